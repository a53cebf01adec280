// A call's small tcp writes from host memory into host windows of one peer, moved as one op.
// One request's KV cache over tcp is thousands of blocks of 16-64 KiB; sent one kPut frame
// each, every block paid a frame to queue, parse, land and acknowledge (~3 us a block on a
// 2-core host, more than a 16 KiB block's bytes took). A BlockBatch posts them as one kPutBlocks
// frame (base/wire.h): the block list (window, offset, length of each), then the blocks' bytes
// in list order, gathered by the sender's system calls straight out of the caller's memory (as
// a kPut's payload is: the memory is the caller's until the op completes). The target checks
// every block against its registered window before any byte lands, lands each block's bytes
// in place, in list order (a later block over the same bytes wins, as separate puts would), and
// acknowledges the frame once (core/progress_blocks.cc). The staged path's batches
// (transport/cuda/staged_batch.h) are the device twin.
#pragma once

#include <cstdint>
#include <vector>

#include "base/wire.h"
#include "transport/path.h"

namespace fxm::tcp {

class BlockBatch {
 public:
  // Writes up to this size go into a batch; larger ones go alone (striped over the lanes).
  static constexpr uint64_t kMaxBlockBytes = 256 << 10;
  // A frame's bytes at most: the target keeps every region a frame names entered until the frame
  // ends, which a deregistration of one of them waits for.
  static constexpr uint64_t kMaxFrameBytes = 64ull << 20;
  BlockBatch(Outbox* outbox, int peer) : outbox_(outbox), peer_(peer) {}
  // Queues a plain write of op.len bytes of host memory (op.local) to window `win` of the peer at
  // op.remote_off. False when the batch holds writes of another context or is full (blocks or
  // bytes): issue() it first.
  bool add(const PathOp& op, uint32_t win);
  size_t size() const { return entries_.size(); }
  // Posts the queued writes as one frame, one op (`count(+1)` runs before it is posted, its ack
  // may come at once; `count(-1)` if the post failed, which then throws), and empties the batch.
  template <typename Count>
  void issue(const Count& count) {
    if (entries_.empty()) return;
    std::vector<wire::BlockEntry> entries;
    ScatterList sources;
    entries.swap(entries_);
    sources.swap(sources_);
    bytes_ = 0;
    count(1);
    try {
      outbox_->post_put_host_blocks(peer_, ctx_, std::move(entries), std::move(sources));
    } catch (...) {
      count(-1);
      throw;
    }
  }

 private:
  Outbox* outbox_;
  int peer_;
  int ctx_ = 0;
  uint64_t bytes_ = 0;
  std::vector<wire::BlockEntry> entries_;
  ScatterList sources_;  // each block's bytes here
};

}  // namespace fxm::tcp
