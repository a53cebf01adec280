// The ucx path: one-sided puts and gets through libucp (runtime.h) into the
// peer's window, which the peer registered with ucp_mem_map; its packed rkey
// travels in the window's description. The endpoint is made from the peer's
// worker address as this rank's own channel to the peer carried it (the mesh's
// bootstrap, the agent's authenticated handshake: PathRequest::ucx_worker),
// never from the description, and the rkey is unpacked on that endpoint only
// (binding.h, invariant 8).
// Asynchronous: a put completes when a flush of its endpoint completed (the
// puts of one batch share one flush), a get when its data is here; both
// through the Outbox as probes. Signals are not carried: a put with a signal
// (a mesh's put_signal) is synchronous, done once its flush completed, and the
// core then sends the signal its own way (ordered after the data).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "transport/path.h"

namespace fxm {

namespace ucx {
struct RequestParams;
class Endpoint;
class Registration;
class Runtime;
}  // namespace ucx

class UcxPath : public Path {
 public:
  UcxPath(ucx::Runtime* rt, std::shared_ptr<ucx::Endpoint> ep, void* rkey, uint64_t remote_base, Outbox* outbox,
          int peer);
  ~UcxPath() override;
  PathKind kind() const override { return PathKind::kUcx; }
  bool synchronous() const override { return false; }
  bool synchronous_for(const PathOp& op) const override { return op.sig != nullptr; }
  int put(const PathOp& op) override;
  int get(const PathOp& op) override;
  void release() override;

 private:
  void check_healthy(const char* op) const;
  static ucx::RequestParams params_for(const PathOp& op);
  void* post_put(const PathOp& op);  // under the runtime's lock: ucp_put_nbx, or throws
  int put_and_flush(const PathOp& op);
  ucx::Runtime* rt_;
  std::shared_ptr<ucx::Endpoint> ep_;
  void* rkey_;  // ucp_rkey_h, unpacked on ep_
  uint64_t remote_base_;
  Outbox* outbox_;
  int peer_;
};

std::unique_ptr<Path> make_ucx_path(const PathRequest& req, const WindowDesc& d, std::string* why);

// Whether windows registered now are registered with UCX too: FLAGCX_MESH_TRANSPORT=ucx,
// or FLAGCX_MESH_UCX_LIB set (UCX wanted for automatic selection).
bool ucx_wanted();
// Registers a window with UCX and fills the description's UCX fields (rkey,
// transports; with_worker: this process's worker address, for the mesh).
// Device memory (cuda) is registered as CUDA memory, and only where UCX offers
// a transport for it (device_memory_transports). nullptr (and the fields left
// empty, said in the log) when UCX cannot.
std::unique_ptr<ucx::Registration> register_with_ucx(void* base, uint64_t size, bool cuda, WindowDesc* d,
                                                     bool with_worker);
// This process's worker address when UCX is wanted and opens, else "".
std::string ucx_worker_address();

// Automatic selection: the first network transport (not tcp, shared memory,
// self or a GPU copy) that both sides' UCX offer, by transport name, "" when
// none ("tcp/eth0", "rc_mlx5/mlx5_0:1", ...).
std::string common_network_transport(const std::vector<std::string>& mine, const std::vector<std::string>& theirs);
// The transports among `tls` that move CUDA memory (cuda_copy, cuda_ipc, gdr_copy), by name,
// ","-joined; "" when none (a UCX built without CUDA, or UCX_TLS without them).
std::string device_memory_transports(const std::vector<std::string>& tls);
// "a,b" <-> {"a", "b"}: how the transports travel in a description.
std::string join_transports(const std::vector<std::string>& tls);
std::vector<std::string> split_transports(const std::string& s);

}  // namespace fxm
