// Virtual memory management (cuMemCreate & co.): an allocation handle is a
// memfd; a reservation is PROT_NONE address space; cuMemMap maps the memfd
// into it (still PROT_NONE: the CPU cannot touch device memory) with an alias
// for the fake's copies. POSIX fds really cross processes (SCM_RIGHTS).
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <mutex>

#include "table.h"

namespace fakecuda {
namespace {

void drop_physical(Handle h) {
  Physical* p = table().handles.at(h);
  if (--p->refs > 0) return;
  close(p->fd);
  table().handles.erase(h);
  delete p;
}

CUresult check_prop(const MemAllocationProp* prop) {
  if (!prop || prop->type != 1 || prop->location.type != 1) return kInvalidValue;
  if (prop->location.id < 0 || prop->location.id >= device_count()) return kInvalidDevice;
  return kSuccess;
}

Handle add_physical(int fd, size_t size, int device, int types) {
  Table& t = table();
  auto p = new Physical{fd, size, device, types, t.next_id++, 1};
  t.handles[p->id] = p;
  return p->id;
}

const Reservation* reservation_holding(CUdeviceptr ptr, size_t size) {
  auto& all = table().reservations;
  auto it = all.upper_bound(ptr);
  if (it == all.begin()) return nullptr;
  --it;
  const Reservation& r = it->second;
  return ptr + size <= r.base + r.size ? &r : nullptr;
}

// The VMM mappings covering [ptr, ptr+size) exactly, in order; empty if they do not.
std::vector<Range*> mappings_covering(CUdeviceptr ptr, size_t size) {
  std::vector<Range*> out;
  CUdeviceptr at = ptr;
  while (at < ptr + size) {
    auto it = table().ranges.find(at);
    if (it == table().ranges.end() || it->second.kind != Kind::kVmmMapping) return {};
    out.push_back(&it->second);
    at += it->second.size;
  }
  return at == ptr + size ? out : std::vector<Range*>{};
}

bool any_range_inside(CUdeviceptr ptr, size_t size) {
  auto it = table().ranges.lower_bound(ptr);
  return it != table().ranges.end() && it->first < ptr + size;
}

// Address space for a reservation, aligned to `align` (a power of two).
void* reserve_space(size_t size, size_t align, CUdeviceptr hint) {
  constexpr int kFlags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE;
  if (hint) {
    void* p = mmap(reinterpret_cast<void*>(hint), size, PROT_NONE, kFlags, -1, 0);
    if (p == reinterpret_cast<void*>(hint)) return p;
    if (p != MAP_FAILED) munmap(p, size);
  }
  void* raw = mmap(nullptr, size + align, PROT_NONE, kFlags, -1, 0);
  if (raw == MAP_FAILED) return nullptr;
  uintptr_t start = reinterpret_cast<uintptr_t>(raw);
  uintptr_t aligned = (start + align - 1) & ~(uintptr_t(align) - 1);
  if (aligned > start) munmap(raw, aligned - start);
  size_t tail = start + size + align - (aligned + size);
  if (tail) munmap(reinterpret_cast<void*>(aligned + size), tail);
  return reinterpret_cast<void*>(aligned);
}

}  // namespace
}  // namespace fakecuda

using namespace fakecuda;

FAKE_API CUresult cuMemGetAllocationGranularity(size_t* gran, const MemAllocationProp* prop, int option) {
  FAKE_ENTER("cuMemGetAllocationGranularity");
  if (!gran || (option != 0 && option != 1)) return kInvalidValue;
  if (CUresult r = check_prop(prop)) return r;
  *gran = granularity();
  return kSuccess;
}

FAKE_API CUresult cuMemCreate(Handle* h, size_t size, const MemAllocationProp* prop,
                              unsigned long long flags) {
  FAKE_ENTER("cuMemCreate");
  if (!h || flags != 0 || size == 0 || size % granularity() != 0) return kInvalidValue;
  if (CUresult r = check_prop(prop)) return r;
  int types = prop->requested_handle_types;
  if (types & kHandleFabric) return kNotPermitted;  // no IMEX channel, as on the H200
  if (types & ~kHandlePosixFd) return kNotSupported;
  std::unique_lock<std::shared_mutex> g(table_lock());
  int fd = new_memfd(size, prop->location.id, types, table().next_id);
  if (fd < 0) return kOutOfMemory;
  *h = add_physical(fd, size, prop->location.id, types);
  return kSuccess;
}

FAKE_API CUresult cuMemRelease(Handle h) {
  FAKE_ENTER("cuMemRelease");
  std::unique_lock<std::shared_mutex> g(table_lock());
  if (!table().handles.count(h)) return kInvalidValue;
  drop_physical(h);
  return kSuccess;
}

FAKE_API CUresult cuMemAddressReserve(CUdeviceptr* ptr, size_t size, size_t alignment,
                                      CUdeviceptr addr, unsigned long long flags) {
  FAKE_ENTER("cuMemAddressReserve");
  size_t gran = granularity();
  if (!ptr || flags != 0 || size == 0 || size % gran != 0) return kInvalidValue;
  if (alignment & (alignment - 1)) return kInvalidValue;
  void* p = reserve_space(size, alignment > gran ? alignment : gran, addr);
  if (!p) return kOutOfMemory;
  std::unique_lock<std::shared_mutex> g(table_lock());
  *ptr = reinterpret_cast<CUdeviceptr>(p);
  table().reservations[*ptr] = Reservation{*ptr, size};
  return kSuccess;
}

FAKE_API CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) {
  FAKE_ENTER("cuMemAddressFree");
  std::unique_lock<std::shared_mutex> g(table_lock());
  auto it = table().reservations.find(ptr);
  if (it == table().reservations.end() || it->second.size != size) return kInvalidValue;
  if (any_range_inside(ptr, size)) return kInvalidValue;  // unmap first
  munmap(reinterpret_cast<void*>(ptr), size);
  table().reservations.erase(it);
  return kSuccess;
}

FAKE_API CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, Handle h,
                           unsigned long long flags) {
  FAKE_ENTER("cuMemMap");
  size_t gran = granularity();
  if (offset != 0 || flags != 0 || size == 0 || size % gran || ptr % gran) return kInvalidValue;
  std::unique_lock<std::shared_mutex> g(table_lock());
  auto hit = table().handles.find(h);
  if (hit == table().handles.end() || size > hit->second->size) return kInvalidValue;
  const Reservation* res = reservation_holding(ptr, size);
  if (!res || find_range(ptr) || any_range_inside(ptr, size)) return kInvalidValue;
  Range r;
  char* base = nullptr;
  r.mapped = size;
  if (!map_views(hit->second->fd, size, reinterpret_cast<void*>(ptr), &base, &r.alias))
    return kOutOfMemory;
  r.base = ptr;
  r.size = size;
  r.kind = Kind::kVmmMapping;
  r.device = hit->second->device;
  r.phys = hit->second;
  r.reservation = res->base;
  hit->second->refs++;
  table().ranges[ptr] = r;
  return kSuccess;
}

FAKE_API CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
  FAKE_ENTER("cuMemUnmap");
  std::unique_lock<std::shared_mutex> g(table_lock());
  std::vector<Range*> maps = mappings_covering(ptr, size);
  if (maps.empty()) return kInvalidValue;
  for (Range* r : maps) {
    Handle h = r->phys->id;
    CUdeviceptr base = r->base;
    unmap_views(*r);
    table().ranges.erase(base);
    drop_physical(h);
  }
  return kSuccess;
}

FAKE_API CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const MemAccessDesc* desc, size_t count) {
  FAKE_ENTER("cuMemSetAccess");
  if (!desc || count == 0) return kInvalidValue;
  bool access = false;
  for (size_t i = 0; i < count; ++i) {
    const MemAccessDesc& d = desc[i];
    if (d.location.type != 1 || d.location.id < 0 || d.location.id >= device_count()) return kInvalidDevice;
    if (d.flags != 0 && d.flags != 1 && d.flags != 3) return kInvalidValue;
    access = access || d.flags != 0;
  }
  std::unique_lock<std::shared_mutex> g(table_lock());
  std::vector<Range*> maps = mappings_covering(ptr, size);
  if (maps.empty()) return kInvalidValue;
  for (Range* r : maps) r->access = access;
  return kSuccess;
}

FAKE_API CUresult cuMemRetainAllocationHandle(Handle* h, void* addr) {
  FAKE_ENTER("cuMemRetainAllocationHandle");
  if (!h) return kInvalidValue;
  std::unique_lock<std::shared_mutex> g(table_lock());
  Range* r = find_range(reinterpret_cast<CUdeviceptr>(addr));
  if (!r || r->kind != Kind::kVmmMapping) return kInvalidValue;
  r->phys->refs++;
  *h = r->phys->id;
  return kSuccess;
}

FAKE_API CUresult cuMemExportToShareableHandle(void* shareable, Handle h, int type,
                                               unsigned long long flags) {
  FAKE_ENTER("cuMemExportToShareableHandle");
  if (!shareable || flags != 0 || type != kHandlePosixFd) return kInvalidValue;
  std::shared_lock<std::shared_mutex> g(table_lock());
  auto it = table().handles.find(h);
  if (it == table().handles.end() || !(it->second->handle_types & kHandlePosixFd)) return kInvalidValue;
  int fd = fcntl(it->second->fd, F_DUPFD_CLOEXEC, 0);
  if (fd < 0) return kOutOfMemory;
  *static_cast<int*>(shareable) = fd;
  return kSuccess;
}

FAKE_API CUresult cuMemImportFromShareableHandle(Handle* h, void* shareable, int type) {
  FAKE_ENTER("cuMemImportFromShareableHandle");
  if (!h || type != kHandlePosixFd) return kInvalidValue;
  int fd = static_cast<int>(reinterpret_cast<intptr_t>(shareable));
  long owner = 0;
  unsigned long long id = 0;
  int device = 0, types = 0;
  struct stat st;
  if (!read_memfd_name(0, fd, &owner, &id, &device, &types) || fstat(fd, &st) != 0) return kInvalidValue;
  if (device >= device_count()) return kInvalidDevice;
  int mine = fcntl(fd, F_DUPFD_CLOEXEC, 0);
  if (mine < 0) return kInvalidValue;
  std::unique_lock<std::shared_mutex> g(table_lock());
  *h = add_physical(mine, static_cast<size_t>(st.st_size), device, types);
  return kSuccess;
}
