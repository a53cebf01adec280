#include "bootstrap/root_release.h"

#include <chrono>
#include <map>

namespace fxm::bootstrap {
namespace {

std::mutex g_mu;
std::map<wire::MeshId, std::shared_ptr<RootRelease>>& roots() {
  static auto* m = new std::map<wire::MeshId, std::shared_ptr<RootRelease>>();  // outlives exit
  return *m;
}

}  // namespace

bool RootRelease::requested() {
  std::lock_guard<std::mutex> lock(mu_);
  return requested_;
}

void RootRelease::decline() {
  std::lock_guard<std::mutex> lock(mu_);
  requested_ = false;
  declined_ = true;
  cv_.notify_all();
}

void RootRelease::finished(bool released) {
  std::lock_guard<std::mutex> lock(mu_);
  finished_ = true;
  released_ = released;
  cv_.notify_all();
}

bool RootRelease::request_and_wait() {
  std::unique_lock<std::mutex> lock(mu_);
  if (finished_) return false;
  requested_ = true;
  declined_ = false;
  cv_.wait_for(lock, std::chrono::seconds(2), [this] { return finished_ || declined_; });
  requested_ = false;
  return finished_ && released_;
}

std::shared_ptr<RootRelease> register_root(const wire::MeshId& id) {
  auto r = std::make_shared<RootRelease>();
  std::lock_guard<std::mutex> lock(g_mu);
  roots()[id] = r;
  return r;
}

void unregister_root(const wire::MeshId& id) {
  std::lock_guard<std::mutex> lock(g_mu);
  roots().erase(id);
}

bool release_root(const wire::MeshId& id) {
  std::shared_ptr<RootRelease> r;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    auto it = roots().find(id);
    if (it == roots().end()) return false;
    r = it->second;
  }
  return r->request_and_wait();
}

}  // namespace fxm::bootstrap
