// Every environment variable the library reads, read in one place.
//   FLAGCX_MESH_IFNAME   interface name (or prefix), or an IP address literal,
//                        used for listening and published to peers
//   FLAGCX_MESH_TIMEOUT  default mesh build deadline, seconds (default 60)
//   FLAGCX_MESH_LOG      error | warn | info | debug (default warn)
//   FLAGCX_MESH_TRANSPORT  auto | tcp | cma | shm: forces the one-sided path;
//                        read at every window registration (transport_env())
//   FLAGCX_MESH_CUDA_PATH  auto | cuda-vmm | cuda-ipc | staged: forces the
//                        path to device windows (cuda_path_env())
//   FLAGCX_MESH_CUDA_DRIVER  the CUDA driver library to load (default libcuda.so.1)
//   FLAGCX_MESH_RANK, FLAGCX_MESH_NRANKS, FLAGCX_MESH_UNIQUE_ID (hex): set by
//                        python -m flagcx_mesh.launch, read by the C ABI's
//                        flagcx_mesh_comm_init_from_env (launcher_env())
#pragma once

#include <string>

namespace fxm {

enum class LogLevel : int { kError = 0, kWarn = 1, kInfo = 2, kDebug = 3 };

struct EnvConfig {
  std::string ifname;            // empty: automatic choice
  double timeout_s = 60.0;
  LogLevel log_level = LogLevel::kWarn;
};

// Parsed once, on first use; later changes to the environment are not seen.
const EnvConfig& env_config();

// FLAGCX_MESH_TRANSPORT as it is now ("" when unset): windows registered
// later in the same process may use another value (tests and benchmarks do).
std::string transport_env();
// FLAGCX_MESH_CUDA_PATH as it is now ("" when unset): forces the path to device windows.
std::string cuda_path_env();
// FLAGCX_MESH_CUDA_DRIVER ("" when unset), read once, when the driver is first loaded.
std::string cuda_driver_env();

// The embedded launcher's variables as they are now; throws
// Error(kInvalidArgument) naming a missing or malformed one.
struct LauncherEnv {
  int rank = 0;
  int nranks = 0;
  std::string unique_id_hex;
};
LauncherEnv launcher_env();

}  // namespace fxm
