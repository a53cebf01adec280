// Messages between ranks and the rendezvous root: a 24-byte header
// {magic "FXMB", type, code, rank, seq, length} and a payload.
// Point-to-point relay: kSend carries the destination in `rank` and the tag in
// `seq`; the root forwards it as kDeliver with the source in `rank`.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "base/clock.h"
#include "base/status.h"
#include "base/wire.h"
#include "transport/tcp/socket.h"

namespace fxm::bootstrap {

constexpr uint32_t kMsgMagic = 0x424d5846;  // "FXMB"
constexpr uint16_t kProtoVersion = 4;  // 2: joins prove the key (kHello, kChallenge); 3: kAdmitted;
                                       // 4: a contribution carries its call (Call)
constexpr size_t kMsgHeaderSize = 24;
constexpr uint64_t kMaxPayload = 64ull << 20;
// Relayed point-to-point messages are for small control data (readiness
// tokens): the root forwards them with blocking writes from its one thread.
constexpr uint64_t kMaxRelayPayload = 64ull << 10;
// The most one rank may contribute to an allgather of nranks: the result
// (nranks u64 lengths + the contributions) must fit kMaxPayload.
constexpr uint64_t max_allgather_part(uint64_t nranks) {
  return nranks == 0 || kMaxPayload / nranks < 8 ? 0 : kMaxPayload / nranks - 8;
}
// Relayed bytes a rank may hold unreceived before recv() takes them.
constexpr uint64_t kMaxInboxBytes = 64ull << 20;

enum class MsgType : uint16_t {
  kJoin = 1,       // rank -> root: its key proof, nranks, timeout (after kHello / kChallenge)
  kAllgather = 2,  // rank -> root: this rank's contribution for `seq`; with code
                   // kInvalidArgument, the rank's refusal (payload: why)
  kResult = 3,     // root -> rank: all contributions for `seq`
  kAbortReq = 4,   // rank -> root: this rank failed; tell the others
  kAbort = 5,      // root -> rank: rank `rank` failed or was lost
  kError = 6,      // root -> rank: the rendezvous itself failed; with code
                   // kInvalidArgument and `seq`, collective `seq` was refused
                   // (too large) and the next one is seq + 1
  kBye = 7,        // rank -> root: clean close
  kSend = 8,       // rank -> root: relay payload to rank `rank` under tag `seq`
  kDeliver = 9,    // root -> rank: a relayed payload from rank `rank`, tag `seq`
  kHello = 10,     // rank -> root, first: mesh id, epoch, version, the rank's nonce
  kChallenge = 11, // root -> rank: the root's nonce and its key proof
  kAdmitted = 12,  // root -> rank: the join was checked and filed (a rank not told retries)
};
constexpr uint16_t kMaxMsgType = 12;

// What a collective is, as the rank called it: every kAllgather payload starts
// with it (kCallSize bytes: kind u16, pad u16, index u32; the root strips it),
// and the root fails every rank, naming both calls, when two ranks' calls of
// one collective differ (a barrier against a window registration, or two
// kinds of registration).
enum class CallKind : uint16_t {
  kAllgather = 1,
  kBarrier = 2,
  kBuildAddresses = 3,   // the build's address exchange
  kBuildBarrier = 4,     // the build's final barrier
  kRegisterWindow = 5,   // index: the window's
  kAllocWindow = 6,
  kSignalWindow = 7,
  kRegisterDeviceWindow = 8,
  kAllocDeviceWindow = 9,
  kRefusedRegistration = 10,  // a rank that cannot register: matches any registration of that index
  kRegistrationDone = 11,     // a registration's second step (every peer mapped the window)
  kDeregister = 12,
};
constexpr uint16_t kMaxCallKind = 12;
constexpr size_t kCallSize = 8;

struct Call {
  CallKind kind = CallKind::kAllgather;
  uint32_t index = 0;  // the window, for registrations and deregister
};
std::string call_name(const Call& c);  // "signal_window() (window #2)"
bool calls_match(const Call& a, const Call& b);
void encode_call(const Call& c, uint8_t out[kCallSize]);
bool decode_call(const uint8_t in[kCallSize], Call* c);

struct Msg {
  MsgType type = MsgType::kBye;
  Code code = Code::kOk;
  int32_t rank = -1;
  uint32_t seq = 0;
  std::vector<uint8_t> payload;
  std::string text() const { return std::string(payload.begin(), payload.end()); }
};

void encode_header(const Msg& m, uint8_t out[kMsgHeaderSize]);
// false when the magic is wrong or the length is implausible.
bool decode_header(const uint8_t in[kMsgHeaderSize], Msg* m, uint64_t* len);

// Appends header and payload to `out` (for queued, non-blocking writers).
void append_msg(const Msg& m, std::vector<uint8_t>* out);
tcp::IoResult send_msg(int fd, const Msg& m, const Deadline& deadline);
// Reads one whole message; kOk with a valid header, else what went wrong
// (a bad header is reported as kError with err == EPROTO).
tcp::IoResult recv_msg(int fd, Msg* m, const Deadline& deadline);

// The join handshake (docs/security.md). Both sides prove they hold the
// mesh's epoch key with an HMAC over the hello (which carries the rank's
// nonce) and the root's nonce; neither the key nor the unique id's secret
// travels.
//   rank -> root  kHello     {mesh id 16, epoch u32, version u16, pad u16, nonce 32}
//   root -> rank  kChallenge {root nonce 32, root MAC 32}
//   rank -> root  kJoin      {rank MAC 32, nranks u32, timeout_ms u32}
using Nonce = std::array<uint8_t, wire::kNonceSize>;
constexpr size_t kHelloPayload = 56;
constexpr size_t kChallengePayload = 64;
constexpr size_t kJoinPayload = 40;

struct HelloInfo {
  std::array<uint8_t, 16> mesh_id{};
  uint32_t epoch = 0;
  uint16_t version = kProtoVersion;
  Nonce nonce{};
};
std::vector<uint8_t> encode_hello(const HelloInfo& h);
bool decode_hello(const std::vector<uint8_t>& p, HelloInfo* h);

struct ChallengeInfo {
  Nonce nonce{};
  wire::Mac mac{};
};
std::vector<uint8_t> encode_challenge(const ChallengeInfo& c);
bool decode_challenge(const std::vector<uint8_t>& p, ChallengeInfo* c);

struct JoinInfo {
  wire::Mac mac{};
  uint32_t nranks = 0;
  uint32_t timeout_ms = 0;
};
std::vector<uint8_t> encode_join(const JoinInfo& j);
bool decode_join(const std::vector<uint8_t>& p, JoinInfo* j);

// What the root proves (over the hello message as sent, rank included, and
// its nonce) and what the rank proves (the same, and its nranks and timeout).
wire::Mac root_proof(const crypto::Key& key, const Msg& hello, const Nonce& root_nonce);
wire::Mac join_proof(const crypto::Key& key, const Msg& hello, const Nonce& root_nonce,
                     uint32_t nranks, uint32_t timeout_ms);

// Result payload: nranks u64 lengths, then the contributions back to back.
std::vector<uint8_t> encode_result(const std::vector<std::vector<uint8_t>>& parts);
bool decode_result(const std::vector<uint8_t>& p, size_t nranks,
                   std::vector<std::vector<uint8_t>>* parts);

}  // namespace fxm::bootstrap
