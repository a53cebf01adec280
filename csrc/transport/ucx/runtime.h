// One UCX context and worker per process, opened on first use (ucp_api.h
// loads the library). Every UCX call of this library goes through the
// runtime's lock (the worker is SERIALIZED). A thread progresses the worker
// while the process runs: over UCX's tcp the target's bytes land in its own
// ucp_worker_progress(), so a target that never calls into the library must
// still progress. While this process has ops in flight (Busy) it progresses
// without sleeping; otherwise it sleeps on the worker's event fd when UCX
// offers one. (It spins at most kSpinAfterOpNs after the last op was posted:
// ops nobody waits for do not keep a core busy; a waiter progresses itself.)
// Endpoints are made per peer worker address and shared by the paths to that
// peer; a peer's failure (UCP_ERR_HANDLING_MODE_PEER) marks its endpoint,
// whose later ops fail at once.
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "base/clock.h"
#include "transport/ucx/ucp_api.h"

namespace fxm::ucx {

class Runtime;

// A flush covering the puts posted on an endpoint since the last one: the
// puts of one batch complete together (ucx_path.cc).
struct FlushGroup {
  bool issued = false;
  bool finished = false;
  void* request = nullptr;
  std::string error;
};

class Endpoint {
 public:
  Endpoint(Runtime* rt, std::string peer) : rt_(rt), peer_(std::move(peer)) {}
  ~Endpoint();  // closes the endpoint (force where UCX handles peer errors: the peer may be gone)
  Endpoint(const Endpoint&) = delete;
  Endpoint& operator=(const Endpoint&) = delete;
  Ep ep() const { return ep_; }
  // Once, after ucp_ep_create (the handler's argument exists first); peer_errors: its error mode.
  void set_ep(Ep ep, bool peer_errors) {
    ep_ = ep;
    peer_errors_ = peer_errors;
  }
  // UCX's peer error handling on this endpoint (else a dead peer is seen by the connection's loss).
  bool peer_errors() const { return peer_errors_; }
  const std::string& peer() const { return peer_; }
  // "" while healthy, else UCX's text of the failure (set by the error handler).
  std::string failure() const;
  // Under the runtime's lock: the group a put posted now joins.
  std::shared_ptr<FlushGroup> open_group();
  static void on_error(void* arg, Ep ep, Status status);

 private:
  Runtime* rt_;
  Ep ep_ = nullptr;
  bool peer_errors_ = false;
  std::string peer_;
  std::atomic<Status> failed_{kOk};
  std::shared_ptr<FlushGroup> open_;
};

// ucp_mem_map of one window, and its packed remote key; unmapped when destroyed.
class Registration {
 public:
  Registration(Runtime* rt, Mem memh, std::string rkey) : rt_(rt), memh_(memh), rkey_(std::move(rkey)) {}
  ~Registration();
  Registration(const Registration&) = delete;
  Registration& operator=(const Registration&) = delete;
  const std::string& rkey() const { return rkey_; }

 private:
  Runtime* rt_;
  Mem memh_;
  std::string rkey_;
};

class Runtime {
 public:
  // The process's runtime, or nullptr with *why set when UCX cannot be opened (said once in the log).
  static Runtime* get(std::string* why);
  const Api& api() const { return *api_; }
  Context context() const { return context_; }
  std::mutex& mu() { return mu_; }
  // The worker's address, as peers connect to it.
  const std::string& address() const { return address_; }
  // The transports UCX offers here, as "tl/device" ("tcp/eth0", "sysv/memory").
  const std::vector<std::string>& transports() const { return transports_; }
  // "UCX 1.22.0 (libucp.so.0 (the system)): self/memory, tcp/lo, ..."
  const std::string& describe() const { return describe_; }
  // The endpoint to the worker at `address`: shared while one lives and has not failed (a failed
  // one is replaced), made on first use, with the error mode its first caller's pair asks for.
  // fabric: the pair shares a network transport other than tcp (FLAGCX_MESH_UCX_ERROR_MODE=auto
  // takes UCX's peer error handling then, not otherwise: peer_error_handling()). Throws Error
  // naming `peer`.
  std::shared_ptr<Endpoint> endpoint(const std::string& address, const std::string& peer, bool fabric);
  // Registers [base, base + size), CUDA memory when `cuda` (UCX is told its memory type, not left
  // to detect it); nullptr with *why (UCX's text) when it cannot.
  std::unique_ptr<Registration> map(void* base, uint64_t size, bool cuda, std::string* why);
  // Under mu(): progresses the worker until it has nothing to do; true when it did something.
  bool progress_locked();
  // Under mu(): a close UCX has not finished (a dead peer's flush) is released by the progress
  // thread once it completes or after kCloseSeconds (runtime.cc), so that no caller waits for it.
  void finish_close(void* request, std::string peer);
  // Held by each op in flight (its completion probe): the progress thread does not sleep meanwhile.
  class Busy {
   public:
    explicit Busy(Runtime* rt) : rt_(rt) {
      rt_->busy_.fetch_add(1);
      rt_->last_op_ns_.store(now_ns(), std::memory_order_relaxed);
    }
    ~Busy() { rt_->busy_.fetch_sub(1); }
    Busy(const Busy&) = delete;
    Busy& operator=(const Busy&) = delete;

   private:
    Runtime* rt_;
  };

 private:
  Runtime() = default;
  bool open(const Library& lib, std::string* why);
  void read_transports();
  void run();
  void stop();
  // Under mu_: an endpoint to `address` whose failures `e` hears of (peer_errors: UCX's peer error
  // handling, which only transports that detect a peer's failure offer).
  Status create_ep(const std::string& address, Endpoint* e, bool peer_errors, Ep* ep);
  const Api* api_ = nullptr;
  Context context_ = nullptr;
  Worker worker_ = nullptr;
  int efd_ = -1;
  std::string address_;
  std::vector<std::string> transports_;
  std::string describe_;
  std::mutex mu_;
  std::vector<std::pair<std::string, std::weak_ptr<Endpoint>>> endpoints_;  // by peer address
  struct Closing {
    void* request;
    std::string peer;
    Deadline deadline;
  };
  std::vector<Closing> closing_;  // under mu_: closes in progress (finish_close)
  void reap_closes_locked();
  static int64_t now_ns();
  std::atomic<int64_t> busy_{0};
  std::atomic<int64_t> last_op_ns_{0};
  std::atomic<bool> stopping_{false};
  std::atomic<bool> running_{false};
};

// FLAGCX_MESH_UCX_ERROR_MODE for an endpoint whose pair shares a network transport other than tcp
// (fabric) or not: whether it gets UCX's peer error handling (auto: only with fabric). Another
// value is an InvalidArgument naming it.
bool peer_error_handling(bool fabric);

}  // namespace fxm::ucx
