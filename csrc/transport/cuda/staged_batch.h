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
// Reads likewise (is_read): one kGetBlocks request names the blocks, the target gathers them
// chunk by chunk (one launch a chunk) into the answer's ring, and each chunk that lands here is
// scattered into the blocks' destinations by one launch; a read batch's frames hold at most
// `max_bytes` (the engine's get credit), and the call waits for each one's answer.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "base/clock.h"
#include "base/wire.h"
#include "transport/cuda/copy_kernel.h"
#include "transport/cuda/streams.h"
#include "transport/path.h"

namespace fxm::cuda {

class StagedPayload;

// The pieces of the blocks (at places[k].first, places[k].second bytes, starting at starts[k] in
// the frame's bytes) that the frame's bytes [from, to) cover, as copies into (gather: `gather`
// true) or out of `chunk` (the pinned buffer holding those bytes); a block straddling either end
// is cut there. Shared by the initiator's gathers and the target's answers.
std::vector<KernelCopy> chunk_pieces(const ScatterList& places, const std::vector<uint64_t>& starts, uint64_t from,
                                     uint64_t to, uint8_t* chunk, bool gather);

class StagedBatch {
 public:
  StagedBatch(Outbox* outbox, int peer, bool is_read = false, uint64_t max_bytes = UINT64_MAX)
      : outbox_(outbox), peer_(peer), is_read_(is_read), max_bytes_(max_bytes) {}
  bool is_read() const { return is_read_; }
  // Queues a plain write (read) of op.len bytes of device memory (op.local on op.local_device)
  // to (from) window `win` of the peer at op.remote_off, on device `remote_device` there. False
  // when the batch holds blocks of another context or device, or is full: issue() it first.
  bool add(const PathOp& op, uint32_t win, int remote_device);
  size_t size() const { return frame_.places.size(); }
  // Posts the queued blocks as one frame, or as several in order where blocks of the batch land
  // on each other's bytes (one launch does not order its copies: a later one must still win),
  // and returns once every byte is on the host (the sources may be reused); reads: once every
  // byte landed here (a read that failed lets the copies already queued end first). `count(+1)`
  // runs before each frame is posted (the op it is), `count(-1)` if that post failed. Empties the
  // batch. Throws Error (the deadline, the peer lost, a copy the driver refused), naming the
  // peer; before a frame was posted nothing of it was sent, after it the connection is shut
  // (staged_payload.h).
  using Count = std::function<void(int)>;
  void issue(const Deadline& deadline, const Count& count);

 private:
  struct Frame {
    ScatterList places;            // each block's bytes here
    std::vector<uint64_t> starts;  // where each block's bytes start in the frame's bytes
    std::vector<wire::BlockEntry> entries;
    std::vector<uint64_t> keys;    // where each block lands, as one number (overlap checks)
    uint64_t bytes = 0;
  };
  // The runs of blocks none of which lands on bytes another one of its run lands on.
  std::vector<Frame> disjoint_runs();
  // Queues the copies of the frame's bytes [from, from + n) into `dst` (see StagedPayload::fill_parts).
  // scratch: device scratch the gather passes through (0: none; device_scratch.h).
  SharedEvent gather(const Frame& f, uint64_t from, uint64_t n, uint8_t* dst, std::unique_ptr<CopyList>* list,
                     CUdeviceptr scratch) const;
  void issue_write(Frame f, const Deadline& deadline, const Count& count);
  void fill_write(Frame& f, const std::vector<std::shared_ptr<StagedPayload>>& parts, const std::vector<uint64_t>& lens,
                  const std::vector<uint64_t>& starts, const Deadline& deadline, const Count& count,
                  const std::shared_ptr<void>& scratch);
  void issue_read(Frame f, const Deadline& deadline, const Count& count);

  Outbox* outbox_;
  int peer_;
  bool is_read_;
  uint64_t max_bytes_;
  int ctx_ = 0;
  int device_ = -1;         // the blocks' device here
  int remote_device_ = -1;  // the device of the windows they go to
  Frame frame_;
};

}  // namespace fxm::cuda
