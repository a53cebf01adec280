#include "bootstrap/exit_wait.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>

#include "base/env.h"
#include "base/log.h"
#include "bootstrap/client.h"

namespace fxm::bootstrap {
namespace {

constexpr double kNoticeAfterS = 2.0;  // a wait this long is said on stderr
constexpr double kStopDrainS = 2.0;    // for a root told to stop to finish

// The roots and clients of this process. Never freed: the exit handler uses it
// after static destructors may have run.
struct Registry {
  pid_t pid = ::getpid();
  std::mutex mu;
  std::vector<std::shared_ptr<RootLife>> roots;
  std::vector<Client*> clients;
};

std::atomic<Registry*> g_registry{nullptr};
std::atomic<bool> g_handler{false};

// This process's registry. A child after fork() starts its own: the parent's
// roots have no thread here, and its lock may be held by one that vanished.
Registry* registry() {
  Registry* r = g_registry.load(std::memory_order_acquire);
  while (r == nullptr || r->pid != ::getpid()) {
    Registry* fresh = new Registry;
    if (g_registry.compare_exchange_strong(r, fresh, std::memory_order_acq_rel)) return fresh;
    delete fresh;  // another thread installed one; r now holds it
  }
  return r;
}

void at_exit() { wait_for_roots_at_exit(); }

void register_handler_once() {
  if (g_handler.exchange(true)) return;
  // Built before the handler is registered, so destroyed after it has run.
  (void)env_config();
  std::atexit(at_exit);
}

std::string seconds(double s) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.1f s", s);
  return buf;
}

// The roots' ranks still connected, for a log line.
std::string who_is_connected(const std::vector<std::shared_ptr<RootLife>>& roots) {
  std::string s;
  for (const auto& root : roots) {
    std::vector<int> ranks = root->connected();
    if (ranks.empty()) continue;
    s += (s.empty() ? "" : "; ") + std::string("ranks ") + rank_list(ranks) + " of mesh " + root->mesh_hex();
  }
  return s;
}

void give_up(RootLife& root, double waited) {
  std::string ranks = rank_list(root.connected());
  FXM_WARN(-1, "process exit: gave up after " + seconds(waited) + " (the ranks' build timeout): ranks " +
                   ranks + " are still connected to the bootstrap root of mesh " + root.mesh_hex() +
                   " that this process hosts (it made the unique id); they will find the root gone");
  root.request_stop("the process hosting the bootstrap root of mesh " + root.mesh_hex() +
                    " (the one that made the unique id) exits: it waited " + seconds(waited) +
                    " for ranks " + ranks + " to leave the root");
  root.wait_done(Deadline::after_seconds(kStopDrainS));
}

}  // namespace

void RootLife::joined(int rank, double timeout_s) {
  std::lock_guard<std::mutex> lock(mu_);
  connected_.insert(rank);
  timeout_s_ = std::max(timeout_s_, timeout_s);
}

void RootLife::left(int rank) {
  std::lock_guard<std::mutex> lock(mu_);
  if (connected_.erase(rank) && connected_.empty()) cv_.notify_all();
}

void RootLife::done() {
  std::lock_guard<std::mutex> lock(mu_);
  done_ = true;
  cv_.notify_all();
}

std::string RootLife::stop_reason() const {
  std::lock_guard<std::mutex> lock(mu_);
  return why_;
}

double RootLife::timeout_s() const {
  std::lock_guard<std::mutex> lock(mu_);
  return timeout_s_;
}

std::vector<int> RootLife::connected() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (done_) return {};
  return {connected_.begin(), connected_.end()};
}

bool RootLife::wait_left(const Deadline& until) {
  std::unique_lock<std::mutex> lock(mu_);
  return cv_.wait_until(lock, until.at(), [&] { return done_ || connected_.empty(); });
}

void RootLife::request_stop(const std::string& why) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    why_ = why;
  }
  stop_.store(true, std::memory_order_release);
}

bool RootLife::wait_done(const Deadline& until) {
  std::unique_lock<std::mutex> lock(mu_);
  return cv_.wait_until(lock, until.at(), [&] { return done_; });
}

bool RootLife::is_done() const {
  std::lock_guard<std::mutex> lock(mu_);
  return done_;
}

std::shared_ptr<RootLife> track_root(const std::string& mesh_hex) {
  register_handler_once();
  auto life = std::make_shared<RootLife>(mesh_hex);
  Registry* r = registry();
  std::lock_guard<std::mutex> lock(r->mu);
  auto finished = [](const std::shared_ptr<RootLife>& l) { return l->is_done(); };
  r->roots.erase(std::remove_if(r->roots.begin(), r->roots.end(), finished), r->roots.end());
  r->roots.push_back(life);
  return life;
}

void track_client(Client* c) {
  Registry* r = registry();
  std::lock_guard<std::mutex> lock(r->mu);
  r->clients.push_back(c);
}

void untrack_client(Client* c) {
  Registry* r = registry();
  std::lock_guard<std::mutex> lock(r->mu);
  r->clients.erase(std::remove(r->clients.begin(), r->clients.end(), c), r->clients.end());
}

void wait_for_roots_at_exit() {
  Registry* r = g_registry.load(std::memory_order_acquire);
  if (r == nullptr || r->pid != ::getpid()) return;
  std::vector<std::shared_ptr<RootLife>> roots;
  {
    std::lock_guard<std::mutex> lock(r->mu);
    for (Client* c : r->clients) c->leave_at_exit();  // this process's ranks go away now
    roots = r->roots;
  }
  double bound = 0;
  for (const auto& root : roots) bound = std::max(bound, root->timeout_s());
  Clock::time_point t0 = Clock::now();
  Deadline deadline = Deadline::after_seconds(bound);
  Deadline notice = Deadline::after_seconds(kNoticeAfterS).min(deadline);
  bool noticed = false;
  for (const auto& root : roots) {
    while (!root->wait_left(noticed ? deadline : notice) && !deadline.expired()) {
      FXM_WARN(-1, "process exit waits up to " + seconds(deadline.seconds_left()) + " more for " +
                       who_is_connected(roots) + ", still connected to the bootstrap root this process hosts " +
                       "(it made the unique id)");
      noticed = true;
    }
  }
  for (const auto& root : roots) {
    if (!root->connected().empty()) give_up(*root, seconds_since(t0));
  }
}

std::string rank_list(const std::vector<int>& ranks) {
  std::string s;
  for (size_t i = 0; i < ranks.size() && i < 32; ++i) s += (i ? ", " : "") + std::to_string(ranks[i]);
  if (ranks.size() > 32) s += ", ... (" + std::to_string(ranks.size()) + " ranks)";
  return "[" + s + "]";
}

}  // namespace fxm::bootstrap
