// The little-endian field codec of the descriptions ranks and agents exchange
// (WindowDesc, agent region descriptors and metadata): fixed-size fields as
// they lie in memory, strings as a u32 length and their bytes. The reader
// never reads past its buffer: the first problem is kept in `error`, and every
// later read returns zeros, so a decoder reads all its fields, then checks ok().
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace fxm::bytes {

struct Writer {
  std::vector<uint8_t> b;
  template <typename T>
  void put(T v) {
    raw(&v, sizeof(T));
  }
  void raw(const void* p, size_t n) {
    const uint8_t* s = static_cast<const uint8_t*>(p);
    b.insert(b.end(), s, s + n);
  }
  void str(const std::string& s) {
    put<uint32_t>(static_cast<uint32_t>(s.size()));
    raw(s.data(), s.size());
  }
};

struct Reader {
  const std::vector<uint8_t>& b;
  size_t off = 0;
  std::string error;  // the first problem; empty while all is well

  bool ok() const { return error.empty(); }
  // True when n more bytes are there (else records the problem).
  bool has(size_t n) {
    if (ok() && n <= b.size() - off) return true;
    if (ok()) error = "truncated (" + std::to_string(b.size()) + " bytes)";
    return false;
  }
  template <typename T>
  T get() {
    T v{};
    raw(&v, sizeof(T));
    return v;
  }
  void raw(void* p, size_t n) {
    if (!has(n)) {
      std::memset(p, 0, n);
      return;
    }
    std::memcpy(p, b.data() + off, n);
    off += n;
  }
  // n bytes as a vector, checked before anything is allocated.
  std::vector<uint8_t> blob(size_t n) {
    if (!has(n)) return {};
    std::vector<uint8_t> v(b.begin() + off, b.begin() + off + n);
    off += n;
    return v;
  }
  std::string str(size_t max) {
    uint32_t n = get<uint32_t>();
    if (ok() && n > max) {
      error = "a field of " + std::to_string(n) + " bytes (at most " + std::to_string(max) + ")";
    }
    if (!ok() || !has(n)) return {};
    std::string s(b.begin() + off, b.begin() + off + n);
    off += n;
    return s;
  }
  // True while bytes are left to read (an optional block follows).
  bool more() const { return ok() && off < b.size(); }
  // True when every byte was read (else records the trailing bytes).
  bool at_end() {
    if (ok() && off != b.size()) error = std::to_string(b.size() - off) + " trailing bytes";
    return ok();
  }
};

}  // namespace fxm::bytes
