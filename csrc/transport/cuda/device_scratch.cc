#include "transport/cuda/device_scratch.h"

#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include "base/env.h"
#include "base/status.h"
#include "transport/cuda/device_memory.h"

namespace fxm::cuda {
namespace {

struct Pool {
  std::mutex mu;
  std::map<std::pair<int, uint64_t>, std::vector<CUdeviceptr>> free;  // by (device, size)
};
Pool& pool() {
  static Pool* p = new Pool();  // never destroyed: buffers may come back during exit
  return *p;
}

uint64_t size_class(uint64_t n) {
  uint64_t c = 64 << 10;
  while (c < n) c <<= 1;
  return c;
}

}  // namespace

DeviceScratch device_scratch(uint64_t n, int ordinal) {
  uint64_t size = size_class(n);
  CUdeviceptr p = 0;
  {
    Pool& pl = pool();
    std::lock_guard<std::mutex> lock(pl.mu);
    auto& v = pl.free[{ordinal, size}];
    if (!v.empty()) {
      p = v.back();
      v.pop_back();
    }
  }
  if (p == 0) {
    const Driver& d = need_driver("device scratch for staged copies");
    use_device(ordinal);
    CUresult r = d.cuMemAlloc(&p, size);
    if (r != kSuccess) {
      fail(Code::kSystem, -1, 0,
           "device scratch of " + std::to_string(size) + " bytes for staged copies: cuMemAlloc: " + result_text(r));
    }
  }
  return DeviceScratch(reinterpret_cast<void*>(p), [ordinal, size](void* q) {
    Pool& pl = pool();
    std::lock_guard<std::mutex> lock(pl.mu);
    pl.free[{ordinal, size}].push_back(reinterpret_cast<CUdeviceptr>(q));
  });
}

bool staged_bounce() {
  static const bool on = [] {
    std::string v = staged_bounce_env();
    if (v.empty() || v == "off") return false;
    if (v == "on") return true;
    fail(Code::kInvalidArgument, -1, 0, "FLAGCX_MESH_STAGED_BOUNCE=" + v + ": want on or off");
  }();
  return on;
}

}  // namespace fxm::cuda
