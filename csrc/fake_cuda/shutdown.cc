// Process exit with stream work in flight. exit() tears down what the
// process's destructors free while the stream threads would still run; so the
// first stream registers a handler that, at exit, lets no further operation
// start (stream threads drop what is queued) and waits for the ones running
// to end. Long operations (a stream wait on a value or an event) return when
// they see the exit. The wait is bounded: a host function that blocks for
// ever must not keep the process from ending.
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <mutex>

#include "fake_cuda.h"

namespace fakecuda {
namespace {

constexpr auto kExitGrace = std::chrono::seconds(5);

struct Gate {
  std::mutex mu;
  std::condition_variable cv;
  std::atomic<bool> exiting{false};  // set under mu; read without it by long operations' polls
  int running = 0;  // stream operations in progress
  pid_t pid = 0;    // the process that registered the handler
};

Gate& gate() {
  static Gate* g = new Gate;  // never destroyed: stream threads may outlive exit()
  return *g;
}

void stop_stream_work_at_exit() {
  Gate& g = gate();
  std::unique_lock<std::mutex> lk(g.mu);
  if (g.pid != getpid()) return;  // a forked child: the threads counted are the parent's
  g.exiting = true;
  g.cv.wait_for(lk, kExitGrace, [&] { return g.running == 0; });
}

}  // namespace

void watch_process_exit() {
  static std::once_flag once;
  std::call_once(once, [] {
    gate().pid = getpid();
    std::atexit(stop_stream_work_at_exit);
  });
}

bool process_exiting() { return gate().exiting.load(); }

CUresult run_stream_op(const std::function<CUresult()>& op) {
  Gate& g = gate();
  {
    std::lock_guard<std::mutex> lk(g.mu);
    if (g.exiting) return kDeinitialized;  // dropped: the process is ending
    g.running++;
  }
  CUresult r = op();
  std::lock_guard<std::mutex> lk(g.mu);
  g.running--;
  g.cv.notify_all();
  return r;
}

}  // namespace fakecuda
