// Disjoint byte ranges [start, end), merged as they are added: what the batches of one call
// (cuda/copy_batch, cma/iov_batch) have written or read so far, to find the op that must wait
// for those before it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <map>

namespace fxm {

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
