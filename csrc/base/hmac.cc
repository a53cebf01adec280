#include "base/hmac.h"

#include <sys/random.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "base/status.h"

namespace fxm::crypto {
namespace {

// FIPS 180-4 section 4.2.2: the first 32 bits of the fractional parts of the
// cube roots of the first 64 primes.
constexpr uint32_t kRound[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};

// Section 5.3.3: the initial hash value.
constexpr uint32_t kInit[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                               0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};

inline uint32_t rotr(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }
inline uint32_t load_be32(const uint8_t* p) {
  return (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) | (uint32_t{p[2]} << 8) | p[3];
}

}  // namespace

Sha256::Sha256() { std::memcpy(h_, kInit, sizeof(h_)); }

// Section 6.2.2: one 512-bit block.
void Sha256::block(const uint8_t* p) {
  uint32_t w[64];
  for (int t = 0; t < 16; ++t) w[t] = load_be32(p + 4 * t);
  for (int t = 16; t < 64; ++t) {
    uint32_t s0 = rotr(w[t - 15], 7) ^ rotr(w[t - 15], 18) ^ (w[t - 15] >> 3);
    uint32_t s1 = rotr(w[t - 2], 17) ^ rotr(w[t - 2], 19) ^ (w[t - 2] >> 10);
    w[t] = w[t - 16] + s0 + w[t - 7] + s1;
  }
  uint32_t a = h_[0], b = h_[1], c = h_[2], d = h_[3], e = h_[4], f = h_[5], g = h_[6], h = h_[7];
  for (int t = 0; t < 64; ++t) {
    uint32_t t1 = h + (rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25)) + ((e & f) ^ (~e & g)) + kRound[t] + w[t];
    uint32_t t2 = (rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
    h = g, g = f, f = e, e = d + t1, d = c, c = b, b = a, a = t1 + t2;
  }
  h_[0] += a, h_[1] += b, h_[2] += c, h_[3] += d, h_[4] += e, h_[5] += f, h_[6] += g, h_[7] += h;
}

void Sha256::update(const void* data, size_t len) {
  const uint8_t* p = static_cast<const uint8_t*>(data);
  total_ += len;
  while (len > 0) {
    size_t take = std::min(len, kBlockSize - buffered_);
    std::memcpy(buf_ + buffered_, p, take);
    buffered_ += take, p += take, len -= take;
    if (buffered_ == kBlockSize) {
      block(buf_);
      buffered_ = 0;
    }
  }
}

// Section 5.1.1: a 1 bit, zeros, and the message length in bits (big-endian).
Digest Sha256::finish() {
  uint64_t bits = total_ * 8;
  uint8_t pad[kBlockSize + 8] = {0x80};
  size_t pad_len = (buffered_ < 56 ? 56 : 120) - buffered_;
  for (int i = 0; i < 8; ++i) pad[pad_len + i] = static_cast<uint8_t>(bits >> (56 - 8 * i));
  update(pad, pad_len + 8);
  Digest out;
  for (int i = 0; i < 8; ++i) {
    for (int j = 0; j < 4; ++j) out[4 * i + j] = static_cast<uint8_t>(h_[i] >> (24 - 8 * j));
  }
  return out;
}

Digest sha256(const void* data, size_t len) {
  Sha256 s;
  s.update(data, len);
  return s.finish();
}

// RFC 2104: H(K ^ opad, H(K ^ ipad, text)); a key longer than a block is hashed first.
Hmac::Hmac(const void* key, size_t key_len) {
  uint8_t k[kBlockSize] = {};
  if (key_len > kBlockSize) {
    Digest d = sha256(key, key_len);
    std::memcpy(k, d.data(), d.size());
  } else if (key_len > 0) {
    std::memcpy(k, key, key_len);
  }
  uint8_t ikey[kBlockSize];
  for (size_t i = 0; i < kBlockSize; ++i) {
    ikey[i] = k[i] ^ 0x36;
    okey_[i] = k[i] ^ 0x5c;
  }
  inner_.update(ikey, sizeof(ikey));
}

Hmac& Hmac::update(const void* data, size_t len) {
  inner_.update(data, len);
  return *this;
}

Digest Hmac::finish() {
  Digest inner = inner_.finish();
  Sha256 outer;
  outer.update(okey_, sizeof(okey_));
  outer.update(inner.data(), inner.size());
  return outer.finish();
}

Digest hmac_sha256(const void* key, size_t key_len, const void* data, size_t len) {
  return Hmac(key, key_len).update(data, len).finish();
}

bool equal_ct(const void* a, const void* b, size_t len) {
  const volatile uint8_t* x = static_cast<const volatile uint8_t*>(a);
  const volatile uint8_t* y = static_cast<const volatile uint8_t*>(b);
  uint8_t diff = 0;
  for (size_t i = 0; i < len; ++i) diff |= static_cast<uint8_t>(x[i] ^ y[i]);
  return diff == 0;
}

void random_bytes(void* out, size_t len) {
  uint8_t* p = static_cast<uint8_t*>(out);
  size_t got = 0;
  while (got < len) {
    ssize_t n = getrandom(p + got, len - got, 0);
    if (n < 0 && errno != EINTR) fail(Code::kSystem, -1, errno, "getrandom");
    if (n > 0) got += static_cast<size_t>(n);
  }
}

}  // namespace fxm::crypto
