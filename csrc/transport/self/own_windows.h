// The windows registered in this process, by every mesh in it: what a peer
// claiming this process's pid may name. A peer's description that names this
// pid reaches memory here (cuda-self) only when it matches one of them
// exactly: the same rank, window index, cookie, address and size.
#pragma once

#include <cstdint>

namespace fxm {

struct OwnWindow {
  int rank = -1;
  uint32_t index = 0;
  uint64_t cookie = 0;
  uint64_t addr = 0;
  uint64_t size = 0;
};

// True when `w` is a window registered in this process (and not yet closed).
bool is_own_window(const OwnWindow& w);

// Holds one window in the table while it lives (reset() or destruction drops it).
class OwnWindowClaim {
 public:
  OwnWindowClaim() = default;
  OwnWindowClaim(const OwnWindowClaim&) = delete;
  OwnWindowClaim& operator=(const OwnWindowClaim&) = delete;
  ~OwnWindowClaim() { reset(); }
  void set(const OwnWindow& w);
  void reset();

 private:
  bool held_ = false;
  OwnWindow w_;
};

}  // namespace fxm
