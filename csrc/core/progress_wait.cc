// Completion and waiting in the progress engine: ops counted as issued and
// completed (acks, answers, device probes), and the calls that wait on them
// (wait_idle, flush, wait_counter) within their deadline.
#include <chrono>
#include <thread>

#include "base/backoff.h"
#include "base/log.h"
#include "base/status.h"
#include "core/progress_items.h"

namespace fxm {

namespace {

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
  Backoff pace;
  while (outstanding_[slot(peer, ctx)] != 0) {
    if (!lost_[peer].empty() || bye_[peer] || deadline.expired()) {
      // One last poll, then only this pair's ops count (others completing meanwhile must not keep it waiting).
      settle_probes(lock);
      if (outstanding_[slot(peer, ctx)] == 0) break;
      lock.unlock();
      fail_wait(peer, "an op waiting for earlier ops to its pair", deadline);
    }
    if (stopping_) fail(Code::kClosed, peer, 0, who() + "the mesh was closed");
    if (ask_for_acks(lock, peer, peer + 1)) continue;
    wait_or_poll(lock, deadline, pace);
  }
}

void Engine::issued(int peer, int ctx, PathKind kind) { issued_n(peer, ctx, kind, 1); }

void Engine::issued_n(int peer, int ctx, PathKind kind, uint64_t ops) {
  std::lock_guard<std::mutex> lock(mu_);
  outstanding_[slot(peer, ctx)] += ops;
  in_flight_kind_[slot(peer, ctx)] = kind;
  issued_[peer].fetch_add(ops);
  stream_ops_.fetch_add(static_cast<int64_t>(ops));
}

bool Engine::wait_stream_ops(const Deadline& deadline) {
  while (stream_ops_.load() > 0) {
    if (deadline.expired()) return false;
    if (!poll_probes()) std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  return true;
}

void Engine::issued_probe(int peer, int ctx, PathKind kind, std::unique_ptr<CompletionProbe> probe, uint64_t ops) {
  issued_n(peer, ctx, kind, ops);
  std::lock_guard<std::mutex> lock(probe_mu_);
  probes_[slot(peer, ctx)].push_back({std::move(probe), ops});
  probes_pending_.fetch_add(1);
}

// A probe that throws (no driver context any more) counts as done, failed with what it threw
// (its ops are not reported as landed); the error is in the log too.
bool Engine::probe_done(CompletionProbe& p, std::string* error) {
  try {
    bool done = p.done();
    if (done) *error = p.error();
    return done;
  } catch (const Error& e) {
    FXM_ENGINE_LOG(::fxm::LogLevel::kWarn, std::string("polling a device op: ") + e.what());
    *error = std::string("polling its completion failed: ") + e.what();
    return true;
  }
}

bool Engine::poll_probes() {
  if (probes_pending_.load() == 0) return false;
  std::vector<ProbeEnd> done;  // per completed probe, in order
  {
    std::lock_guard<std::mutex> lock(probe_mu_);
    std::string error;
    for (size_t s = 0; s < probes_.size(); ++s) {
      while (!probes_[s].empty() && probe_done(*probes_[s].front().probe, &error)) {
        done.push_back({static_cast<int>(s), error, probes_[s].front().probe->peer_lost(), probes_[s].front().ops});
        probes_[s].pop_front();
      }
    }
  }
  probes_pending_.fetch_sub(static_cast<int64_t>(done.size()));
  for (ProbeEnd& e : done) {
    int peer = e.slot / ncontexts_;
    if (e.lost) {
      std::lock_guard<std::mutex> lock(mu_);
      if (refused_[peer].empty()) refused_lost_[peer] = 1;
    }
    completed_n(peer, e.slot % ncontexts_, e.error, e.ops);
  }
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

// One step of a wait on the completion counters. While probed device ops are
// pending it polls them; while ops completed from a stream (host functions)
// are pending and the wait is young, it only yields. Otherwise it sleeps on
// the condition variable. `pace` (one per wait) spins first, then sleeps
// longer as the wait grows (base/backoff.h): a sleep costs the timer slack
// (~50 us), more than a small device copy takes.
void Engine::wait_or_poll(std::unique_lock<std::mutex>& lock, const Deadline& deadline, const Backoff& pace) {
  bool probes = probes_pending_.load() != 0;
  if (!probes && stream_ops_.load() == 0 && pace.within(kHelpSpin) && may_help()) {
    lock.unlock();  // the acks (or answers) it waits for: read them here rather than wake up for them
    if (!help_read()) std::this_thread::yield();
    lock.lock();
    return;
  }
  if (!probes && (stream_ops_.load() == 0 || !pace.spinning())) {
    unpark();
    cv_.wait_until(lock, deadline.min(Deadline::after_seconds(0.1)).at());
    return;
  }
  lock.unlock();
  if (may_help()) unpark();  // it may have read in its first kHelpSpin: the progress thread reads while this one pauses
  if (!probes || !poll_probes()) pace.pause();
  lock.lock();
}

void Engine::completed(int peer, int ctx, const std::string& error) { completed_n(peer, ctx, error, 1); }

void Engine::completed_n(int peer, int ctx, const std::string& error, uint64_t ops) {
  if (!error.empty()) {
    std::lock_guard<std::mutex> lock(mu_);
    if (refused_[peer].empty()) refused_[peer] = "an op to peer " + std::to_string(peer) + " failed: " + error;
  }
  complete(peer, ctx, ops);
  stream_ops_.fetch_sub(static_cast<int64_t>(ops));
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

bool Engine::ask_for_acks(std::unique_lock<std::mutex>& lock, int lo, int hi) {
  if (!lazy_unrequested(lo, hi)) return false;
  lock.unlock();
  request_acks(lo, hi);
  lock.lock();
  return true;
}

void Engine::fail_if_gone(int peer, const std::string& what) const {
  if (!lost_[peer].empty()) fail(Code::kPeerLost, peer, 0, what + lost_[peer]);
  if (bye_[peer]) fail(Code::kPeerLost, peer, 0, what + "peer " + std::to_string(peer) + " closed its mesh");
}

void Engine::wait_counter(uint64_t value, const Deadline& deadline) {
  std::unique_lock<std::mutex> lock(mu_);
  CountWaiter counted(&count_waiters_);
  Backoff pace;
  while (completed_all_.load() < value) {
    for (int p = 0; p < nranks_; ++p) {
      if ((!lost_[p].empty() || bye_[p]) && done_[p].load() != issued_[p].load()) {
        settle_probes(lock);  // one last poll; then only that peer's ops count
        if (done_[p].load() == issued_[p].load()) continue;
        lock.unlock();
        fail_wait(p, "wait_counter", deadline);
      }
    }
    if (stopping_) fail(Code::kClosed, -1, 0, who() + "wait_counter: the mesh was closed");
    if (deadline.expired()) {
      fail(Code::kTimeout, -1, 0, who() + "wait_counter(" + std::to_string(value) + ") timed out at " +
                                      std::to_string(completed_all_.load()) + " completed ops");
    }
    if (ask_for_acks(lock, 0, nranks_)) continue;
    wait_or_poll(lock, deadline, pace);
  }
  fail_if_refused(0, nranks_, "wait_counter");
}

void Engine::flush(int peer, const Deadline& deadline, bool report_refused) {
  int lo = peer < 0 ? 0 : peer, hi = peer < 0 ? nranks_ : peer + 1;
  std::unique_lock<std::mutex> lock(mu_);
  CountWaiter counted(&count_waiters_);
  Backoff pace;
  for (int p = lo; p < hi; ++p) {
    while (done_[p].load() != issued_[p].load()) {
      if (!lost_[p].empty() || bye_[p] || deadline.expired()) {
        settle_probes(lock);  // one last poll: then only this peer's ops count, not others completing meanwhile
        if (done_[p].load() == issued_[p].load()) break;
        lock.unlock();
        fail_wait(p, "flush", deadline);
      }
      if (stopping_) fail(Code::kClosed, p, 0, who() + "flush: the mesh was closed");
      if (ask_for_acks(lock, p, p + 1)) continue;
      wait_or_poll(lock, deadline, pace);
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

}  // namespace fxm
