// Ordered pairwise rounds. Round 0 is self. In round i > 0 a rank first tells
// its accept peer (rank - i) over the bootstrap that its round-i accept is
// next, then waits for the same word from its connect peer (rank + i), and
// only then connects. A listener therefore only ever receives the connection
// of the round whose token it sent: its FIFO accept queue never holds
// another round's connection, so taking the first one is always right.
// The token carries the build id, so a token left over from an earlier
// failed build (same tags) is recognised and skipped.
#include <cstring>

#include "adaptor/build_state.h"

namespace fxm::adaptor {
namespace {

struct Token {
  uint32_t magic;
  uint32_t round;
  int32_t src;
  int32_t pad;
  uint64_t build_id;
};
constexpr uint32_t kTokenMagic = 0x4b54'4d46;  // "FMTK"

void exchange_tokens(Build& b, int round, int connect_peer, int accept_peer) {
  Token mine{kTokenMagic, static_cast<uint32_t>(round), b.rank(), 0, b.build_id()};
  b.boot_send(accept_peer, b.tag(round), &mine, sizeof(mine), round);
  while (true) {
    Token got{};
    b.boot_recv(connect_peer, b.tag(round), &got, sizeof(got), round);
    if (got.magic != kTokenMagic || got.src != connect_peer || got.round != static_cast<uint32_t>(round)) {
      b.fail_at(Code::kProtocol, connect_peer, "round " + std::to_string(round) +
                                                   ": malformed readiness token from rank " +
                                                   std::to_string(connect_peer));
    }
    if (got.build_id == b.build_id()) return;  // else a stale token of an earlier build
  }
}

// The deadline passed inside a round. A connect that never completes went to
// a rank whose token said its accept was next: that rank is stuck further on
// (waiting for a rank beyond it, perhaps a lost one), which is said.
void report_stall(const Build& b, int round, int connect_peer, int accept_peer, bool have_send, bool have_recv) {
  std::string what = "round " + std::to_string(round) + ": ";
  if (!have_send) {
    what += "connect to rank " + std::to_string(connect_peer) + " not done";
    if (round > 0) {
      what += " (rank " + std::to_string(connect_peer) + " sent its readiness token but never took the "
              "connection: it is stuck further on, e.g. waiting for a lost rank)";
    }
  }
  if (!have_send && !have_recv) what += " and ";
  if (!have_recv) what += "accept from rank " + std::to_string(accept_peer) + " not done";
  b.check_deadline(what, have_send ? accept_peer : connect_peer);
}

void drive_round(Build& b, int round, int connect_peer, int accept_peer) {
  bool have_send = false, have_recv = false;
  int spins = 0;
  while (!have_send || !have_recv) {
    bool progress = false;
    if (!have_send) progress |= have_send = b.step_connect(connect_peer, round);
    if (!have_recv) {
      void* comm = b.step_accept(round);
      if (comm) b.file_recv(accept_peer, comm);
      progress |= have_recv = comm != nullptr;
    }
    if (have_send && have_recv) return;
    if (b.deadline().expired()) report_stall(b, round, connect_peer, accept_peer, have_send, have_recv);
    if (progress) spins = 0;
    backoff(&spins);
  }
}

}  // namespace

void build_ordered(Build& b) {
  b.listen_and_gather();
  int r = b.rank(), n = b.nranks();
  drive_round(b, 0, r, r);
  for (int i = 1; i < n; ++i) {
    int connect_peer = (r + i) % n;
    int accept_peer = (r - i + n) % n;
    exchange_tokens(b, i, connect_peer, accept_peer);
    drive_round(b, i, connect_peer, accept_peer);
  }
}

}  // namespace fxm::adaptor
