#include "transport/cma/cma_path.h"

#include <cerrno>

#include "base/status.h"
#include "transport/cma/cma.h"
#include "transport/cma/iov_batch.h"
#include "transport/binding.h"

namespace fxm {

int CmaPath::put(const PathOp& op) { return cma::write(pid_, addr_ + op.remote_off, op.local, op.len); }

int CmaPath::get(const PathOp& op) { return cma::read(pid_, addr_ + op.remote_off, op.local, op.len); }

Queued CmaPath::queue_host(const PathOp& op, bool is_get, cma::IovBatch* batch) {
  if (op.sig != nullptr) return Queued::kNo;
  return batch->add(pid_, is_get, op.local, addr_ + op.remote_off, op.len) ? Queued::kYes : Queued::kBatchFirst;
}

std::unique_ptr<Path> make_cma_path(const PathRequest& req, const WindowDesc& d, std::string* why) {
  if (req.forced == ForcedTransport::kTcp) {
    *why = "FLAGCX_MESH_TRANSPORT=tcp";
    return nullptr;
  }
  if (d.kind == WindowKind::kSignal) return nullptr;  // atomics need a shared mapping
  if (req.forced == ForcedTransport::kUcx) {
    *why = "FLAGCX_MESH_TRANSPORT=ucx";
    return nullptr;
  }
  // binding.h: the pid is the peer's process, and the seal it keeps matches this description
  // (its address, size and window index are what the peer registered).
  *why = req.binding ? req.binding->for_cma() : "not bound to the peer";
  if (!why->empty()) return nullptr;
  return std::make_unique<CmaPath>(d.pid, d.addr);
}

}  // namespace fxm
