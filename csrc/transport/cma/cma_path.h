// The cma path: a peer process on this host whose memory this rank reads
// and writes with process_vm_readv / process_vm_writev (synchronous).
//
// Identity: a pid names a process only inside one PID namespace, and a pid
// can be reused; and any rank may publish any pid (another rank's, with that
// rank's cookie and an address of its choosing). The factory takes this path
// only when binding.h bound the description to the peer: on this host (boot
// id, /dev/shm), in this PID namespace, the process behind the pid holds the
// peer's end of this connection (peer_process.h: it is the peer's process),
// and the seal read back through process_vm_readv at the cookie address is
// the seal of the description as presented (the address, size and window
// index are what the peer registered, and the window is open).
#pragma once

#include "transport/path.h"

namespace fxm {

class CmaPath : public Path {
 public:
  CmaPath(pid_t pid, uint64_t addr) : pid_(pid), addr_(addr) {}
  PathKind kind() const override { return PathKind::kCma; }
  int put(const PathOp& op) override;
  int get(const PathOp& op) override;
  Queued queue_host(const PathOp& op, bool is_get, cma::IovBatch* batch) override;

 private:
  pid_t pid_;
  uint64_t addr_;
};

std::unique_ptr<Path> make_cma_path(const PathRequest& req, const WindowDesc& d, std::string* why);

}  // namespace fxm
