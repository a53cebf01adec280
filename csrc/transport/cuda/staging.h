// Host buffers for staged device bytes: page-locked (registered with the CUDA
// driver once, then reused), so copies to and from the device run at pinned
// speed and no op pays for fresh pages. Buffers come in power-of-two sizes
// from 64 KiB; a released buffer goes back to the pool (up to 512 MiB in all,
// and per size up to 4 or half of that, whichever is more, are kept; the
// rest freed).
#pragma once

#include <cstdint>
#include <memory>

namespace fxm::cuda {

using HostBuffer = std::shared_ptr<uint8_t>;

// A buffer of at least n bytes (not zeroed), for copies with device `ordinal`.
// Registered with the driver when registration works; plain memory otherwise.
// Throws Error: kSystem (with its errno) when the memory cannot be had,
// kInvalidArgument for n over 2^48.
HostBuffer staging_buffer(uint64_t n, int ordinal);

// True when a kernel of the current device may use the staging buffer at `p` at that same
// address (registered and mapped for the device, as the driver answers under unified addressing).
bool device_addressable(const uint8_t* p);

}  // namespace fxm::cuda
