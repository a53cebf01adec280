#include "agent/name_probe.h"

#include <system_error>

#include "agent/connection.h"
#include "base/thread_name.h"

namespace fxm::agent {

NameProbe::NameProbe(std::vector<std::shared_ptr<Connection>> rivals, const Deadline& deadline)
    : deadline_(deadline) {
  for (auto& c : rivals) rivals_.push_back({std::move(c)});
}

// A rival that ended counts as gone; one whose lanes are still joining is pinged once it started.
NameProbe::Verdict NameProbe::step() {
  bool all_ended = true;
  for (Rival& r : rivals_) {
    if (r.conn->ended()) continue;
    all_ended = false;
    if (!r.conn->started()) continue;
    if (!r.pinged) {
      r.mark = r.conn->ping();
      r.pinged = true;
    } else if (r.conn->answered(r.mark)) {
      alive_ = r.conn.get();
      return Verdict::kAlive;
    }
  }
  return all_ended || deadline_.expired() ? Verdict::kGone : Verdict::kPending;
}

std::string NameProbe::refusal(const PeerInfo& p) const {
  const PeerInfo& held = alive_ ? alive_->peer() : p;
  return "agent " + p.name + " is alive here as incarnation " + incarnation_hex(held.incarnation) + " (" +
         held.address + ", it answered just now): a second agent named " + p.name +
         " is refused (a restarted one is admitted once its old incarnation's connection has ended or stops answering)";
}

// ------------------------------------------------------------ Closer

void Closer::close(std::shared_ptr<Connection> c, std::string why) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!stopping_) {
      queue_.emplace_back(std::move(c), std::move(why));
      if (running_) return;
      if (thread_.joinable()) thread_.join();  // the last one ended: it takes the lock no more
      try {
        thread_ = std::thread([this] {
          name_this_thread("fxm-closer");
          run();
        });
        running_ = true;
        return;
      } catch (const std::system_error&) {  // no thread to be had: closed here, as below
        c = std::move(queue_.back().first);
        why = std::move(queue_.back().second);
        queue_.pop_back();
      }
    }
  }
  c->close(why);  // the agent is closing (or no thread): here
}

void Closer::run() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    if (queue_.empty()) {
      running_ = false;
      return;
    }
    auto item = std::move(queue_.front());
    queue_.pop_front();
    lock.unlock();
    item.first->close(item.second);
    item.first.reset();  // its last reference may go here, off the lock
    lock.lock();
  }
}

void Closer::stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  if (thread_.joinable()) thread_.join();  // it closes what is queued first
}

}  // namespace fxm::agent
