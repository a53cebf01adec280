#include "transport/cuda/device_memory.h"

#include <unistd.h>

#include <cstring>
#include <map>
#include <mutex>

#include "base/log.h"
#include "base/status.h"

namespace fxm::cuda {

const Driver& need_driver(const std::string& doing) {
  const Driver* d = driver();
  if (d == nullptr) fail(Code::kInvalidArgument, -1, 0, doing + ": " + driver_error());
  return *d;
}

void check(CUresult r, const std::string& doing) {
  if (r != kSuccess) fail(Code::kSystem, -1, 0, doing + ": " + result_text(r));
}

namespace {

// The primary context of `ordinal`, retained once per process (never released: a device op may come at any time).
CUcontext primary_context(const Driver& d, int ordinal) {
  static std::mutex mu;
  static std::map<int, CUcontext> contexts;
  std::lock_guard<std::mutex> lock(mu);
  auto it = contexts.find(ordinal);
  if (it != contexts.end()) return it->second;
  CUdevice dev = 0;
  CUcontext ctx = nullptr;
  check(d.cuDeviceGet(&dev, ordinal), "cuDeviceGet(" + std::to_string(ordinal) + ")");
  check(d.cuDevicePrimaryCtxRetain(&ctx, dev), "cuDevicePrimaryCtxRetain(device " + std::to_string(ordinal) + ")");
  return contexts.emplace(ordinal, ctx).first->second;
}

}  // namespace

// Every device op and every poll of one calls this: the thread's last device
// is kept so that the common case is one cuCtxGetCurrent (the user may have
// made another context current since, which that call tells).
void use_device(int ordinal) {
  struct Last {
    const Driver* driver = nullptr;
    int ordinal = -1;
    CUcontext ctx = nullptr;
  };
  thread_local Last last;
  const Driver* dp = driver();  // the text only when it fails
  if (dp == nullptr) need_driver("using CUDA device " + std::to_string(ordinal));
  const Driver& d = *dp;
  if (last.driver != dp || last.ordinal != ordinal) last = Last{dp, ordinal, primary_context(d, ordinal)};
  CUcontext cur = nullptr;
  if (d.cuCtxGetCurrent(&cur) == kSuccess && cur == last.ctx) return;
  check(d.cuCtxSetCurrent(last.ctx), "cuCtxSetCurrent(device " + std::to_string(ordinal) + ")");
}

namespace {

template <typename T>
CUresult attr(const Driver& d, T* out, PointerAttr a, const void* p) {
  return d.cuPointerGetAttribute(out, a, reinterpret_cast<CUdeviceptr>(p));
}

// Some context must be current for pointer queries; device 0's primary one will do.
void ensure_some_context(const Driver& d) {
  CUcontext cur = nullptr;
  if (d.cuCtxGetCurrent(&cur) != kSuccess || cur == nullptr) use_device(0);
}

std::string hex(const void* p) {
  char b[32];
  std::snprintf(b, sizeof(b), "%p", p);
  return b;
}

// Empty, or why [p, p + size) is not one cudaMalloc allocation or an unbroken
// run of cuMem mappings (a peer maps the allocation, or each mapping, it lies in).
std::string range_problem(const Driver& d, uint8_t* p, uint64_t size) {
  uint64_t types = 0;  // cuMem: every mapping the range touches must be there
  if (attr(d, &types, kPtrAllowedHandleTypes, p) == kSuccess && types != 0) {
    for (uint8_t* a = p; a < p + size;) {
      CUdeviceptr mbase = 0;
      size_t msize = 0;
      if (attr(d, &mbase, kPtrMappingBaseAddr, a) != kSuccess || attr(d, &msize, kPtrMappingSize, a) != kSuccess ||
          msize == 0) {
        return "no cuMem mapping at " + hex(a) + " inside the range";
      }
      a = reinterpret_cast<uint8_t*>(mbase + msize);
    }
    return "";
  }
  CUdeviceptr start = 0;
  size_t len = 0;
  if (attr(d, &start, kPtrRangeStartAddr, p) != kSuccess || attr(d, &len, kPtrRangeSize, p) != kSuccess) return "";
  CUdeviceptr end = reinterpret_cast<CUdeviceptr>(p) + size;
  if (end > start + len) {
    return "it runs " + std::to_string(end - start - len) + " bytes past the end of its allocation (" +
           std::to_string(len) + " bytes at " + hex(reinterpret_cast<void*>(start)) + "); a window must lie in one";
  }
  return "";
}

}  // namespace

int current_device() {
  const Driver& d = need_driver("using a CUDA stream");
  ensure_some_context(d);
  CUdevice dev = 0;
  check(d.cuCtxGetDevice(&dev), "cuCtxGetDevice");
  return dev;
}

int device_of(const void* p) {
  const Driver* d = driver();
  if (d == nullptr || p == nullptr) return -1;
  ensure_some_context(*d);
  unsigned type = 0;
  int ordinal = -1;
  if (attr(*d, &type, kPtrMemoryType, p) != kSuccess || type != kMemoryTypeDevice) return -1;
  if (attr(*d, &ordinal, kPtrDeviceOrdinal, p) != kSuccess) return -1;
  return ordinal;
}

std::shared_ptr<DeviceMemory> DeviceMemory::wrap(void* p, uint64_t size) {
  const Driver& d = need_driver("registering device memory at " + hex(p));
  ensure_some_context(d);
  unsigned type = 0;
  CUresult r = attr(d, &type, kPtrMemoryType, p);
  if (r != kSuccess || type != kMemoryTypeDevice) {
    fail(Code::kInvalidArgument, -1, 0, "registering " + std::to_string(size) + " bytes at " + hex(p) +
                                            " as device memory: the CUDA driver does not know it as device memory (" +
                                            (r != kSuccess ? result_text(r) : "memory type " + std::to_string(type)) + ")");
  }
  auto m = std::shared_ptr<DeviceMemory>(new DeviceMemory());
  m->base_ = static_cast<uint8_t*>(p);
  m->size_ = size;
  check(attr(d, &m->ordinal_, kPtrDeviceOrdinal, p), "cuPointerGetAttribute(DEVICE_ORDINAL)");
  std::string problem = size == 0 ? "" : range_problem(d, m->base_, size);
  if (problem.empty() && size > 0 && device_of(m->base_ + size - 1) != m->ordinal_) {
    problem = "it does not lie in device memory of device " + std::to_string(m->ordinal_);
  }
  if (!problem.empty()) {
    fail(Code::kInvalidArgument, -1, 0, "registering " + std::to_string(size) + " bytes at " + hex(p) +
                                            " as device memory: " + problem);
  }
  return m;
}

std::shared_ptr<DeviceMemory> DeviceMemory::allocate(uint64_t size, int ordinal) {
  const Driver& d = need_driver("alloc_window on CUDA device " + std::to_string(ordinal));
  use_device(ordinal);
  MemAllocationProp prop{};
  prop.type = kAllocationPinned;
  prop.location = {kLocationDevice, ordinal};
  prop.requested_handle_types = kHandlePosixFd | kHandleFabric;
  size_t gran = 0;
  check(d.cuMemGetAllocationGranularity(&gran, &prop, kGranularityMinimum), "cuMemGetAllocationGranularity");
  uint64_t rounded = (size + gran - 1) / gran * gran;
  if (rounded == 0) rounded = gran;
  auto m = std::shared_ptr<DeviceMemory>(new DeviceMemory());
  m->ordinal_ = ordinal;
  m->owned_ = true;
  m->size_ = size;
  CUresult r = d.cuMemCreate(&m->handle_, rounded, &prop, 0);
  if (r != kSuccess) {  // FABRIC needs an IMEX channel: a quiet fallback, as on most hosts
    FXM_INFO(-1, "cuMemCreate with a FABRIC handle refused (" + result_text(r) + "); using a POSIX fd handle");
    prop.requested_handle_types = kHandlePosixFd;
    check(d.cuMemCreate(&m->handle_, rounded, &prop, 0),
          "cuMemCreate(" + std::to_string(rounded) + " bytes, device " + std::to_string(ordinal) + ", POSIX fd)");
  }
  CUdeviceptr va = 0;
  check(d.cuMemAddressReserve(&va, rounded, gran, 0, 0), "cuMemAddressReserve");
  m->reserved_ = rounded;
  m->base_ = reinterpret_cast<uint8_t*>(va);
  check(d.cuMemMap(va, rounded, 0, m->handle_, 0), "cuMemMap");
  MemAccessDesc access{{kLocationDevice, ordinal}, kAccessReadWrite};
  check(d.cuMemSetAccess(va, rounded, &access, 1), "cuMemSetAccess");
  return m;
}

DeviceMemory::~DeviceMemory() {
  drop_fds();
  const Driver* d = driver();
  if (!owned_ || d == nullptr) return;
  CUdeviceptr va = reinterpret_cast<CUdeviceptr>(base_);
  if (reserved_ != 0) {
    d->cuMemUnmap(va, reserved_);
    d->cuMemAddressFree(va, reserved_);
  }
  if (handle_ != 0) d->cuMemRelease(handle_);
}

void DeviceMemory::drop_fds() {
  std::lock_guard<std::mutex> lock(fds_mu_);
  for (int fd : fds_) ::close(fd);
  fds_.clear();
}

std::vector<int> DeviceMemory::fds() const {
  std::lock_guard<std::mutex> lock(fds_mu_);
  return fds_;
}

DeviceExport DeviceMemory::export_for_peers(bool with_fds) {
  const Driver& d = need_driver("exporting a device window");
  use_device(ordinal_);
  DeviceExport e;
  e.ordinal = ordinal_;
  uint64_t legacy = 0;  // a boolean written as 4 bytes
  CUdeviceptr range = 0;
  if (attr(d, &legacy, kPtrIsLegacyIpcCapable, base_) != kSuccess || legacy == 0) {
    e.why_no_ipc = "not a cudaMalloc allocation (no legacy IPC handle)";
  } else if (CUresult r = attr(d, &range, kPtrRangeStartAddr, base_); r != kSuccess) {
    e.why_no_ipc = "its allocation base is unknown: " + result_text(r);
  } else if (CUresult r2 = d.cuIpcGetMemHandle(&e.ipc_handle, range); r2 != kSuccess) {
    e.why_no_ipc = "cuIpcGetMemHandle: " + result_text(r2);
  } else {
    e.ipc = true;
    e.ipc_offset = reinterpret_cast<CUdeviceptr>(base_) - range;
  }
  describe_vmm(&e);
  if (with_fds && !e.vmm.empty()) {
    std::string why;
    if (export_fds(&why).empty()) {
      e.vmm.clear();
      e.why_no_vmm = why;
    }
  }
  return e;
}

// Each cuMem mapping the window touches (an expandable-segments tensor spans
// several): its place, asked of the driver; export_fds() makes their fds.
void DeviceMemory::describe_vmm(DeviceExport* e) {
  const Driver& d = *driver();
  uint64_t types = 0;  // 4 or 8 bytes written, depending on the driver: zeroed, read little-endian
  if (attr(d, &types, kPtrAllowedHandleTypes, base_) != kSuccess || (types & kHandlePosixFd) == 0) {
    e->why_no_vmm = "not a cuMem allocation with a POSIX fd handle";
    return;
  }
  for (uint8_t* a = base_; a < base_ + size_ || a == base_;) {
    CUdeviceptr mbase = 0;
    size_t msize = 0;
    CUresult r = attr(d, &mbase, kPtrMappingBaseAddr, a);
    if (r == kSuccess) r = attr(d, &msize, kPtrMappingSize, a);
    if (r != kSuccess || msize == 0) {
      e->vmm.clear();
      e->why_no_vmm = "the cuMem mapping at " + hex(a) + " is unknown: " + result_text(r);
      return;
    }
    e->vmm.push_back({static_cast<int64_t>(mbase - reinterpret_cast<CUdeviceptr>(base_)), msize});
    a = reinterpret_cast<uint8_t*>(mbase + msize);
    if (size_ == 0) break;
    if (e->vmm.size() > 250) {  // what one fd message carries
      e->vmm.clear();
      e->why_no_vmm = "more than 250 cuMem mappings";
      return;
    }
  }
  layout_ = e->vmm;
}

// One POSIX fd per mapping described, made at the first call and kept until drop_fds().
std::vector<int> DeviceMemory::export_fds(std::string* why) {
  std::lock_guard<std::mutex> lock(fds_mu_);
  if (!fds_.empty() || layout_.empty()) return fds_;
  const Driver& d = need_driver("exporting a device window's cuMem mappings");
  use_device(ordinal_);
  for (const VmmMapping& m : layout_) {
    uint8_t* a = base_ + m.offset;
    CUmemGenericAllocationHandle h = 0;
    int fd = -1;
    CUresult r = d.cuMemRetainAllocationHandle(&h, a);
    if (r == kSuccess) {
      r = d.cuMemExportToShareableHandle(&fd, h, kHandlePosixFd, 0);
      d.cuMemRelease(h);
    }
    if (r != kSuccess) {
      for (int f : fds_) ::close(f);
      fds_.clear();
      *why = "exporting its cuMem mapping at " + hex(a) + ": " + result_text(r);
      return {};
    }
    fds_.push_back(fd);
  }
  return fds_;
}

// ------------------------------------------------------------ PeerMapping

namespace {

// Empty, or why the published mappings do not hold the window [0, size): they
// must follow each other without a gap, the first starting at or before the
// window's base, the last ending at or after its end.
std::string vmm_layout_problem(const std::vector<VmmMapping>& maps, uint64_t size, size_t nfds) {
  if (maps.empty() || maps.size() != nfds) return "the mappings published do not match the fds served";
  if (maps.front().offset > 0) return "the first mapping starts after the window's base";
  int64_t at = maps.front().offset;
  for (const VmmMapping& m : maps) {
    if (m.offset != at || m.size == 0 || m.size > (1ull << 56)) return "the mappings published are not contiguous";
    at += static_cast<int64_t>(m.size);
  }
  if (at < 0 || static_cast<uint64_t>(at) < size) {
    return "the mappings end " + std::to_string(at) + " bytes after the window's base, before its end (" +
           std::to_string(size) + " bytes)";
  }
  return "";
}

}  // namespace

std::unique_ptr<PeerMapping> PeerMapping::import_vmm(const DeviceExport& e, uint64_t size, std::vector<int> fds,
                                                     int my_ordinal) {
  struct CloseLeft {  // every fd not yet imported is closed, whatever fails
    std::vector<int>& fds;
    ~CloseLeft() {
      for (int fd : fds) {
        if (fd >= 0) ::close(fd);
      }
    }
  } close_left{fds};
  std::string layout = vmm_layout_problem(e.vmm, size, fds.size());
  if (!layout.empty()) fail(Code::kProtocol, -1, 0, "mapping a peer's device window: " + layout);
  const Driver& d = need_driver("mapping a peer's device window");
  use_device(my_ordinal);
  std::unique_ptr<PeerMapping> m(new PeerMapping());
  m->ordinal_ = my_ordinal;
  m->kernel_device_ = my_ordinal;  // cuMemSetAccess below grants this device alone
  int64_t first = e.vmm.front().offset;
  uint64_t span = static_cast<uint64_t>(e.vmm.back().offset - first) + e.vmm.back().size;
  check(d.cuMemAddressReserve(&m->reserved_, span, 0, 0, 0),
        "cuMemAddressReserve(" + std::to_string(span) + " bytes) for a peer's window");
  m->reserved_size_ = span;
  MemAccessDesc access{{kLocationDevice, my_ordinal}, kAccessReadWrite};
  for (size_t i = 0; i < e.vmm.size(); ++i) {
    CUmemGenericAllocationHandle h = 0;
    CUresult r = d.cuMemImportFromShareableHandle(&h, reinterpret_cast<void*>(static_cast<intptr_t>(fds[i])),
                                                  kHandlePosixFd);
    ::close(fds[i]);
    fds[i] = -1;
    check(r, "cuMemImportFromShareableHandle");
    m->handles_.push_back(h);
    CUdeviceptr at = m->reserved_ + static_cast<uint64_t>(e.vmm[i].offset - first);
    check(d.cuMemMap(at, e.vmm[i].size, 0, h, 0), "cuMemMap of a peer's mapping");
    m->mapped_.push_back({at, e.vmm[i].size});
    check(d.cuMemSetAccess(at, e.vmm[i].size, &access, 1), "cuMemSetAccess on a peer's mapping");
  }
  m->window_base_ = reinterpret_cast<uint8_t*>(m->reserved_ - first);
  return m;
}

namespace {

// Opened IPC handles of this process: the driver returns one pointer per
// allocation, so each is opened once and closed when its last user goes.
struct IpcOpen {
  CUdeviceptr base = 0;
  int users = 0;
  uint64_t size = 0;  // of the allocation, as the driver says
  int device = -1;    // whose context opened it (peer access enabled for that one alone)
};
struct IpcTable {
  std::mutex mu;
  std::map<std::string, IpcOpen> open;  // by handle bytes
};
IpcTable& ipc_table() {
  static IpcTable* t = new IpcTable();  // never destroyed: mappings may outlive static destruction
  return *t;
}

}  // namespace

std::unique_ptr<PeerMapping> PeerMapping::open_ipc(const DeviceExport& e, uint64_t size, int my_ordinal) {
  const Driver& d = need_driver("opening a peer's IPC handle");
  use_device(my_ordinal);
  std::string key(e.ipc_handle.reserved, kIpcHandleSize);
  IpcTable& t = ipc_table();
  std::lock_guard<std::mutex> lock(t.mu);
  auto it = t.open.find(key);
  if (it == t.open.end()) {
    CUdeviceptr p = 0;
    check(d.cuIpcOpenMemHandle(&p, e.ipc_handle, kIpcLazyEnablePeerAccess), "cuIpcOpenMemHandle");
    CUdeviceptr base = 0;
    size_t len = 0;
    CUresult r = d.cuMemGetAddressRange(&base, &len, p);
    if (r != kSuccess || base != p) {
      d.cuIpcCloseMemHandle(p);
      fail(Code::kSystem, -1, 0, "the size of the allocation a peer's IPC handle opens is unknown: " +
                                     (r != kSuccess ? result_text(r) : std::string("its base is not the pointer opened")));
    }
    it = t.open.emplace(key, IpcOpen{p, 0, len, my_ordinal}).first;
  }
  const IpcOpen& o = it->second;
  if (e.ipc_offset > o.size || size > o.size - e.ipc_offset) {
    bool unused = o.users == 0;
    if (unused) {
      d.cuIpcCloseMemHandle(o.base);
      t.open.erase(it);
    }
    fail(Code::kProtocol, -1, 0, "the window a peer describes (" + std::to_string(size) + " bytes at offset " +
                                     std::to_string(e.ipc_offset) + ") does not lie inside the allocation its IPC "
                                     "handle opens (" + std::to_string(o.size) + " bytes)");
  }
  ++it->second.users;
  std::unique_ptr<PeerMapping> m(new PeerMapping());
  m->ordinal_ = my_ordinal;
  m->kernel_device_ = it->second.device;
  m->ipc_base_ = it->second.base;
  m->window_base_ = reinterpret_cast<uint8_t*>(m->ipc_base_ + e.ipc_offset);
  return m;
}

PeerMapping::~PeerMapping() {
  const Driver* d = driver();
  if (d == nullptr) return;
  try {
    use_device(ordinal_);
  } catch (const Error&) {  // unmapping below needs no context; closing an IPC handle may
  }
  if (ipc_base_ != 0) {
    IpcTable& t = ipc_table();
    std::lock_guard<std::mutex> lock(t.mu);
    for (auto it = t.open.begin(); it != t.open.end(); ++it) {
      if (it->second.base != ipc_base_ || --it->second.users > 0) continue;
      d->cuIpcCloseMemHandle(ipc_base_);
      t.open.erase(it);
      break;
    }
  }
  for (auto& [at, size] : mapped_) d->cuMemUnmap(at, size);
  for (CUmemGenericAllocationHandle h : handles_) d->cuMemRelease(h);
  if (reserved_ != 0) d->cuMemAddressFree(reserved_, reserved_size_);
}

}  // namespace fxm::cuda
