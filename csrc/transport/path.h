// One-sided paths: how this rank reaches one peer's copy of one window.
//
// A path moves bytes (put / get) and applies signals for one (window, peer).
// Each kind lives in transport/<kind>/ and has a factory; path_factories()
// lists them in order of preference (self, shm, cma, tcp). choose_path()
// asks each in turn and takes the first that accepts; every refusal on the
// way is kept with its reason, for describe().
//
// A path is synchronous (the op is done when the call returns: memcpy,
// process_vm_writev) or asynchronous (the call posts the op; it completes
// later, and its completion is reported through the Outbox that posted it).
// Transport sits below the core: the asynchronous tcp path posts frames
// through the Outbox interface, which the core's progress engine implements.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <set>
#include <utility>
#include <string>
#include <vector>

#include "base/clock.h"
#include "base/wire.h"
#include "transport/cuda/device_memory.h"

namespace fxm {

// kDevice: CUDA device memory (the user's, or allocated by the library).
enum class WindowKind : uint32_t { kUser = 1, kShm = 2, kSignal = 3, kDevice = 4 };
const char* kind_name(WindowKind k);

// FLAGCX_MESH_TRANSPORT: auto (default) | tcp | cma | shm | ucx
enum class ForcedTransport { kAuto, kTcp, kCma, kShm, kUcx };
ForcedTransport forced_transport();  // throws InvalidArgument on a bad value

// FLAGCX_MESH_CUDA_PATH: auto (default) | cuda-vmm | cuda-ipc | staged: forces
// the path to device windows (the same process always copies directly).
enum class ForcedCudaPath { kAuto, kVmm, kIpc, kStaged };
ForcedCudaPath forced_cuda_path();  // throws InvalidArgument on a bad value

enum class PathKind : uint8_t {
  kSelf = 0, kShm = 1, kCma = 2, kTcp = 3,
  kCudaSelf = 4,  // a device window of this process: copies on the device
  kCudaVmm = 5,   // the peer's cuMem mappings imported from fds
  kCudaIpc = 6,   // the peer's allocation opened from a legacy IPC handle
  kStaged = 7,    // through host memory and the tcp path (any host)
  kUcx = 8,       // libucp's one-sided puts and gets (transport/ucx)
};
const char* path_name(PathKind k);
inline bool is_device_path(PathKind k) { return k >= PathKind::kCudaSelf && k <= PathKind::kCudaIpc; }

// What a rank publishes about its copy of a window.
struct WindowDesc {
  WindowKind kind = WindowKind::kUser;
  uint64_t size = 0;         // bytes (signal windows: nslots * 8)
  uint64_t addr = 0;         // base address in the owner (for cma)
  int32_t pid = 0;
  std::string host;          // shm::host_id(): boot id + /dev/shm identity
  std::string pid_ns;        // readlink /proc/self/ns/pid
  std::string shm_name;      // empty for user windows
  uint64_t cookie_addr = 0;  // where the owner keeps `cookie` (read back through cma)
  uint64_t cookie = 0;       // random, per window and rank
  cuda::DeviceExport dev;    // device windows: how peers reach the memory
  std::string fd_socket;     // device windows with cuMem mappings: where their fds are served
  uint64_t fd_token = 0;     // ... to those who send this token
  // Windows registered with UCX (transport/ucx): the packed rkey, the transports the owner's
  // UCX offers ("tcp/eth0,sysv/memory") and, from a mesh rank, its worker address (an agent's
  // travels in its connection's handshake). Encoded after the rest, only when an rkey is set,
  // so descriptions of windows without UCX keep their former encoding.
  std::string ucx_rkey;
  std::string ucx_transports;
  std::string ucx_worker;
  std::vector<uint8_t> encode() const;
  static bool decode(const std::vector<uint8_t>& b, WindowDesc* out);
};

// A signal applied after an op's data landed (put_signal / signal).
struct SignalSpec {
  bool on = false;
  bool set = false;  // false: add
  uint32_t win = 0;
  uint64_t slot = 0;
  uint64_t value = 0;
};

// Where the bytes of a batch's blocks go, in order: (address, length) each.
using ScatterList = std::vector<std::pair<uint8_t*, uint64_t>>;

// The completion of an asynchronous op that the engine polls (a CUDA event
// recorded after a copy): done() is true once the op completed.
class CompletionProbe {
 public:
  virtual ~CompletionProbe() = default;
  virtual bool done() = 0;  // true once the op completed, or failed (then error() says why)
  virtual std::string error() const { return ""; }
  // True when the failure is the peer's loss (its flush or get failed with the endpoint): the
  // wait that reports it fails with PeerLost, not as a refused op.
  virtual bool peer_lost() const { return false; }
};

namespace cuda {
class StagedPayload;
}

// Frames and completions of asynchronous paths, implemented by the core's
// progress engine. post_* count the op as issued to (peer, ctx); it completes
// when the target acknowledges it (or answers the get).
class Outbox {
 public:
  virtual ~Outbox() = default;
  // may_stripe: the target's window is host memory, so a large put may go over several connections.
  virtual void post_put(int peer, int ctx, const uint8_t* src, uint64_t len, uint32_t dst_win,
                        uint64_t dst_off, const SignalSpec& sig, bool may_stripe = false) = 0;
  // dst_device >= 0: dst is memory of that device, landed through pinned staging.
  virtual void post_get(int peer, int ctx, uint32_t src_win, uint64_t src_off, uint8_t* dst,
                        uint64_t len, int dst_device = -1) = 0;
  // Asynchronous paths that complete ops themselves (a copy on a device
  // stream): count an op to (peer, ctx) as issued on `kind`, and report its
  // completion later, in issue order per pair ("" or why it failed; the
  // failure is reported by the next flush / wait_counter).
  virtual void issued(int peer, int ctx, PathKind kind) = 0;
  virtual void completed(int peer, int ctx, const std::string& error) = 0;
  // Counts `ops` ops as issued; they complete together when `probe` says so (polled in issue
  // order per pair): a batch of copies behind one event is one probe, polled once.
  virtual void issued_probe(int peer, int ctx, PathKind kind, std::unique_ptr<CompletionProbe> probe,
                            uint64_t ops) = 0;
  // A put whose payload is staged out of device memory while it is sent: the
  // outbox sends only the bytes the payload says are ready (staged_payload.h).
  virtual void post_put_staged(int peer, int ctx, std::shared_ptr<cuda::StagedPayload> payload, uint32_t dst_win,
                               uint64_t dst_off, const SignalSpec& sig) = 0;
  // A batch of staged writes as one op (staged_batch.h): the payloads hold the blocks' bytes in
  // the order of `blocks` (window, offset, length each), which the frame carries before them; more
  // than one: the parts of a frame striped over the tcp lanes, as stripes() said (wire::kBlocksStriped).
  virtual void post_put_blocks(int peer, int ctx, std::vector<std::shared_ptr<cuda::StagedPayload>> parts,
                               std::vector<wire::BlockEntry> blocks) = 0;
  // How many parts a batch of `bytes` is cut in (1: not striped; else each lane's part is
  // wire::stripe_first / stripe_part of them).
  virtual int stripes(uint64_t bytes) const = 0;
  // A batch of writes from host memory into host windows as one op (tcp/block_batch.h): the frame
  // carries `blocks` (window, offset, length each), then their bytes, read from `sources` (this
  // process's memory, one piece a block, in order) as they are sent.
  virtual void post_put_host_blocks(int peer, int ctx, std::vector<wire::BlockEntry> blocks, ScatterList sources) = 0;
  // A batch of staged reads as one get: the peer's `blocks` land, in order, at `into` (device
  // memory of `device`, one destination a block), through pinned staging.
  virtual void post_get_blocks(int peer, int ctx, std::vector<wire::BlockEntry> blocks,
                               std::shared_ptr<const ScatterList> into, int device) = 0;
  // Waits until the ops issued to (peer, ctx) completed (throws on loss or expiry).
  virtual void wait_idle(int peer, int ctx, const Deadline& deadline) = 0;
};

namespace cuda {
class StreamFence;
class CopyBatch;
class StagedBatch;
}
namespace cma {
class IovBatch;
}
namespace tcp {
class BlockBatch;
}

// Whether a path queued an op into a batch of one call's ops (queue()).
enum class Queued { kNo, kYes, kBatchFirst };  // not batched / queued / issue the batch, then ask again

// The signal slots of a signal window mapped in this process.
struct SignalSlots {
  uint64_t* values = nullptr;
  int64_t* last_src = nullptr;
  struct SignalNotify* notify = nullptr;
};

// One op as a path sees it: the window offset on the peer's side, this
// rank's bytes, the (peer, ctx) pair and, for signals, the spec.
struct PathOp {
  int ctx = 0;
  uint64_t remote_off = 0;
  uint8_t* local = nullptr;  // source of a put, destination of a get
  uint64_t len = 0;
  const SignalSpec* sig = nullptr;  // put: apply after the data (carries_signal() paths only)
  // Device ops: the user's stream (stream_set: 0 is the legacy default
  // stream), the pair's fence (FIFO across streams), this rank's device
  // (-1: host memory) and the target's signal slots mapped here (if any).
  bool stream_set = false;
  void* stream = nullptr;
  cuda::StreamFence* fence = nullptr;
  int local_device = -1;
  SignalSlots sig_slots;
  int src_rank = -1;
  Deadline deadline = Deadline::never();  // set for device / staged ops and ops with a stream
  // A device op whose signal cannot be applied from the stream (the signal
  // window is reached over tcp): the call waits for the copy, the signal follows.
  bool wait_here = false;
};

class Path {
 public:
  virtual ~Path() = default;
  virtual PathKind kind() const = 0;
  const char* name() const { return path_name(kind()); }
  // True: put / get / signal are done when they return. False: they post the
  // op, which completes later through the Outbox.
  virtual bool synchronous() const { return true; }
  // The same for one op (device paths: synchronous unless it names a stream).
  virtual bool synchronous_for(const PathOp& op) const { (void)op; return synchronous(); }
  // True: put() takes op.sig and applies it at the target after the data.
  virtual bool carries_signal() const { return false; }
  // True: signal() works on this path (a shared mapping or a carrier).
  virtual bool can_signal() const { return false; }
  // 0, or an errno: the op did not happen and may take the fallback path.
  virtual int put(const PathOp& op) = 0;
  virtual int get(const PathOp& op) = 0;
  virtual void signal(const PathOp& op, int src_rank) { (void)op; (void)src_rank; }
  // Paths that issue one call's plain ops together (device paths,
  // copy_batch.h): queues a put (get: is_get) into `batch`, which the caller
  // issues. kNo: not this op (a signal, a wait, host memory): put/get it alone.
  virtual Queued queue(const PathOp& op, bool is_get, cuda::CopyBatch* batch) {
    (void)op; (void)is_get; (void)batch;
    return Queued::kNo;
  }
  // The same for an op that differs from the last one queue() took into `batch` (kYes, nothing
  // issued since) only in its offsets and length: what queue() checked holds for it too, so
  // device paths queue it without asking again (a request's thousands of copies between the
  // same two regions).
  virtual Queued queue_more(const PathOp& op, bool is_get, cuda::CopyBatch* batch) { return queue(op, is_get, batch); }
  // The same for synchronous host paths (cma, iov_batch.h): one call's plain
  // ops to one process go in one iovec list per system call. kNo: put/get it alone.
  virtual Queued queue_host(const PathOp& op, bool is_get, cma::IovBatch* batch) {
    (void)op; (void)is_get; (void)batch;
    return Queued::kNo;
  }
  // The staged path: queues a plain write or read (no signal, no stream, device memory and a
  // device window) into the call's staged batch (staged_batch.h), which the caller issues. kNo:
  // post it alone.
  virtual Queued queue_staged(const PathOp& op, cuda::StagedBatch* batch) {
    (void)op; (void)batch;
    return Queued::kNo;
  }
  // The tcp path: queues a plain write from host memory into a host window (no signal, at most
  // tcp::BlockBatch::kMaxBlockBytes) into the call's batch of them (tcp/block_batch.h), which the
  // caller issues. kNo: post it alone.
  virtual Queued queue_blocks(const PathOp& op, bool is_get, tcp::BlockBatch* batch) {
    (void)op; (void)is_get; (void)batch;
    return Queued::kNo;
  }
  // The window was closed: drop what the path maps (it then serves no op).
  virtual void release() {}
  // The peer's signal slots mapped here (self / shm signal windows), else empty.
  virtual SignalSlots slots() const { return {}; }
};

// What a factory knows when asked for a path to one peer's window.
struct PathRequest {
  int me = 0;
  int peer = 0;
  uint32_t win_index = 0;
  WindowKind kind = WindowKind::kUser;
  uint8_t* local_base = nullptr;  // this rank's copy (for self)
  SignalSlots local_slots;        // this rank's signal slots (for self)
  std::string host, pid_ns;       // this rank's
  ForcedTransport forced = ForcedTransport::kAuto;
  ForcedCudaPath forced_cuda = ForcedCudaPath::kAuto;
  int device = -1;  // this rank's copy: its CUDA device (-1: host memory)
  Outbox* outbox = nullptr;
  int peer_socket = -1;  // this rank's mesh connection to the peer (tells which process is the peer's)
  bool peer_is_agent = false;  // the peer's windows carry rank -1 in this process's table (own_windows.h)
  int fd_fetch_ms = 5000;  // cuda-vmm: fetching the peer's cuMem fds, all of it (the mesh timeout, 5 s at most)
  // The peer in refusals ("agent b"); not empty: a legacy IPC handle is opened for one peer process
  // only (binding.h, keyed by its proven pid). Empty: the caller binds exports itself (the mesh).
  std::string peer_id;
  // The seal of the description as its publisher handed it over (binding.h); 0: of the description
  // given to choose_path() (the mesh narrows a description's exports first: bind_exports).
  uint64_t seal = 0;
  // Processes already proven to be the peer's on this connection, as (pid, start time): the
  // socket-table scan is done once per process (binding.h); null: each time.
  std::set<std::pair<int32_t, uint64_t>>* proven = nullptr;
  // The peer's UCX worker address, as this rank's own channel to it carried it (the mesh's
  // bootstrap, an agent connection's handshake), never a description's claim; "" if none.
  std::string ucx_worker;
  // Set by choose_path(): what the description was proven to be (binding.h).
  const struct Binding* binding = nullptr;
};

// Every factory that opens what a description names (shm, cma, cuda-vmm,
// cuda-ipc) first asks req.binding (binding.h, invariant 8).
// nullptr with *why set (or left empty: "not applicable, say nothing") when
// the path cannot reach that window.
using PathFactory = std::unique_ptr<Path> (*)(const PathRequest& req, const WindowDesc& d, std::string* why);
const std::vector<PathFactory>& path_factories();  // self, shm, cma, ucx, tcp
const std::vector<PathFactory>& device_path_factories();  // cuda-self, cuda-vmm, cuda-ipc, ucx, staged

struct PathChoice {
  std::unique_ptr<Path> path;
  std::string why;  // the refusals before it, "; "-joined (empty when none)
  // Not empty: the description contradicts what the peer's proven process
  // registered (binding.h: its seal), and why; an agent refuses the op.
  std::string mismatch;
};
PathChoice choose_path(const PathRequest& req, const WindowDesc& d);

// This process's PID namespace ("pid:[4026531836]"), "" when unreadable.
const std::string& pid_namespace();

}  // namespace fxm
