// A bootstrap shaped like FlagCX's (bootstrapRecv has no deadline and never
// learns that a peer died), over flagcx_mesh's own bootstrap: recv ignores
// the build's timeout and the own bootstrap's "peer lost", and waits until
// the message comes or abort() is called. With abort_hook the ops carry
// abort(); without, they have none, as a 0.2 caller's would.
// Thread-safety: abort() may be called from any thread while recv blocks.
#pragma once

#include <atomic>

#include "flagcx_mesh.h"

namespace fxm::adaptor {

class NoDeadlineBoot {
 public:
  NoDeadlineBoot(const flagcx_mesh_bootstrap_ops_t& inner, bool abort_hook);
  const flagcx_mesh_bootstrap_ops_t& ops() const { return ops_; }
  bool aborted() const { return aborted_.load(); }

 private:
  static int allgather(void* ctx, void* data, size_t bytes, double timeout_s);
  static int send(void* ctx, int peer, int tag, const void* data, size_t size, double timeout_s);
  static int recv(void* ctx, int peer, int tag, void* data, size_t size, double timeout_s);
  static int abort(void* ctx);

  flagcx_mesh_bootstrap_ops_t inner_;
  flagcx_mesh_bootstrap_ops_t ops_{};
  std::atomic<bool> aborted_{false};
};

}  // namespace fxm::adaptor
