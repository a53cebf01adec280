// One-sided operations of a mesh: collective window registration, then
// put / get / signal / put_signal / batch put, completion counting and
// signal waits. Every argument is validated before anything is written,
// locally or remotely. Operations on one (peer, context) are FIFO across
// paths: an op whose window allows a synchronous path (self, shm, cma) still
// takes tcp while earlier tcp ops to that pair are in flight. An op enters
// the windows it touches; deregister waits for them (see Window::enter).
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "bootstrap/client.h"
#include "base/clock.h"
#include "core/progress.h"
#include "core/window.h"

namespace fxm {

// A bootstrap collective, carrying what it is (bootstrap::Call: a mismatch fails every rank).
using Allgather = std::function<bootstrap::Parts(const std::vector<uint8_t>&, const bootstrap::Call&)>;

struct PutArgs {
  int peer = 0;
  int ctx = 0;
  uint32_t src_win = 0;
  uint64_t src_off = 0;
  uint32_t dst_win = 0;
  uint64_t dst_off = 0;
  uint64_t size = 0;
  SignalSpec sig;  // sig.on: apply after the data landed (put_signal / signal)
  // The user's CUDA stream (stream_set; 0 is the legacy default stream): the
  // op starts after the stream's earlier work and completes in its order.
  bool stream_set = false;
  void* stream = nullptr;
  // Set by batch_put: every entry's waits end at the batch's one deadline. Otherwise the op's
  // first wait takes one (own_deadline, from the op timeout) and its later waits end there too.
  const Deadline* deadline = nullptr;
  mutable Deadline own_deadline;
  mutable bool own_deadline_set = false;
};

// The windows one op touches, entered (Window::enter) until the op is done
// with their memory; leaving is the destructor's.
class OpWindows {
 public:
  OpWindows() = default;
  OpWindows(const OpWindows&) = delete;
  OpWindows& operator=(const OpWindows&) = delete;
  ~OpWindows() {
    for (int i = 0; i < n_; ++i) held_[i]->leave();
  }
  void add(Window* w) { held_[n_++] = w; }
  Window* local = nullptr;   // this rank's side of the data
  Window* remote = nullptr;  // the peer's side of the data
  Window* sig = nullptr;     // the signal window

 private:
  Window* held_[3];
  int n_ = 0;
};

class OneSided {
 public:
  // op_timeout_s bounds what an op may wait for (earlier ops to its pair, a stream).
  // conns: the mesh's connections (which process is a local peer's, for cma).
  OneSided(int rank, int nranks, int ncontexts, Engine* engine, const Connections* conns,
           WindowTable* windows, Allgather allgather, double op_timeout_s);

  // Collective registration; each returns the window index.
  uint32_t register_user(void* base, uint64_t size);
  uint32_t alloc(uint64_t size);
  uint32_t alloc_signal(uint64_t nslots);
  // Device windows: the caller's CUDA memory, or cuMem memory allocated on `device`.
  uint32_t register_device(void* base, uint64_t size);
  uint32_t alloc_device(uint64_t size, int device);
  // Joins a registration collective for a window this rank cannot provide
  // (the reason is sent to every rank, which all fail naming this one), then
  // throws InvalidArgument with `reason`.
  [[noreturn]] void refuse_registration(const std::string& reason);
  // Collective: flushes, then every rank drops the window.
  void deregister(uint32_t index, const Deadline& deadline);
  std::shared_ptr<Window> window(uint32_t index, const char* op) const;  // live or throws

  void put(const PutArgs& a);
  // What an op may wait for, from now (batch_put takes one for all its entries).
  Deadline op_deadline() const { return Deadline::after_seconds(op_timeout_s_); }
  // Validates like put() without issuing anything (batch_put checks all first).
  void check_put(const PutArgs& a) const;
  // Reads peer's window src_win into this rank's window dst_win.
  void get(PutArgs a);
  uint64_t read_signal(uint32_t win, uint64_t slot) const;
  void wait_signal(uint32_t win, uint64_t slot, uint64_t expected, const Deadline& deadline) const;
  bool signals_by_tcp(const Window& w) const;
  // Queues the wait on `stream` and returns; where the driver has no stream
  // memory operations, waits on the host instead (logged once).
  void wait_signal_on_stream(uint32_t win, uint64_t slot, uint64_t expected, void* stream,
                             const Deadline& deadline) const;

 private:
  // Makes this rank's part of the next window (index, &shm_name) or throws.
  using Prepare = std::function<std::shared_ptr<Window>(uint32_t, std::string*)>;
  // The registration collective (`kind`: the call, matched on every rank); a
  // local failure still takes part (see refuse_registration).
  uint32_t register_collective(bootstrap::CallKind kind, const Prepare& prepare);
  // This rank's part of the registration (device windows: starts the server of their cuMem fds).
  std::vector<uint8_t> describe_for_peers(Window& w, const std::string& shm_name) const;
  std::vector<WindowDesc> check_descriptions(const Window& w, const bootstrap::Parts& parts) const;
  // Drops from each description the device exports (IPC handle, cuMem fd
  // server) another rank published first or alongside: they open that rank's memory.
  void bind_exports(std::vector<WindowDesc>* descs);
  // seals: of each description as published (binding.h), before bind_exports narrowed it.
  void connect_peers(Window& w, const std::vector<struct WindowDesc>& descs, const std::vector<uint64_t>& seals);
  PeerView view_of(const Window& w, int peer, const struct WindowDesc& d, uint64_t seal) const;
  // Checks every argument; with `ow`, enters the windows the op touches.
  void validate(const PutArgs& a, const char* op, bool is_get, OpWindows* ow) const;
  void validate_signal(const PutArgs& a, const char* op, OpWindows* ow) const;
  void check_put(const PutArgs& a, OpWindows* ow) const;
  // A registered window that is not closing (entered into `ow` when given), or throws.
  Window& use(uint32_t index, const char* op, OpWindows* ow) const;
  Window& signal_slot(uint32_t win, uint64_t slot, const char* op, OpWindows* ow) const;
  void wait_unused(const Window& w, const Deadline& deadline, bool closed = false) const;  // closed: after live went false
  void check_same_window(Window& w, const bootstrap::Parts& parts) const;
  struct InFlight {
    bool busy = false;  // ops to the pair are in flight on an asynchronous path
    PathKind kind = PathKind::kTcp;
  };
  Path* ordered_path(const PutArgs& a, const PeerView& v, Path* preferred, const InFlight& f) const;
  uint64_t spin_for_signal(const Window& w, uint64_t slot, uint64_t expected) const;  // the current value
  [[noreturn]] void fail_wait_closed(const Window& w, uint64_t slot) const;
  [[noreturn]] void fail_wait_signal(const Window& w, uint64_t slot, uint64_t expected, uint64_t current,
                                    int lost) const;
  bool move_data(const PutArgs& a, Window& local, const PeerView& v, bool is_get, const InFlight& f,
                 bool* signal_done);
  PathOp path_op(const PutArgs& a, Window& local, bool is_get) const;
  // The pair's lock (one op of a pair at a time), waited for within the op's deadline.
  std::unique_lock<std::timed_mutex> lock_pair(const PutArgs& a, const char* op) const;
  // pair_busy: ops to the pair are in flight (else the pair's stream fence is dropped: nothing to wait for).
  void prepare_device_op(const PutArgs& a, const Window& local, const Path& p, bool is_get, bool pair_busy,
                         PathOp* op) const;
  bool signal_on_stream(const PutArgs& a, const PeerView& sig_view, const InFlight& f);  // true: queued
  void finish_registration(Window& w) const;
  std::string who() const { return "rank " + std::to_string(rank_) + ": "; }
  // The op's one deadline (see PutArgs::deadline): taken at its first wait, so an op that never
  // waits reads no clock.
  Deadline op_deadline(const PutArgs& a) const {
    if (a.deadline) return *a.deadline;
    if (!a.own_deadline_set) {
      a.own_deadline = op_deadline();
      a.own_deadline_set = true;
    }
    return a.own_deadline;
  }

  int rank_, nranks_, ncontexts_;
  double op_timeout_s_;
  Engine* engine_;
  const Connections* conns_;
  WindowTable* windows_;
  Allgather allgather_;
  std::string host_;
  std::vector<std::unique_ptr<std::timed_mutex>> pair_mu_;  // per (peer, ctx): see lock_pair()
  std::vector<std::unique_ptr<cuda::StreamFence>> fences_;  // per (peer, ctx), under pair_mu_
  std::mutex register_mu_;
  std::map<std::string, int> export_owner_;  // device export -> the rank that published it (under register_mu_)
};

}  // namespace fxm
