#include "core/progress.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "base/env.h"
#include "base/log.h"
#include "core/progress_items.h"
#include "transport/signal_ops.h"
#include "base/status.h"

namespace fxm {

using wire::FrameType;

namespace {

size_t op_header_size(FrameType t) {
  switch (t) {
    case FrameType::kPut: return sizeof(wire::PutHeader);
    case FrameType::kGetReq: return sizeof(wire::GetHeader);
    case FrameType::kGetResp:
    case FrameType::kAck:
    case FrameType::kRefused: return 8;
    default: return 0;
  }
}


// Counts a thread that waits on the completion counters for as long as it is in scope.
class CountWaiter {
 public:
  explicit CountWaiter(std::atomic<int>* n) : n_(n) { n_->fetch_add(1); }
  ~CountWaiter() { n_->fetch_sub(1); }
  CountWaiter(const CountWaiter&) = delete;
  CountWaiter& operator=(const CountWaiter&) = delete;

 private:
  std::atomic<int>* n_;
};

}  // namespace

Engine::Engine(int rank, int nranks, int ncontexts, Connections* conns, WindowTable* windows,
               uint64_t max_unreceived)
    : rank_(rank), nranks_(nranks), ncontexts_(ncontexts), conns_(conns), windows_(windows),
      out_(nranks * ncontexts), mailbox_(nranks * ncontexts), mailbox_bytes_(nranks * ncontexts),
      max_unreceived_(max_unreceived), outstanding_(nranks * ncontexts), acks_due_(nranks * ncontexts),
      in_flight_kind_(nranks * ncontexts, PathKind::kTcp), probes_(nranks * ncontexts), refused_(nranks),
      queued_msg_(nranks * ncontexts), get_bytes_(nranks * ncontexts), answer_bytes_(nranks * ncontexts),
      applied_(nranks * ncontexts), acked_out_(nranks * ncontexts), acked_in_(nranks * ncontexts),
      lost_(nranks), bye_conn_(nranks * ncontexts), bye_count_(nranks), bye_(nranks), issued_(nranks),
      done_(nranks) {
  for (int s = 0; s < nranks * ncontexts; ++s) {
    in_.push_back(std::make_unique<InConn>());
    write_mu_.push_back(std::make_unique<std::mutex>());
  }
  wake_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (wake_fd_ < 0) fail(Code::kSystem, -1, errno, who() + "eventfd for the progress thread");
  thread_ = std::thread([this] { run(); });
}

Engine::~Engine() {
  stop();
  if (wake_fd_ >= 0) ::close(wake_fd_);
}

void Engine::wake() {
  uint64_t one = 1;
  ssize_t n = ::write(wake_fd_, &one, sizeof(one));
  (void)n;
}

void Engine::enqueue(int s, OutItem&& item, Count counted) {
  bool idle;
  {
    std::lock_guard<std::mutex> lock(mu_);
    int peer = s / ncontexts_;
    if (counted != Count::kNone) {  // before any byte leaves: the ack may come back at once
      ++outstanding_[s];
      in_flight_kind_[s] = PathKind::kTcp;
      if (counted == Count::kPut) ++acks_due_[s];
      issued_[peer].fetch_add(1);
    }
    idle = out_[s].empty();
    if (!idle) out_[s].push_back(std::move(item));
  }
  if (idle && send_direct(s, item)) return;
  // The progress thread queues only from poll_once(), whose write_pending() sends it before the next
  // poll: waking itself through the eventfd would cost a write and an extra pass for nothing.
  if (std::this_thread::get_id() != progress_tid_.load()) wake();
}

bool Engine::send_direct(int s, OutItem& item) {
  std::unique_lock<std::mutex> writer(*write_mu_[s], std::try_to_lock);
  if (!writer.owns_lock() || std::this_thread::get_id() == progress_tid_.load()) {
    std::lock_guard<std::mutex> lock(mu_);
    out_[s].push_back(std::move(item));
    return false;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!out_[s].empty()) {  // someone queued meanwhile: keep the order
      out_[s].push_back(std::move(item));
      return false;
    }
  }
  ssize_t n = send_item(s, item);
  if (n >= 0 && item.sent == item.total()) return true;
  std::lock_guard<std::mutex> lock(mu_);
  if (n >= 0) out_[s].push_front(std::move(item));  // started on the wire: it goes first
  return false;
}

ssize_t Engine::send_item(int s, OutItem& it) {
  iovec iov[2];
  int n = 0;
  uint64_t hs = it.head.size();
  if (it.sent < hs) iov[n++] = {it.head.data() + it.sent, hs - it.sent};
  if (it.len > 0) {
    uint64_t off = it.sent > hs ? it.sent - hs : 0;
    iov[n++] = {const_cast<uint8_t*>(it.data) + off, it.len - off};
  }
  msghdr mh{};
  mh.msg_iov = iov;
  mh.msg_iovlen = n;
  while (true) {
    ssize_t w = ::sendmsg(conns_->send[s].get(), &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w >= 0) {
      it.sent += static_cast<uint64_t>(w);
      return w;
    }
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
    lose(s / ncontexts_, "writing to its connection failed: " + errno_text(errno));
    return -1;
  }
}

namespace {

wire::PutHeader put_header(uint32_t dst_win, uint64_t dst_off, const SignalSpec& sig) {
  wire::PutHeader h;
  h.dst_win = dst_win;
  h.dst_off = dst_off;
  if (sig.on) {
    h.flags = wire::kPutHasSignal | (sig.set ? wire::kPutSignalSet : 0);
    h.sig_win = sig.win;
    h.sig_slot = sig.slot;
    h.sig_val = sig.value;
  }
  return h;
}

}  // namespace

void Engine::post_put(int peer, int ctx, const uint8_t* src, uint64_t len, uint32_t dst_win,
                      uint64_t dst_off, const SignalSpec& sig) {
  wire::PutHeader h = put_header(dst_win, dst_off, sig);
  OutItem it{frame(FrameType::kPut, &h, len), src, len, 0, 0};
  enqueue(slot(peer, ctx), std::move(it), Count::kPut);
}

void Engine::post_put_owned(int peer, int ctx, std::shared_ptr<uint8_t> bytes, uint64_t len, uint32_t dst_win,
                            uint64_t dst_off, const SignalSpec& sig) {
  wire::PutHeader h = put_header(dst_win, dst_off, sig);
  OutItem it{frame(FrameType::kPut, &h, len), bytes.get(), len, 0, 0};
  it.owned = std::move(bytes);  // sent from where it is, freed with the item
  enqueue(slot(peer, ctx), std::move(it), Count::kPut);
}

void Engine::post_get(int peer, int ctx, uint32_t src_win, uint64_t src_off, uint8_t* dst,
                      uint64_t len) {
  wire::GetHeader g;
  g.src_win = src_win;
  g.src_off = src_off;
  g.size = len;
  int s = slot(peer, ctx);
  {
    std::unique_lock<std::mutex> lock(mu_);
    wait_get_credit(lock, peer, s, len);
    get_bytes_[s] += len;
    g.req_id = next_req_++;
    gets_[g.req_id] = {peer, ctx, dst, len};
  }
  enqueue(s, {frame(FrameType::kGetReq, &g, 0), nullptr, 0, 0, 0}, Count::kGet);
}

void Engine::wait_get_credit(std::unique_lock<std::mutex>& lock, int peer, int s, uint64_t len) {
  Deadline deadline = Deadline::after_seconds(env_config().timeout_s);
  while (get_bytes_[s] > 0 && get_bytes_[s] + len > kMaxGetBytesInFlight) {
    std::string what = who() + "get of " + std::to_string(len) + " bytes from peer " + std::to_string(peer);
    if (stopping_) fail(Code::kClosed, peer, 0, what + ": the mesh was closed");
    fail_if_gone(peer, what + ": ");
    if (deadline.expired()) {
      fail(Code::kTimeout, peer, 0, what + ": timed out waiting for " + std::to_string(get_bytes_[s]) +
                                        " bytes of earlier gets to be answered (is the peer progressing?)");
    }
    cv_.wait_until(lock, deadline.min(Deadline::after_seconds(0.1)).at());
  }
}

void Engine::drop_get(std::map<uint64_t, PendingGet>::iterator* it) {
  get_bytes_[slot((*it)->second.peer, (*it)->second.ctx)] -= (*it)->second.len;
  *it = gets_.erase(*it);
  cv_.notify_all();
}

bool Engine::in_flight(int peer, int ctx, const char* op, PathKind* kind) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (!lost_[peer].empty() || bye_[peer]) {  // the hot path builds no text
    fail_if_gone(peer, who() + op + " to peer " + std::to_string(peer) + ": ");
  }
  *kind = in_flight_kind_[slot(peer, ctx)];
  return outstanding_[slot(peer, ctx)] != 0;
}

void Engine::wait_idle(int peer, int ctx, const Deadline& deadline) {
  std::unique_lock<std::mutex> lock(mu_);
  while (outstanding_[slot(peer, ctx)] != 0) {
    if (!lost_[peer].empty() || bye_[peer] || deadline.expired()) {
      if (settle_probes(lock)) continue;
      lock.unlock();
      fail_wait(peer, "an op waiting for earlier ops to its pair", deadline);
    }
    if (stopping_) fail(Code::kClosed, peer, 0, who() + "the mesh was closed");
    wait_or_poll(lock, deadline);
  }
}

void Engine::issued(int peer, int ctx, PathKind kind) {
  std::lock_guard<std::mutex> lock(mu_);
  ++outstanding_[slot(peer, ctx)];
  in_flight_kind_[slot(peer, ctx)] = kind;
  issued_[peer].fetch_add(1);
  stream_ops_.fetch_add(1);
}

bool Engine::wait_stream_ops(const Deadline& deadline) {
  while (stream_ops_.load() > 0) {
    if (deadline.expired()) return false;
    if (!poll_probes()) std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  return true;
}

void Engine::issued_probe(int peer, int ctx, PathKind kind, std::unique_ptr<CompletionProbe> probe) {
  issued(peer, ctx, kind);
  std::lock_guard<std::mutex> lock(probe_mu_);
  probes_[slot(peer, ctx)].push_back(std::move(probe));
  probes_pending_.fetch_add(1);
}

// A probe that throws (no driver context any more) counts as done: its error is in the log.
bool Engine::probe_done(CompletionProbe& p) {
  try {
    return p.done();
  } catch (const Error& e) {
    FXM_WARN(rank_, std::string("polling a device op: ") + e.what());
    return true;
  }
}

bool Engine::poll_probes() {
  if (probes_pending_.load() == 0) return false;
  std::vector<std::pair<int, std::string>> done;  // (slot, error) per completed op, in order
  {
    std::lock_guard<std::mutex> lock(probe_mu_);
    for (size_t s = 0; s < probes_.size(); ++s) {
      while (!probes_[s].empty() && probe_done(*probes_[s].front())) {
        done.push_back({static_cast<int>(s), probes_[s].front()->error()});
        probes_[s].pop_front();
      }
    }
  }
  probes_pending_.fetch_sub(static_cast<int64_t>(done.size()));
  for (auto& [s, error] : done) completed(s / ncontexts_, s % ncontexts_, error);
  return !done.empty();
}

// Before a waiter fails (a peer gone, the deadline): the device ops it waits
// for may be done without anyone having polled them. True when polling
// completed some (the caller checks again).
bool Engine::settle_probes(std::unique_lock<std::mutex>& lock) {
  if (probes_pending_.load() == 0) return false;
  lock.unlock();
  bool some = poll_probes();
  lock.lock();
  return some;
}

// Sleeps on the condition variable, or, while probed ops are pending, polls them.
void Engine::wait_or_poll(std::unique_lock<std::mutex>& lock, const Deadline& deadline) {
  if (probes_pending_.load() == 0) {
    cv_.wait_until(lock, deadline.min(Deadline::after_seconds(0.1)).at());
    return;
  }
  lock.unlock();
  if (!poll_probes()) std::this_thread::sleep_for(std::chrono::microseconds(5));
  lock.lock();
}

void Engine::completed(int peer, int ctx, const std::string& error) {
  if (!error.empty()) {
    std::lock_guard<std::mutex> lock(mu_);
    if (refused_[peer].empty()) refused_[peer] = "an op to peer " + std::to_string(peer) + " failed: " + error;
  }
  complete(peer, ctx, 1);
  stream_ops_.fetch_sub(1);
}

void Engine::post_message(int peer, int ctx, const void* data, uint64_t len, const Deadline& deadline) {
  int s = slot(peer, ctx);
  if (len > kMaxMessageBytes) {
    fail(Code::kInvalidArgument, peer, 0, who() + "send to peer " + std::to_string(peer) + ": " +
                                              std::to_string(len) + " bytes exceed the message limit of " +
                                              std::to_string(kMaxMessageBytes) + " (use a window and put)");
  }
  OutItem it{frame<wire::PutHeader>(FrameType::kMessage, nullptr, len), nullptr, 0, 0, len};
  const uint8_t* p = static_cast<const uint8_t*>(data);
  it.head.insert(it.head.end(), p, p + len);
  std::unique_lock<std::mutex> lock(mu_);
  std::string what = who() + "send to peer " + std::to_string(peer) + " (ctx " + std::to_string(ctx) + ")";
  while (queued_msg_[s] > 0 && queued_msg_[s] + len > kMaxQueuedMessageBytes) {
    if (!lost_[peer].empty() || bye_[peer] || stopping_) break;
    if (deadline.expired()) {
      fail(Code::kTimeout, peer, 0, what + ": timed out waiting for " + std::to_string(queued_msg_[s]) +
                                        " queued bytes to drain (is the peer receiving?)");
    }
    cv_.wait_until(lock, deadline.min(Deadline::after_seconds(0.1)).at());
  }
  if (stopping_) fail(Code::kClosed, peer, 0, what + ": the mesh was closed");
  fail_if_gone(peer, what + ": ");
  queued_msg_[s] += len;
  out_[s].push_back(std::move(it));
  lock.unlock();
  wake();
}

std::vector<uint8_t> Engine::recv_message(int peer, int ctx, const Deadline& deadline) {
  std::unique_lock<std::mutex> lock(mu_);
  auto& box = mailbox_[slot(peer, ctx)];
  while (box.empty()) {
    if (stopping_) fail(Code::kClosed, peer, 0, who() + "recv: the mesh was closed");
    if (!lost_[peer].empty() || bye_conn_[slot(peer, ctx)]) break;  // nothing more will come
    if (deadline.expired()) break;
    cv_.wait_until(lock, deadline.min(Deadline::after_seconds(0.1)).at());
  }
  if (!box.empty()) {
    std::vector<uint8_t> m = std::move(box.front());
    box.pop_front();
    uint64_t& queued = mailbox_bytes_[slot(peer, ctx)];
    bool was_paused = queued >= max_unreceived_;
    queued -= m.size();
    if (was_paused && queued < max_unreceived_) wake();  // resume reading that connection
    return m;
  }
  std::string what = who() + "recv from peer " + std::to_string(peer) + " (ctx " + std::to_string(ctx) + ")";
  if (!lost_[peer].empty()) fail(Code::kPeerLost, peer, 0, what + ": " + lost_[peer]);
  if (bye_conn_[slot(peer, ctx)]) {
    fail(Code::kPeerLost, peer, 0, what + ": peer " + std::to_string(peer) + " closed its mesh");
  }
  fail(Code::kTimeout, peer, 0, what + ": timed out");
}

void Engine::count_inline(int peer, uint64_t n) {
  issued_[peer].fetch_add(n);
  done_[peer].fetch_add(n);
  completed_all_.fetch_add(n);
  // A waiter counts itself (seq_cst) before it tests the counters under mu_: either it sees
  // the additions above, or this sees it and, through mu_, notifies only once it sleeps.
  if (count_waiters_.load() == 0) return;
  { std::lock_guard<std::mutex> lock(mu_); }
  cv_.notify_all();
}

void Engine::complete(int peer, int ctx, uint64_t n) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    outstanding_[slot(peer, ctx)] -= n;
    done_[peer].fetch_add(n);
    completed_all_.fetch_add(n);
  }
  cv_.notify_all();
}

void Engine::fail_if_gone(int peer, const std::string& what) const {
  if (!lost_[peer].empty()) fail(Code::kPeerLost, peer, 0, what + lost_[peer]);
  if (bye_[peer]) fail(Code::kPeerLost, peer, 0, what + "peer " + std::to_string(peer) + " closed its mesh");
}

std::string Engine::lost_reason(int peer) const {
  std::lock_guard<std::mutex> lock(mu_);
  return lost_[peer];
}

int Engine::first_lost_peer() const {
  std::lock_guard<std::mutex> lock(mu_);
  for (int p = 0; p < nranks_; ++p) {
    if (!lost_[p].empty()) return p;
  }
  return -1;
}

void Engine::wait_counter(uint64_t value, const Deadline& deadline) {
  std::unique_lock<std::mutex> lock(mu_);
  CountWaiter counted(&count_waiters_);
  while (completed_all_.load() < value) {
    for (int p = 0; p < nranks_; ++p) {
      if ((!lost_[p].empty() || bye_[p]) && done_[p].load() != issued_[p].load() && !settle_probes(lock)) {
        lock.unlock();
        fail_wait(p, "wait_counter", deadline);
      }
    }
    if (stopping_) fail(Code::kClosed, -1, 0, who() + "wait_counter: the mesh was closed");
    if (deadline.expired()) {
      fail(Code::kTimeout, -1, 0, who() + "wait_counter(" + std::to_string(value) + ") timed out at " +
                                      std::to_string(completed_all_.load()) + " completed ops");
    }
    wait_or_poll(lock, deadline);
  }
  fail_if_refused(0, nranks_, "wait_counter");
}

void Engine::flush(int peer, const Deadline& deadline, bool report_refused) {
  int lo = peer < 0 ? 0 : peer, hi = peer < 0 ? nranks_ : peer + 1;
  std::unique_lock<std::mutex> lock(mu_);
  CountWaiter counted(&count_waiters_);
  for (int p = lo; p < hi; ++p) {
    while (done_[p].load() != issued_[p].load()) {
      if (!lost_[p].empty() || bye_[p] || deadline.expired()) {
        if (settle_probes(lock)) continue;
        lock.unlock();
        fail_wait(p, "flush", deadline);
      }
      if (stopping_) fail(Code::kClosed, p, 0, who() + "flush: the mesh was closed");
      wait_or_poll(lock, deadline);
    }
  }
  if (report_refused) fail_if_refused(lo, hi, "flush");
}

void Engine::fail_wait(int peer, const char* doing, const Deadline& deadline) const {
  uint64_t left = issued_[peer].load() - done_[peer].load();
  std::string what = who() + doing + ": " + std::to_string(left) + " op(s) to peer " +
                     std::to_string(peer) + " not completed";
  std::string lost = lost_reason(peer);
  if (!lost.empty()) fail(Code::kPeerLost, peer, 0, what + ": " + lost);
  if (!deadline.expired()) fail(Code::kPeerLost, peer, 0, what + ": peer " + std::to_string(peer) + " closed its mesh");
  fail(Code::kTimeout, peer, 0, what + " before the deadline");
}

void Engine::lose(int peer, const std::string& why) {
  {
    // No get answer is landing once this returns (the progress thread lands
    // under landing_mu_ and, between reads, finds the get gone).
    std::unique_lock<std::mutex> landing(landing_mu_, std::defer_lock);
    if (std::this_thread::get_id() != progress_tid_.load()) landing.lock();
    std::lock_guard<std::mutex> lock(mu_);
    if (!lost_[peer].empty() || bye_[peer]) return;
    lost_[peer] = why;  // its queues are dropped by write_some(), which owns them
    for (auto it = gets_.begin(); it != gets_.end();) {
      if (it->second.peer == peer) drop_get(&it);
      else ++it;
    }
  }
  if (!stopping_) FXM_WARN(rank_, "peer " + std::to_string(peer) + " lost: " + why);
  cv_.notify_all();
}

void Engine::run() {
  progress_tid_.store(std::this_thread::get_id());
  try {
    while (!stopping_) poll_once();
  } catch (const std::exception& e) {  // never std::terminate the application
    for (int p = 0; p < nranks_; ++p) lose(p, std::string("progress thread failed: ") + e.what());
  }
}

void Engine::poll_once() {
  std::vector<pollfd> fds{{wake_fd_, POLLIN, 0}};
  std::vector<int> owner{-1};  // slot s: its send side; total + s: its receive side
  int total = nranks_ * ncontexts_;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (int s = 0; s < total; ++s) {
      if (!out_[s].empty()) {
        fds.push_back({conns_->send[s].get(), POLLOUT, 0});
        owner.push_back(s);
      }
      if (!in_[s]->closed && mailbox_bytes_[s] < max_unreceived_) {  // else paused: see recv_message
        fds.push_back({conns_->recv[s].get(), POLLIN, 0});
        owner.push_back(total + s);
      }
    }
  }
  ::poll(fds.data(), fds.size(), 100);
  for (size_t k = 1; k < fds.size(); ++k) {
    if (fds[k].revents == 0) continue;
    if (owner[k] >= total) read_some(owner[k] - total);
    else write_some(owner[k]);
  }
  if (fds[0].revents) {  // new work was queued: the write_pending() below starts it now
    uint64_t v;
    ssize_t n = ::read(wake_fd_, &v, sizeof(v));
    (void)n;
  }
  send_acks();
  write_pending();
}

void Engine::write_pending() {
  int total = nranks_ * ncontexts_;
  for (int s = 0; s < total; ++s) {
    bool pending;
    {
      std::lock_guard<std::mutex> lock(mu_);
      pending = !out_[s].empty();
    }
    if (pending) write_some(s);
  }
}

bool Engine::write_some(int s) {
  std::lock_guard<std::mutex> writer(*write_mu_[s]);
  while (true) {
    OutItem* it;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!lost_[s / ncontexts_].empty() || bye_[s / ncontexts_]) {  // nothing more goes to a lost/closed peer
        out_[s].clear();
        queued_msg_[s] = 0;
        answer_bytes_[s] = 0;
        cv_.notify_all();
      }
      if (out_[s].empty()) return true;
      it = &out_[s].front();
    }
    ssize_t w = send_item(s, *it);
    if (w < 0) return false;
    if (it->sent < it->total()) return true;  // the socket is full: wait for POLLOUT
    std::lock_guard<std::mutex> lock(mu_);
    queued_msg_[s] -= it->msg_bytes;
    answer_bytes_[s] -= it->answer_bytes;
    bool notify = stopping_ || it->msg_bytes > 0 || out_[s].size() == 1;
    out_[s].pop_front();
    if (notify) cv_.notify_all();
  }
}

void Engine::read_some(int s) {
  InConn& in = *in_[s];
  int fd = conns_->recv[s].get();
  size_t budget = 8u << 20;  // then let other connections have a turn
  while (budget > 0 && !in.closed) {
    uint8_t* where;
    size_t want;
    std::unique_lock<std::mutex> landing(landing_mu_, std::defer_lock);
    if (in.st == InConn::kPayload) {
      // A get answer lands in the user's buffer: lose() waits for this read to end.
      if (in.f.type == FrameType::kGetResp) landing.lock();
      want = static_cast<size_t>(std::min<uint64_t>(in.remaining, budget));
      where = landing_spot(in);
      if (!where) {
        where = discard_.data();
        want = std::min(want, discard_.size());
      }
    } else {
      where = in.buf + in.got;
      want = in.need - in.got;
    }
    tcp::IoResult r = tcp::read_some(fd, where, want);
    if (landing.owns_lock()) landing.unlock();
    if (!r.ok()) {
      in.closed = true;
      int peer = s / ncontexts_;
      bool clean;
      {
        std::lock_guard<std::mutex> lock(mu_);
        clean = bye_conn_[s];
      }
      // Without its goodbye: a close that gave up on unsent frames (1 s) looks the same as an end.
      if (!clean) {
        lose(peer, "its connection closed before its goodbye (" + r.describe() +
                       "): its process ended, or it closed its mesh before the frames queued to this rank were sent");
      }
      in.reset();
      cv_.notify_all();
      return;
    }
    if (r.done == 0) return;
    budget -= std::min(budget, r.done);
    if (in.st == InConn::kPayload) {
      in.remaining -= r.done;
      if (in.remaining == 0) on_payload_done(s, in);
    } else if ((in.got += r.done) == in.need) {
      if (in.st == InConn::kHeader) on_header(s, in);
      else on_op_header(s, in);
    }
  }
}

void Engine::on_header(int s, InConn& in) {
  if (!wire::decode_frame(in.buf, &in.f)) {
    lose(s / ncontexts_, "protocol error: a malformed frame arrived");
    in.closed = true;
    return;
  }
  size_t oplen = op_header_size(in.f.type);
  bool fixed = in.f.type == FrameType::kAck || in.f.type == FrameType::kBye || in.f.type == FrameType::kGetReq;
  if (in.f.length < oplen || (fixed && in.f.length != oplen)) {
    lose(s / ncontexts_, "protocol error: a frame whose length does not fit its type");
    in.closed = true;
    return;
  }
  in.st = InConn::kOpHeader;
  in.got = 0;
  in.need = oplen;
  if (oplen == 0) on_op_header(s, in);
}

void Engine::on_op_header(int s, InConn& in) {
  int peer = s / ncontexts_;
  uint64_t payload = in.f.length - in.need;
  in.dst = nullptr;
  switch (in.f.type) {
    case FrameType::kMessage:
      if (payload > kMaxMessageBytes) {
        lose(peer, "protocol error: a " + std::to_string(payload) + "-byte message frame");
        in.closed = true;
        return;
      }
      in.msg.assign(payload, 0);
      in.dst = in.msg.data();
      break;
    case FrameType::kPut:
      on_put_header(s, in, payload);
      break;
    case FrameType::kGetReq: {
      wire::GetHeader g;
      std::memcpy(&g, in.buf, sizeof(g));
      on_get_request(s, g);
      in.reset();
      return;
    }
    case FrameType::kGetResp:
      on_get_answer(s, in, payload);
      if (in.closed) return;
      break;
    case FrameType::kRefused:
      if (payload > wire::kMaxRefusedText) {
        lose(peer, "protocol error: a " + std::to_string(payload) + "-byte refusal");
        in.closed = true;
        return;
      }
      in.msg.assign(payload, 0);
      in.dst = in.msg.data();
      break;
    case FrameType::kAck:
      if (on_ack(s, in.buf)) in.reset();
      return;
    case FrameType::kBye: {
      std::lock_guard<std::mutex> lock(mu_);
      bye_conn_[s] = true;
      if (++bye_count_[peer] == ncontexts_) bye_[peer] = true;
      // Waits on this peer now fail ("closed its mesh"): an answer it still sends after its
      // goodbye must not land in a buffer its get's caller was told is given up.
      for (auto it = gets_.begin(); it != gets_.end();) {
        if (slot(it->second.peer, it->second.ctx) == s) drop_get(&it);
        else ++it;
      }
      in.reset();
      return;
    }
    default:
      lose(peer, "protocol error: unknown frame type " + std::to_string(static_cast<int>(in.f.type)));
      in.closed = true;
      return;
  }
  in.st = InConn::kPayload;
  in.total = in.remaining = payload;
  if (payload == 0) on_payload_done(s, in);
}

void Engine::send_acks() {
  int total = nranks_ * ncontexts_;
  for (int s = 0; s < total; ++s) {
    if (applied_[s] == acked_out_[s]) continue;
    acked_out_[s] = applied_[s];
    uint64_t v = applied_[s];
    enqueue(s, {frame(FrameType::kAck, &v, 0), nullptr, 0, 0, 0}, Count::kNone);
  }
}

void Engine::stop() {
  if (!thread_.joinable()) return;
  int total = nranks_ * ncontexts_;
  for (int s = 0; s < total; ++s) {
    enqueue(s, {frame<wire::PutHeader>(FrameType::kBye, nullptr, 0), nullptr, 0, 0, 0}, Count::kNone);
  }
  {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_for(lock, std::chrono::seconds(1), [&] {
      for (int s = 0; s < total; ++s) {
        if (!out_[s].empty() && lost_[s / ncontexts_].empty() && !bye_[s / ncontexts_]) return false;
      }
      return true;
    });
    stopping_ = true;
  }
  wake();
  thread_.join();
  cv_.notify_all();
}

}  // namespace fxm
