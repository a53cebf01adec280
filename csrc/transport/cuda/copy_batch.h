// Device copies of one call issued together. A host thread pays several
// microseconds per cuMemcpyAsync and one more per event (on the H200 machine
// 7.1 and 1.1 us, docs/gpu.md "Batched device copies"), which bounds a batch
// of small blocks far below the copy engines. A CopyBatch queues the plain
// copies of one call (same device, stream and fence), then issues them with
// one cuMemcpyBatchAsync per run of copies that touch none of each other's
// bytes (the driver does not order copies within one call; runs follow each
// other in stream order), records one event after the last, and counts each
// copy as one op of its (peer, context) completing with that event.
// Without cuMemcpyBatchAsync (drivers before 12.8), or with
// FLAGCX_MESH_CUDA_BATCH_COPY=off, each copy is one cuMemcpyAsync; the one
// event stays.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "transport/cuda/driver.h"
#include "transport/path.h"

namespace fxm::cuda {

class StreamFence;

struct BatchedCopy {
  CUdeviceptr dst = 0;
  CUdeviceptr src = 0;
  size_t len = 0;
  PathKind kind = PathKind::kCudaIpc;  // the path the op is counted on
};

class CopyBatch {
 public:
  CopyBatch(Outbox* outbox, int peer, int ctx) : outbox_(outbox), peer_(peer), ctx_(ctx) {}
  // Queues a copy on (ordinal, s) after `fence` (may be null); false when the
  // batch holds copies of another device, stream or fence (issue() them first).
  bool add(int ordinal, CUstream s, StreamFence* fence, const BatchedCopy& c);
  size_t size() const { return copies_.size(); }
  // Issues every queued copy and empties the batch. Returns how many were
  // issued and counted: all, unless the driver refused one (then *error says
  // why, and it and the copies after it were neither issued nor counted).
  size_t issue(std::string* error);
  void clear() { copies_.clear(); }

 private:
  // The end of the run of copies that starts at `from` (none overlaps another's bytes).
  size_t run_end(size_t from) const;
  size_t issue_run(const Driver& d, size_t from, size_t to, std::string* error);
  bool batch_call(const Driver& d, size_t from, size_t to);

  Outbox* outbox_;
  int peer_, ctx_;
  int ordinal_ = -1;
  CUstream stream_ = nullptr;
  StreamFence* fence_ = nullptr;
  std::vector<BatchedCopy> copies_;
};

// Whether batches call cuMemcpyBatchAsync: the driver has it, FLAGCX_MESH_CUDA_BATCH_COPY
// is not "off", and no such call failed in this process yet.
bool batch_copy_enabled(const Driver& d);

}  // namespace fxm::cuda
