// Monotonic deadlines.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>

namespace fxm {

using Clock = std::chrono::steady_clock;

// Clock's time in nanoseconds (for timestamps kept in atomics or plain integers).
inline int64_t steady_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
}

class Deadline {
 public:
  // s beyond a year (or inf / NaN) is a year: the conversion below must not overflow.
  static Deadline after_seconds(double s) {
    constexpr double kYear = 365.0 * 24 * 3600;
    if (!(s < kYear)) s = kYear;
    Deadline d;
    d.at_ = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                               std::chrono::duration<double>(s));
    return d;
  }
  static Deadline never() { return after_seconds(1e300); }
  bool expired() const { return Clock::now() >= at_; }
  // Milliseconds left, clamped to [0, cap_ms]; suitable for poll().
  int poll_ms(int cap_ms = 1 << 30) const {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(at_ - Clock::now()).count();
    if (left < 0) left = 0;
    return static_cast<int>(std::min<long long>(left + 1, cap_ms));
  }
  double seconds_left() const {
    return std::chrono::duration<double>(at_ - Clock::now()).count();
  }
  Deadline min(const Deadline& o) const { return at_ < o.at_ ? *this : o; }
  Clock::time_point at() const { return at_; }

 private:
  Clock::time_point at_{};
};

inline double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

}  // namespace fxm
