#include "core/onesided.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <thread>

#include "base/env.h"
#include "base/log.h"
#include "core/window_setup.h"
#include "transport/binding.h"
#include "transport/signal_ops.h"
#include "transport/cuda/device_path.h"
#include "transport/tcp/tcp_path.h"
#include "transport/ucx/ucx_path.h"
#include "base/status.h"

namespace fxm {
namespace {

bool in_range(uint64_t off, uint64_t size, uint64_t limit) {
  return off <= limit && size <= limit - off;
}

std::string range_text(uint64_t off, uint64_t size) {
  return "[" + std::to_string(off) + ", " + std::to_string(off) + "+" + std::to_string(size) + ")";
}

}  // namespace

OneSided::OneSided(int rank, int nranks, int ncontexts, Engine* engine, const Connections* conns,
                   WindowTable* windows, Allgather allgather, double op_timeout_s)
    : rank_(rank), nranks_(nranks), ncontexts_(ncontexts), op_timeout_s_(op_timeout_s), engine_(engine),
      conns_(conns), windows_(windows), allgather_(std::move(allgather)), host_(shm::host_id()) {
  for (int s = 0; s < nranks * ncontexts; ++s) {
    pair_mu_.push_back(std::make_unique<std::timed_mutex>());
    fences_.push_back(std::make_unique<cuda::StreamFence>());
  }
}

// ------------------------------------------------------------ registration

uint32_t OneSided::register_user(void* base, uint64_t size) {
  return register_collective(bootstrap::CallKind::kRegisterWindow, [&](uint32_t, std::string*) {
    auto w = std::make_shared<Window>();
    w->kind = WindowKind::kUser;
    w->base = static_cast<uint8_t*>(base);
    w->size = size;
    return w;
  });
}

uint32_t OneSided::alloc(uint64_t size) {
  return register_collective(bootstrap::CallKind::kAllocWindow, [&](uint32_t, std::string* name) {
    auto w = std::make_shared<Window>();
    w->kind = WindowKind::kShm;
    w->seg = std::make_shared<shm::Segment>(shm::Segment::create_unique(size));
    *name = w->seg->name();
    w->base = w->seg->data();
    w->size = size;
    return w;
  });
}

uint32_t OneSided::alloc_signal(uint64_t nslots) {
  return register_collective(bootstrap::CallKind::kSignalWindow, [&](uint32_t, std::string* name) {
    if (!signal_slots_valid(nslots)) {
      fail(Code::kInvalidArgument, -1, 0, who() + "signal_window: nslots must be in [1, 2^32], got " +
                                              std::to_string(nslots));
    }
    auto w = std::make_shared<Window>();
    w->kind = WindowKind::kSignal;
    w->seg = std::make_shared<shm::Segment>(shm::Segment::create_unique(signal_segment_bytes(nslots)));
    *name = w->seg->name();
    w->base = w->seg->data();
    w->size = nslots * 8;
    w->last_src = signal_last_src(w->base, nslots);
    w->notify = signal_notify(w->base, nslots);
    for (uint64_t i = 0; i < nslots; ++i) w->last_src[i] = -1;
    return w;
  });
}

void OneSided::refuse_registration(const std::string& reason) {
  using bootstrap::CallKind;
  register_collective(CallKind::kRefusedRegistration, [&](uint32_t, std::string*) -> std::shared_ptr<Window> {
    fail(Code::kInvalidArgument, -1, 0, reason);
  });
  fail(Code::kInternal, -1, 0, who() + "refused registration went through");  // unreachable
}

namespace {

// A rank that cannot register still takes part in the collective with this
// marker (kind 0 + its reason), so every rank fails at once, naming it.
std::vector<uint8_t> failure_marker(uint32_t index, const std::string& reason) {
  std::vector<uint8_t> b(8, 0);
  std::memcpy(b.data(), &index, 4);
  b.insert(b.end(), reason.begin(), reason.end());
  return b;
}

bool is_failure_marker(const std::vector<uint8_t>& part, std::string* reason) {
  uint32_t kind = 1;
  if (part.size() >= 8) std::memcpy(&kind, part.data() + 4, 4);
  if (kind != 0) return false;
  *reason = std::string(part.begin() + 8, part.end());
  return true;
}

}  // namespace

uint32_t OneSided::register_collective(bootstrap::CallKind kind, const Prepare& prepare) {
  std::lock_guard<std::mutex> lock(register_mu_);
  uint32_t index = windows_->next_index();
  std::shared_ptr<Window> w;
  std::string shm_name;
  std::exception_ptr local_failure;
  std::vector<uint8_t> mine;
  try {
    forced_transport();  // a bad FLAGCX_MESH_TRANSPORT (or _CUDA_PATH) fails like any other local problem
    forced_cuda_path();
    w = prepare(index, &shm_name);
    w->index = index;
    w->nonce = random_cookie();
    w->own_cookie(0);  // sealed by describe_for_peers
    mine = describe_for_peers(*w, shm_name);
    w->own.set({rank_, index, w->nonce, reinterpret_cast<uint64_t>(w->base), w->size});
  } catch (const Error& e) {
    local_failure = std::current_exception();
    mine = failure_marker(index, e.what());
  }
  bootstrap::Parts parts = allgather_(mine, {kind, index});
  if (local_failure) std::rethrow_exception(local_failure);
  try {
    std::vector<WindowDesc> descs = check_descriptions(*w, parts);
    std::vector<uint64_t> seals;  // of each description as published, before bind_exports narrows it
    for (const WindowDesc& d : descs) seals.push_back(window_seal(d, index));
    bind_exports(&descs);
    connect_peers(*w, descs, seals);
  } catch (...) {
    finish_registration(*w);
    throw;
  }
  windows_->add(w);  // before the barrier: a peer may use the window as soon as it returns
  try {
    // every peer has mapped this rank's segment: the name can go
    allgather_({}, {bootstrap::CallKind::kRegistrationDone, index});
  } catch (...) {
    w->live = false;
    finish_registration(*w);  // no more fds served, no name left behind
    throw;
  }
  finish_registration(*w);
  FXM_INFO(rank_, w->describe());
  return w->index;
}

// Every peer has mapped this rank's copy: its shm name and cuMem fds can go.
void OneSided::finish_registration(Window& w) const {
  if (w.seg) w.seg->unlink();
  w.fd_server.reset();
  if (w.dev) w.dev->drop_fds();
}

std::vector<uint8_t> OneSided::describe_for_peers(Window& w, const std::string& shm_name) const {
  WindowDesc d = describe_local(w, host_, shm_name);
  if (w.dev) export_device(w, &d);
  if (w.kind != WindowKind::kSignal) w.ucx_reg = register_with_ucx(w.base, w.size, w.dev != nullptr, &d, true);
  seal_window(w, d);
  std::vector<uint8_t> mine(4);
  std::memcpy(mine.data(), &w.index, 4);
  std::vector<uint8_t> enc = d.encode();
  mine.insert(mine.end(), enc.begin(), enc.end());
  return mine;
}

std::vector<WindowDesc> OneSided::check_descriptions(const Window& w, const bootstrap::Parts& parts) const {
  std::vector<WindowDesc> descs(nranks_);
  for (int r = 0; r < nranks_; ++r) {
    std::string reason;
    if (is_failure_marker(parts[r], &reason)) {
      fail(Code::kInvalidArgument, r, 0, who() + "window #" + std::to_string(w.index) +
                                             " was not registered: rank " + std::to_string(r) +
                                             " could not register its part (" + reason + ")");
    }
    uint32_t idx = 0;
    std::vector<uint8_t> rest(parts[r].begin() + std::min<size_t>(4, parts[r].size()), parts[r].end());
    if (parts[r].size() < 4 || !WindowDesc::decode(rest, &descs[r])) {
      fail(Code::kProtocol, r, 0, who() + "rank " + std::to_string(r) + " published a malformed window description");
    }
    std::memcpy(&idx, parts[r].data(), 4);
    const WindowDesc& d = descs[r];
    if (d.kind == WindowKind::kSignal && (d.size % 8 != 0 || !signal_slots_valid(d.size / 8))) {
      fail(Code::kProtocol, r, 0, who() + "rank " + std::to_string(r) + " published signal window #" +
                                      std::to_string(idx) + " of " + std::to_string(d.size) +
                                      " bytes, not 1 .. 2^32 slots of 8 bytes");
    }
    if (idx != w.index || (d.kind == WindowKind::kSignal) != (w.kind == WindowKind::kSignal)) {
      fail(Code::kInvalidArgument, r, 0,
           who() + "collective registration mismatch: this rank registers window #" + std::to_string(w.index) +
               " (" + kind_name(w.kind) + ") while rank " + std::to_string(r) + " registers #" +
               std::to_string(idx) + " (" + kind_name(descs[r].kind) +
               "); every rank must register windows in the same order");
    }
  }
  return descs;
}

void OneSided::connect_peers(Window& w, const std::vector<WindowDesc>& descs, const std::vector<uint64_t>& seals) {
  w.peers.clear();
  for (int r = 0; r < nranks_; ++r) w.peers.push_back(view_of(w, r, descs[r], seals[r]));
}

PeerView OneSided::view_of(const Window& w, int peer, const WindowDesc& d, uint64_t seal) const {
  PathRequest req;
  req.seal = seal;
  req.me = rank_;
  req.peer = peer;
  req.win_index = w.index;
  req.kind = w.kind;
  req.local_base = w.base;
  if (w.kind == WindowKind::kSignal) req.local_slots = {reinterpret_cast<uint64_t*>(w.base), w.last_src, w.notify};
  req.host = host_;
  req.pid_ns = pid_namespace();
  req.forced = forced_transport();
  req.forced_cuda = forced_cuda_path();
  req.device = w.device;
  req.outbox = engine_;
  req.fd_fetch_ms = static_cast<int>(std::clamp(op_timeout_s_ * 1000.0, 1.0, 5000.0));
  req.ucx_worker = d.ucx_worker;  // the mesh's descriptions come through its bootstrap, not an application
  size_t s = static_cast<size_t>(peer) * ncontexts_;
  if (conns_ != nullptr && s < conns_->send.size()) req.peer_socket = conns_->send[s].get();
  PathChoice c = choose_path(req, d);
  PeerView v;
  v.size = d.size;
  v.why = std::move(c.why);
  v.path = std::move(c.path);
  bool device = w.kind == WindowKind::kDevice || d.kind == WindowKind::kDevice;
  if (v.path->kind() != PathKind::kTcp && v.path->kind() != PathKind::kStaged) {
    v.fallback = device ? make_staged_path(req, d, nullptr) : make_tcp_path(req, d, nullptr);
  }
  return v;
}

void OneSided::deregister(uint32_t index, const Deadline& deadline) {
  std::shared_ptr<Window> w = window(index, "deregister");
  if (w->closing.exchange(true)) {
    fail(Code::kInvalidArgument, -1, 0, who() + "deregister: window #" + std::to_string(index) +
                                            " is already being closed");
  }
  if (w->notify) wake_signal_waiters(w->notify);  // they see `closing` and leave
  std::vector<uint8_t> mine(4);
  std::memcpy(mine.data(), &index, 4);
  std::exception_ptr local_failure;
  try {
    wait_unused(*w, deadline);  // ops being issued on it, waiters
    engine_->flush(-1, deadline, false);  // ops in flight that hold it complete
  } catch (const Error& e) {  // still take part, so every rank fails at once naming this one
    local_failure = std::current_exception();
    mine = failure_marker(index, e.what());
  }
  bootstrap::Parts parts;
  try {  // a mismatched call (another window) fails every rank: the window stays open
    parts = allgather_(mine, {bootstrap::CallKind::kDeregister, index});
  } catch (const Error&) { local_failure = std::current_exception(); }
  if (local_failure) {
    w->closing = false;  // it stays open on every rank
    std::rethrow_exception(local_failure);
  }
  check_same_window(*w, parts);  // every rank closes it: nobody writes into it any more
  w->live = false;
  if (w->cookie) __atomic_store_n(w->cookie, 0, __ATOMIC_RELEASE);  // revoked: no cma path can be chosen for it again
  w->own.reset();                 // nor cuda-self
  // A (misbehaving) peer's frame the engine is landing: one socket read at most still writes
  // (window.h, io); the rest of that frame goes to a sink, and the peer's op is refused.
  if (!w->wait_io(Deadline::after_seconds(std::max(1.0, deadline.seconds_left())))) {
    FXM_ERROR(rank_, "deregister: window #" + std::to_string(index) + ": a copy into it did not end");
  }
  wait_unused(*w, deadline, true);
  for (PeerView& v : w->peers) {
    v.path->release();  // unmaps the peers' segments; describe() still names the paths
    if (v.fallback) v.fallback->release();
  }
  if (!stream_waits_passed(*w, deadline)) {  // a stream still waits on a slot: keep them mapped
    FXM_ERROR(rank_, "deregister: signal window #" + std::to_string(index) +
                         " has stream waits that have not passed; its slots stay mapped and registered");
    new std::shared_ptr<shm::Segment>(w->seg);  // deliberately never freed
    (void)w->host_reg.release();
  }
  {
    std::lock_guard<std::mutex> lock(w->host_reg_mu);
    w->host_reg.reset();
  }
  w->ucx_reg.reset();  // UCX's mapping goes before the memory it maps
  w->seg.reset();  // unmapped once no Python view of it remains
  w->dev.reset();  // released when the library allocated it
  if (w->cut_off.load() != 0) {  // a frame ended (its rest discarded) before the deadline
    fail(Code::kTimeout, -1, 0, who() + "deregister: window #" + std::to_string(index) + " was closed, but " +
                                    std::to_string(w->cut_off.load()) + " frame(s) of peers were still landing in "
                                    "it: they were cut off (the rest of their bytes went to a sink) and it may hold "
                                    "part of what they wrote");
  }
}

// A close collective in which ranks name different windows would leave them disagreeing about which
// windows exist (a peer writing into memory its owner released): every rank fails, the window stays open.
void OneSided::check_same_window(Window& w, const bootstrap::Parts& parts) const {
  for (int r = 0; r < nranks_; ++r) {
    uint32_t idx = UINT32_MAX;
    if (parts[r].size() == 4) std::memcpy(&idx, parts[r].data(), 4);
    if (idx == w.index) continue;
    w.closing = false;
    std::string reason;
    if (is_failure_marker(parts[r], &reason)) {
      fail(Code::kInvalidArgument, r, 0, who() + "deregister: window #" + std::to_string(w.index) +
                                             " stays open: rank " + std::to_string(r) +
                                             " could not close it (" + reason + ")");
    }
    fail(Code::kInvalidArgument, r, 0,
         who() + "deregister: collective mismatch: this rank closes window #" + std::to_string(w.index) +
             " while rank " + std::to_string(r) + " closes " +
             (idx == UINT32_MAX ? std::string("another") : "#" + std::to_string(idx)) +
             "; every rank must close the same window (it stays open)");
  }
}

void OneSided::wait_unused(const Window& w, const Deadline& deadline, bool closed) const {
  for (int spins = 0; w.users.load() != 0; ++spins) {
    if (deadline.expired() && closed) {
      fail(Code::kTimeout, -1, 0, who() + "deregister: window #" + std::to_string(w.index) + " was closed, but " +
                                      std::to_string(w.users.load()) + " frame(s) of peers were still landing in it "
                                      "at the timeout: they were cut off (the rest of their bytes goes to a sink) "
                                      "and it may hold part of what they wrote");
    }
    if (deadline.expired()) {
      fail(Code::kTimeout, -1, 0, who() + "deregister: window #" + std::to_string(w.index) + " is still used by " +
                                      std::to_string(w.users.load()) + " operation(s)");
    }
    if (spins < 100) std::this_thread::yield();
    else std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

std::shared_ptr<Window> OneSided::window(uint32_t index, const char* op) const {
  std::shared_ptr<Window> w = windows_->get(index);
  if (!w) {
    fail(Code::kInvalidArgument, -1, 0, who() + op + ": window #" + std::to_string(index) + " is not registered");
  }
  if (!w->live) {
    fail(Code::kInvalidArgument, -1, 0, who() + op + ": window #" + std::to_string(index) + " was deregistered");
  }
  return w;
}

Window& OneSided::use(uint32_t index, const char* op, OpWindows* ow) const {
  Window* w = windows_->find(index);
  if (w != nullptr && (ow == nullptr ? w->live && !w->closing : w->enter())) {
    if (ow != nullptr) ow->add(w);
    return *w;
  }
  std::string what = who() + op + ": window #" + std::to_string(index);
  if (!w) fail(Code::kInvalidArgument, -1, 0, what + " is not registered");
  if (!w->live) fail(Code::kInvalidArgument, -1, 0, what + " was deregistered");
  fail(Code::kInvalidArgument, -1, 0, what + " is being deregistered (closed)");
}

// ------------------------------------------------------------ operations

void OneSided::validate(const PutArgs& a, const char* op, bool is_get, OpWindows* ow) const {
  auto head = [&] { return who() + op + " (peer " + std::to_string(a.peer) + "): "; };  // failures only
  if (a.peer < 0 || a.peer >= nranks_) {
    fail(Code::kInvalidArgument, a.peer, 0, head() + "peer out of range [0, " + std::to_string(nranks_) + ")");
  }
  if (a.ctx < 0 || a.ctx >= ncontexts_) {
    fail(Code::kInvalidArgument, a.peer, 0, head() + "context " + std::to_string(a.ctx) + " out of range");
  }
  if (a.size == 0 && !is_get && a.sig.on) return;  // signal only: no data windows involved
  Window& local = use(is_get ? a.dst_win : a.src_win, op, ow);
  Window& remote = use(is_get ? a.src_win : a.dst_win, op, ow);
  if (ow) {
    ow->local = &local;
    ow->remote = &remote;
  }
  for (const Window* w : {&local, &remote}) {
    if (w->kind == WindowKind::kSignal) {
      fail(Code::kInvalidArgument, a.peer, 0, head() + "window #" + std::to_string(w->index) +
                                                  " is a signal window; use signal() / put_signal()");
    }
  }
  uint64_t loff = is_get ? a.dst_off : a.src_off, roff = is_get ? a.src_off : a.dst_off;
  if (!in_range(loff, a.size, local.size)) {
    fail(Code::kInvalidArgument, a.peer, 0, head() + "local range " + range_text(loff, a.size) +
                                                " exceeds window #" + std::to_string(local.index) + " (" +
                                                std::to_string(local.size) + " bytes)");
  }
  uint64_t rsize = remote.peers[a.peer].size;
  if (!in_range(roff, a.size, rsize)) {
    fail(Code::kInvalidArgument, a.peer, 0, head() + "remote range " + range_text(roff, a.size) +
                                                " exceeds window #" + std::to_string(remote.index) +
                                                " of peer " + std::to_string(a.peer) + " (" +
                                                std::to_string(rsize) + " bytes)");
  }
}

void OneSided::validate_signal(const PutArgs& a, const char* op, OpWindows* ow) const {
  Window& w = use(a.sig.win, op, ow);
  if (ow) ow->sig = &w;
  auto head = [&] { return who() + op + " (peer " + std::to_string(a.peer) + "): "; };
  if (w.kind != WindowKind::kSignal) {
    fail(Code::kInvalidArgument, a.peer, 0, head() + "window #" + std::to_string(a.sig.win) + " is not a signal window");
  }
  uint64_t nslots = w.peers[a.peer].size / 8;
  if (a.sig.slot >= nslots) {
    fail(Code::kInvalidArgument, a.peer, 0, head() + "signal slot " + std::to_string(a.sig.slot) +
                                                " out of range [0, " + std::to_string(nslots) + ")");
  }
}

// FIFO per (peer, ctx) across paths. Synchronous paths are done when they
// return. While ops to the pair are in flight on an asynchronous path, a
// later op takes that path too when this window has it (tcp reaches every
// window), so it completes after them, signals included; otherwise it waits
// until they completed.
// staged ops are tcp frames: they queue behind tcp ops like tcp ops do.
inline PathKind order_kind(PathKind k) { return k == PathKind::kStaged ? PathKind::kTcp : k; }

Path* OneSided::ordered_path(const PutArgs& a, const PeerView& v, Path* preferred, const InFlight& f) const {
  if (!f.busy || order_kind(preferred->kind()) == f.kind) return preferred;
  if (order_kind(v.path->kind()) == f.kind) return v.path.get();
  if (v.fallback && order_kind(v.fallback->kind()) == f.kind) return v.fallback.get();
  engine_->wait_idle(a.peer, a.ctx, op_deadline(a));
  return preferred;
}

// Moves the data of a put or get over its ordered path; a synchronous path
// that fails (process_vm_writev refused) hands the op to tcp. True when the
// op is complete on return.
PathOp OneSided::path_op(const PutArgs& a, Window& local, bool is_get) const {
  PathOp op{a.ctx, is_get ? a.src_off : a.dst_off, local.base + (is_get ? a.dst_off : a.src_off), a.size,
            a.sig.on ? &a.sig : nullptr};
  op.stream_set = a.stream_set;
  op.stream = a.stream;
  op.fence = fences_[a.peer * ncontexts_ + a.ctx].get();
  op.local_device = local.device;
  op.src_rank = rank_;
  return op;
}

bool OneSided::move_data(const PutArgs& a, Window& local, const PeerView& v, bool is_get, const InFlight& f,
                         bool* signal_done) {
  PathOp op = path_op(a, local, is_get);
  Path* p = ordered_path(a, v, v.path.get(), f);
  prepare_device_op(a, local, *p, is_get, f.busy, &op);
  if (p->synchronous_for(op)) {
    int err = is_get ? p->get(op) : p->put(op);
    if (err == 0) return true;
    std::string what = p->kind() != PathKind::kCma ? std::string(p->name()) + (is_get ? " get" : " put")
                                                    : is_get ? "process_vm_readv" : "process_vm_writev";
    FXM_WARN(rank_, what + " to peer " + std::to_string(a.peer) + " failed (" + errno_text(err) +
                        "); this op goes over tcp");
    p = &v.tcp();
  }
  if (is_get) p->get(op);
  else p->put(op);  // the signal travels with the data (or from the stream), except on ucx
  *signal_done = op.sig != nullptr && p->carries_signal();
  return false;
}

// Another thread's op to the pair may hold it as long as that op waits: this
// one waits for it within its own deadline (taken here when it must wait).
std::unique_lock<std::timed_mutex> OneSided::lock_pair(const PutArgs& a, const char* op) const {
  std::unique_lock<std::timed_mutex> lock(*pair_mu_[a.peer * ncontexts_ + a.ctx], std::try_to_lock);
  if (lock.owns_lock() || lock.try_lock_until(op_deadline(a).at())) return lock;
  fail(Code::kTimeout, a.peer, 0, who() + op + " (peer " + std::to_string(a.peer) + ", ctx " + std::to_string(a.ctx) +
                                      "): timed out waiting for another thread's op to that peer and context");
}

void OneSided::check_put(const PutArgs& a) const { check_put(a, nullptr); }

void OneSided::check_put(const PutArgs& a, OpWindows* ow) const {
  const char* op = !a.sig.on ? "put" : a.size ? "put_signal" : "signal";
  validate(a, op, false, ow);
  if (a.sig.on) validate_signal(a, op, ow);
}

void OneSided::put(const PutArgs& in) {
  PutArgs a = in;
  OpWindows ow;  // entered until the op is issued; in flight, the engine completes it before close()
  check_put(a, &ow);
  const char* op = a.sig.on ? (a.size ? "put_signal" : "signal") : "put";
  if (a.sig.on && a.sig.value == 0 && !a.sig.set) a.sig.on = false;  // value 0: data only
  std::unique_lock<std::timed_mutex> lock = lock_pair(a, op);
  engine_->poll_probes();  // device ops done by now no longer hold this one up
  InFlight f;
  f.busy = engine_->in_flight(a.peer, a.ctx, op, &f.kind);  // throws when the peer is gone
  bool signal_done = false;  // it travels with the data (tcp, staged, or from the stream)
  if (a.size != 0 && !move_data(a, *ow.local, ow.remote->peers[a.peer], false, f, &signal_done)) {
    if (!a.sig.on || signal_done) return;
    f.busy = engine_->in_flight(a.peer, a.ctx, op, &f.kind);  // the data is in flight on a stream
  }
  if (a.sig.on && a.size == 0 && a.stream_set && signal_on_stream(a, ow.sig->peers[a.peer], f)) return;
  if (a.sig.on) {
    const PeerView& v = ow.sig->peers[a.peer];
    Path* p = ordered_path(a, v, v.path->can_signal() ? v.path.get() : &v.tcp(), f);
    p->signal(PathOp{a.ctx, 0, nullptr, 0, &a.sig}, rank_);
    if (!p->synchronous()) return;
  }
  engine_->count_inline(a.peer, 1);
}

void OneSided::get(PutArgs a) {  // a copy: its own deadline is this call's
  OpWindows ow;
  validate(a, "get", true, &ow);
  std::unique_lock<std::timed_mutex> lock = lock_pair(a, "get");
  engine_->poll_probes();
  InFlight f;
  f.busy = engine_->in_flight(a.peer, a.ctx, "get", &f.kind);  // throws when the peer is gone
  bool unused = false;
  if (a.size != 0 && !move_data(a, *ow.local, ow.remote->peers[a.peer], true, f, &unused)) return;
  engine_->count_inline(a.peer, 1);
}

}  // namespace fxm
