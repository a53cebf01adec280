#include "agent/want.h"

#include <cstring>

#include "base/bytes.h"
#include "base/status.h"

namespace fxm::agent {
namespace {

// The fixed part: prefix, version, part, readers (without the variable fields' lengths).
constexpr size_t kWantHead = kWantPrefix.size() + 1 + 5 * 4;

// A cursor over the bytes: a read past the end records "truncated" and returns zeros, so the
// parse reads its fields, then checks once.
struct Cursor {
  const uint8_t* p;
  size_t n, off = 0;
  bool short_ = false;
  bool has(size_t k) {
    if (!short_ && k <= n - off) return true;
    short_ = true;
    return false;
  }
  template <typename T>
  T get() {
    T v{};
    if (!has(sizeof(T))) return v;
    std::memcpy(&v, p + off, sizeof(T));
    off += sizeof(T);
    return v;
  }
  const uint8_t* take(size_t k) {
    if (!has(k)) return nullptr;
    off += k;
    return p + off - k;
  }
};

std::string count_refusal(const char* what, size_t n, size_t max) {
  if (n == 0) return std::string(what) + " is empty";
  if (n > max) return std::string(what) + " of " + std::to_string(n) + " bytes (at most " + std::to_string(max) + ")";
  return "";
}

}  // namespace

std::string want_refusal(const Want& w) {
  std::string why = count_refusal("req", w.req.size(), kMaxWantId);
  if (why.empty()) why = count_refusal("answer", w.answer.size(), kMaxWantId);
  if (!why.empty()) return why;
  if (w.sn == 0 || w.dn == 0 || w.si >= w.sn || w.di >= w.dn) {
    return "part [" + std::to_string(w.si) + ", " + std::to_string(w.sn) + ", " + std::to_string(w.di) + ", " +
           std::to_string(w.dn) + "] is not slice si of sn into slice di of dn";
  }
  if (w.counts.empty() || w.counts.size() > kMaxWantGroups) {
    return std::to_string(w.counts.size()) + " groups (1 to " + std::to_string(kMaxWantGroups) + ")";
  }
  uint64_t sum = 0;
  for (uint64_t c : w.counts) {
    if (c > w.dst.size() - sum) return "the groups' counts add up to more than the " + std::to_string(w.dst.size()) + " dst ids";
    sum += c;
  }
  if (sum != w.dst.size()) {
    return "the groups' counts add up to " + std::to_string(sum) + ", not the " + std::to_string(w.dst.size()) + " dst ids";
  }
  for (size_t k = 0; k < w.dst.size(); ++k) {
    if (w.dst[k] < 0) return "dst id " + std::to_string(k) + " is negative (" + std::to_string(w.dst[k]) + ")";
  }
  size_t total = kWantHead + 2 + w.req.size() + 2 + w.answer.size() + 4 + 8 * w.counts.size() + 8 + 8 * w.dst.size();
  if (total > kMaxWantBytes) return std::to_string(total) + " bytes (at most " + std::to_string(kMaxWantBytes) + ")";
  return "";
}

std::vector<uint8_t> encode_want(const Want& w) {
  std::string why = want_refusal(w);
  if (!why.empty()) fail(Code::kInvalidArgument, -1, 0, "a want: " + why);
  bytes::Writer out;
  out.raw(kWantPrefix.data(), kWantPrefix.size());
  out.put<uint8_t>(kWantVersion);
  for (uint32_t v : {w.si, w.sn, w.di, w.dn, w.readers}) out.put<uint32_t>(v);
  out.put<uint16_t>(static_cast<uint16_t>(w.req.size()));
  out.raw(w.req.data(), w.req.size());
  out.put<uint16_t>(static_cast<uint16_t>(w.answer.size()));
  out.raw(w.answer.data(), w.answer.size());
  out.put<uint32_t>(static_cast<uint32_t>(w.counts.size()));
  out.raw(w.counts.data(), 8 * w.counts.size());
  out.put<uint64_t>(w.dst.size());
  out.raw(w.dst.data(), 8 * w.dst.size());
  return std::move(out.b);
}

bool parse_want(const uint8_t* data, size_t n, Want* out, std::string* why) {
  auto refuse = [&](const std::string& what) {
    *why = "a want: " + what;
    return false;
  };
  if (n > kMaxWantBytes) return refuse(std::to_string(n) + " bytes (at most " + std::to_string(kMaxWantBytes) + ")");
  if (n < kWantPrefix.size() || std::memcmp(data, kWantPrefix.data(), kWantPrefix.size()) != 0) {
    return refuse("not one (its prefix is not fxkv1w)");
  }
  Cursor c{data, n, kWantPrefix.size()};
  uint8_t version = c.get<uint8_t>();
  if (!c.short_ && version != kWantVersion) return refuse("version " + std::to_string(version) + " (this is 1)");
  Want w;
  w.si = c.get<uint32_t>(), w.sn = c.get<uint32_t>(), w.di = c.get<uint32_t>(), w.dn = c.get<uint32_t>();
  w.readers = c.get<uint32_t>();
  uint16_t req_n = c.get<uint16_t>();
  if (const uint8_t* p = c.take(req_n)) w.req.assign(reinterpret_cast<const char*>(p), req_n);
  uint16_t answer_n = c.get<uint16_t>();
  if (const uint8_t* p = c.take(answer_n)) w.answer.assign(p, p + answer_n);
  uint32_t groups = c.get<uint32_t>();
  if (!c.short_ && groups > kMaxWantGroups) return refuse(std::to_string(groups) + " groups (1 to 1024)");
  const uint8_t* counts = c.take(8ull * groups);
  if (counts != nullptr && groups != 0) {  // (memcpy from or to null: undefined even for 0 bytes)
    w.counts.resize(groups);
    std::memcpy(w.counts.data(), counts, 8ull * groups);
  }
  uint64_t ndst = c.get<uint64_t>();
  if (!c.short_ && ndst > (n - c.off) / 8) c.short_ = true;  // (checked before anything is allocated)
  const uint8_t* dst = c.take(8 * ndst);
  if (dst != nullptr && ndst != 0) {
    w.dst.resize(ndst);
    std::memcpy(w.dst.data(), dst, 8 * ndst);
  }
  if (c.short_) return refuse("truncated (" + std::to_string(n) + " bytes)");
  if (c.off != n) return refuse(std::to_string(n - c.off) + " trailing bytes");
  std::string wrong = want_refusal(w);
  if (!wrong.empty()) return refuse(wrong);
  *out = std::move(w);
  return true;
}

}  // namespace fxm::agent
