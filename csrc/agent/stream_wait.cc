#include "agent/stream_wait.h"

#include <cmath>
#include <algorithm>
#include <cstdlib>

#include "agent/connection.h"
#include "base/backoff.h"
#include "base/env.h"
#include "agent/name_probe.h"
#include "base/log.h"
#include "base/thread_name.h"
#include "core/window.h"
#include "transport/cuda/device_memory.h"

namespace fxm::agent {
namespace {

constexpr uint64_t kSlotsPerBlock = 512;  // one 4 KiB page of 8-byte slots
constexpr double kCloseWaitS = 5.0;       // close waits this long for streams still on a slot
// A waiter is woken by the agent's doorbell (doorbell.h) when something it waits for may have
// happened; it looks again at least this often all the same (a safety net, not a pace).
constexpr double kLookAtLeastEveryS = 0.1;

// The bytes as the user wrote them when printable, else in hex (at most 64 bytes shown).
std::string shown(const std::vector<uint8_t>& b) {
  bool text = std::all_of(b.begin(), b.end(), [](uint8_t c) { return c >= 0x20 && c < 0x7f; });
  size_t n = std::min<size_t>(b.size(), 64);
  std::string out;
  static const char* hex = "0123456789abcdef";
  for (size_t i = 0; i < n; ++i) {
    if (text) out += static_cast<char>(b[i]);
    else out += {hex[b[i] >> 4], hex[b[i] & 15]};
  }
  if (n < b.size()) out += "...";
  return text ? "\"" + out + "\"" : "0x" + out;
}

std::string what_wait(const WaitState& w) {
  std::string what = w.any_bytes ? "the next notification" : "notification " + shown(w.bytes);
  const char* kind = w.on_release ? "watch for " : w.host ? "wait_notification for " : "stream wait on ";
  return kind + what +
         (w.peer.empty() ? "" : " from agent " + w.peer);
}

// What a released stream wait adds to its error (a host wait holds no stream).
std::string stream_note(const WaitState& w) { return w.host || w.on_release ? "" : "; the stream was released"; }

}  // namespace

// A signal window of kSlotsPerBlock slots (host memory the device maps at the
// first stream wait); per slot the wait that holds it and the event after it.
struct NotificationInbox::SlotBlock {
  std::shared_ptr<Window> win = std::make_shared<Window>();
  std::vector<std::shared_ptr<WaitState>> owner = std::vector<std::shared_ptr<WaitState>>(kSlotsPerBlock);
  std::vector<cuda::SharedEvent> passed = std::vector<cuda::SharedEvent>(kSlotsPerBlock);
  std::vector<uint64_t> values = std::vector<uint64_t>(kSlotsPerBlock, 0);  // the last value each slot was given
  bool keep = false;  // a stream may still read it: never unmapped nor freed
  SlotBlock() {
    void* mem = nullptr;
    if (::posix_memalign(&mem, 4096, kSlotsPerBlock * 8) != 0) fail(Code::kSystem, -1, ENOMEM, "slots for stream waits");
    std::fill_n(static_cast<uint64_t*>(mem), kSlotsPerBlock, 0);
    win->kind = WindowKind::kSignal;
    win->base = static_cast<uint8_t*>(mem);
    win->size = kSlotsPerBlock * 8;
  }
  ~SlotBlock() {
    if (keep) {
      new std::shared_ptr<Window>(win);  // mapped and registered for good: a stream may still read it
      return;
    }
    uint8_t* mem = win->base;
    win.reset();  // unregisters the slots
    std::free(mem);
  }
  bool free_at(size_t i) const {
    return !owner[i] || (owner[i]->released && (!passed[i] || cuda::event_done(passed[i])));
  }
};

NotificationInbox::NotificationInbox(Agent* agent) : agent_(agent), sync_(std::make_shared<WaitSync>()) {}

NotificationInbox::~NotificationInbox() { close(); }

std::string NotificationInbox::who() const { return "agent " + agent_->name() + ": "; }

uint64_t* NotificationInbox::take_slot(uint64_t* value, SlotBlock** block, uint64_t* index) {
  for (auto& b : blocks_) {
    for (size_t i = 0; i < kSlotsPerBlock; ++i) {
      if (!b->free_at(i)) continue;
      b->owner[i].reset();
      b->passed[i].reset();
      *value = ++b->values[i];  // above what the slot holds: the wait holds until released
      *block = b.get();
      *index = i;
      return reinterpret_cast<uint64_t*>(b->win->base) + i;
    }
  }
  blocks_.push_back(std::make_unique<SlotBlock>());
  return take_slot(value, block, index);
}

void NotificationInbox::release(WaitState& w, Code code, const std::string& error) {
  if (w.slot != nullptr) __atomic_store_n(w.slot, w.value, __ATOMIC_RELEASE);  // the stream goes on
  w.released = true;
  w.code = code;
  w.error = error;
  w.bound.reset();
  if (w.on_release) {
    w.on_release(w);  // (its owner reports a failure)
    w.on_release = nullptr;
  } else if (code != Code::kOk && !w.host) {
    FXM_WARN(-1, error);  // a host wait throws it to its caller
  }
  sync_->cv.notify_all();
  agent_->bell_->ring();  // a host wait sleeps on the doorbell
}

bool NotificationInbox::match(const Notification& n) {
  for (auto it = pending_.begin(); it != pending_.end(); ++it) {
    WaitState& w = **it;
    if ((!w.any_bytes && w.bytes != n.bytes) || (!w.peer.empty() && w.peer != n.peer)) continue;
    w.sender = n.peer;
    w.got = n;
    release(w, Code::kOk, "");
    pending_.erase(it);
    return true;
  }
  return false;
}

// `gone`: what each connection said before it was drained (a notification it
// delivered before it went still counts).
void NotificationInbox::check_failures(const std::vector<std::shared_ptr<Connection>>& conns,
                                       const std::vector<std::string>& gone) {
  for (auto it = pending_.begin(); it != pending_.end();) {
    WaitState& w = **it;
    if (!w.peer.empty() && !w.bound) {  // the first connection of that peer the wait sees
      for (size_t i = 0; i < conns.size(); ++i) {
        if (conns[i]->peer().name == w.peer && gone[i].empty()) w.bound = conns[i];
      }
    }
    std::string lost;
    for (size_t i = 0; w.bound && i < conns.size(); ++i) {
      if (conns[i] == w.bound) lost = gone[i];
    }
    if (!lost.empty()) {
      std::string why = ": agent " + w.peer + " is gone before sending it (" + lost + ")";
      release(w, Code::kPeerLost, who() + what_wait(w) + why + stream_note(w));
    } else if (w.deadline.expired()) {
      std::string why = ": it did not arrive within the wait's timeout";
      release(w, Code::kTimeout, who() + what_wait(w) + why + stream_note(w));
    } else {
      ++it;
      continue;
    }
    it = pending_.erase(it);
  }
}

void NotificationInbox::poll() {
  drains_.fetch_add(1, std::memory_order_relaxed);
  std::vector<std::shared_ptr<Connection>> conns;
  {
    std::lock_guard<std::mutex> lock(agent_->mu_);
    conns = agent_->conns_;
  }
  for (const auto& w : pending_) {
    if (w->bound && std::find(conns.begin(), conns.end(), w->bound) == conns.end()) conns.push_back(w->bound);
  }
  std::vector<std::string> gone;
  for (const auto& c : conns) gone.push_back(c->gone());
  for (auto it = inbox_.begin(); !pending_.empty() && it != inbox_.end();) {  // unread ones first, in order
    it = match(*it) ? inbox_.erase(it) : std::next(it);
  }
  std::vector<Notification> got;
  for (const auto& c : conns) {
    c->take_notifications(&got);
    for (Notification& n : got) {
      if (!claimed(c, n) && !match(n)) inbox_.push_back(std::move(n));
    }
    got.clear();
  }
  check_failures(conns, gone);
}

bool NotificationInbox::claimed(const std::shared_ptr<Connection>& c, Notification& n) {
  for (auto& [prefix, fn] : claims_) {
    if (n.bytes.size() >= prefix.size() && std::equal(prefix.begin(), prefix.end(), n.bytes.begin())) return fn(c, n);
  }
  return false;
}

bool NotificationInbox::claim(std::vector<uint8_t> prefix, NotificationClaim fn) {
  std::lock_guard<std::mutex> lock(sync_->mu);
  auto it = std::find_if(claims_.begin(), claims_.end(), [&](const auto& c) { return c.first == prefix; });
  if (it != claims_.end()) return false;  // (its owner's unclaim would take a replacement out too)
  claims_.emplace_back(std::move(prefix), std::move(fn));
  if (!closing_) start_watcher();  // (it drains while a claim is installed)
  return true;
}

void NotificationInbox::unclaim(const std::vector<uint8_t>& prefix) {
  std::lock_guard<std::mutex> lock(sync_->mu);
  claims_.erase(std::remove_if(claims_.begin(), claims_.end(), [&](const auto& c) { return c.first == prefix; }),
                claims_.end());
}

void NotificationInbox::deliver(Notification n) {
  {
    std::lock_guard<std::mutex> lock(sync_->mu);
    if (!match(n)) inbox_.push_back(std::move(n));
  }
  agent_->bell_->ring();  // a take() asleep on the doorbell drains: finds it in inbox_
}

// The earliest deadline of the pending waits, and no later than kLookAtLeastEveryS (lock held).
Deadline NotificationInbox::next_look() const {
  Deadline d = Deadline::after_seconds(kLookAtLeastEveryS);
  for (const auto& w : pending_) d = d.min(w->deadline);
  return d;
}

// Drains and matches whenever the doorbell rang (a notification landed, a peer ended) or a wait's
// deadline came, while waits are pending or a claim is installed.
void NotificationInbox::watch() {
  std::unique_lock<std::mutex> lock(sync_->mu);
  while (!closing_) {
    if (pending_.empty() && claims_.empty()) {
      sync_->cv.wait(lock);
      continue;
    }
    uint64_t seen = agent_->bell_->rings();  // before the drain: a ring after it wakes the wait below
    poll();
    Deadline until = next_look();
    lock.unlock();
    agent_->bell_->wait(seen, until);
    lock.lock();
  }
}

NotificationWait NotificationInbox::stream_wait(const std::vector<uint8_t>& bytes, const std::string& peer,
                                                void* stream, double timeout_s) {
  auto w = std::make_shared<WaitState>();
  w->sync = sync_;
  w->bytes = bytes;
  w->peer = peer;
  w->deadline = Deadline::after_seconds(timeout_s > 0 ? timeout_s : agent_->timeout_s());
  std::unique_lock<std::mutex> lock(sync_->mu);
  if (closing_) fail(Code::kClosed, -1, 0, who() + "stream_wait_notification: the agent was closed");
  pending_.push_back(w);
  poll();  // one that arrived and is unread releases it now: nothing is queued
  if (w->released) return NotificationWait(w);
  SlotBlock* block = nullptr;
  uint64_t index = 0;
  uint64_t* slot = take_slot(&w->value, &block, &index);
  std::string why;
  cuda::SharedEvent passed;
  try {
    passed = queue_stream_wait(*block->win, index, w->value, stream, cuda::current_device(), &why);
  } catch (const Error& e) {
    pending_.erase(std::find(pending_.begin(), pending_.end(), w));
    fail(e.code(), -1, e.sys_errno(), who() + what_wait(*w) + ": " + e.what());
  }
  start_watcher();
  if (passed) {
    w->slot = slot;
    block->owner[index] = w;
    block->passed[index] = std::move(passed);
    return NotificationWait(w);
  }
  static std::once_flag logged;
  std::call_once(logged, [&] {
    FXM_WARN(-1, who() + "stream waits on notifications wait on the host: the driver has no stream memory "
                         "operations (" + why + ")");
  });
  sync_->cv.wait(lock, [&] { return w->released; });  // bounded by the wait's timeout
  return NotificationWait(w);
}

void NotificationInbox::start_watcher() {  // with the lock held
  if (!watcher_.joinable()) watcher_ = std::thread([this] {
    name_this_thread("fxm-streamwait");
    watch();
  });
  sync_->cv.notify_all();
  agent_->bell_->ring();  // a watcher asleep on the doorbell looks at the new wait's deadline
}

// A pending wait like a stream wait's, without a slot. This thread drains and matches itself each
// time the doorbell rings (no watcher between the arrival and it); whoever else drains the
// connections meanwhile (a notifications() call, the watcher of stream waits, another host wait)
// may release it instead, and rings the doorbell doing so.
Notification NotificationInbox::host_wait(const std::vector<uint8_t>* bytes, const std::string& peer,
                                          double timeout_s) {
  auto w = std::make_shared<WaitState>();
  w->sync = sync_;
  w->host = true;
  w->any_bytes = bytes == nullptr;
  if (bytes) w->bytes = *bytes;
  w->peer = peer;
  w->deadline = Deadline::after_seconds(timeout_s);
  std::unique_lock<std::mutex> lock(sync_->mu);
  if (closing_) fail(Code::kClosed, -1, 0, who() + "wait_notification: the agent was closed");
  pending_.push_back(w);
  Clock::time_point since = Clock::now();
  bool reading = false;
  while (true) {  // bounded by the wait's deadline (poll() releases it then), and by close
    uint64_t seen = agent_->bell_->rings();  // before the drain: a ring after it wakes the wait below
    poll();  // one that arrived and is unread matches at once
    if (w->released) break;
    Deadline until = w->deadline.min(Deadline::after_seconds(kLookAtLeastEveryS));
    lock.unlock();
    await_news(peer, seen, until, since, &reading, Backoff::kSpin);
    lock.lock();
  }
  if (w->code != Code::kOk) fail(w->code, -1, 0, w->error);
  return std::move(w->got);
}

std::shared_ptr<WaitState> NotificationInbox::watch_for(const std::vector<uint8_t>& bytes,
                                                        std::shared_ptr<Connection> conn, double timeout_s,
                                                        std::function<void(const WaitState&)> on_release) {
  auto w = std::make_shared<WaitState>();
  w->sync = sync_;
  w->bytes = bytes;
  w->peer = conn->peer().name;
  w->bound = std::move(conn);  // this connection, not the first of that name the inbox sees
  w->deadline = Deadline::after_seconds(timeout_s);
  w->on_release = std::move(on_release);
  std::lock_guard<std::mutex> lock(sync_->mu);
  if (closing_) fail(Code::kClosed, -1, 0, who() + "a watch for a notification: the agent was closed");
  pending_.push_back(w);
  poll();  // one that arrived and is unread releases it now
  if (!w->released) start_watcher();
  return w;
}

bool NotificationInbox::withdraw(const std::shared_ptr<WaitState>& w) {
  std::lock_guard<std::mutex> lock(sync_->mu);
  auto it = std::find(pending_.begin(), pending_.end(), w);
  if (it == pending_.end()) return false;
  pending_.erase(it);
  w->on_release = nullptr;
  return true;
}

void NotificationInbox::wake() {
  woken_.store(true, std::memory_order_release);
  agent_->bell_->ring();
}

void NotificationInbox::unread(std::vector<Notification> ns) {
  if (ns.empty()) return;
  {
    std::lock_guard<std::mutex> lock(sync_->mu);
    inbox_.insert(inbox_.begin(), std::make_move_iterator(ns.begin()), std::make_move_iterator(ns.end()));
  }
  agent_->bell_->ring();  // a wait that found the inbox empty meanwhile (await_any) finds them now
}

std::vector<std::shared_ptr<Connection>> NotificationInbox::connections_of(const std::string& peer) const {
  std::vector<std::shared_ptr<Connection>> out;
  std::lock_guard<std::mutex> lock(agent_->mu_);
  for (const auto& c : agent_->conns_) {
    if (peer.empty() || c->peer().name == peer) out.push_back(c);
  }
  return out;
}

void NotificationInbox::await_news(const std::string& peer, uint64_t seen, const Deadline& until,
                                   Clock::time_point since, bool* reading, std::chrono::microseconds watch_bell) {
  std::vector<std::shared_ptr<Connection>> conns;
  auto read_for = std::max<std::chrono::microseconds>(Engine::kHelpSpin, watch_bell);  // it spins that long anyway
  if (*reading || Clock::now() - since < read_for) conns = connections_of(peer);
  while (!conns.empty() && Clock::now() - since < read_for && !until.expired()) {
    *reading = true;
    bool read = false;
    for (const auto& c : conns) read = c->help_read() || read;
    if (read || agent_->bell_->rings() != seen) return;  // something came: drain it
    std::this_thread::yield();
  }
  // This thread reads no more: the progress thread does. Also when the spin ended in an earlier
  // call that returned with a frame read (an ack, say, not the notification awaited): without it
  // the progress thread stayed parked, and the notification waited for its 1 ms timer.
  for (const auto& c : conns) c->unpark();
  *reading = false;
  while (Clock::now() - since < watch_bell && !until.expired()) {
    if (agent_->bell_->rings() != seen) return;
    std::this_thread::yield();
  }
  agent_->bell_->wait(seen, until);
}

std::vector<Notification> NotificationInbox::take(double timeout_s, size_t most) {
  std::vector<Notification> out;
  wait_for_any(timeout_s, &out, most);
  return out;
}

bool NotificationInbox::await_any(double timeout_s) { return wait_for_any(timeout_s, nullptr, 0); }

// Drains, and waits for the doorbell, until the inbox holds something (its first `most` moved
// into *out where out is given), the deadline passed, the agent closed or wake() was called.
bool NotificationInbox::wait_for_any(double timeout_s, std::vector<Notification>* out, size_t most) {
  Deadline d = Deadline::after_seconds(std::max(0.0, timeout_s));
  Clock::time_point since = Clock::now();
  bool reading = false;
  while (true) {
    uint64_t seen = agent_->bell_->rings();  // before the drain: a ring after it wakes the wait below
    {
      std::unique_lock<std::mutex> lock(sync_->mu);
      poll();
      if (!inbox_.empty()) {
        if (out != nullptr) {
          auto end = inbox_.begin() + static_cast<std::ptrdiff_t>(std::min(most, inbox_.size()));
          out->assign(std::make_move_iterator(inbox_.begin()), std::make_move_iterator(end));
          inbox_.erase(inbox_.begin(), end);
        }
        return true;
      }
    }
    if (d.expired() || agent_->closed() || woken_.exchange(false, std::memory_order_acq_rel)) return false;
    sweep();
    await_news("", seen, d.min(Deadline::after_seconds(kLookAtLeastEveryS)), since, &reading);
  }
}

// A connection counts as ended only once its peer's last frame was read (a loss or its goodbye),
// so what it holds then is all it will ever hold: kept here before it leaves the table.
bool NotificationInbox::sweep(bool wait) {
  std::vector<std::shared_ptr<Connection>> dead;
  {
    std::unique_lock<std::mutex> lock(sync_->mu, std::defer_lock);
    if (!wait && !lock.try_lock()) return false;
    if (wait) lock.lock();
    if (closing_) return true;
    dead = agent_->take_ended();
    std::vector<Notification> got;
    for (const auto& c : dead) c->take_notifications(&got);
    for (Notification& n : got) {
      if (!match(n)) inbox_.push_back(std::move(n));
    }
  }
  for (auto& c : dead) {  // its threads and sockets end now, off this thread (its engine's stop may
    std::string why = c->gone();  // wait for a hung peer); later calls on it read why it ended
    agent_->closer_->close(c, why.empty() ? "the peer was lost" : why);
  }
  return true;
}

void NotificationInbox::close() {
  {
    std::lock_guard<std::mutex> lock(sync_->mu);
    if (closing_) return;
    closing_ = true;
    for (auto& w : pending_) {
      std::string why = ": the agent was closed with the wait pending";
      release(*w, Code::kClosed, who() + what_wait(*w) + why + stream_note(*w));
    }
    pending_.clear();
    claims_.clear();
    sync_->cv.notify_all();
  }
  agent_->bell_->ring();  // a take() asleep on the doorbell returns
  if (watcher_.joinable()) watcher_.join();
  Deadline d = Deadline::after_seconds(kCloseWaitS);
  for (auto& b : blocks_) {
    if (stream_waits_passed(*b->win, d)) continue;
    b->keep = true;
    FXM_ERROR(-1, who() + "close: a stream has not passed its wait on a notification slot after " +
                      std::to_string(kCloseWaitS) + " s (its earlier work is still running?): the slots stay mapped");
  }
}

// ------------------------------------------------------------ NotificationWait

bool NotificationWait::done() const {
  std::lock_guard<std::mutex> lock(s_->sync->mu);
  return s_->released;
}

void NotificationWait::wait(double timeout_s) const {
  check_call_timeout(timeout_s, "wait: timeout");
  std::unique_lock<std::mutex> lock(s_->sync->mu);
  auto released = [&] { return s_->released; };
  if (timeout_s > 0 && std::isfinite(timeout_s)) {
    auto until = std::chrono::duration<double>(timeout_s);
    if (!s_->sync->cv.wait_for(lock, until, released)) {
      fail(Code::kTimeout, -1, 0, what_wait(*s_) + ": still pending after " + std::to_string(timeout_s) + " s");
    }
  } else {
    s_->sync->cv.wait(lock, released);
  }
  if (s_->code != Code::kOk) fail(s_->code, -1, 0, s_->error);
}

std::string NotificationWait::error() const {
  std::lock_guard<std::mutex> lock(s_->sync->mu);
  return s_->error;
}

std::string NotificationWait::sender() const {
  std::lock_guard<std::mutex> lock(s_->sync->mu);
  return s_->sender;
}

}  // namespace fxm::agent
