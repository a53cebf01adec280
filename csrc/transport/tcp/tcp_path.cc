#include "transport/tcp/tcp_path.h"

#include <mutex>

#include "base/env.h"
#include "base/log.h"
#include "transport/tcp/block_batch.h"

namespace fxm {

int TcpPath::put(const PathOp& op) {
  static const SignalSpec kNone;
  outbox_->post_put(peer_, op.ctx, op.local, op.len, win_, op.remote_off, op.sig ? *op.sig : kNone,
                     host_target_);
  return 0;
}

int TcpPath::get(const PathOp& op) {
  outbox_->post_get(peer_, op.ctx, win_, op.remote_off, op.local, op.len);
  return 0;
}

void TcpPath::signal(const PathOp& op, int) {
  outbox_->post_put(peer_, op.ctx, nullptr, 0, 0, 0, *op.sig);  // no data window involved
}

// A plain write from host memory into a host window (no signal, at most kMaxBlockBytes): one
// block of the call's batch (block_batch.h).
Queued TcpPath::queue_blocks(const PathOp& op, bool is_get, tcp::BlockBatch* batch) {
  if (is_get || kind() != PathKind::kTcp || !host_target_ || op.sig != nullptr || op.stream_set || op.wait_here ||
      op.local_device >= 0 || op.len == 0 || op.len > tcp::BlockBatch::kMaxBlockBytes) {
    return Queued::kNo;
  }
  return batch->add(op, win_) ? Queued::kYes : Queued::kBatchFirst;
}

bool tcp_batch_wanted() {
  std::string v = tcp_batch_env();
  if (v == "off") return false;
  if (!v.empty() && v != "auto") {
    static std::once_flag told;
    std::call_once(told, [&] { FXM_WARN(-1, "FLAGCX_MESH_TCP_BATCH=" + v + " is neither auto nor off: taken as auto"); });
  }
  return true;
}

std::unique_ptr<Path> make_tcp_path(const PathRequest& req, const WindowDesc& d, std::string*) {
  return std::make_unique<TcpPath>(req.outbox, req.peer, req.win_index, d.kind != WindowKind::kDevice);
}

}  // namespace fxm
