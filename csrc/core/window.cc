#include "core/window.h"

#include <thread>

namespace fxm {

bool Window::wait_io(const Deadline& deadline) const {
  for (int spins = 0; io.load() != 0; ++spins) {
    if (deadline.expired()) return false;
    if (spins < 100) std::this_thread::yield();
    else std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  return true;
}

std::string Window::mode() const {
  // How this rank reaches the other ranks' copies: the most common path.
  // Remote paths first: "self" (or "cuda-self") only when every peer is in this process.
  int count[9] = {0, 0, 0, 0, 0, 0, 0, 0, 0};
  for (const PeerView& v : peers) ++count[static_cast<int>(v.path->kind())];
  PathKind best = kind == WindowKind::kDevice ? PathKind::kCudaSelf : PathKind::kSelf;
  int most = 0;
  for (PathKind p : {PathKind::kShm, PathKind::kCma, PathKind::kTcp, PathKind::kCudaVmm, PathKind::kCudaIpc,
                     PathKind::kStaged, PathKind::kUcx}) {
    if (count[static_cast<int>(p)] > most) {
      best = p;
      most = count[static_cast<int>(p)];
    }
  }
  return path_name(best);
}

std::string Window::describe() const {
  std::string s = "window #" + std::to_string(index) + " (" + kind_name(kind) + ", " +
                  std::to_string(size) + " bytes, mode " + mode() + "): ";
  for (size_t r = 0; r < peers.size(); ++r) {
    s += (r ? ", " : "") + std::string("peer ") + std::to_string(r) + " " + peers[r].path->name();
    if (!peers[r].why.empty()) s += " (" + peers[r].why + ")";
  }
  return s;
}

}  // namespace fxm
