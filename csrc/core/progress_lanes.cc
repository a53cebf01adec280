// Lanes of the progress engine: with FLAGCX_MESH_TCP_LANES > 1 each (peer, context) has that
// many send and receive connections, built by the same handshake (wire context ctx + lane *
// contexts). Lane 0 carries every frame as before; the other lanes carry only the stripes of
// large puts (kStripe) and their goodbye.
//
// Threads. The progress thread owns lane 0 of every slot. Lane k >= 1 of every slot is owned by
// lane worker k - 1 (LaneWorker: its own eventfd and poll loop), the only thread that reads and
// writes those connections once the engine runs, so the kernel copies of a striped put run on
// as many cores as there are lanes. What they share: the queues (under mu_, as for lane 0),
// window entry (atomic), and per slot two counters, stripes_admitted_ (progress thread -> workers)
// and stripes_landed_ (workers -> progress thread), each woken through the other's eventfd.
//
// Order across lanes is kept at the target. A striped put's lane-0 part (kPut + kPutStriped)
// admits the put; a stripe (numbered per slot) is not read past its header until its put was
// admitted, so it cannot overtake an earlier op of lane 0; and lane 0 reads nothing after the
// part until every stripe landed, so no later op (a put to the same bytes, a signal, a get, a
// message) overtakes a stripe. The put is then applied once, by the progress thread: its signal
// (after every stripe's bytes: the workers' counts are released, its load acquires them), then
// its ack. A lane that dies loses the peer (PeerLost naming it and the lane), so no striped put
// completes half.
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/socket.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <thread>

#include "base/log.h"
#include "base/status.h"
#include "core/progress_items.h"

namespace fxm {

using wire::FrameType;

bool Engine::lane_spinning(int64_t until_ns) const { return until_ns > 0 && steady_ns() < until_ns; }

std::string Engine::conn_name(int c) const {
  return lane_of(c) == 0 ? "" : " (tcp lane " + std::to_string(lane_of(c)) + ")";
}

void Engine::post_striped(int peer, int ctx, const uint8_t* src, uint64_t len, uint32_t dst_win, uint64_t dst_off,
                          const SignalSpec& sig) {
  int s = slot(peer, ctx);
  uint64_t part = len / lanes_, first = len - part * (lanes_ - 1);
  wire::PutHeader h = put_header(dst_win, dst_off, sig);
  h.flags |= wire::kPutStriped;
  h.pad = static_cast<uint32_t>(lanes_ - 1);
  OutItem head{frame(FrameType::kPut, &h, first), src, first, 0, 0};
  {
    // One critical section: the parts of consecutive striped puts queue in one order on every lane.
    std::lock_guard<std::mutex> lock(mu_);
    ++outstanding_[s];
    in_flight_kind_[s] = PathKind::kTcp;
    ++acks_due_[s];
    issued_[peer].fetch_add(1);
    uint64_t number = ++stripe_seq_[s];
    out_[s].push_back(std::move(head));
    for (int k = 1; k < lanes_; ++k) {
      uint64_t at = first + (k - 1) * part;
      wire::PutHeader p;
      p.dst_win = dst_win;
      p.dst_off = dst_off + at;
      p.sig_slot = number;
      out_[k * total_ + s].push_back({frame(FrameType::kStripe, &p, part), src + at, part, 0, 0});
    }
  }
  if (std::this_thread::get_id() != progress_tid_.load()) wake();
  wake_lanes();
}

bool Engine::lane_readable(int c) const {
  const InConn& in = *in_[c];
  if (in.closed) return false;
  if (c < total_) return mailbox_bytes_[c] < max_unreceived_ && !lane0_held_[c];
  return !(in.st == InConn::kPayload && lane_seq_[c] > stripes_admitted_[base_slot(c)].load(std::memory_order_acquire));
}

bool Engine::on_striped_header(int s, InConn& in) {
  uint64_t payload = in.f.length - in.need;
  if (lanes_ == 1 || in.put.pad != static_cast<uint32_t>(lanes_ - 1) || payload == 0) {
    lose(peer_of(s), "protocol error: a put striped over " + std::to_string(in.put.pad + 1) + " lanes (this mesh has " +
                         std::to_string(lanes_) + ")");
    in.closed = true;
    return false;
  }
  // Every stripe of the earlier striped puts landed (lane 0 was held until then), and none of
  // this one's has been read past its header: the workers may read this one's now.
  stripes_admitted_[s].fetch_add(1, std::memory_order_release);
  if (lane_spin_ns_ > 0) lane0_spin_until_ns_.store(steady_ns() + lane_spin_ns_, std::memory_order_relaxed);
  wake_lanes();
  return true;
}

void Engine::on_stripe_header(int c, InConn& in, uint64_t payload) {
  int s = base_slot(c);
  wire::PutHeader p;
  std::memcpy(&p, in.buf, sizeof(p));
  if (payload == 0 || p.sig_slot != lane_seq_[c] + 1 || p.sig_slot < stripes_admitted_[s].load()) {
    lose(peer_of(c), "protocol error: stripe #" + std::to_string(p.sig_slot) + " on" + conn_name(c) +
                         " out of order (expected #" + std::to_string(lane_seq_[c] + 1) + ")");
    in.closed = true;
    return;
  }
  lane_seq_[c] = p.sig_slot;  // read_some() stops here until lane 0 admitted that put
  Window* w = windows_->find(p.dst_win);
  if (w != nullptr && w->kind == WindowKind::kDevice) {  // initiators stripe only to host windows
    in.put = p;
    in.refused = "a stripe of a put to device window #" + std::to_string(p.dst_win) + " (not striped there)";
    FXM_WARN(rank_, "refused " + in.refused + " from peer " + std::to_string(peer_of(c)));
    return;
  }
  on_put_header(c, in, payload);
}

// The lane's thread: the stripe's bytes are in the window (or were dropped, refused).
void Engine::on_stripe_done(int c, InConn& in) {
  int s = base_slot(c);
  if (!in.refused.empty()) {
    std::lock_guard<std::mutex> lock(mu_);
    if (stripe_refused_[s].empty()) stripe_refused_[s] = in.refused;
  }
  in.reset();  // leaves the window
  if (lane_spin_ns_ > 0) {  // the next hand-offs: lane 0 applies this put and admits the next one's stripes
    int64_t until = steady_ns() + lane_spin_ns_;
    lane_workers_[lane_of(c) - 1]->spin_until_ns = until;
    lane0_spin_until_ns_.store(until, std::memory_order_relaxed);
  }
  uint64_t landed = stripes_landed_[s].fetch_add(1, std::memory_order_acq_rel) + 1;
  // The last stripe of the admitted put (no later one is admitted before it): lane 0 may wait.
  if (landed == stripes_admitted_[s].load(std::memory_order_acquire) * static_cast<uint64_t>(lanes_ - 1)) {
    wake_lane(0);
  }
}

bool Engine::striped_put_waits(int s, InConn& in) {
  uint64_t whole = stripes_admitted_[s].load(std::memory_order_relaxed) * static_cast<uint64_t>(lanes_ - 1);
  if (stripes_landed_[s].load(std::memory_order_acquire) < whole) {
    if (!lane0_held_[s]) held_.push_back(s);
    lane0_held_[s] = true;  // finish_landed_stripes() applies it once the last stripe landed
    return true;
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (in.refused.empty() && !stripe_refused_[s].empty()) in.refused = "part of " + stripe_refused_[s];
  stripe_refused_[s].clear();
  return false;
}

void Engine::finish_striped(int s) {
  InConn& in = *in_[s];
  lane0_held_[s] = false;
  striped_put_waits(s, in);
  on_put_done(s, in);
  in.reset();
}

void Engine::finish_landed_stripes() {
  for (size_t k = 0; k < held_.size();) {
    int s = held_[k];
    uint64_t whole = stripes_admitted_[s].load(std::memory_order_relaxed) * static_cast<uint64_t>(lanes_ - 1);
    if (stripes_landed_[s].load(std::memory_order_acquire) < whole) {
      ++k;
      continue;
    }
    held_[k] = held_.back();
    held_.pop_back();
    try {
      finish_striped(s);
    } catch (const std::exception& e) {
      in_[s]->closed = true;
      lose(peer_of(s), std::string("handling its frames failed: ") + e.what());
    }
  }
}

// ---------------------------------------------------------------- lane workers

void Engine::start_lane_workers() {
  for (int lane = 1; lane < lanes_; ++lane) {
    auto w = std::make_unique<LaneWorker>();
    w->lane = lane;
    w->wake_fd = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (w->wake_fd < 0) fail(Code::kSystem, -1, errno, who() + "eventfd for tcp lane " + std::to_string(lane));
    lane_workers_.push_back(std::move(w));
  }
  try {
    for (auto& w : lane_workers_) {
      LaneWorker* worker = w.get();
      w->thread = std::thread([this, worker] { run_lane(*worker); });
    }
  } catch (...) {  // a thread that could not be started: stop those that were
    stopping_ = true;
    join_lane_workers();
    throw;
  }
}

void Engine::join_lane_workers() {
  for (auto& w : lane_workers_) {
    if (!w->thread.joinable()) continue;
    wake_lane(w->lane);
    w->thread.join();
  }
}

void Engine::wake_lane(int lane) {
  int fd = lane == 0 ? wake_fd_ : lane_workers_[lane - 1]->wake_fd;
  uint64_t one = 1;
  ssize_t n = ::write(fd, &one, sizeof(one));
  (void)n;
}

void Engine::wake_lanes() {
  for (auto& w : lane_workers_) wake_lane(w->lane);
}

bool Engine::owns_conn(int c) const {
  int lane = lane_of(c);
  if (lane == 0) return std::this_thread::get_id() == progress_tid_.load();
  return std::this_thread::get_id() == lane_workers_[lane - 1]->tid.load();
}

uint8_t* Engine::discard_for(int c, size_t* size) {
  std::vector<uint8_t>& sink = lane_of(c) == 0 ? discard_ : lane_workers_[lane_of(c) - 1]->discard;
  *size = sink.size();
  return sink.data();
}

void Engine::on_waiting_close(int c) {
  InConn& in = *in_[c];
  if (in.st != InConn::kPayload || lane_seq_[c] <= stripes_admitted_[base_slot(c)].load(std::memory_order_acquire)) {
    return;  // admitted meanwhile: read_some() reads on, and sees the close after the stripe
  }
  in.hup = true;  // reported at every poll from now on: not polled for it again
  int buffered = 0;
  if (::ioctl(conns_->recv[c].get(), FIONREAD, &buffered) != 0) buffered = 0;
  buffered += static_cast<int>(in.buffered());  // read ahead already
  if (static_cast<uint64_t>(buffered) >= in.remaining) return;  // the stripe is whole: read once admitted
  in.closed = true;
  lose(peer_of(c), "its connection" + conn_name(c) + " closed before its goodbye, " +
                       std::to_string(in.remaining - static_cast<uint64_t>(buffered)) +
                       " bytes short of the stripe it was sending");
}

// Like run(): a worker never ends before stop(); what a peer's frames throw fails that peer.
void Engine::run_lane(LaneWorker& w) {
  w.tid.store(std::this_thread::get_id());
  while (!stopping_) {
    try {
      poll_lane(w);
    } catch (const std::exception& e) {
      FXM_WARN(rank_, "tcp lane " + std::to_string(w.lane) + " thread: " + e.what() + " (retrying)");
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }
}

void Engine::poll_lane(LaneWorker& w) {
  std::vector<pollfd> fds{{w.wake_fd, POLLIN, 0}};
  std::vector<int> owner{-1};  // connection c: its send side; -2 - c: its receive side
  int first = w.lane * total_;
  bool ahead = false;  // some connection holds frames read ahead: no poll reports those
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (int c = first; c < first + total_; ++c) {
      if (!out_[c].empty()) {
        fds.push_back({conns_->send[c].get(), POLLOUT, 0});
        owner.push_back(c);
      }
      if (lane_readable(c)) {  // else closed, or its stripe waits for lane 0
        fds.push_back({conns_->recv[c].get(), POLLIN, 0});
        owner.push_back(-2 - c);
        ahead = ahead || in_[c]->buffered() > 0;
      } else if (!in_[c]->closed && !in_[c]->hup) {  // waits: a close is still seen (on_waiting_close)
        fds.push_back({conns_->recv[c].get(), POLLRDHUP, 0});
        owner.push_back(-2 - c);
      }
    }
  }
  bool spin = !ahead && lane_spinning(w.spin_until_ns);
  ::poll(fds.data(), fds.size(), ahead || spin ? 0 : 100);
  if (spin) std::this_thread::yield();
  for (size_t k = 1; k < fds.size(); ++k) {
    if (owner[k] <= -2 && fds[k].events == POLLIN && in_[-2 - owner[k]]->buffered() > 0) fds[k].revents |= POLLIN;
    if (fds[k].revents == 0) continue;
    if (owner[k] <= -2 && fds[k].events == POLLRDHUP) on_waiting_close(-2 - owner[k]);
    else if (owner[k] <= -2) read_guarded(-2 - owner[k]);
    else write_guarded(owner[k]);
  }
  if (fds[0].revents) {
    uint64_t v;
    ssize_t n = ::read(w.wake_fd, &v, sizeof(v));
    (void)n;
  }
  for (int c = first; c < first + total_; ++c) {  // what was queued meanwhile, and lost peers' queues
    bool pending;
    {
      std::lock_guard<std::mutex> lock(mu_);
      pending = !out_[c].empty();
    }
    if (pending) write_guarded(c);
  }
}

}  // namespace fxm
