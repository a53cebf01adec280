#include "core/mesh.h"

#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>

#include "base/env.h"
#include "base/log.h"

namespace fxm {
namespace {

constexpr size_t kWireCheckSize = 32;

std::vector<uint8_t> wire_check_payload(const wire::MeshId& id, int src, int dst, int ctx,
                                        uint32_t epoch) {
  std::vector<uint8_t> p(kWireCheckSize, 0);
  std::memcpy(p.data(), id.data(), 16);
  int32_t v[3] = {src, dst, ctx};
  std::memcpy(p.data() + 16, v, 12);
  std::memcpy(p.data() + 28, &epoch, 4);
  return p;
}

void check_args(int nranks, int rank, const MeshOptions& opt) {
  auto bad = [](const std::string& m) { fail(Code::kInvalidArgument, -1, 0, m); };
  if (nranks < 1) bad("nranks must be >= 1, got " + std::to_string(nranks));
  if (rank < 0 || rank >= nranks) {
    bad("rank " + std::to_string(rank) + " is out of range for nranks=" + std::to_string(nranks));
  }
  if (opt.contexts < 1 || opt.contexts > 1024) {
    bad("contexts must be in [1, 1024], got " + std::to_string(opt.contexts));
  }
  if (opt.timeout_s != 0) check_timeout(opt.timeout_s, "Mesh build: timeout", false);
  check_timeout(opt.header_timeout_s, "Mesh build: header_timeout", false);
  if (opt.max_inflight < 1) bad("max_inflight must be >= 1");
  if (opt.max_unreceived < 1) bad("max_unreceived must be >= 1");
  if (opt.epoch > 0xFFFFFFFFll || opt.epoch < -1) {
    bad("epoch must be in [0, 2^32) (or -1: the unique id's), got " + std::to_string(opt.epoch));
  }
}

}  // namespace

Mesh::Mesh(int nranks, const uint8_t* unique_id, size_t unique_id_len, int rank,
           const MeshOptions& opt)
    : nranks_(nranks), rank_(rank), contexts_(opt.contexts) {
  require_valid_env();
  check_args(nranks, rank, opt);
  bootstrap::UniqueId id = bootstrap::decode_unique_id(unique_id, unique_id_len);
  mesh_id_ = id.mesh_id;
  epoch_ = opt.epoch < 0 ? id.epoch : static_cast<uint32_t>(opt.epoch);
  key_ = id.key_for(epoch_);
  double timeout_s = build_timeout_s(opt.timeout_s, "Mesh build: timeout");
  Deadline deadline = Deadline::after_seconds(timeout_s);
  try {
    build(id, opt, deadline);
  } catch (const Error& e) {
    if (boot_) boot_->abort(e.code(), e.what());
    throw;
  } catch (const std::exception& e) {
    if (boot_) boot_->abort(Code::kInternal, who() + "mesh build aborted: " + e.what());
    throw;
  }
  timeout_s_ = timeout_s;
  engine_ = std::make_unique<Engine>(rank_, nranks_, contexts_, &conns_, &windows_, opt.max_unreceived, timeout_s_);
  onesided_ = std::make_unique<OneSided>(
      rank_, nranks_, contexts_, engine_.get(), &conns_, &windows_,
      [this](const std::vector<uint8_t>& mine, const bootstrap::Call& call) {
        return boot_->allgather(mine, Deadline::after_seconds(timeout_s_), call);
      },
      timeout_s_);
}

Mesh::~Mesh() {
  close();
  if (kept_engine_ != nullptr) (void)engine_.release();
}

void Mesh::build(const bootstrap::UniqueId& id, const MeshOptions& opt, const Deadline& deadline) {
  auto phase = [&](const char* name) {
    if (opt.on_phase) opt.on_phase(name);
  };
  Clock::time_point t0 = Clock::now(), t = t0;
  auto lap = [&t]() {
    double s = seconds_since(t);
    t = Clock::now();
    return s;
  };
  int err = 0;
  tcp::Fd listener = tcp::listen_on(tcp::local_address(), &listen_addr_, &err);
  if (!listener) fail(Code::kSystem, -1, err, who() + "listen on " + tcp::local_address().str());
  times_.listen = lap();
  phase("listen");
  std::vector<tcp::SockAddr> peers = rendezvous(id, deadline);
  times_.rendezvous = lap();
  phase("rendezvous");
  // Each lane is one more connection of the same handshake: wire context ctx + lane * contexts.
  BuildPlan plan{rank_, nranks_, contexts_ * lanes_, mesh_id_, epoch_, key_, std::move(peers), listener.get(),
                 boot_->fd(), [&] { boot_->raise_pending(deadline); }, deadline,
                 opt.header_timeout_s, opt.max_inflight};
  conns_ = lanes_in_engine_order(build_mesh(plan, &stats_));
  listener.reset();  // no connection is accepted after the build
  times_.connect = lap();
  phase("connect");
  wiring_check(deadline);
  boot_->barrier(deadline, bootstrap::CallKind::kBuildBarrier);
  times_.wiring = lap();
  times_.total = seconds_since(t0);
  phase("wiring");
}

std::vector<tcp::SockAddr> Mesh::rendezvous(const bootstrap::UniqueId& id, const Deadline& deadline) {
  boot_ = std::make_unique<bootstrap::Client>(id, rank_, nranks_, deadline, epoch_);
  // The address, then the lanes this rank offers (the mesh uses the smallest offer).
  // Per lane this rank holds a send and a receive connection per (peer, context).
  uint32_t offer = static_cast<uint32_t>(tcp_lanes_env(2ull * nranks_ * contexts_));
  std::vector<uint8_t> mine(tcp::kWireAddrSize + sizeof(offer));
  tcp::addr_to_wire(listen_addr_, mine.data());
  std::memcpy(mine.data() + tcp::kWireAddrSize, &offer, sizeof(offer));
  bootstrap::Parts parts = boot_->allgather(mine, deadline, {bootstrap::CallKind::kBuildAddresses, 0});
  std::vector<tcp::SockAddr> peers(nranks_);
  lanes_ = kMaxTcpLanes;
  for (int r = 0; r < nranks_; ++r) {
    uint32_t lanes = 0;
    if (parts[r].size() == mine.size()) std::memcpy(&lanes, parts[r].data() + tcp::kWireAddrSize, sizeof(lanes));
    if (parts[r].size() != mine.size() || !tcp::addr_from_wire(parts[r].data(), &peers[r]) || lanes < 1 ||
        lanes > static_cast<uint32_t>(kMaxTcpLanes)) {
      fail(Code::kProtocol, r, 0, who() + "rank " + std::to_string(r) + " published a malformed address");
    }
    lanes_ = std::min(lanes_, static_cast<int>(lanes));
  }
  return peers;
}

Connections Mesh::lanes_in_engine_order(Connections built) const {
  int wire_contexts = contexts_ * lanes_, total = nranks_ * contexts_;
  Connections c;
  c.send.resize(built.send.size());
  c.recv.resize(built.recv.size());
  for (int peer = 0; peer < nranks_; ++peer) {
    for (int w = 0; w < wire_contexts; ++w) {
      int lane = w / contexts_, ctx = w % contexts_;
      int at = lane * total + peer * contexts_ + ctx, from = peer * wire_contexts + w;
      c.send[at] = std::move(built.send[from]);
      c.recv[at] = std::move(built.recv[from]);
    }
  }
  return c;
}

// Every connection, lanes included, proves its (source, destination, wire context) once more.
void Mesh::wiring_check(const Deadline& deadline) {
  int total = nranks_ * contexts_ * lanes_;
  auto wire_ctx = [&](int s) { return (s / (nranks_ * contexts_)) * contexts_ + s % contexts_; };
  for (int s = 0; s < total; ++s) {
    int peer = (s % (nranks_ * contexts_)) / contexts_, ctx = wire_ctx(s);
    std::vector<uint8_t> msg(wire::kFrameHeaderSize);
    wire::encode_frame({wire::FrameType::kWireCheck, 0, kWireCheckSize}, msg.data());
    std::vector<uint8_t> p = wire_check_payload(mesh_id_, rank_, peer, ctx, epoch_);
    msg.insert(msg.end(), p.begin(), p.end());
    tcp::IoResult r = tcp::write_full(conns_.send[s].get(), msg.data(), msg.size(), deadline);
    if (!r.ok()) fail_build_io(r, peer, ctx, "sending the wiring check", deadline);
  }
  for (int s = 0; s < total; ++s) {
    int peer = (s % (nranks_ * contexts_)) / contexts_, ctx = wire_ctx(s);
    uint8_t buf[wire::kFrameHeaderSize + kWireCheckSize];
    wait_readable(conns_.recv[s].get(), peer, deadline, "waiting for the wiring check");
    tcp::IoResult r = tcp::read_full(conns_.recv[s].get(), buf, sizeof(buf), deadline);
    if (!r.ok()) fail_build_io(r, peer, ctx, "reading the wiring check", deadline);
    wire::FrameHeader f;
    std::vector<uint8_t> expect = wire_check_payload(mesh_id_, peer, rank_, ctx, epoch_);
    if (!wire::decode_frame(buf, &f) || f.type != wire::FrameType::kWireCheck ||
        std::memcmp(buf + wire::kFrameHeaderSize, expect.data(), kWireCheckSize) != 0) {
      fail(Code::kProtocol, peer, 0,
           who() + "wiring check failed: the connection filed as (peer " + std::to_string(peer) +
               ", ctx " + std::to_string(ctx) + ") did not prove to come from that rank");
    }
  }
}

void Mesh::wait_readable(int fd, int peer, const Deadline& deadline, const char* doing) {
  while (true) {
    pollfd fds[2] = {{fd, POLLIN, 0}, {boot_ ? boot_->fd() : -1, POLLIN, 0}};
    int rc = ::poll(fds, 2, deadline.poll_ms(1000));
    if (rc > 0 && fds[0].revents) return;
    if (rc > 0 && fds[1].revents) boot_->raise_pending(deadline);
    if (deadline.expired()) {
      fail(Code::kTimeout, peer, 0, who() + doing + " from peer " + std::to_string(peer) + ": timed out");
    }
  }
}

void Mesh::check_peer(int peer, int ctx, const char* op) const {
  if (closed_) fail(Code::kClosed, peer, 0, who() + op + ": the mesh is closed");
  if (peer < 0 || peer >= nranks_) {
    fail(Code::kInvalidArgument, peer, 0, who() + op + ": peer " + std::to_string(peer) +
                                              " is out of range [0, " + std::to_string(nranks_) + ")");
  }
  if (ctx < 0 || ctx >= contexts_) {
    fail(Code::kInvalidArgument, peer, 0, who() + op + ": context " + std::to_string(ctx) +
                                              " is out of range [0, " + std::to_string(contexts_) + ")");
  }
}

// During the build a connection closes because its rank failed; that rank (or
// the root, for a rank that died) tells the root why just before. Give that
// notice a moment to arrive and raise it, so that the error names the rank at
// the origin of the failure rather than the first one this rank heard close.
void Mesh::fail_build_io(const tcp::IoResult& r, int peer, int ctx, const char* doing,
                         const Deadline& deadline) {
  if (r.kind == tcp::IoResult::kClosed && boot_) {
    pollfd p{boot_->fd(), POLLIN, 0};
    if (::poll(&p, 1, deadline.min(Deadline::after_seconds(0.5)).poll_ms()) > 0) {
      boot_->raise_pending(deadline);
    }
  }
  fail_io(r, peer, ctx, doing);
}

void Mesh::fail_io(const tcp::IoResult& r, int peer, int ctx, const char* doing) const {
  std::string what = who() + doing + " (peer " + std::to_string(peer) + ", ctx " + std::to_string(ctx) + ")";
  if (closed_) fail(Code::kClosed, peer, 0, what + ": the mesh was closed");
  switch (r.kind) {
    case tcp::IoResult::kTimeout: fail(Code::kTimeout, peer, 0, what + ": timed out");
    case tcp::IoResult::kClosed:
      fail(Code::kPeerLost, peer, r.err, what + ": peer " + std::to_string(peer) + " closed the connection");
    default: fail(Code::kSystem, peer, r.err, what);
  }
}

// An operation's timeout, the one rule of every call that takes one (docs/python-api.md,
// "Timeouts"): 0 is the mesh's timeout, > 0 seconds, +inf no limit; a negative number or NaN
// is refused naming the call before anything starts.
Deadline Mesh::deadline_for(double timeout_s, const std::string& call) const {
  return call_deadline(timeout_s, timeout_s_, who() + call + ": timeout");
}

void Mesh::send(int peer, const void* data, size_t len, int ctx, double timeout_s) {
  Deadline deadline = deadline_for(timeout_s, "send");
  std::shared_lock<std::shared_timed_mutex> life(life_mu_);
  check_peer(peer, ctx, "send");
  engine_->post_message(peer, ctx, data, len, deadline);
}

std::vector<uint8_t> Mesh::recv(int peer, int ctx, double timeout_s) {
  Deadline deadline = deadline_for(timeout_s, "recv");
  std::shared_lock<std::shared_timed_mutex> life(life_mu_);
  check_peer(peer, ctx, "recv");
  return engine_->recv_message(peer, ctx, deadline);
}

void Mesh::check_open(const char* op) const {
  if (closed_) fail(Code::kClosed, -1, 0, who() + op + ": the mesh is closed");
}

#define FXM_OPEN(op)                                              \
  std::shared_lock<std::shared_timed_mutex> life(life_mu_); \
  check_open(op)

uint32_t Mesh::register_window(void* base, uint64_t size) {
  FXM_OPEN("register_window");
  return onesided_->register_user(base, size);
}

uint32_t Mesh::alloc_window(uint64_t size) {
  FXM_OPEN("alloc_window");
  return onesided_->alloc(size);
}

uint32_t Mesh::register_device_window(void* base, uint64_t size) {
  FXM_OPEN("register_window");
  return onesided_->register_device(base, size);
}

uint32_t Mesh::alloc_device_window(uint64_t size, int device) {
  FXM_OPEN("alloc_window");
  return onesided_->alloc_device(size, device);
}

uint32_t Mesh::signal_window(uint64_t nslots) {
  FXM_OPEN("signal_window");
  return onesided_->alloc_signal(nslots);
}

void Mesh::refuse_registration(const std::string& reason) {
  FXM_OPEN("register_window");
  onesided_->refuse_registration(reason);
}

void Mesh::deregister(uint32_t index) {
  FXM_OPEN("deregister");
  onesided_->deregister(index, Deadline::after_seconds(timeout_s_));
}

std::shared_ptr<Window> Mesh::window(uint32_t index) {
  FXM_OPEN("window");
  return onesided_->window(index, "window");
}

void Mesh::put(const PutArgs& a) {
  FXM_OPEN("put");
  onesided_->put(a);
}

void Mesh::batch_put(const std::vector<PutArgs>& ops) {
  FXM_OPEN("batch_put");
  for (size_t i = 0; i < ops.size(); ++i) {
    try {
      onesided_->check_put(ops[i]);
    } catch (const Error& e) {  // nothing was issued: name the entry
      fail(e.code(), e.peer(), e.sys_errno(), "batch_put entry " + std::to_string(i) + ": " + e.what());
    }
  }
  Deadline deadline = onesided_->op_deadline();  // one for the whole batch
  for (PutArgs a : ops) {
    a.deadline = &deadline;
    onesided_->put(a);
  }
}

void Mesh::get(const PutArgs& a) {
  FXM_OPEN("get");
  onesided_->get(a);
}

uint64_t Mesh::read_signal(uint32_t win, uint64_t slot) {
  FXM_OPEN("read_signal");
  return onesided_->read_signal(win, slot);
}

void Mesh::wait_signal(uint32_t win, uint64_t slot, uint64_t expected, double timeout_s) {
  FXM_OPEN("wait_signal");
  onesided_->wait_signal(win, slot, expected, deadline_for(timeout_s, "wait_signal"));
}

void Mesh::wait_signal_on_stream(uint32_t win, uint64_t slot, uint64_t expected, void* stream, double timeout_s) {
  FXM_OPEN("wait_signal");
  onesided_->wait_signal_on_stream(win, slot, expected, stream, deadline_for(timeout_s, "wait_signal"));
}

void Mesh::flush(int peer, double timeout_s) {
  FXM_OPEN("flush");
  if (peer < -1 || peer >= nranks_) check_peer(peer, 0, "flush");
  engine_->flush(peer, deadline_for(timeout_s, "flush"));
}

uint64_t Mesh::read_counter() {
  FXM_OPEN("read_counter");
  engine_->poll_probes();
  return engine_->completed();
}

void Mesh::wait_counter(uint64_t value, double timeout_s) {
  FXM_OPEN("wait_counter");
  engine_->wait_counter(value, deadline_for(timeout_s, "wait_counter"));
}

bootstrap::Parts Mesh::allgather(const std::vector<uint8_t>& mine, double timeout_s) {
  return collective(mine, timeout_s, {bootstrap::CallKind::kAllgather, 0});
}

void Mesh::barrier(double timeout_s) { collective({}, timeout_s, {bootstrap::CallKind::kBarrier, 0}); }

bootstrap::Parts Mesh::collective(const std::vector<uint8_t>& mine, double timeout_s, const bootstrap::Call& call) {
  Deadline deadline = deadline_for(timeout_s, bootstrap::call_name(call));
  std::shared_lock<std::shared_timed_mutex> life(life_mu_);
  if (closed_) fail(Code::kClosed, -1, 0, who() + bootstrap::call_name(call) + ": the mesh is closed");
  return boot_->allgather(mine, deadline, call);
}

void Mesh::close() {
  if (closed_.exchange(true)) return;
  keep_for_streams();
  if (engine_) engine_->stop();  // says goodbye to every peer, wakes waiters
  for (auto* v : {&conns_.send, &conns_.recv}) {
    for (tcp::Fd& fd : *v) {
      if (fd) ::shutdown(fd.get(), SHUT_RDWR);  // wakes operations blocked on it
    }
  }
  std::unique_lock<std::shared_timed_mutex> life(life_mu_, std::defer_lock);
  if (!life.try_lock_for(std::chrono::milliseconds(200))) {
    if (boot_) boot_->interrupt();  // a collective is blocked in another thread
    life.lock();
  }
  conns_.send.clear();
  conns_.recv.clear();
  if (boot_) boot_->bye();
}

// Ops queued on CUDA streams report their completion (and apply signals)
// from the stream: the engine and the windows must outlive them. When the
// streams do not get there within the timeout, both are kept, never freed.
void Mesh::keep_for_streams() {
  if (!engine_) return;
  Deadline deadline = Deadline::after_seconds(std::min(timeout_s_, 5.0));
  bool waits_passed = true;
  for (const std::shared_ptr<Window>& w : windows_.all()) waits_passed = stream_waits_passed(*w, deadline) && waits_passed;
  if (engine_->wait_stream_ops(deadline) && waits_passed) return;
  FXM_ERROR(rank_, "close: " + std::to_string(engine_->stream_ops_pending()) +
                       " op(s) queued on CUDA streams have not completed, or a stream still waits on a signal "
                       "slot; the windows' memory is kept (never freed)");
  new std::vector<std::shared_ptr<Window>>(windows_.all());  // deliberately never freed
  kept_engine_ = engine_.get();
}

std::vector<int> Mesh::tcp_lane_ports(int peer, int ctx) const {
  check_peer(peer, ctx, "tcp_lane_ports");
  std::vector<int> ports;
  for (int lane = 0; lane < lanes_; ++lane) {
    size_t c = static_cast<size_t>(lane * nranks_ * contexts_ + peer * contexts_ + ctx);
    sockaddr_storage a{};
    socklen_t n = sizeof(a);
    int port = -1;
    if (c < conns_.send.size() && ::getsockname(conns_.send[c].get(), reinterpret_cast<sockaddr*>(&a), &n) == 0) {
      port = ntohs(a.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&a)->sin6_port
                                           : reinterpret_cast<sockaddr_in*>(&a)->sin_port);
    }
    ports.push_back(port);
  }
  return ports;
}

std::string Mesh::describe() const {
  char buf[512];
  std::snprintf(buf, sizeof(buf),
                "Mesh(rank %d of %d, contexts %d, tcp lanes %d, mesh id %s, %s, built in %.1f ms, "
                "%llu foreign connections rejected, %llu connect retries%s)",
                rank_, nranks_, contexts_, lanes_, mesh_id_hex().substr(0, 8).c_str(),
                tcp::local_address_reason().c_str(), times_.total * 1e3,
                static_cast<unsigned long long>(stats_.total_rejected()),
                static_cast<unsigned long long>(stats_.connect_retries), closed_ ? ", closed" : "");
  return buf;
}

}  // namespace fxm
