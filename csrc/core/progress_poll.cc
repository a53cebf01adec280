// The progress thread's pass over lane 0, and waiters that read lane 0 themselves.
//
// The read role. Whoever reads a lane-0 receive connection holds read_mu_: the progress thread
// for its read phase (with the acks it then sends and the striped puts it applies), or a thread
// waiting in wait_signal, flush, wait_counter, for an op's pair or (an agent's connection) for a
// notification (help_read), which takes it only
// when it is free (try_lock) and never while it holds mu_. Everything only the reader touches
// (the connections' InConn, applied_ and the ack state, held_) is touched under it.
//
// Why waiters read. Over tcp a put_signal's signal is applied by whoever reads its frame. When
// that is the progress thread, each hop costs two wake-ups on the target (the progress thread,
// then the waiter); a waiter that reads the connection itself while it spins costs none. For the
// first kHelpSpin of a wait the waiter reads (non-blocking) and yields in turn; then it sleeps,
// and the progress thread does the work, as before.
//
// Parking. The progress thread polls the same connections, so the kernel wakes it too for every
// frame a waiter reads. Once waiters have read since its last pass (helped_ moved), it polls
// without the lane-0 receive connections for up to 1 ms (parked_); so does a pass that finds the
// read role taken (park_beside_reader). A waiter that read and then sleeps or pauses (also one
// whose spin ended in an earlier call that had read a frame) ends either at once and keeps it
// from parking again on that pass (unpark). A frame that no waiter is
// there to read (read_counter polled in a loop, say) may so wait up to 1 ms for the progress
// thread. mesh.stats() counts the parked polls and those a lost wake-up left to their timer.
//
// Frames left to the progress thread. With a device window on this rank, a waiter stops at a
// frame whose bytes go through staging buffers and device copies (a put, a batch, a get or its
// answer: progress_thread_frame) and leaves it to the progress thread: at its op header, which
// the progress thread then acts on as if it had read it itself (read_some), or in its payload,
// when the progress thread began it and the socket ran dry (or its read's budget ran out)
// before its end: the progress thread reads it to its end. Until then waiters skip that slot,
// and the progress thread does not park and takes the read role by waiting for it (left_count_),
// saying so (role_wanted_: waiters then take it no more, nor read past their current slot), and
// acts on the frame whatever the mailbox holds, reading on to the next frame's start at most;
// the waiter that left it gives up the role, then
// wakes the progress thread (which may be polling sockets this waiter just emptied). A poll
// that ran out its timer although a frame had been handed to it at its op header is a lost
// wake-up (late_wakes_).
#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <thread>

#include "base/clock.h"
#include "core/progress_items.h"

namespace fxm {

using wire::FrameType;

bool Engine::may_help() const { return !stopping_.load(std::memory_order_relaxed); }

// With a device window here: whether the payload of `in` may land through device copies (a put,
// a batch of writes or a get's answer) or be acted on through them once read (a batch of reads).
// Their windows are not looked up for it: host ones count too.
bool Engine::device_payload(const InConn& in) const {
  if (!windows_->has_device()) return false;
  switch (in.f.type) {
    case FrameType::kPut:
    case FrameType::kPutBlocks:
    case FrameType::kGetResp:
    case FrameType::kGetBlocks:
      return true;
    default:
      return false;
  }
}

// Whether frame `in` of lane-0 slot s (its op header read) is the progress thread's to act on:
// those above, a get (answered from its window through device copies), and a message while an
// answer to a get still streams (acting on it snapshots that answer's window).
bool Engine::progress_thread_frame(int s, const InConn& in) {
  if (device_payload(in) || (in.f.type == FrameType::kGetReq && windows_->has_device())) return true;
  if (in.f.type != FrameType::kMessage || !windows_->has_device()) return false;
  std::lock_guard<std::mutex> lock(mu_);
  return !open_answers_[s].empty();
}

void Engine::mark_left(int s, uint8_t how) {
  left_to_progress_[s] = how;
  ++left_marks_;
  left_count_.fetch_add(1);
  if (how != kLeftAtHeader) return;
  left_since_ns_.store(INT64_MAX, std::memory_order_relaxed);  // handed over once the waiter woke it (help_read)
  left_at_header_.fetch_add(1);
}

void Engine::clear_left(int s) {
  if (left_to_progress_[s] == kLeftAtHeader) left_at_header_.fetch_sub(1);
  left_to_progress_[s] = kNotLeft;
  left_count_.fetch_sub(1);
}

// A waiter at such a frame (on_op_header): lane 0 stops there for the progress thread.
bool Engine::leave_to_progress(int s, InConn& in) {
  if (s >= total_ || owns_conn(s) || !progress_thread_frame(s, in)) return false;
  mark_left(s, kLeftAtHeader);
  return true;
}

// read_some, a waiter: true when lane 0's frame is the progress thread's (left to it already,
// or one it began whose payload goes through device copies: left to it now).
bool Engine::waiter_stops(int s, const InConn& in) {
  if (left_to_progress_[s] != kNotLeft) return true;
  if (in.st != InConn::kPayload || !device_payload(in)) return false;
  mark_left(s, kLeftMidFrame);
  return true;
}

// read_some, the progress thread, at a slot left to it: acts on a frame left at its op header
// (true: the caller reads on from there); one left in its payload stays the progress thread's
// until its end (waiters stay away meanwhile).
bool Engine::take_back_left(int s, InConn& in) {
  uint8_t how = left_to_progress_[s];
  if (how == kNotLeft || (how == kLeftMidFrame && in.st == InConn::kPayload)) return false;
  clear_left(s);
  if (how != kLeftAtHeader) return false;
  on_op_header(s, in);
  return true;
}

// read_some, the progress thread, at a frame's start after a frame left to it: whether lane 0 of
// slot s waits for its mailbox to drain (as lane_readable says), which reading a left frame
// regardless of it must not overrun by more than that frame.
bool Engine::mailbox_full(int s) const {
  std::lock_guard<std::mutex> lock(mu_);
  return mailbox_bytes_[s] >= max_unreceived_;
}

// The progress thread (the role held): a slot left to it whose connection closed meanwhile is
// never read again; it no longer keeps waiters from the other slots.
void Engine::forget_closed_left() {
  if (left_count_.load() == 0) return;
  for (int s = 0; s < total_; ++s) {
    if (left_to_progress_[s] != kNotLeft && in_[s]->closed) clear_left(s);
  }
}

// A waiter counts its sleep before it looks at parked_; the progress thread sets parked_ before it
// looks at the count again (both seq_cst): either it sees the sleep and stays, or this sees it parked.
void Engine::unpark() {
  last_sleep_ns_.store(steady_ns(), std::memory_order_relaxed);
  sleeps_.fetch_add(1);
  if (parked_.exchange(false)) wake();
}

// A parked poll that ran out its timer (from poll_from_ns) woke late when a waiter went to sleep
// well before that timer was due: its unpark() should have ended the poll. A waiter that went to
// sleep only once the timer was due (the progress thread preempted after its poll, say) is not
// a lost wake-up. The last sleep's time stands for all since sleeps_before (one waiter sleeps at
// a time in the common case; a miss only undercounts).
namespace {
constexpr int64_t kTimerSlackNs = 200 * 1000;  // the kernel's timer slack and rounding, with room
}

bool Engine::woke_late(uint64_t sleeps_before, int64_t poll_from_ns, int timeout_ms) const {
  if (timeout_ms <= 0 || sleeps_.load() == sleeps_before) return false;
  return last_sleep_ns_.load(std::memory_order_relaxed) < poll_from_ns + timeout_ms * 1000000LL - kTimerSlackNs;
}

// An unparked poll that ran out its timer late for a frame a waiter left to it (at its op header)
// well before that timer was due: the waiter's wake did not reach it.
bool Engine::left_frame_waited(int64_t poll_from_ns, int timeout_ms) const {
  if (timeout_ms <= 0 || left_at_header_.load() == 0) return false;
  return left_since_ns_.load(std::memory_order_relaxed) < poll_from_ns + timeout_ms * 1000000LL - kTimerSlackNs;
}

// The read role is taken (a waiter reads lane 0 now): this pass polls without lane 0, parked as
// decide_park() parks, so that the waiter that stops reading and sleeps wakes it (unpark). Not
// parked when a waiter went to sleep since `sleeps_before` (it may not have seen parked_).
bool Engine::park_beside_reader(uint64_t sleeps_before) {
  parked_.store(true);
  if (sleeps_.load() == sleeps_before) return true;
  parked_.store(false);
  return false;
}

// After a pass: parked when waiters read since the last one and none went to sleep (one that
// sleeps waits for the progress thread to read its frame).
void Engine::decide_park() {
  uint64_t helped = helped_.load(std::memory_order_relaxed), sleeps = sleeps_.load();
  bool park = helped != helped_seen_ && sleeps == sleeps_seen_ && left_count_.load() == 0;
  helped_seen_ = helped;
  sleeps_seen_ = sleeps;
  if (!park) return;
  parked_.store(true);
  if (sleeps_.load() != sleeps) parked_.store(false);
}

// Lists the lane-0 receive connections the reader may read now (with mu_ held and the role).
// (A frame left to the progress thread is acted on at once, whatever the poll says and whatever
// the mailbox holds; waiters skip its slot.)
void Engine::readable_fds(std::vector<pollfd>* fds, std::vector<int>* owner, int tag, std::vector<int>* ahead,
                          bool waiter) const {
  for (int s = 0; s < total_; ++s) {
    bool left = left_to_progress_[s] != kNotLeft;
    if (!conns_->recv[s] || (left && waiter)) continue;
    bool left_open = left && !in_[s]->closed && !lane0_held_[s];
    if (!left_open && !lane_readable(s)) continue;  // else paused (recv_message), held or closed
    fds->push_back({conns_->recv[s].get(), POLLIN, 0});
    owner->push_back(tag + s);
    bool left_ready = left_to_progress_[s] == kLeftAtHeader ||
                      (left_to_progress_[s] == kLeftMidFrame && in_[s]->st != InConn::kPayload);  // (its end read)
    if (in_[s]->buffered() > 0 || left_ready) ahead->push_back(s);
  }
}

bool Engine::help_read() {
  if (role_wanted_.load()) return false;  // the progress thread waits for the role (a frame left to it)
  std::unique_lock<std::mutex> role(read_mu_, std::try_to_lock);
  if (!role.owns_lock()) return false;
  helped_.fetch_add(1, std::memory_order_relaxed);
  uint64_t marks = left_marks_;
  help_fds_.clear();
  help_owner_.clear();
  help_ahead_.clear();
  {
    std::lock_guard<std::mutex> lock(mu_);
    readable_fds(&help_fds_, &help_owner_, 0, &help_ahead_, true);
  }
  if (help_fds_.empty()) return false;
  // A few connections are read at once (a read that finds nothing costs what a poll would).
  bool direct = help_fds_.size() <= kHelpDirectReads;
  if (!direct && help_ahead_.empty() && ::poll(help_fds_.data(), help_fds_.size(), 0) <= 0) return false;
  bool any = false;
  uint64_t first = frames_read_;
  for (size_t k = 0; k < help_fds_.size() && !role_wanted_.load(); ++k) {
    int s = help_owner_[k];
    bool ahead = std::find(help_ahead_.begin(), help_ahead_.end(), s) != help_ahead_.end();
    if (!direct && help_fds_[k].revents == 0 && !ahead) continue;
    uint64_t before = frames_read_;
    read_guarded(s);
    any = any || frames_read_ != before;
  }
  waiter_reads_.fetch_add(frames_read_ - first, std::memory_order_relaxed);
  finish_landed_stripes();
  send_acks();
  if (left_marks_ != marks) {  // it left a frame to the progress thread: the role first, then the wakes
    left_since_ns_.store(steady_ns(), std::memory_order_relaxed);  // (under the role: in the order of the marks)
    role.unlock();
    unpark();
    wake();  // (unpark wakes a parked poll only; one that is not parked may poll sockets this read emptied)
  }
  return any;
}

void Engine::poll_once() {
  std::vector<pollfd> fds{{wake_fd_, POLLIN, 0}};
  std::vector<int> owner{-1};  // slot s: its send side; total + s: its receive side
  int total = total_;  // lane 0: the other lanes are their workers' (progress_lanes.cc)
  bool copies = false;
  std::vector<int> ahead;  // slots with frames read ahead: read them whatever the poll says
  uint64_t sleeps_before = sleeps_.load();
  bool park = parked_.load() && left_count_.load() == 0;  // a frame left to it: read it now
  std::unique_lock<std::mutex> role(read_mu_, std::defer_lock);
  bool retry = false;  // a waiter went to sleep meanwhile: no role and not parked, so look again at once
  if (!park && left_count_.load() > 0) {  // a frame left to it: waiters hold the role a read at a time
    role_wanted_.store(true);
    role.lock();
    role_wanted_.store(false);
  } else if (!park && !role.try_lock()) {
    retry = !(park = park_beside_reader(sleeps_before));
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (int s = 0; s < total; ++s) {
      // A get answer waiting for its copies down is polled by write_pending (see copies_timeout_ms).
      if (!out_[s].empty() && out_[s].front().staged && out_[s].front().staged->copies_pending()) copies = true;
      if (!out_[s].empty() && !waiting_for_staging(s)) {  // else the filler's wake() resumes it
        fds.push_back({conns_->send[s].get(), POLLOUT, 0});
        owner.push_back(s);
      }
    }
    if (role.owns_lock()) {
      forget_closed_left();
      readable_fds(&fds, &owner, total, &ahead, false);
    }
  }
  if (role.owns_lock()) role.unlock();
  int timeout_ms = copies_timeout_ms(copies);
  if ((park || lazy_pending_.load() > 0) && timeout_ms > 1) timeout_ms = 1;  // parked; the lazy acks' timer
  if (retry || !ahead.empty() || (lane_spin_ns_ > 0 && lane_spinning(lane0_spin_until_ns_.load(std::memory_order_relaxed)))) {
    timeout_ms = 0;  // read ahead, striped puts' hand-offs due (progress_lanes.cc), or the role freed
  }
  int64_t poll_from_ns = steady_ns();
  int ready = ::poll(fds.data(), fds.size(), timeout_ms);
  if (park) {
    parked_.store(false);
    parks_.fetch_add(1, std::memory_order_relaxed);
    if (ready == 0 && woke_late(sleeps_before, poll_from_ns, timeout_ms)) late_wakes_.fetch_add(1, std::memory_order_relaxed);
  } else if (ready == 0 && left_frame_waited(poll_from_ns, timeout_ms)) {
    late_wakes_.fetch_add(1, std::memory_order_relaxed);
  }
  if (timeout_ms == 0 && ahead.empty()) std::this_thread::yield();
  // Drained before the read phase: a wake-up that comes during it (a lane landing the last
  // stripe of a held put after finish_landed_stripes looked) stays for the next poll.
  if (fds[0].revents) {  // new work was queued: the write_pending() below starts it now
    uint64_t v;
    ssize_t n = ::read(wake_fd_, &v, sizeof(v));
    (void)n;
  }
  read_phase(fds, owner, ahead);
  for (size_t k = 1; k < fds.size(); ++k) {
    if (fds[k].revents != 0 && owner[k] < total) write_guarded(owner[k]);
  }
  decide_park();  // waiters read lane 0: leave it to them a while
  write_pending();
}

// Reads what the poll found readable, applies striped puts whose stripes landed, sends acks.
void Engine::read_phase(const std::vector<pollfd>& fds, const std::vector<int>& owner, const std::vector<int>& ahead) {
  std::lock_guard<std::mutex> role(read_mu_);
  for (size_t k = 1; k < fds.size(); ++k) {
    if (owner[k] < total_) continue;
    int s = owner[k] - total_;
    if (fds[k].revents != 0 || std::find(ahead.begin(), ahead.end(), s) != ahead.end()) read_guarded(s);
  }
  finish_landed_stripes();
  send_acks();
}

// Copies down of a get answer take tens of microseconds a chunk on a GPU: while get answers wait
// for theirs the poll spins (yielding) for 2 ms from the last copy seen complete (each answer in a
// run of them gets its own spin), then sleeps up to 1 ms a pass; with none pending up to 100 ms.
int Engine::copies_timeout_ms(bool copies) {
  auto now = std::chrono::steady_clock::now();
  if (!copies) {
    copies_since_ = {};
    return 100;
  }
  uint64_t done = answer_copies_done_.load(std::memory_order_relaxed);
  if (copies_since_ == std::chrono::steady_clock::time_point{} || done != copies_seen_) {
    copies_since_ = now;
    copies_seen_ = done;
  }
  return now - copies_since_ < std::chrono::milliseconds(2) ? 0 : 1;
}

}  // namespace fxm
