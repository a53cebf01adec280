// A call's staged writes to one peer as one op. One request's KV cache is thousands of blocks
// scattered in device memory; sent one staged put each, every block paid a copy down, a frame,
// a landing and an ack of its own (a 4096 x 64 KiB request moved at 1.8 GB/s on an H100). A
// StagedBatch gathers the blocks of one call, chunk after chunk, into the ring of pinned
// staging of one StagedPayload (staged_payload.h) with one launch of the copy kernel a chunk
// (copy_batch.h: copy_run; the driver's copies where the kernel cannot run), and posts them as
// one kPutBlocks frame (base/wire.h): the block list (window, offset, length of each), then
// their bytes in list order, sent while later chunks are gathered. The target checks every
// block against its registered window before any byte lands, scatters each chunk it received
// with one launch and acknowledges the frame once (core/progress_blocks.cc): one completion
// for the batch here. A batch holds the blocks of one source device to windows of one device
// of the peer, at most wire::kMaxBlocksPerFrame of them; more make several frames.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "base/clock.h"
#include "base/wire.h"
#include "transport/cuda/copy_kernel.h"
#include "transport/cuda/streams.h"
#include "transport/path.h"

namespace fxm::cuda {

class StagedBatch {
 public:
  StagedBatch(Outbox* outbox, int peer) : outbox_(outbox), peer_(peer) {}
  // Queues a plain write of op.len bytes of device memory (op.local on op.local_device) to
  // window `win` of the peer at op.remote_off, on device `remote_device` there. False when the
  // batch holds blocks of another context or device, or is full: issue() it first.
  bool add(const PathOp& op, uint32_t win, int remote_device);
  size_t size() const { return blocks_.size(); }
  // Posts the queued blocks as one frame (the op is counted then: *posted true) and returns once
  // every byte is on the host (the sources may be reused). Empties the batch. Throws Error (the
  // deadline, the peer lost, a copy the driver refused), naming the peer; before the frame was
  // posted nothing was sent, after it the connection is shut (staged_payload.h).
  void issue(const Deadline& deadline, bool* posted);

 private:
  struct Block {
    const uint8_t* src;
    uint64_t at;  // where its bytes start in the frame's bytes
    uint64_t len;
  };
  // Queues the copies of chunk i of the frame's bytes into `dst` (see StagedPayload::fill_queued).
  SharedEvent gather(uint64_t chunk, uint64_t i, uint8_t* dst, std::unique_ptr<CopyList>* list) const;
  void clear();

  Outbox* outbox_;
  int peer_;
  int ctx_ = 0;
  int device_ = -1;         // the blocks' device here
  int remote_device_ = -1;  // the device of the windows they go to
  std::vector<Block> blocks_;             // (the gather's: entries_ goes with the frame once posted)
  std::vector<wire::BlockEntry> entries_;
  uint64_t bytes_ = 0;
};

}  // namespace fxm::cuda
