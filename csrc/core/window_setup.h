// What a registration prepares locally, shared by the mesh's collective
// registration (onesided.cc) and the agent's local one (csrc/agent): the
// window's cma cookie, the description peers reach it by and a device window's
// memory and exports.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "core/window.h"

namespace fxm {

// Non-zero (zero is a revoked cookie), from the kernel's random source.
uint64_t random_cookie();

// The description of this process's copy of `w` (kind, size, address, pid,
// host, pid namespace, shm name, cookie); device exports are the caller's.
WindowDesc describe_local(const Window& w, const std::string& host, const std::string& shm_name);

// Publishes the seal of `d` (the window's full description) where peers read
// it back (*w.cookie): binding.h. Call once the description is complete.
void seal_window(Window& w, const WindowDesc& d);

// A window over the user's device memory [base, base + size) (throws
// InvalidArgument when it is not device memory of one allocation).
std::shared_ptr<Window> wrap_device_window(void* base, uint64_t size);

// A device window's exports for peers, into *d: its legacy IPC handle and its
// cuMem mappings, whose fds w.fd_server then serves to those who send the
// random token published with them (until the caller drops the server and
// w.dev's fds). Each refusal of the driver is kept in d->dev for describe().
void export_device(Window& w, WindowDesc* d);

}  // namespace fxm
