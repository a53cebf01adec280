#include "transport/cuda/staging.h"

#include <algorithm>
#include <cstdlib>
#include <map>
#include <mutex>
#include <vector>

#include "base/status.h"
#include "transport/cuda/device_memory.h"

namespace fxm::cuda {
namespace {

constexpr uint64_t kMinBytes = 64 << 10;
constexpr size_t kKeepPerSize = 4;
constexpr uint64_t kKeepBytes = 512ull << 20;
constexpr uint64_t kMaxBytes = 1ull << 48;  // size classes stay powers of two up to this

struct Pool {
  std::mutex mu;
  std::map<uint64_t, std::vector<uint8_t*>> free;  // by size
  uint64_t kept = 0;                               // bytes in `free`
  // Every live buffer of the pool (held or free): its bytes and whether kernels may use it at its
  // own address, as the driver answered once at its registration. device_addressable() reads it
  // here: asked of the driver for every chunk, it took the driver's lock that the lanes' launches
  // and the landings' event queries wait for.
  std::map<const uint8_t*, std::pair<uint64_t, bool>> live;
};
Pool& pool() {
  static Pool* p = new Pool();  // never destroyed: buffers may come back during exit
  return *p;
}

// Staged ops cut in chunks hold many buffers of one size at once (a ring per
// put in flight, a few per op landing, a get answer's chunks): those sizes keep
// up to half of kKeepBytes.
size_t keep_per_size(uint64_t bytes) {
  return std::max<size_t>(kKeepPerSize, static_cast<size_t>(kKeepBytes / 2 / bytes));
}

uint64_t size_class(uint64_t n) {
  uint64_t c = kMinBytes;
  while (c < n) c <<= 1;
  return c;
}

// Whether the driver maps the registered buffer at p for kernels at that same address.
bool mapped_at_own_address(const Driver* d, const uint8_t* p) {
  if (d == nullptr || !d->cuMemHostGetDevicePointer) return false;
  CUdeviceptr dev = 0;
  return d->cuMemHostGetDevicePointer(&dev, const_cast<uint8_t*>(p), 0) == kSuccess &&
         dev == reinterpret_cast<CUdeviceptr>(p);
}

uint8_t* allocate(uint64_t bytes, int ordinal) {
  void* p = nullptr;
  int rc = ::posix_memalign(&p, 4096, bytes);
  if (rc != 0) {
    fail(Code::kSystem, -1, rc, "allocating a staging buffer of " + std::to_string(bytes) + " bytes");
  }
  const Driver* d = driver();
  bool mapped = false;
  if (d != nullptr) {
    use_device(ordinal);
    // Mapped for the devices too (the copy kernel gathers into it and scatters out of it); pinned
    // alone where mapping is refused, pageable where neither works.
    if (d->cuMemHostRegister(p, bytes, kHostRegisterPortable | kHostRegisterDeviceMap) == kSuccess) {
      mapped = mapped_at_own_address(d, static_cast<uint8_t*>(p));
    } else {
      d->cuMemHostRegister(p, bytes, kHostRegisterPortable);
    }
  }
  Pool& pl = pool();
  std::lock_guard<std::mutex> lock(pl.mu);
  pl.live[static_cast<uint8_t*>(p)] = {bytes, mapped};
  return static_cast<uint8_t*>(p);
}

void give_back(uint64_t bytes, uint8_t* p) {
  Pool& pl = pool();
  {
    std::lock_guard<std::mutex> lock(pl.mu);
    std::vector<uint8_t*>& v = pl.free[bytes];
    if (v.size() < keep_per_size(bytes) && pl.kept + bytes <= kKeepBytes) {
      v.push_back(p);
      pl.kept += bytes;
      return;
    }
    pl.live.erase(p);
  }
  const Driver* d = driver();
  if (d != nullptr) d->cuMemHostUnregister(p);
  std::free(p);
}

}  // namespace

bool device_addressable(const uint8_t* p) {
  {
    Pool& pl = pool();
    std::lock_guard<std::mutex> lock(pl.mu);
    auto it = pl.live.upper_bound(p);  // the pool's buffer holding p, if any: the last one at or below it
    if (it != pl.live.begin() && p < (--it)->first + it->second.first) return it->second.second;
  }
  return mapped_at_own_address(driver(), p);  // not the pool's: the driver answers
}

HostBuffer staging_buffer(uint64_t n, int ordinal) {
  if (n > kMaxBytes) {  // size_class() would not end; no window is that large
    fail(Code::kInvalidArgument, -1, 0, "a staging buffer of " + std::to_string(n) + " bytes: over the limit of " +
                                            std::to_string(kMaxBytes));
  }
  uint64_t bytes = size_class(n);
  uint8_t* p = nullptr;
  {
    Pool& pl = pool();
    std::lock_guard<std::mutex> lock(pl.mu);
    std::vector<uint8_t*>& v = pl.free[bytes];
    if (!v.empty()) {
      p = v.back();
      v.pop_back();
      pl.kept -= bytes;
    }
  }
  if (p == nullptr) p = allocate(bytes, ordinal);
  return HostBuffer(p, [bytes](uint8_t* b) { give_back(bytes, b); });
}

}  // namespace fxm::cuda
