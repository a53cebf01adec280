#include "transport/cuda/staged_batch.h"

#include <algorithm>

#include "base/env.h"
#include "base/status.h"
#include "transport/cuda/copy_batch.h"
#include "transport/cuda/device_memory.h"
#include "transport/cuda/staged_payload.h"
#include "transport/cuda/staging.h"

namespace fxm::cuda {

bool StagedBatch::add(const PathOp& op, uint32_t win, int remote_device) {
  if (!entries_.empty() && (op.ctx != ctx_ || op.local_device != device_ || remote_device != remote_device_ ||
                            entries_.size() >= wire::kMaxBlocksPerFrame || op.len > max_bytes_ - bytes_)) {
    return false;
  }
  ctx_ = op.ctx;
  device_ = op.local_device;
  remote_device_ = remote_device;
  places_.emplace_back(op.local, op.len);
  starts_.push_back(bytes_);
  wire::BlockEntry e;
  e.win = win;
  e.off = op.remote_off;
  e.len = op.len;
  entries_.push_back(e);
  bytes_ += op.len;
  return true;
}

std::vector<KernelCopy> chunk_pieces(const ScatterList& places, const std::vector<uint64_t>& starts, uint64_t from,
                                     uint64_t to, uint8_t* chunk, bool gather) {
  size_t k = static_cast<size_t>(std::upper_bound(starts.begin(), starts.end(), from) - starts.begin()) - 1;
  std::vector<KernelCopy> copies;
  for (; k < places.size() && starts[k] < to; ++k) {
    uint64_t lo = std::max(from, starts[k]), hi = std::min(to, starts[k] + places[k].second);
    if (hi <= lo) continue;  // (an empty block)
    auto here = reinterpret_cast<CUdeviceptr>(chunk + (lo - from));
    auto there = reinterpret_cast<CUdeviceptr>(places[k].first + (lo - starts[k]));
    copies.push_back(gather ? KernelCopy{here, there, hi - lo} : KernelCopy{there, here, hi - lo});
  }
  return copies;
}

SharedEvent StagedBatch::gather(uint64_t chunk, uint64_t i, uint8_t* dst, std::unique_ptr<CopyList>* list) const {
  uint64_t from = i * chunk;
  std::vector<KernelCopy> copies = chunk_pieces(places_, starts_, from, std::min(bytes_, from + chunk), dst, true);
  return copy_run(device_, library_stream(device_), copies, device_addressable(dst), list,
                  "gathering a staged batch for peer " + std::to_string(peer_));
}

void StagedBatch::issue(const Deadline& deadline, bool* posted) {
  *posted = false;
  if (entries_.empty()) return;
  try {
    if (is_read_) issue_read(deadline, posted);
    else issue_write(deadline, posted);
  } catch (...) {
    clear();
    throw;
  }
  clear();
}

void StagedBatch::issue_write(const Deadline& deadline, bool* posted) {
  auto payload = std::make_shared<StagedPayload>(outbox_, peer_, bytes_, device_, deadline);
  uint64_t chunk = payload->chunk();
  payload->fill_queued(
      device_, deadline,
      [&] {
        outbox_->post_put_blocks(peer_, ctx_, payload, std::move(entries_));
        *posted = true;
      },
      [&](uint64_t i, uint8_t* dst, std::unique_ptr<CopyList>* list) { return gather(chunk, i, dst, list); });
}

// The engine lands the answer through its ring of pinned buffers, each scattered into the
// blocks' destinations while the next fills (core/progress_blocks.cc).
void StagedBatch::issue_read(const Deadline& deadline, bool* posted) {
  auto into = std::make_shared<ScatterList>(std::move(places_));
  outbox_->post_get_blocks(peer_, ctx_, std::move(entries_), std::move(into), device_);
  *posted = true;
  try {
    outbox_->wait_idle(peer_, ctx_, deadline);
  } catch (...) {
    // Scatters queued before the read failed may still run: let them end first (bounded; none
    // is queued once it failed), so none writes after the call returned.
    try {
      wait_for_stream(device_, landing_stream(device_), Deadline::after_seconds(env_config().timeout_s),
                      "a failed batch of staged reads' copies up");
    } catch (const Error&) {  // the read's own error is the one to raise
    }
    throw;
  }
}

void StagedBatch::clear() {
  places_.clear();
  starts_.clear();
  entries_.clear();
  bytes_ = 0;
}

}  // namespace fxm::cuda
