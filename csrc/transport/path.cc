#include "transport/path.h"

#include <unistd.h>

#include <cstring>

#include "base/bytes.h"
#include "base/env.h"
#include "base/status.h"
#include "transport/binding.h"
#include "transport/cma/cma_path.h"
#include "transport/cuda/device_path.h"
#include "transport/self/self_path.h"
#include "transport/shm/shm_path.h"
#include "transport/tcp/tcp_path.h"
#include "transport/ucx/ucx_path.h"

namespace fxm {

const char* path_name(PathKind k) {
  switch (k) {
    case PathKind::kSelf: return "self";
    case PathKind::kShm: return "shm";
    case PathKind::kCma: return "cma";
    case PathKind::kTcp: return "tcp";
    case PathKind::kCudaSelf: return "cuda-self";
    case PathKind::kCudaVmm: return "cuda-vmm";
    case PathKind::kCudaIpc: return "cuda-ipc";
    case PathKind::kStaged: return "staged";
    case PathKind::kUcx: return "ucx";
  }
  return "?";
}

const char* kind_name(WindowKind k) {
  switch (k) {
    case WindowKind::kUser: return "user";
    case WindowKind::kShm: return "shm";
    case WindowKind::kSignal: return "signal";
    case WindowKind::kDevice: return "device";
  }
  return "?";
}

ForcedTransport forced_transport() {
  std::string s = transport_env();
  if (s == "tcp") return ForcedTransport::kTcp;
  if (s == "cma") return ForcedTransport::kCma;
  if (s == "shm") return ForcedTransport::kShm;
  if (s == "ucx") return ForcedTransport::kUcx;
  if (!s.empty() && s != "auto") {
    fail(Code::kInvalidArgument, -1, 0, "FLAGCX_MESH_TRANSPORT=" + s + " is not one of auto, tcp, cma, shm, ucx");
  }
  return ForcedTransport::kAuto;
}

ForcedCudaPath forced_cuda_path() {
  std::string s = cuda_path_env();
  if (s == "cuda-vmm") return ForcedCudaPath::kVmm;
  if (s == "cuda-ipc") return ForcedCudaPath::kIpc;
  if (s == "staged") return ForcedCudaPath::kStaged;
  if (!s.empty() && s != "auto") {
    fail(Code::kInvalidArgument, -1, 0, "FLAGCX_MESH_CUDA_PATH=" + s + " is not one of auto, cuda-vmm, cuda-ipc, staged");
  }
  return ForcedCudaPath::kAuto;
}

const std::string& pid_namespace() {
  static const std::string ns = [] {
    char buf[128];
    ssize_t n = ::readlink("/proc/self/ns/pid", buf, sizeof(buf) - 1);
    return n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string();
  }();
  return ns;
}

const std::vector<PathFactory>& path_factories() {
  static const std::vector<PathFactory> order{make_self_path, make_shm_path, make_cma_path, make_ucx_path,
                                              make_tcp_path};
  return order;
}

const std::vector<PathFactory>& device_path_factories() {
  static const std::vector<PathFactory> order{make_cuda_self_path, make_cuda_vmm_path, make_cuda_ipc_path,
                                              make_ucx_path, make_staged_path};
  return order;
}

// The description is bound to the peer once, here, for every factory (binding.h).
PathChoice choose_path(const PathRequest& request, const WindowDesc& d) {
  PathChoice c;
  Binding b;
  if (request.peer != request.me) b = bind_to_peer(request, d);
  else b.process = "this rank's own copy";
  if (b.mismatch) c.mismatch = b.sealed;
  PathRequest req = request;
  req.binding = &b;
  bool device = d.kind == WindowKind::kDevice || req.kind == WindowKind::kDevice;
  for (PathFactory make : device ? device_path_factories() : path_factories()) {
    std::string why;
    c.path = make(req, d, &why);
    if (!why.empty() && c.why.find(why) == std::string::npos) c.why += (c.why.empty() ? "" : "; ") + why;
    if (c.path) break;
  }
  return c;
}

// ------------------------------------------------------------ WindowDesc

// Strings of a description (host ids, names, reasons) are at most this long.
constexpr size_t kMaxDescString = 4096;
// The tag of the optional UCX block at a description's end.
constexpr uint8_t kUcxBlock = 0x55;

std::vector<uint8_t> WindowDesc::encode() const {
  bytes::Writer w;
  w.put<uint32_t>(static_cast<uint32_t>(kind));
  w.put<uint64_t>(size);
  w.put<uint64_t>(addr);
  w.put<int32_t>(pid);
  w.str(host);
  w.str(pid_ns);
  w.str(shm_name);
  w.put<uint64_t>(cookie_addr);
  w.put<uint64_t>(cookie);
  w.put<int32_t>(dev.ordinal);
  w.put<uint8_t>(dev.ipc ? 1 : 0);
  w.raw(dev.ipc_handle.reserved, cuda::kIpcHandleSize);
  w.put<uint64_t>(dev.ipc_offset);
  w.put<uint32_t>(static_cast<uint32_t>(dev.vmm.size()));
  for (const cuda::VmmMapping& m : dev.vmm) {
    w.put<int64_t>(m.offset);
    w.put<uint64_t>(m.size);
  }
  w.str(dev.why_no_ipc);
  w.str(dev.why_no_vmm);
  w.str(fd_socket);
  w.put<uint64_t>(fd_token);
  if (!ucx_rkey.empty()) {  // the UCX block: absent from descriptions of windows without UCX
    w.put<uint8_t>(kUcxBlock);
    w.str(ucx_rkey);
    w.str(ucx_transports);
    w.str(ucx_worker);
  }
  return std::move(w.b);
}

bool WindowDesc::decode(const std::vector<uint8_t>& b, WindowDesc* out) {
  bytes::Reader r{b};
  uint32_t kind = r.get<uint32_t>();
  out->size = r.get<uint64_t>();
  out->addr = r.get<uint64_t>();
  out->pid = r.get<int32_t>();
  out->host = r.str(kMaxDescString);
  out->pid_ns = r.str(kMaxDescString);
  out->shm_name = r.str(kMaxDescString);
  out->cookie_addr = r.get<uint64_t>();
  out->cookie = r.get<uint64_t>();
  out->dev.ordinal = r.get<int32_t>();
  out->dev.ipc = r.get<uint8_t>() != 0;
  r.raw(out->dev.ipc_handle.reserved, cuda::kIpcHandleSize);
  out->dev.ipc_offset = r.get<uint64_t>();
  uint32_t nmaps = r.get<uint32_t>();
  if (nmaps > 250) return false;
  for (uint32_t i = 0; r.ok() && i < nmaps; ++i) {
    int64_t off = r.get<int64_t>();
    out->dev.vmm.push_back({off, r.get<uint64_t>()});
  }
  out->dev.why_no_ipc = r.str(kMaxDescString);
  out->dev.why_no_vmm = r.str(kMaxDescString);
  out->fd_socket = r.str(kMaxDescString);
  out->fd_token = r.get<uint64_t>();
  if (r.more()) {
    if (r.get<uint8_t>() != kUcxBlock) return false;
    out->ucx_rkey = r.str(kMaxDescString);
    out->ucx_transports = r.str(kMaxDescString);
    out->ucx_worker = r.str(kMaxDescString);
    if (out->ucx_rkey.empty()) return false;
  }
  if (kind < 1 || kind > 4) return false;
  out->kind = static_cast<WindowKind>(kind);
  return r.at_end();
}

}  // namespace fxm
