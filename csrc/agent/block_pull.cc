#include "agent/block_pull.h"

#include <algorithm>
#include <chrono>

#include "agent/connection.h"
#include "agent/stream_wait.h"
#include "base/backoff.h"
#include "base/log.h"
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

double now_s() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

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

void BlockPuller::await_answer(AnswerJob job) {
  if (!job.conn || &job.conn->agent() != agent_.get()) {
    fail(Code::kInvalidArgument, -1, 0, "awaiting an answer: the connection is not one of this puller's agent");
  }
  uint64_t token = job.token;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closing_) fail(Code::kClosed, -1, 0, "block reads: closed");
    live_.insert(token);
    awaited_[token] = Awaited{job.conn, std::move(job.on_landed), nullptr};
  }
  std::shared_ptr<WaitState> w;
  try {  // (an answer here already is taken now, in this call)
    w = agent_->watch_notification(job.answer, job.conn, job.timeout_s,
                                   [this, token](const WaitState& s) { answered(token, s.error); });
  } catch (...) {
    forget(token);
    throw;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = awaited_.find(token);
    if (it != awaited_.end()) {
      it->second.watch = std::move(w);
      return;
    }
  }
  agent_->withdraw_watch(w);  // forgotten, answered or closed meanwhile: no watch may outlive its record
}

void BlockPuller::answered(uint64_t token, const std::string& error) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    answered_.push_back({token, error});
  }
  cv_.notify_all();
}

void BlockPuller::forget(uint64_t token) {
  std::shared_ptr<WaitState> w;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = awaited_.find(token);
    if (it == awaited_.end()) return;
    w = std::move(it->second.watch);
    awaited_.erase(it);
    live_.erase(token);
    cancelled_.erase(token);
  }
  if (w) agent_->withdraw_watch(w);  // (not under mu_: a release holds the inbox's lock, then takes mu_)
}

// The answers that came (or failed): the ack goes, then the outcome; one forgotten meanwhile is skipped.
void BlockPuller::finish_answers(std::vector<Answered> done) {
  for (Answered& a : done) {
    Awaited got;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = awaited_.find(a.token);
      if (it == awaited_.end()) continue;
      got = std::move(it->second);
      awaited_.erase(it);
    }
    PullOutcome o{a.token, a.error, 0, 0, cancelled(a.token)};
    // The answer says the bytes landed: that stands whether or not the ack reaches the peer (gone
    // meanwhile, it releases what it held for this agent anyway).
    if (o.error.empty() && !o.cancelled) notify_quietly(*got.conn, got.on_landed);
    post(std::move(o));
  }
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
  bool claimed;
  {
    std::lock_guard<std::mutex> claim(claim_mu_);
    {
      std::lock_guard<std::mutex> lock(mu_);
      closing_ = true;  // (the claim takes no more wants from now)
      claimed = serving_;
      serving_ = false;
    }
    if (claimed) agent_->unclaim_notifications({kWantPrefix.begin(), kWantPrefix.end()});
  }
  cv_.notify_all();
  if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) thread_.join();
}

void BlockPuller::post(PullOutcome o) {
  o.at_s = now_s();
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
  std::string why = issue(job);
  if (why.empty()) return;
  InFlight f{std::move(job), Handle()};
  finish(f, why);
}

// A push was counted in flight when its offer was found (serve()); its started event is posted
// once its write was issued. The answer goes with the write where the socket orders it behind the
// data; where it would wait for device copies (which would hold this thread) it goes once the write
// is over (finish_push). A write that fails as it is issued (its connection failing: some of its
// ops may have gone) is a push that failed, not a refusal: its events are posted, it is not handed
// back (as the connector's own push counts it).
std::string BlockPuller::issue(PullJob& job) {
  std::vector<Xfer> xs;
  std::string why = make_ops(job, &xs);
  if (!why.empty()) return why;
  Handle op;
  bool answered = false;
  std::string failed;
  try {
    if (!job.write) {
      op = job.conn->transfer(xs, /*is_read=*/true, nullptr);
    } else if (!xs.empty()) {
      op = job.conn->transfer(xs, /*is_read=*/false, &job.on_landed, {}, &answered);
    }
  } catch (const Error& e) {  // refused by the checks before anything moved (InvalidArgument), or failed as issued
    if (!job.write || e.code() == Code::kInvalidArgument) return e.what();
    failed = std::string("the write failed as it was issued: ") + e.what();
  } catch (const std::exception& e) {
    return e.what();
  }
  InFlight f{std::move(job), std::move(op)};
  if (!failed.empty()) {
    post_served(f, kServedStarted, "");
    post_served(f, kServedEnded, failed);
    return "";
  }
  f.answered = answered;
  if (f.job.write) {
    f.late_at = Deadline::after_seconds(f.job.late_s > 0 ? f.job.late_s : agent_->timeout_s());
    post_served(f, kServedStarted, "");
  }
  if (f.op.done()) {  // a host path's op is over at its return
    finish(f, "");
  } else {
    flight_.push_back(std::move(f));
  }
  return "";
}

bool BlockPuller::polled(InFlight& f) {
  std::string why;
  try {
    if (!f.op.poll()) {
      if (f.job.write && !f.late && f.late_at.expired()) {
        f.late = true;
        post_served(f, kServedLate, "");
      }
      return false;
    }
  } catch (const std::exception& e) {  // (polling a device copy's completion failed)
    why = std::string("polling the ") + (f.job.write ? "push" : "read") + "'s completion failed: " + e.what();
  }
  finish(f, why);
  return true;
}

// ---- wants served (want_server.h) ----------------------------------------------------------

void BlockPuller::serve_wants(bool on) {
  std::lock_guard<std::mutex> claim(claim_mu_);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closing_) fail(Code::kClosed, -1, 0, "serving wants: the block reads were closed");
    if (serving_ == on) return;
    serving_ = on;  // (before the claim: it takes wants as soon as it is installed)
  }
  std::vector<uint8_t> prefix(kWantPrefix.begin(), kWantPrefix.end());
  if (!on) return agent_->unclaim_notifications(prefix);
  try {
    agent_->claim_notifications(prefix, [this](const std::shared_ptr<Connection>& c, Notification& n) {
      return claimed(c, n);
    });
  } catch (const Error& e) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      serving_ = false;
    }
    if (e.code() != Code::kInvalidArgument) throw;
    fail(Code::kInvalidArgument, -1, 0, "serving wants: another block puller of this agent serves them");
  } catch (...) {
    std::lock_guard<std::mutex> lock(mu_);
    serving_ = false;
    throw;
  }
}

bool BlockPuller::claimed(const std::shared_ptr<Connection>& conn, Notification& n) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!serving_) return false;  // (closing, or serve_wants(false) on its way to take the claim out)
    claimed_.push_back({conn, std::move(n)});
  }
  cv_.notify_all();
  return true;
}

bool BlockPuller::resubmit(const std::shared_ptr<Connection>& conn, std::vector<uint8_t> bytes) {
  if (!conn || &conn->agent() != agent_.get()) {
    fail(Code::kInvalidArgument, -1, 0, "serving a want again: the connection is not one of this puller's agent");
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closing_) fail(Code::kClosed, -1, 0, "serving a want again: the block reads were closed");
  }
  Notification n{conn->peer().name, conn->peer().incarnation, std::move(bytes)};
  return claimed(conn, n);  // (false once wants are not served: serve_wants(false), or a close since)
}

void BlockPuller::offer(uint64_t token, std::string req, std::vector<std::vector<int64_t>> groups, double timeout_s) {
  std::lock_guard<std::mutex> lock(mu_);
  served_.offer(token, std::move(req), std::move(groups), timeout_s);
}

uint64_t BlockPuller::withdraw(uint64_t token) {
  std::lock_guard<std::mutex> lock(mu_);
  return served_.withdraw(token);
}

uint64_t BlockPuller::in_flight(uint64_t token) const {
  std::lock_guard<std::mutex> lock(mu_);
  return served_.in_flight(token);
}

void BlockPuller::serve_layout(std::shared_ptr<Connection> conn, std::array<uint32_t, 4> part,
                               std::vector<std::shared_ptr<const RegionDesc>> locals,
                               std::vector<std::shared_ptr<const RegionDesc>> remotes,
                               std::vector<std::vector<std::shared_ptr<const BlockRows>>> group_tables) {
  if (!conn || &conn->agent() != agent_.get()) {
    fail(Code::kInvalidArgument, -1, 0, "serving wants: the connection is not one of this puller's agent");
  }
  std::lock_guard<std::mutex> lock(mu_);
  served_.serve_layout(conn, part, std::move(locals), std::move(remotes), std::move(group_tables));
}

void BlockPuller::forget_layouts(const std::shared_ptr<Connection>& conn) {
  std::lock_guard<std::mutex> lock(mu_);
  served_.forget_layouts(conn.get());
}

std::vector<ServedEvent> BlockPuller::take_served() {
  std::lock_guard<std::mutex> lock(mu_);
  return served_.take();
}

// The push is counted in flight as its offer is found, under the same lock: a withdraw() after that
// waits for it (none starts unseen); until its write was issued (or failed as issued) a failure
// takes it out again and hands the want back.
void BlockPuller::serve(ClaimedWant& c) {
  std::string why;
  PullJob job;
  bool counted = false;
  try {
    Want w;
    if (parse_want(c.n.bytes.data(), c.n.bytes.size(), &w, &why)) {
      std::lock_guard<std::mutex> lock(mu_);
      why = served_.push_for(w, c.conn, &job);
      if (why.empty()) {
        job.push = served_.begin(job.token);
        counted = true;
      }
    }
    if (why.empty()) why = issue(job);
  } catch (const std::exception& e) {  // (out of memory): not served
    why = e.what();
  }
  if (why.empty()) return;
  if (counted) uncount_push(job);
  hand_back(c, why);
}

void BlockPuller::hand_back(ClaimedWant& c, const std::string& why) {
  FXM_DEBUG(-1, "agent " + agent_->name() + ": a want of agent " + c.n.peer + " goes to notifications(): " + why);
  agent_->deliver_notification(std::move(c.n));
}

void BlockPuller::uncount_push(const PullJob& job) {
  std::lock_guard<std::mutex> lock(mu_);
  served_.end(job.token);
}

void BlockPuller::post_served(InFlight& f, int kind, const std::string& error) {
  const PeerInfo& peer = f.job.conn->peer();
  ServedEvent e{f.job.token, f.job.push, kind, peer.name, peer.incarnation, f.job.readers,
                f.op.count(), f.op.bytes(), error, now_s()};
  {
    std::lock_guard<std::mutex> lock(mu_);
    served_.record(std::move(e));
    ++seq_;
  }
  cv_.notify_all();
}

// The answer goes once the bytes landed (unless it went with the write); the ended event says
// whether the push and its answer went.
void BlockPuller::finish_push(InFlight& f, std::string error) {
  if (error.empty()) {
    try {
      f.op.wait(0);  // over: returns at once, or raises the write's own error
      if (!f.answered) f.job.conn->notify(f.job.on_landed);
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  post_served(f, kServedEnded, error);
}

// At close: every answer still awaited fails (its watch taken out first, so none is posted twice).
void BlockPuller::close_answers() {
  std::vector<uint64_t> tokens;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [token, a] : awaited_) tokens.push_back(token);
  }
  std::vector<Answered> left;
  for (uint64_t token : tokens) {
    std::shared_ptr<WaitState> w;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = awaited_.find(token);
      if (it == awaited_.end()) continue;
      w = it->second.watch;
    }
    if (!w || agent_->withdraw_watch(w)) {
      left.push_back({token, "the block reads were closed with this answer awaited"});
    }
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    left.insert(left.begin(), answered_.begin(), answered_.end());  // (arrived since the thread looked)
    answered_.clear();
  }
  finish_answers(std::move(left));
}

void BlockPuller::finish(InFlight& f, const std::string& error) {
  if (f.job.write) return finish_push(f, error);
  PullOutcome o{f.job.token, error, f.op.count(), f.op.bytes(), cancelled(f.job.token)};
  if (o.error.empty()) {
    try {
      f.op.wait(0);  // over: returns at once, or raises the read's own error
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
bool BlockPuller::news() const {  // (mu_ held)
  return !queued_.empty() || !answered_.empty() || !claimed_.empty() || closing_;
}

void BlockPuller::run() {
  name_this_thread("fxm-blockreads");
  Backoff pace;
  for (;;) {
    std::vector<PullJob> jobs;
    std::vector<Answered> done;
    std::vector<ClaimedWant> wants;
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (flight_.empty()) cv_.wait(lock, [&] { return news(); });
      if (closing_) break;  // (what is queued fails below)
      jobs.swap(queued_);
      done.swap(answered_);
      wants.swap(claimed_);
    }
    finish_answers(std::move(done));
    for (PullJob& j : jobs) {
      try {
        start(j);
      } catch (...) {  // (out of memory making its ops): it fails, the thread goes on
        InFlight f{std::move(j), Handle()};
        finish(f, "the read could not be started");
      }
    }
    for (ClaimedWant& w : wants) serve(w);
    bool moved = !jobs.empty() || !wants.empty();
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
      cv_.wait_for(lock, pace.sleep(), [&] { return news(); });
    }
  }
  std::vector<PullJob> left;
  std::vector<ClaimedWant> wants;
  {
    std::lock_guard<std::mutex> lock(mu_);
    left.swap(queued_);
    wants.swap(claimed_);
  }
  for (PullJob& j : left) {
    InFlight f{std::move(j), Handle()};
    finish(f, "the block reads were closed before this one was issued");
  }
  for (ClaimedWant& w : wants) hand_back(w, "the block reads were closed before it was served");
  for (InFlight& f : flight_) {
    finish(f, std::string("the block reads were closed with this ") + (f.job.write ? "push" : "read") + " in flight");
  }
  flight_.clear();
  close_answers();
}

}  // namespace fxm::agent
