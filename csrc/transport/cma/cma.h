// Cross-memory attach: copy straight into / out of another local process's
// memory with process_vm_writev / process_vm_readv (needs ptrace permission
// over the target; probe() tells whether the kernel allows it).
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>

namespace fxm::cma {

// 0 on success, else the errno (EPERM when ptrace rules forbid it).
int write(pid_t pid, uint64_t remote_addr, const void* local, size_t len);
int read(pid_t pid, uint64_t remote_addr, void* local, size_t len);
// Reads one byte of the peer's memory to find out whether CMA works.
int probe(pid_t pid, uint64_t remote_addr);

}  // namespace fxm::cma
