// The wire format: one versioned connection header that opens every mesh
// connection (and its answer), and the frame header of messages on it.
// All integers are little-endian; the layout is fixed and checked by tests.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

#include "base/hmac.h"

namespace fxm::wire {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "wire format assumes little-endian hosts");

constexpr uint32_t kConnMagic = 0x484d5846;   // "FXMH"
constexpr uint32_t kFrameMagic = 0x464d5846;  // "FXMF"
// 2: the header is followed by the key proof handshake; 3: lazy acks (kPutLazyAck, kAckReq);
// 4: the agents' identity block carries their tcp lanes (agent/handshake.h); 5: kPutBlocks, kGetBlocks;
// 6: kPutBlocks into host windows (an agent call's small tcp writes, transport/tcp/block_batch.h);
// 7: a mesh connection's acceptor confirms the connector's proof (kConfirmByte);
// 8: a kPutBlocks frame (host or staged writes) striped over the tcp lanes (kBlocksStriped, kStripeOfBlocks)
constexpr uint16_t kVersion = 8;
constexpr size_t kConnHeaderSize = 64;
constexpr size_t kFrameHeaderSize = 16;

using MeshId = std::array<uint8_t, 16>;

// kAgent*: a connection between two agents (csrc/agent), which names no mesh
// or rank: mesh_id carries the sender's incarnation, ext_len the length of the
// identity block (agent name, expected peer incarnation) after the hello or
// the answer, which both MACs cover.
enum class Role : uint16_t { kConnect = 1, kAccept = 2, kAgentConnect = 3, kAgentAccept = 4 };
inline bool is_accept_role(Role r) { return r == Role::kAccept || r == Role::kAgentAccept; }

// Offsets: magic 0, version 4, role 6, mesh_id 8, epoch 24, src 28, dst 32,
// context 36, nranks 40, ncontexts 44, ext_len 48, reserved 52..59, checksum 60.
struct ConnHeader {
  uint32_t magic = kConnMagic;
  uint16_t version = kVersion;
  Role role = Role::kConnect;
  MeshId mesh_id{};
  uint32_t epoch = 0;
  int32_t src = -1;
  int32_t dst = -1;
  uint32_t context = 0;
  uint32_t nranks = 0;
  uint32_t ncontexts = 0;
  uint32_t ext_len = 0;  // agent roles: bytes of the identity block that follows; mesh roles: 0
};

// Why an incoming header was refused. kNone means accepted.
enum class Reject : int {
  kNone = 0,
  kSilent,        // no header before the header deadline
  kTruncated,     // the peer closed before a whole header arrived
  kBadMagic,      // not ours at all (port scan, HTTP, random bytes)
  kBadVersion,
  kBadChecksum,
  kBadRole,
  kForeignMesh,   // another mesh's id
  kWrongEpoch,
  kWrongDst,      // meant for another rank
  kBadSrc,        // source rank out of range
  kBadContext,
  kBadShape,      // nranks / ncontexts differ from ours
  kDuplicate,     // that (src, context) slot is already filled
  kOverflow,      // too many unidentified connections at once
  kBadAuth,       // its proof of the mesh key was wrong (a stranger, a replay, another epoch's key)
  kPolicy,        // agents: the acceptor's policy refused that peer
  kStaleIncarnation,  // agents: it names an incarnation that is not the current one
  kUnknownLane,       // agents: a tcp lane that no admitted connection of that peer awaits
  kNameInUse,         // agents: its name is another incarnation's, which is alive (it answered a ping)
  kCount
};
const char* reject_name(Reject r);

void encode(const ConnHeader& h, uint8_t out[kConnHeaderSize]);
// Decodes and checks magic, version and checksum only.
Reject decode(const uint8_t in[kConnHeaderSize], ConnHeader* out);

// What a receiver expects of a header.
struct Expect {
  MeshId mesh_id{};
  uint32_t epoch = 0;
  int32_t me = 0;
  uint32_t nranks = 0;
  uint32_t ncontexts = 0;
  Role role = Role::kConnect;
};
// Full identity check of a decoded header against expectations.
Reject validate(const ConnHeader& h, const Expect& e);

// Proof of the key. After the header, each side proves that it holds the
// mesh's epoch key (derive_key) with an HMAC-SHA256 over both sides' fresh
// nonces and both headers, so a recorded handshake is worth nothing later:
//   connector -> acceptor  hello:  header + connector nonce     (96 bytes)
//   acceptor -> connector  answer: header + acceptor nonce + acceptor MAC (128)
//   connector -> acceptor  proof:  connector MAC                (32)
//   acceptor -> connector  confirm: kConfirmByte (mesh builds: the connection is filed)
// The MACs carry different labels, so neither side's answer can be reflected
// as the other's proof. A mesh's connector counts its connection only on the
// confirm: an acceptor that closed it instead (a proof past its header timeout)
// is connected to again.
constexpr size_t kNonceSize = 32;
constexpr size_t kMacSize = crypto::kDigestSize;
constexpr size_t kHelloSize = kConnHeaderSize + kNonceSize;
constexpr size_t kAnswerSize = kHelloSize + kMacSize;
constexpr size_t kProofSize = kMacSize;
constexpr uint8_t kConfirmByte = 0xC7;
using Mac = crypto::Digest;

// The key a mesh of `epoch` uses on the wire: HMAC(secret, label | mesh id |
// epoch). The secret (in the unique id) itself never travels; another epoch
// means another key, so a rank of an earlier epoch cannot prove itself.
crypto::Key derive_key(const crypto::Key& secret, const MeshId& mesh_id, uint32_t epoch);
// The MAC `prover` sends: over the hello (header + connector nonce) and the
// first kHelloSize bytes of the answer (header + acceptor nonce).
// `bound` (agents: both identity blocks) is covered too; the mesh binds none.
Mac handshake_mac(const crypto::Key& key, Role prover, const uint8_t hello[kHelloSize],
                  const uint8_t answer_head[kHelloSize], const uint8_t* bound = nullptr,
                  size_t bound_len = 0);
// The key agents prove: derive_key over the SHA-256 of the shared secret, in
// the agents' own domain (no mesh id, epoch 0), so a mesh's key never opens an
// agent connection nor the reverse.
crypto::Key agent_key(const std::string& secret);

// Frames on an established connection: {magic, type, flags, length}.
enum class FrameType : uint16_t {
  kWireCheck = 1,  // build-time identity proof
  kMessage = 2,    // two-sided message
  kPut = 3,        // PutHeader + data; the target lands it, then applies the signal
  kGetReq = 4,     // GetHeader; the target answers with kGetResp
  kGetResp = 5,    // u64 request id + data
  kAck = 6,        // u64: one-sided ops from the receiver applied so far on this pair
  kBye = 7,        // the sender closes cleanly
  kRefused = 8,    // u64 number of the refused op on this pair (as acks count) + the reason (text)
  kAdmit = 9,      // agents: the acceptor's verdict after the proofs ("" admitted, else why not)
  kStripe = 10,    // PutHeader + data on a lane > 0: one part of a striped put (sig_slot: its number)
  kAckReq = 11,    // no body: ack now every op from it applied so far (lazy ones too), even none new (a ping)
  kPutBlocks = 12, // BlocksHeader + count BlockEntry + the blocks' bytes in list order: one op (one ack);
                   // into device windows (staged) or host windows (tcp), every block of one kind
  kGetBlocks = 13, // GetBlocksHeader + count BlockEntry: one get, answered by one kGetResp (list order)
};
constexpr uint64_t kMaxRefusedText = 1024;
// Set in a kRefused number: it refuses get request (number & ~kRefusedGet),
// which no answer follows (the refusal completes that get, failed).
constexpr uint64_t kRefusedGet = 1ull << 63;

// After a kPut frame header (40 bytes).
struct PutHeader {
  uint32_t dst_win = 0;
  uint32_t sig_win = 0;
  uint64_t dst_off = 0;
  uint64_t sig_slot = 0;
  uint64_t sig_val = 0;
  uint32_t flags = 0;  // kPutHasSignal | kPutSignalSet
  uint32_t pad = 0;
};
constexpr uint32_t kPutHasSignal = 1;
constexpr uint32_t kPutSignalSet = 2;
// A striped put's part on lane 0 (pad: how many kStripe parts on the other lanes). The target
// applies it (signal, ack) only once every part landed, and acts on nothing after it on lane 0
// before, but the head of a striped put of the same layout (core/progress_admit.cc).
constexpr uint32_t kPutStriped = 4;
// The initiator needs no ack of its own for this put (a put_signal: its target learns of it
// through the signal): the target acks it with the next ack it sends, when a kAckReq asks,
// or at the latest about a millisecond after applying it (Engine::kLazyAckNs).
constexpr uint32_t kPutLazyAck = 8;
// A kStripe that carries part of a striped kPutBlocks frame's bytes (see kBlocksStriped): dst_off
// is where its bytes start in the concatenation of the frame's blocks (dst_win 0, unused).
constexpr uint32_t kStripeOfBlocks = 16;

// After a kGetReq frame header (32 bytes).
struct GetHeader {
  uint32_t src_win = 0;
  uint32_t pad = 0;
  uint64_t src_off = 0;
  uint64_t size = 0;
  uint64_t req_id = 0;
};
// After a kPutBlocks frame header (16 bytes): a batch of staged writes (or of tcp writes into host windows) as one op. The frame's
// length is 16 + 24 * count + bytes; `bytes` is the sum of the entries' lengths. The target
// checks every entry against its registered window before any byte lands, lands them all (or
// none is applied) and acknowledges the frame once (core/progress_blocks.cc).
struct BlocksHeader {
  uint32_t count = 0;
  uint32_t flags = 0;  // 0, or kBlocksStriped | (parts on other lanes) << 8
  uint64_t bytes = 0;
};
// A batch of writes (into host windows, or staged into device windows) of at least
// Engine::kStripeMinBytes, over N > 1 tcp lanes:
// the frame on lane 0 carries the whole list and the first `bytes - (N - 1) * (bytes / N)` bytes
// of the blocks' concatenation; lane k >= 1 carries the next `bytes / N` as one kStripe
// (kStripeOfBlocks), numbered as striped puts' stripes are. The target checks the whole list
// on lane 0 before it admits the stripes, lands every part through the list, and acknowledges
// (or refuses) the frame once, after every part landed (core/progress_admit.cc).
constexpr uint32_t kBlocksStriped = 1;
// The split of a striped op's `bytes` over `lanes`: each lane k >= 1 carries stripe_part() bytes,
// lane 0 the rest (stripe_first(), the remainder included), as for striped puts.
inline uint64_t stripe_part(uint64_t bytes, int lanes) { return bytes / static_cast<uint64_t>(lanes); }
inline uint64_t stripe_first(uint64_t bytes, int lanes) {
  return bytes - stripe_part(bytes, lanes) * static_cast<uint64_t>(lanes - 1);
}
struct BlockEntry {
  uint32_t win = 0;
  uint32_t pad = 0;
  uint64_t off = 0;
  uint64_t len = 0;
};
constexpr uint32_t kMaxBlocksPerFrame = 65536;  // a larger batch is several frames
// After a kGetBlocks frame header (24 bytes): a batch of staged reads as one get. The frame's
// length is 24 + 24 * count; the answer (kGetResp, req_id) carries the blocks' bytes in list
// order, or a kRefused (kRefusedGet | req_id) names the first bad block.
struct GetBlocksHeader {
  uint32_t count = 0;
  uint32_t pad = 0;
  uint64_t bytes = 0;
  uint64_t req_id = 0;
};
static_assert(sizeof(PutHeader) == 40 && sizeof(GetHeader) == 32, "fixed op header sizes");
static_assert(sizeof(BlocksHeader) == 16 && sizeof(BlockEntry) == 24 && sizeof(GetBlocksHeader) == 24,
              "fixed block list sizes");
struct FrameHeader {
  FrameType type = FrameType::kMessage;
  uint16_t flags = 0;
  uint64_t length = 0;
};
void encode_frame(const FrameHeader& f, uint8_t out[kFrameHeaderSize]);
bool decode_frame(const uint8_t in[kFrameHeaderSize], FrameHeader* out);

std::string mesh_id_hex(const MeshId& id);

}  // namespace fxm::wire
