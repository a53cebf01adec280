// The fake's address table: device ranges (cuMemAlloc allocations, opened
// IPC handles, VMM mappings), VMM reservations and allocation handles, and
// registered host memory. One lock guards it all (table_lock()).
#pragma once

#include <functional>
#include <map>
#include <string>
#include <utility>

#include "fake_cuda.h"

namespace fakecuda {

// A memfd behind device memory. VMM: one per allocation handle, counted by
// handle references plus mappings; legacy: owned by its Range.
struct Physical {
  int fd = -1;
  size_t size = 0;
  int device = 0;
  int handle_types = 0;
  unsigned long long id = 0;
  int refs = 0;
};

enum class Kind { kLegacy, kIpcOpened, kVmmMapping };

struct Range {
  CUdeviceptr base = 0;
  size_t size = 0;         // what the caller sees
  size_t mapped = 0;       // the page-rounded length of both mappings
  char* alias = nullptr;   // the fake's read-write view of the same pages
  Kind kind = Kind::kLegacy;
  int device = 0;
  Physical* phys = nullptr;               // legacy (owned) and VMM (counted)
  std::pair<long, unsigned long long> ipc_key{0, 0};  // opened IPC: exporter pid, id
  int ipc_refs = 0;
  bool access = false;                    // VMM: cuMemSetAccess granted access
  CUdeviceptr reservation = 0;            // VMM: the reserved range holding the mapping
};

struct Reservation {
  CUdeviceptr base = 0;
  size_t size = 0;
};

struct HostRegion {
  uintptr_t base = 0;
  size_t size = 0;
};

struct Table {
  std::map<CUdeviceptr, Range> ranges;  // by base
  std::map<CUdeviceptr, Reservation> reservations;
  std::map<Handle, Physical*> handles;  // VMM allocation handles
  std::map<uintptr_t, HostRegion> host;
  std::map<std::pair<long, unsigned long long>, CUdeviceptr> opened;  // IPC key -> base
  unsigned long long next_id = 1;
};

// The table; hold table_lock() (shared to read, unique to change it).
Table& table();
// The range holding addr, or nullptr.
Range* find_range(CUdeviceptr addr);
// The registered host region holding [p, p+n), or nullptr.
const HostRegion* find_host(uintptr_t p, size_t n);

size_t page_round(size_t n);
// A new memfd of `size` bytes, named so that an importer can check what it is.
int new_memfd(size_t size, int device, int handle_types, unsigned long long id);
// Parses the name of a fake memfd open at `fd` in process `pid` (0: this one).
bool read_memfd_name(long pid, int fd, long* owner, unsigned long long* id, int* device, int* types);
// Maps fd at `at` (nullptr: anywhere) PROT_NONE, and an alias read-write; false on failure.
bool map_views(int fd, size_t mapped, void* at, char** base, char** alias);
void unmap_views(const Range& r);
// Waits until every host function queued (cuLaunchHostFunc) has run, as the driver's
// cuMemHostUnregister waits for its callback thread (seen on an H200: it spun while a host
// function waited for a lock the caller held); at once when called from a host function
// (which may make no driver call).
void wait_host_functions_idle();

// ---- streams.cc: queues `op` on the stream `handle` names (kInvalidHandle when none).
CUresult enqueue_on(void* handle, std::function<CUresult()> op);

}  // namespace fakecuda
