// Device copies of one call issued together. A host thread pays several
// microseconds per cuMemcpyAsync and one more per event (on the H200 machine
// 7.1 and 1.1 us, docs/gpu.md "Batched device copies"), which bounds a batch
// of small blocks far below the copy engines. A CopyBatch queues the plain
// copies of one call (same device, stream and fence), then issues each run of
// copies that touch none of each other's bytes (neither a kernel nor the
// driver's batch call orders the copies it is given; runs follow each other
// in stream order) as one launch of the copy kernel (copy_kernel.h), or one
// cuMemcpyBatchAsync, records one event after the last, and counts the
// batch's copies as ops of their (peer, context) completing with that event
// (one probe, polled once). FLAGCX_MESH_CUDA_BATCH_COPY picks: auto (the
// kernel, else the driver's batch call, else one cuMemcpyAsync a copy),
// kernel, driver, off (one cuMemcpyAsync a copy); the one event stays.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "transport/cuda/copy_kernel.h"
#include "transport/cuda/driver.h"
#include "transport/cuda/streams.h"
#include "transport/path.h"

namespace fxm::cuda {

class StreamFence;

struct BatchedCopy {
  CUdeviceptr dst = 0;
  CUdeviceptr src = 0;
  size_t len = 0;
  PathKind kind = PathKind::kCudaIpc;  // the path the op is counted on
  bool kernel = true;  // both ends can be dereferenced by a kernel on the batch's device
};

class CopyBatch {
 public:
  CopyBatch(Outbox* outbox, int peer, int ctx) : outbox_(outbox), peer_(peer), ctx_(ctx) {}
  // Queues a copy on (ordinal, s) after `fence` (may be null); false when the
  // batch holds copies of another device, stream or fence (issue() them first).
  // (Inline: a request queues thousands.)
  bool add(int ordinal, CUstream s, StreamFence* fence, const BatchedCopy& c) {
    if (!copies_.empty() && (ordinal != ordinal_ || s != stream_ || fence != fence_)) return false;
    ordinal_ = ordinal;
    stream_ = s;
    fence_ = fence;
    copies_.push_back(c);
    return true;
  }
  // A copy on the device and stream, after the fence, of the last one added (none: false).
  bool add_more(const BatchedCopy& c) {
    if (copies_.empty()) return false;
    copies_.push_back(c);
    return true;
  }
  size_t size() const { return copies_.size(); }
  // Room for n copies in all, so that a call's many are not moved as the batch grows.
  void reserve(size_t n) { copies_.reserve(n); }
  // Issues every queued copy and empties the batch. Returns how many were
  // issued and counted: all, unless the driver refused one (then *error says
  // why, and it and the copies after it were neither issued nor counted).
  size_t issue(std::string* error);
  // Empties the batch. Lists still here belong to kernels that were launched but whose
  // completion was never recorded (an error on the way): the device may read them, so they are
  // never reused (leaked).
  void clear() {
    copies_.clear();
    for (auto& l : lists_) l.release();
    lists_.clear();
  }

 private:
  // The end of the run of copies that starts at `from` (none overlaps another's bytes).
  size_t run_end(size_t from) const;
  bool disjoint(size_t from) const;  // no copy from `from` on touches bytes another writes
  size_t issue_run(const Driver& d, size_t from, size_t to, std::string* error);
  bool batch_call(const Driver& d, size_t from, size_t to);
  bool kernel_call(size_t from, size_t to);
  bool long_copies(size_t from, size_t to);
  void count_issued(size_t issued);

  Outbox* outbox_;
  int peer_, ctx_;
  int ordinal_ = -1;
  CUstream stream_ = nullptr;
  StreamFence* fence_ = nullptr;
  std::vector<BatchedCopy> copies_;
  std::vector<std::unique_ptr<CopyList>> lists_;  // the kernel's, until the batch's event completed
};

// How runs of copies are issued (FLAGCX_MESH_CUDA_BATCH_COPY, and what failed in this process).
enum class BatchCopy { kKernel, kDriver, kOne };
BatchCopy batch_copy_mode(const Driver& d, int ordinal);
// Loads the copy kernel for `ordinal` now (batch_copy_mode), where the driver is there: device
// paths when they are set up, device windows when registered (a batch of staged ops lands in
// them from the progress thread). A first launch can block behind a stream wait of the context
// (docs/gpu.md, "Traps"), so it is made before any could be queued. A kernel that cannot load
// is said at info: batches then go through the driver.
void prepare_copy_kernel(int ordinal);

// One run of copies (none touches another's bytes) on stream s of device `ordinal`, between its
// memory and page-locked host memory mapped for it (the staged path's gathers and scatters,
// staged_batch.h): one launch of the copy kernel where the mode allows it and `kernel_ok` (the
// host ends are device-addressable as they are), else one cuMemcpyAsync a copy. Returns an event
// recorded after them; *list then holds the kernel's list, to be dropped only once that event
// completed (release() it, never reused, when that is not known). Throws Error naming `doing`
// when the driver refuses a copy (nothing of the run is then known to have happened).
SharedEvent copy_run(int ordinal, CUstream s, const std::vector<KernelCopy>& copies, bool kernel_ok,
                     std::unique_ptr<CopyList>* list, const std::string& doing);
// The same through device scratch (device_scratch.h) of `n` bytes or more, for a run whose host
// ends all lie in page-locked [host, host + n): a gather (to_host) is moved by one launch into the
// scratch, then down by one copy; a scatter up by one copy, then by one launch out of the scratch.
// Where the kernel cannot run, copy_run's copies (the scratch unused).
SharedEvent copy_run_through(int ordinal, CUstream s, const std::vector<KernelCopy>& copies, bool to_host,
                             uint8_t* host, uint64_t n, CUdeviceptr scratch, std::unique_ptr<CopyList>* list,
                             const std::string& doing);

}  // namespace fxm::cuda
