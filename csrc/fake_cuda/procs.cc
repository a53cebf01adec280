// cuGetProcAddress: the library resolves every entry point through it, by
// base name ("cuMemGetAddressRange" gives cuMemGetAddressRange_v2, as the
// driver answers for CUDA 12.0 and later). The exact exported names are
// answered too.
#include <cstring>

#include "fake_cuda.h"

// The entry points, declared only to take their addresses (their real
// signatures are in the files that define them).
extern "C" {
void cuInit();
void cuDriverGetVersion();
void cuGetErrorName();
void cuGetErrorString();
void cuDeviceGet();
void cuDeviceGetCount();
void cuDevicePrimaryCtxRetain();
void cuCtxSetCurrent();
void cuCtxGetCurrent();
void cuCtxGetDevice();
void cuCtxSynchronize();
void cuPointerGetAttribute();
void cuMemGetAddressRange_v2();
void cuIpcGetMemHandle();
void cuIpcOpenMemHandle_v2();
void cuIpcCloseMemHandle();
void cuMemGetAllocationGranularity();
void cuMemCreate();
void cuMemRelease();
void cuMemAddressReserve();
void cuMemAddressFree();
void cuMemMap();
void cuMemUnmap();
void cuMemSetAccess();
void cuMemRetainAllocationHandle();
void cuMemExportToShareableHandle();
void cuMemImportFromShareableHandle();
void cuMemcpyAsync();
void cuMemcpyBatchAsync_v2();
void cuModuleLoadData();
void cuModuleGetFunction();
void cuLaunchKernel();
void cuMemHostRegister_v2();
void cuMemHostUnregister();
void cuMemHostGetDevicePointer_v2();
void cuStreamCreate();
void cuStreamDestroy_v2();
void cuStreamSynchronize();
void cuStreamWaitEvent();
void cuStreamWaitValue64_v2();
void cuLaunchHostFunc();
void cuEventCreate();
void cuEventRecord();
void cuEventQuery();
void cuEventSynchronize();
void cuEventDestroy_v2();
void cuMemAlloc_v2();
void cuMemFree_v2();
void cuMemcpyHtoD_v2();
void cuMemcpyDtoH_v2();
}

namespace fakecuda {
namespace {

struct Proc {
  const char* name;
  void* fn;
};

const Proc kProcs[] = {
    {"cuInit", reinterpret_cast<void*>(&cuInit)},
    {"cuDriverGetVersion", reinterpret_cast<void*>(&cuDriverGetVersion)},
    {"cuGetErrorName", reinterpret_cast<void*>(&cuGetErrorName)},
    {"cuGetErrorString", reinterpret_cast<void*>(&cuGetErrorString)},
    {"cuDeviceGet", reinterpret_cast<void*>(&cuDeviceGet)},
    {"cuDeviceGetCount", reinterpret_cast<void*>(&cuDeviceGetCount)},
    {"cuDevicePrimaryCtxRetain", reinterpret_cast<void*>(&cuDevicePrimaryCtxRetain)},
    {"cuCtxSetCurrent", reinterpret_cast<void*>(&cuCtxSetCurrent)},
    {"cuCtxGetCurrent", reinterpret_cast<void*>(&cuCtxGetCurrent)},
    {"cuCtxGetDevice", reinterpret_cast<void*>(&cuCtxGetDevice)},
    {"cuCtxSynchronize", reinterpret_cast<void*>(&cuCtxSynchronize)},
    {"cuPointerGetAttribute", reinterpret_cast<void*>(&cuPointerGetAttribute)},
    {"cuMemGetAddressRange", reinterpret_cast<void*>(&cuMemGetAddressRange_v2)},
    {"cuIpcGetMemHandle", reinterpret_cast<void*>(&cuIpcGetMemHandle)},
    {"cuIpcOpenMemHandle", reinterpret_cast<void*>(&cuIpcOpenMemHandle_v2)},
    {"cuIpcCloseMemHandle", reinterpret_cast<void*>(&cuIpcCloseMemHandle)},
    {"cuMemGetAllocationGranularity", reinterpret_cast<void*>(&cuMemGetAllocationGranularity)},
    {"cuMemCreate", reinterpret_cast<void*>(&cuMemCreate)},
    {"cuMemRelease", reinterpret_cast<void*>(&cuMemRelease)},
    {"cuMemAddressReserve", reinterpret_cast<void*>(&cuMemAddressReserve)},
    {"cuMemAddressFree", reinterpret_cast<void*>(&cuMemAddressFree)},
    {"cuMemMap", reinterpret_cast<void*>(&cuMemMap)},
    {"cuMemUnmap", reinterpret_cast<void*>(&cuMemUnmap)},
    {"cuMemSetAccess", reinterpret_cast<void*>(&cuMemSetAccess)},
    {"cuMemRetainAllocationHandle", reinterpret_cast<void*>(&cuMemRetainAllocationHandle)},
    {"cuMemExportToShareableHandle", reinterpret_cast<void*>(&cuMemExportToShareableHandle)},
    {"cuMemImportFromShareableHandle", reinterpret_cast<void*>(&cuMemImportFromShareableHandle)},
    {"cuMemcpyAsync", reinterpret_cast<void*>(&cuMemcpyAsync)},
    {"cuMemcpyBatchAsync", reinterpret_cast<void*>(&cuMemcpyBatchAsync_v2)},
    {"cuModuleLoadData", reinterpret_cast<void*>(&cuModuleLoadData)},
    {"cuModuleGetFunction", reinterpret_cast<void*>(&cuModuleGetFunction)},
    {"cuLaunchKernel", reinterpret_cast<void*>(&cuLaunchKernel)},
    {"cuMemHostRegister", reinterpret_cast<void*>(&cuMemHostRegister_v2)},
    {"cuMemHostUnregister", reinterpret_cast<void*>(&cuMemHostUnregister)},
    {"cuMemHostGetDevicePointer", reinterpret_cast<void*>(&cuMemHostGetDevicePointer_v2)},
    {"cuStreamCreate", reinterpret_cast<void*>(&cuStreamCreate)},
    {"cuStreamDestroy", reinterpret_cast<void*>(&cuStreamDestroy_v2)},
    {"cuStreamSynchronize", reinterpret_cast<void*>(&cuStreamSynchronize)},
    {"cuStreamWaitEvent", reinterpret_cast<void*>(&cuStreamWaitEvent)},
    {"cuStreamWaitValue64", reinterpret_cast<void*>(&cuStreamWaitValue64_v2)},
    {"cuLaunchHostFunc", reinterpret_cast<void*>(&cuLaunchHostFunc)},
    {"cuEventCreate", reinterpret_cast<void*>(&cuEventCreate)},
    {"cuEventRecord", reinterpret_cast<void*>(&cuEventRecord)},
    {"cuEventQuery", reinterpret_cast<void*>(&cuEventQuery)},
    {"cuEventSynchronize", reinterpret_cast<void*>(&cuEventSynchronize)},
    {"cuEventDestroy", reinterpret_cast<void*>(&cuEventDestroy_v2)},
    {"cuMemAlloc", reinterpret_cast<void*>(&cuMemAlloc_v2)},
    {"cuMemFree", reinterpret_cast<void*>(&cuMemFree_v2)},
    {"cuMemcpyHtoD", reinterpret_cast<void*>(&cuMemcpyHtoD_v2)},
    {"cuMemcpyDtoH", reinterpret_cast<void*>(&cuMemcpyDtoH_v2)},
};

void* find_proc(const char* symbol) {
  for (const Proc& p : kProcs) {
    if (std::strcmp(p.name, symbol) == 0) return p.fn;
    size_t n = std::strlen(p.name);
    // the versioned name itself: "cuMemGetAddressRange_v2"
    if (std::strncmp(p.name, symbol, n) == 0 && std::strcmp(symbol + n, "_v2") == 0) return p.fn;
  }
  return nullptr;
}

}  // namespace
}  // namespace fakecuda

using namespace fakecuda;

FAKE_API CUresult cuGetProcAddress_v2(const char* symbol, void** pfn, int cuda_version,
                                      unsigned long long flags, int* status) {
  if (!symbol || !pfn || cuda_version <= 0) return kInvalidValue;
  (void)flags;
  void* fn = find_proc(symbol);
  *pfn = fn;
  if (status) *status = fn ? 0 : 1;  // CU_GET_PROC_ADDRESS_SUCCESS / _SYMBOL_NOT_FOUND
  return fn ? kSuccess : kNotFound;
}

FAKE_API CUresult cuGetProcAddress(const char* symbol, void** pfn, int cuda_version,
                                   unsigned long long flags) {
  return cuGetProcAddress_v2(symbol, pfn, cuda_version, flags, nullptr);
}
