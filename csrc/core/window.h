// Registered memory windows and how each peer's copy of a window is reached.
//
// Windows are registered collectively; the index is the registration order
// and is the same on every rank. Each rank publishes a WindowDesc; every rank
// then asks the path factories (transport/path.h: self, shm, cma, tcp, in
// that order) for a path to each peer's copy, and records why the preferred
// paths were not taken.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "transport/path.h"
#include "transport/shm/segment.h"

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
  bool live = true;
  // Library-allocated memory (shm and signal windows). Shared: Python views of
  // the window hold a reference, so deregistration never unmaps memory a view
  // still points at.
  std::shared_ptr<shm::Segment> seg;
  std::vector<PeerView> peers;
  uint64_t nslots() const { return kind == WindowKind::kSignal ? size / 8 : 0; }
  std::string mode() const;      // "shm" | "cma" | "tcp" | "self" (the dominant remote path)
  std::string describe() const;  // per-peer paths and reasons
};

// The registered windows of one mesh, by index. Thread-safe; entries are
// never removed (a deregistered window stays, with live == false).
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
    wins_.push_back(std::move(w));
  }
  std::vector<std::shared_ptr<Window>> all() const {
    std::lock_guard<std::mutex> lock(mu_);
    return wins_;
  }

 private:
  mutable std::mutex mu_;
  std::vector<std::shared_ptr<Window>> wins_;
};


}  // namespace fxm
