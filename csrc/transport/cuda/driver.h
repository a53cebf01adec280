// The CUDA driver, loaded at run time: no CUDA header or library is needed to
// build flagcx_mesh, and a machine without a GPU runs every host path.
//
// driver() loads libcuda.so.1 (or the library FLAGCX_MESH_CUDA_DRIVER names:
// tests use a fake driver) once, resolves the entry points below through
// cuGetProcAddress (ABI of CUDA 12.0) or dlsym, and calls cuInit. When that
// fails it returns nullptr and driver_error() says why ("libcuda.so.1: cannot
// open shared object file ..."). The types and constants are the driver
// API's own values, declared here so that no CUDA header is included.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace fxm::cuda {

using CUresult = int;
using CUdevice = int;
using CUdeviceptr = unsigned long long;
using CUcontext = void*;
using CUstream = void*;
using CUevent = void*;
using CUmemGenericAllocationHandle = unsigned long long;
using CUhostFn = void (*)(void* user_data);
using CUmodule = void*;
using CUfunction = void*;

constexpr CUresult kSuccess = 0;
constexpr CUresult kErrInvalidValue = 1;
constexpr CUresult kErrNotInitialized = 3;
constexpr CUresult kErrNoDevice = 100;
constexpr CUresult kErrNotReady = 600;
constexpr CUresult kErrNotPermitted = 800;
constexpr CUresult kErrNotSupported = 801;

// CUpointer_attribute
enum PointerAttr : int {
  kPtrContext = 1,
  kPtrMemoryType = 2,
  kPtrDeviceOrdinal = 9,
  kPtrIsLegacyIpcCapable = 10,
  kPtrRangeStartAddr = 11,
  kPtrRangeSize = 12,
  kPtrAllowedHandleTypes = 14,
  kPtrMappingSize = 18,
  kPtrMappingBaseAddr = 19,
};
constexpr unsigned kMemoryTypeHost = 1, kMemoryTypeDevice = 2, kMemoryTypeUnified = 4;
// CUmemAllocationHandleType
constexpr int kHandlePosixFd = 1, kHandleFabric = 8;
// cuStreamWaitValue64 flags
constexpr unsigned kWaitGeq = 0;
// cuMemHostRegister flags
constexpr unsigned kHostRegisterPortable = 1, kHostRegisterDeviceMap = 2;
constexpr unsigned kIpcLazyEnablePeerAccess = 1;
constexpr unsigned kStreamNonBlocking = 1;
constexpr unsigned kEventDisableTiming = 2;
constexpr int kAccessReadWrite = 3;          // CU_MEM_ACCESS_FLAGS_PROT_READWRITE
constexpr int kLocationDevice = 1;           // CU_MEM_LOCATION_TYPE_DEVICE
constexpr int kAllocationPinned = 1;         // CU_MEM_ALLOCATION_TYPE_PINNED
constexpr int kGranularityMinimum = 0;
constexpr size_t kIpcHandleSize = 64;

struct MemLocation {
  int type;
  int id;
};
struct MemAllocationProp {  // CUmemAllocationProp
  int type;
  int requested_handle_types;
  MemLocation location;
  void* win32_metadata;
  unsigned char compression_type;
  unsigned char gpu_direct_rdma_capable;
  unsigned short usage;
  unsigned char reserved[4];
};
struct MemAccessDesc {  // CUmemAccessDesc
  MemLocation location;
  int flags;
};
struct IpcMemHandle {
  char reserved[kIpcHandleSize];
};
constexpr int kSrcAccessOrderStream = 1;  // CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
struct MemcpyAttributes {  // CUmemcpyAttributes
  int src_access_order;
  MemLocation src_hint;
  MemLocation dst_hint;
  unsigned flags;
};
// cuMemcpyBatchAsync as of CUDA 13.0, and as of 12.8 (with a failIdx out-parameter).
using MemcpyBatch13 = CUresult (*)(CUdeviceptr* dsts, CUdeviceptr* srcs, size_t* sizes, size_t count,
                                   MemcpyAttributes* attrs, size_t* attr_idxs, size_t num_attrs, CUstream s);
using MemcpyBatch12 = CUresult (*)(CUdeviceptr* dsts, CUdeviceptr* srcs, size_t* sizes, size_t count,
                                   MemcpyAttributes* attrs, size_t* attr_idxs, size_t num_attrs, size_t* fail_idx,
                                   CUstream s);

// The entry points flagcx_mesh uses, with the driver's own signatures.
struct Driver {
  CUresult (*cuInit)(unsigned);
  CUresult (*cuDriverGetVersion)(int*);
  CUresult (*cuGetErrorName)(CUresult, const char**);
  CUresult (*cuGetErrorString)(CUresult, const char**);
  CUresult (*cuDeviceGet)(CUdevice*, int);
  CUresult (*cuDeviceGetCount)(int*);
  CUresult (*cuDevicePrimaryCtxRetain)(CUcontext*, CUdevice);
  CUresult (*cuCtxSetCurrent)(CUcontext);
  CUresult (*cuCtxGetCurrent)(CUcontext*);
  CUresult (*cuCtxGetDevice)(CUdevice*);
  CUresult (*cuPointerGetAttribute)(void* data, int attr, CUdeviceptr ptr);
  CUresult (*cuMemGetAddressRange)(CUdeviceptr* base, size_t* size, CUdeviceptr ptr);
  CUresult (*cuIpcGetMemHandle)(IpcMemHandle* handle, CUdeviceptr ptr);
  CUresult (*cuIpcOpenMemHandle)(CUdeviceptr* ptr, IpcMemHandle handle, unsigned flags);
  CUresult (*cuIpcCloseMemHandle)(CUdeviceptr ptr);
  CUresult (*cuMemGetAllocationGranularity)(size_t* gran, const MemAllocationProp* prop, int option);
  CUresult (*cuMemCreate)(CUmemGenericAllocationHandle* h, size_t size, const MemAllocationProp* prop,
                          unsigned long long flags);
  CUresult (*cuMemRelease)(CUmemGenericAllocationHandle h);
  CUresult (*cuMemAddressReserve)(CUdeviceptr* ptr, size_t size, size_t alignment, CUdeviceptr addr,
                                  unsigned long long flags);
  CUresult (*cuMemAddressFree)(CUdeviceptr ptr, size_t size);
  CUresult (*cuMemMap)(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle h,
                       unsigned long long flags);
  CUresult (*cuMemUnmap)(CUdeviceptr ptr, size_t size);
  CUresult (*cuMemSetAccess)(CUdeviceptr ptr, size_t size, const MemAccessDesc* desc, size_t count);
  CUresult (*cuMemRetainAllocationHandle)(CUmemGenericAllocationHandle* h, void* addr);
  CUresult (*cuMemExportToShareableHandle)(void* shareable, CUmemGenericAllocationHandle h, int type,
                                           unsigned long long flags);
  CUresult (*cuMemImportFromShareableHandle)(CUmemGenericAllocationHandle* h, void* shareable, int type);
  CUresult (*cuMemcpyAsync)(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s);
  CUresult (*cuMemAlloc)(CUdeviceptr* p, size_t n);
  CUresult (*cuMemFree)(CUdeviceptr p);
  CUresult (*cuMemHostRegister)(void* p, size_t n, unsigned flags);
  CUresult (*cuMemHostUnregister)(void* p);
  CUresult (*cuMemHostGetDevicePointer)(CUdeviceptr* dptr, void* p, unsigned flags);
  CUresult (*cuStreamCreate)(CUstream* s, unsigned flags);
  CUresult (*cuStreamDestroy)(CUstream s);
  CUresult (*cuStreamSynchronize)(CUstream s);
  CUresult (*cuStreamWaitEvent)(CUstream s, CUevent e, unsigned flags);
  CUresult (*cuStreamWaitValue64)(CUstream s, CUdeviceptr addr, uint64_t value, unsigned flags);
  CUresult (*cuLaunchHostFunc)(CUstream s, CUhostFn fn, void* user_data);
  CUresult (*cuEventCreate)(CUevent* e, unsigned flags);
  CUresult (*cuEventRecord)(CUevent e, CUstream s);
  CUresult (*cuEventQuery)(CUevent e);
  CUresult (*cuEventSynchronize)(CUevent e);
  CUresult (*cuEventDestroy)(CUevent e);
  // Optional (null where the driver lacks it): many copies in one call, CUDA 12.8 and later;
  // at most one of the two is set, in the ABI of the driver's version.
  MemcpyBatch13 cuMemcpyBatchAsync13;
  MemcpyBatch12 cuMemcpyBatchAsync12;
  // Optional: kernels loaded from PTX (copy_kernel.h); null where the driver lacks one.
  CUresult (*cuModuleLoadData)(CUmodule* m, const void* image);
  CUresult (*cuModuleGetFunction)(CUfunction* f, CUmodule m, const char* name);
  CUresult (*cuLaunchKernel)(CUfunction f, unsigned grid_x, unsigned grid_y, unsigned grid_z, unsigned block_x,
                             unsigned block_y, unsigned block_z, unsigned shared_bytes, CUstream s, void** params,
                             void** extra);
};

// The loaded driver, or nullptr (then driver_error() says why).
const Driver* driver();
const std::string& driver_error();

// "CUDA_ERROR_NOT_PERMITTED (operation not permitted)" for a result code.
std::string result_text(CUresult r);

}  // namespace fxm::cuda
