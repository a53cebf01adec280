#include "transport/self/self_path.h"

#include <cstring>

#include "transport/signal_ops.h"

namespace fxm {

int MappedPath::put(const PathOp& op) {
  std::memmove(base_ + op.remote_off, op.local, op.len);
  return 0;
}

int MappedPath::get(const PathOp& op) {
  std::memmove(op.local, base_ + op.remote_off, op.len);
  return 0;
}

void MappedPath::signal(const PathOp& op, int src_rank) {
  const SignalSpec& s = *op.sig;
  apply_signal(slots_.values, slots_.last_src, slots_.notify, s.slot, s.value, s.set, src_rank);
}

std::unique_ptr<Path> make_self_path(const PathRequest& req, const WindowDesc&, std::string* why) {
  if (req.forced == ForcedTransport::kTcp) {
    *why = "FLAGCX_MESH_TRANSPORT=tcp";
    return nullptr;
  }
  if (req.peer != req.me) return nullptr;
  return std::make_unique<MappedPath>(PathKind::kSelf, req.local_base, req.local_slots);
}

}  // namespace fxm
