// The part of UCX's public API (libucp, ucp/api/ucp.h) this library calls,
// declared here and loaded at run time: UCX is no build dependency, as the
// CUDA driver is not (cuda/driver.h). Only the fields and flags used are
// named; every parameter struct is passed with a field mask that names the
// fields set, and is padded to more than UCX's own size, so UCX reads nothing
// outside what it was given. Layouts as of UCX 1.10 (the _nbx calls) onward.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>

namespace fxm::ucx {

using Status = int;  // ucs_status_t
constexpr Status kOk = 0;
constexpr Status kInProgress = 1;
constexpr intptr_t kErrLast = -100;  // UCS_ERR_LAST: status pointers at or above it are errors

// Opaque handles.
struct ContextT;
struct WorkerT;
struct EpT;
struct MemT;
struct RkeyT;
struct ConfigT;
struct AddressT;
using Context = ContextT*;
using Worker = WorkerT*;
using Ep = EpT*;
using Mem = MemT*;
using Rkey = RkeyT*;

// ucs_status_ptr_t: nullptr (done), an error status, or a request.
inline bool is_error(void* p) { return reinterpret_cast<uintptr_t>(p) >= static_cast<uintptr_t>(kErrLast); }
inline bool is_request(void* p) { return p != nullptr && !is_error(p); }
inline Status status_of(void* p) { return static_cast<Status>(reinterpret_cast<intptr_t>(p)); }

constexpr uint64_t kFeatureRma = 1u << 1;     // UCP_FEATURE_RMA
constexpr uint64_t kFeatureWakeup = 1u << 4;  // UCP_FEATURE_WAKEUP
struct Params {                                // ucp_params_t
  uint64_t field_mask = 1;                     // UCP_PARAM_FIELD_FEATURES
  uint64_t features = 0;
  uint8_t rest[248] = {};
};

constexpr int kThreadSerialized = 1;  // UCS_THREAD_MODE_SERIALIZED: this library holds one lock around every call
struct WorkerParams {                 // ucp_worker_params_t
  uint64_t field_mask = 1;            // UCP_WORKER_PARAM_FIELD_THREAD_MODE
  int thread_mode = kThreadSerialized;
  uint8_t rest[500] = {};
};

using ErrHandler = void (*)(void* arg, Ep ep, Status status);
constexpr uint64_t kEpRemoteAddress = 1u << 0, kEpErrMode = 1u << 1, kEpErrHandler = 1u << 2;
constexpr int kErrModeNone = 0;  // UCP_ERR_HANDLING_MODE_NONE
constexpr int kErrModePeer = 1;  // UCP_ERR_HANDLING_MODE_PEER: a peer's failure fails its ops
struct EpParams {                // ucp_ep_params_t
  uint64_t field_mask = kEpRemoteAddress | kEpErrMode | kEpErrHandler;
  const AddressT* address = nullptr;
  int err_mode = kErrModePeer;
  ErrHandler err_cb = nullptr;  // ucp_err_handler_t {cb, arg}
  void* err_arg = nullptr;
  uint8_t rest[500] = {};
};

constexpr uint64_t kMapAddress = 1u << 0, kMapLength = 1u << 1, kMapMemoryType = 1u << 4;
constexpr int kMemoryHost = 0;  // UCS_MEMORY_TYPE_HOST
constexpr int kMemoryCuda = 1;  // UCS_MEMORY_TYPE_CUDA
struct MemMapParams {  // ucp_mem_map_params_t
  uint64_t field_mask = kMapAddress | kMapLength;
  void* address = nullptr;
  size_t length = 0;
  unsigned flags = 0;
  unsigned prot = 0;
  int memory_type = kMemoryHost;  // read only with kMapMemoryType in field_mask
  uint8_t rest[500] = {};
};

constexpr uint32_t kOpFlags = 1u << 4;       // UCP_OP_ATTR_FIELD_FLAGS
constexpr uint32_t kOpMemoryType = 1u << 6;  // UCP_OP_ATTR_FIELD_MEMORY_TYPE
constexpr uint32_t kCloseForce = 1u << 0;    // UCP_EP_CLOSE_FLAG_FORCE
struct RequestParams {                       // ucp_request_param_t
  uint32_t op_attr_mask = 0;
  uint32_t flags = 0;
  void* request = nullptr;
  void* cb = nullptr;
  uint64_t datatype = 0;
  void* user_data = nullptr;
  void* reply_buffer = nullptr;
  int memory_type = kMemoryHost;  // of the local buffer: read only with kOpMemoryType
  uint8_t rest[500] = {};
};

// The entry points, resolved by name from the library loaded.
struct Api {
  void (*ucp_get_version)(unsigned*, unsigned*, unsigned*);
  const char* (*ucs_status_string)(Status);
  Status (*ucp_config_read)(const char*, const char*, ConfigT**);
  void (*ucp_config_release)(ConfigT*);
  Status (*ucp_init_version)(unsigned, unsigned, const Params*, const ConfigT*, Context*);
  void (*ucp_cleanup)(Context);
  void (*ucp_context_print_info)(Context, FILE*);
  Status (*ucp_worker_create)(Context, const WorkerParams*, Worker*);
  void (*ucp_worker_destroy)(Worker);
  Status (*ucp_worker_get_address)(Worker, AddressT**, size_t*);
  void (*ucp_worker_release_address)(Worker, AddressT*);
  unsigned (*ucp_worker_progress)(Worker);
  Status (*ucp_worker_get_efd)(Worker, int*);
  Status (*ucp_worker_arm)(Worker);
  Status (*ucp_ep_create)(Worker, const EpParams*, Ep*);
  void* (*ucp_ep_close_nbx)(Ep, const RequestParams*);
  void* (*ucp_ep_flush_nbx)(Ep, const RequestParams*);
  Status (*ucp_mem_map)(Context, const MemMapParams*, Mem*);
  Status (*ucp_mem_unmap)(Context, Mem);
  Status (*ucp_rkey_pack)(Context, Mem, void**, size_t*);
  void (*ucp_rkey_buffer_release)(void*);
  Status (*ucp_ep_rkey_unpack)(Ep, const void*, Rkey*);
  void (*ucp_rkey_destroy)(Rkey);
  void* (*ucp_put_nbx)(Ep, const void*, size_t, uint64_t, Rkey, const RequestParams*);
  void* (*ucp_get_nbx)(Ep, void*, size_t, uint64_t, Rkey, const RequestParams*);
  Status (*ucp_request_check_status)(void*);
  void (*ucp_request_free)(void*);
};

// What was loaded: the entry points (null when nothing could be), from which
// file, the version, or why not.
struct Library {
  const Api* api = nullptr;
  std::string path;     // the file dlopen() took
  std::string version;  // "1.22.0"
  unsigned major = 0, minor = 0;
  std::string error;    // why no library could be loaded ("" when one was)
};

// The library is looked for, once: FLAGCX_MESH_UCX_LIB; else the libucx wheel's
// libucp (set_wheel_library(), told by the Python package); else libucp.so.0.
const Library& library();
// The libucp of the `libucx` wheel, if the Python package found one (before the first library()).
void set_wheel_library(const std::string& path);

// UCX's own text for a status ("Connection reset by remote peer (-25)").
std::string status_text(Status s);

}  // namespace fxm::ucx
