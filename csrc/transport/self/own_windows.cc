#include "transport/self/own_windows.h"

#include <mutex>
#include <vector>

namespace fxm {
namespace {

struct Table {
  std::mutex mu;
  std::vector<OwnWindow> wins;
};
Table& table() {
  static Table* t = new Table();  // never destroyed: windows may outlive static destruction
  return *t;
}

bool same(const OwnWindow& a, const OwnWindow& b) {
  return a.rank == b.rank && a.index == b.index && a.cookie == b.cookie && a.addr == b.addr && a.size == b.size;
}

}  // namespace

bool is_own_window(const OwnWindow& w) {
  Table& t = table();
  std::lock_guard<std::mutex> lock(t.mu);
  for (const OwnWindow& o : t.wins) {
    if (same(o, w)) return true;
  }
  return false;
}

void OwnWindowClaim::set(const OwnWindow& w) {
  reset();
  Table& t = table();
  std::lock_guard<std::mutex> lock(t.mu);
  t.wins.push_back(w);
  w_ = w;
  held_ = true;
}

void OwnWindowClaim::reset() {
  if (!held_) return;
  Table& t = table();
  std::lock_guard<std::mutex> lock(t.mu);
  for (size_t i = 0; i < t.wins.size(); ++i) {
    if (same(t.wins[i], w_)) {
      t.wins.erase(t.wins.begin() + static_cast<long>(i));
      break;
    }
  }
  held_ = false;
}

}  // namespace fxm
