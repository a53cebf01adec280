#include "transport/cma/cma_path.h"

#include <cerrno>

#include "base/status.h"
#include "transport/cma/cma.h"

namespace fxm {

int CmaPath::put(const PathOp& op) { return cma::write(pid_, addr_ + op.remote_off, op.local, op.len); }

int CmaPath::get(const PathOp& op) { return cma::read(pid_, addr_ + op.remote_off, op.local, op.len); }

namespace {

// "" when process_vm_writev reaches the peer's window, else why not.
std::string check_identity(const PathRequest& req, const WindowDesc& d) {
  if (d.host != req.host) return "peer is on another host";
  int err = d.size == 0 ? EINVAL : cma::probe(d.pid, d.addr);
  if (err != 0) return "process_vm_writev not permitted: " + errno_text(err);
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
