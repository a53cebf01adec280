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
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include "base/clock.h"
#include "transport/cuda/staging.h"

namespace fxm::cuda {

// FLAGCX_MESH_STAGED_CHUNK_BYTES (default 4 MiB, at least 64 KiB, a power of two):
// the pieces a staged op is cut in.
uint64_t staged_chunk_bytes();
// FLAGCX_MESH_STAGED_INFLIGHT_BYTES (default 64 MiB, at least one chunk): the
// staging a process's staged puts to one peer hold until sent.
uint64_t staged_inflight_bytes();
// Staging bytes held now by the puts to `peer` through `outbox` (tests, docs/gpu.md).
uint64_t staged_bytes_held(const void* outbox, int peer);
// The most any one peer's puts held at once since the process started.
uint64_t staged_bytes_peak();

class StagedPayload {
 public:
  // Takes the ring from the budget of (outbox, peer): waits until it fits, up
  // to `deadline` (then Error(kTimeout) naming the peer). ordinal: the device copied from.
  // `bounded` false: no budget is taken (get answers, bounded by the engine's get credits).
  StagedPayload(const void* outbox, int peer, uint64_t len, int ordinal, const Deadline& deadline,
                bool bounded = true);
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

  // Get answers (bounded false): queues the copies down of every chunk at once
  // on the landing stream (after the copies up of puts landed before, ahead of
  // later ones: the answer is the window as of the request), to be published
  // by poll_copies() as they complete; Error when a copy cannot be queued.
  void copy_all(int ordinal, const uint8_t* src, const Deadline& deadline);
  // What keeps copy_all()'s source alive (the engine: leaving the window the
  // answer is read from), run when the payload goes once every copy completed;
  // never run while a copy may still read the source (the source stays held).
  void hold_source(std::function<void()> release) { release_source_ = std::move(release); }
  // Engine: publishes the chunks whose copies completed (true when some did);
  // a failed copy or one past the deadline gives the payload up.
  bool poll_copies();
  bool copies_pending() const { return !events_.empty() && ready() < len_ && !failed(); }

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
  std::atomic<uint64_t> ready_{0};
  std::atomic<bool> failed_{false};
  std::function<void()> waker_;
  std::function<void()> release_source_;
  std::vector<std::shared_ptr<void>> events_;  // copy_all(): one per chunk
  size_t events_done_ = 0;
  int copies_on_ = -1;  // the device of copy_all()
  Deadline copies_by_ = Deadline::never();
  mutable std::mutex mu_;
  std::condition_variable cv_;
  uint64_t sent_ = 0;
  bool head_sent_ = false;  // the frame's header went out (sent_to was called)
  std::string failure_, canceled_;
};

}  // namespace fxm::cuda
