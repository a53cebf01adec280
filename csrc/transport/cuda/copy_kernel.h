// One kernel for the copies of one batch. The driver's batched memcpy still
// costs the host ~5 us a copy (docs/gpu.md "Batched device copies"), so a KV
// request of thousands of scattered blocks moves at a few GB/s where a gather
// of the same blocks runs at hundreds. A run of copies is instead written as a
// list into page-locked host memory the device reads, and one launch of
// fxm_copy_blocks (kernels/copy_blocks.cu, embedded as PTX and compiled by the
// driver for the GPU it finds) copies them all: a thread block per (copy,
// 64 KiB chunk). The list stays leased until the batch's event has completed.
// The kernel runs on the device's SMs (the copy engines stay idle):
// FLAGCX_MESH_CUDA_BATCH_COPY=driver keeps the driver's copies.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "transport/cuda/driver.h"

namespace fxm::cuda {

// One copy as the kernel reads it (the layout of kernels/copy_blocks.cu's fxm_copy).
struct KernelCopy {
  CUdeviceptr dst;
  CUdeviceptr src;
  uint64_t len;
};

// A page-locked copy list the device reads; back to the pool when destroyed.
class CopyList {
 public:
  virtual ~CopyList() = default;
  virtual KernelCopy* entries() = 0;  // room for the count asked for
  virtual CUdeviceptr device_address() const = 0;
};

// A list of room for n copies, for device `ordinal`. Throws Error when no page-locked memory can be had.
std::unique_ptr<CopyList> copy_list(size_t n, int ordinal);

// Whether the copy kernel is loaded on device `ordinal` (loaded and launched once, empty, on the
// first call; when it cannot be, *why says why, once per device, and later calls answer false
// at once). Device paths call it when they are set up (copy_batch.h: batch_copy_mode).
bool copy_kernel_ready(int ordinal, std::string* why);

// Launches the kernel for the n copies of `list` on stream s of device `ordinal` (current): a
// thread block per `block_bytes` of each copy (0: 64 KiB), more where a copy would need more
// blocks than a grid holds.
CUresult launch_copies(int ordinal, CUstream s, const CopyList& list, size_t n, uint64_t longest,
                       uint64_t block_bytes = 0);

}  // namespace fxm::cuda
