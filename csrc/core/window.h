// Registered memory windows and how each peer's copy of a window is reached.
//
// Windows are registered collectively; the index is the registration order
// and is the same on every rank. Each rank publishes a WindowDesc; every rank
// then decides, per peer, the path to that peer's window:
//   self  the window is in this process: memcpy / atomics
//   shm   the peer's window is a shared-memory segment mapped here
//   cma   the peer is on this host and process_vm_writev/readv reach it
//   tcp   the peer's progress thread lands the data (any window, any host)
// and records why a preferred path was not taken.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "transport/shm/segment.h"

namespace fxm {

struct SignalNotify;

enum class WindowKind : uint32_t { kUser = 1, kShm = 2, kSignal = 3 };
enum class Path : uint8_t { kSelf = 0, kShm = 1, kCma = 2, kTcp = 3 };
// FLAGCX_MESH_TRANSPORT: auto (default) | tcp | cma | shm
enum class ForcedTransport { kAuto, kTcp, kCma, kShm };

const char* path_name(Path p);
const char* kind_name(WindowKind k);
ForcedTransport forced_transport();

// What a rank publishes about its copy of a window.
struct WindowDesc {
  WindowKind kind = WindowKind::kUser;
  uint64_t size = 0;     // bytes (signal windows: nslots * 8)
  uint64_t addr = 0;     // base address in the owner (for cma)
  int32_t pid = 0;
  std::string host;      // shm::host_id()
  std::string shm_name;  // empty for user windows
  std::vector<uint8_t> encode() const;
  static bool decode(const std::vector<uint8_t>& b, WindowDesc* out);
};

// How this rank reaches one peer's copy of a window.
struct PeerView {
  Path path = Path::kTcp;
  uint64_t size = 0;
  uint8_t* mapped = nullptr;  // shm / self: where the peer's bytes are here
  int64_t* last_src = nullptr;  // signal windows mapped here: last signaller per slot
  struct SignalNotify* notify = nullptr;  // signal windows mapped here: wake-up block
  pid_t pid = 0;
  uint64_t addr = 0;
  std::string why;  // why a better path was not taken (empty when none)
  shm::Segment seg;
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
