#include "bootstrap/sealed_id.h"

#include <cstring>
#include <string>

#include "base/hmac.h"
#include "base/status.h"

namespace fxm::bootstrap {
namespace {

constexpr size_t kNonce = 16;
constexpr char kSealLabel[] = "flagcx_mesh unique id seal";  // with its NUL

crypto::Digest seal_key(const UniqueId& shared) {
  crypto::Hmac h(shared.secret.data(), shared.secret.size());
  h.update(kSealLabel, sizeof(kSealLabel));
  h.update(shared.mesh_id.data(), shared.mesh_id.size());
  return h.finish();
}

// XORs `len` bytes at `p` with the keystream HMAC(key, nonce | block counter).
void apply_stream(const crypto::Digest& key, const uint8_t* nonce, uint8_t* p, size_t len) {
  for (uint32_t block = 0; static_cast<size_t>(block) * crypto::kDigestSize < len; ++block) {
    crypto::Hmac h(key.data(), key.size());
    h.update(nonce, kNonce).update(&block, sizeof(block));
    crypto::Digest ks = h.finish();
    size_t at = static_cast<size_t>(block) * crypto::kDigestSize;
    for (size_t i = 0; i < crypto::kDigestSize && at + i < len; ++i) p[at + i] ^= ks[i];
  }
}

crypto::Digest tag_of(const crypto::Digest& key, const uint8_t* sealed, size_t len) {
  crypto::Hmac h(key.data(), key.size());
  static const char kTag[] = "tag";
  return h.update(kTag, sizeof(kTag)).update(sealed, len).finish();
}

}  // namespace

std::vector<uint8_t> seal_unique_id(const UniqueId& shared, const UniqueIdBytes& next) {
  crypto::Digest key = seal_key(shared);
  std::vector<uint8_t> out(kNonce + kUniqueIdSize);
  crypto::random_bytes(out.data(), kNonce);
  std::memcpy(out.data() + kNonce, next.data(), kUniqueIdSize);
  apply_stream(key, out.data(), out.data() + kNonce, kUniqueIdSize);
  crypto::Digest tag = tag_of(key, out.data(), out.size());
  out.insert(out.end(), tag.begin(), tag.end());
  return out;
}

UniqueIdBytes unseal_unique_id(const UniqueId& shared, const std::vector<uint8_t>& sealed) {
  if (sealed.size() != kNonce + kUniqueIdSize + crypto::kDigestSize) {
    fail(Code::kProtocol, -1, 0, "a sealed unique id of " + std::to_string(sealed.size()) + " bytes (expected " +
                                     std::to_string(kNonce + kUniqueIdSize + crypto::kDigestSize) + ")");
  }
  crypto::Digest key = seal_key(shared);
  crypto::Digest tag = tag_of(key, sealed.data(), kNonce + kUniqueIdSize);
  if (!crypto::equal_ct(tag.data(), sealed.data() + kNonce + kUniqueIdSize, tag.size())) {
    fail(Code::kProtocol, -1, 0, "a sealed unique id that was not sealed under this mesh's secret");
  }
  UniqueIdBytes next{};
  std::memcpy(next.data(), sealed.data() + kNonce, kUniqueIdSize);
  apply_stream(key, sealed.data(), next.data(), kUniqueIdSize);
  return next;
}

}  // namespace fxm::bootstrap
