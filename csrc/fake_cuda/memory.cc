// Device memory as memfds: the address table, copies through aliases,
// cuMemAlloc memory, registered host memory and pointer attributes.
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <chrono>
#include <mutex>
#include <thread>

#include "table.h"

namespace fakecuda {

Table& table() {
  static Table* t = new Table;  // never destroyed: stream threads may outlive exit()
  return *t;
}

std::shared_mutex& table_lock() {
  static std::shared_mutex* mu = new std::shared_mutex;
  return *mu;
}

Range* find_range(CUdeviceptr addr) {
  auto& ranges = table().ranges;
  auto it = ranges.upper_bound(addr);
  if (it == ranges.begin()) return nullptr;
  --it;
  return addr < it->second.base + it->second.size ? &it->second : nullptr;
}

const HostRegion* find_host(uintptr_t p, size_t n) {
  auto& host = table().host;
  auto it = host.upper_bound(p);
  if (it == host.begin()) return nullptr;
  --it;
  const HostRegion& h = it->second;
  return p + n <= h.base + h.size ? &h : nullptr;
}

size_t page_round(size_t n) {
  size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return (n + page - 1) / page * page;
}

int new_memfd(size_t size, int device, int handle_types, unsigned long long id) {
  char name[128];
  std::snprintf(name, sizeof name, "fxm-fakecuda:pid=%ld:id=%llu:dev=%d:types=%d",
                static_cast<long>(getpid()), id, device, handle_types);
  int fd = memfd_create(name, MFD_CLOEXEC);
  if (fd < 0) return -1;
  if (ftruncate(fd, static_cast<off_t>(page_round(size))) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

bool read_memfd_name(long pid, int fd, long* owner, unsigned long long* id, int* device,
                     int* types) {
  char path[64], link[256];
  if (pid) std::snprintf(path, sizeof path, "/proc/%ld/fd/%d", pid, fd);
  else std::snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
  ssize_t n = readlink(path, link, sizeof link - 1);
  if (n <= 0) return false;
  link[n] = '\0';
  return std::sscanf(link, "/memfd:fxm-fakecuda:pid=%ld:id=%llu:dev=%d:types=%d", owner, id,
                     device, types) == 4;
}

bool map_views(int fd, size_t mapped, void* at, char** base, char** alias) {
  int fixed = at ? MAP_FIXED : 0;
  void* b = mmap(at, mapped, PROT_NONE, MAP_SHARED | fixed, fd, 0);
  if (b == MAP_FAILED) return false;
  void* a = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (a == MAP_FAILED) {
    munmap(b, mapped);
    return false;
  }
  *base = static_cast<char*>(b);
  *alias = static_cast<char*>(a);
  return true;
}

void unmap_views(const Range& r) {
  munmap(r.alias, r.mapped);
  if (r.kind == Kind::kVmmMapping)  // give the pages back to the reservation
    mmap(reinterpret_cast<void*>(r.base), r.mapped, PROT_NONE,
         MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
  else
    munmap(reinterpret_cast<void*>(r.base), r.mapped);
}

CUresult resolve(CUdeviceptr addr, size_t n, std::vector<Span>* out) {
  out->clear();
  const Range* r = find_range(addr);
  if (!r) {  // host memory, used as it is
    if (n) out->push_back({reinterpret_cast<char*>(addr), n});
    return kSuccess;
  }
  while (n > 0) {
    if (!r || (r->kind == Kind::kVmmMapping && !r->access)) return kIllegalAddress;
    size_t take = std::min<size_t>(n, r->base + r->size - addr);
    out->push_back({r->alias + (addr - r->base), take});
    addr += take;
    n -= take;
    if (n) r = find_range(addr);
  }
  return kSuccess;
}

void copy_spans(const std::vector<Span>& dst, const std::vector<Span>& src) {
  size_t di = 0, si = 0, doff = 0, soff = 0;
  while (di < dst.size() && si < src.size()) {
    size_t take = std::min(dst[di].n - doff, src[si].n - soff);
    std::memmove(dst[di].p + doff, src[si].p + soff, take);
    doff += take;
    soff += take;
    if (doff == dst[di].n) di++, doff = 0;
    if (soff == src[si].n) si++, soff = 0;
  }
}

bool device_visible(CUdeviceptr addr, size_t n) {
  std::vector<Span> spans;
  if (find_range(addr)) return resolve(addr, n, &spans) == kSuccess;
  return find_host(static_cast<uintptr_t>(addr), n) != nullptr;
}

namespace {

// A synchronous copy (cuMemcpyHtoD / DtoH): done when it returns.
CUresult copy_now(CUdeviceptr dst, CUdeviceptr src, size_t n) {
  std::shared_lock<std::shared_mutex> g(table_lock());
  std::vector<Span> d, s;
  if (resolve(dst, n, &d) || resolve(src, n, &s)) return kInvalidValue;
  copy_spans(d, s);
  return kSuccess;
}

CUresult free_legacy(CUdeviceptr ptr) {
  std::unique_lock<std::shared_mutex> g(table_lock());
  auto it = table().ranges.find(ptr);
  if (it == table().ranges.end() || it->second.kind != Kind::kLegacy) return kInvalidValue;
  unmap_views(it->second);
  close(it->second.phys->fd);
  delete it->second.phys;
  table().ranges.erase(it);
  return kSuccess;
}

}  // namespace
}  // namespace fakecuda

using namespace fakecuda;

FAKE_API CUresult cuMemAlloc_v2(CUdeviceptr* ptr, size_t size) {
  FAKE_ENTER("cuMemAlloc");
  FAKE_NEED_CONTEXT();
  if (!ptr || size == 0) return kInvalidValue;
  std::unique_lock<std::shared_mutex> g(table_lock());
  Table& t = table();
  auto phys = new Physical{-1, size, current_device(), 0, t.next_id++, 1};
  phys->fd = new_memfd(size, phys->device, 0, phys->id);
  Range r;
  char* base = nullptr;
  r.mapped = page_round(size);
  if (phys->fd < 0 || !map_views(phys->fd, r.mapped, nullptr, &base, &r.alias)) {
    if (phys->fd >= 0) close(phys->fd);
    delete phys;
    return kOutOfMemory;
  }
  r.base = reinterpret_cast<CUdeviceptr>(base);
  r.size = size;
  r.device = phys->device;
  r.phys = phys;
  t.ranges[r.base] = r;
  *ptr = r.base;
  return kSuccess;
}

FAKE_API CUresult cuMemFree_v2(CUdeviceptr ptr) {
  FAKE_ENTER("cuMemFree");  // the H200 answers a bad pointer without a context, not 201
  return free_legacy(ptr);
}

FAKE_API CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void* src, size_t n) {
  FAKE_ENTER("cuMemcpyHtoD");
  FAKE_NEED_CONTEXT();
  return copy_now(dst, reinterpret_cast<CUdeviceptr>(src), n);
}

FAKE_API CUresult cuMemcpyDtoH_v2(void* dst, CUdeviceptr src, size_t n) {
  FAKE_ENTER("cuMemcpyDtoH");
  FAKE_NEED_CONTEXT();
  return copy_now(reinterpret_cast<CUdeviceptr>(dst), src, n);
}

// As the H200 answers: an allocation, a VMM mapping with access granted, or a
// registered host range; CUDA_ERROR_NOT_FOUND for anything else.
FAKE_API CUresult cuMemGetAddressRange_v2(CUdeviceptr* base, size_t* size, CUdeviceptr ptr) {
  FAKE_ENTER("cuMemGetAddressRange");
  FAKE_NEED_CONTEXT();
  std::shared_lock<std::shared_mutex> g(table_lock());
  CUdeviceptr b = 0;
  size_t n = 0;
  if (const Range* r = find_range(ptr)) {
    if (r->kind == Kind::kVmmMapping && !r->access) return kNotFound;
    b = r->base, n = r->size;
  } else if (const HostRegion* h = find_host(static_cast<uintptr_t>(ptr), 1)) {
    b = h->base, n = h->size;
  } else {
    return kNotFound;
  }
  if (base) *base = b;
  if (size) *size = n;
  return kSuccess;
}

// ----------------------------------------------------------------- host memory

FAKE_API CUresult cuMemHostRegister_v2(void* p, size_t n, unsigned flags) {
  FAKE_ENTER("cuMemHostRegister");
  FAKE_NEED_CONTEXT();
  constexpr unsigned kIoMemory = 4, kKnown = 1 | 2 | 4 | 8;
  if (!p || n == 0 || (flags & ~kKnown) || (flags & kIoMemory)) return kInvalidValue;
  std::unique_lock<std::shared_mutex> g(table_lock());
  auto& host = table().host;
  uintptr_t b = reinterpret_cast<uintptr_t>(p);
  auto next = host.lower_bound(b);
  if (next != host.end() && next->first < b + n) return kHostAlreadyRegistered;
  if (next != host.begin() && std::prev(next)->second.base + std::prev(next)->second.size > b)
    return kHostAlreadyRegistered;
  if (find_range(b)) return kInvalidValue;
  host[b] = HostRegion{b, n};
  return kSuccess;
}

FAKE_API CUresult cuMemHostUnregister(void* p) {
  FAKE_ENTER("cuMemHostUnregister");  // needs no context on the H200
  size_t n = 0;
  {
    std::shared_lock<std::shared_mutex> g(table_lock());
    auto it = table().host.find(reinterpret_cast<uintptr_t>(p));
    if (it == table().host.end()) return kHostNotRegistered;
    n = it->second.size;
  }
  // Unpinning takes time (FXM_FAKECUDA_HOST_UNREGISTER_US_PER_MIB), and the driver waits for
  // running host functions.
  std::this_thread::sleep_for(std::chrono::microseconds((n >> 20) * host_unregister_us_per_mib()));
  wait_host_functions_idle();
  std::unique_lock<std::shared_mutex> g(table_lock());
  if (table().host.erase(reinterpret_cast<uintptr_t>(p)) == 0) return kHostNotRegistered;
  return kSuccess;
}

FAKE_API CUresult cuMemHostGetDevicePointer_v2(CUdeviceptr* dptr, void* p, unsigned flags) {
  FAKE_ENTER("cuMemHostGetDevicePointer");
  FAKE_NEED_CONTEXT();
  if (!dptr || flags != 0) return kInvalidValue;
  std::shared_lock<std::shared_mutex> g(table_lock());
  if (!find_host(reinterpret_cast<uintptr_t>(p), 1)) return kInvalidValue;
  *dptr = reinterpret_cast<CUdeviceptr>(p);  // the H200 answers the host address itself
  return kSuccess;
}

// ----------------------------------------------------------------- attributes

namespace fakecuda {
namespace {

// What cuPointerGetAttribute reports for one pointer.
struct PointerFacts {
  unsigned memory_type;
  int device;
  int legacy_ipc;
  unsigned long long handle_types;
  CUdeviceptr range_start, mapping_base;
  size_t range_size, mapping_size;
};

bool pointer_facts(CUdeviceptr ptr, PointerFacts* f) {
  if (const Range* r = find_range(ptr)) {
    *f = PointerFacts{2, r->device, r->kind == Kind::kLegacy, 0, r->base, r->base, r->size, r->size};
    if (r->kind == Kind::kVmmMapping) {
      const Reservation& res = table().reservations.at(r->reservation);
      f->handle_types = static_cast<unsigned long long>(r->phys->handle_types);
      f->range_start = res.base;
      f->range_size = res.size;
    }
    return true;
  }
  if (const HostRegion* h = find_host(static_cast<uintptr_t>(ptr), 1)) {
    *f = PointerFacts{1, 0, 0, 0, h->base, h->base, h->size, h->size};
    return true;
  }
  return false;  // unregistered pageable memory: the driver knows nothing of it
}

template <typename T>
CUresult put(void* data, T value) {
  std::memcpy(data, &value, sizeof value);
  return kSuccess;
}

CUresult write_attribute(void* data, int attr, const PointerFacts& f) {
  switch (attr) {
    case 1: return put<void*>(data, primary_context(f.device));   // CONTEXT
    case 2: return put<unsigned>(data, f.memory_type);             // MEMORY_TYPE
    case 9: return put<int>(data, f.device);                       // DEVICE_ORDINAL
    case 10: return put<int>(data, f.legacy_ipc);                  // IS_LEGACY_CUDA_IPC_CAPABLE
    case 11: return put<CUdeviceptr>(data, f.range_start);         // RANGE_START_ADDR
    case 12: return put<size_t>(data, f.range_size);               // RANGE_SIZE
    case 14: return put<unsigned long long>(data, f.handle_types); // ALLOWED_HANDLE_TYPES
    case 18: return put<size_t>(data, f.mapping_size);             // MAPPING_SIZE
    case 19: return put<void*>(data, reinterpret_cast<void*>(f.mapping_base));  // MAPPING_BASE_ADDR
    default: return kInvalidValue;
  }
}

}  // namespace
}  // namespace fakecuda

FAKE_API CUresult cuPointerGetAttribute(void* data, int attr, CUdeviceptr ptr) {
  FAKE_ENTER("cuPointerGetAttribute");
  if (!data) return kInvalidValue;
  std::shared_lock<std::shared_mutex> g(table_lock());
  PointerFacts f;
  if (!pointer_facts(ptr, &f)) return kInvalidValue;
  return write_attribute(data, attr, f);
}
