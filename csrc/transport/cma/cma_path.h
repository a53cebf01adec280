// The cma path: a peer process on this host whose memory this rank reads
// and writes with process_vm_readv / process_vm_writev (synchronous).
//
// Identity: a pid names a process only inside one PID namespace, and a pid
// can be reused. The factory takes this path only when the peer is on this
// host (boot id, /dev/shm), in this PID namespace, and the window's random
// cookie, read back through process_vm_readv at the published address,
// matches the one the peer published: the process behind that pid is the
// peer that registered the window, at the time of registration.
#pragma once

#include "transport/path.h"

namespace fxm {

class CmaPath : public Path {
 public:
  CmaPath(pid_t pid, uint64_t addr) : pid_(pid), addr_(addr) {}
  PathKind kind() const override { return PathKind::kCma; }
  int put(const PathOp& op) override;
  int get(const PathOp& op) override;

 private:
  pid_t pid_;
  uint64_t addr_;
};

std::unique_ptr<Path> make_cma_path(const PathRequest& req, const WindowDesc& d, std::string* why);

}  // namespace fxm
