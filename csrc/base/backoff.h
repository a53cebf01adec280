// Pacing of a loop that polls for work another thread or the GPU finishes
// (a device copy's event, a host function's completion).
//
// A sleep, however short, costs the timer slack (50 us by default on Linux):
// more than a small device copy takes. So for the first kSpin of a wait the
// loop only yields the core (others may run; it wakes as soon as it is
// scheduled again), then it sleeps, a tenth of the time waited so far (20 us
// to 1 ms): a long wait costs few wake-ups and ends at most ~10 % late.
#pragma once

#include <algorithm>
#include <chrono>
#include <thread>

#include "base/clock.h"

namespace fxm {

class Backoff {
 public:
  static constexpr std::chrono::microseconds kSpin{1000};
  static constexpr std::chrono::microseconds kMinSleep{20}, kMaxSleep{1000};

  Backoff() : start_(Clock::now()) {}
  // True during the first kSpin of the wait (a poll then only yields).
  bool spinning() const { return Clock::now() - start_ < kSpin; }
  bool within(std::chrono::microseconds d) const { return Clock::now() - start_ < d; }
  void pause() const {
    if (spinning()) {
      std::this_thread::yield();
      return;
    }
    std::this_thread::sleep_for(sleep());
  }
  // How long a pause past the spin sleeps (a loop that may be woken sooner waits this long on its
  // condition variable instead).
  std::chrono::microseconds sleep() const {
    auto waited = std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - start_);
    return std::clamp(waited / 10, kMinSleep, kMaxSleep);
  }

 private:
  Clock::time_point start_;
};

}  // namespace fxm
