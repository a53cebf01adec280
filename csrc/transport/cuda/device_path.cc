#include "transport/cuda/device_path.h"

#include <unistd.h>

#include "base/env.h"
#include "base/log.h"
#include "base/status.h"
#include "transport/binding.h"
#include "transport/cuda/copy_batch.h"
#include "transport/cuda/fd_pass.h"
#include "transport/cuda/staged_batch.h"
#include "transport/cuda/staged_payload.h"
#include "transport/cuda/staging.h"
#include "transport/cuda/streams.h"
#include "transport/self/own_windows.h"

namespace fxm {

cuda::CUstream DevicePath::stream_for(const PathOp& op) const {
  return op.stream_set ? op.stream : op.fence ? op.fence->own_stream(ordinal_) : cuda::library_stream(ordinal_);
}

int DevicePath::copy(const PathOp& op, void* dst, const void* src) {
  const cuda::Driver& d = cuda::need_driver("a device put/get");
  cuda::use_device(ordinal_);
  cuda::CUstream s = stream_for(op);
  if (op.fence) op.fence->before(s);
  cuda::CUresult r = d.cuMemcpyAsync(reinterpret_cast<cuda::CUdeviceptr>(dst), reinterpret_cast<cuda::CUdeviceptr>(src),
                                     op.len, s);
  if (r != cuda::kSuccess) {
    fail(Code::kSystem, peer_, 0, std::string("cuMemcpyAsync over ") + path_name(kind_) + ": " + cuda::result_text(r));
  }
  bool signal = op.sig != nullptr && op.sig_slots.values != nullptr;
  if (signal) {  // the host function reports the op; the fence's event follows the signal
    outbox_->issued(peer_, op.ctx, kind_);
    cuda::complete_on_stream(s, outbox_, peer_, op.ctx, op.sig, op.sig_slots, op.src_rank);
  }
  cuda::SharedEvent after = cuda::record_event(ordinal_, s);
  if (op.fence) op.fence->after(s, after);
  if (op.wait_here) {
    cuda::wait_for_stream(ordinal_, s, op.deadline, std::string("a copy over ") + path_name(kind_));
  } else if (!signal) {
    outbox_->issued_probe(peer_, op.ctx, kind_, cuda::event_probe(ordinal_, std::move(after)), 1);
  }
  return 0;
}

// Device memory on both sides only: a host buffer (pageable or not) keeps cuMemcpyAsync.
Queued DevicePath::queue(const PathOp& op, bool is_get, cuda::CopyBatch* batch) {
  if (op.sig != nullptr || op.wait_here || op.local_device < 0 || !remote_on_device_ || remote_ == nullptr) {
    return Queued::kNo;
  }
  if (batch->size() == 0) cuda::use_device(ordinal_);  // (CopyBatch::issue makes it current again)
  return batch->add(ordinal_, stream_for(op), op.fence, batched(op, is_get)) ? Queued::kYes : Queued::kBatchFirst;
}

// (The device, stream and fence are the last op's: queue() found them for its fields.)
Queued DevicePath::queue_more(const PathOp& op, bool is_get, cuda::CopyBatch* batch) {
  return batch->add_more(batched(op, is_get)) ? Queued::kYes : Queued::kBatchFirst;
}

cuda::BatchedCopy DevicePath::batched(const PathOp& op, bool is_get) const {
  auto local = reinterpret_cast<cuda::CUdeviceptr>(op.local);
  auto remote = reinterpret_cast<cuda::CUdeviceptr>(remote_ + op.remote_off);
  // A kernel on ordinal_ reads and writes both ends: the local memory must be on that device and
  // the peer's mapped for it (cuda-self: the window is on ordinal_ itself).
  bool kernel = op.local_device == ordinal_ && (!mapping_ || mapping_->kernel_device() == ordinal_);
  return {is_get ? local : remote, is_get ? remote : local, op.len, kind_, kernel};
}

namespace {

// Loads the copy kernel for `ordinal` now, when the path is set up, rather than at the first
// batch (copy_kernel.h: a first launch can block behind a user's stream wait).
template <typename P>
std::unique_ptr<Path> with_batches_ready(std::unique_ptr<P> p, int ordinal) {
  cuda::prepare_copy_kernel(ordinal);
  return p;
}

bool same_host(const PathRequest& req, const WindowDesc& d) { return d.host == req.host && d.pid_ns == req.pid_ns; }

// The device this rank copies on: its own copy's, else the peer's (same host).
int copy_device(const PathRequest& req, const WindowDesc& d) { return req.device >= 0 ? req.device : d.dev.ordinal; }

const char* forced_name(ForcedCudaPath f) {
  switch (f) {
    case ForcedCudaPath::kVmm: return "FLAGCX_MESH_CUDA_PATH=cuda-vmm";
    case ForcedCudaPath::kIpc: return "FLAGCX_MESH_CUDA_PATH=cuda-ipc";
    case ForcedCudaPath::kStaged: return "FLAGCX_MESH_CUDA_PATH=staged";
    default: return "";
  }
}

// FLAGCX_MESH_TRANSPORT=ucx takes device memory too, unless FLAGCX_MESH_CUDA_PATH names a device path.
bool forced_ucx(const PathRequest& req) {
  return req.forced == ForcedTransport::kUcx && req.forced_cuda == ForcedCudaPath::kAuto;
}

// Empty, or why a device path cannot map the peer's copy at all.
std::string mappable(const PathRequest& req, const WindowDesc& d, ForcedCudaPath self) {
  if (req.forced_cuda != ForcedCudaPath::kAuto && req.forced_cuda != self) return forced_name(req.forced_cuda);
  if (forced_ucx(req)) return "FLAGCX_MESH_TRANSPORT=ucx";
  if (d.kind != WindowKind::kDevice) return "the peer's copy is host memory";
  if (!same_host(req, d)) return "peer is on another host";
  if (cuda::driver() == nullptr) return cuda::driver_error();
  return req.binding ? req.binding->for_mapping() : "not bound to the peer";  // binding.h
}

}  // namespace

// Only a window registered in this process, by that peer, exactly as described
// (a peer may claim this process's pid with any address).
std::unique_ptr<Path> make_cuda_self_path(const PathRequest& req, const WindowDesc& d, std::string* why) {
  if (d.pid != static_cast<int32_t>(::getpid()) || !same_host(req, d) || cuda::driver() == nullptr) return nullptr;
  if (forced_ucx(req) && req.peer != req.me) {  // (a mesh rank's own copy stays here)
    *why = "cuda-self refused: FLAGCX_MESH_TRANSPORT=ucx";
    return nullptr;
  }
  if (!is_own_window({req.peer_is_agent ? -1 : req.peer, req.win_index, d.cookie, d.addr, d.size})) {
    *why = "cuda-self refused: " + std::string(req.peer_is_agent ? "the peer agent" : "rank " + std::to_string(req.peer)) +
           " names this process but no window #" +
           std::to_string(req.win_index) + " of it at that address and size is registered here";
    return nullptr;
  }
  int ordinal = d.kind == WindowKind::kDevice ? d.dev.ordinal : req.device;
  auto path = std::make_unique<DevicePath>(PathKind::kCudaSelf, req.peer, ordinal, reinterpret_cast<uint8_t*>(d.addr),
                                           nullptr, req.outbox, d.kind == WindowKind::kDevice);
  return with_batches_ready(std::move(path), ordinal);
}

std::unique_ptr<Path> make_cuda_vmm_path(const PathRequest& req, const WindowDesc& d, std::string* why) {
  std::string no = mappable(req, d, ForcedCudaPath::kVmm);
  if (no.empty() && d.dev.vmm.empty()) no = d.dev.why_no_vmm;
  std::vector<int> fds;
  if (no.empty()) fds = cuda::fetch_fds(d.fd_socket, d.fd_token, d.dev.vmm.size(), req.fd_fetch_ms, &no, d.pid);
  if (!no.empty()) {
    *why = "cuda-vmm refused: " + no;
    return nullptr;
  }
  try {
    auto m = cuda::PeerMapping::import_vmm(d.dev, d.size, std::move(fds), copy_device(req, d));
    uint8_t* base = m->window_base();
    auto path = std::make_unique<DevicePath>(PathKind::kCudaVmm, req.peer, copy_device(req, d), base, std::move(m),
                                             req.outbox);
    return with_batches_ready(std::move(path), copy_device(req, d));
  } catch (const Error& e) {
    *why = std::string("cuda-vmm refused: ") + e.what();
    return nullptr;
  }
}

std::unique_ptr<Path> make_cuda_ipc_path(const PathRequest& req, const WindowDesc& d, std::string* why) {
  std::string no = mappable(req, d, ForcedCudaPath::kIpc);
  if (no.empty() && !d.dev.ipc) no = d.dev.why_no_ipc;
  std::string key(d.dev.ipc_handle.reserved, cuda::kIpcHandleSize);
  auto taken = [](const std::string& first) {
    return "field IPC handle: " + first + " presented this handle first: it opens that peer's memory";
  };
  if (no.empty() && !req.peer_id.empty()) {  // binding.h: one legacy handle, one peer process
    std::string first = export_holder(key, d.pid);  // (d.pid is the peer's process: binding.h proved it)
    if (!first.empty()) no = taken(first);
  }
  if (!no.empty()) {
    *why = "cuda-ipc refused: " + no;
    return nullptr;
  }
  try {
    auto m = cuda::PeerMapping::open_ipc(d.dev, d.size, copy_device(req, d));
    if (!req.peer_id.empty()) {  // opened, inside its allocation: now it is this peer's
      std::string first = claim_export(key, d.pid, req.peer_id + " (pid " + std::to_string(d.pid) + ")");
      if (!first.empty()) {
        *why = "cuda-ipc refused: " + taken(first);
        return nullptr;
      }
    }
    uint8_t* base = m->window_base();
    auto path = std::make_unique<DevicePath>(PathKind::kCudaIpc, req.peer, copy_device(req, d), base, std::move(m),
                                             req.outbox);
    return with_batches_ready(std::move(path), copy_device(req, d));
  } catch (const Error& e) {
    *why = std::string("cuda-ipc refused: ") + e.what();
    return nullptr;
  }
}

// From device memory, its batches gather with the copy kernel: loaded now (with_batches_ready).
std::unique_ptr<Path> make_staged_path(const PathRequest& req, const WindowDesc& d, std::string*) {
  auto path = std::make_unique<StagedPath>(req.outbox, req.peer, req.win_index,
                                           d.kind == WindowKind::kDevice ? d.dev.ordinal : -1);
  if (req.device < 0 || cuda::driver() == nullptr) return path;
  return with_batches_ready(std::move(path), req.device);
}

// ------------------------------------------------------------ staged

namespace {

void wait_for_stream(const PathOp& op, const char* doing) {
  if (!op.stream_set) return;
  int ordinal = op.local_device >= 0 ? op.local_device : cuda::current_device();
  cuda::wait_for_stream(ordinal, op.stream, op.deadline, std::string(doing) + ": waiting for its stream");
}

}  // namespace

// Cut in chunks (staged_payload.h): the frame is posted once the first chunk
// is on the host, and the engine sends each chunk while the next is copied
// down. The call returns once every chunk is on the host.
int StagedPath::put(const PathOp& op) {
  wait_for_stream(op, "a staged put");
  if (op.local_device < 0 || op.len == 0) return TcpPath::put(op);
  auto payload = std::make_shared<cuda::StagedPayload>(outbox_, peer_, op.len, op.local_device, op.deadline);
  static const SignalSpec kNone;
  payload->fill(op.local_device, op.local, op.deadline, [&] {
    outbox_->post_put_staged(peer_, op.ctx, payload, win_, op.remote_off, op.sig ? *op.sig : kNone);
  });
  return 0;
}

// Device memory here, a device window there (or, for writes, a host window), without a signal or
// a stream: one block of the call's batch of writes or reads (staged_batch.h).
// FLAGCX_MESH_CUDA_BATCH_COPY=off sends each op alone.
Queued StagedPath::queue_staged(const PathOp& op, cuda::StagedBatch* batch) {
  // Reads come from device memory only (the target gathers them); writes land in host regions too.
  bool remote_ok = remote_device_ >= 0 || !batch->is_read();
  if (op.sig != nullptr || op.stream_set || op.wait_here || op.local_device < 0 || !remote_ok || op.len == 0 ||
      cuda_batch_copy_env() == "off") {
    return Queued::kNo;
  }
  return batch->add(op, win_, remote_device_) ? Queued::kYes : Queued::kBatchFirst;
}

// A get into device memory: the engine lands the answer through its ring of
// pinned buffers, each copied up while the next fills (progress_ops.cc), and counts the get
// complete once every copy up ended (land_get_answer): posted, it completes as a tcp get does
// (flush, the handle's wait), so gets in a row are in flight together. With a stream the call
// returns once every byte is in place, for the stream's later work.
int StagedPath::get(const PathOp& op) {
  wait_for_stream(op, "a staged get");
  if (op.local_device < 0 || op.len == 0) return TcpPath::get(op);
  outbox_->post_get(peer_, op.ctx, win_, op.remote_off, op.local, op.len, op.local_device);
  if (!op.stream_set) return 0;
  try {
    outbox_->wait_idle(peer_, op.ctx, op.deadline);
  } catch (...) {
    // Copies up queued before the get failed may still run: let them end first, so none
    // writes after the call returned (bounded; nothing more is queued for a failed get).
    try {
      cuda::wait_for_stream(op.local_device, cuda::landing_stream(op.local_device),
                            Deadline::after_seconds(env_config().timeout_s), "a failed staged get's copies up");
    } catch (const Error&) {  // the get's own error is the one to raise
    }
    throw;
  }
  return 0;
}

}  // namespace fxm
