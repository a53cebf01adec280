#include "transport/cuda/staged_batch.h"

#include <algorithm>

#include "base/status.h"
#include "transport/cuda/copy_batch.h"
#include "transport/cuda/device_memory.h"
#include "transport/cuda/staged_payload.h"
#include "transport/cuda/staging.h"

namespace fxm::cuda {

bool StagedBatch::add(const PathOp& op, uint32_t win, int remote_device) {
  if (!entries_.empty() && (op.ctx != ctx_ || op.local_device != device_ || remote_device != remote_device_ ||
                            entries_.size() >= wire::kMaxBlocksPerFrame)) {
    return false;
  }
  ctx_ = op.ctx;
  device_ = op.local_device;
  remote_device_ = remote_device;
  blocks_.push_back({op.local, bytes_, op.len});
  wire::BlockEntry e;
  e.win = win;
  e.off = op.remote_off;
  e.len = op.len;
  entries_.push_back(e);
  bytes_ += op.len;
  return true;
}

// The pieces of the blocks that chunk i covers, blocks straddling its ends cut at them.
SharedEvent StagedBatch::gather(uint64_t chunk, uint64_t i, uint8_t* dst, std::unique_ptr<CopyList>* list) const {
  uint64_t from = i * chunk, to = std::min(bytes_, from + chunk);
  auto first = std::upper_bound(blocks_.begin(), blocks_.end(), from,
                                [](uint64_t at, const Block& b) { return at < b.at; });
  std::vector<KernelCopy> copies;
  for (size_t k = static_cast<size_t>(first - blocks_.begin()) - 1; k < blocks_.size() && blocks_[k].at < to; ++k) {
    uint64_t lo = std::max(from, blocks_[k].at), hi = std::min(to, blocks_[k].at + blocks_[k].len);
    if (hi <= lo) continue;  // (an empty block)
    copies.push_back({reinterpret_cast<CUdeviceptr>(dst + (lo - from)),
                      reinterpret_cast<CUdeviceptr>(blocks_[k].src + (lo - blocks_[k].at)), hi - lo});
  }
  return copy_run(device_, library_stream(device_), copies, device_addressable(dst), list,
                  "gathering a staged batch for peer " + std::to_string(peer_));
}

void StagedBatch::issue(const Deadline& deadline, bool* posted) {
  *posted = false;
  if (entries_.empty()) return;
  try {
    auto payload = std::make_shared<StagedPayload>(outbox_, peer_, bytes_, device_, deadline);
    uint64_t chunk = payload->chunk();
    payload->fill_queued(
        device_, deadline,
        [&] {
          outbox_->post_put_blocks(peer_, ctx_, payload, std::move(entries_));
          *posted = true;
        },
        [&](uint64_t i, uint8_t* dst, std::unique_ptr<CopyList>* list) { return gather(chunk, i, dst, list); });
  } catch (...) {
    clear();
    throw;
  }
  clear();
}

void StagedBatch::clear() {
  blocks_.clear();
  entries_.clear();
  bytes_ = 0;
}

}  // namespace fxm::cuda
