// A FlagCX net adaptor plugin (FLAGCX_NET_ADAPTOR_PLUGIN=libflagcx_mesh_probe_net.so) for a
// host without an RDMA NIC: FlagCX's own socket adaptor (every connection, message and close is
// flagcxNetSocket's), plus the two things that let flagcxOneSideRegister get as far as building
// its full mesh there:
//   * iput / iget / iputSignal are set (FlagCX's one-sided path refuses an adaptor without
//     them before building anything); they move no data and return flagcxNotSupported;
//   * regMr accepts device memory and hands back a handle shaped like IB's (flagcxIbMrHandle
//     with one ibv_mr whose addr/length are the buffer's, keys 0), since flagcxOneSideRegister
//     reads the keys out of it; deregMr frees it.
// So through FlagCX's public API a registration builds the mesh (the patch's builder, over real
// sockets and FlagCX's bootstrap) and exchanges the windows' addresses; no one-sided op can
// then move bytes. For measuring the build on one host, never for real transfers.
#include <cstdio>
#include <cstdlib>

#include "flagcx_net_adaptor.h"
#include "ib_common.h"

extern struct flagcxNetAdaptor flagcxNetSocket;  // libflagcx.so's, already loaded

namespace {

flagcxResult_t probeInit() { return flagcxNetSocket.init(); }
flagcxResult_t probeDevices(int *n) { return flagcxNetSocket.devices(n); }
flagcxResult_t probeProps(int dev, void *props) { return flagcxNetSocket.getProperties(dev, props); }
flagcxResult_t probeListen(int dev, void *h, void **l) { return flagcxNetSocket.listen(dev, h, l); }
flagcxResult_t probeConnect(int dev, void *h, void **s) { return flagcxNetSocket.connect(dev, h, s); }
flagcxResult_t probeAccept(void *l, void **r) { return flagcxNetSocket.accept(l, r); }
flagcxResult_t probeCloseSend(void *c) { return flagcxNetSocket.closeSend(c); }
flagcxResult_t probeCloseRecv(void *c) { return flagcxNetSocket.closeRecv(c); }
flagcxResult_t probeCloseListen(void *c) { return flagcxNetSocket.closeListen(c); }

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

flagcxResult_t probeIsend(void *c, void *d, size_t n, int tag, void *mh, void *ph, void **req) {
  return flagcxNetSocket.isend(c, d, n, tag, mh, ph, req);
}
flagcxResult_t probeIrecv(void *c, int n, void **d, size_t *sz, int *tags, void **mh, void **ph, void **req) {
  return flagcxNetSocket.irecv(c, n, d, sz, tags, mh, ph, req);
}
flagcxResult_t probeIflush(void *c, int n, void **d, int *sz, void **mh, void **req) {
  return flagcxNetSocket.iflush(c, n, d, sz, mh, req);
}
flagcxResult_t probeTest(void *req, int *done, int *sizes) { return flagcxNetSocket.test(req, done, sizes); }

flagcxResult_t noRdma(const char *what) {
  static bool said = false;
  if (!said) fprintf(stderr, "probe net adaptor: %s: no RDMA on this host, no data moved\n", what);
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

extern "C" {
struct flagcxNetAdaptor_v1 flagcxNetAdaptorPlugin_v1 = {
    "MeshProbe", probeInit, probeDevices, probeProps,
    probeListen, probeConnect, probeAccept, probeCloseSend, probeCloseRecv, probeCloseListen,
    probeRegMr, nullptr, probeDeregMr,
    probeIsend, probeIrecv, probeIflush, probeTest,
    probeIput, probeIget, probeIputSignal,
    nullptr,
};
}
