// A fake CUDA driver over host memory, for tests on machines without a GPU.
// libflagcx_mesh_fakecuda.so exports the driver entry points flagcx_mesh
// loads (csrc/transport/cuda/driver.h) under the real symbol names. Device
// memory is a memfd mapped PROT_NONE at the address the caller sees (a CPU
// access faults, as on a GPU); the fake copies through a private read-write
// alias of the same memfd. Streams are FIFOs served by one thread each.
// See docs/testing.md, "The fake CUDA driver". No project header is used.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <shared_mutex>
#include <vector>

#define FAKE_API extern "C" __attribute__((visibility("default")))

namespace fakecuda {

using CUresult = int;
using CUdeviceptr = unsigned long long;
using Handle = unsigned long long;  // CUmemGenericAllocationHandle

constexpr CUresult kSuccess = 0, kInvalidValue = 1, kOutOfMemory = 2, kNotInitialized = 3, kDeinitialized = 4,
                   kNoDevice = 100,
                   kInvalidDevice = 101, kInvalidContext = 201, kInvalidPtx = 218, kInvalidHandle = 400,
                   kNotFound = 500, kNotReady = 600, kIllegalAddress = 700,
                   kHostAlreadyRegistered = 712, kHostNotRegistered = 713, kNotPermitted = 800,
                   kNotSupported = 801;
constexpr int kHandlePosixFd = 1, kHandleFabric = 8;

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

// ---- state.cc: initialisation, devices, contexts, fault injection
bool initialized();
int device_count();
size_t granularity();
bool stream_memops_disabled();
// FXM_FAKECUDA_COPY_TO_DEVICE_DELAY_MS: a stream copy into device memory
// waits that long on its stream before it runs (a slow copy).
long copy_to_device_delay_ms();
// FXM_FAKECUDA_COPY_FROM_DEVICE_DELAY_MS: the same for a stream copy out of device memory
// (device to host or to device: a copy between two device ranges waits for both delays).
long copy_from_device_delay_ms();
// FXM_FAKECUDA_HOST_UNREGISTER_US_PER_MIB (default 100): what unpinning costs in cuMemHostUnregister.
long host_unregister_us_per_mib();
// Set at run time by fxmFakeSetNotReadyQueryDelay(us) (default 0): a cuEventQuery that
// answers CUDA_ERROR_NOT_READY (the state at the call) takes that long: a poll of pending
// work is slow, one that finds the work done is not.
long not_ready_query_delay_us();
// The code FXM_FAKECUDA_FAIL sets for call `nth` of `name` (base name, no _v2), or 0; without
// `nth`, for the call after those counted so far.
CUresult injected_failure(const char* name, long nth);
CUresult injected_failure(const char* name);
// The primary context of `device` (never null), and the device of a context (-1: not ours).
void* primary_context(int device);
int context_device(void* ctx);
// The device of the calling thread's current context, or -1.
int current_device();

// ---- counts.cc: calls per entry point (fakecuda_call_count)
// Counts a call of `name` and returns its number (1: the first), taken under the lock that counts
// it: concurrent callers each get their own, so a window of failing calls ("@N:K") is exact.
unsigned long long count_call(const char* name);
extern "C" unsigned long long fakecuda_call_count(const char* name);
extern "C" unsigned long long fakecuda_thread_call_count(const char* name);

// The checks every entry point starts with: counted, initialised, then an injected failure.
#define FAKE_ENTER(name)                                              \
  do {                                                                \
    long nth_ = static_cast<long>(::fakecuda::count_call(name));     \
    if (!::fakecuda::initialized()) return ::fakecuda::kNotInitialized; \
    if (CUresult inj_ = ::fakecuda::injected_failure(name, nth_)) return inj_; \
  } while (0)
#define FAKE_NEED_CONTEXT()                                                  \
  do {                                                                       \
    if (::fakecuda::current_device() < 0) return ::fakecuda::kInvalidContext; \
  } while (0)

// ---- memory.cc: the table of device address ranges
// One piece of a resolved address range: where the bytes are for the fake.
struct Span {
  char* p;
  size_t n;
};
// Resolves [addr, addr+n) to the fake's own accessible memory: device ranges
// (possibly several adjacent mappings) to their aliases, anything else to
// itself (host memory). Returns kIllegalAddress where a device range ends
// inside it or a mapping has no access set. Call with table_lock() held shared.
CUresult resolve(CUdeviceptr addr, size_t n, std::vector<Span>* out);
// True where addr is in a device range or in registered host memory.
bool device_visible(CUdeviceptr addr, size_t n);
std::shared_mutex& table_lock();
// Copies between two resolved lists of the same total length.
void copy_spans(const std::vector<Span>& dst, const std::vector<Span>& src);

// ---- streams.cc
void synchronize_all_streams();

// ---- shutdown.cc: stream work at process exit
// Registers (once) the exit handler that stops stream work before exit()
// tears the process down; called when the first stream starts.
void watch_process_exit();
// True once exit() has begun: long stream operations return.
bool process_exiting();
// Runs one stream operation, counted as running for the exit handler; once the
// process is exiting, runs nothing and answers CUDA_ERROR_DEINITIALIZED.
CUresult run_stream_op(const std::function<CUresult()>& op);

}  // namespace fakecuda
