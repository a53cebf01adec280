// The device side of one-sided operations: device window registration, the
// checks and stream handling of an op whose path is a device path, signals
// and signal waits on CUDA streams (see docs/gpu.md).
#include <algorithm>
#include <thread>

#include "base/log.h"
#include "base/status.h"
#include "core/onesided.h"
#include "core/window_setup.h"
#include "transport/cuda/device_path.h"

namespace fxm {

uint32_t OneSided::register_device(void* base, uint64_t size) {
  return register_collective(bootstrap::CallKind::kRegisterDeviceWindow,
                             [&](uint32_t, std::string*) { return wrap_device_window(base, size); });
}

uint32_t OneSided::alloc_device(uint64_t size, int device) {
  return register_collective(bootstrap::CallKind::kAllocDeviceWindow, [&](uint32_t, std::string*) {
    if (device < 0) {
      fail(Code::kInvalidArgument, -1, 0, who() + "alloc_window: device " + std::to_string(device) + " is not a CUDA device");
    }
    auto w = std::make_shared<Window>();
    w->kind = WindowKind::kDevice;
    w->dev = cuda::DeviceMemory::allocate(size, device);
    w->device = device;
    w->base = w->dev->base();
    w->size = size;
    return w;
  });
}

namespace {

// What identifies a description's device exports ("" for none): each opens
// the memory of the rank that made it, whoever publishes it.
std::string ipc_export(const WindowDesc& d) {
  return d.dev.ipc ? "ipc:" + std::string(d.dev.ipc_handle.reserved, cuda::kIpcHandleSize) : "";
}
std::string vmm_export(const WindowDesc& d) { return d.dev.vmm.empty() ? "" : "fd:" + d.fd_socket; }

}  // namespace

void OneSided::bind_exports(std::vector<WindowDesc>* descs) {
  std::map<std::string, int> now;  // this registration's exports: the first rank that published each
  for (int r = 0; r < nranks_; ++r) {
    for (const std::string& e : {ipc_export((*descs)[r]), vmm_export((*descs)[r])}) {
      auto it = now.find(e);
      if (!e.empty()) now[e] = it == now.end() || it->second == r ? r : -1;  // -1: two ranks at once
    }
  }
  for (int r = 0; r < nranks_; ++r) {
    WindowDesc& d = (*descs)[r];
    auto owner = [&](const std::string& e) {
      auto seen = export_owner_.find(e);
      return seen != export_owner_.end() ? seen->second : now[e];
    };
    auto taken = [&](const std::string& e) {
      int o = owner(e);
      return "rank " + std::to_string(r) + " published " + (o < 0 ? "the same export as another rank in this "
             "registration" : "an export rank " + std::to_string(o) + " published") + ": it opens that rank's memory";
    };
    std::string ipc = ipc_export(d), vmm = vmm_export(d);
    if (!ipc.empty() && owner(ipc) != r) {
      d.dev.why_no_ipc = taken(ipc);
      d.dev.ipc = false;
    }
    if (!vmm.empty() && owner(vmm) != r) {
      d.dev.why_no_vmm = taken(vmm);
      d.dev.vmm.clear();
    }
  }
  for (const auto& [e, r] : now) export_owner_.emplace(e, r);  // -1 stays refused
}

// An op whose path is a device path or staged: its stream and signal; an op
// from device memory into a host window is refused (nothing was issued yet).
void OneSided::prepare_device_op(const PutArgs& a, const Window& local, const Path& p, bool is_get,
                                 bool pair_busy, PathOp* op) const {
  bool device_path = is_device_path(p.kind()) || p.kind() == PathKind::kStaged;
  if (!pair_busy && op->fence && is_device_path(p.kind())) op->fence->forget();  // idle pair: no stream wait
  if (device_path || a.stream_set) op->deadline = op_deadline(a);  // host paths never wait: no clock read
  if (local.kind == WindowKind::kDevice && !device_path && p.kind() != PathKind::kUcx) {  // (UCX moves either)
    fail(Code::kInvalidArgument, a.peer, 0, who() + (is_get ? "get" : "put") + " (peer " + std::to_string(a.peer) +
                                                "): window #" + std::to_string(local.index) +
                                                " is device memory and the peer's window is host memory; "
                                                "ops between a device and a host window are not supported");
  }
  if (a.stream_set && !device_path) {  // a host path: start after the stream's earlier work
    int ordinal = local.device >= 0 ? local.device : cuda::current_device();
    cuda::wait_for_stream(ordinal, a.stream, op->deadline, who() + "waiting for the op's stream");
    op->stream_set = false;
  }
  if (is_device_path(p.kind()) && op->sig != nullptr) {
    op->sig_slots = windows_->find(a.sig.win)->peers[a.peer].path->slots();  // applied from the stream
    if (op->sig_slots.values == nullptr) {  // reached over tcp: it follows once the copy is done
      op->sig = nullptr;
      op->wait_here = true;
    }
  }
}

// A signal alone with a stream: applied from the stream after its earlier work
// and the pair's earlier ops, when the slots are mapped here; otherwise (over
// tcp) it follows through the engine once the stream got there.
bool OneSided::signal_on_stream(const PutArgs& a, const PeerView& sig_view, const InFlight& f) {
  int ordinal = cuda::current_device();  // the stream's device; a context for this thread
  SignalSlots slots = sig_view.path->slots();
  if (slots.values == nullptr) {
    cuda::wait_for_stream(ordinal, a.stream, op_deadline(a), who() + "signal: waiting for its stream");
    return false;
  }
  if (f.busy && !is_device_path(f.kind)) engine_->wait_idle(a.peer, a.ctx, op_deadline(a));  // tcp / staged first
  cuda::StreamFence& fence = *fences_[a.peer * ncontexts_ + a.ctx];
  if (!f.busy) fence.forget();  // every earlier op of the pair completed: nothing to wait for
  fence.before(a.stream);  // after the pair's earlier device ops on other streams
  engine_->issued(a.peer, a.ctx, PathKind::kCudaSelf);
  cuda::complete_on_stream(a.stream, engine_, a.peer, a.ctx, &a.sig, slots, rank_);
  fence.after(a.stream, cuda::record_event(ordinal, a.stream));  // later ops wait for the signal too
  return true;
}

void OneSided::wait_signal_on_stream(uint32_t win, uint64_t slot, uint64_t expected, void* stream,
                                     const Deadline& deadline) const {
  OpWindows ow;
  Window& w = signal_slot(win, slot, "wait_signal", &ow);
  int ordinal = cuda::current_device();  // a context for this thread (it may never have used CUDA)
  std::string why;
  if (queue_stream_wait(w, slot, expected, stream, ordinal, &why)) return;
  static std::once_flag logged;
  std::call_once(logged, [&] {
    FXM_WARN(rank_, "wait_signal with a stream waits on the host: the driver has no stream memory operations (" +
                        why + ")");
  });
  wait_signal(win, slot, expected, deadline);
}

cuda::SharedEvent queue_stream_wait(Window& w, uint64_t slot, uint64_t expected, void* stream, int ordinal,
                                    std::string* why) {
  std::lock_guard<std::mutex> lock(w.host_reg_mu);
  if (!w.host_reg) w.host_reg = std::make_unique<cuda::HostRegistration>(w.base, w.size);
  uint64_t* at = reinterpret_cast<uint64_t*>(w.base) + slot;
  if (!cuda::stream_wait_geq(stream, w.host_reg->device_address(at), expected, why)) return nullptr;
  cuda::SharedEvent passed = cuda::record_event(ordinal, stream);
  w.stream_waits.push_back(passed);  // the slots stay mapped until it passed
  return passed;
}

// Waits (until `deadline`) for the stream waits queued on a signal window; false
// when some are still pending (then its slots must stay mapped and registered).
bool stream_waits_passed(Window& w, const Deadline& deadline) {
  std::lock_guard<std::mutex> lock(w.host_reg_mu);
  auto& waits = w.stream_waits;
  for (;;) {
    waits.erase(std::remove_if(waits.begin(), waits.end(), [](const cuda::SharedEvent& e) { return cuda::event_done(e); }),
                waits.end());
    if (waits.empty()) return true;
    if (deadline.expired()) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

}  // namespace fxm
