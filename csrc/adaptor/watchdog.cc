#include "adaptor/watchdog.h"
#include "base/thread_name.h"

namespace fxm::adaptor {

Watchdog::Watchdog(const flagcx_mesh_bootstrap_ops_t& boot, const Deadline& deadline)
    : boot_(boot), deadline_(deadline) {
  if (boot_.abort) thread_ = std::thread([this] {
    name_this_thread("fxm-watchdog");
    run();
  });
}

void Watchdog::stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void Watchdog::run() {
  std::unique_lock<std::mutex> lock(mu_);
  if (cv_.wait_until(lock, deadline_.at(), [this] { return stopping_; })) return;
  // Past the deadline. Outside a bootstrap call the build notices the
  // deadline itself; inside one only the hook can get it out.
  while (!stopping_) {
    if (in_call_.load()) {
      aborted_.store(true);  // before the hook: the call it ends reads it at once
      boot_.abort(boot_.ctx);  // its result changes nothing: the build fails either way
      return;
    }
    cv_.wait_for(lock, std::chrono::milliseconds(5), [this] { return stopping_; });
  }
}

}  // namespace fxm::adaptor
