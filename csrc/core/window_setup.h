// What a registration prepares locally, shared by the mesh's collective
// registration (onesided.cc) and the agent's local one (csrc/agent): the
// window's cma cookie and the description peers reach it by.
#pragma once

#include <cstdint>
#include <string>

#include "core/window.h"

namespace fxm {

// Non-zero (zero is a revoked cookie), from the kernel's random source.
uint64_t random_cookie();

// The description of this process's copy of `w` (kind, size, address, pid,
// host, pid namespace, shm name, cookie); device exports are the caller's.
WindowDesc describe_local(const Window& w, const std::string& host, const std::string& shm_name);

}  // namespace fxm
