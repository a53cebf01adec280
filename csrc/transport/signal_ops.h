// Atomic operations on 64-bit signal slots, shared by every path that applies
// a signal (inline through a shared mapping, or the TCP progress thread).
// Sequentially consistent: data written before the signal is visible to a
// reader that observes the new value.
//
// A signal window's segment is laid out as: nslots u64 values, nslots i64
// "last signaller" ranks, then a 64-byte notify block {u32 epoch, u32
// waiters}. A signaller bumps the epoch and, when someone sleeps, wakes the
// futex on it; waiters sleep on the epoch instead of spinning (shared futexes
// work across processes that map the same segment).
#pragma once

#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <climits>
#include <cstdint>

namespace fxm {

struct SignalNotify {
  uint32_t epoch;
  uint32_t waiters;
};

// A signal window holds 1 .. kMaxSignalSlots slots, so its segment size never overflows.
constexpr uint64_t kMaxSignalSlots = 1ull << 32;
inline bool signal_slots_valid(uint64_t nslots) { return nslots >= 1 && nslots <= kMaxSignalSlots; }
inline uint64_t signal_segment_bytes(uint64_t nslots) { return nslots * 16 + 64; }
inline int64_t* signal_last_src(uint8_t* base, uint64_t nslots) {
  return reinterpret_cast<int64_t*>(base + nslots * 8);
}
inline SignalNotify* signal_notify(uint8_t* base, uint64_t nslots) {
  return reinterpret_cast<SignalNotify*>(base + nslots * 16);
}

inline void apply_signal(uint64_t* slots, int64_t* last_src, SignalNotify* notify, uint64_t slot,
                         uint64_t value, bool set, int src_rank) {
  if (set) {
    __atomic_store_n(&slots[slot], value, __ATOMIC_SEQ_CST);
  } else {
    __atomic_fetch_add(&slots[slot], value, __ATOMIC_SEQ_CST);
  }
  if (last_src != nullptr) __atomic_store_n(&last_src[slot], src_rank, __ATOMIC_RELAXED);
  if (notify != nullptr) {
    __atomic_fetch_add(&notify->epoch, 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&notify->waiters, __ATOMIC_SEQ_CST) != 0) {
      syscall(SYS_futex, &notify->epoch, FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
    }
  }
}

// Wakes every waiter on the block (they re-check what they wait for).
inline void wake_signal_waiters(SignalNotify* notify) {
  __atomic_fetch_add(&notify->epoch, 1, __ATOMIC_SEQ_CST);
  syscall(SYS_futex, &notify->epoch, FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

inline uint64_t load_signal(const uint64_t* slots, uint64_t slot) {
  return __atomic_load_n(&slots[slot], __ATOMIC_ACQUIRE);
}

// Whether a slot holding `value` has reached `expected`: the rule of every
// signal wait, on the host and on a stream alike. It is the CUDA driver's
// stream wait (cuStreamWaitValue64 GEQ): cyclic, value - expected as a signed
// 64-bit number >= 0, so a value up to 2^63 - 1 ahead of `expected` passes and
// one further ahead counts as behind (docs/gpu.md).
inline bool signal_reached(uint64_t value, uint64_t expected) {
  return static_cast<int64_t>(value - expected) >= 0;
}

// Sleeps while the epoch still equals `seen`, at most `max_ns`.
inline void wait_signal_epoch(SignalNotify* notify, uint32_t seen, long max_ns) {
  timespec ts{max_ns / 1000000000L, max_ns % 1000000000L};
  __atomic_fetch_add(&notify->waiters, 1, __ATOMIC_SEQ_CST);
  syscall(SYS_futex, &notify->epoch, FUTEX_WAIT, seen, &ts, nullptr, 0);
  __atomic_fetch_sub(&notify->waiters, 1, __ATOMIC_SEQ_CST);
}

}  // namespace fxm
