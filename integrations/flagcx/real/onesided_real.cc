// One rank of FlagCX's public one-sided API, libflagcx built with the flagcx_mesh patch, on GPU
// buffers of one host. build_real.sh starts NRANKS of these:
//
//   onesided_real UID_FILE RANK NRANKS [DIE_RANK]
//
// Rank 0 makes the unique id (flagcxGetUniqueId) and writes it to UID_FILE; the others wait for
// it. Every rank then: flagcxCommInitRank; cudaMalloc of two buffers; flagcxOneSideRegister of
// both (the first one builds FlagCX's one-sided full mesh, through the patch's ordered builder);
// flagcxOneSideSignalRegister; flagcxPut / flagcxGet to rank+1 with flagcxWaitCounter; and
// flagcxCommDestroy. Each step prints one line "rank R: STEP: RESULT in T ms[: detail]".
// With FXM_REAL_PROBE=1, probe.cc first changes FlagCX's socket adaptor so that the one-sided
// path gets as far as the mesh build on a host without an RDMA NIC (see there).
// With DIE_RANK, that rank exits (86) at its first bootstrap send of the mesh build (its first
// readiness token, after the listen-handle allgather), and every other rank must see its
// flagcxOneSideRegister fail by the build deadline (FLAGCX_MESH_TIMEOUT) instead of hanging.
// A step that runs past FXM_REAL_STEP_TIMEOUT seconds (default 120) prints "HUNG" and exits 124.
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "flagcx.h"

struct bootstrapState;
extern "C" void flagcxMeshProbeInstall(void);  // probe.cc

namespace {

int g_rank = -1, g_die = -1;
constexpr int kMeshTagBase = 0x6d780000;  // FLAGCX_MESH_NET_BUILD_CONFIG_INITIALIZER's tag_base
char g_step[160] = "start";

double nowMs() {
  using namespace std::chrono;
  return duration<double, std::milli>(steady_clock::now().time_since_epoch()).count();
}

void onAlarm(int) {
  char line[256];
  int n = snprintf(line, sizeof line, "rank %d: %s: HUNG (past FXM_REAL_STEP_TIMEOUT)\n", g_rank, g_step);
  if (write(1, line, n) < 0) _exit(125);
  _exit(124);
}

void beginStep(const char *name) {
  snprintf(g_step, sizeof g_step, "%s", name);
  const char *t = getenv("FXM_REAL_STEP_TIMEOUT");
  alarm(t ? atoi(t) : 120);
}

// The result's name (flagcxGetErrorString at 0c721293 answers "Not implemented." for every code).
const char *resultName(flagcxResult_t rc) {
  static const char *const names[] = {"ok", "flagcxUnhandledDeviceError", "flagcxSystemError",
                                      "flagcxInternalError", "flagcxInvalidArgument", "flagcxInvalidUsage",
                                      "flagcxRemoteError", "flagcxInProgress", "flagcxUnhandledCCLError",
                                      "flagcxNotSupported"};
  return rc >= 0 && rc < (int)(sizeof names / sizeof names[0]) ? names[rc] : "unknown result";
}

void report(const char *step, flagcxResult_t rc, double t0, const std::string &detail = "") {
  alarm(0);
  printf("rank %d: %s: %s (%d) in %.1f ms%s%s\n", g_rank, step, resultName(rc), (int)rc, nowMs() - t0,
         detail.empty() ? "" : ": ", detail.c_str());
  fflush(stdout);
}

// What FlagCX and NCCL last warned about, looked up at run time (FlagCX keeps its last WARN in
// the exported flagcxLastError; NCCL answers ncclGetLastError(NULL)): the cause of a failure
// even with their logging off.
std::string lastWarnings() {
  std::string s;
  if (const char *f = (const char *)dlsym(RTLD_DEFAULT, "flagcxLastError"); f && *f) s += std::string("FlagCX: ") + f;
  using NcclLast = const char *(*)(void *);
  if (auto n = (NcclLast)dlsym(RTLD_DEFAULT, "ncclGetLastError")) {
    const char *m = n(nullptr);
    if (m && *m) s += std::string(s.empty() ? "" : "; ") + "NCCL: " + m;
  }
  for (char &c : s) c = c == '\n' ? ' ' : c;
  return s.empty() ? "no FlagCX or NCCL warning recorded" : s;
}

bool shareId(const char *path, flagcxUniqueId *id) {
  if (g_rank == 0) {
    if (flagcxGetUniqueId(id) != flagcxSuccess) return false;
    std::string tmp = std::string(path) + ".tmp";
    FILE *f = fopen(tmp.c_str(), "wb");
    if (!f || fwrite(id, sizeof *id, 1, f) != 1 || fclose(f)) return false;
    return rename(tmp.c_str(), path) == 0;
  }
  for (int i = 0; i < 6000; ++i, usleep(10000)) {
    FILE *f = fopen(path, "rb");
    if (!f) continue;
    bool ok = fread(id, sizeof *id, 1, f) == 1;
    fclose(f);
    return ok;
  }
  return false;
}

// Waits for the counter on a thread, so an op that never completes (no RDMA) is reported, not hung on.
flagcxResult_t waitCounterBounded(flagcxComm_t comm, uint64_t target, double seconds, bool *returned) {
  auto done = std::make_shared<std::atomic<int>>(-1);
  std::thread([comm, target, done] { done->store((int)flagcxWaitCounter(comm, target)); }).detach();
  double t0 = nowMs();
  while (done->load() < 0 && nowMs() - t0 < seconds * 1000) usleep(1000);
  *returned = done->load() >= 0;
  return *returned ? (flagcxResult_t)done->load() : flagcxInProgress;
}

// What a bounded wait says: a bandwidth only when flagcxWaitCounter returned success (the op's
// bytes are confirmed); a failed or unfinished wait confirms none, and says so.
std::string waitDetail(flagcxResult_t rc, bool returned, size_t bytes, double ms) {
  if (!returned) return "no completion within 10 s, no bytes confirmed";
  if (rc != flagcxSuccess) return "the op failed, no bytes confirmed";
  return std::to_string(bytes / ms / 1e6) + " GB/s";
}

// One op (put or get) of `bytes` to/from rank+1, then its completion; GB/s only when it succeeded.
bool oneOp(flagcxComm_t comm, bool put, size_t bytes, int nranks) {
  int peer = (g_rank + 1) % nranks;
  uint64_t before = 0;
  flagcxReadCounter(comm, &before);
  beginStep(put ? "flagcxPut" : "flagcxGet");
  double t0 = nowMs();
  flagcxResult_t rc = put ? flagcxPut(comm, peer, 0, 0, bytes, 0, 1) : flagcxGet(comm, peer, 0, 0, bytes, 0, 1);
  report(put ? "flagcxPut" : "flagcxGet", rc, t0, std::to_string(bytes) + " bytes, peer " + std::to_string(peer));
  if (rc != flagcxSuccess) return true;
  bool returned = false;
  rc = waitCounterBounded(comm, before + 1, 10.0, &returned);
  report("flagcxWaitCounter", rc, t0, waitDetail(rc, returned, bytes, nowMs() - t0));
  return returned;
}

}  // namespace

// Interposes libflagcx's bootstrapSend (C linkage in FlagCX's bootstrap.h; the executable's
// definition comes first, it is linked with -rdynamic): DIE_RANK exits at its first send with a
// mesh-build tag, i.e. in the middle of the build.
extern "C" flagcxResult_t bootstrapSend(struct bootstrapState *state, int peer, int tag, void *data, int size) {
  using Fn = flagcxResult_t (*)(struct bootstrapState *, int, int, void *, int);
  static Fn next = (Fn)dlsym(RTLD_NEXT, "bootstrapSend");
  if (g_rank == g_die && tag >= kMeshTagBase && tag < kMeshTagBase + 0x10000) {
    printf("rank %d: dies mid-build (its first readiness token, to rank %d)\n", g_rank, peer);
    fflush(stdout);
    _exit(86);
  }
  if (!next) {
    fprintf(stderr, "rank %d: bootstrapSend not found in libflagcx\n", g_rank);
    return flagcxInternalError;
  }
  return next(state, peer, tag, data, size);
}

int main(int argc, char **argv) {
  if (argc < 4) {
    fprintf(stderr, "usage: %s UID_FILE RANK NRANKS [DIE_RANK]\n", argv[0]);
    return 2;
  }
  g_rank = atoi(argv[2]);
  int nranks = atoi(argv[3]);
  g_die = argc > 4 ? atoi(argv[4]) : -1;
  signal(SIGALRM, onAlarm);
  size_t bytes = getenv("FXM_REAL_BYTES") ? strtoull(getenv("FXM_REAL_BYTES"), nullptr, 0) : (64u << 20);
  int ndev = 0;
  if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0 || cudaSetDevice(g_rank % ndev) != cudaSuccess) {
    printf("rank %d: no CUDA device\n", g_rank);
    return 1;
  }
  flagcxUniqueId id;
  beginStep("unique id");
  if (!shareId(argv[1], &id)) {
    printf("rank %d: no unique id in %s\n", g_rank, argv[1]);
    return 1;
  }
  if (getenv("FXM_REAL_PROBE") && !strcmp(getenv("FXM_REAL_PROBE"), "1")) {
    flagcxMeshProbeInstall();
    printf("rank %d: probe installed in FlagCX's socket adaptor (one-sided calls that move nothing)\n", g_rank);
  }
  flagcxComm_t comm = nullptr;
  beginStep("flagcxCommInitRank");
  double t0 = nowMs();
  flagcxResult_t rc = flagcxCommInitRank(&comm, nranks, &id, g_rank);
  std::string where = "device " + std::to_string(g_rank % ndev) + " of " + std::to_string(ndev);
  report("flagcxCommInitRank", rc, t0, rc == flagcxSuccess ? where : where + "; " + lastWarnings());
  if (rc != flagcxSuccess) return 1;

  void *buf[2] = {nullptr, nullptr}, *sig = nullptr;
  if (cudaMalloc(&buf[0], bytes) || cudaMalloc(&buf[1], bytes) || cudaMalloc(&sig, 8 * nranks) ||
      cudaMemset(buf[0], g_rank + 1, bytes) || cudaMemset(buf[1], 0, bytes) || cudaMemset(sig, 0, 8 * nranks)) {
    printf("rank %d: cudaMalloc/cudaMemset of 2 x %zu bytes failed\n", g_rank, bytes);
    return 1;
  }
  bool registered = true;
  for (int i = 0; i < 2 && registered; ++i) {
    std::string step = "flagcxOneSideRegister #" + std::to_string(i) + (i == 0 ? " (builds the mesh)" : "");
    beginStep(step.c_str());
    t0 = nowMs();
    rc = flagcxOneSideRegister(comm, buf[i], bytes);
    report(step.c_str(), rc, t0, rc == flagcxSuccess ? std::to_string(bytes) + " bytes of GPU memory" : lastWarnings());
    registered = rc == flagcxSuccess;
  }
  if (!registered && g_die >= 0) _exit(3);  // the build was aborted: its bootstrap is unusable, no destroy
  if (registered) {
    beginStep("flagcxOneSideSignalRegister");
    t0 = nowMs();
    rc = flagcxOneSideSignalRegister(comm, sig, 8 * nranks, 0x2 /* FLAGCX_PTR_CUDA */);
    report("flagcxOneSideSignalRegister", rc, t0);
    if (!oneOp(comm, true, bytes, nranks) || !oneOp(comm, false, bytes, nranks)) {
      printf("rank %d: an op never completed: exiting without flagcxCommDestroy\n", g_rank);
      fflush(stdout);
      _exit(0);
    }
  }
  beginStep("flagcxCommDestroy");
  t0 = nowMs();
  rc = flagcxCommDestroy(comm);
  report("flagcxCommDestroy", rc, t0);
  return 0;
}
