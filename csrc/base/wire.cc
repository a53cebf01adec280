#include "base/wire.h"

#include <algorithm>
#include <cstring>

namespace fxm::wire {
namespace {

template <typename T>
void put(uint8_t* base, size_t off, T v) {
  std::memcpy(base + off, &v, sizeof(T));
}
template <typename T>
T get(const uint8_t* base, size_t off) {
  T v;
  std::memcpy(&v, base + off, sizeof(T));
  return v;
}

// FNV-1a over the first 60 bytes.
uint32_t checksum(const uint8_t* p) {
  uint32_t h = 2166136261u;
  for (size_t i = 0; i < kConnHeaderSize - 4; ++i) h = (h ^ p[i]) * 16777619u;
  return h;
}

}  // namespace

const char* reject_name(Reject r) {
  static const char* names[] = {
      "accepted",        "silent (no header before deadline)", "truncated header",
      "bad magic",       "unsupported version",                "bad checksum",
      "bad role",        "foreign mesh id",                    "wrong epoch",
      "wrong destination rank", "source rank out of range",    "context out of range",
      "nranks/contexts mismatch", "duplicate connection",      "too many pending connections",
      "bad authentication", "refused by the agent's policy",
      "stale incarnation", "unknown tcp lane", "name in use by a live agent"};
  static_assert(sizeof(names) / sizeof(names[0]) == static_cast<size_t>(Reject::kCount));
  int i = static_cast<int>(r);
  return (i >= 0 && i < static_cast<int>(Reject::kCount)) ? names[i] : "unknown";
}

void encode(const ConnHeader& h, uint8_t out[kConnHeaderSize]) {
  std::memset(out, 0, kConnHeaderSize);
  put<uint32_t>(out, 0, h.magic);
  put<uint16_t>(out, 4, h.version);
  put<uint16_t>(out, 6, static_cast<uint16_t>(h.role));
  std::memcpy(out + 8, h.mesh_id.data(), 16);
  put<uint32_t>(out, 24, h.epoch);
  put<int32_t>(out, 28, h.src);
  put<int32_t>(out, 32, h.dst);
  put<uint32_t>(out, 36, h.context);
  put<uint32_t>(out, 40, h.nranks);
  put<uint32_t>(out, 44, h.ncontexts);
  put<uint32_t>(out, 48, h.ext_len);
  put<uint32_t>(out, 60, checksum(out));
}

Reject decode(const uint8_t in[kConnHeaderSize], ConnHeader* h) {
  h->magic = get<uint32_t>(in, 0);
  if (h->magic != kConnMagic) return Reject::kBadMagic;
  h->version = get<uint16_t>(in, 4);
  if (h->version != kVersion) return Reject::kBadVersion;
  if (get<uint32_t>(in, 60) != checksum(in)) return Reject::kBadChecksum;
  h->role = static_cast<Role>(get<uint16_t>(in, 6));
  std::memcpy(h->mesh_id.data(), in + 8, 16);
  h->epoch = get<uint32_t>(in, 24);
  h->src = get<int32_t>(in, 28);
  h->dst = get<int32_t>(in, 32);
  h->context = get<uint32_t>(in, 36);
  h->nranks = get<uint32_t>(in, 40);
  h->ncontexts = get<uint32_t>(in, 44);
  h->ext_len = get<uint32_t>(in, 48);
  return Reject::kNone;
}

Reject validate(const ConnHeader& h, const Expect& e) {
  if (h.role != e.role) return Reject::kBadRole;
  if (h.mesh_id != e.mesh_id) return Reject::kForeignMesh;
  if (h.epoch != e.epoch) return Reject::kWrongEpoch;
  if (h.nranks != e.nranks || h.ncontexts != e.ncontexts || h.ext_len != 0) return Reject::kBadShape;
  if (h.dst != e.me) return Reject::kWrongDst;
  if (h.src < 0 || static_cast<uint32_t>(h.src) >= e.nranks) return Reject::kBadSrc;
  if (h.context >= e.ncontexts) return Reject::kBadContext;
  return Reject::kNone;
}

crypto::Key derive_key(const crypto::Key& secret, const MeshId& mesh_id, uint32_t epoch) {
  static const char kLabel[] = "flagcx_mesh epoch key v1";
  uint8_t le[4];
  put<uint32_t>(le, 0, epoch);
  return crypto::Hmac(secret.data(), secret.size())
      .update(kLabel, sizeof(kLabel))
      .update(mesh_id.data(), mesh_id.size())
      .update(le, sizeof(le))
      .finish();
}

Mac handshake_mac(const crypto::Key& key, Role prover, const uint8_t hello[kHelloSize],
                  const uint8_t answer_head[kHelloSize], const uint8_t* bound, size_t bound_len) {
  const char* label = is_accept_role(prover) ? "flagcx_mesh accept proof" : "flagcx_mesh connect proof";
  return crypto::Hmac(key.data(), key.size())
      .update(label, std::strlen(label) + 1)
      .update(hello, kHelloSize)
      .update(answer_head, kHelloSize)
      .update(bound, bound_len)
      .finish();
}

crypto::Key agent_key(const std::string& secret) {
  static const MeshId kAgentDomain{'f', 'l', 'a', 'g', 'c', 'x', '_', 'm', 'e', 's', 'h', ' ', 'a', 'g', 'n', 't'};
  crypto::Digest d = crypto::sha256(secret.data(), secret.size());
  crypto::Key k;
  std::copy(d.begin(), d.end(), k.begin());
  return derive_key(k, kAgentDomain, 0);
}

void encode_frame(const FrameHeader& f, uint8_t out[kFrameHeaderSize]) {
  put<uint32_t>(out, 0, kFrameMagic);
  put<uint16_t>(out, 4, static_cast<uint16_t>(f.type));
  put<uint16_t>(out, 6, f.flags);
  put<uint64_t>(out, 8, f.length);
}

bool decode_frame(const uint8_t in[kFrameHeaderSize], FrameHeader* f) {
  if (get<uint32_t>(in, 0) != kFrameMagic) return false;
  f->type = static_cast<FrameType>(get<uint16_t>(in, 4));
  f->flags = get<uint16_t>(in, 6);
  f->length = get<uint64_t>(in, 8);
  return true;
}

std::string mesh_id_hex(const MeshId& id) {
  static const char* digits = "0123456789abcdef";
  std::string s;
  for (uint8_t b : id) {
    s += digits[b >> 4];
    s += digits[b & 15];
  }
  return s;
}

}  // namespace fxm::wire
