#include "transport/cuda/staged_batch.h"

#include <algorithm>

#include "base/env.h"
#include "base/status.h"
#include "transport/byte_ranges.h"
#include "transport/cuda/copy_batch.h"
#include "transport/cuda/device_scratch.h"
#include "transport/cuda/device_memory.h"
#include "transport/cuda/staged_payload.h"
#include "transport/cuda/staging.h"

namespace fxm::cuda {

namespace {

// Where a block lands as one number: a write's (window, offset) (window_key), a read's local address.
uint64_t landing_key(const PathOp& op, uint32_t win, bool is_read) {
  return is_read ? reinterpret_cast<uint64_t>(op.local) : window_key(win, op.remote_off);
}

}  // namespace

bool StagedBatch::add(const PathOp& op, uint32_t win, int remote_device) {
  Frame& f = frame_;
  if (!f.entries.empty() && (op.ctx != ctx_ || op.local_device != device_ || remote_device != remote_device_ ||
                             f.entries.size() >= wire::kMaxBlocksPerFrame || op.len > max_bytes_ - f.bytes)) {
    return false;
  }
  ctx_ = op.ctx;
  device_ = op.local_device;
  remote_device_ = remote_device;
  f.places.emplace_back(op.local, op.len);
  f.starts.push_back(f.bytes);
  wire::BlockEntry e;
  e.win = win;
  e.off = op.remote_off;
  e.len = op.len;
  f.entries.push_back(e);
  f.keys.push_back(landing_key(op, win, is_read_));
  f.bytes += op.len;
  return true;
}

// One sort when no two blocks land on each other's bytes (a request's KV); else an ordered walk
// cuts the batch where a block lands on bytes one before it in its run does.
std::vector<StagedBatch::Frame> StagedBatch::disjoint_runs() {
  Frame& f = frame_;
  std::vector<ByteSpan> spans;
  spans.reserve(f.keys.size());
  for (size_t k = 0; k < f.keys.size(); ++k) spans.push_back({f.keys[k], f.keys[k] + f.places[k].second, true});
  std::vector<Frame> runs;
  if (!any_conflict(spans)) {
    runs.push_back(std::move(f));
    return runs;
  }
  ByteRanges seen;
  for (size_t k = 0; k < f.keys.size(); ++k) {
    uint64_t a = f.keys[k], b = a + f.places[k].second;
    if (runs.empty() || seen.overlaps(a, b)) {
      runs.emplace_back();
      seen = ByteRanges();
    }
    Frame& r = runs.back();
    r.places.push_back(f.places[k]);
    r.starts.push_back(r.bytes);
    r.entries.push_back(f.entries[k]);
    r.bytes += f.places[k].second;
    seen.add(a, b);
  }
  return runs;
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

SharedEvent StagedBatch::gather(const Frame& f, uint64_t from, uint64_t n, uint8_t* dst,
                                std::unique_ptr<CopyList>* list, CUdeviceptr scratch) const {
  uint64_t to = std::min(f.bytes, from + n);
  std::vector<KernelCopy> copies = chunk_pieces(f.places, f.starts, from, to, dst, true);
  std::string doing = "gathering a staged batch for peer " + std::to_string(peer_);
  if (scratch != 0) {
    return copy_run_through(device_, library_stream(device_), copies, true, dst, to - from, scratch, list, doing);
  }
  return copy_run(device_, library_stream(device_), copies, device_addressable(dst), list, doing);
}

void StagedBatch::issue(const Deadline& deadline, const Count& count) {
  if (frame_.entries.empty()) return;
  std::vector<Frame> runs = disjoint_runs();
  frame_ = Frame();
  for (Frame& r : runs) {
    if (is_read_) issue_read(std::move(r), deadline, count);
    else issue_write(std::move(r), deadline, count);
  }
}

// A frame of kStripeMinBytes or more goes over every tcp lane (Outbox::stripes): one payload a
// lane, each the frame's bytes [at, at + len) gathered chunk by chunk, the parts taking turns.
void StagedBatch::issue_write(Frame f, const Deadline& deadline, const Count& count) {
  int lanes = outbox_->stripes(f.bytes);
  std::vector<uint64_t> lens(1, lanes > 1 ? wire::stripe_first(f.bytes, lanes) : f.bytes), starts(1, 0);
  for (int k = 1; k < lanes; ++k) {
    starts.push_back(starts.back() + lens.back());
    lens.push_back(wire::stripe_part(f.bytes, lanes));
  }
  auto parts = StagedPayload::parts(outbox_, peer_, lens, device_, deadline);
  uint64_t chunk = parts[0]->chunk();
  // One scratch serves every chunk: the library stream runs each chunk's gather and copy down in order.
  DeviceScratch scratch = staged_bounce() ? device_scratch(chunk, device_) : nullptr;
  try {
    fill_write(f, parts, lens, starts, deadline, count, scratch);
  } catch (...) {
    if (scratch) new DeviceScratch(scratch);  // copies may still use it: never reused
    throw;
  }
}

void StagedBatch::fill_write(Frame& f, const std::vector<std::shared_ptr<StagedPayload>>& parts,
                             const std::vector<uint64_t>& lens, const std::vector<uint64_t>& starts,
                             const Deadline& deadline, const Count& count, const DeviceScratch& scratch) {
  std::vector<StagedPayload*> filled;
  for (const auto& p : parts) filled.push_back(p.get());
  uint64_t chunk = parts[0]->chunk();
  StagedPayload::fill_parts(
      filled, device_, deadline,
      [&] {
        count(1);
        try {
          outbox_->post_put_blocks(peer_, ctx_, parts, std::move(f.entries));
        } catch (...) {
          count(-1);
          throw;
        }
      },
      [&](size_t k, uint64_t i, uint8_t* dst, std::unique_ptr<CopyList>* list) {
        uint64_t n = std::min(lens[k] - i * chunk, chunk);
        return gather(f, starts[k] + i * chunk, n, dst, list, scratch_address(scratch));
      });
}

// The engine lands the answer through its ring of pinned buffers, each scattered into the
// blocks' destinations while the next fills (core/progress_blocks.cc).
void StagedBatch::issue_read(Frame f, const Deadline& deadline, const Count& count) {
  auto into = std::make_shared<ScatterList>(std::move(f.places));
  count(1);
  try {
    outbox_->post_get_blocks(peer_, ctx_, std::move(f.entries), std::move(into), device_);
  } catch (...) {
    count(-1);
    throw;
  }
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

}  // namespace fxm::cuda
