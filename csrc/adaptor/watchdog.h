// The build's watchdog over a bootstrap without deadlines: when the build's
// deadline passes while the build is blocked inside a bootstrap call, it
// calls the bootstrap's abort hook (once, from its own thread), so that the
// blocked call returns and the build fails with a message naming the peer it
// waited for. Without a hook no thread is started.
// Thread-safety: enter()/leave() are called by the build's thread only;
// stop() by that thread too, before the bootstrap may go away.
#pragma once

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <thread>

#include "base/clock.h"
#include "flagcx_mesh.h"

namespace fxm::adaptor {

class Watchdog {
 public:
  Watchdog(const flagcx_mesh_bootstrap_ops_t& boot, const Deadline& deadline);
  ~Watchdog() { stop(); }
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  // Bracket every bootstrap call of the build.
  void enter() { in_call_.store(true); }
  void leave() { in_call_.store(false); }
  // True from just before the hook is called.
  bool aborted() const { return aborted_.load(); }
  // Ends the thread; after it the hook is never called.
  void stop();

 private:
  void run();

  flagcx_mesh_bootstrap_ops_t boot_;
  Deadline deadline_;
  std::atomic<bool> in_call_{false}, aborted_{false};
  std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace fxm::adaptor
