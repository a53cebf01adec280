#include "transport/tcp/tcp_path.h"

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

std::unique_ptr<Path> make_tcp_path(const PathRequest& req, const WindowDesc& d, std::string*) {
  return std::make_unique<TcpPath>(req.outbox, req.peer, req.win_index, d.kind != WindowKind::kDevice);
}

}  // namespace fxm
