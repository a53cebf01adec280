#include "transport/cuda/copy_kernel.h"

#include <algorithm>
#include <cstdlib>
#include <map>
#include <mutex>
#include <vector>

#include "base/status.h"
#include "transport/cuda/device_memory.h"

namespace fxm::cuda {
namespace {

const char kCopyBlocksPtx[] =
#include "transport/cuda/kernels/copy_blocks.ptx.inc"
    ;

constexpr unsigned kThreads = 256;        // copy_blocks.cu's __launch_bounds__
constexpr uint64_t kChunk = 64 << 10;     // bytes per thread block, unless a copy needs more chunks than
constexpr uint64_t kMaxChunks = 65535;    // a grid's y dimension holds
constexpr size_t kListFloor = 4096;       // smallest list allocation, bytes
constexpr size_t kKeptPerSize = 8;        // free lists kept per size, at least
constexpr size_t kKeptBytesPerSize = 1 << 20;  // and of small lists as many as fit this

// ---- page-locked lists, pooled by power-of-two size, each with its device address: a staged
// batch takes a list per chunk on every lane at once, and each list registered anew (or its
// address asked again) took the driver's lock that the other lanes' launches wait for.

size_t kept_per_size(size_t bytes) { return std::max(kKeptPerSize, kKeptBytesPerSize / bytes); }

struct Pool {
  std::mutex mu;
  std::map<size_t, std::vector<std::pair<void*, CUdeviceptr>>> free;  // by size
};
Pool& pool() {
  static Pool* p = new Pool();  // never destroyed: a list may be returned at exit
  return *p;
}

class PooledList : public CopyList {
 public:
  PooledList(void* host, size_t bytes, CUdeviceptr dev) : host_(host), bytes_(bytes), dev_(dev) {}
  ~PooledList() override {
    Pool& p = pool();
    std::lock_guard<std::mutex> lock(p.mu);
    auto& kept = p.free[bytes_];
    if (dev_ != 0 && kept.size() < kept_per_size(bytes_)) {  // (one whose address was refused is not kept)
      kept.emplace_back(host_, dev_);
      return;
    }
    const Driver* d = driver();
    if (d && d->cuMemHostUnregister(host_) == kSuccess) std::free(host_);  // else kept: still registered
  }
  KernelCopy* entries() override { return static_cast<KernelCopy*>(host_); }
  CUdeviceptr device_address() const override { return dev_; }

 private:
  void* host_;
  size_t bytes_;
  CUdeviceptr dev_;
};

size_t list_bytes(size_t n) {
  size_t want = n * sizeof(KernelCopy), bytes = kListFloor;
  while (bytes < want) bytes <<= 1;
  return bytes;
}

void* new_list(size_t bytes) {
  void* p = nullptr;
  if (posix_memalign(&p, 4096, bytes) != 0) fail(Code::kSystem, -1, ENOMEM, "a device copy list of " + std::to_string(bytes) + " bytes");
  CUresult r = driver()->cuMemHostRegister(p, bytes, kHostRegisterPortable | kHostRegisterDeviceMap);
  if (r != kSuccess) {
    std::free(p);
    fail(Code::kSystem, -1, 0, "cuMemHostRegister of a device copy list: " + result_text(r));
  }
  return p;
}

// ---- the kernel, per device

struct Loaded {
  bool tried = false;
  CUfunction fn = nullptr;
  std::string why;
};
std::mutex kernels_mu;
std::map<int, Loaded>& kernels() {
  static auto* k = new std::map<int, Loaded>();  // never destroyed: modules live until exit
  return *k;
}

// One launch of nothing on a stream of its own, waited for: the first launch of a module the
// driver loads lazily blocks behind a pending cuStreamWaitValue64 of the context (gpu.md,
// "Traps"), so it is made here, when a device path is set up, not behind a user's wait.
CUresult warm_up(const Driver& d, CUfunction fn, int ordinal) {
  std::unique_ptr<CopyList> list = copy_list(1, ordinal);
  list->entries()[0] = {0, 0, 0};
  CUstream s = nullptr;
  CUresult r = d.cuStreamCreate(&s, kStreamNonBlocking);
  if (r != kSuccess) return r;
  CUdeviceptr copies = list->device_address();
  uint64_t chunk = kChunk;
  void* params[] = {&copies, &chunk};
  r = d.cuLaunchKernel(fn, 1, 1, 1, kThreads, 1, 1, 0, s, params, nullptr);
  CUresult synced = d.cuStreamSynchronize(s);  // (the list lives until the launch is done)
  d.cuStreamDestroy(s);
  return r != kSuccess ? r : synced;
}

Loaded load(int ordinal) {
  Loaded l;
  l.tried = true;
  const Driver* d = driver();
  if (d == nullptr) {
    l.why = driver_error();
    return l;
  }
  if (!d->cuModuleLoadData) {
    l.why = "the CUDA driver has no cuModuleLoadData";
    return l;
  }
  use_device(ordinal);
  CUmodule m = nullptr;
  CUresult r = d->cuModuleLoadData(&m, kCopyBlocksPtx);
  if (r == kSuccess) r = d->cuModuleGetFunction(&l.fn, m, "fxm_copy_blocks");
  if (r == kSuccess) {
    try {
      r = warm_up(*d, l.fn, ordinal);
    } catch (const Error& e) {  // no page-locked memory for its list
      l.fn = nullptr;
      l.why = "warming up the copy kernel on device " + std::to_string(ordinal) + ": " + e.what();
      return l;
    }
  }
  if (r != kSuccess) {
    l.fn = nullptr;
    l.why = "loading the copy kernel on device " + std::to_string(ordinal) + ": " + result_text(r);
  }
  return l;
}

}  // namespace

std::unique_ptr<CopyList> copy_list(size_t n, int ordinal) {
  (void)ordinal;  // registered portable: one list serves every device
  size_t bytes = list_bytes(n);
  {
    Pool& p = pool();
    std::lock_guard<std::mutex> lock(p.mu);
    auto& kept = p.free[bytes];
    if (!kept.empty()) {
      auto [host, dev] = kept.back();
      kept.pop_back();
      return std::make_unique<PooledList>(host, bytes, dev);
    }
  }
  void* host = new_list(bytes);
  CUdeviceptr dev = 0;
  CUresult r = driver()->cuMemHostGetDevicePointer(&dev, host, 0);
  auto list = std::make_unique<PooledList>(host, bytes, dev);
  if (r != kSuccess) fail(Code::kSystem, -1, 0, "cuMemHostGetDevicePointer of a device copy list: " + result_text(r));
  return list;
}

bool copy_kernel_ready(int ordinal, std::string* why) {
  std::lock_guard<std::mutex> lock(kernels_mu);
  Loaded& k = kernels()[ordinal];
  if (!k.tried) {
    k = load(ordinal);
    if (!k.fn) *why = k.why;  // told once
  }
  return k.fn != nullptr;
}

CUresult launch_copies(int ordinal, CUstream s, const CopyList& list, size_t n, uint64_t longest,
                       uint64_t block_bytes) {
  CUfunction fn = nullptr;
  {
    std::lock_guard<std::mutex> lock(kernels_mu);
    fn = kernels()[ordinal].fn;
  }
  if (fn == nullptr || n == 0 || n > 0x7fffffffu) return kErrInvalidValue;
  uint64_t chunk = block_bytes > 0 ? block_bytes : kChunk;
  if ((longest + chunk - 1) / chunk > kMaxChunks) chunk = ((longest + kMaxChunks - 1) / kMaxChunks + 15) & ~uint64_t{15};
  unsigned chunks = static_cast<unsigned>(longest == 0 ? 1 : (longest + chunk - 1) / chunk);
  CUdeviceptr copies = list.device_address();
  void* params[] = {&copies, &chunk};
  return driver()->cuLaunchKernel(fn, static_cast<unsigned>(n), chunks, 1, kThreads, 1, 1, 0, s, params, nullptr);
}

}  // namespace fxm::cuda
