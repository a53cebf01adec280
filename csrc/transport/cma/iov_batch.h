// The cma ops of one call to one peer process, moved together: one
// process_vm_writev / process_vm_readv per run of up to IOV_MAX ops (a local
// and a remote iovec each), not one system call per op. This is the host twin
// of cuda::CopyBatch (copy_batch.h): a path queues plain ops (Path::queue_host),
// the caller issues the batch and sends the ops that were not done over its
// fallback.
//
// Order. The kernel copies a call's iovecs one after the other, but says
// nothing of it; so, as for device copies, a run ends before an op that
// touches bytes an earlier op of the run writes (writes: the peer's bytes;
// reads: this process's), and runs follow each other. A later op over the
// same bytes therefore lands after the earlier one, as it did one call at a
// time. (Into this very process, where an op may read what an earlier one wrote, each op is a
// call of its own.)
//
// Partial transfers. process_vm_* may move fewer bytes than asked (a page of
// the peer that is not mapped, the kernel's cap per call): the batch goes on
// from the byte where the call stopped, and stops at the first call that
// fails; the ops from there on are reported as not done (the op that was cut
// short included: moved again whole elsewhere, it writes the same bytes).
#pragma once

#include <sys/types.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace fxm::cma {

class IovBatch {
 public:
  // The most iovecs one process_vm_* call takes (IOV_MAX on Linux).
  static constexpr size_t kMaxIov = 1024;
  // Queues an op; false when the batch holds ops to another process or of the other
  // direction (issue() them first).
  bool add(pid_t pid, bool is_read, uint8_t* local, uint64_t remote_addr, uint64_t len);
  size_t size() const { return ops_.size(); }
  // Moves every queued op, in order, and empties the batch. Returns how many ops were done:
  // all, unless a call failed (then *err is its errno, and that op and those after it were
  // not done, or not wholly).
  size_t issue(int* err);

 private:
  struct Op {
    uint8_t* local;
    uint64_t remote;
    uint64_t len;
  };
  // Where the run that starts at `from` ends: at most kMaxIov ops, none touching what an
  // earlier one of the run writes.
  size_t run_end(size_t from) const;
  bool any_overlap() const;  // some two ops of the batch touch the same written bytes
  // One run [from, to): 0, or the errno of the call that failed (*done: the ops done).
  int issue_run(size_t from, size_t to, size_t* done);
  uint64_t written_start(const Op& op) const { return is_read_ ? reinterpret_cast<uint64_t>(op.local) : op.remote; }

  pid_t pid_ = 0;
  pid_t self_ = ::getpid();
  bool is_read_ = false;
  bool overlap_ = false;  // issue(): some ops overlap, so runs are cut where they do
  std::vector<Op> ops_;
};

}  // namespace fxm::cma
