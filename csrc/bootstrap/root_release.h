// Releasing a rendezvous root nobody uses: get_unique_id() starts a root
// thread and a listening port in this process; release_root(mesh id) ends it
// at once when no rank has joined it, so an id that is never used costs
// nothing until the idle bound (FLAGCX_MESH_ROOT_IDLE_TIMEOUT) expires.
// Thread-safety: any thread; the root's thread answers within one poll.
#pragma once

#include <condition_variable>
#include <memory>
#include <mutex>

#include "base/wire.h"

namespace fxm::bootstrap {

// Shared between one root's thread and the callers of release_root().
class RootRelease {
 public:
  // Root thread: true once release_root() asked to stop (checked every poll).
  bool requested();
  // Root thread: a rank has joined, so the request is declined (the root
  // lives on as usual).
  void decline();
  // Root thread, as it ends: whether it ended because of the release (no rank
  // had joined); wakes the caller of release_root().
  void finished(bool released);
  // release_root(): asks, then waits until the root has ended (or 2 s).
  bool request_and_wait();

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool requested_ = false;
  bool finished_ = false;
  bool declined_ = false;
  bool released_ = false;
};

// Registers a new root of this process under its mesh id.
std::shared_ptr<RootRelease> register_root(const wire::MeshId& id);
void unregister_root(const wire::MeshId& id);

// Ends the root of `id` if this process hosts it and no rank has joined it;
// true when it was ended here (thread gone, port closed), false when it is
// unknown, already ended, or in use (it then lives on as usual).
bool release_root(const wire::MeshId& id);

}  // namespace fxm::bootstrap
