// FlagCX's full-mesh loop as shipped (flagcxOneSideBuildFullMesh): pairwise
// rounds with no synchronisation between ranks, each accept taking whatever
// connection is first in the listener's queue. Only a deadline is added, so
// that its hang is reported (naming the round, both peers and the missing
// side) instead of spinning forever. Kept to reproduce the race.
#include <sched.h>

#include "adaptor/build_state.h"

namespace fxm::adaptor {
namespace {

[[noreturn]] void report_hang(const Build& b, int round, int connect_peer, int accept_peer, bool have_send,
                              bool have_recv) {
  std::string missing;
  if (!have_send) missing = "sendComm (connect to rank " + std::to_string(connect_peer) + ") is still NULL";
  if (!have_recv) {
    missing += std::string(missing.empty() ? "" : " and ") + "recvComm (accept from rank " +
               std::to_string(accept_peer) + ") is still NULL";
  }
  std::string what = "hung in round " + std::to_string(round) + " (connectPeer " + std::to_string(connect_peer) +
                     ", acceptPeer " + std::to_string(accept_peer) + "): " + missing +
                     " (the known full-mesh race of this loop: accept takes whatever connection is"
                     " first in the queue, and the rounds are not synchronised)";
  b.check_deadline(what, have_send ? accept_peer : connect_peer);
  b.fail_at(Code::kInternal, connect_peer, "report_hang called before the deadline");
}

}  // namespace

void build_legacy(Build& b) {
  b.listen_and_gather();
  int r = b.rank(), n = b.nranks();
  for (int i = 0; i < n; ++i) {
    int connect_peer = (r + i) % n;
    int accept_peer = (r - i + n) % n;
    bool have_send = false;
    void* recv = nullptr;
    while (!have_send || recv == nullptr) {
      if (!have_send) have_send = b.step_connect(connect_peer, i);
      if (recv == nullptr) {
        recv = b.step_accept(i);
        if (recv) b.file_recv(accept_peer, recv);  // whatever came first: no identity to check
      }
      if (b.deadline().expired()) report_hang(b, i, connect_peer, accept_peer, have_send, recv != nullptr);
      sched_yield();
    }
  }
}

}  // namespace fxm::adaptor
