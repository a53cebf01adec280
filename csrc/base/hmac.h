// SHA-256 (FIPS 180-4) and HMAC-SHA256 (RFC 2104), the MAC that proves
// knowledge of a mesh's key in every handshake, plus the helpers around it:
// a constant-time comparison and kernel random bytes.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace fxm::crypto {

constexpr size_t kDigestSize = 32;
constexpr size_t kBlockSize = 64;
using Digest = std::array<uint8_t, kDigestSize>;
using Key = std::array<uint8_t, 32>;

// Incremental SHA-256.
class Sha256 {
 public:
  Sha256();
  void update(const void* data, size_t len);
  Digest finish();

 private:
  void block(const uint8_t* p);
  uint32_t h_[8];
  uint8_t buf_[kBlockSize];
  size_t buffered_ = 0;
  uint64_t total_ = 0;
};

Digest sha256(const void* data, size_t len);

// Incremental HMAC-SHA256 with a key of any length.
class Hmac {
 public:
  Hmac(const void* key, size_t key_len);
  Hmac& update(const void* data, size_t len);
  Hmac& update(const std::vector<uint8_t>& v) { return update(v.data(), v.size()); }
  Digest finish();

 private:
  Sha256 inner_;
  uint8_t okey_[kBlockSize];
};

Digest hmac_sha256(const void* key, size_t key_len, const void* data, size_t len);

// Compares in time that depends on len only, never on where bytes differ.
bool equal_ct(const void* a, const void* b, size_t len);

// len bytes from getrandom(); throws Error(kSystem) when the kernel refuses.
void random_bytes(void* out, size_t len);

}  // namespace fxm::crypto
