#include "testing/no_deadline_boot.h"

#include <chrono>
#include <thread>

namespace fxm::adaptor {
namespace {

constexpr double kLong = 3600.0;  // "no deadline" for the calls that pass through
constexpr double kSlice = 0.05;   // recv polls the inner bootstrap this often
constexpr int kAbortedRc = FLAGCX_MESH_SYSTEM;

NoDeadlineBoot* boot_of(void* ctx) { return static_cast<NoDeadlineBoot*>(ctx); }

}  // namespace

NoDeadlineBoot::NoDeadlineBoot(const flagcx_mesh_bootstrap_ops_t& inner, bool abort_hook) : inner_(inner) {
  ops_.size = sizeof(ops_);
  ops_.ctx = this;
  ops_.rank = inner.rank;
  ops_.nranks = inner.nranks;
  ops_.allgather = &NoDeadlineBoot::allgather;
  ops_.send = &NoDeadlineBoot::send;
  ops_.recv = &NoDeadlineBoot::recv;
  ops_.abort = abort_hook ? &NoDeadlineBoot::abort : nullptr;
}

int NoDeadlineBoot::allgather(void* ctx, void* data, size_t bytes, double) {
  NoDeadlineBoot* b = boot_of(ctx);
  return b->inner_.allgather(b->inner_.ctx, data, bytes, kLong);
}

int NoDeadlineBoot::send(void* ctx, int peer, int tag, const void* data, size_t size, double) {
  NoDeadlineBoot* b = boot_of(ctx);
  return b->inner_.send(b->inner_.ctx, peer, tag, data, size, kLong);
}

int NoDeadlineBoot::recv(void* ctx, int peer, int tag, void* data, size_t size, double) {
  NoDeadlineBoot* b = boot_of(ctx);
  while (!b->aborted_.load()) {
    int rc = b->inner_.recv(b->inner_.ctx, peer, tag, data, size, kSlice);
    if (rc == FLAGCX_MESH_TIMED_OUT) continue;
    if (rc != FLAGCX_MESH_PEER_LOST) return rc;
    std::this_thread::sleep_for(std::chrono::duration<double>(kSlice));  // FlagCX would not know: wait on
  }
  return kAbortedRc;
}

int NoDeadlineBoot::abort(void* ctx) {
  boot_of(ctx)->aborted_.store(true);
  return 0;
}

}  // namespace fxm::adaptor
