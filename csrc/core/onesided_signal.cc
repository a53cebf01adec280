// Signal slots of one-sided operations: reading a slot and waiting on the
// host until it reaches a value (spin, yield, then sleep on the window's
// notify futex), within a deadline.
#include <sched.h>

#include "base/status.h"
#include "core/onesided.h"
#include "transport/signal_ops.h"

namespace fxm {
namespace {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

}  // namespace

Window& OneSided::signal_slot(uint32_t win, uint64_t slot, const char* op, OpWindows* ow) const {
  Window& w = use(win, op, ow);
  if (w.kind != WindowKind::kSignal || slot >= w.nslots()) {
    fail(Code::kInvalidArgument, -1, 0, who() + op + ": window #" + std::to_string(win) + " slot " +
                                            std::to_string(slot) + " is not a signal slot (window has " +
                                            std::to_string(w.nslots()) + " slots)");
  }
  return w;
}

uint64_t OneSided::read_signal(uint32_t win, uint64_t slot) const {
  OpWindows ow;
  Window& w = signal_slot(win, slot, "read_signal", &ow);
  return load_signal(reinterpret_cast<const uint64_t*>(w.base), slot);
}

// True when some peer's signals to window w arrive over tcp (its path is tcp, or cannot signal):
// this rank's reader applies them, so the waiter may read for them (Engine::help_read).
bool OneSided::signals_by_tcp(const Window& w) const {
  for (int p = 0; p < static_cast<int>(w.peers.size()); ++p) {
    if (p == rank_ || !w.peers[p].path) continue;
    if (w.peers[p].path->kind() == PathKind::kTcp || !w.peers[p].path->can_signal()) return true;
  }
  return false;
}

// Spin, then yield, each for a bounded time (a PAUSE count would not do: PAUSE takes 10 to 140 cycles
// depending on the CPU, 2000 of them 45 us on some). The signaller may need this very core (fewer
// free cores than spinning threads), so the spin is short; the caller then sleeps on the futex.
uint64_t OneSided::spin_for_signal(const Window& w, uint64_t slot, uint64_t expected) const {
  constexpr auto kSpin = std::chrono::microseconds(2), kYield = std::chrono::microseconds(50);
  const uint64_t* slots = reinterpret_cast<const uint64_t*>(w.base);
  uint64_t current = load_signal(slots, slot);
  if (signal_reached(current, expected)) return current;
  const Clock::time_point start = Clock::now();
  for (unsigned i = 1; !signal_reached(current, expected); ++i) {
    cpu_relax();
    current = load_signal(slots, slot);
    if (i % 16 == 0 && Clock::now() - start >= kSpin) break;  // the clock every 16 loads
  }
  // The yields read the peers' tcp connections (when no other thread does): a signal from them
  // is then applied here, not by the progress thread, which would have to wake this one up.
  bool help = !signal_reached(current, expected) && engine_->may_help() && signals_by_tcp(w);
  while (!signal_reached(current, expected) && Clock::now() - start < kYield) {
    if (w.closing.load(std::memory_order_relaxed)) fail_wait_closed(w, slot);
    if (!help || !engine_->help_read()) sched_yield();
    current = load_signal(slots, slot);
  }
  return current;
}

void OneSided::wait_signal(uint32_t win, uint64_t slot, uint64_t expected, const Deadline& deadline) const {
  OpWindows ow;  // the slots stay mapped while this waits; close() wakes it
  Window& w = signal_slot(win, slot, "wait_signal", &ow);
  const uint64_t* slots = reinterpret_cast<const uint64_t*>(w.base);
  uint64_t current = spin_for_signal(w, slot, expected);
  if (!signal_reached(current, expected)) engine_->unpark();  // it sleeps: the progress thread reads
  while (!signal_reached(current, expected)) {
    uint32_t seen = __atomic_load_n(&w.notify->epoch, __ATOMIC_SEQ_CST);
    current = load_signal(slots, slot);
    if (signal_reached(current, expected)) break;
    if (w.closing.load()) fail_wait_closed(w, slot);
    if (engine_->stopped()) {
      fail(Code::kClosed, -1, 0, who() + "wait_signal(window #" + std::to_string(win) + ", slot " +
                                     std::to_string(slot) + "): the mesh was closed");
    }
    int lost = engine_->first_lost_peer();
    if (lost >= 0 || deadline.expired()) fail_wait_signal(w, slot, expected, current, lost);
    wait_signal_epoch(w.notify, seen, std::min<long>(10000000L, deadline.poll_ms() * 1000000L));
    current = load_signal(slots, slot);
  }
}

void OneSided::fail_wait_closed(const Window& w, uint64_t slot) const {
  fail(Code::kInvalidArgument, -1, 0, who() + "wait_signal(window #" + std::to_string(w.index) + ", slot " +
                                          std::to_string(slot) + "): the window was closed (deregistered) while waiting");
}

void OneSided::fail_wait_signal(const Window& w, uint64_t slot, uint64_t expected, uint64_t current,
                                int lost) const {
  std::string what = who() + "wait_signal(window #" + std::to_string(w.index) + ", slot " + std::to_string(slot) +
                     "): expected >= " + std::to_string(expected) + ", current " + std::to_string(current);
  int64_t last = __atomic_load_n(&w.last_src[slot], __ATOMIC_RELAXED);
  std::string by = last < 0 ? "never signalled" : "last signalled by rank " + std::to_string(last);
  if (lost >= 0) {
    fail(Code::kPeerLost, lost, 0, what + ", " + by + "; peer " + std::to_string(lost) +
                                       " was lost: " + engine_->lost_reason(lost));
  }
  fail(Code::kTimeout, static_cast<int>(last), 0, what + ", " + by + ": timed out");
}

}  // namespace fxm
