// The probe for a host without an RDMA NIC: onesided_real calls flagcxMeshProbeInstall() (with
// FXM_REAL_PROBE=1) before flagcxCommInitRank, which changes FlagCX's own socket adaptor in place
// (the exported flagcxNetSocket of libflagcx.so; every connection, message and close stays
// its own, and FlagCX still sees its socket adaptor) in the two things that let
// flagcxOneSideRegister get as far as building its full mesh there:
//   * iput / iget / iputSignal are set (FlagCX's one-sided path refuses an adaptor without
//     them before building anything); they move no data and return flagcxNotSupported;
//   * regMr accepts device memory and hands back a handle shaped like IB's (flagcxIbMrHandle
//     with one ibv_mr whose addr/length are the buffer's, keys 0), since flagcxOneSideRegister
//     reads the keys out of it; deregMr frees it (the socket adaptor's own ignore the handle).
// So through FlagCX's public API a registration builds the mesh (the patch's builder, over real
// sockets and FlagCX's bootstrap) and exchanges the windows' addresses; no one-sided op can
// then move bytes. For measuring the build on one host, never for real transfers.
#include <cstdio>
#include <cstdlib>

#include "flagcx_net_adaptor.h"
#include "ib_common.h"

extern struct flagcxNetAdaptor flagcxNetSocket;  // libflagcx.so's

namespace {

flagcxResult_t probeRegMr(void *, void *data, size_t size, int, int, void **mhandle) {
  auto *h = static_cast<flagcxIbMrHandle *>(calloc(1, sizeof(flagcxIbMrHandle)));
  auto *mr = static_cast<ibv_mr *>(calloc(1, sizeof(ibv_mr)));
  if (!h || !mr) {
    free(h);
    free(mr);
    return flagcxSystemError;
  }
  mr->addr = data;
  mr->length = size;
  h->mrs[0] = mr;
  *mhandle = h;
  return flagcxSuccess;
}

flagcxResult_t probeDeregMr(void *, void *mhandle) {
  auto *h = static_cast<flagcxIbMrHandle *>(mhandle);
  if (h) {
    free(h->mrs[0]);
    free(h);
  }
  return flagcxSuccess;
}

flagcxResult_t noRdma(const char *what) {
  static bool said = false;
  if (!said) fprintf(stderr, "probe: %s: no RDMA on this host, no data moved\n", what);
  said = true;
  return flagcxNotSupported;
}
flagcxResult_t probeIput(void *, uint64_t, uint64_t, size_t, int, int, void **, void **, void **) {
  return noRdma("iput");
}
flagcxResult_t probeIget(void *, uint64_t, uint64_t, size_t, int, int, void **, void **, void **) {
  return noRdma("iget");
}
flagcxResult_t probeIputSignal(void *, uint64_t, uint64_t, size_t, int, int, void **, void **, uint64_t, void **,
                               uint64_t, void **) {
  return noRdma("iputSignal");
}

}  // namespace

extern "C" void flagcxMeshProbeInstall(void) {
  flagcxNetSocket.regMr = probeRegMr;
  flagcxNetSocket.deregMr = probeDeregMr;
  flagcxNetSocket.iput = probeIput;
  flagcxNetSocket.iget = probeIget;
  flagcxNetSocket.iputSignal = probeIputSignal;
}
