// The wiring check after the legacy and ordered builds: over each send comm
// a rank sends {src, dst, build id}; over each recv comm it checks that the
// record came from the slot's peer. This is how a miswired mesh (a
// connection filed into another peer's slot) is detected.
#include "adaptor/build_state.h"

namespace fxm::adaptor {
namespace {

void check_slot(const Build& b, int p, const uint8_t* got) {
  wire::ConnHeader id;
  std::string why = decode_identity(got, b.build_id(), b.rank(), b.nranks(), &id);
  if (!why.empty()) {
    b.fail_at(Code::kProtocol, p, "wiring check: recv slot " + std::to_string(p) + ": refused header (" + why + ")");
  }
  if (id.src != p || id.dst != b.rank()) {
    b.fail_at(Code::kProtocol, p, "miswired: recv slot " + std::to_string(p) + " holds rank " +
                                      std::to_string(id.src) + "'s connection (to rank " +
                                      std::to_string(id.dst) + ")");
  }
}

}  // namespace

void wiring_check(Build& b) {
  int n = b.nranks();
  uint8_t* mine = b.buffer(kIdentitySize * static_cast<size_t>(n));  // outlive the comms
  uint8_t* got = b.buffer(kIdentitySize * static_cast<size_t>(n));
  std::vector<void*> sreq(static_cast<size_t>(n)), rreq(static_cast<size_t>(n));
  for (int p = 0; p < n; ++p) {
    uint8_t* out = mine + kIdentitySize * static_cast<size_t>(p);
    encode_identity(b.build_id(), b.rank(), p, n, out);
    sreq[p] = b.isend(b.send_comm(p), out, kIdentitySize, p, "wiring check");
    rreq[p] = b.irecv(b.recv_comm(p), got + kIdentitySize * static_cast<size_t>(p), kIdentitySize, p,
                      "wiring check");
  }
  int pending = 2 * n, spins = 0;
  while (pending > 0) {
    bool progress = false;
    for (int p = 0; p < n; ++p) {
      if (sreq[p] && b.test(sreq[p], p, "wiring check")) sreq[p] = nullptr, --pending, progress = true;
      if (rreq[p] && b.test(rreq[p], p, "wiring check")) {
        rreq[p] = nullptr, --pending, progress = true;
        check_slot(b, p, got + kIdentitySize * static_cast<size_t>(p));
      }
    }
    if (pending == 0) break;
    if (b.deadline().expired()) {
      int p = 0;
      while (!sreq[p] && !rreq[p]) ++p;
      b.check_deadline("wiring check: " + std::string(rreq[p] ? "no identity arrived in recv slot "
                                                              : "identity not sent to rank ") +
                           std::to_string(p) + " (the slot may hold a connection nobody sends on)",
                       p);
    }
    if (progress) spins = 0;
    backoff(&spins);
  }
}

}  // namespace fxm::adaptor
