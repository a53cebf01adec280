// Modules and kernel launches: the one kernel the library loads, fxm_copy_blocks
// (transport/cuda/kernels/copy_blocks.cu), run on the stream as the device would run it.
// The image must be PTX naming that entry; the launch reads its copy list when the
// stream reaches it (from registered host memory, as the device reads it: a list
// reused before the kernel ran shows as wrong bytes), runs the copies last to first
// (the device does not order them: a caller that relies on their order gets the
// wrong bytes) and, per copy, exactly the chunks the grid covers.
#include <cstring>
#include <vector>

#include "table.h"

namespace fakecuda {
namespace {

int module_tag, function_tag;  // their addresses are the handles

struct ListEntry {
  CUdeviceptr dst, src;
  unsigned long long len;
};

CUresult run_copy_blocks(CUdeviceptr list, unsigned grid_x, unsigned grid_y, unsigned long long chunk) {
  std::shared_lock<std::shared_mutex> g(table_lock());
  size_t bytes = size_t{grid_x} * sizeof(ListEntry);
  if (!find_host(static_cast<uintptr_t>(list), bytes)) return kIllegalAddress;  // the list is gone
  std::vector<ListEntry> copies(grid_x);
  std::memcpy(copies.data(), reinterpret_cast<const void*>(list), bytes);
  for (size_t i = copies.size(); i-- > 0;) {
    const ListEntry& c = copies[i];
    for (unsigned y = 0; y < grid_y; ++y) {
      unsigned long long from = y * chunk;
      if (from >= c.len) break;
      size_t n = static_cast<size_t>(c.len - from < chunk ? c.len - from : chunk);
      std::vector<Span> d, s;
      if (resolve(c.dst + from, n, &d) != kSuccess || resolve(c.src + from, n, &s) != kSuccess) return kIllegalAddress;
      copy_spans(d, s);
    }
  }
  return kSuccess;
}

}  // namespace
}  // namespace fakecuda

using namespace fakecuda;

FAKE_API CUresult cuModuleLoadData(void** module, const void* image) {
  FAKE_ENTER("cuModuleLoadData");
  FAKE_NEED_CONTEXT();
  if (!module || !image) return kInvalidValue;
  const char* ptx = static_cast<const char*>(image);
  if (!std::strstr(ptx, ".entry fxm_copy_blocks(") || !std::strstr(ptx, ".target sm_")) return kInvalidPtx;
  *module = &module_tag;
  return kSuccess;
}

FAKE_API CUresult cuModuleGetFunction(void** fn, void* module, const char* name) {
  FAKE_ENTER("cuModuleGetFunction");
  if (!fn || module != &module_tag || !name) return kInvalidValue;
  if (std::strcmp(name, "fxm_copy_blocks") != 0) return kNotFound;
  *fn = &function_tag;
  return kSuccess;
}

FAKE_API CUresult cuLaunchKernel(void* fn, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                                 unsigned bz, unsigned shared, void* stream, void** params, void** extra) {
  FAKE_ENTER("cuLaunchKernel");
  if (fn != &function_tag || !params || extra || gz != 1 || by != 1 || bz != 1 || shared != 0) return kInvalidValue;
  if (gx == 0 || gy == 0 || gy > 65535 || bx == 0 || bx > 256) return kInvalidValue;  // __launch_bounds__(256)
  CUdeviceptr list = *static_cast<CUdeviceptr*>(params[0]);
  unsigned long long chunk = *static_cast<unsigned long long*>(params[1]);
  if (chunk == 0) return kInvalidValue;
  return enqueue_on(stream, [=] { return run_copy_blocks(list, gx, gy, chunk); });
}
