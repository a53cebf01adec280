// Atomic operations on 64-bit signal slots, shared by every path that applies
// a signal (inline through a shared mapping, or the TCP progress thread).
// Release ordering: data written before the signal is visible to a reader
// that observes the new value with acquire ordering.
#pragma once

#include <cstdint>

namespace fxm {

inline void apply_signal(uint64_t* slots, int64_t* last_src, uint64_t slot, uint64_t value,
                         bool set, int src_rank) {
  if (set) {
    __atomic_store_n(&slots[slot], value, __ATOMIC_SEQ_CST);
  } else {
    __atomic_fetch_add(&slots[slot], value, __ATOMIC_SEQ_CST);
  }
  if (last_src != nullptr) __atomic_store_n(&last_src[slot], src_rank, __ATOMIC_RELAXED);
}

inline uint64_t load_signal(const uint64_t* slots, uint64_t slot) {
  return __atomic_load_n(&slots[slot], __ATOMIC_ACQUIRE);
}

}  // namespace fxm
