// The wiring check after the legacy and ordered builds: over each send comm
// a rank sends {src, dst, build id}; over each recv comm it checks that the
// record came from the slot's peer. This is how a miswired mesh (a
// connection filed into another peer's slot) is detected. Buffers are
// registered when the adaptor wants it, and a NULL request is posted again.
#include "adaptor/build_state.h"

namespace fxm::adaptor {
namespace {

void check_slot(const Build& b, int p, const uint8_t* got) {
  wire::ConnHeader id;
  std::string why = decode_identity(got, b.build_id(), b.build_key(), b.rank(), b.nranks(), &id);
  if (!why.empty()) {
    b.fail_at(Code::kProtocol, p, "wiring check: recv slot " + std::to_string(p) + ": refused header (" + why + ")");
  }
  if (id.src != p || id.dst != b.rank()) {
    b.fail_at(Code::kProtocol, p, "miswired: recv slot " + std::to_string(p) + " holds rank " +
                                      std::to_string(id.src) + "'s connection (to rank " +
                                      std::to_string(id.dst) + ")");
  }
}

Transfer make(Build& b, void* comm, bool send, int peer) {
  Transfer t;
  t.comm = comm, t.send = send, t.peer = peer, t.size = kIdentitySize;
  t.data = b.buffer(kIdentitySize);  // outlives the comms
  t.mhandle = b.reg(comm, t.data, t.size, peer, "wiring check");
  return t;
}

[[noreturn]] void timed_out(const Build& b, const std::vector<Transfer>& sends, const std::vector<Transfer>& recvs) {
  int p = 0;
  while (sends[p].done && recvs[p].done) ++p;
  bool recv_missing = !recvs[p].done;
  std::string posted = (recv_missing ? recvs[p] : sends[p]).request ? "" : " (the adaptor never took the request)";
  b.check_deadline("wiring check: " + std::string(recv_missing ? "no identity arrived in recv slot "
                                                               : "identity not sent to rank ") +
                       std::to_string(p) + posted + " (the slot may hold a connection nobody sends on)",
                   p);
  b.fail_at(Code::kInternal, p, "wiring check timed out before the deadline");
}

}  // namespace

void wiring_check(Build& b) {
  int n = b.nranks();
  std::vector<Transfer> sends, recvs;
  for (int p = 0; p < n; ++p) {
    sends.push_back(make(b, b.send_comm(p), true, p));
    encode_identity(b.build_id(), b.build_key(), b.rank(), p, n, sends.back().data);
    recvs.push_back(make(b, b.recv_comm(p), false, p));
  }
  int pending = 2 * n, spins = 0;
  while (pending > 0) {
    bool progress = false;
    for (int p = 0; p < n; ++p) {
      bool sent = sends[p].step(b, "wiring check"), got = recvs[p].step(b, "wiring check");
      progress |= sent || got;
      if (sent && sends[p].done) --pending;
      if (got && recvs[p].done) {
        --pending;
        check_slot(b, p, recvs[p].data);
      }
    }
    if (pending == 0) break;
    if (b.deadline().expired()) timed_out(b, sends, recvs);
    if (progress) spins = 0;
    backoff(&spins);
  }
}

}  // namespace fxm::adaptor
