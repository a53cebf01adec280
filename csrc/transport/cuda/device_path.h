// Paths to a peer's device window. cuda-self (the window is in this process),
// cuda-vmm (its cuMem mappings imported from fds passed over a unix socket)
// and cuda-ipc (its allocation opened from a legacy IPC handle) map the
// peer's memory here and copy with cuMemcpyAsync on the user's stream or the
// library's; the op completes through the Outbox when the stream gets there
// (an event the engine polls, or, with a signal, a host function that applies
// it first: there is no stream "add").
// staged moves the bytes through host memory and the tcp path: the only one
// across hosts; its ops with a stream first wait for that stream.
#pragma once

#include <memory>

#include "transport/cuda/device_memory.h"
#include "transport/path.h"
#include "transport/tcp/tcp_path.h"

namespace fxm {
namespace cuda {
struct BatchedCopy;
}

class DevicePath : public Path {
 public:
  // remote_on_device: `remote` is device memory (cuda-self may reach a host window of this process).
  DevicePath(PathKind kind, int peer, int ordinal, uint8_t* remote, std::unique_ptr<cuda::PeerMapping> m,
             Outbox* outbox, bool remote_on_device = true)
      : kind_(kind), peer_(peer), ordinal_(ordinal), remote_(remote), mapping_(std::move(m)), outbox_(outbox),
        remote_on_device_(remote_on_device) {}
  PathKind kind() const override { return kind_; }
  bool synchronous() const override { return false; }  // completes when its stream gets there
  bool synchronous_for(const PathOp& op) const override { return op.wait_here; }
  bool carries_signal() const override { return true; }  // from the stream, with op.sig_slots
  int put(const PathOp& op) override { return copy(op, remote_ + op.remote_off, op.local); }
  int get(const PathOp& op) override { return copy(op, op.local, remote_ + op.remote_off); }
  Queued queue(const PathOp& op, bool is_get, cuda::CopyBatch* batch) override;
  Queued queue_more(const PathOp& op, bool is_get, cuda::CopyBatch* batch) override;
  void release() override {
    mapping_.reset();
    remote_ = nullptr;
  }

 private:
  int copy(const PathOp& op, void* dst, const void* src);
  cuda::BatchedCopy batched(const PathOp& op, bool is_get) const;
  cuda::CUstream stream_for(const PathOp& op) const;
  PathKind kind_;
  int peer_;
  int ordinal_;
  uint8_t* remote_;
  std::unique_ptr<cuda::PeerMapping> mapping_;
  Outbox* outbox_;
  bool remote_on_device_;
};

class StagedPath : public TcpPath {
 public:
  // remote_device: the device the peer's window is on (its description's), -1 for host memory.
  StagedPath(Outbox* outbox, int peer, uint32_t win, int remote_device = -1)
      : TcpPath(outbox, peer, win), remote_device_(remote_device) {}
  PathKind kind() const override { return PathKind::kStaged; }
  int put(const PathOp& op) override;
  int get(const PathOp& op) override;
  Queued queue_staged(const PathOp& op, cuda::StagedBatch* batch) override;

 private:
  int remote_device_;
};

std::unique_ptr<Path> make_cuda_self_path(const PathRequest& req, const WindowDesc& d, std::string* why);
std::unique_ptr<Path> make_cuda_vmm_path(const PathRequest& req, const WindowDesc& d, std::string* why);
std::unique_ptr<Path> make_cuda_ipc_path(const PathRequest& req, const WindowDesc& d, std::string* why);
std::unique_ptr<Path> make_staged_path(const PathRequest& req, const WindowDesc& d, std::string* why);

}  // namespace fxm
