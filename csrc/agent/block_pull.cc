#include "agent/block_pull.h"

#include <algorithm>
#include <chrono>

#include "agent/connection.h"
#include "base/backoff.h"
#include "base/status.h"
#include "base/thread_name.h"

namespace fxm::agent {

namespace {

// The ops of a job's tables, or the words of why none can be made.
std::string make_ops(const PullJob& job, std::vector<Xfer>* xs) {
  std::vector<int64_t> rows;
  for (const PullGroup& g : job.groups) {
    if (g.local_ids.size() != g.remote_ids.size()) {
      return std::to_string(g.local_ids.size()) + " local block ids for " + std::to_string(g.remote_ids.size()) +
             " of the peer's";
    }
    for (const auto& t : g.tables) {
      if (!t->rows(g.local_ids.data(), g.remote_ids.data(), g.local_ids.size(), &rows)) {
        return "a block id is out of its layers' range";
      }
    }
  }
  xs->reserve(rows.size() / 5);
  for (size_t r = 0; r < rows.size(); r += 5) {
    uint64_t li = static_cast<uint64_t>(rows[r]), ri = static_cast<uint64_t>(rows[r + 2]);
    if (li >= job.locals.size() || ri >= job.remotes.size()) {
      return "row " + std::to_string(r / 5) + " names region " + std::to_string(li >= job.locals.size() ? li : ri) +
             ", of " + std::to_string(li >= job.locals.size() ? job.locals.size() : job.remotes.size()) + " given";
    }
    xs->push_back({job.locals[li].get(), static_cast<uint64_t>(rows[r + 1]), job.remotes[ri].get(),
                   static_cast<uint64_t>(rows[r + 3]), static_cast<uint64_t>(rows[r + 4])});
  }
  return "";
}

void notify_quietly(Connection& c, const std::vector<uint8_t>& bytes) {
  if (bytes.empty()) return;
  try {
    c.notify(bytes);
  } catch (const std::exception&) {  // the peer is gone: the outcome says why already
  }
}

}  // namespace

BlockPuller::BlockPuller(std::shared_ptr<Agent> agent) : agent_(std::move(agent)), thread_([this] { run(); }) {}

BlockPuller::~BlockPuller() { close(); }

void BlockPuller::submit(PullJob job) {
  if (!job.conn || &job.conn->agent() != agent_.get()) {
    fail(Code::kInvalidArgument, -1, 0, "block reads: the connection is not one of this puller's agent");
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closing_) fail(Code::kClosed, -1, 0, "block reads: closed");
    live_.insert(job.token);
    queued_.push_back(std::move(job));
  }
  cv_.notify_all();
}

void BlockPuller::cancel(uint64_t token) {
  std::lock_guard<std::mutex> lock(mu_);
  if (live_.count(token)) cancelled_.insert(token);  // (one whose outcome is posted: nothing to do)
}

std::vector<PullOutcome> BlockPuller::take() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<PullOutcome> out;
  out.swap(outcomes_);
  return out;
}

uint64_t BlockPuller::seq() const {
  std::lock_guard<std::mutex> lock(mu_);
  return seq_;
}

void BlockPuller::wait(uint64_t seen, double timeout_s) const {
  std::unique_lock<std::mutex> lock(mu_);
  double s = timeout_s > 0 ? std::min(timeout_s, 86400.0) : 0.0;  // (NaN: 0)
  auto until = std::chrono::steady_clock::now() +
               std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(s));
  cv_.wait_until(lock, until, [&] { return seq_ != seen || !outcomes_.empty() || closing_; });
}

void BlockPuller::wake() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++seq_;
  }
  cv_.notify_all();
}

void BlockPuller::close() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    closing_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) thread_.join();
}

void BlockPuller::post(PullOutcome o) {
  o.at_s = std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
  {
    std::lock_guard<std::mutex> lock(mu_);
    live_.erase(o.token);
    cancelled_.erase(o.token);  // (a cancel that came after finish() looked)
    outcomes_.push_back(std::move(o));
    ++seq_;
  }
  cv_.notify_all();
}

bool BlockPuller::cancelled(uint64_t token) {
  std::lock_guard<std::mutex> lock(mu_);
  return cancelled_.erase(token) != 0;
}

void BlockPuller::start(PullJob& job) {
  std::vector<Xfer> xs;
  std::string why = make_ops(job, &xs);
  Handle read;
  if (why.empty()) {
    try {
      read = job.conn->transfer(xs, /*is_read=*/true, nullptr);
    } catch (const std::exception& e) {  // refused before any byte moved
      why = e.what();
    }
  }
  InFlight f{std::move(job), std::move(read)};
  if (!why.empty() || f.read.done()) return finish(f, why);  // a host path's read is over at its return
  flight_.push_back(std::move(f));
}

bool BlockPuller::polled(InFlight& f) {
  std::string why;
  try {
    if (!f.read.poll()) return false;
  } catch (const std::exception& e) {  // (polling a device copy's completion failed)
    why = std::string("polling the read's completion failed: ") + e.what();
  }
  finish(f, why);
  return true;
}

void BlockPuller::finish(InFlight& f, const std::string& error) {
  PullOutcome o{f.job.token, error, f.read.count(), f.read.bytes(), cancelled(f.job.token)};
  if (o.error.empty()) {
    try {
      f.read.wait(0);  // over: returns at once, or raises the read's own error
    } catch (const std::exception& e) {
      o.error = e.what();
    }
  }
  if (o.error.empty() && !o.cancelled && !f.job.on_landed.empty()) {
    try {
      f.job.conn->notify(f.job.on_landed);
    } catch (const std::exception& e) {
      o.error = std::string("the read landed, but its ack could not go: ") + e.what();
    }
  }
  if (!o.error.empty()) notify_quietly(*f.job.conn, f.job.on_failed);
  post(std::move(o));
}

// The thread: issues what is queued, then polls the reads in flight (each is finished as it is
// over, whatever its connection), pacing its polls as a waiter does (base/backoff.h) and woken
// at once by a new job.
void BlockPuller::run() {
  name_this_thread("fxm-blockreads");
  Backoff pace;
  for (;;) {
    std::vector<PullJob> jobs;
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (flight_.empty()) cv_.wait(lock, [&] { return !queued_.empty() || closing_; });
      if (closing_) break;  // (what is queued fails below)
      jobs.swap(queued_);
    }
    for (PullJob& j : jobs) {
      try {
        start(j);
      } catch (...) {  // (out of memory making its ops): it fails, the thread goes on
        InFlight f{std::move(j), Handle()};
        finish(f, "the read could not be started");
      }
    }
    bool moved = !jobs.empty();
    for (auto it = flight_.begin(); it != flight_.end();) {
      if (polled(*it)) {
        it = flight_.erase(it);
        moved = true;
      } else {
        ++it;
      }
    }
    if (moved) pace = Backoff();
    if (flight_.empty() || moved) continue;
    std::unique_lock<std::mutex> lock(mu_);
    if (pace.spinning()) {
      lock.unlock();
      std::this_thread::yield();
    } else {
      cv_.wait_for(lock, pace.sleep(), [&] { return !queued_.empty() || closing_; });
    }
  }
  std::vector<PullJob> left;
  {
    std::lock_guard<std::mutex> lock(mu_);
    left.swap(queued_);
  }
  for (PullJob& j : left) {
    InFlight f{std::move(j), Handle()};
    finish(f, "the block reads were closed before this one was issued");
  }
  for (InFlight& f : flight_) finish(f, "the block reads were closed with this read in flight");
  flight_.clear();
}

}  // namespace fxm::agent
