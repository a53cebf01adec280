// Lanes of the progress engine: with FLAGCX_MESH_TCP_LANES > 1 each (peer, context) has that
// many send and receive connections, built by the same handshake (wire context ctx + lane *
// contexts). Lane 0 carries every frame as before; the other lanes carry only the stripes of
// large puts (kStripe) and their goodbye.
//
// Threads. The progress thread owns lane 0 of every slot. Lane k >= 1 of every slot is owned by
// lane worker k - 1 (LaneWorker: its own eventfd and poll loop), the only thread that reads and
// writes those connections once the engine runs, so the kernel copies of a striped put run on
// as many cores as there are lanes. What they share: the queues (under mu_, as for lane 0),
// window entry (atomic), per slot stripes_admitted_ (progress thread -> workers) and per
// connection lane_landed_, the number of the last stripe it landed (workers -> progress thread),
// each woken through the other's eventfd.
//
// Order across lanes is kept at the target (progress_admit.cc). A striped put's lane-0 part
// (kPut + kPutStriped) admits the put; a stripe (numbered per slot) is not read past its header
// until its put was admitted, so it cannot overtake an earlier op of lane 0. While stripes are
// landing, lane 0 reads on into the next frame's headers but acts on it only when it is the
// head of a striped put of the same layout (window, offset, lane-0 length, lanes; at most
// kMaxAdmitted admitted): its stripes are admitted at once and land right after their
// predecessors on each lane (a stripe that covers other bytes than its lane's previous one
// waits until every lane landed the put before). Any other frame (a put to the same bytes, a
// signal, a get, a message) waits at its op header until every held put was applied, so none
// overtakes a stripe. Put n is applied once every lane landed its stripe n, in order, by the
// reader of lane 0: its signal (after every stripe's bytes: the workers' stores are released,
// its loads acquire them), then its ack. A lane that dies loses the peer (PeerLost naming it
// and the lane), so no striped put completes half.
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
#include "base/thread_name.h"
#include "core/progress_items.h"

namespace fxm {

using wire::FrameType;

bool Engine::lane_spinning(int64_t until_ns) const { return until_ns > 0 && steady_ns() < until_ns; }

std::string Engine::conn_name(int c) const {
  return lane_of(c) == 0 ? "" : " (tcp lane " + std::to_string(lane_of(c)) + ")";
}

template <typename Stripe>
void Engine::queue_striped(int peer, int ctx, OutItem head, const Stripe& stripe) {
  int s = slot(peer, ctx);
  {
    // One critical section: the parts of consecutive striped ops queue in one order on every lane.
    std::lock_guard<std::mutex> lock(mu_);
    ++outstanding_[s];
    in_flight_kind_[s] = PathKind::kTcp;
    ++acks_due_[s];
    issued_[peer].fetch_add(1);
    uint64_t number = ++stripe_seq_[s];
    out_[s].push_back(std::move(head));
    for (int k = 1; k < lanes_; ++k) out_[k * total_ + s].push_back(stripe(k, number));
  }
  if (std::this_thread::get_id() != progress_tid_.load()) wake();
  wake_lanes();
}

void Engine::post_striped(int peer, int ctx, const uint8_t* src, uint64_t len, uint32_t dst_win, uint64_t dst_off,
                          const SignalSpec& sig) {
  uint64_t part = wire::stripe_part(len, lanes_), first = wire::stripe_first(len, lanes_);
  wire::PutHeader h = put_header(dst_win, dst_off, sig);
  h.flags |= wire::kPutStriped;
  h.pad = static_cast<uint32_t>(lanes_ - 1);
  OutItem head{frame(FrameType::kPut, &h, first), src, first, 0, 0};
  queue_striped(peer, ctx, std::move(head), [&](int k, uint64_t number) {
    uint64_t at = first + (k - 1) * part;
    wire::PutHeader p;
    p.dst_win = dst_win;
    p.dst_off = dst_off + at;
    p.sig_slot = number;
    return OutItem{frame(FrameType::kStripe, &p, part), src + at, part, 0, 0};
  });
}

void Engine::post_striped_blocks(int peer, int ctx, const std::vector<wire::BlockEntry>& blocks, uint64_t bytes,
                                 const AttachPart& attach) {
  uint64_t part = wire::stripe_part(bytes, lanes_), first = wire::stripe_first(bytes, lanes_);
  OutItem head = blocks_item(blocks, bytes, first, wire::kBlocksStriped | static_cast<uint32_t>(lanes_ - 1) << 8);
  attach(&head, 0, 0, first);
  queue_striped(peer, ctx, std::move(head), [&](int k, uint64_t number) {
    uint64_t at = first + (k - 1) * part;
    wire::PutHeader p;
    p.dst_off = at;
    p.sig_slot = number;
    p.flags = wire::kStripeOfBlocks;
    OutItem it{frame(FrameType::kStripe, &p, part), nullptr, part, 0, 0};
    attach(&it, k, at, part);
    return it;
  });
}

bool Engine::lane_readable(int c) const {
  const InConn& in = *in_[c];
  if (in.closed) return false;
  if (c < total_) return mailbox_bytes_[c] < max_unreceived_ && !lane0_held_[c];
  return !stripe_waits(c);
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
      w->thread = std::thread([this, worker] {
        name_this_thread("fxm-lane");
        run_lane(*worker);
      });
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
  if (!stripe_waits(c)) return;  // free to go meanwhile: read_some() reads on, and sees the close after the stripe
  in.hup = true;  // reported at every poll from now on: not polled for it again
  int buffered = 0;
  if (::ioctl(conns_->recv[c].get(), FIONREAD, &buffered) != 0) buffered = 0;
  buffered += static_cast<int>(in.buffered());  // read ahead already
  if (static_cast<uint64_t>(buffered) >= in.remaining) return;  // the stripe is whole: read once admitted
  in.closed = true;
  lose(peer_of(c), "its connection" + conn_name(c) + " closed before its goodbye, " +
                       std::to_string(in.remaining - static_cast<uint64_t>(buffered)) +
                       " bytes short of the stripe it was sending");
  in.reset();  // leaves the window it entered
}

// Like run(): a worker never ends before stop(); what a peer's frames throw fails that peer.
void Engine::run_lane(LaneWorker& w) {
  w.tid.store(std::this_thread::get_id());
  while (!stopping_) {
    try {
      poll_lane(w);
    } catch (const std::exception& e) {
      FXM_ENGINE_LOG(::fxm::LogLevel::kWarn, "tcp lane " + std::to_string(w.lane) + " thread: " + e.what() + " (retrying)");
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }
}

void Engine::poll_lane(LaneWorker& w) {
  std::vector<pollfd> fds{{w.wake_fd, POLLIN, 0}};
  std::vector<int> owner{-1};  // connection c: its send side; -2 - c: its receive side
  int first = w.lane * total_;
  bool ahead = false;  // some connection holds frames read ahead: no poll reports those
  std::vector<int> dropped;  // stripes that wait for a lost peer: they never land
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (int c = first; c < first + total_; ++c) {
      if (!in_[c]->closed && !lost_[peer_of(c)].empty() && stripe_waits(c)) dropped.push_back(c);
      if (!out_[c].empty() && !waiting_for_staging(c)) {  // else the part's filler wakes the lane
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
  for (int c : dropped) {  // their windows are left, so that they can be deregistered
    in_[c]->closed = true;
    in_[c]->reset();
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
