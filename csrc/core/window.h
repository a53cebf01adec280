// Registered memory windows and how each peer's copy of a window is reached.
//
// Windows are registered collectively; the index is the registration order
// and is the same on every rank. Each rank publishes a WindowDesc; every rank
// then asks the path factories (transport/path.h: self, shm, cma, tcp, in
// that order) for a path to each peer's copy, and records why the preferred
// paths were not taken.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "transport/cuda/device_memory.h"
#include "transport/cuda/fd_pass.h"
#include "transport/cuda/streams.h"
#include "transport/path.h"
#include "transport/self/own_windows.h"
#include "transport/shm/segment.h"
#include "transport/ucx/runtime.h"

namespace fxm {

// How this rank reaches one peer's copy of a window: the path chosen for it
// and, when that is not tcp, the tcp path as a fallback (ops the chosen path
// cannot take, and ops that must queue behind tcp ops in flight).
struct PeerView {
  std::unique_ptr<Path> path;
  std::unique_ptr<Path> fallback;  // tcp; empty when `path` is tcp
  uint64_t size = 0;
  std::string why;  // why a better path was not taken (empty when none)
  Path& tcp() const { return fallback ? *fallback : *path; }
};

struct Window {
  uint32_t index = 0;
  WindowKind kind = WindowKind::kUser;
  uint8_t* base = nullptr;  // local bytes
  uint64_t size = 0;
  int64_t* last_src = nullptr;  // signal windows: last signaller per slot (rank)
  struct SignalNotify* notify = nullptr;  // signal windows: wake-up block
  // Lifetime. An op (or a waiter, or the engine landing a frame) enters the
  // windows it touches and leaves when done with their memory; deregister
  // sets `closing` (new ops fail), waits for those inside, and unmaps only
  // after `live` went false and nobody is inside (see OneSided::deregister).
  std::atomic<bool> live{true};
  std::atomic<bool> closing{false};
  // An agent's deregister seals the window first: no frame or answer enters it any more, while
  // those inside may finish (until its timeout); then `live` goes false (see io below).
  std::atomic<bool> sealed{false};
  std::atomic<uint32_t> users{0};
  // Identity proof for every path that opens the window from another process
  // (transport/binding.h): `nonce` (random) is published in its description,
  // *cookie holds the seal of that description (window_seal(), 0 once closed),
  // in `cookie_owned` or in a slot of the owner's cookie table (cma/cookie_table.h).
  uint64_t nonce = 0;
  uint64_t* cookie = nullptr;
  std::unique_ptr<uint64_t> cookie_owned;
  void own_cookie(uint64_t value) {
    cookie_owned = std::make_unique<uint64_t>(value);
    cookie = cookie_owned.get();
  }
  // This process's registration of the window (what cuda-self may reach), until it is closed.
  OwnWindowClaim own;
  // Library-allocated memory (shm and signal windows). Shared: Python views of
  // the window hold a reference, so deregistration never unmaps memory a view
  // still points at.
  std::shared_ptr<shm::Segment> seg;
  // Device windows: the CUDA device, the memory (released with the window
  // when the library allocated it) and, during registration, the server of
  // its cuMem fds.
  int device = -1;
  std::shared_ptr<cuda::DeviceMemory> dev;
  std::unique_ptr<cuda::FdServer> fd_server;
  // Signal windows: the slots registered for the device at the first stream wait.
  // The stream waits queued on them (an event after each) keep them mapped.
  std::mutex host_reg_mu;
  std::unique_ptr<cuda::HostRegistration> host_reg;
  std::vector<cuda::SharedEvent> stream_waits;
  std::vector<PeerView> peers;
  // Its registration with UCX (transport/ucx), when UCX is wanted; unmapped with the window.
  std::unique_ptr<ucx::Registration> ucx_reg;
  uint64_t nslots() const { return kind == WindowKind::kSignal ? size / 8 : 0; }
  // Ops: false once closing. The engine landing a peer's frame passes
  // while_closing (peers may write until the close collective): false once dead.
  bool enter(bool while_closing = false) {
    users.fetch_add(1);
    if (live.load() && !sealed.load() && (while_closing || !closing.load())) return true;
    users.fetch_sub(1);
    return false;
  }
  void leave() { users.fetch_sub(1); }
  // Bytes moving into (or out of) the window's memory right now: a reader landing one socket
  // read of a frame's payload, an answer copying one chunk out. Each checks `live` after
  // counting itself, and deregister waits for `io` to drop to 0 after `live` went false
  // (both sequentially consistent): once it did, no such copy touches the memory again, and a
  // frame still landing sends its remaining bytes to a sink (its put is refused). Unlike
  // `users` (held for a whole frame, however slowly the peer sends it), this is held for one
  // non-blocking read or copy only.
  std::atomic<uint32_t> io{0};
  std::atomic<uint32_t> cut_off{0};  // frames and answers cut off by that (each once)
  bool begin_io() {
    io.fetch_add(1);
    if (live.load()) return true;
    io.fetch_sub(1);
    return false;
  }
  void end_io() { io.fetch_sub(1); }
  // Waits for io to drop to 0 (after live went false): true unless `deadline` passed first.
  bool wait_io(const Deadline& deadline) const;
  std::string mode() const;      // "shm" | "cma" | "tcp" | "self" (the dominant remote path)
  std::string describe() const;  // per-peer paths and reasons
};

// Queues on `stream` (of device `ordinal`) a wait until slot `slot` of the signal
// window w has reached `expected` (cuStreamWaitValue64 GEQ), registering w's slots
// for the device at its first stream wait. Returns the event recorded after the
// wait (also kept in w.stream_waits), or null when the driver has no stream memory
// operations (*why says so; nothing was queued). The mesh's wait_signal(stream=)
// and the agent's stream waits on notifications both queue theirs here.
cuda::SharedEvent queue_stream_wait(Window& w, uint64_t slot, uint64_t expected, void* stream, int ordinal,
                                    std::string* why);

// Waits until `deadline` for the stream waits queued on w; false when some are still pending.
bool stream_waits_passed(Window& w, const Deadline& deadline);

// The registered windows of one mesh, by index. Thread-safe; entries are
// never removed (a deregistered window stays, with live == false), so a
// Window lives as long as the table. find() takes no lock (it is on every op's path): the pointers sit in
// a slab that add() publishes with release stores; a full slab is copied into
// one twice its size and kept until the table goes (readers may still hold it).
class WindowTable {
 public:
  std::shared_ptr<Window> get(uint32_t index) const {
    std::lock_guard<std::mutex> lock(mu_);
    return index < wins_.size() ? wins_[index] : nullptr;
  }
  uint32_t next_index() const {
    std::lock_guard<std::mutex> lock(mu_);
    return static_cast<uint32_t>(wins_.size());
  }
  void add(std::shared_ptr<Window> w) {
    std::lock_guard<std::mutex> lock(mu_);
    size_t n = wins_.size();
    Slab* cur = slab_.load(std::memory_order_relaxed);
    if (cur == nullptr || n == cur->cap) {
      auto bigger = std::make_unique<Slab>(cur == nullptr ? 16 : 2 * cur->cap);
      for (size_t i = 0; i < n; ++i) bigger->at[i].store(wins_[i].get(), std::memory_order_relaxed);
      cur = bigger.get();
      slabs_.push_back(std::move(bigger));
      slab_.store(cur, std::memory_order_release);
    }
    // device_ first: whoever find()s a device window sees has_device() too (a waiter that saw it
    // false would act on a frame for that window itself: Engine::progress_thread_frame; a peer
    // names a window only once its descriptor, sent after this, reached it).
    if (w->kind == WindowKind::kDevice) device_.store(true, std::memory_order_release);
    cur->at[n].store(w.get(), std::memory_order_release);
    wins_.push_back(std::move(w));
  }
  // Once a device window was registered here (it stays true).
  bool has_device() const { return device_.load(std::memory_order_acquire); }
  // The window itself, or nullptr when no window has this index (yet).
  Window* find(uint32_t index) const {
    const Slab* s = slab_.load(std::memory_order_acquire);
    return s != nullptr && index < s->cap ? s->at[index].load(std::memory_order_acquire) : nullptr;
  }
  std::vector<std::shared_ptr<Window>> all() const {
    std::lock_guard<std::mutex> lock(mu_);
    return wins_;
  }

 private:
  std::atomic<bool> device_{false};
  struct Slab {
    explicit Slab(size_t n) : cap(n), at(new std::atomic<Window*>[n]) {
      for (size_t i = 0; i < n; ++i) at[i].store(nullptr, std::memory_order_relaxed);
    }
    size_t cap;
    std::unique_ptr<std::atomic<Window*>[]> at;
  };
  mutable std::mutex mu_;
  std::vector<std::shared_ptr<Window>> wins_;  // owns the windows
  std::vector<std::unique_ptr<Slab>> slabs_;   // every slab published, under mu_
  std::atomic<Slab*> slab_{nullptr};           // the current one
};

}  // namespace fxm
