// What wakes the threads that wait on an agent's notifications (docs/agent.md, "How a
// notification reaches its waiter"): a count that each event that may change what they wait
// for moves, and a condition variable. It is rung by a connection's engine when a message
// lands in its mailbox, when the peer says goodbye or is lost (Engine's arrival hook, on the
// thread that read it), by a connection closed here, by a wait released, by
// wake_notifications() and by close(). A waiter reads rings() before it looks (drains the
// connections), and wait(seen, ...) returns at once when a ring came in between: no wake-up is
// lost, and none is polled for.
//
// Its lock is taken by nothing else and held only to count and to sleep: ring() may be called
// with any other lock held (the inbox's included), and never blocks behind a waiter's work.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>

#include "base/clock.h"

namespace fxm::agent {

class Doorbell {
 public:
  // (A load: a waiter that spins looks at it without the lock.)
  uint64_t rings() const { return rings_.load(std::memory_order_acquire); }
  void ring() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      rings_.fetch_add(1, std::memory_order_acq_rel);
    }
    cv_.notify_all();
  }
  // Returns once the count is not `seen` any more, or at `until`.
  void wait(uint64_t seen, const Deadline& until) const {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_until(lock, until.at(), [&] { return rings() != seen; });
  }

 private:
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  std::atomic<uint64_t> rings_{0};  // moved under mu_, so that a wait cannot miss a ring
};

}  // namespace fxm::agent
