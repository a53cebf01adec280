// Device memory a staged gather or scatter passes through (FLAGCX_MESH_STAGED_BOUNCE=on): the
// copy kernel then moves the scattered blocks within device memory, and the bytes cross the bus
// in one copy of the copy engine (a chunk down, or up), where otherwise the kernel reads or
// writes page-locked host memory across the bus itself. Buffers are pooled per (device, size):
// cuMemFree waits for the whole device, so none is freed while the process runs.
#pragma once

#include <cstdint>
#include <memory>

#include "transport/cuda/driver.h"

namespace fxm::cuda {

// A device buffer of at least n bytes on `ordinal`, back to the pool when the last holder lets
// it go (a holder whose copies may still use it keeps it: release() a copy of it). Throws Error.
using DeviceScratch = std::shared_ptr<void>;
DeviceScratch device_scratch(uint64_t n, int ordinal);
inline CUdeviceptr scratch_address(const DeviceScratch& s) { return reinterpret_cast<CUdeviceptr>(s.get()); }

// FLAGCX_MESH_STAGED_BOUNCE: on, staged gathers and scatters by the copy kernel pass through
// device scratch (default off).
bool staged_bounce();

}  // namespace fxm::cuda
