#include "core/mesh.h"

#include <poll.h>
#include <sys/socket.h>

#include <cstdio>
#include <cstring>

#include "core/env.h"
#include "core/log.h"

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

Deadline deadline_for(double timeout_s) {
  return timeout_s > 0 ? Deadline::after_seconds(timeout_s) : Deadline::never();
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
  if (opt.timeout_s < 0) bad("timeout must be positive");
  if (opt.max_inflight < 1) bad("max_inflight must be >= 1");
}

}  // namespace

Mesh::Mesh(int nranks, const uint8_t* unique_id, size_t unique_id_len, int rank,
           const MeshOptions& opt)
    : nranks_(nranks), rank_(rank), contexts_(opt.contexts), epoch_(opt.epoch) {
  check_args(nranks, rank, opt);
  bootstrap::UniqueId id = bootstrap::decode_unique_id(unique_id, unique_id_len);
  mesh_id_ = id.mesh_id;
  double timeout_s = opt.timeout_s > 0 ? opt.timeout_s : env_config().timeout_s;
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
  for (int s = 0; s < nranks_ * contexts_; ++s) {
    send_mu_.push_back(std::make_unique<std::mutex>());
    recv_mu_.push_back(std::make_unique<std::mutex>());
  }
}

Mesh::~Mesh() { close(); }

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
  std::vector<tcp::SockAddr> peers = rendezvous(id.root, deadline);
  times_.rendezvous = lap();
  phase("rendezvous");
  BuildPlan plan{rank_, nranks_, contexts_, mesh_id_, epoch_, std::move(peers), listener.get(),
                 boot_->fd(), [&] { boot_->raise_pending(deadline); }, deadline,
                 opt.header_timeout_s, opt.max_inflight};
  conns_ = build_mesh(plan, &stats_);
  listener.reset();  // no connection is accepted after the build
  times_.connect = lap();
  phase("connect");
  wiring_check(deadline);
  boot_->barrier(deadline);
  times_.wiring = lap();
  times_.total = seconds_since(t0);
  phase("wiring");
}

std::vector<tcp::SockAddr> Mesh::rendezvous(const tcp::SockAddr& root, const Deadline& deadline) {
  bootstrap::UniqueId id{root, mesh_id_};
  boot_ = std::make_unique<bootstrap::Client>(id, rank_, nranks_, deadline);
  std::vector<uint8_t> mine(tcp::kWireAddrSize);
  tcp::addr_to_wire(listen_addr_, mine.data());
  bootstrap::Parts parts = boot_->allgather(mine, deadline);
  std::vector<tcp::SockAddr> peers(nranks_);
  for (int r = 0; r < nranks_; ++r) {
    if (parts[r].size() != tcp::kWireAddrSize || !tcp::addr_from_wire(parts[r].data(), &peers[r])) {
      fail(Code::kProtocol, r, 0, who() + "rank " + std::to_string(r) + " published a malformed address");
    }
  }
  return peers;
}

void Mesh::wiring_check(const Deadline& deadline) {
  int total = nranks_ * contexts_;
  for (int s = 0; s < total; ++s) {
    int peer = s / contexts_, ctx = s % contexts_;
    std::vector<uint8_t> msg(wire::kFrameHeaderSize);
    wire::encode_frame({wire::FrameType::kWireCheck, 0, kWireCheckSize}, msg.data());
    std::vector<uint8_t> p = wire_check_payload(mesh_id_, rank_, peer, ctx, epoch_);
    msg.insert(msg.end(), p.begin(), p.end());
    tcp::IoResult r = tcp::write_full(conns_.send[s].get(), msg.data(), msg.size(), deadline);
    if (!r.ok()) fail_io(r, peer, ctx, "sending the wiring check");
  }
  for (int s = 0; s < total; ++s) {
    int peer = s / contexts_, ctx = s % contexts_;
    uint8_t buf[wire::kFrameHeaderSize + kWireCheckSize];
    wait_readable(conns_.recv[s].get(), peer, deadline, "waiting for the wiring check");
    tcp::IoResult r = tcp::read_full(conns_.recv[s].get(), buf, sizeof(buf), deadline);
    if (!r.ok()) fail_io(r, peer, ctx, "reading the wiring check");
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

void Mesh::send(int peer, const void* data, size_t len, int ctx, double timeout_s) {
  std::shared_lock<std::shared_timed_mutex> life(life_mu_);
  check_peer(peer, ctx, "send");
  int s = peer * contexts_ + ctx;
  std::lock_guard<std::mutex> lock(*send_mu_[s]);
  Deadline deadline = deadline_for(timeout_s);
  uint8_t hdr[wire::kFrameHeaderSize];
  wire::encode_frame({wire::FrameType::kMessage, 0, len}, hdr);
  tcp::IoResult r = tcp::write_full(conns_.send[s].get(), hdr, sizeof(hdr), deadline);
  if (r.ok() && len > 0) r = tcp::write_full(conns_.send[s].get(), data, len, deadline);
  if (!r.ok()) fail_io(r, peer, ctx, "send");
}

std::vector<uint8_t> Mesh::recv(int peer, int ctx, double timeout_s) {
  std::shared_lock<std::shared_timed_mutex> life(life_mu_);
  check_peer(peer, ctx, "recv");
  int s = peer * contexts_ + ctx;
  std::lock_guard<std::mutex> lock(*recv_mu_[s]);
  Deadline deadline = deadline_for(timeout_s);
  uint8_t hdr[wire::kFrameHeaderSize];
  tcp::IoResult r = tcp::read_full(conns_.recv[s].get(), hdr, sizeof(hdr), deadline);
  if (!r.ok()) fail_io(r, peer, ctx, "recv");
  wire::FrameHeader f;
  if (!wire::decode_frame(hdr, &f) || f.type != wire::FrameType::kMessage || f.length > (1ull << 40)) {
    fail(Code::kProtocol, peer, 0, who() + "recv from peer " + std::to_string(peer) + ": malformed frame");
  }
  std::vector<uint8_t> out(f.length);
  r = tcp::read_full(conns_.recv[s].get(), out.data(), out.size(), deadline);
  if (!r.ok()) fail_io(r, peer, ctx, "recv");
  return out;
}

bootstrap::Parts Mesh::allgather(const std::vector<uint8_t>& mine, double timeout_s) {
  std::shared_lock<std::shared_timed_mutex> life(life_mu_);
  if (closed_) fail(Code::kClosed, -1, 0, who() + "allgather: the mesh is closed");
  return boot_->allgather(mine, deadline_for(timeout_s));
}

void Mesh::barrier(double timeout_s) { allgather({}, timeout_s); }

void Mesh::close() {
  if (closed_.exchange(true)) return;
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

std::string Mesh::describe() const {
  char buf[512];
  std::snprintf(buf, sizeof(buf),
                "Mesh(rank %d of %d, contexts %d, mesh id %s, %s, built in %.1f ms, "
                "%llu foreign connections rejected, %llu connect retries%s)",
                rank_, nranks_, contexts_, mesh_id_hex().substr(0, 8).c_str(),
                tcp::local_address_reason().c_str(), times_.total * 1e3,
                static_cast<unsigned long long>(stats_.total_rejected()),
                static_cast<unsigned long long>(stats_.connect_retries), closed_ ? ", closed" : "");
  return buf;
}

}  // namespace fxm
