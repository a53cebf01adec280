// How a listener lives through a shortage of file descriptors (the bootstrap root's, the mesh
// builder's and the agent's): accept() fails with EMFILE (or ENFILE, ENOBUFS, ENOMEM) while the
// connection stays in the kernel's backlog, so the listening socket stays readable and polling it
// again at once fails again, as fast as the loop runs. Instead the owner stops polling it for a
// pause that starts at 10 ms and doubles up to 0.5 s while accept keeps failing, and says so once
// per episode, when it starts and when an accept works again.
#pragma once

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <string>

#include "base/clock.h"

namespace fxm {

class FdShortage {
 public:
  static constexpr double kPauseMinS = 0.01;
  static constexpr double kPauseMaxS = 0.5;

  // accept() failed for want of a descriptor or of kernel memory: retrying at once fails again.
  static bool no_descriptor(int err) { return err == EMFILE || err == ENFILE || err == ENOBUFS || err == ENOMEM; }
  // "accept is retried every 10 to 500 ms": for the owner's warning at the start of an episode.
  static std::string retry_text() {
    return "accept is retried every " + std::to_string(static_cast<int>(kPauseMinS * 1000)) + " to " +
           std::to_string(static_cast<int>(kPauseMaxS * 1000)) + " ms";
  }

  bool active() const { return active_; }
  // The listening socket is not to be polled before resume().
  bool paused() const { return active_ && !resume_.expired(); }
  const Deadline& resume() const { return resume_; }

  // A failed accept: the pause starts, or doubles. True when it starts an episode.
  bool failed() {
    bool starts = !active_;
    if (starts) {
      active_ = true;
      failures_ = 0;
      pause_s_ = kPauseMinS;
      since_ = Clock::now();
    } else {
      pause_s_ = std::min(2 * pause_s_, kPauseMaxS);
    }
    ++failures_;
    resume_ = Deadline::after_seconds(pause_s_);
    return starts;
  }
  // An accept that worked: when it ends an episode, what the episode was ("3 accept(s) failed for
  // want of descriptors over 0.07 s"), and the shortage is over; else "".
  std::string ended() {
    if (!active_) return "";
    std::string what = std::to_string(failures_) + " accept(s) failed for want of descriptors over " +
                       std::to_string(seconds_since(since_)) + " s";
    *this = FdShortage{};
    return what;
  }

 private:
  bool active_ = false;
  uint64_t failures_ = 0;  // failed accepts in this episode
  double pause_s_ = 0;
  Deadline resume_;
  Clock::time_point since_;
};

}  // namespace fxm
