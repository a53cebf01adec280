#include "transport/cuda/copy_batch.h"

#include <algorithm>
#include <atomic>

#include "base/env.h"
#include "transport/byte_ranges.h"
#include "base/log.h"
#include "base/status.h"
#include "transport/cuda/copy_kernel.h"
#include "transport/cuda/device_memory.h"
#include "transport/cuda/staged_payload.h"
#include "transport/cuda/streams.h"

namespace fxm::cuda {
namespace {

std::atomic<bool> batch_failed{false};   // a cuMemcpyBatchAsync failed: no more batch calls
std::atomic<bool> kernel_failed{false};  // a launch of the copy kernel failed: no more launches
// The longest copy the kernel takes: a longer one is one cuMemcpyAsync (the copy engines move it
// at full speed), so a grid is never a few long copies' chunks times many short copies.
constexpr uint64_t kKernelLongest = 4 << 20;

// A batch's completion: its one event, and the copy lists its kernels read until then.
struct BatchDone {
  int ordinal;
  SharedEvent event;
  bool done = false;
  std::string error;
  std::vector<std::unique_ptr<CopyList>> lists;
  ~BatchDone() {
    if (done || lists.empty()) return;
    bool finished = false;
    try {
      finished = event && event_done(event);
    } catch (const Error&) {
    }
    if (!finished) {
      for (auto& l : lists) l.release();  // the device may still read them: never reused
    }
  }
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
    b_->lists.clear();
    return true;
  }
  std::string error() const override { return b_->error; }

 private:
  std::shared_ptr<BatchDone> b_;
};

void warn_once(std::atomic<bool>& failed, int peer, const std::string& what) {
  if (!failed.exchange(true)) FXM_WARN(peer, what);
}

bool driver_batch_usable(const Driver& d) {
  return (d.cuMemcpyBatchAsync13 || d.cuMemcpyBatchAsync12) && !batch_failed.load();
}

}  // namespace

BatchCopy batch_copy_mode(const Driver& d, int ordinal) {
  std::string v = cuda_batch_copy_env();
  bool driver_batch = driver_batch_usable(d);
  if (v == "off") return BatchCopy::kOne;
  if (v == "driver") return driver_batch ? BatchCopy::kDriver : BatchCopy::kOne;
  if (!v.empty() && v != "auto" && v != "on" && v != "kernel") {
    static std::once_flag told;
    std::call_once(told, [&] {
      FXM_WARN(-1, "FLAGCX_MESH_CUDA_BATCH_COPY=" + v + " is none of auto, kernel, driver, off: taken as auto");
    });
  }
  std::string why;
  bool kernel = !kernel_failed.load() && copy_kernel_ready(ordinal, &why);
  if (!why.empty()) {
    FXM_INFO(-1, why + "; batches of device copies go " +
                     (driver_batch ? "through cuMemcpyBatchAsync" : "one cuMemcpyAsync a copy"));
  }
  if (kernel) return BatchCopy::kKernel;
  return driver_batch ? BatchCopy::kDriver : BatchCopy::kOne;
}

void prepare_copy_kernel(int ordinal) {
  try {
    if (const Driver* d = driver()) batch_copy_mode(*d, ordinal);
  } catch (const Error& e) {  // the paths work without it: batches then go through the driver
    FXM_INFO(-1, std::string("the copy kernel is not ready on device ") + std::to_string(ordinal) + ": " + e.what());
  }
}

// One sort instead of a map per copy (copies touching their own bytes count as a conflict
// too: the ordered walk below then decides). When every byte read lies outside the span of
// those written (a request: the peer's memory written, this one's read, or the other way),
// no read can meet a write: only the written ranges are sorted, half as many.
bool CopyBatch::disjoint(size_t from) const {
  std::vector<ByteSpan> spans;
  spans.reserve(2 * (copies_.size() - from));
  CUdeviceptr dst_lo = ~CUdeviceptr{0}, dst_hi = 0, src_lo = ~CUdeviceptr{0}, src_hi = 0;
  for (size_t i = from; i < copies_.size(); ++i) {
    const BatchedCopy& c = copies_[i];
    spans.push_back({c.dst, c.dst + c.len, true});
    dst_lo = std::min(dst_lo, c.dst);
    dst_hi = std::max(dst_hi, c.dst + c.len);
    src_lo = std::min(src_lo, c.src);
    src_hi = std::max(src_hi, c.src + c.len);
  }
  if (src_lo < dst_hi && dst_lo < src_hi) {  // the reads' span meets the writes'
    for (size_t i = from; i < copies_.size(); ++i) {
      const BatchedCopy& c = copies_[i];
      spans.push_back({c.src, c.src + c.len, false});
    }
  }
  return !any_conflict(spans);
}

// The sweep runs once per batch: when the whole batch is disjoint it is one run; otherwise the
// ordered walk cuts it (a sweep per run would make a batch of many runs quadratic).
size_t CopyBatch::run_end(size_t from) const {
  if (copies_.size() - from <= 1) return copies_.size();  // one copy: nothing to order it against
  if (from == 0 && disjoint(0)) return copies_.size();
  ByteRanges written, read;
  size_t i = from;
  for (; i < copies_.size(); ++i) {
    const BatchedCopy& c = copies_[i];
    CUdeviceptr d0 = c.dst, d1 = c.dst + c.len, s0 = c.src, s1 = c.src + c.len;
    if (i > from && (written.overlaps(d0, d1) || read.overlaps(d0, d1) || written.overlaps(s0, s1))) break;
    written.add(d0, d1);
    read.add(s0, s1);
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
  warn_once(batch_failed, peer_, "cuMemcpyBatchAsync of " + std::to_string(n) + " device copies failed (" +
                                     result_text(r) + "): device copies are issued one at a time from now on");
  return false;
}

// The run's copies into a page-locked list, and one launch that reads it.
bool CopyBatch::kernel_call(size_t from, size_t to) {
  size_t n = to - from, small = 0;  // by the kernel; longer ones by the copy engines (the run is disjoint: any order)
  for (size_t i = from; i < to; ++i) {
    if (!copies_[i].kernel) return false;  // an end the kernel's device cannot dereference: the driver copies
    small += copies_[i].len <= kKernelLongest;
  }
  if (small < 2) return false;
  std::unique_ptr<CopyList> list;
  try {
    list = copy_list(small, ordinal_);
  } catch (const Error& e) {  // no page-locked memory for the list: this run goes through the driver
    FXM_WARN(peer_, std::string("a list for the copy kernel: ") + e.what() + "; " + std::to_string(n) +
                        " copies go through the driver");
    return false;
  }
  KernelCopy* e = list->entries();
  uint64_t longest = 0;
  for (size_t i = from, k = 0; i < to; ++i) {
    const BatchedCopy& c = copies_[i];
    if (c.len > kKernelLongest) continue;
    e[k++] = {c.dst, c.src, c.len};
    longest = std::max<uint64_t>(longest, c.len);
  }
  CUresult r = launch_copies(ordinal_, stream_, *list, small, longest);
  if (r == kSuccess) {
    lists_.push_back(std::move(list));
    return small == n || long_copies(from, to);
  }
  warn_once(kernel_failed, peer_, "launching the copy kernel for " + std::to_string(n) + " device copies failed (" +
                                      result_text(r) + "): batches go through the driver's copies from now on");
  return false;
}

// The run's copies the kernel left (longer than kKernelLongest), one cuMemcpyAsync each. The
// kernel's launch is already queued: a refusal here is an error of the run.
bool CopyBatch::long_copies(size_t from, size_t to) {
  const Driver& d = *driver();
  for (size_t i = from; i < to; ++i) {
    const BatchedCopy& c = copies_[i];
    if (c.len <= kKernelLongest) continue;
    CUresult r = d.cuMemcpyAsync(c.dst, c.src, c.len, stream_);
    if (r != kSuccess) fail(Code::kSystem, peer_, 0, std::string("cuMemcpyAsync over ") + path_name(c.kind) + ": " + result_text(r));
  }
  return true;
}

// A run is idempotent (no copy reads or writes what another writes): after a
// failed kernel launch or batch call its copies are issued again another way.
size_t CopyBatch::issue_run(const Driver& d, size_t from, size_t to, std::string* error) {
  if (to - from > 1) {
    BatchCopy mode = batch_copy_mode(d, ordinal_);
    if (mode == BatchCopy::kKernel && kernel_call(from, to)) return to;
    // The kernel did not take the run (an end its device cannot reach, or its launch failed):
    // the driver's batch call, where there is one, rather than a copy call per copy.
    if (mode == BatchCopy::kKernel) mode = driver_batch_usable(d) ? BatchCopy::kDriver : BatchCopy::kOne;
    if (mode == BatchCopy::kDriver && batch_call(d, from, to)) return to;
  }
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

// One probe per stretch of copies on one path, all completing with the batch's one event.
void CopyBatch::count_issued(size_t issued) {
  auto done = std::make_shared<BatchDone>();
  done->ordinal = ordinal_;
  done->lists = std::move(lists_);  // (should the record throw, the lists are never reused)
  lists_.clear();
  done->event = record_event(ordinal_, stream_);
  if (fence_) fence_->after(stream_, done->event);
  for (size_t i = 0; i < issued;) {
    size_t j = i + 1;
    while (j < issued && copies_[j].kind == copies_[i].kind) ++j;
    outbox_->issued_probe(peer_, ctx_, copies_[i].kind, std::make_unique<BatchProbe>(done), j - i);
    i = j;
  }
}

namespace {

// The run's copies in one list and one launch; false (nothing queued) where it cannot be.
bool launch_run(int ordinal, CUstream s, const std::vector<KernelCopy>& copies, std::unique_ptr<CopyList>* list) {
  std::unique_ptr<CopyList> l;
  try {
    l = copy_list(copies.size(), ordinal);
  } catch (const Error& e) {
    FXM_WARN(-1, std::string("a list for the copy kernel: ") + e.what() + "; these copies go through the driver");
    return false;
  }
  uint64_t longest = 0;
  KernelCopy* e = l->entries();
  for (size_t k = 0; k < copies.size(); ++k) {
    e[k] = copies[k];
    longest = std::max<uint64_t>(longest, copies[k].len);
  }
  CUresult r = launch_copies(ordinal, s, *l, copies.size(), longest, staged_kernel_bytes());
  if (r == kSuccess) {
    *list = std::move(l);
    return true;
  }
  warn_once(kernel_failed, -1, "launching the copy kernel for " + std::to_string(copies.size()) +
                                   " staged copies failed (" + result_text(r) +
                                   "): batches go through the driver's copies from now on");
  return false;
}

}  // namespace

namespace {

// One copy on s through the driver (Error naming `doing` when it refuses).
void driver_copy(const Driver& d, CUdeviceptr dst, CUdeviceptr src, uint64_t n, CUstream s, const std::string& doing) {
  CUresult r = d.cuMemcpyAsync(dst, src, n, s);
  if (r != kSuccess) fail(Code::kSystem, -1, 0, doing + ": cuMemcpyAsync: " + result_text(r));
}

// copy_run's copies queued on s, without the event after them.
void queue_run(const Driver& d, int ordinal, CUstream s, const std::vector<KernelCopy>& copies, bool kernel_ok,
               std::unique_ptr<CopyList>* list, const std::string& doing) {
  bool kernel = kernel_ok && copies.size() > 1 && batch_copy_mode(d, ordinal) == BatchCopy::kKernel;
  if (kernel && launch_run(ordinal, s, copies, list)) return;
  for (const KernelCopy& c : copies) driver_copy(d, c.dst, c.src, c.len, s, doing);
}

}  // namespace

SharedEvent copy_run(int ordinal, CUstream s, const std::vector<KernelCopy>& copies, bool kernel_ok,
                     std::unique_ptr<CopyList>* list, const std::string& doing) {
  const Driver& d = need_driver(doing);
  use_device(ordinal);
  queue_run(d, ordinal, s, copies, kernel_ok, list, doing);
  return record_event(ordinal, s);
}

SharedEvent copy_run_through(int ordinal, CUstream s, const std::vector<KernelCopy>& copies, bool to_host,
                             uint8_t* host, uint64_t n, CUdeviceptr scratch, std::unique_ptr<CopyList>* list,
                             const std::string& doing) {
  const Driver& d = need_driver(doing);
  use_device(ordinal);
  if (copies.size() <= 1 || batch_copy_mode(d, ordinal) != BatchCopy::kKernel) {
    return copy_run(ordinal, s, copies, false, list, doing);
  }
  auto h = reinterpret_cast<CUdeviceptr>(host);
  std::vector<KernelCopy> within = copies;  // each host end moved to the same place in the scratch
  for (KernelCopy& c : within) (to_host ? c.dst : c.src) = scratch + ((to_host ? c.dst : c.src) - h);
  if (!to_host) driver_copy(d, scratch, h, n, s, doing);  // up, then scattered
  queue_run(d, ordinal, s, within, true, list, doing);
  if (to_host) driver_copy(d, h, scratch, n, s, doing);  // gathered, then down
  return record_event(ordinal, s);
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
  if (issued > 0) count_issued(issued);
  clear();
  return issued;
}

}  // namespace fxm::cuda
