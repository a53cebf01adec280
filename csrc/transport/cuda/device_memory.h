// Device memory of a window: what the driver says about a pointer, memory the
// library allocates (cuMem with a POSIX fd handle), how a window is exported
// to peers (legacy IPC handle, cuMem mappings as fds) and how a peer's export
// is mapped here. Every call makes the window's device context current on the
// calling thread first. Errors are fxm::Error naming the driver's result.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "transport/cuda/driver.h"

namespace fxm::cuda {

// The loaded driver, or throws Error(kInvalidArgument) naming why there is none.
const Driver& need_driver(const std::string& doing);
// Makes device `ordinal`'s primary context current on this thread.
void use_device(int ordinal);
// The device of this thread's current context; device 0's primary context is
// made current first when none is (a thread that never used CUDA).
int current_device();
// Throws Error(kSystem) "<doing>: <driver result>" when r is not success.
void check(CUresult r, const std::string& doing);

// One cuMem mapping of a window: its place relative to the window base and
// the exported fd (owned by the DeviceMemory that exported it).
struct VmmMapping {
  int64_t offset = 0;  // mapping base - window base (<= 0 for the first)
  uint64_t size = 0;
};

// What a peer needs to reach a device window (published in its WindowDesc).
struct DeviceExport {
  int ordinal = -1;
  bool ipc = false;                 // legacy IPC handle below is valid
  IpcMemHandle ipc_handle{};
  uint64_t ipc_offset = 0;          // window base - allocation base
  std::vector<VmmMapping> vmm;      // empty: no cuMem export
  std::string why_no_ipc, why_no_vmm;  // the driver's refusals, for describe()
};

// A device window's memory on its owner: user memory (not freed) or memory
// allocated here (unmapped and released on destruction).
class DeviceMemory {
 public:
  // Throws InvalidArgument when [p, p + size) is not device memory of one allocation.
  static std::shared_ptr<DeviceMemory> wrap(void* p, uint64_t size);
  // cuMemCreate on `ordinal` with a POSIX fd handle (FABRIC first where permitted).
  static std::shared_ptr<DeviceMemory> allocate(uint64_t size, int ordinal);
  ~DeviceMemory();
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;

  uint8_t* base() const { return base_; }
  uint64_t size() const { return size_; }
  int ordinal() const { return ordinal_; }
  // Exports for peers: the legacy IPC handle and the cuMem mappings' layout;
  // with_fds: their fds too (else export_fds() makes them when first asked).
  // A refusal of the driver is said in why_no_ipc / why_no_vmm.
  DeviceExport export_for_peers(bool with_fds = true);
  // The fds of the mappings export_for_peers() described, made at the first
  // call and kept here until drop_fds(); empty with *why set when the driver
  // refuses. Thread-safe (an fd server's thread may ask).
  std::vector<int> export_fds(std::string* why);
  std::vector<int> fds() const;
  void drop_fds();

 private:
  DeviceMemory() = default;
  void describe_vmm(DeviceExport* e);
  uint8_t* base_ = nullptr;
  uint64_t size_ = 0;
  int ordinal_ = -1;
  bool owned_ = false;
  CUmemGenericAllocationHandle handle_ = 0;  // owned allocations
  uint64_t reserved_ = 0;                    // owned: reserved address range
  std::vector<VmmMapping> layout_;  // the cuMem mappings described for peers
  mutable std::mutex fds_mu_;
  std::vector<int> fds_;
};

// A peer's device window mapped into this process (cuda-vmm or cuda-ipc).
class PeerMapping {
 public:
  // Imports the peer's cuMem fds (one per mapping, in order); takes the fds.
  // The mappings must follow each other and cover the window's `size` bytes;
  // the driver refuses a mapping larger than the allocation its fd opens.
  static std::unique_ptr<PeerMapping> import_vmm(const DeviceExport& e, uint64_t size, std::vector<int> fds,
                                                 int my_ordinal);
  // Opens the peer's IPC handle; the window (ipc_offset, `size` bytes) must lie
  // inside the allocation the handle opens (its size asked of the driver).
  static std::unique_ptr<PeerMapping> open_ipc(const DeviceExport& e, uint64_t size, int my_ordinal);
  ~PeerMapping();
  uint8_t* window_base() const { return window_base_; }
  // The device whose kernels may dereference the mapping (access was granted, or peer access
  // enabled, for that context alone); copies by the driver need no such thing.
  int kernel_device() const { return kernel_device_; }

 private:
  PeerMapping() = default;
  uint8_t* window_base_ = nullptr;
  int ordinal_ = -1;
  int kernel_device_ = -1;
  CUdeviceptr ipc_base_ = 0;  // opened IPC allocation (closed through the shared table)
  CUdeviceptr reserved_ = 0;
  uint64_t reserved_size_ = 0;
  std::vector<std::pair<CUdeviceptr, uint64_t>> mapped_;
  std::vector<CUmemGenericAllocationHandle> handles_;
};

// The device ordinal of `p`, or -1 when the driver does not know it as device memory.
int device_of(const void* p);

}  // namespace fxm::cuda
