// Stream waits on notifications (docs/agent.md, "Stream waits on notifications").
//
// A wait is a slot of a host-shared signal window (core/window.h) and the
// mesh's cuStreamWaitValue64 on it (queue_stream_wait): later work on the
// stream runs once the slot reached the wait's value. The agent's one
// notification inbox matches arriving notifications against pending waits
// (exact bytes, optionally from one peer, oldest wait first) and releases a
// wait by storing its value in the slot. A wait is released also when its
// timeout passes, when the peer it waits for is lost or closes, or when the
// agent closes: the stream always proceeds, and the wait's error says why.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "agent/agent.h"
#include "base/status.h"

namespace fxm::agent {

// What one stream wait is at: pending, released by its notification, or released by a failure.
struct WaitSync {
  std::mutex mu;                // the inbox's state and every wait's
  std::condition_variable cv;   // a wait was released
};

struct WaitState {
  std::shared_ptr<WaitSync> sync;
  std::vector<uint8_t> bytes;
  bool any_bytes = false;  // a host wait for the next notification of `peer`, whatever its bytes
  bool host = false;       // a host wait (Agent::wait_notification): no stream involved
  std::string peer;  // "" : from any peer
  Deadline deadline;
  std::shared_ptr<Connection> bound;  // the peer's connection the wait follows (peer set)
  uint64_t* slot = nullptr;           // null: no stream wait queued (host fallback, or matched at once)
  uint64_t value = 0;                 // what releases the slot
  bool released = false;
  Code code = Code::kOk;
  std::string error;   // "" once released by its notification
  std::string sender;  // who sent the matching notification
  Notification got;    // the matching notification (host waits)
  // A watch (NotificationInbox::watch_for): run once, as it is released (the inbox's lock held: it
  // must be short and take no lock that is held while calling into the inbox).
  std::function<void(const WaitState&)> on_release;
};

// The user's view of a wait (Python NotificationWait, C flagcx_mesh_agent_handle_t).
class NotificationWait {
 public:
  explicit NotificationWait(std::shared_ptr<WaitState> s) : s_(std::move(s)) {}
  bool done() const;
  // Waits on the host until the wait was released (timeout_s <= 0: until then,
  // which its own timeout bounds), then throws its failure, if any.
  void wait(double timeout_s) const;
  std::string error() const;   // "" while pending or once matched
  std::string sender() const;  // the peer whose notification released it ("" until then)

 private:
  std::shared_ptr<WaitState> s_;
};

// What a claim on a prefix of notifications does with one (NotificationInbox::claim): true takes
// it (it may move the notification out), false leaves it, untouched, for the waits and take().
using NotificationClaim = std::function<bool(const std::shared_ptr<Connection>& conn, Notification& n)>;

// The agent's notifications: drained from its connections (by notifications()
// and, while stream waits are pending or a claim is installed, by a watcher
// thread), offered to the claim of their prefix, then matched against pending
// waits, the rest kept for notifications() in arrival order.
class NotificationInbox {
 public:
  explicit NotificationInbox(Agent* agent);
  ~NotificationInbox();
  // Queues the wait on `stream` (of the current device) and returns at once.
  NotificationWait stream_wait(const std::vector<uint8_t>& bytes, const std::string& peer, void* stream,
                               double timeout_s);
  // Waits on the host (up to timeout_s, > 0) for the notification of `peer` with exactly
  // `bytes` (null: its next one) and returns it, consumed; throws as a stream wait's
  // wait() does (PeerLost naming the peer, Timeout, Closed).
  Notification host_wait(const std::vector<uint8_t>* bytes, const std::string& peer, double timeout_s);
  // A wait without a stream nor a thread waiting in it: `on_release` runs when the notification of
  // exactly `bytes` from the peer of `conn` arrives on it (one already here and unread: at once,
  // in this call), or with the wait's error when `conn` ends first, timeout_s passes (> 0) or the
  // agent closes. Nothing is logged: the owner reports the outcome.
  std::shared_ptr<WaitState> watch_for(const std::vector<uint8_t>& bytes, std::shared_ptr<Connection> conn,
                                   double timeout_s, std::function<void(const WaitState&)> on_release);
  // Takes a watch out before it was released (its on_release never runs); false when it was released.
  bool withdraw(const std::shared_ptr<WaitState>& w);
  // Puts notifications read but not consumed back in front of the unread ones, in order.
  void unread(std::vector<Notification> ns);
  // Offers each notification drained from a connection whose bytes start with `prefix` to `fn`,
  // with the connection it came on, before any wait sees it; fn returning true consumes it. One
  // claim per prefix: false (nothing installed) while another holds it; prefixes should not be each other's prefix
  // (the first installed that matches is offered it). fn runs in whichever thread drains (the
  // watcher, which keeps draining while a claim is installed, or a take() or wait), with the
  // inbox's lock held: short, taking no lock that is held while calling into the inbox (the rule
  // of WaitState::on_release). Notifications already drained (unread, delivered) are not offered.
  bool claim(std::vector<uint8_t> prefix, NotificationClaim fn);
  // Takes the claim of `prefix` out: once it returns, its fn is not running and never runs again.
  void unclaim(const std::vector<uint8_t>& prefix);
  // A notification handed back (a claim took it, then could not use it): matched against the
  // pending waits, else kept for take() after the unread ones, and a take() waiting returns it now.
  void deliver(Notification n);
  // What arrived and no wait consumed (at most `most`, the first ones), waiting up to timeout_s
  // for the first, or until wake().
  std::vector<Notification> take(double timeout_s, size_t most = SIZE_MAX);
  // Waits as take() does, taking nothing: true once take() has something to return.
  bool await_any(double timeout_s);
  // Makes a take() waiting in another thread return now (with what is there, maybe nothing); with
  // none waiting, the next take() returns at once. Wakes do not add up.
  void wake();
  // Drops the connections whose peer is gone from the agent's table and closes them, keeping
  // the notifications they still hold (for take() and the waits). take() and the listener
  // (ten times a second) call it, so peers that come and go do not keep their sockets.
  // wait false (the listener): when another thread holds the inbox now (a take(), a stream
  // wait queuing on a stream), nothing is done and false returned; the listener never waits
  // on the inbox, so no call on it can keep the listener from its peers.
  bool sweep(bool wait = true);
  // The times a waiter drained the connections (AgentStats::notification_drains).
  uint64_t drains() const { return drains_.load(std::memory_order_relaxed); }
  // Releases every pending wait (kClosed) and stops the watcher; the slots stay
  // mapped while a stream still sits on one (bounded wait, then they are kept).
  void close();

 private:
  struct SlotBlock;
  void poll();  // with the lock held: drain, match, release what failed
  bool match(const Notification& n);
  bool claimed(const std::shared_ptr<Connection>& c, Notification& n);  // (lock held)
  bool wait_for_any(double timeout_s, std::vector<Notification>* out, size_t most);  // take() (out) or await_any() (none)
  void check_failures(const std::vector<std::shared_ptr<Connection>>& conns, const std::vector<std::string>& gone);
  void release(WaitState& w, Code code, const std::string& error);
  void start_watcher();
  Deadline next_look() const;
  // Without the inbox's lock: returns once there may be news for a wait that drained at doorbell
  // count `seen`, or at `until`. For the first Engine::kHelpSpin (or `watch_bell`, if longer)
  // since `since` it reads the connections of `peer` ("": all) itself (no wake-up of the progress
  // thread nor of this one when the notification comes then), later it sleeps on the doorbell. *reading: this wait read
  // the connections and has not handed them back to the progress thread yet (which may have
  // parked, leaving them to it: progress_poll.cc); handed back (Connection::unpark) before any sleep.
  // `watch_bell`: the wait reads, then looks at the doorbell, without sleeping until that long
  // after `since` (a blocking wait for one peer's notification: Backoff::kSpin, as the engine's
  // waiters spin), so that a notification that comes then costs no wake-up of this thread nor
  // of the progress thread (one over a GPU path comes after the write's copy, ~150 us between
  // two processes on one GPU); zero: it sleeps at once.
  void await_news(const std::string& peer, uint64_t seen, const Deadline& until, Clock::time_point since,
                  bool* reading, std::chrono::microseconds watch_bell = std::chrono::microseconds{0});
  std::vector<std::shared_ptr<Connection>> connections_of(const std::string& peer) const;
  uint64_t* take_slot(uint64_t* value, SlotBlock** block, uint64_t* index);
  void watch();
  std::string who() const;

  Agent* agent_;
  std::shared_ptr<WaitSync> sync_;
  std::deque<Notification> inbox_;
  std::deque<std::shared_ptr<WaitState>> pending_;  // oldest first
  std::vector<std::pair<std::vector<uint8_t>, NotificationClaim>> claims_;
  std::vector<std::unique_ptr<SlotBlock>> blocks_;
  std::thread watcher_;
  bool closing_ = false;
  std::atomic<bool> woken_{false};  // wake(): the next (or waiting) take() returns
  std::atomic<uint64_t> drains_{0};
};

}  // namespace fxm::agent
