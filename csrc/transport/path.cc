#include "transport/path.h"

#include <unistd.h>

#include <cstring>

#include "base/env.h"
#include "base/status.h"
#include "transport/cma/cma_path.h"
#include "transport/cuda/device_path.h"
#include "transport/self/self_path.h"
#include "transport/shm/shm_path.h"
#include "transport/tcp/tcp_path.h"

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
  if (!s.empty() && s != "auto") {
    fail(Code::kInvalidArgument, -1, 0, "FLAGCX_MESH_TRANSPORT=" + s + " is not one of auto, tcp, cma, shm");
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
  static const std::vector<PathFactory> order{make_self_path, make_shm_path, make_cma_path, make_tcp_path};
  return order;
}

const std::vector<PathFactory>& device_path_factories() {
  static const std::vector<PathFactory> order{make_cuda_self_path, make_cuda_vmm_path, make_cuda_ipc_path,
                                              make_staged_path};
  return order;
}

PathChoice choose_path(const PathRequest& req, const WindowDesc& d) {
  PathChoice c;
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

namespace {

template <typename T>
void put(std::vector<uint8_t>& b, T v) {
  const uint8_t* p = reinterpret_cast<const uint8_t*>(&v);
  b.insert(b.end(), p, p + sizeof(T));
}

void put_str(std::vector<uint8_t>& b, const std::string& s) {
  put<uint32_t>(b, static_cast<uint32_t>(s.size()));
  b.insert(b.end(), s.begin(), s.end());
}

struct Reader {
  const std::vector<uint8_t>& b;
  size_t off = 0;
  bool ok = true;
  template <typename T>
  T get() {
    T v{};
    if (off + sizeof(T) > b.size()) {
      ok = false;
      return v;
    }
    std::memcpy(&v, b.data() + off, sizeof(T));
    off += sizeof(T);
    return v;
  }
  std::string str() {
    uint32_t n = get<uint32_t>();
    if (!ok || n > 4096 || off + n > b.size()) {
      ok = false;
      return {};
    }
    std::string s(b.begin() + off, b.begin() + off + n);
    off += n;
    return s;
  }
};

}  // namespace

std::vector<uint8_t> WindowDesc::encode() const {
  std::vector<uint8_t> b;
  put<uint32_t>(b, static_cast<uint32_t>(kind));
  put<uint64_t>(b, size);
  put<uint64_t>(b, addr);
  put<int32_t>(b, pid);
  put_str(b, host);
  put_str(b, pid_ns);
  put_str(b, shm_name);
  put<uint64_t>(b, cookie_addr);
  put<uint64_t>(b, cookie);
  put<int32_t>(b, dev.ordinal);
  put<uint8_t>(b, dev.ipc ? 1 : 0);
  b.insert(b.end(), dev.ipc_handle.reserved, dev.ipc_handle.reserved + cuda::kIpcHandleSize);
  put<uint64_t>(b, dev.ipc_offset);
  put<uint32_t>(b, static_cast<uint32_t>(dev.vmm.size()));
  for (const cuda::VmmMapping& m : dev.vmm) {
    put<int64_t>(b, m.offset);
    put<uint64_t>(b, m.size);
  }
  put_str(b, dev.why_no_ipc);
  put_str(b, dev.why_no_vmm);
  put_str(b, fd_socket);
  put<uint64_t>(b, fd_token);
  return b;
}

bool WindowDesc::decode(const std::vector<uint8_t>& b, WindowDesc* out) {
  Reader r{b};
  uint32_t kind = r.get<uint32_t>();
  out->size = r.get<uint64_t>();
  out->addr = r.get<uint64_t>();
  out->pid = r.get<int32_t>();
  out->host = r.str();
  out->pid_ns = r.str();
  out->shm_name = r.str();
  out->cookie_addr = r.get<uint64_t>();
  out->cookie = r.get<uint64_t>();
  out->dev.ordinal = r.get<int32_t>();
  out->dev.ipc = r.get<uint8_t>() != 0;
  for (size_t i = 0; i < cuda::kIpcHandleSize; ++i) out->dev.ipc_handle.reserved[i] = static_cast<char>(r.get<uint8_t>());
  out->dev.ipc_offset = r.get<uint64_t>();
  uint32_t nmaps = r.get<uint32_t>();
  if (nmaps > 250) return false;
  for (uint32_t i = 0; r.ok && i < nmaps; ++i) {
    int64_t off = r.get<int64_t>();
    out->dev.vmm.push_back({off, r.get<uint64_t>()});
  }
  out->dev.why_no_ipc = r.str();
  out->dev.why_no_vmm = r.str();
  out->fd_socket = r.str();
  out->fd_token = r.get<uint64_t>();
  if (kind < 1 || kind > 4) return false;
  out->kind = static_cast<WindowKind>(kind);
  return r.ok && r.off == b.size();
}

}  // namespace fxm
