#include "transport/cma/cma_path.h"

#include <cerrno>

#include "base/status.h"
#include "transport/cma/cma.h"
#include "transport/cma/peer_process.h"

namespace fxm {

int CmaPath::put(const PathOp& op) { return cma::write(pid_, addr_ + op.remote_off, op.local, op.len); }

int CmaPath::get(const PathOp& op) { return cma::read(pid_, addr_ + op.remote_off, op.local, op.len); }

namespace {

// "" when the process behind d.pid is the peer that published d, else why not.
// The cookie says the process behind the pid holds it (the window is open);
// the pid is then bound to the peer through this rank's connection to it
// (another rank may republish the peer's pid, cookie and cookie address, with
// an address of its choosing).
std::string check_identity(const PathRequest& req, const WindowDesc& d) {
  if (d.host != req.host) return "peer is on another host";
  if (d.pid_ns.empty() || d.pid_ns != req.pid_ns) {
    return "peer is in another PID namespace (" + (d.pid_ns.empty() ? std::string("unknown") : d.pid_ns) +
           ", here " + (req.pid_ns.empty() ? std::string("unknown") : req.pid_ns) + "): its pid means nothing here";
  }
  int err = d.size == 0 ? EINVAL : 0;
  uint64_t cookie = 0;
  if (err == 0) err = cma::read(d.pid, d.cookie_addr, &cookie, sizeof(cookie));
  if (err != 0) return "process_vm_writev not permitted: " + errno_text(err);
  if (cookie != d.cookie) {
    return "pid " + std::to_string(d.pid) + " is not the peer's process here (the window cookie read back does not match)";
  }
  std::string process = cma::holds_other_end(d.pid, req.peer_socket);  // (the read above tells whether cma works)
  if (!process.empty()) return "the published pid is not rank " + std::to_string(req.peer) + "'s process: " + process;
  return "";
}

}  // namespace

std::unique_ptr<Path> make_cma_path(const PathRequest& req, const WindowDesc& d, std::string* why) {
  if (req.forced == ForcedTransport::kTcp) {
    *why = "FLAGCX_MESH_TRANSPORT=tcp";
    return nullptr;
  }
  if (d.kind == WindowKind::kSignal) return nullptr;  // atomics need a shared mapping
  *why = check_identity(req, d);
  if (!why->empty()) return nullptr;
  return std::make_unique<CmaPath>(d.pid, d.addr);
}

}  // namespace fxm
