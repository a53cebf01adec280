#include "transport/cuda/copy_batch.h"

#include <atomic>

#include "base/env.h"
#include "base/log.h"
#include "base/status.h"
#include "transport/cuda/device_memory.h"
#include "transport/cuda/streams.h"

namespace fxm::cuda {
namespace {

std::atomic<bool> batch_failed{false};  // a cuMemcpyBatchAsync failed: copies go one at a time

// Disjoint byte ranges [start, end) by start.
using Ranges = std::map<CUdeviceptr, CUdeviceptr>;

bool overlaps(const Ranges& r, CUdeviceptr a, CUdeviceptr b) {
  auto it = r.lower_bound(b);  // the first range starting at or after b cannot overlap
  return it != r.begin() && std::prev(it)->second > a;
}

void insert(Ranges& r, CUdeviceptr a, CUdeviceptr b) {
  auto it = r.lower_bound(a);
  if (it != r.begin() && std::prev(it)->second >= a) --it;  // merges with the range before
  while (it != r.end() && it->first <= b) {
    a = std::min(a, it->first);
    b = std::max(b, it->second);
    it = r.erase(it);
  }
  r.emplace(a, b);
}

// Each probe of one batch asks the one event once: the first that sees it done tells the others.
struct BatchDone {
  int ordinal;
  SharedEvent event;
  bool done = false;
  std::string error;
};

class BatchProbe : public CompletionProbe {
 public:
  explicit BatchProbe(std::shared_ptr<BatchDone> b) : b_(std::move(b)) {}
  bool done() override {
    if (b_->done) return true;  // probes are polled under the outbox's lock, in issue order
    use_device(b_->ordinal);
    CUresult r = driver()->cuEventQuery(b_->event.get());
    if (r == kErrNotReady) return false;
    if (r != kSuccess) b_->error = "a device copy failed on its stream: " + result_text(r);
    b_->done = true;
    return true;
  }
  std::string error() const override { return b_->error; }

 private:
  std::shared_ptr<BatchDone> b_;
};

}  // namespace

bool batch_copy_enabled(const Driver& d) {
  if (!d.cuMemcpyBatchAsync13 && !d.cuMemcpyBatchAsync12) return false;
  if (batch_failed.load(std::memory_order_relaxed)) return false;
  std::string v = cuda_batch_copy_env();
  if (v.empty() || v == "auto" || v == "on") return true;
  if (v == "off") return false;
  static std::once_flag told;
  std::call_once(told, [&] {
    FXM_WARN(-1, "FLAGCX_MESH_CUDA_BATCH_COPY=" + v + " is neither auto nor off: taken as auto");
  });
  return true;
}

bool CopyBatch::add(int ordinal, CUstream s, StreamFence* fence, const BatchedCopy& c) {
  if (!copies_.empty() && (ordinal != ordinal_ || s != stream_ || fence != fence_)) return false;
  ordinal_ = ordinal;
  stream_ = s;
  fence_ = fence;
  copies_.push_back(c);
  return true;
}

size_t CopyBatch::run_end(size_t from) const {
  if (copies_.size() - from <= 1) return copies_.size();  // one copy: nothing to order it against
  Ranges written, read;
  size_t i = from;
  for (; i < copies_.size(); ++i) {
    const BatchedCopy& c = copies_[i];
    CUdeviceptr d0 = c.dst, d1 = c.dst + c.len, s0 = c.src, s1 = c.src + c.len;
    if (i > from && (overlaps(written, d0, d1) || overlaps(read, d0, d1) || overlaps(written, s0, s1))) break;
    insert(written, d0, d1);
    insert(read, s0, s1);
  }
  return i;
}

bool CopyBatch::batch_call(const Driver& d, size_t from, size_t to) {
  size_t n = to - from;
  std::vector<CUdeviceptr> dsts(n), srcs(n);
  std::vector<size_t> sizes(n);
  for (size_t i = 0; i < n; ++i) {
    dsts[i] = copies_[from + i].dst;
    srcs[i] = copies_[from + i].src;
    sizes[i] = copies_[from + i].len;
  }
  MemcpyAttributes attr{kSrcAccessOrderStream, {kLocationDevice, ordinal_}, {kLocationDevice, ordinal_}, 0};
  size_t attr_at = 0, failed_at = 0;
  CUresult r = d.cuMemcpyBatchAsync13
                   ? d.cuMemcpyBatchAsync13(dsts.data(), srcs.data(), sizes.data(), n, &attr, &attr_at, 1, stream_)
                   : d.cuMemcpyBatchAsync12(dsts.data(), srcs.data(), sizes.data(), n, &attr, &attr_at, 1,
                                            &failed_at, stream_);
  if (r == kSuccess) return true;
  if (!batch_failed.exchange(true)) {
    FXM_WARN(peer_, "cuMemcpyBatchAsync of " + std::to_string(n) + " device copies failed (" + result_text(r) +
                        "): device copies are issued one at a time from now on");
  }
  return false;
}

// A run is idempotent (no copy reads or writes what another writes): after a
// failed batch call its copies are issued again one at a time.
size_t CopyBatch::issue_run(const Driver& d, size_t from, size_t to, std::string* error) {
  if (to - from > 1 && batch_copy_enabled(d) && batch_call(d, from, to)) return to;
  for (size_t i = from; i < to; ++i) {
    const BatchedCopy& c = copies_[i];
    CUresult r = d.cuMemcpyAsync(c.dst, c.src, c.len, stream_);
    if (r != kSuccess) {
      *error = std::string("cuMemcpyAsync over ") + path_name(c.kind) + ": " + result_text(r);
      return i;
    }
  }
  return to;
}

size_t CopyBatch::issue(std::string* error) {
  if (copies_.empty()) return 0;
  const Driver& d = need_driver("a batch of device copies");
  use_device(ordinal_);
  if (fence_) fence_->before(stream_);
  size_t issued = 0;
  while (issued < copies_.size()) {
    size_t end = run_end(issued);
    size_t got = issue_run(d, issued, end, error);
    issued = got;
    if (got < end) break;
  }
  if (issued > 0) {
    auto done = std::make_shared<BatchDone>();
    done->ordinal = ordinal_;
    done->event = record_event(ordinal_, stream_);
    if (fence_) fence_->after(stream_, done->event);
    for (size_t i = 0; i < issued; ++i) {
      outbox_->issued_probe(peer_, ctx_, copies_[i].kind, std::make_unique<BatchProbe>(done));
    }
  }
  copies_.clear();
  return issued;
}

}  // namespace fxm::cuda
