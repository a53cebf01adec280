// How a listener bounds the connections that have not proved the key yet (the mesh builder's
// and the agent's): beyond the bound it closes the oldest without a valid header (else the
// oldest), so a flood of idle or garbage connections cannot crowd out a peer that is halfway
// through its handshake.
#pragma once

#include <cstddef>

namespace fxm {

// The pending connection to close, or nullptr while fewer than `bound` are live. `Pending`
// has `finished` (closed or handed on) and `header_ok` (its header was valid).
template <class List>
auto* pending_victim(List& pending, size_t bound) {
  size_t live = 0;
  decltype(&*pending.begin()) victim = nullptr;
  for (auto& in : pending) {
    if (in.finished) continue;
    ++live;
    if (!victim || (victim->header_ok && !in.header_ok)) victim = &in;
  }
  return live >= bound ? victim : nullptr;
}

}  // namespace fxm
