#include "transport/cuda/driver.h"

#include <dlfcn.h>

#include <mutex>

#include "base/env.h"

namespace fxm::cuda {
namespace {

using GetProcAddress = CUresult (*)(const char*, void**, int, unsigned long long, int*);
constexpr int kAbiVersion = 12000;  // the entry points' signatures as of CUDA 12.0

struct Loaded {
  Driver d{};
  bool ok = false;
  std::string error;
};

// Resolves `name` (the base name: cuGetProcAddress picks the version).
bool resolve(GetProcAddress gpa, const char* name, void** out, std::string* error) {
  *out = nullptr;
  int status = 0;
  if (gpa(name, out, kAbiVersion, 0, &status) == kSuccess && *out != nullptr) return true;
  *error = std::string("the CUDA driver has no entry point ") + name;
  return false;
}

// The kernel entry points (every driver since CUDA 4 has them; a fake driver may not).
void resolve_kernel_calls(GetProcAddress gpa, Driver& d) {
  std::string ignored;
  void* fn[3] = {};
  if (!resolve(gpa, "cuModuleLoadData", &fn[0], &ignored) || !resolve(gpa, "cuModuleGetFunction", &fn[1], &ignored) ||
      !resolve(gpa, "cuLaunchKernel", &fn[2], &ignored)) {
    return;
  }
  d.cuModuleLoadData = reinterpret_cast<decltype(d.cuModuleLoadData)>(fn[0]);
  d.cuModuleGetFunction = reinterpret_cast<decltype(d.cuModuleGetFunction)>(fn[1]);
  d.cuLaunchKernel = reinterpret_cast<decltype(d.cuLaunchKernel)>(fn[2]);
}

// The entry points a driver may lack, each in the ABI of the driver's own version.
void resolve_optional(GetProcAddress gpa, Driver& d) {
  resolve_kernel_calls(gpa, d);
  int version = 0;
  if (d.cuDriverGetVersion(&version) != kSuccess || version < 12080) return;
  void* fn = nullptr;
  int status = 0;
  int abi = version >= 13000 ? 13000 : 12080;
  if (gpa("cuMemcpyBatchAsync", &fn, abi, 0, &status) != kSuccess || fn == nullptr) return;
  if (abi == 13000) d.cuMemcpyBatchAsync13 = reinterpret_cast<MemcpyBatch13>(fn);
  else d.cuMemcpyBatchAsync12 = reinterpret_cast<MemcpyBatch12>(fn);
}

#define FXM_CU_ENTRY(name) {#name, reinterpret_cast<void**>(&d.name)}

bool resolve_all(void* lib, Driver& d, std::string* error) {
  auto gpa = reinterpret_cast<GetProcAddress>(::dlsym(lib, "cuGetProcAddress_v2"));
  if (gpa == nullptr) {
    *error = "no cuGetProcAddress_v2";
    return false;
  }
  struct Entry {
    const char* name;
    void** slot;
  } entries[] = {
      FXM_CU_ENTRY(cuInit), FXM_CU_ENTRY(cuDriverGetVersion), FXM_CU_ENTRY(cuGetErrorName),
      FXM_CU_ENTRY(cuGetErrorString), FXM_CU_ENTRY(cuDeviceGet), FXM_CU_ENTRY(cuDeviceGetCount),
      FXM_CU_ENTRY(cuDevicePrimaryCtxRetain), FXM_CU_ENTRY(cuCtxSetCurrent), FXM_CU_ENTRY(cuCtxGetCurrent), FXM_CU_ENTRY(cuCtxGetDevice),
      FXM_CU_ENTRY(cuPointerGetAttribute), FXM_CU_ENTRY(cuMemGetAddressRange), FXM_CU_ENTRY(cuIpcGetMemHandle),
      FXM_CU_ENTRY(cuIpcOpenMemHandle), FXM_CU_ENTRY(cuIpcCloseMemHandle),
      FXM_CU_ENTRY(cuMemGetAllocationGranularity), FXM_CU_ENTRY(cuMemCreate), FXM_CU_ENTRY(cuMemRelease),
      FXM_CU_ENTRY(cuMemAddressReserve), FXM_CU_ENTRY(cuMemAddressFree), FXM_CU_ENTRY(cuMemMap),
      FXM_CU_ENTRY(cuMemUnmap), FXM_CU_ENTRY(cuMemSetAccess), FXM_CU_ENTRY(cuMemRetainAllocationHandle),
      FXM_CU_ENTRY(cuMemExportToShareableHandle), FXM_CU_ENTRY(cuMemImportFromShareableHandle),
      FXM_CU_ENTRY(cuMemcpyAsync), FXM_CU_ENTRY(cuMemAlloc), FXM_CU_ENTRY(cuMemFree),
      FXM_CU_ENTRY(cuMemHostRegister), FXM_CU_ENTRY(cuMemHostUnregister),
      FXM_CU_ENTRY(cuMemHostGetDevicePointer), FXM_CU_ENTRY(cuStreamCreate), FXM_CU_ENTRY(cuStreamDestroy),
      FXM_CU_ENTRY(cuStreamSynchronize), FXM_CU_ENTRY(cuStreamWaitEvent), FXM_CU_ENTRY(cuStreamWaitValue64),
      FXM_CU_ENTRY(cuLaunchHostFunc), FXM_CU_ENTRY(cuEventCreate), FXM_CU_ENTRY(cuEventRecord),
      FXM_CU_ENTRY(cuEventQuery), FXM_CU_ENTRY(cuEventSynchronize), FXM_CU_ENTRY(cuEventDestroy),
  };
  for (const Entry& e : entries) {
    if (!resolve(gpa, e.name, e.slot, error)) return false;
  }
  resolve_optional(gpa, d);
  return true;
}

#undef FXM_CU_ENTRY

Loaded load() {
  Loaded l;
  std::string path = cuda_driver_env();
  if (path.empty()) path = "libcuda.so.1";
  void* lib = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* why = ::dlerror();
    l.error = "no CUDA driver: " + std::string(why != nullptr ? why : path + " not found") +
              " (device memory needs an NVIDIA driver; FLAGCX_MESH_CUDA_DRIVER names another library)";
    return l;
  }
  std::string error;
  if (!resolve_all(lib, l.d, &error)) {
    l.error = path + ": " + error + " (a driver for CUDA 12.0 or later is needed)";
    return l;
  }
  CUresult r = l.d.cuInit(0);
  if (r != kSuccess) {
    const char* name = nullptr;
    l.d.cuGetErrorName(r, &name);
    l.error = path + ": cuInit failed: " + (name != nullptr ? name : "CUDA error " + std::to_string(r)) +
              " (no usable GPU?)";
    return l;
  }
  l.ok = true;
  return l;
}

const Loaded& loaded() {
  static const Loaded l = load();
  return l;
}

}  // namespace

const Driver* driver() {
  const Loaded& l = loaded();
  return l.ok ? &l.d : nullptr;
}

const std::string& driver_error() { return loaded().error; }

std::string result_text(CUresult r) {
  const Driver* d = driver();
  const char* name = nullptr;
  const char* text = nullptr;
  if (d != nullptr) {
    d->cuGetErrorName(r, &name);
    d->cuGetErrorString(r, &text);
  }
  std::string s = name != nullptr ? name : "CUDA error " + std::to_string(r);
  if (text != nullptr) s += std::string(" (") + text + ")";
  return s;
}

}  // namespace fxm::cuda
