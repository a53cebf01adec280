#include "transport/tcp/block_batch.h"

namespace fxm::tcp {

bool BlockBatch::add(const PathOp& op, uint32_t win) {
  if (!entries_.empty() && (op.ctx != ctx_ || entries_.size() >= wire::kMaxBlocksPerFrame ||
                            op.len > kMaxFrameBytes - bytes_)) {
    return false;
  }
  ctx_ = op.ctx;
  bytes_ += op.len;
  wire::BlockEntry e;
  e.win = win;
  e.off = op.remote_off;
  e.len = op.len;
  entries_.push_back(e);
  sources_.emplace_back(op.local, op.len);
  return true;
}

}  // namespace fxm::tcp
