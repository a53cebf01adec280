// The engine's queued and incoming frames, shared by progress.cc (the
// thread, connections, counters) and progress_ops.cc (one-sided frames).
#pragma once

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <thread>
#include <string>
#include <vector>

#include "core/progress.h"
#include "transport/cuda/copy_kernel.h"
#include "transport/cuda/staged_payload.h"
#include "transport/cuda/streams.h"

namespace fxm {

// Moves a cursor over pieces (piece *at, byte *off of it) past `bytes`, and past the empty pieces
// it then stands on: a batch's payload as it is sent (OutItem::gather) or lands (host blocks).
inline void advance_pieces(const ScatterList& pieces, size_t* at, uint64_t* off, uint64_t bytes) {
  while (*at < pieces.size() && (bytes > 0 || pieces[*at].second == *off)) {
    uint64_t step = std::min(bytes, pieces[*at].second - *off);
    *off += step;
    bytes -= step;
    if (*off == pieces[*at].second) {
      ++*at;
      *off = 0;
    }
  }
}

// The pieces of bytes [from, from + n) of `pieces`' concatenation.
inline ScatterList slice_pieces(const ScatterList& pieces, uint64_t from, uint64_t n) {
  ScatterList out;
  size_t at = 0;
  uint64_t off = 0;
  advance_pieces(pieces, &at, &off, from);
  for (; n > 0 && at < pieces.size(); ++at, off = 0) {
    uint64_t take = std::min(n, pieces[at].second - off);
    out.emplace_back(pieces[at].first + off, take);
    n -= take;
  }
  return out;
}

struct Engine::OutItem {
  std::vector<uint8_t> head;      // frame header + op header (+ owned payload)
  const uint8_t* data = nullptr;  // borrowed payload (puts; get answers are copied into head)
  uint64_t len = 0;
  uint64_t sent = 0;
  uint64_t msg_bytes = 0;  // two-sided message bytes it carries (back-pressure)
  uint64_t answer_bytes = 0;  // get answer bytes it carries (get credits)
  uint64_t answer_id = 0;     // a get answer's request id
  // A staged put's payload (data is then unused): only its ready bytes are sent.
  std::shared_ptr<cuda::StagedPayload> staged;
  // A batch of host writes' payload (data is then unused): the blocks' bytes, piece after piece
  // (tcp/block_batch.h); the next byte to send is at gather[gather_at] + gather_off.
  ScatterList gather;
  size_t gather_at = 0;
  uint64_t gather_off = 0;
  uint64_t total() const { return head.size() + len; }
  bool plain() const { return !staged && gather.empty(); }  // its payload one piece (or none)
};

// A message received, or dropped here (`dropped` says why; recv() raises it in its place).
struct Engine::Inbound {
  std::vector<uint8_t> bytes;
  std::string dropped;
};

struct Engine::InConn {
  enum State { kHeader, kOpHeader, kPayload } st = kHeader;
  uint8_t buf[64];
  size_t got = 0, need = wire::kFrameHeaderSize;
  wire::FrameHeader f;
  wire::PutHeader put;
  uint64_t req_id = 0;
  uint8_t* dst = nullptr;  // payload destination; nullptr: discard
  // A put into a device window lands in a ring of pinned staging buffers of
  // `staged` bytes each (see take_landing_ring): a full one is copied up to
  // device_at + landed on the landing stream while the next one fills; a
  // buffer is refilled only once its copy is done, and the put is applied
  // only once every copy is.
  struct Landing {
    std::shared_ptr<uint8_t> buf;
    std::shared_ptr<void> copied;  // the event after its copy up (empty: none pending)
    std::shared_ptr<cuda::CopyList> list;  // a scatter's kernel list, read until `copied` completed
    std::shared_ptr<void> scratch;  // device scratch its scatter passes through (FLAGCX_MESH_STAGED_BOUNCE)
  };
  std::vector<Landing> stage;
  size_t filling = 0;   // the buffer the next bytes go to
  uint64_t staged = 0;  // bytes per buffer
  uint64_t landed = 0;  // bytes handed to copies up
  uint8_t* device_at = nullptr;  // a staged put's or get answer's destination in device memory
  int device = -1;
  uint64_t total = 0, remaining = 0;
  std::vector<uint8_t> msg;  // a message or refusal: grows as its bytes arrive (see grow_message)
  // A kPutBlocks frame (progress_blocks.cc): its list, the windows it entered (left at reset),
  // whether the list was checked, and the block the next landed byte belongs to.
  wire::BlocksHeader blocks_head;
  wire::GetBlocksHeader get_blocks;  // a kGetBlocks request's header
  std::shared_ptr<const ScatterList> scatter;  // where the landed bytes go, block after block
  int blocks_peer = -1;  // the peer that sent it (for log lines)
  std::vector<wire::BlockEntry> blocks;
  // The blocks' bytes a kPutBlocks frame carries after its list (striped: lane 0's part).
  uint64_t carried() const { return total - blocks.size() * sizeof(wire::BlockEntry); }
  std::vector<Window*> block_windows;  // per block (entered once per distinct window: entered_once)
  std::vector<Window*> entered_once;
  bool blocks_checked = false;
  size_t block_at = 0;       // the block the next scattered byte belongs to
  uint64_t block_off = 0;    // bytes of it scattered already
  Window* io_window = nullptr;  // a batch of host writes: the window the next read lands in (WindowIo)
  Window* entered = nullptr;  // the window a put lands in (Window::enter), left at reset()
  std::string refused;        // why the target drops this put or message (empty: applied)
  // Bytes read ahead from the socket (one recv takes in a small frame whole, or several):
  // frames are taken from here first; the socket is read only once it is empty, straight into
  // place for a payload of at least kReadAhead bytes. reset() keeps them (they are later frames').
  static constexpr size_t kReadAhead = 8192;
  std::unique_ptr<uint8_t[]> ahead;
  size_t ahead_pos = 0, ahead_end = 0;
  size_t buffered() const { return ahead_end - ahead_pos; }
  bool closed = false;
  bool hup = false;  // a lane whose stripe waits for lane 0 saw its peer's close (progress_lanes.cc)
  // The buffers go back to the staging pool, except those a copy up may still
  // read (a put cut short or timed out): those are deliberately kept.
  void release_stage() {
    for (Landing& l : stage) {
      if (l.copied && !cuda::event_done(l.copied)) {
        new std::shared_ptr<uint8_t>(l.buf);
        if (l.list) new std::shared_ptr<cuda::CopyList>(l.list);
        if (l.scratch) new std::shared_ptr<void>(l.scratch);
      }
    }
    stage.clear();
    filling = 0;
  }
  void reset() {
    st = kHeader;
    got = 0;
    need = wire::kFrameHeaderSize;
    dst = nullptr;
    device_at = nullptr;
    landed = 0;
    release_stage();
    if (entered) entered->leave();
    entered = nullptr;
    for (Window* w : entered_once) w->leave();
    entered_once.clear();
    block_windows.clear();
    scatter.reset();
    std::vector<wire::BlockEntry>().swap(blocks);
    blocks_checked = false;
    block_at = 0;
    block_off = 0;
    io_window = nullptr;
    device = -1;
    refused.clear();
    std::vector<uint8_t>().swap(msg);
  }
};

// The thread of lane `lane` (>= 1): polls `wake_fd` and that lane's connections of every slot.
struct Engine::LaneWorker {
  int lane = 0;
  int wake_fd = -1;
  std::thread thread;
  std::atomic<std::thread::id> tid{};  // the thread's id, once it runs (read by any thread)
  std::vector<uint8_t> discard = std::vector<uint8_t>(1 << 16);  // its sink for dropped payloads (never read)
  int64_t spin_until_ns = 0;  // its thread: polls without sleeping until then (lane_spin_ns_ after a stripe)
  ~LaneWorker() {
    if (wake_fd >= 0) ::close(wake_fd);
  }
};

// Set while this thread holds landing_mu_: lose() then does not take it again.
inline thread_local bool t_landing = false;

// landing_mu_ held by a reader while a get answer's bytes go into the user's buffer.
class LandingLock {
 public:
  explicit LandingLock(std::mutex& m) : lock_(m, std::defer_lock) {}
  LandingLock(const LandingLock&) = delete;
  LandingLock& operator=(const LandingLock&) = delete;
  ~LandingLock() { unlock(); }
  void lock() {
    lock_.lock();
    t_landing = true;
  }
  void unlock() {
    if (!lock_.owns_lock()) return;
    t_landing = false;
    lock_.unlock();
  }
  bool owns_lock() const { return lock_.owns_lock(); }

 private:
  std::unique_lock<std::mutex> lock_;
};

inline wire::PutHeader put_header(uint32_t dst_win, uint64_t dst_off, const SignalSpec& sig) {
  wire::PutHeader h;
  h.dst_win = dst_win;
  h.dst_off = dst_off;
  if (sig.on) {
    h.flags = wire::kPutHasSignal | (sig.set ? wire::kPutSignalSet : 0);
    h.sig_win = sig.win;
    h.sig_slot = sig.slot;
    h.sig_val = sig.value;
  }
  return h;
}

template <typename T>
inline std::vector<uint8_t> frame(wire::FrameType type, const T* op, uint64_t payload) {
  size_t oplen = op ? sizeof(T) : 0;
  std::vector<uint8_t> b(wire::kFrameHeaderSize + oplen);
  wire::encode_frame({type, 0, oplen + payload}, b.data());
  if (op) std::memcpy(b.data() + wire::kFrameHeaderSize, op, oplen);
  return b;
}

}  // namespace fxm
