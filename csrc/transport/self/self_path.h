// Paths through memory mapped in this process: self (the window is this
// rank's own) and shm (the peer's segment is mapped here). put / get are
// memmove, signals are atomics on the mapped slots; both are synchronous.
#pragma once

#include "transport/path.h"
#include "transport/shm/segment.h"

namespace fxm {

class MappedPath : public Path {
 public:
  MappedPath(PathKind kind, uint8_t* base, SignalSlots slots, shm::Segment seg = {})
      : kind_(kind), base_(base), slots_(slots), seg_(std::move(seg)) {}
  PathKind kind() const override { return kind_; }
  bool can_signal() const override { return slots_.values != nullptr; }
  int put(const PathOp& op) override;
  int get(const PathOp& op) override;
  void signal(const PathOp& op, int src_rank) override;
  SignalSlots slots() const override { return slots_; }
  void release() override {
    seg_.reset();
    base_ = nullptr;
    slots_ = {};
  }

 private:
  PathKind kind_;
  uint8_t* base_;
  SignalSlots slots_;
  shm::Segment seg_;  // shm: the mapping this path owns (unmapped with the path)
};

// The window is this rank's own copy.
std::unique_ptr<Path> make_self_path(const PathRequest& req, const WindowDesc& d, std::string* why);

}  // namespace fxm
