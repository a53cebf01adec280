#include "agent/handshake.h"

#include <poll.h>

#include <cstring>

#include "base/env.h"
#include "base/status.h"

namespace fxm::agent::hs {

using wire::kConnHeaderSize;
using wire::kHelloSize;

namespace {

// The optional UCX block after the identity's fixed part (at `base`): a 2-byte length and that many bytes.
bool decode_ucx_worker(const std::vector<uint8_t>& b, size_t base, std::string* out) {
  if (b.size() < base + 2) return false;
  size_t n = b[base] | static_cast<size_t>(b[base + 1]) << 8;
  if (n == 0 || n > kMaxUcxWorker || b.size() != base + 2 + n) return false;
  out->assign(b.begin() + static_cast<long>(base + 2), b.end());
  return true;
}

}  // namespace

std::vector<uint8_t> encode_ident(const Ident& id) {
  std::vector<uint8_t> b;
  b.push_back(static_cast<uint8_t>(id.name.size()));
  b.insert(b.end(), id.name.begin(), id.name.end());
  b.insert(b.end(), id.expect.begin(), id.expect.end());
  b.push_back(id.lanes);
  b.push_back(id.lane);
  uint8_t token[sizeof(id.token)];
  std::memcpy(token, &id.token, sizeof(token));
  b.insert(b.end(), token, token + sizeof(token));
  if (!id.ucx_worker.empty() && id.ucx_worker.size() <= kMaxUcxWorker) {
    size_t n = id.ucx_worker.size();
    b.push_back(static_cast<uint8_t>(n & 0xff));
    b.push_back(static_cast<uint8_t>(n >> 8));
    b.insert(b.end(), id.ucx_worker.begin(), id.ucx_worker.end());
  }
  return b;
}

bool decode_ident(const std::vector<uint8_t>& b, Ident* out) {
  constexpr size_t kTail = 2 + sizeof(out->token);  // lanes, lane, token
  if (b.empty() || b[0] == 0) return false;
  size_t base = 1u + b[0] + out->expect.size() + kTail;
  if (b.size() != base && !decode_ucx_worker(b, base, &out->ucx_worker)) return false;
  out->name.assign(b.begin() + 1, b.begin() + 1 + b[0]);
  const uint8_t* p = b.data() + 1 + b[0];
  std::memcpy(out->expect.data(), p, out->expect.size());
  p += out->expect.size();
  out->lanes = p[0];
  out->lane = p[1];
  std::memcpy(&out->token, p + 2, sizeof(out->token));
  return out->lanes >= 1 && out->lanes <= kMaxTcpLanes && out->lane < out->lanes;
}

wire::ConnHeader header(wire::Role role, const Incarnation& mine, uint32_t ext_len) {
  wire::ConnHeader h;
  h.role = role;
  h.mesh_id = mine;
  h.ncontexts = 1;
  h.ext_len = ext_len;
  return h;
}

wire::Reject check_header(const uint8_t raw[kConnHeaderSize], wire::Role want, wire::ConnHeader* h) {
  wire::Reject why = wire::decode(raw, h);
  if (why != wire::Reject::kNone) return why;
  if (h->role != want) return wire::Reject::kBadRole;
  if (h->epoch != 0 || h->src != -1 || h->dst != -1 || h->nranks != 0 || h->ncontexts != 1 ||
      h->ext_len < 2 || h->ext_len > kMaxIdent) {
    return wire::Reject::kBadShape;
  }
  return wire::Reject::kNone;
}

wire::Mac mac(const crypto::Key& key, wire::Role prover, const uint8_t hello[kHelloSize],
              const uint8_t answer[kHelloSize], const std::vector<uint8_t>& hello_ident,
              const std::vector<uint8_t>& answer_ident) {
  std::vector<uint8_t> bound(hello_ident);
  bound.insert(bound.end(), answer_ident.begin(), answer_ident.end());
  return wire::handshake_mac(key, prover, hello, answer, bound.data(), bound.size());
}

std::vector<uint8_t> verdict_frame(const std::string& why) {
  std::string text = why.substr(0, kMaxVerdict);
  std::vector<uint8_t> b(wire::kFrameHeaderSize);
  wire::encode_frame({wire::FrameType::kAdmit, 0, text.size()}, b.data());
  b.insert(b.end(), text.begin(), text.end());
  return b;
}

namespace {

[[noreturn]] void fail_dial(Code code, const std::string& who, const tcp::SockAddr& to, const std::string& cause) {
  fail(code, -1, 0, who + "connect to " + to.str() + ": " + cause);
}

void io(const tcp::IoResult& r, const std::string& who, const tcp::SockAddr& to, const char* doing) {
  if (r.ok()) return;
  Code c = r.kind == tcp::IoResult::kTimeout ? Code::kTimeout : Code::kPeerLost;
  fail_dial(c, who, to, std::string(doing) + ": " + r.describe() +
                            (r.kind == tcp::IoResult::kClosed ? " (a wrong secret, or refused at its listener)" : ""));
}

tcp::Fd start_socket(const tcp::SockAddr& to, const std::string& who) {
  int err = 0;
  tcp::Fd fd = tcp::connect_start(to, &err);
  if (!fd) fail_dial(Code::kPeerLost, who, to, errno_text(err));
  return fd;
}

void await_connect(int fd, const tcp::SockAddr& to, const Deadline& deadline, const std::string& who) {
  pollfd p{fd, POLLOUT, 0};
  int rc = ::poll(&p, 1, deadline.poll_ms());
  if (rc == 0) fail_dial(Code::kTimeout, who, to, "the TCP connect did not complete before the deadline");
  int err = rc < 0 ? errno : tcp::connect_error(fd);
  if (err != 0) fail_dial(Code::kPeerLost, who, to, errno_text(err) + " (is the agent there?)");
}

}  // namespace

namespace {

// Reads the answer and its identity block, checks its header, its MAC and
// (when `me` expects one) its incarnation; returns the acceptor's identity.
PeerInfo read_answer(int fd, const uint8_t hello[kHelloSize], const std::vector<uint8_t>& my_ident, const Ident& me,
                     const crypto::Key& key, const tcp::SockAddr& to, const Deadline& deadline, const std::string& who,
                     uint8_t answer[wire::kAnswerSize], std::vector<uint8_t>* peer_ident, int* lanes) {
  io(tcp::read_full(fd, answer, wire::kAnswerSize, deadline), who, to, "reading the answer");
  wire::ConnHeader h;
  wire::Reject why = check_header(answer, wire::Role::kAgentAccept, &h);
  if (why != wire::Reject::kNone) {
    fail_dial(Code::kProtocol, who, to, std::string("the answer is not an agent's (") + wire::reject_name(why) + ")");
  }
  peer_ident->resize(h.ext_len);
  io(tcp::read_full(fd, peer_ident->data(), peer_ident->size(), deadline), who, to, "reading the answer");
  Ident theirs;
  if (!decode_ident(*peer_ident, &theirs)) fail_dial(Code::kProtocol, who, to, "a malformed identity in the answer");
  wire::Mac want = mac(key, wire::Role::kAgentAccept, hello, answer, my_ident, *peer_ident);
  if (!crypto::equal_ct(want.data(), answer + kHelloSize, want.size())) {
    fail_dial(Code::kProtocol, who, to, "the agent there does not prove the secret (another secret, or not an agent)");
  }
  static const Incarnation kAny{};
  if (me.expect != kAny && h.mesh_id != me.expect) {
    // In full: two incarnations may share the 12 digits that name one elsewhere. The metadata's
    // checksum passed (Metadata::decode), so this is a restart, not damaged bytes.
    fail_dial(Code::kInvalidArgument, who, to, "agent " + theirs.name + " there is incarnation " +
                                                   wire::mesh_id_hex(h.mesh_id) + ", not the " +
                                                   wire::mesh_id_hex(me.expect) +
                                                   " the metadata names: that agent restarted since the metadata was"
                                                   " made");
  }
  if (theirs.lane != me.lane || theirs.token != me.token || (me.lane > 0 && theirs.lanes != me.lanes)) {
    fail_dial(Code::kProtocol, who, to, "the answer names another lane, lane count or connection than this one");
  }
  *lanes = theirs.lanes;
  return {theirs.name, h.mesh_id, to.str(), theirs.ucx_worker};
}

// The acceptor's verdict: "" admitted, else its reason (thrown).
void read_verdict(int fd, const PeerInfo& peer, const tcp::SockAddr& to, const Deadline& deadline,
                  const std::string& who) {
  uint8_t fh[wire::kFrameHeaderSize];
  io(tcp::read_full(fd, fh, sizeof(fh), deadline), who, to, "waiting for admission");
  wire::FrameHeader f;
  if (!wire::decode_frame(fh, &f) || f.type != wire::FrameType::kAdmit || f.length > kMaxVerdict) {
    fail_dial(Code::kProtocol, who, to, "a malformed admission answer");
  }
  std::string reason(f.length, '\0');
  io(tcp::read_full(fd, reason.data(), reason.size(), deadline), who, to, "waiting for admission");
  if (!reason.empty()) fail_dial(Code::kInvalidArgument, who, to, "agent " + peer.name + " refused this agent: " + reason);
}

}  // namespace

namespace {

// One socket's connector side, step by step: dial_steps() runs each step on
// every socket before the next, so the lanes' round trips overlap.
struct DialState {
  Ident me;
  std::string who;
  std::vector<uint8_t> my_ident, peer_ident;
  uint8_t hello[kHelloSize];
  uint8_t answer[wire::kAnswerSize];
  Dialed out;
};

void send_hello(DialState& s, const Incarnation& mine, const tcp::SockAddr& to, const Deadline& deadline) {
  s.my_ident = encode_ident(s.me);
  wire::encode(header(wire::Role::kAgentConnect, mine, static_cast<uint32_t>(s.my_ident.size())), s.hello);
  crypto::random_bytes(s.hello + kConnHeaderSize, wire::kNonceSize);
  std::vector<uint8_t> first(s.hello, s.hello + kHelloSize);
  first.insert(first.end(), s.my_ident.begin(), s.my_ident.end());
  io(tcp::write_full(s.out.fd.get(), first.data(), first.size(), deadline), s.who, to, "sending the hello");
}

void answer_and_prove(DialState& s, const crypto::Key& key, const tcp::SockAddr& to, const Deadline& deadline) {
  s.out.peer = read_answer(s.out.fd.get(), s.hello, s.my_ident, s.me, key, to, deadline, s.who, s.answer,
                           &s.peer_ident, &s.out.lanes);
  wire::Mac proof = mac(key, wire::Role::kAgentConnect, s.hello, s.answer, s.my_ident, s.peer_ident);
  io(tcp::write_full(s.out.fd.get(), proof.data(), proof.size(), deadline), s.who, to, "sending the proof");
}

std::vector<Dialed> dial_steps(std::vector<DialState>& all, const tcp::SockAddr& to, const Incarnation& mine,
                               const crypto::Key& key, const Deadline& deadline) {
  for (DialState& s : all) s.out.fd = start_socket(to, s.who);
  for (DialState& s : all) await_connect(s.out.fd.get(), to, deadline, s.who);
  for (DialState& s : all) send_hello(s, mine, to, deadline);
  for (DialState& s : all) answer_and_prove(s, key, to, deadline);
  for (DialState& s : all) read_verdict(s.out.fd.get(), s.out.peer, to, deadline, s.who);
  std::vector<Dialed> out;
  for (DialState& s : all) out.push_back(std::move(s.out));
  return out;
}

}  // namespace

Dialed dial(const tcp::SockAddr& to, const Ident& me, const Incarnation& mine, const crypto::Key& key,
            const Deadline& deadline, const std::string& who) {
  std::vector<DialState> one(1);
  one[0].me = me;
  one[0].who = who;
  return std::move(dial_steps(one, to, mine, key, deadline)[0]);
}

std::vector<Dialed> dial_lanes(const tcp::SockAddr& to, const Ident& me, const Incarnation& mine,
                               const crypto::Key& key, const Deadline& deadline, const std::string& who) {
  std::vector<DialState> lanes(me.lanes > 1 ? me.lanes - 1 : 0);
  for (size_t k = 0; k < lanes.size(); ++k) {
    lanes[k].me = me;
    lanes[k].me.lane = static_cast<uint8_t>(k + 1);
    lanes[k].who = who + "tcp lane " + std::to_string(k + 1) + ": ";
  }
  return dial_steps(lanes, to, mine, key, deadline);
}

}  // namespace fxm::agent::hs
