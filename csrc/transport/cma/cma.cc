#include "transport/cma/cma.h"

#include <sys/uio.h>

#include <cerrno>

namespace fxm::cma {
namespace {

template <typename Fn>
int transfer(Fn fn, pid_t pid, uint64_t remote_addr, void* local, size_t len) {
  size_t done = 0;
  while (done < len) {
    iovec l{static_cast<char*>(local) + done, len - done};
    iovec r{reinterpret_cast<void*>(remote_addr + done), len - done};
    ssize_t n = fn(pid, &l, 1, &r, 1, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    if (n == 0) return EFAULT;
    done += static_cast<size_t>(n);
  }
  return 0;
}

}  // namespace

int write(pid_t pid, uint64_t remote_addr, const void* local, size_t len) {
  return transfer(process_vm_writev, pid, remote_addr, const_cast<void*>(local), len);
}

int read(pid_t pid, uint64_t remote_addr, void* local, size_t len) {
  return transfer(process_vm_readv, pid, remote_addr, local, len);
}

int probe(pid_t pid, uint64_t remote_addr) {
  uint8_t b;
  return read(pid, remote_addr, &b, 1);
}

}  // namespace fxm::cma
