// Legacy CUDA IPC over memfds: a handle names the exporter's pid and the fd
// of the allocation's memfd; the importer opens /proc/<pid>/fd/<fd> (same
// user), checks the memfd's name, and maps it. One mapping per handle per
// process, counted.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <mutex>

#include "table.h"

namespace fakecuda {

struct IpcMemHandle {  // CUipcMemHandle
  char reserved[64];
};

namespace {

constexpr uint32_t kIpcMagic = 0x43465846;  // "FXFC"

struct IpcWire {
  uint32_t magic;
  int32_t device;
  int64_t pid;
  int64_t fd;
  uint64_t size;
  uint64_t id;
};
static_assert(sizeof(IpcWire) <= sizeof(IpcMemHandle), "the wire form fits a CUipcMemHandle");

// Opens the exporter's memfd, checking that it still is the allocation the handle names.
int open_exported(const IpcWire& w) {
  long owner = 0;
  unsigned long long id = 0;
  int device = 0, types = 0;
  if (!read_memfd_name(w.pid, static_cast<int>(w.fd), &owner, &id, &device, &types)) return -1;
  if (owner != w.pid || id != w.id) return -1;  // the fd number was reused
  char path[64];
  std::snprintf(path, sizeof path, "/proc/%lld/fd/%lld", static_cast<long long>(w.pid),
                static_cast<long long>(w.fd));
  int fd = open(path, O_RDWR | O_CLOEXEC);
  struct stat st;
  if (fd >= 0 && (fstat(fd, &st) != 0 || static_cast<uint64_t>(st.st_size) < w.size)) {
    close(fd);
    return -1;
  }
  return fd;
}

CUresult map_opened(const IpcWire& w, CUdeviceptr* ptr) {
  int fd = open_exported(w);
  if (fd < 0) return kInvalidValue;
  Range r;
  char* base = nullptr;
  r.mapped = page_round(w.size);
  bool ok = map_views(fd, r.mapped, nullptr, &base, &r.alias);
  close(fd);  // the mappings keep the memory
  if (!ok) return kInvalidValue;
  r.base = reinterpret_cast<CUdeviceptr>(base);
  r.size = w.size;
  r.kind = Kind::kIpcOpened;
  r.device = w.device;
  r.ipc_key = {static_cast<long>(w.pid), w.id};
  r.ipc_refs = 1;
  table().ranges[r.base] = r;
  table().opened[r.ipc_key] = r.base;
  *ptr = r.base;
  return kSuccess;
}

}  // namespace
}  // namespace fakecuda

using namespace fakecuda;

FAKE_API CUresult cuIpcGetMemHandle(IpcMemHandle* handle, CUdeviceptr ptr) {
  FAKE_ENTER("cuIpcGetMemHandle");
  FAKE_NEED_CONTEXT();
  if (!handle) return kInvalidValue;
  std::shared_lock<std::shared_mutex> g(table_lock());
  const Range* r = find_range(ptr);
  if (!r || r->kind != Kind::kLegacy) return kInvalidValue;  // VMM, opened IPC, host memory
  IpcWire w{kIpcMagic, r->device, static_cast<int64_t>(getpid()), r->phys->fd, r->size, r->phys->id};
  std::memset(handle, 0, sizeof *handle);
  std::memcpy(handle, &w, sizeof w);
  return kSuccess;
}

FAKE_API CUresult cuIpcOpenMemHandle_v2(CUdeviceptr* ptr, IpcMemHandle handle, unsigned flags) {
  FAKE_ENTER("cuIpcOpenMemHandle");
  FAKE_NEED_CONTEXT();
  IpcWire w;
  std::memcpy(&w, &handle, sizeof w);
  if (!ptr || w.magic != kIpcMagic || (flags & ~1u)) return kInvalidValue;
  if (w.pid == getpid()) return kInvalidContext;  // as the driver answers its own handle
  std::unique_lock<std::shared_mutex> g(table_lock());
  auto it = table().opened.find({static_cast<long>(w.pid), w.id});
  if (it != table().opened.end()) {
    table().ranges.at(it->second).ipc_refs++;
    *ptr = it->second;
    return kSuccess;
  }
  return map_opened(w, ptr);
}

FAKE_API CUresult cuIpcCloseMemHandle(CUdeviceptr ptr) {
  FAKE_ENTER("cuIpcCloseMemHandle");
  FAKE_NEED_CONTEXT();
  std::unique_lock<std::shared_mutex> g(table_lock());
  auto it = table().ranges.find(ptr);
  if (it == table().ranges.end() || it->second.kind != Kind::kIpcOpened) return kInvalidValue;
  if (--it->second.ipc_refs > 0) return kSuccess;
  unmap_views(it->second);
  table().opened.erase(it->second.ipc_key);
  table().ranges.erase(it);
  return kSuccess;
}
