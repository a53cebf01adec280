#include "transport/cma/iov_batch.h"

#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <map>
#include <utility>

#include "transport/byte_ranges.h"

namespace fxm::cma {
namespace {

// Moves `skip` bytes past the front of iovs [*at, end), as a call that moved them leaves it.
void advance(iovec* iov, size_t* at, size_t skip) {
  while (skip > 0) {
    size_t step = std::min(skip, iov[*at].iov_len);
    iov[*at].iov_base = static_cast<char*>(iov[*at].iov_base) + step;
    iov[*at].iov_len -= step;
    skip -= step;
    if (iov[*at].iov_len == 0) ++*at;
  }
}

}  // namespace

bool IovBatch::add(pid_t pid, bool is_read, uint8_t* local, uint64_t remote_addr, uint64_t len) {
  if (!ops_.empty() && (pid != pid_ || is_read != is_read_)) return false;
  pid_ = pid;
  is_read_ = is_read;
  ops_.push_back({local, remote_addr, len});
  return true;
}

// The written ranges only: what a call reads from the other side may overlap.
bool IovBatch::any_overlap() const {
  std::vector<ByteSpan> written;
  written.reserve(ops_.size());
  for (const Op& op : ops_) written.push_back({written_start(op), written_start(op) + op.len, true});
  return any_conflict(written);
}

size_t IovBatch::run_end(size_t from) const {
  // Into this very process (two agents of one process), an op's source may be an earlier op's
  // destination, which the written ranges do not see: one op per call, as before.
  if (pid_ == self_) return from + 1;
  size_t last = std::min(ops_.size(), from + kMaxIov);
  if (!overlap_) return last;
  ByteRanges written;
  size_t i = from;
  for (; i < last; ++i) {
    uint64_t a = written_start(ops_[i]), b = a + ops_[i].len;
    if (i > from && written.overlaps(a, b)) break;
    written.add(a, b);
  }
  return i;
}

int IovBatch::issue_run(size_t from, size_t to, size_t* done) {
  iovec local[kMaxIov], remote[kMaxIov];
  size_t n = to - from;
  for (size_t k = 0; k < n; ++k) {
    const Op& op = ops_[from + k];
    local[k] = {op.local, op.len};
    remote[k] = {reinterpret_cast<void*>(op.remote), op.len};
  }
  size_t at = 0;  // the first op (of the run) not wholly moved; local and remote advance alike
  while (true) {
    while (at < n && local[at].iov_len == 0) ++at;  // (an empty op is done)
    if (at == n) break;
    ssize_t got = is_read_ ? process_vm_readv(pid_, local + at, n - at, remote + at, n - at, 0)
                           : process_vm_writev(pid_, local + at, n - at, remote + at, n - at, 0);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) {
      *done = from + at;
      return got < 0 ? errno : EFAULT;
    }
    size_t remote_at = at;
    advance(local, &at, static_cast<size_t>(got));
    advance(remote, &remote_at, static_cast<size_t>(got));
  }
  *done = to;
  return 0;
}

size_t IovBatch::issue(int* err) {
  *err = 0;
  overlap_ = ops_.size() > 1 && any_overlap();
  size_t done = 0;
  while (done < ops_.size()) {
    size_t end = run_end(done);
    *err = issue_run(done, end, &done);
    if (*err != 0) break;
  }
  ops_.clear();
  return done;
}

}  // namespace fxm::cma
