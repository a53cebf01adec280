#include "agent/connection.h"

#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <thread>

#include "base/env.h"
#include "base/log.h"
#include "base/status.h"
#include "transport/binding.h"
#include "transport/cma/iov_batch.h"
#include "transport/tcp/block_batch.h"
#include "transport/cuda/copy_batch.h"
#include "transport/cuda/device_path.h"
#include "transport/cuda/staged_batch.h"
#include "transport/tcp/tcp_path.h"

namespace fxm::agent {
namespace {

constexpr int kPeer = 0;  // the peer's index in the connection's engine (its only peer)
constexpr int kCtx = 0;

bool in_range(uint64_t off, uint64_t size, uint64_t limit) { return off <= limit && size <= limit - off; }

std::string range_text(uint64_t off, uint64_t size) {
  return "[" + std::to_string(off) + ", " + std::to_string(off) + "+" + std::to_string(size) + ")";
}

}  // namespace

// One transfer, checked: the local window (held by the call's LocalWindows) and the remote region.
struct Connection::Checked {
  const Window* local = nullptr;
  const Xfer* x = nullptr;
};

// The device copies of one call that wait to be issued together (copy_batch.h),
// and their ops, for the fallback of any the driver refuses. A call of one op
// has nothing to issue together: its copy is posted as the mesh's put is.
// Likewise the cma ops (iov_batch.h): one process_vm_* per up to IOV_MAX of them.
// The staged writes (reads) likewise: one kPutBlocks (kGetBlocks) frame (staged_batch.h) per run of them.
// And the small tcp writes between host memories: one kPutBlocks frame (tcp/block_batch.h).
struct Connection::Batch {
  Batch(Outbox* outbox, bool is_read, size_t count, Deadline deadline)
      : copies(outbox, kPeer, kCtx), staged(outbox, kPeer, is_read, Engine::kMaxGetBytesInFlight),
        blocks(outbox, kPeer), is_read(is_read), single(count == 1), count(count), deadline(deadline) {}
  cuda::CopyBatch copies;
  cuda::StagedBatch staged;
  tcp::BlockBatch blocks;
  bool tcp_batch = tcp_batch_wanted();  // FLAGCX_MESH_TCP_BATCH, read once a call
  bool is_read;
  bool single;
  size_t count;  // the call's ops
  Deadline deadline;  // of the call's device, staged and stream-ordered ops (renewed every kRenewEvery ops)
  static constexpr size_t kRenewEvery = 256;  // a clock read per op cost more than the op's issue
  // The queued copies are issued once they hold kIssueBytes (issue_all): the device copies them
  // while the rest are queued (a request's 4096 copies take 0.3-0.4 ms to queue on an H100 host).
  // Each issue costs ~10 us (a launch, an event, a probe) and hides the copy of what it issued
  // behind the queueing of what follows: by bytes, not by count, since a copy's time goes with
  // its bytes (on an H100, issuing every 512 copies made a call of 4096 x 64 KiB 16-20 % shorter
  // and one of 4096 x 16 KiB 0.04-0.05 ms longer: docs/benchmarks.md, "The pull's final form").
  static constexpr uint64_t kIssueBytes = 32ull << 20;
  uint64_t queued_bytes = 0;  // of the copies queued since the last issue
  bool copies_only() const { return blocks.size() == 0 && staged.size() == 0 && iovs.size() == 0; }
  // The ops queued in `copies`, in order, for the fallback of any the driver refuses: each is
  // the first op of its run (`firsts`) but for its own offsets and length (a PathOp is ~100
  // bytes, and a request queues thousands).
  struct Copy {
    uint32_t first;  // its run's first op, in `firsts`
    uint8_t* local;
    uint64_t remote_off, len;
  };
  std::vector<std::pair<PeerView*, PathOp>> firsts;
  std::vector<Copy> ops;
  // The run of plain device copies that the last op started or continued (issue()): a later op
  // naming the same remote descriptor and local window is one more of them, on the same path,
  // stream and fence, while nothing was issued or queued elsewhere since. Null: none.
  const RegionDesc* run_remote = nullptr;
  const Window* run_local = nullptr;
  Path* run_path = nullptr;
  bool in_run(const Checked& c) const { return c.x->remote == run_remote && c.local == run_local; }
  void end_run() { run_remote = nullptr; }
  void queued_first(PeerView* v, const PathOp& op);
  void queued_more(const PathOp& op);
  void start_run(const Checked& c, Path* p);
  std::pair<PeerView*, PathOp> queued_op(size_t i) const;  // the i-th of `ops`, whole
  void clear_ops() {
    ops.clear();
    firsts.clear();
    queued_bytes = 0;
  }
  cma::IovBatch iovs;
  std::vector<std::pair<PeerView*, PathOp>> host_ops;  // the ops in iovs, in order
  bool host_fell_back = false;  // some host ops went over tcp (the call is then asynchronous)
};

// An op issue() queued in `copies`: the first of its run (of one, unless start_run() follows).
// Room for the call's ops at the first one, so that a request's thousands are not moved as the
// lists grow.
void Connection::Batch::queued_first(PeerView* v, const PathOp& op) {
  if (ops.capacity() == 0) {
    ops.reserve(count);
    copies.reserve(count);
  }
  firsts.emplace_back(v, op);
  queued_more(op);
}

// An op queued in `copies` as one of the last first op's run: its offsets and length.
void Connection::Batch::queued_more(const PathOp& op) {
  ops.push_back({static_cast<uint32_t>(firsts.size() - 1), op.local, op.remote_off, op.len});
  queued_bytes += op.len;
}

void Connection::Batch::start_run(const Checked& c, Path* p) {
  run_remote = c.x->remote;
  run_local = c.local;
  run_path = p;
}

std::pair<PeerView*, PathOp> Connection::Batch::queued_op(size_t i) const {
  std::pair<PeerView*, PathOp> o = firsts[ops[i].first];
  o.second.local = ops[i].local;
  o.second.remote_off = ops[i].remote_off;
  o.second.len = ops[i].len;
  return o;
}

Connection::Connection(Agent* agent, tcp::Fd fd, PeerInfo peer, bool initiated, int lanes, uint64_t token)
    : agent_(agent), bell_(agent->bell_), peer_(std::move(peer)), initiated_(initiated), token_(token) {
  conns_.send.resize(std::max(1, lanes));
  conns_.recv.resize(std::max(1, lanes));
  add_lane(0, std::move(fd));
}

std::string Connection::lane_refused(int lane) const {
  std::lock_guard<std::mutex> lock(state_mu_);
  if (!closed_why_.empty()) return "the connection was closed: " + closed_why_;
  if (lane < 0 || lane >= tcp_lanes()) {
    return "it has " + std::to_string(tcp_lanes()) + " tcp lanes, not a lane " + std::to_string(lane);
  }
  if (conns_.recv[lane]) return "its tcp lane " + std::to_string(lane) + " joined already";
  return "";
}

bool Connection::add_lane(int lane, tcp::Fd fd) {
  int twin = ::dup(fd.get());
  if (twin < 0) fail(Code::kSystem, -1, errno, who() + ": dup of the socket of tcp lane " + std::to_string(lane));
  std::lock_guard<std::mutex> lock(state_mu_);
  if (!closed_why_.empty()) {
    ::close(twin);
    return false;  // fd closes here
  }
  conns_.send[lane] = tcp::Fd(twin);
  conns_.recv[lane] = std::move(fd);
  return joined_locked();
}

bool Connection::joined_locked() const {
  return std::all_of(conns_.recv.begin(), conns_.recv.end(), [](const tcp::Fd& f) { return static_cast<bool>(f); });
}

bool Connection::lanes_joined() const {
  std::lock_guard<std::mutex> lock(state_mu_);
  return joined_locked();
}

void Connection::start() {
  std::lock_guard<std::mutex> lock(state_mu_);
  if (!closed_why_.empty() || engine_) return;
  if (!joined_locked()) fail(Code::kProtocol, -1, 0, who() + ": started before every tcp lane joined");
  engine_ = std::make_unique<Engine>(0, 1, 1, &conns_, &agent_->windows_, 1ull << 30, agent_->timeout_s(),
                                     Engine::Words{who() + ": ", "agent " + peer_.name},
                                     [bell = bell_] { bell->ring(); });
  ready_.store(true, std::memory_order_release);
}

// The acceptor files a connection before it sends the verdict (so the table
// and its judgement agree) and starts it right after: a call in between waits.
Engine& Connection::started_engine() const {
  if (ready_.load(std::memory_order_acquire)) return *engine_;
  Deadline d = Deadline::after_seconds(agent_->header_timeout_s_);
  while (!ready_.load(std::memory_order_acquire)) {
    std::string g = gone();
    if (!g.empty() || d.expired()) fail(Code::kPeerLost, -1, 0, who() + ": " + (g.empty() ? "never started" : g));
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  return *engine_;
}

Connection::~Connection() { close("the connection was closed"); }

std::string Connection::who() const {
  return agent_->who() + "connection to agent " + peer_.name + " (incarnation " + incarnation_hex(peer_.incarnation) + ")";
}

bool Connection::ended() const {
  if (closed_.load(std::memory_order_acquire)) return true;
  return ready_.load(std::memory_order_acquire) && engine_->peer_ended(kPeer);
}

std::string Connection::gone() const {
  {
    std::lock_guard<std::mutex> lock(state_mu_);
    if (!closed_why_.empty()) return closed_why_;
  }
  return peer_end();
}

// How the peer's side ended, in the engine's view ("" while it has not).
std::string Connection::peer_end() const {
  if (!ready_.load(std::memory_order_acquire)) return "";
  std::string lost = engine_->lost_reason(kPeer);
  if (!lost.empty()) return "the peer was lost: " + lost;
  return engine_->peer_closed(kPeer) ? "agent " + peer_.name + " closed the connection" : "";
}

void Connection::retire(const std::string& why) {
  // Before a waiter learns of the end: no copy up of a get into device memory lands after it.
  if (ready_.load(std::memory_order_acquire)) engine_->settle_device_gets();
  std::lock_guard<std::mutex> lock(state_mu_);  // start() checks it under the same lock
  if (closed_why_.empty()) closed_why_ = why;
  closed_.store(true, std::memory_order_release);
  bell_->ring();  // a wait on this peer's notification fails now
  if (!engine_) {  // never started: the peer sees the end now, not at the last reference (the fds stay
    for (tcp::Fd& f : conns_.recv) {  // valid for a verdict the listener may be writing on lane 0)
      if (f) ::shutdown(f.get(), SHUT_RDWR);
    }
  }
}

void Connection::close(const std::string& why) {
  retire(why);
  if (ready_.load(std::memory_order_acquire) && !stopped_.exchange(true)) engine_->stop();
}

// An ended connection's calls: Closed when this agent closed it, else PeerLost.
Code Connection::lost_code() const {
  return agent_closed_.load(std::memory_order_acquire) ? Code::kClosed : Code::kPeerLost;
}

void Connection::close_for_agent() {
  agent_closed_.store(true, std::memory_order_release);
  close("this agent was closed");
}

uint64_t Connection::ping() { return engine_->ping(kPeer); }

bool Connection::answered(uint64_t mark) const { return engine_->acks_heard(kPeer) > mark; }

// A refusal's words are made out of line, in fail_op(): made here, every op paid for the room
// they take.
Connection::Checked Connection::check(const Xfer& x, const char* call, long op, LocalWindows* locals) const {
  if (!x.local || !x.remote) fail_op(x, call, op, Refusal::kMissing);
  const RegionDesc& r = *x.remote;
  if (locals->last_remote != &r) {  // (a batch's ops name few descriptors, each many times in a row)
    if (r.agent != peer_.name) fail_op(x, call, op, Refusal::kAgent);
    if (r.incarnation != peer_.incarnation) fail_op(x, call, op, Refusal::kIncarnation);
    locals->last_remote = &r;
  }
  if (!in_range(x.remote_off, x.size, r.size)) fail_op(x, call, op, Refusal::kRemoteRange);
  Checked c;
  c.x = &x;
  c.local = locals->of(*agent_, *x.local, call);
  if (!in_range(x.local_off, x.size, c.local->size)) fail_op(x, call, op, Refusal::kLocalRange, c.local->size);
  return c;
}

void Connection::fail_op(const Xfer& x, const char* call, long op, Refusal why, uint64_t local_size) const {
  std::string which = op < 0 ? std::string(call) : std::string(call) + " op " + std::to_string(op);
  std::string what;
  switch (why) {
    case Refusal::kMissing: fail(Code::kInvalidArgument, -1, 0, who() + ": " + which + ": a descriptor is missing");
    case Refusal::kAgent: what = "to a region of agent " + x.remote->agent + ", not of this connection's peer"; break;
    case Refusal::kIncarnation:
      what = "to region #" + std::to_string(x.remote->index) + " of incarnation " +
             incarnation_hex(x.remote->incarnation) + " of agent " + x.remote->agent + ", which is now incarnation " +
             incarnation_hex(peer_.incarnation) + " (it restarted: its old descriptors are void)";
      break;
    case Refusal::kRemoteRange:
      what = "at remote " + range_text(x.remote_off, x.size) + ": out of range of its region #" +
             std::to_string(x.remote->index) + " (" + std::to_string(x.remote->size) + " bytes)";
      break;
    case Refusal::kLocalRange:
      what = "at local " + range_text(x.local_off, x.size) + ": out of range of local region #" +
             std::to_string(x.local->index) + " (" + std::to_string(local_size) + " bytes)";
      break;
  }
  fail(Code::kInvalidArgument, -1, 0, who() + ": " + which + " of " + std::to_string(x.size) + " bytes " + what);
}

// Each local region of a call looked up once (a batch names few regions many times): by its
// descriptor's address, the last one first (of()), then the few before it, then a map.
const Window* Connection::LocalWindows::find(const Agent& agent, const RegionDesc& d, const char* call) {
  constexpr size_t kScanned = 16;
  const Window* found = nullptr;
  for (size_t i = 0; i < held.size() && i < kScanned && !found; ++i) {
    if (descs[i] == &d) found = held[i].get();
  }
  if (!found && held.size() > kScanned) {
    auto it = more.find(&d);
    if (it != more.end()) found = it->second;
  }
  if (!found) {
    bool entered = false;
    std::shared_ptr<Window> w = agent.window_for(d, call, &entered);
    w->leave();  // deregister() flushes this agent's connections before it closes a region
    found = w.get();
    if (held.size() >= kScanned) more.emplace(&d, found);
    descs.push_back(&d);
    held.push_back(std::move(w));
  }
  last_desc = &d;
  return last = found;
}

// A descriptor that the peer's proven process says is not its registration (binding.h), naming
// the first field in which it differs from a descriptor of that region already in use here.
void Connection::fail_mismatch(const RegionDesc& remote, const WindowDesc& d, const std::string& why) const {
  std::string field;
  for (const auto& [key, held] : views_) {
    WindowDesc known;
    if (std::get<0>(key) != remote.index || !WindowDesc::decode(held.window, &known)) continue;
    field = first_difference(known, d);
    if (!field.empty()) break;
  }
  fail(Code::kInvalidArgument, -1, 0, "region #" + std::to_string(remote.index) + " of agent " + peer_.name + ": " +
                                          (field.empty() ? why : "field " + field + " differs from that region's "
                                                                 "descriptor in use (" + why + ")"));
}

// Per op: this call's last region, else the descriptor's bytes seen before (no hash, no
// allocation), else its seal (decode and hash once per descriptor).
PeerView& Connection::view_of(const RegionDesc& remote, int device) {
  if (last_remote_ == &remote && last_device_ == device) return *last_view_;
  std::string_view bytes(reinterpret_cast<const char*>(remote.window.data()), remote.window.size());
  PeerView* found = nullptr;
  auto s = seen_.find(bytes);
  if (s != seen_.end()) {
    for (const Seen& e : s->second) {
      if (e.index == remote.index && e.device == device) found = e.view;
    }
  }
  if (!found) {
    WindowDesc d;
    WindowDesc::decode(remote.window, &d);  // RegionDesc::decode checked it
    ViewKey key{remote.index, device, window_seal(d, remote.index)};
    auto it = views_.find(key);
    found = it != views_.end() ? &it->second.view : &bind_view(remote, d, device, key);
    if (seen_.size() >= 4 * max_views_) seen_.clear();
    seen_[std::string(bytes)].push_back({remote.index, device, found});
  }
  last_remote_ = &remote;
  last_device_ = device;
  last_view_ = found;
  return *found;
}

PeerView& Connection::bind_view(const RegionDesc& remote, const WindowDesc& d, int device, const ViewKey& key) {
  if (views_.size() >= max_views_) {
    fail(Code::kInvalidArgument, -1, 0, "region #" + std::to_string(remote.index) + " of agent " + peer_.name +
                                            ": this connection already keeps paths for " + std::to_string(views_.size()) +
                                            " descriptors of the peer's regions (FLAGCX_MESH_AGENT_MAX_VIEWS); "
                                            "reconnect to start afresh");
  }
  PathRequest req;
  req.me = 1;  // never the peer: self is for a mesh rank's own copy
  req.peer = kPeer;
  req.win_index = remote.index;
  req.kind = device >= 0 ? WindowKind::kDevice : WindowKind::kUser;
  req.device = device;
  req.host = agent_->host_;
  req.pid_ns = pid_namespace();
  req.forced = forced_transport();
  req.forced_cuda = forced_cuda_path();
  req.outbox = &engine();
  req.peer_socket = conns_.recv[0].get();
  req.proven = &proven_;  // the socket-table scan once per process of the peer
  req.peer_is_agent = true;
  req.ucx_worker = peer_.ucx_worker;  // from the handshake, never from the descriptor (transport/ucx)
  req.peer_id = "agent " + peer_.name;  // (its words: a cuda-ipc claim is keyed by the proven process)
  req.fd_fetch_ms = static_cast<int>(std::clamp(agent_->timeout_s() * 1000.0, 1.0, 5000.0));
  PathChoice c = choose_path(req, d);
  if (!c.mismatch.empty()) fail_mismatch(remote, d, c.mismatch);  // its owner says it is not its registration
  PeerView v;
  v.size = d.size;
  v.why = std::move(c.why);
  v.path = std::move(c.path);
  bool dev = device >= 0 || d.kind == WindowKind::kDevice;  // the fallback of a device path is staged, as the mesh's
  if (v.path->kind() != PathKind::kTcp && v.path->kind() != PathKind::kStaged) {
    v.fallback = dev ? make_staged_path(req, d, nullptr) : make_tcp_path(req, d, nullptr);
  }
  FXM_INFO(-1, who() + ": region #" + std::to_string(remote.index) + " (" + kind_name(d.kind) + ") from " +
                   (device >= 0 ? "device " + std::to_string(device) : std::string("host memory")) + " over " +
                   v.path->name() + (v.why.empty() ? "" : " (" + v.why + ")"));
  PeerView& bound = views_.emplace(key, Held{std::move(v), remote.window}).first->second.view;
  cookie_refs_.emplace(&bound, CookieRef{d.pid, d.cookie_addr, std::get<2>(key)});  // the seal it is bound to
  return bound;
}

// A cma path was chosen while the region was registered; the peer may have
// closed it since (it revokes the cookie), which the peer's engine cannot
// refuse for a write it never sees: read the cookie back before the first op
// to it of each call (a batch names few regions many times). A shm or device path maps the peer's memory here, likewise unseen by its engine; on
// a host where this process may not read the peer's (ptrace rules) it cannot
// tell, and the op goes ahead (docs/agent.md).
// (An op racing with the close itself can still land: see docs/agent.md.)
// The peer's cookie table makes the read a load (cma/cookie_table.h).
void Connection::check_cookie(const RegionDesc& remote, const PeerView& view, bool mapped) {
  const CookieRef& ref = cookie_refs_.at(&view);  // (bind_view: the descriptor this view was bound for)
  uint64_t now = 0;
  std::string note;
  int err = peer_cookies_.read(ref.pid, ref.addr, &now, &note);
  if (!note.empty()) {
    FXM_INFO(-1, who() + ": the peer's cookie table " + (note == "mapped" ? "is mapped: region checks are loads"
                                                                         : "is not mapped (" + note + "): region checks read through cma"));
  }
  if (err == 0 && now == ref.value) return;
  if (mapped && (err == EPERM || err == ENOSYS)) return;
  fail(Code::kInvalidArgument, -1, 0, "region #" + std::to_string(remote.index) + " of agent " + peer_.name +
                                          (err == 0 ? " was deregistered there" : " cannot be read back (" + errno_text(err) + ")"));
}

std::string Connection::path_to(const RegionDesc& remote, const RegionDesc* local) try {
  int device = -1;
  if (local) {
    bool entered = false;
    std::shared_ptr<Window> w = agent_->window_for(*local, "path_to", &entered);
    w->leave();
    if (w->kind == WindowKind::kDevice) device = w->device;
  }
  std::lock_guard<std::mutex> lock(op_mu_);
  last_remote_ = nullptr;
  return view_of(remote, device).path->name();
} catch (const Error& e) {
  rethrow_naming(e, peer_.name);
}

// A synchronous path that fails hands the op to tcp; while tcp ops are in
// flight on this connection every op takes tcp (FIFO, as the mesh keeps it).
// Device memory on either side takes a device path or staged.
// An op queued as a plain device copy while no other queue held ops starts a run: the ops
// right after it that name the same remote descriptor and local window would find all that it
// found here (view, path, no issue first, the cookie read, only copies queued, the same
// stream and fence), so issue_all() has them only queued (queue_in_run()).
Connection::Issued Connection::issue(const Checked& c, bool is_read, const StreamArg& stream, Batch* batch) {
  batch->end_run();
  int device = c.local->kind == WindowKind::kDevice ? c.local->device : -1;
  PeerView& v = view_of(*c.x->remote, device);
  if (!is_device_path(v.path->kind())) issue_batch(batch);  // what came before is issued first
  PathOp op;
  op.ctx = kCtx;
  op.remote_off = c.x->remote_off;
  op.local = c.local->base + c.x->local_off;
  op.len = c.x->size;
  op.src_rank = 1;
  op.local_device = device;
  Path* p = v.path.get();
  bool device_op = device >= 0 || is_device_path(p->kind()) || p->kind() == PathKind::kStaged;
  if (device_op || stream.set) op.deadline = batch->deadline;
  // (tcp writes queued in the call's batch are in flight too: a later cma op must not pass them)
  if (p->synchronous() && (batch->blocks.size() > 0 || !reached(async_issued_.load()))) p = &v.tcp();
  order_on(stream, p, device, &op);
  bool checked = cookie_checked_ == &v;  // once per region and call (a batch names few)
  // shm too: a segment the peer deregistered is unlinked there, and a write into it would be lost.
  if (!checked && (p->kind() == PathKind::kCma || p->kind() == PathKind::kShm || is_device_path(p->kind()))) {
    check_cookie(*c.x->remote, v, p->kind() != PathKind::kCma);
    cookie_checked_ = &v;
  }
  // A device copy while nothing waits in the other paths' queues (a request's blocks): none of
  // them would take it, nor has ops to issue before it.
  bool only_copies = is_device_path(p->kind()) && batch->blocks.size() == 0 && batch->staged.size() == 0 &&
                     batch->iovs.size() == 0;
  if (!only_copies) {
    if (!batch->single && queue_blocks(p, op, batch)) return Issued::kEngine;
    issue_blocks(batch);  // the tcp writes queued before this op go first
    // (A call's one staged write of kStripeMinBytes or more too: as a batch it is striped over the lanes.)
    bool striped = !batch->is_read && engine().stripes(op.len) > 1;
    if ((!batch->single || striped) && queue_staged(p, op, batch)) return Issued::kEngine;
    issue_staged(batch);  // the staged ops queued before this op go first
    if (p->synchronous() && !batch->single && queue_host(p, v, op, batch)) return Issued::kDone;
    issue_host(batch);  // the host ops queued before this one are done first
  }
  if (p->synchronous()) {
    int err = is_read ? p->get(op) : p->put(op);
    if (err == 0) return Issued::kDone;
    if (err == ESRCH) {  // no process of that pid: the peer is gone, and tcp says so to the call
      FXM_WARN(-1, who() + ": agent " + peer_.name + "'s process is gone (" + p->name() + ": " + errno_text(err) +
                       "); this op goes to tcp, which fails it once the connection's loss is seen");
    } else {
      FXM_WARN(-1, who() + ": " + p->name() + " failed (" + errno_text(err) + "); this op goes over tcp");
    }
    p = &v.tcp();
  }
  if (batch->single) return post(p, v, op, is_read);
  Queued q = p->queue(op, is_read, &batch->copies);
  if (q == Queued::kBatchFirst) {
    issue_batch(batch);
    q = p->queue(op, is_read, &batch->copies);
  }
  if (q == Queued::kYes) {
    batch->queued_first(&v, op);
    if (only_copies) batch->start_run(c, p);
    return Issued::kUnordered;
  }
  issue_batch(batch);
  return post(p, v, op, is_read);
}

// One more op of the run (issue()): its copy queued on the run's path as the first one's was,
// the first op's fields but for its offsets and length. Once nothing is in flight the fence is
// forgotten, as order_on() does for each op.
Connection::Issued Connection::queue_in_run(const Checked& c, bool is_read, const StreamArg& stream, Batch* b) {
  PathOp& op = b->firsts.back().second;  // (its offsets and length are kept in b->ops)
  forget_if_idle();
  op.remote_off = c.x->remote_off;
  op.local = c.local->base + c.x->local_off;
  op.len = c.x->size;
  if (b->run_path->queue_more(op, is_read, &b->copies) != Queued::kYes) {  // (not seen: the first op's answer holds)
    b->end_run();
    return issue(c, is_read, stream, b);
  }
  b->queued_more(op);
  return Issued::kUnordered;
}

// Counted before they are issued (their acks may come at once); a copy the
// driver refuses, and those after it, go over the fallback one by one.
void Connection::issue_batch(Batch* b) {
  b->end_run();  // the ops after these copies are ordered after them: issue() looks again
  size_t n = b->copies.size();
  if (n == 0) return;
  async_issued_ += n;
  std::string error;
  size_t issued = 0;
  try {
    issued = b->copies.issue(&error);
  } catch (const Error&) {  // the driver failed outside a copy (an event): nothing is counted
    async_issued_ -= n;
    b->copies.clear();
    b->clear_ops();
    throw;
  }
  if (issued < n) {
    async_issued_ -= n - issued;
    FXM_WARN(-1, who() + ": " + error + "; " + std::to_string(n - issued) + " op(s) go over " +
                     b->queued_op(issued).first->tcp().name());
    for (size_t i = issued; i < n; ++i) {
      auto [v, op] = b->queued_op(i);
      post(&v->tcp(), *v, op, b->is_read);
    }
  }
  b->clear_ops();
}

// Queues a staged write (read) into the call's staged batch; false when the path does not batch it.
bool Connection::queue_staged(Path* p, const PathOp& op, Batch* b) {
  Queued q = p->queue_staged(op, &b->staged);
  if (q == Queued::kBatchFirst) {
    issue_staged(b);
    q = p->queue_staged(op, &b->staged);
  }
  return q == Queued::kYes;
}

// The queued staged writes (reads) as one op a frame, each counted before it is posted (its ack
// may come at once).
void Connection::issue_staged(Batch* b) {
  if (b->staged.size() == 0) return;
  b->staged.issue(b->deadline, [this](int n) {
    if (n > 0) ++async_issued_;
    else --async_issued_;  // that frame was not posted
  });
}

// Queues a small tcp write between host memories into the call's batch of them; false when the
// path does not batch it.
bool Connection::queue_blocks(Path* p, const PathOp& op, Batch* b) {
  if (!b->tcp_batch) return false;
  Queued q = p->queue_blocks(op, b->is_read, &b->blocks);
  if (q == Queued::kBatchFirst) {
    issue_blocks(b);
    q = p->queue_blocks(op, b->is_read, &b->blocks);
  }
  if (q != Queued::kYes) return false;
  if (b->blocks.size() == 1) {  // a new batch: the ops queued before it go first, as before an op posted alone
    issue_staged(b);
    issue_host(b);
  }
  return true;
}

// The queued tcp writes as one frame, one op, counted before it is posted (its ack may come at once).
void Connection::issue_blocks(Batch* b) {
  b->blocks.issue([this](int n) { async_issued_ += n; });
}

// Queues a synchronous path's op into the call's host batch; false when the path does not batch it.
bool Connection::queue_host(Path* p, PeerView& v, const PathOp& op, Batch* b) {
  Queued q = p->queue_host(op, b->is_read, &b->iovs);
  if (q == Queued::kBatchFirst) {
    issue_host(b);
    q = p->queue_host(op, b->is_read, &b->iovs);
  }
  if (q != Queued::kYes) return false;
  b->host_ops.emplace_back(&v, op);
  return true;
}

// The queued host ops, in order; those the system call did not do (the peer's process is gone,
// a page it unmapped) go over tcp, as one op would, and the call waits for them.
void Connection::issue_host(Batch* b) {
  if (b->iovs.size() == 0) return;
  std::vector<std::pair<PeerView*, PathOp>> ops;
  ops.swap(b->host_ops);
  int err = 0;
  size_t done = b->iovs.issue(&err);
  if (done == ops.size()) return;
  Path& tcp = ops[done].first->tcp();
  if (err == ESRCH) {  // no process of that pid: the peer is gone, and tcp says so to the call
    FXM_WARN(-1, who() + ": agent " + peer_.name + "'s process is gone (cma: " + errno_text(err) + "); " +
                     std::to_string(ops.size() - done) + " op(s) go to tcp, which fails them once the "
                     "connection's loss is seen");
  } else {
    FXM_WARN(-1, who() + ": cma failed at op " + std::to_string(done) + " of " + std::to_string(ops.size()) +
                     " queued (" + errno_text(err) + "); it and those after it go over " + tcp.name());
  }
  b->host_fell_back = true;
  for (size_t i = done; i < ops.size(); ++i) post(&ops[i].first->tcp(), *ops[i].first, ops[i].second, b->is_read);
}

// A device path copies on the op's stream (or the connection's), after the
// connection's earlier device copies; staged waits for the stream itself; a
// host path starts once the stream's earlier work is done.
void Connection::order_on(const StreamArg& stream, Path* p, int device, PathOp* op) {
  bool device_path = is_device_path(p->kind());
  if (device_path) {
    forget_if_idle();
    op->fence = &fence_;
  }
  if (!stream.set) return;
  if (device_path || p->kind() == PathKind::kStaged) {
    op->stream_set = true;
    op->stream = stream.stream;
    return;
  }
  int ordinal = device >= 0 ? device : cuda::current_device();
  cuda::wait_for_stream(ordinal, stream.stream, op->deadline, who() + ": waiting for the transfer's stream");
}

// Nothing of this connection in flight: its next device copy waits for nothing across streams.
// (A fence that holds nothing has nothing to forget: no completion count is read for it.)
void Connection::forget_if_idle() {
  if (fence_.holds() && reached(async_issued_.load())) fence_.forget();
}

// An asynchronous op; a device path whose copy cannot be issued hands it to its fallback.
Connection::Issued Connection::post(Path* p, PeerView& v, const PathOp& op, bool is_read) {
  ++async_issued_;  // before the post: its ack may come back at once
  try {
    if (is_read) p->get(op);
    else p->put(op);
  } catch (const Error& e) {
    --async_issued_;  // nothing was counted: the copy was never issued
    if (!is_device_path(p->kind())) throw;
    FXM_WARN(-1, who() + ": " + p->name() + " failed (" + e.what() + "); this op goes over " + v.tcp().name());
    return post(&v.tcp(), v, op, is_read);
  }
  return is_device_path(p->kind()) || p->kind() == PathKind::kUcx ? Issued::kUnordered : Issued::kEngine;
}

// The ops in order; device copies and cma ops in batches. An op that fails
// to issue fails the call; the ops queued before it are issued first (as they
// would have been one at a time).
void Connection::issue_all(const std::vector<Checked>& checked, bool is_read, const StreamArg& stream, bool* async,
                           bool* unordered) {
  Batch batch(&engine(), is_read, checked.size(), Deadline::after_seconds(agent_->timeout_s()));
  try {
    size_t n = 0;
    bool any_async = false, any_unordered = false;
    for (const Checked& c : checked) {
      if (c.x->size == 0) continue;
      if (++n % Batch::kRenewEvery == 0) {  // waits measured from near their op
        batch.deadline = Deadline::after_seconds(agent_->timeout_s());
        batch.end_run();  // (the run's first op holds the deadline before)
      }
      Issued how = batch.in_run(c) ? queue_in_run(c, is_read, stream, &batch) : issue(c, is_read, stream, &batch);
      any_async = any_async || how != Issued::kDone;
      any_unordered = any_unordered || how == Issued::kUnordered;
      if (batch.queued_bytes >= Batch::kIssueBytes && batch.copies_only()) issue_batch(&batch);
    }
    *async = *async || any_async;
    *unordered = *unordered || any_unordered;
    issue_blocks(&batch);
    issue_staged(&batch);
    issue_host(&batch);
    issue_batch(&batch);
    *async = *async || batch.host_fell_back;
  } catch (const Error&) {
    try {
      issue_blocks(&batch);
      issue_staged(&batch);
      issue_host(&batch);
      issue_batch(&batch);
    } catch (const Error&) {  // the first error is the call's
    }
    throw;
  }
}

Handle Connection::transfer(const std::vector<Xfer>& ops, bool is_read, const std::vector<uint8_t>* notification,
                            StreamArg stream, bool* notified) try {
  LogSpeaker speaker(agent_->who());  // device-copy lines of this thread name the agent
  const char* call = is_read ? "read" : "write";
  if (ended()) fail(lost_code(), -1, 0, who() + ": " + call + ": " + gone());
  std::vector<Checked> checked;
  checked.reserve(ops.size());
  LocalWindows locals;
  for (size_t i = 0; i < ops.size(); ++i) {
    checked.push_back(check(ops[i], call, ops.size() > 1 ? static_cast<long>(i) : -1, &locals));
  }
  std::lock_guard<std::mutex> lock(op_mu_);
  cookie_checked_ = nullptr;
  last_remote_ = nullptr;
  bool async = false, unordered = false;
  try {
    issue_all(checked, is_read, stream, &async, &unordered);
    bool must_wait = (is_read || unordered) && async;  // what the socket does not order completes first
    if (notified) *notified = notification && !must_wait;
    if (notification && !(must_wait && notified)) {  // after the data
      if (must_wait) engine().wait_counter(async_issued_.load(), Deadline::after_seconds(agent_->timeout_s()));
      engine().post_message(kPeer, kCtx, notification->data(), notification->size(),
                            Deadline::after_seconds(agent_->timeout_s()));
    }
  } catch (const Error& e) {
    fail_call(e, call);
  }
  uint64_t bytes = 0;
  for (const Xfer& x : ops) bytes += x.size;
  return Handle(shared_from_this(), async ? async_issued_.load() : 0, async, is_read, ops.size(), bytes);
} catch (const Error& e) {
  rethrow_naming(e, peer_.name);
}

void Connection::notify(const std::vector<uint8_t>& bytes) {
  if (bytes.size() > kMaxNotificationBytes) check_notification_size(bytes.size(), who() + ": notify");  // (the words only then)
  std::lock_guard<std::mutex> lock(op_mu_);
  try {
    engine().post_message(kPeer, kCtx, bytes.data(), bytes.size(), Deadline::after_seconds(agent_->timeout_s()));
  } catch (const Error& e) {
    fail_call(e, "notify");
  }
}

void Connection::take_notifications(std::vector<Notification>* out) {
  // Not started: its tcp lanes are still joining and nothing arrived yet. Never engine() here:
  // its wait for the start would hold the inbox's lock, and the listener behind it, which is
  // what lets the lanes join (a slow joiner's connection then lost its lanes).
  if (!ready_.load(std::memory_order_acquire)) return;
  try {
    std::vector<uint8_t> m;
    while (engine_->try_recv_message(kPeer, kCtx, &m)) out->push_back({peer_.name, peer_.incarnation, std::move(m)});
  } catch (const Error& e) {  // the peer closed / was lost (nothing more will come), or the engine stopped
    if (e.code() == Code::kPeerLost) {
      std::string why = peer_end();
      std::lock_guard<std::mutex> lock(state_mu_);
      if (closed_why_.empty()) closed_why_ = why.empty() ? std::string("the peer is gone: ") + e.what() : why;
      closed_.store(true, std::memory_order_release);
    }
  }
}

bool Connection::help_read() {
  if (!ready_.load(std::memory_order_acquire) || stopped_.load(std::memory_order_acquire)) return false;
  return engine_->may_help() && engine_->help_read();
}

void Connection::unpark() {
  if (ready_.load(std::memory_order_acquire) && !stopped_.load(std::memory_order_acquire)) engine_->unpark();
}

bool Connection::reached(uint64_t target) const { return engine().completed() >= target; }

void Connection::poll_completions() const { engine().poll_probes(); }

void Connection::wait(uint64_t target, const Deadline& deadline, const Handle& describe) const {
  try {
    engine().wait_counter(target, deadline);
  } catch (const Error& e) {
    fail_call(e, describe.call(), &describe);
  }
}

void Connection::flush(const Deadline& deadline) {
  try {
    engine().wait_counter(async_issued_.load(), deadline);
  } catch (const Error& e) {
    if (e.code() == Code::kTimeout) throw;
  }
}

// The engine's words name its pair ("rank 0: ... peer 0 (ctx 0)", "wait_counter: 5998 op(s) to
// peer 0 not completed", "closed its mesh"): they are said of the agents and of this call here.
void Connection::fail_call(const Error& e, const std::string& call, const Handle* handle) const {
  std::string cause = e.what();
  if (cause.rfind("rank 0: ", 0) == 0) cause.erase(0, 8);  // (before the handle's words look at its start)
  if (handle) {  // the connection's count of ops in flight is no fact of this handle: its own are
    std::string mine = "its " + std::to_string(handle->count()) + " op(s) (" + std::to_string(handle->bytes()) +
                       " bytes) did not complete";
    size_t end = cause.find(" not completed");
    if (cause.rfind("wait_counter: ", 0) == 0 && end != std::string::npos) {
      cause.replace(0, end + 14, mine);
    } else if (cause.rfind("wait_counter(", 0) == 0 && e.code() == Code::kTimeout) {
      cause = mine + " in time";
    } else if (cause.rfind("wait_counter: ", 0) == 0) {
      cause.replace(0, 14, mine + ": ");
    }
  }
  cause = said_of_pair(cause, "agent " + peer_.name);
  std::string g = gone();
  bool said_goodbye = ready_.load(std::memory_order_acquire) && engine_->peer_closed(kPeer);
  if ((e.code() == Code::kClosed || said_goodbye) && !g.empty()) cause = g;  // not the engine's "closed its mesh"
  try {
    fail(e.code() == Code::kClosed ? lost_code() : e.code(), -1, e.sys_errno(), who() + ": " + call + ": " + cause);
  } catch (const Error& named) {
    rethrow_naming(named, peer_.name);
  }
}

// ------------------------------------------------------------ Handle

bool Handle::done() const {
  if (!pending_) return true;
  return conn_->reached(target_) || conn_->ended();
}

bool Handle::poll() const {
  if (!pending_) return true;
  conn_->poll_completions();
  return done();
}

void Handle::wait(double timeout_s) const {
  check_call_timeout(timeout_s, "wait: timeout");
  if (!pending_) return;
  double t = timeout_s > 0 ? timeout_s : conn_->agent_timeout();
  conn_->wait(target_, Deadline::after_seconds(t), *this);
}

std::string Handle::call() const {
  if (!conn_) return "";
  return std::string(is_read_ ? "read" : "write") + " of " + std::to_string(count_) + " transfer(s) to agent " +
         conn_->peer().name;
}

}  // namespace fxm::agent
