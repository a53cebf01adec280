// Who holds an agent name (docs/agent.md, "Names"). A peer that proved the
// secret under a name one of this agent's open connections carries with another
// incarnation is either that agent restarted (its old process died or hangs) or
// a second live agent of that name. A NameProbe pings each such connection
// (Engine::ping: the peer's engine answers at once, whatever it is doing) and
// says which: kAlive as soon as one answered, kGone once every one has ended or
// none answered within its limit. step() never blocks: the listener polls it
// between its other work; a connector's thread loops on it.
//
// Closer: closes connections off the caller's thread. A connection's close stops
// its engine, which waits (about a second) for a hung peer to take its goodbye;
// the listener retires a superseded connection (ended at once) and hands the
// close here rather than wait itself. Its thread runs while closes are queued
// (an idle agent keeps no thread for it).
#pragma once

#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "agent/agent.h"

namespace fxm::agent {

class NameProbe {
 public:
  static constexpr double kLimitS = 2.0;  // a live agent answers in microseconds; a hung one never
  enum class Verdict { kPending, kAlive, kGone };
  NameProbe(std::vector<std::shared_ptr<Connection>> rivals, const Deadline& deadline);
  Verdict step();
  const Deadline& deadline() const { return deadline_; }
  // Why a newcomer `p` is refused, naming the incarnation that answered (after kAlive).
  std::string refusal(const PeerInfo& p) const;

 private:
  struct Rival {
    std::shared_ptr<Connection> conn;
    bool pinged = false;
    uint64_t mark = 0;
  };
  std::vector<Rival> rivals_;
  Deadline deadline_;
  const Connection* alive_ = nullptr;
};

class Closer {
 public:
  ~Closer() { stop(); }
  void close(std::shared_ptr<Connection> c, std::string why);
  void stop();  // closes what is queued, then joins its thread (idempotent)

 private:
  void run();
  std::mutex mu_;
  std::deque<std::pair<std::shared_ptr<Connection>, std::string>> queue_;
  std::thread thread_;
  bool running_ = false;  // thread_ takes the queue (once false, thread_ has left the lock for good)
  bool stopping_ = false;
};

}  // namespace fxm::agent
