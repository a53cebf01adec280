// The payload of a staged put while it is copied out of device memory and
// sent: `len` bytes in a ring of pooled pinned chunks (staging.h). The
// calling thread copies chunk after chunk into the ring and publishes how
// many bytes are ready; the progress engine sends only ready bytes and
// reports how many went out, which frees ring slots for later chunks. So
// the copy down of chunk k+1 overlaps the send of chunk k, and an op holds
// at most its ring, whatever its size.
//
// The ring is taken from a budget per (outbox, peer): at most
// staged_inflight_bytes() of staging held by the puts to one peer that are
// not sent yet; a put that does not fit waits (up to its deadline) for
// earlier ones to be sent. An op's whole ring is taken at once, so an op
// that holds a ring never waits for more.
//
// A get answer (`bounded` false) is the same ring, of kAnswerChunks chunks,
// filled by the engine itself as the socket drains (staged_answer.cc): from
// device memory (copies down on the landing stream) or host memory (memcpy,
// ordinal -1). Its buffers are taken when its first chunk is copied, so an
// answer still queued behind others holds none. snapshot_rest() copies every
// chunk not copied yet at once (the engine calls it before it applies a later
// frame of the same pair: the answer stays the window as of the request).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "base/clock.h"
#include "transport/cuda/copy_kernel.h"
#include "transport/cuda/staging.h"
#include "transport/cuda/streams.h"

namespace fxm::cuda {

// FLAGCX_MESH_STAGED_CHUNK_BYTES (default 4 MiB, at least 64 KiB, a power of two):
// the pieces a staged op is cut in.
uint64_t staged_chunk_bytes();
// FLAGCX_MESH_STAGED_INFLIGHT_BYTES (default 64 MiB, at least one chunk): the
// staging a process's staged puts to one peer hold until sent.
uint64_t staged_inflight_bytes();
// FLAGCX_MESH_STAGED_KERNEL_BYTES (default 64 KiB, 4 KiB to 1 MiB, a multiple of 16): the bytes
// each thread block of the copy kernel moves in a staged gather or scatter (its other end is pinned
// host memory, read or written across the bus: smaller pieces, more blocks, more bytes in flight).
uint64_t staged_kernel_bytes();
// FLAGCX_MESH_STAGED_LANDING_BUFFERS (default 4, 2 to 64): the pinned buffers of a chunk each that
// a staged frame into device memory (or each tcp lane's part of one, or a staged get's answer)
// lands through where it is received; a lane whose next buffer's copy into device memory has not
// completed waits for it. A bad value throws at each landing (nothing is kept).
uint64_t staged_landing_buffers();
// Staging bytes held now by the puts to `peer` through `outbox` (tests, docs/gpu.md).
uint64_t staged_bytes_held(const void* outbox, int peer);
// The most any one peer's puts held at once since the process started.
uint64_t staged_bytes_peak();

// Where the staged path's threads waited, since the process started (docs/gpu.md, "Where a staged
// batch waits"): the filler for a ring slot (the lanes sent slower than it gathered), the filler for
// a gathered chunk's copy (the device slower), the writers for gathered bytes (a lane with nothing to
// send), the target's lanes for a landing buffer whose scatter had not completed. Each: how many
// waits and their microseconds, by name as flagcx_mesh.cuda.staged_waits() gives them
// (slot_waits, slot_us, gather_waits, gather_us, starved, starved_us, landing_waits, landing_us).
std::vector<std::pair<const char*, uint64_t>> staged_waits();
// One wait of a kind of staged_waits(), counted when it ends however it ends (a deadline, a
// cancel), where `waits` (what it waits for was not done when it began).
enum class StagedWait { kSlot, kGather, kStarved, kLanding };
class StagedWaitTimer {
 public:
  StagedWaitTimer(StagedWait kind, bool waits) : kind_(kind), waits_(waits), t0_(Clock::now()) {}
  ~StagedWaitTimer();
  StagedWaitTimer(const StagedWaitTimer&) = delete;
  StagedWaitTimer& operator=(const StagedWaitTimer&) = delete;

 private:
  StagedWait kind_;
  bool waits_;
  Clock::time_point t0_;
};
// wait_event() (streams.h), counted as a wait of `kind` when `e` was not done yet.
void wait_event_counted(StagedWait kind, int ordinal, const SharedEvent& e, const Deadline& deadline,
                        const std::string& doing);

class StagedPayload {
 public:
  // Takes the ring from the budget of (outbox, peer): waits until it fits, up
  // to `deadline` (then Error(kTimeout) naming the peer). ordinal: the device copied from.
  // `bounded` false: no budget is taken (get answers, bounded by the engine's get credits).
  // `share`: the ring takes at most 1 / share of the budget (one of `share` parts of a frame);
  // `prepaid`: its budget was taken already (parts()).
  StagedPayload(const void* outbox, int peer, uint64_t len, int ordinal, const Deadline& deadline,
                bool bounded = true, int share = 1, bool prepaid = false);
  // The parts of one frame striped over the tcp lanes (lens: each lane's bytes), their rings
  // taken from the budget at once (each 1 / lens.size() of it at most): see fill_parts().
  static std::vector<std::shared_ptr<StagedPayload>> parts(const void* outbox, int peer,
                                                           const std::vector<uint64_t>& lens, int ordinal,
                                                           const Deadline& deadline);
  ~StagedPayload();  // gives the ring and its budget back
  StagedPayload(const StagedPayload&) = delete;
  StagedPayload& operator=(const StagedPayload&) = delete;

  uint64_t len() const { return len_; }
  uint64_t chunk() const { return chunk_; }
  uint64_t chunks() const { return (len_ + chunk_ - 1) / chunk_; }

  // Filler (the calling thread). Where chunk i goes: waits until the chunk
  // that used its ring slot was sent (Error kTimeout at the deadline,
  // kPeerLost once cancel() was called), naming the peer.
  uint8_t* slot_for(uint64_t i, const Deadline& deadline);
  uint64_t chunk_len(uint64_t i) const { return std::min(chunk_, len_ - i * chunk_); }
  void publish(uint64_t ready);       // bytes [0, ready) are in place
  void give_up(const std::string& why);  // no more bytes come: the engine gives up the frame
  void keep_slot(uint64_t i);         // a copy into chunk i may still run: never given back
  void set_waker(std::function<void()> w) { waker_ = std::move(w); }
  // Copies the payload down from device memory at `src`, chunk after chunk, each
  // published once it landed; `posted` (if any) runs after the first chunk (it
  // posts the frame). A failed copy (Error, the deadline) throws; once the frame
  // was posted the payload is given up first (the engine cannot complete it).
  void fill(int ordinal, const uint8_t* src, const Deadline& deadline, const std::function<void()>& posted);
  // The same for a payload gathered from many places (staged_batch.h): `copy` queues the copies
  // of chunk i into `dst` on device `ordinal` and returns the event after them (keeping in *list
  // what they read until then). Up to kFillAhead chunks, and at most half the ring, are in flight,
  // each published in order as soon as its event completed (looked at before each chunk queued);
  // `posted` runs after the first. Failures as fill()'s.
  using ChunkCopy = std::function<SharedEvent(uint64_t i, uint8_t* dst, std::unique_ptr<CopyList>* list)>;
  static constexpr size_t kFillAhead = 4;
  void fill_queued(int ordinal, const Deadline& deadline, const std::function<void()>& posted, const ChunkCopy& copy);
  // The parts of one frame striped over the tcp lanes, filled as fill_queued() fills one, taking
  // turns (chunk i of every part, then chunk i + 1), so every lane has bytes to send from the
  // start: `copy` queues part k's chunk i. `posted` runs after the first chunk; a failure gives
  // every part up once it ran.
  using PartCopy = std::function<SharedEvent(size_t k, uint64_t i, uint8_t* dst, std::unique_ptr<CopyList>* list)>;
  static void fill_parts(const std::vector<StagedPayload*>& parts, int ordinal, const Deadline& deadline,
                         const std::function<void()>& posted, const PartCopy& copy);

  // Get answers (bounded false, staged_answer.cc). The source: `len` bytes at
  // `src` in device memory of `ordinal` (-1: host memory). Nothing is copied yet.
  static constexpr uint64_t kAnswerChunks = 4;  // the ring of an answer, in chunks
  void answer_from(int ordinal, const uint8_t* src, const Deadline& deadline);
  // An answer gathered from many places (a batch of staged reads): chunk i is queued by
  // `gather` (as fill_queued's `copy`) on device `ordinal` instead of copied from one source.
  void answer_gathered(int ordinal, ChunkCopy gather, const Deadline& deadline);
  // What keeps the source alive (the engine: leaving the window the answer is
  // read from), run once every copy completed (or when the payload goes);
  // never while a copy may still read the source (the source stays held).
  void hold_source(std::function<void()> release) { release_source_ = std::move(release); }
  // Each copy out of the source runs between begin() (false: the source was
  // closed; the payload is given up) and end(): see Window::begin_io.
  void guard_source(std::function<bool()> begin, std::function<void()> end) {
    source_begin_ = std::move(begin);
    source_end_ = std::move(end);
  }
  // Where the answer's buffers are counted: bytes held now, and the most held at once.
  void count_in(std::atomic<uint64_t>* held, std::atomic<uint64_t>* peak) {
    count_held_ = held;
    count_peak_ = peak;
  }
  // The writer: copies (or queues the copies down of) the chunks whose ring slot is free.
  void copy_ahead();
  // Any thread: copies every chunk not copied yet, each into a buffer of its own.
  void snapshot_rest();
  bool all_copied() const;  // every chunk was copied or queued (nothing more reads the source but those)
  // Engine: publishes the chunks whose copies completed (true when some did);
  // a failed copy or one past the deadline gives the payload up.
  bool poll_copies();
  bool copies_pending() const;  // copies down queued and not complete

  // Engine (the writer).
  uint64_t ready() const { return ready_.load(std::memory_order_acquire); }
  bool failed() const { return failed_.load(std::memory_order_acquire); }
  std::string failure() const;
  // The ready bytes from payload offset `off`, contiguous: *n of them (0: none ready yet).
  const uint8_t* bytes_at(uint64_t off, uint64_t* n) const;
  void sent_to(uint64_t off);            // the frame's header and the bytes below `off` went out
  // Every ready byte went out and more are to come (then the writer waits for publish()).
  bool waiting_for_bytes() const;
  void cancel(const std::string& why);  // the frame will not be sent (its peer was lost)

 private:
  const void* outbox_;
  int peer_;
  uint64_t len_, chunk_;
  std::vector<HostBuffer> ring_;
  uint64_t held_ = 0;  // budget taken
  uint64_t frame_len_ = 0;  // parts(): the bytes of the whole frame (for errors)
  static uint64_t ring_bytes(uint64_t len, int share, uint64_t* slots);
  std::atomic<uint64_t> ready_{0};
  std::atomic<bool> failed_{false};
  mutable std::atomic<int64_t> starved_since_ns_{0};  // the writer found every ready byte sent (staged_waits)
  std::function<void()> waker_;
  std::function<void()> release_source_;
  // Answers (staged_answer.cc), under mu_ unless said.
  bool answer_ = false;
  const uint8_t* src_ = nullptr;
  uint64_t next_ = 0;  // the next chunk to copy
  std::vector<HostBuffer> own_;  // after snapshot_rest(): chunk i >= snap_from_ in own_[i]
  std::atomic<uint64_t> snap_from_{UINT64_MAX};  // stored before ready_ covers those chunks
  std::function<bool()> source_begin_;
  std::function<void()> source_end_;
  std::atomic<uint64_t>* count_held_ = nullptr;
  std::atomic<uint64_t>* count_peak_ = nullptr;
  uint64_t counted_ = 0;  // bytes of buffers added to *count_held_
  HostBuffer answer_buffer(uint64_t n);  // counted
  bool copy_chunk(uint64_t i, uint8_t* dst);  // false: the source was closed (given up)
  void release_source_locked();
  const HostBuffer& buffer_of(uint64_t i) const;
  void give_up_locked(const std::string& why);
  std::vector<std::shared_ptr<void>> events_;  // answers from device memory: one per chunk queued
  std::vector<std::shared_ptr<CopyList>> lists_;  // beside events_: a gather's kernel list (or none)
  ChunkCopy gather_;  // answer_gathered()'s
  size_t events_done_ = 0;
  int copies_on_ = -1;  // the device answers are copied from (-1: host memory)
  Deadline copies_by_ = Deadline::never();  // the last copy queued must complete by then
  double copy_timeout_s_ = 60;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  uint64_t sent_ = 0;
  bool head_sent_ = false;  // the frame's header went out (sent_to was called)
  std::string failure_, canceled_;
};

}  // namespace fxm::cuda
