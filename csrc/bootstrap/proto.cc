#include "bootstrap/proto.h"

#include <cerrno>
#include <cstring>

namespace fxm::bootstrap {
namespace {

template <typename T>
void put(uint8_t* b, size_t off, T v) { std::memcpy(b + off, &v, sizeof(T)); }
template <typename T>
T get(const uint8_t* b, size_t off) {
  T v;
  std::memcpy(&v, b + off, sizeof(T));
  return v;
}

}  // namespace

void encode_header(const Msg& m, uint8_t out[kMsgHeaderSize]) {
  put<uint32_t>(out, 0, kMsgMagic);
  put<uint16_t>(out, 4, static_cast<uint16_t>(m.type));
  put<uint16_t>(out, 6, static_cast<uint16_t>(m.code));
  put<int32_t>(out, 8, m.rank);
  put<uint32_t>(out, 12, m.seq);
  put<uint64_t>(out, 16, m.payload.size());
}

bool decode_header(const uint8_t in[kMsgHeaderSize], Msg* m, uint64_t* len) {
  if (get<uint32_t>(in, 0) != kMsgMagic) return false;
  uint16_t type = get<uint16_t>(in, 4);
  if (type < 1 || type > kMaxMsgType) return false;
  m->type = static_cast<MsgType>(type);
  m->code = static_cast<Code>(get<uint16_t>(in, 6));
  m->rank = get<int32_t>(in, 8);
  m->seq = get<uint32_t>(in, 12);
  *len = get<uint64_t>(in, 16);
  return *len <= kMaxPayload;
}

void append_msg(const Msg& m, std::vector<uint8_t>* out) {
  size_t at = out->size();
  out->resize(at + kMsgHeaderSize + m.payload.size());
  encode_header(m, out->data() + at);
  if (!m.payload.empty()) std::memcpy(out->data() + at + kMsgHeaderSize, m.payload.data(), m.payload.size());
}

tcp::IoResult send_msg(int fd, const Msg& m, const Deadline& deadline) {
  std::vector<uint8_t> buf;
  append_msg(m, &buf);
  return tcp::write_full(fd, buf.data(), buf.size(), deadline);
}

tcp::IoResult recv_msg(int fd, Msg* m, const Deadline& deadline) {
  uint8_t hdr[kMsgHeaderSize];
  tcp::IoResult r = tcp::read_full(fd, hdr, sizeof(hdr), deadline);
  if (!r.ok()) return r;
  uint64_t len = 0;
  if (!decode_header(hdr, m, &len)) {
    r.kind = tcp::IoResult::kError;
    r.err = EPROTO;
    return r;
  }
  m->payload.resize(len);
  if (len == 0) return r;
  return tcp::read_full(fd, m->payload.data(), len, deadline);
}

namespace {

bool is_registration(CallKind k) {
  return k >= CallKind::kRegisterWindow && k <= CallKind::kRefusedRegistration;
}

}  // namespace

std::string call_name(const Call& c) {
  static const char* const names[] = {"",
                                      "allgather()",
                                      "barrier()",
                                      "the build's address exchange",
                                      "the build's final barrier",
                                      "register_window()",
                                      "alloc_window()",
                                      "signal_window()",
                                      "register_window() of device memory",
                                      "alloc_window(device=)",
                                      "a registration it could not make",
                                      "the end of a registration",
                                      "deregister()"};
  std::string s = names[static_cast<uint16_t>(c.kind)];
  bool windowed = is_registration(c.kind) || c.kind == CallKind::kRegistrationDone || c.kind == CallKind::kDeregister;
  return windowed ? s + " (window #" + std::to_string(c.index) + ")" : s;
}

bool calls_match(const Call& a, const Call& b) {
  if (a.kind == CallKind::kRefusedRegistration || b.kind == CallKind::kRefusedRegistration) {
    return is_registration(a.kind) && is_registration(b.kind) && a.index == b.index;
  }
  return a.kind == b.kind && a.index == b.index;
}

void encode_call(const Call& c, uint8_t out[kCallSize]) {
  put<uint16_t>(out, 0, static_cast<uint16_t>(c.kind));
  put<uint16_t>(out, 2, 0);
  put<uint32_t>(out, 4, c.index);
}

bool decode_call(const uint8_t in[kCallSize], Call* c) {
  uint16_t kind = get<uint16_t>(in, 0);
  if (kind < 1 || kind > kMaxCallKind) return false;
  c->kind = static_cast<CallKind>(kind);
  c->index = get<uint32_t>(in, 4);
  return true;
}

std::vector<uint8_t> encode_hello(const HelloInfo& h) {
  std::vector<uint8_t> p(kHelloPayload, 0);
  std::memcpy(p.data(), h.mesh_id.data(), 16);
  put<uint32_t>(p.data(), 16, h.epoch);
  put<uint16_t>(p.data(), 20, h.version);
  std::memcpy(p.data() + 24, h.nonce.data(), h.nonce.size());
  return p;
}

bool decode_hello(const std::vector<uint8_t>& p, HelloInfo* h) {
  if (p.size() != kHelloPayload) return false;
  std::memcpy(h->mesh_id.data(), p.data(), 16);
  h->epoch = get<uint32_t>(p.data(), 16);
  h->version = get<uint16_t>(p.data(), 20);
  std::memcpy(h->nonce.data(), p.data() + 24, h->nonce.size());
  return true;
}

std::vector<uint8_t> encode_challenge(const ChallengeInfo& c) {
  std::vector<uint8_t> p(kChallengePayload);
  std::memcpy(p.data(), c.nonce.data(), 32);
  std::memcpy(p.data() + 32, c.mac.data(), 32);
  return p;
}

bool decode_challenge(const std::vector<uint8_t>& p, ChallengeInfo* c) {
  if (p.size() != kChallengePayload) return false;
  std::memcpy(c->nonce.data(), p.data(), 32);
  std::memcpy(c->mac.data(), p.data() + 32, 32);
  return true;
}

std::vector<uint8_t> encode_join(const JoinInfo& j) {
  std::vector<uint8_t> p(kJoinPayload);
  std::memcpy(p.data(), j.mac.data(), 32);
  put<uint32_t>(p.data(), 32, j.nranks);
  put<uint32_t>(p.data(), 36, j.timeout_ms);
  return p;
}

bool decode_join(const std::vector<uint8_t>& p, JoinInfo* j) {
  if (p.size() != kJoinPayload) return false;
  std::memcpy(j->mac.data(), p.data(), 32);
  j->nranks = get<uint32_t>(p.data(), 32);
  j->timeout_ms = get<uint32_t>(p.data(), 36);
  return true;
}

namespace {

crypto::Hmac transcript(const crypto::Key& key, const char* label, const Msg& hello, const Nonce& root_nonce) {
  std::vector<uint8_t> bytes;
  append_msg(hello, &bytes);
  crypto::Hmac mac(key.data(), key.size());
  mac.update(label, std::strlen(label) + 1).update(bytes).update(root_nonce.data(), root_nonce.size());
  return mac;
}

}  // namespace

wire::Mac root_proof(const crypto::Key& key, const Msg& hello, const Nonce& root_nonce) {
  return transcript(key, "flagcx_mesh root proof", hello, root_nonce).finish();
}

wire::Mac join_proof(const crypto::Key& key, const Msg& hello, const Nonce& root_nonce,
                     uint32_t nranks, uint32_t timeout_ms) {
  uint8_t tail[8];
  put<uint32_t>(tail, 0, nranks);
  put<uint32_t>(tail, 4, timeout_ms);
  return transcript(key, "flagcx_mesh join proof", hello, root_nonce).update(tail, sizeof(tail)).finish();
}

std::vector<uint8_t> encode_result(const std::vector<std::vector<uint8_t>>& parts) {
  size_t total = parts.size() * 8;
  for (const auto& part : parts) total += part.size();
  std::vector<uint8_t> p(total);
  size_t off = parts.size() * 8;
  for (size_t i = 0; i < parts.size(); ++i) {
    put<uint64_t>(p.data(), i * 8, parts[i].size());
    if (!parts[i].empty()) std::memcpy(p.data() + off, parts[i].data(), parts[i].size());
    off += parts[i].size();
  }
  return p;
}

bool decode_result(const std::vector<uint8_t>& p, size_t nranks,
                   std::vector<std::vector<uint8_t>>* parts) {
  if (p.size() < nranks * 8) return false;
  size_t off = nranks * 8;
  parts->assign(nranks, {});
  for (size_t i = 0; i < nranks; ++i) {
    uint64_t len = get<uint64_t>(p.data(), i * 8);
    if (len > p.size() - off) return false;
    (*parts)[i].assign(p.begin() + off, p.begin() + off + len);
    off += len;
  }
  return off == p.size();
}

}  // namespace fxm::bootstrap
