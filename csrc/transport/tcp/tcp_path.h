// The tcp path: the peer's progress thread lands the data (any window, any
// host). Asynchronous: put / get / signal post a frame through the Outbox
// (the core's progress engine) and complete when the target acknowledges
// (or answers) it. A signal travels in the frame of its data.
#pragma once

#include "transport/path.h"

namespace fxm {

class TcpPath : public Path {
 public:
  TcpPath(Outbox* outbox, int peer, uint32_t win, bool host_target = false)
      : outbox_(outbox), peer_(peer), win_(win), host_target_(host_target) {}
  PathKind kind() const override { return PathKind::kTcp; }
  bool synchronous() const override { return false; }
  bool carries_signal() const override { return true; }
  bool can_signal() const override { return true; }
  int put(const PathOp& op) override;
  int get(const PathOp& op) override;
  void signal(const PathOp& op, int src_rank) override;
  Queued queue_blocks(const PathOp& op, bool is_get, tcp::BlockBatch* batch) override;

 protected:  // the staged path (transport/cuda) posts through the same outbox, peer and window
  Outbox* outbox_;
  int peer_;
  uint32_t win_;
  bool host_target_;  // the peer's window is host memory: large puts may be striped over lanes
};

// FLAGCX_MESH_TCP_BATCH: whether a call's small tcp writes between host memories go as one frame
// (block_batch.h): "off" no; "auto" (or unset) yes; another value yes, warned once.
bool tcp_batch_wanted();

std::unique_ptr<Path> make_tcp_path(const PathRequest& req, const WindowDesc& d, std::string* why);

}  // namespace fxm
