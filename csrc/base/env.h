// Every environment variable the library reads, read in one place.
//   FLAGCX_MESH_IFNAME   interface name (or prefix), or an IP address literal,
//                        used for listening and published to peers
//   FLAGCX_MESH_TIMEOUT  default mesh build deadline, seconds (default 60)
//   FLAGCX_MESH_ROOT_IDLE_TIMEOUT  seconds a rendezvous root waits for its
//                        first join before it ends (default 600)
//   FLAGCX_MESH_LOG      error | warn | info | debug (default warn)
//   FLAGCX_MESH_TRANSPORT  auto | tcp | cma | shm | ucx: forces the one-sided path;
//                        read at every window registration (transport_env())
//   FLAGCX_MESH_CUDA_PATH  auto | cuda-vmm | cuda-ipc | staged: forces the
//                        path to device windows (cuda_path_env())
//   FLAGCX_MESH_UCX_LIB  the libucp to load (ucx_lib_env(); default: the libucx
//                        wheel's, else libucp.so.0); set, it also turns UCX on
//                        for automatic selection (transport/ucx/ucx_path.h)
//   FLAGCX_MESH_UCX_ERROR_MODE  peer | none: UCX's error handling on the ucx path's
//                        endpoints (ucx_error_mode_env(); transport/ucx/runtime.h)
//   FLAGCX_MESH_CUDA_DRIVER  the CUDA driver library to load (default libcuda.so.1)
//   FLAGCX_MESH_CUDA_BATCH_COPY  auto | off: whether an agent's batch of device
//                        copies is issued with cuMemcpyBatchAsync (cuda_batch_copy_env())
//   FLAGCX_MESH_TCP_BATCH  auto | off: whether an agent call's small tcp writes between host
//                        memories go as one frame (tcp_batch_env(); transport/tcp/block_batch.h)
//   FLAGCX_MESH_AGENT_PORTS  P or P-Q: the ports an agent listens on (agent_ports_env())
//   FLAGCX_MESH_AGENT_COOKIE_TABLE  auto | off: whether an agent keeps its regions'
//                        cookies in a table its peers map (agent_cookie_table_env())
//   FLAGCX_MESH_STAGED_CHUNK_BYTES, FLAGCX_MESH_STAGED_INFLIGHT_BYTES  how the
//                        staged path cuts its ops and how much staging its puts
//                        to one peer hold (transport/cuda/staged_payload.h)
//   FLAGCX_MESH_RANK, FLAGCX_MESH_NRANKS, FLAGCX_MESH_UNIQUE_ID (hex): set by
//                        python -m flagcx_mesh.launch, read by the C ABI's
//                        flagcx_mesh_comm_init_from_env (launcher_env())
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "base/clock.h"

namespace fxm {

enum class LogLevel : int { kError = 0, kWarn = 1, kInfo = 2, kDebug = 3 };

struct EnvConfig {
  std::string ifname;            // empty: automatic choice
  double timeout_s = 60.0;       // a malformed value leaves the default (see default_timeout_s)
  double root_idle_s = 600.0;
  LogLevel log_level = LogLevel::kWarn;
  std::string error;             // what is wrong with a timeout or log variable ("" if nothing)
};

// Parsed once, on first use; later changes to the environment are not seen.
const EnvConfig& env_config();

// FLAGCX_MESH_TIMEOUT / FLAGCX_MESH_ROOT_IDLE_TIMEOUT, for the entry points
// that use them; throw Error(kInvalidArgument) naming a malformed variable
// (not a finite number of seconds > 0).
double default_timeout_s();
// Throws Error(kInvalidArgument) naming every malformed variable of EnvConfig
// (a timeout, FLAGCX_MESH_LOG); entry points (a mesh, an agent) call it first.
void require_valid_env();
double root_idle_timeout_s();

// A timeout argument: `what` (e.g. "Mesh: timeout") must be finite and > 0;
// with no_limit_ok, +inf is accepted too (it means no limit). Throws
// Error(kInvalidArgument) naming what and the value (NaN, <= 0, inf).
void check_timeout(double seconds, const char* what, bool no_limit_ok);
// An agent call's timeout: 0 keeps the call's default (docs/python-api.md, "Timeouts"), else
// check_timeout(seconds, what, true); a negative number or NaN is refused naming `what`.
void check_call_timeout(double seconds, const std::string& what);
// The deadline of a call's timeout under that rule: 0 is default_s, +inf never.
Deadline call_deadline(double seconds, double default_s, const std::string& what);
// A build deadline argument: 0 means default_timeout_s(); anything else must
// pass check_timeout(seconds, what, false). Returns the seconds to use.
double build_timeout_s(double seconds, const char* what);

// FLAGCX_MESH_TRANSPORT as it is now ("" when unset): windows registered
// later in the same process may use another value (tests and benchmarks do).
std::string transport_env();
// FLAGCX_MESH_UCX_LIB as it is now ("" when unset).
std::string ucx_lib_env();
std::string ucx_error_mode_env();
// FLAGCX_MESH_TCP_LANES as it is now: the tcp connections this rank offers per (peer, context),
// 1..kMaxTcpLanes; unset or empty: default_tcp_lanes(). Throws InvalidArgument on another value.
constexpr int kMaxTcpLanes = 16;
int tcp_lanes_env(uint64_t sockets_per_lane);
// min(4, max(1, cores / 2)): 1 on 2 cores (one connection per pair, as before lanes), 4 from 8
// cores; and at most what keeps the mesh's sockets (sockets_per_lane on each lane) within half
// of RLIMIT_NOFILE, never below 1.
int default_tcp_lanes(uint64_t sockets_per_lane);
// FLAGCX_MESH_TCP_LANE_SPIN_US, read once: microseconds a lane's threads poll without sleeping
// after each striped put's hand-off (core/progress.h); 0..10000, unset or empty: 50. Throws
// InvalidArgument on another value.
int tcp_lane_spin_us_env();
// FLAGCX_MESH_AGENT_MAX_VIEWS as it is now: the paths one agent connection keeps for the peer's
// descriptors (agent/connection.h); a whole number > 0, else (unset, empty, malformed) 4096.
size_t agent_max_views_env();
// FLAGCX_MESH_AGENT_PORTS as it is now: the ports an agent's listener may take, "P" or "P-Q"
// (1..65535, P <= Q); unset or empty: {0, 0} (any free port). Throws InvalidArgument naming the
// variable on another value.
struct PortRange {
  int first = 0, last = 0;
};
PortRange agent_ports_env();
// FLAGCX_MESH_CUDA_PATH as it is now ("" when unset): forces the path to device windows.
std::string cuda_path_env();
// FLAGCX_MESH_CUDA_BATCH_COPY as it is now ("" when unset; transport/cuda/copy_batch.h checks it).
std::string cuda_batch_copy_env();
// FLAGCX_MESH_TCP_BATCH as it is now ("" when unset; transport/tcp/tcp_path.cc checks it).
std::string tcp_batch_env();
// FLAGCX_MESH_CUDA_DRIVER ("" when unset), read once, when the driver is first loaded.
std::string cuda_driver_env();
// FLAGCX_MESH_STAGED_CHUNK_BYTES / FLAGCX_MESH_STAGED_INFLIGHT_BYTES ("" when
// unset), read once, at the first staged op (checked by staged_payload.cc).
std::string staged_chunk_env();
std::string staged_inflight_env();
// FLAGCX_MESH_STAGED_KERNEL_BYTES ("" when unset), read once, at the first staged gather or
// scatter by the copy kernel (checked by staged_payload.cc).
std::string staged_kernel_env();
// FLAGCX_MESH_STAGED_LANDING_BUFFERS ("" when unset), read at the first staged landing and kept
// once good (checked by staged_payload.cc).
std::string staged_landing_env();
// FLAGCX_MESH_STAGED_BOUNCE ("" when unset), read once (checked by transport/cuda/device_scratch.cc).
std::string staged_bounce_env();
// FLAGCX_MESH_AGENT_SECRET ("" when unset): the secret agents prove when none is given.
std::string agent_secret_env();
// FLAGCX_MESH_AGENT_COOKIE_TABLE ("" when unset), read when an agent registers its first region.
std::string agent_cookie_table_env();

// The embedded launcher's variables as they are now; throws
// Error(kInvalidArgument) naming a missing or malformed one.
struct LauncherEnv {
  int rank = 0;
  int nranks = 0;
  std::string unique_id_hex;
};
LauncherEnv launcher_env();

}  // namespace fxm
