// The byte ranges the ops of one call (cuda/copy_batch, cma/iov_batch) touch: whether any two
// conflict at all (one sort), and, when some do, the ranges an ordered walk has seen so far, to
// find the op that must wait for those before it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <map>
#include <memory>
#include <utility>
#include <vector>

namespace fxm {

// Where bytes at `off` of window `win` are, as one number (offsets stay below 2^48: no window is
// that large): the ranges a batch's blocks land on, compared across windows.
inline uint64_t window_key(uint32_t win, uint64_t off) { return (uint64_t{win} << 48) + off; }

// One range an op touches: [start, end), written or only read.
struct ByteSpan {
  uint64_t start, end;
  bool written;
};

// Sorts spans by start (equal starts in any order). Large lists by a least-significant-digit
// radix sort over only the bits in which their starts differ (11 a pass; addresses of one
// process differ in ~30-40 bits: 3-4 passes), linear where a comparison sort is n log n: the
// check below ran once per batch and was a quarter of the core's per-op cost of a request's
// 4096 device copies (8192 spans), counted with callgrind.
inline void sort_by_start(std::vector<ByteSpan>& spans) {
  constexpr size_t kRadixFrom = 512;
  if (spans.size() < kRadixFrom) {
    std::sort(spans.begin(), spans.end(), [](const ByteSpan& a, const ByteSpan& b) { return a.start < b.start; });
    return;
  }
  uint64_t any = 0, all = ~0ull;
  for (const ByteSpan& s : spans) {
    any |= s.start;
    all &= s.start;
  }
  uint64_t differ = any ^ all;  // the bits not alike in every start
  if (differ == 0) return;
  constexpr int kBits = 11;
  constexpr size_t kBuckets = size_t{1} << kBits;
  size_t n = spans.size();
  std::unique_ptr<ByteSpan[]> scratch(new ByteSpan[n]);  // (not zeroed: each pass writes every slot)
  ByteSpan *from = spans.data(), *to = scratch.get();
  std::vector<size_t> at(kBuckets);
  for (int shift = __builtin_ctzll(differ); shift <= 63 - __builtin_clzll(differ); shift += kBits) {
    std::fill(at.begin(), at.end(), 0);
    for (size_t i = 0; i < n; ++i) ++at[(from[i].start >> shift) & (kBuckets - 1)];
    size_t sum = 0;
    for (size_t& a : at) sum += std::exchange(a, sum);  // each bucket's first slot
    for (size_t i = 0; i < n; ++i) to[at[(from[i].start >> shift) & (kBuckets - 1)]++] = from[i];
    std::swap(from, to);
  }
  if (from != spans.data()) std::copy(from, from + n, spans.data());
}

// Whether a written span overlaps any other span (reads may overlap reads), in one sort of
// `spans` (reordered): cheaper than a ByteRanges walk when, as in a request's KV, no two ops
// touch the same bytes. Empty spans touch nothing.
inline bool any_conflict(std::vector<ByteSpan>& spans) {
  sort_by_start(spans);
  uint64_t any_end = 0, written_end = 0;  // the furthest end of the spans before, all / written ones
  for (const ByteSpan& s : spans) {
    if (s.start == s.end) continue;
    if (s.start < written_end || (s.written && s.start < any_end)) return true;
    any_end = std::max(any_end, s.end);
    if (s.written) written_end = std::max(written_end, s.end);
  }
  return false;
}

class ByteRanges {
 public:
  // Whether [a, b) overlaps a range added.
  bool overlaps(uint64_t a, uint64_t b) const {
    auto it = r_.lower_bound(b);  // the first range starting at or after b cannot overlap
    return it != r_.begin() && std::prev(it)->second > a;
  }
  void add(uint64_t a, uint64_t b) {
    auto it = r_.lower_bound(a);
    if (it != r_.begin() && std::prev(it)->second >= a) --it;  // merges with the range before
    while (it != r_.end() && it->first <= b) {
      a = std::min(a, it->first);
      b = std::max(b, it->second);
      it = r_.erase(it);
    }
    r_.emplace(a, b);
  }

 private:
  std::map<uint64_t, uint64_t> r_;  // start -> end
};

}  // namespace fxm
