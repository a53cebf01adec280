// The rendezvous root is a thread of the process that made the unique id, so
// that process must not take it away from ranks that joined and still use it
// (a rank 0 that finishes first, under torchrun, MPI or a plain environment).
// At exit (std::atexit, registered by the first root), the process:
//   1. leaves the roots with its own ranks (BYE; a rank busy in another thread
//      has its connection shut down instead), since they are going away;
//   2. waits until every rank that joined one of its roots has left it (BYE,
//      or its connection closed), up to the ranks' build timeout from their
//      JOIN; after 2 s it says which ranks it waits for;
//   3. on expiry names the ranks still connected, tells them why the root goes
//      away, and lets the roots finish (a short drain).
// A root nobody joined is not waited for. A child after fork() does not wait
// for its parent's roots; _exit() and signals skip the wait.
#pragma once

#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "base/clock.h"

namespace fxm::bootstrap {

class Client;

// What the exit handler knows of one root; updated by the root's thread.
class RootLife {
 public:
  explicit RootLife(std::string mesh_hex) : mesh_hex_(std::move(mesh_hex)) {}

  // Root side.
  void joined(int rank, double timeout_s);
  void left(int rank);
  void done();  // the root's thread has finished
  bool stop_requested() const { return stop_.load(std::memory_order_acquire); }
  std::string stop_reason() const;

  // Exit side.
  const std::string& mesh_hex() const { return mesh_hex_; }
  double timeout_s() const;
  std::vector<int> connected() const;
  // True once no joined rank is connected (or the root finished); false when
  // `until` passed first.
  bool wait_left(const Deadline& until);
  void request_stop(const std::string& why);
  bool wait_done(const Deadline& until);
  bool is_done() const;

 private:
  const std::string mesh_hex_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::set<int> connected_;  // joined and not yet left, under mu_
  double timeout_s_ = 0;     // the longest build timeout a JOIN announced, under mu_
  bool done_ = false;        // under mu_
  std::string why_;          // under mu_
  std::atomic<bool> stop_{false};
};

// A new root's record; the first one registers the exit handler.
std::shared_ptr<RootLife> track_root(const std::string& mesh_hex);
// Clients of this process (they leave first at exit).
void track_client(Client* c);
void untrack_client(Client* c);

// The exit handler itself (also callable directly, e.g. by a test harness).
void wait_for_roots_at_exit();

// "[1, 5, 7]" (at most 32 ranks named, then "...") and the count.
std::string rank_list(const std::vector<int>& ranks);

}  // namespace fxm::bootstrap
