// One rank of a full-mesh build over FlagCX's own socket adaptor and its own
// collective bootstrap, through the glue the patch adds
// (flagcx/service/flagcx_mesh_glue.cc), on a CPU-only machine:
//
//   mesh_check HANDLE_FILE RANK NRANKS BUILDER TRIALS [DIE_RANK]
//
// Rank 0 makes the bootstrap's root and writes its handle to HANDLE_FILE;
// the others wait for that file. BUILDER is legacy (FlagCX's loop as shipped, with a deadline), ordered or
// tagged. Every trial builds, then the build's own wiring check (tagged: its
// identity headers) proves the slots; rank 0 prints one line per trial:
// "trial T: completed|miswired|hung|failed: <first error>". With DIE_RANK,
// that rank exits after the bootstrap's allgather of the first build, and the
// others must fail by the deadline (through the abort hook) instead of
// blocking in bootstrapRecv. With MESH_CHECK_STALL_RANK=R in the environment,
// rank R stops before its first build and never returns (a stuck builder, for
// the test that check.sh reports a hang). Run it through check.sh.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <string>
#include <unistd.h>
#include <vector>

#include "bootstrap.h"
#include "flagcx_mesh_glue.h"

extern struct flagcxNetAdaptor flagcxNetSocket;

namespace {

int g_die_rank = -1, g_rank = -1;
flagcx_mesh_bootstrap_ops_t g_inner;

// The glue's allgather, with a rank that dies right after it (die test).
int dyingAllGather(void *ctx, void *data, size_t bytes, double timeoutS) {
  int rc = g_inner.allgather(ctx, data, bytes, timeoutS);
  if (g_rank == g_die_rank) _exit(86);
  return rc;
}

// Rank 0: a new root, its handle written to path; others: read it from path.
bool shareHandle(const char *path, int rank, struct flagcxBootstrapHandle *handle) {
  if (rank == 0) {
    if (bootstrapGetUniqueId(handle)) return false;
    std::string tmp = std::string(path) + ".tmp";
    FILE *f = fopen(tmp.c_str(), "wb");
    if (!f || fwrite(handle, sizeof(*handle), 1, f) != 1 || fclose(f)) return false;
    return rename(tmp.c_str(), path) == 0;
  }
  for (int i = 0; i < 3000; ++i, usleep(10000)) {
    FILE *f = fopen(path, "rb");
    if (!f) continue;
    bool ok = fread(handle, sizeof(*handle), 1, f) == 1;
    fclose(f);
    return ok;
  }
  return false;
}

double now() {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

std::string outcome(flagcx_mesh_result_t rc, const char *err) {
  if (rc == FLAGCX_MESH_OK) return "completed";
  if (rc == FLAGCX_MESH_TIMED_OUT) return "hung";
  if (rc == FLAGCX_MESH_PROTOCOL && strstr(err, "miswired")) return "miswired";
  return "failed";
}

int builderOf(const char *name) {
  if (!strcmp(name, "legacy")) return FLAGCX_MESH_BUILD_LEGACY;
  if (!strcmp(name, "tagged")) return FLAGCX_MESH_BUILD_TAGGED;
  return FLAGCX_MESH_BUILD_ORDERED;
}

} // namespace

int main(int argc, char **argv) {
  if (argc < 6) {
    fprintf(stderr, "usage: %s HANDLE_FILE RANK NRANKS BUILDER TRIALS [DIE_RANK]\n", argv[0]);
    return 2;
  }
  int rank = atoi(argv[2]), nranks = atoi(argv[3]), trials = atoi(argv[5]);
  struct flagcxBootstrapHandle handle;
  if (bootstrapNetInit() || !shareHandle(argv[1], rank, &handle)) {
    fprintf(stderr, "rank %d: no bootstrap handle\n", rank);
    return 1;
  }
  g_rank = rank;
  g_die_rank = argc > 6 ? atoi(argv[6]) : -1;
  struct bootstrapState *state = NULL;
  if (bootstrapCollInit(&handle, rank, nranks, handle.magic, NULL, &state)) {
    fprintf(stderr, "rank %d: bootstrap init failed\n", rank);
    return 1;
  }
  if (flagcxNetSocket.init()) return 1;
  struct flagcxMeshNetCtx netCtx;
  struct flagcxMeshBootCtx bootCtx;
  flagcx_mesh_net_adaptor_t net;
  flagcx_mesh_bootstrap_ops_t boot;
  flagcxMeshNetAdaptorInit(&net, &netCtx, &flagcxNetSocket, 0);
  flagcxMeshBootstrapOpsInit(&boot, &bootCtx, state, rank, nranks);
  g_inner = boot;
  if (g_die_rank >= 0) boot.allgather = dyingAllGather;
  const char *stall = getenv("MESH_CHECK_STALL_RANK");
  if (stall && atoi(stall) == rank)
    for (;;) pause();
  int bad = 0;
  for (int t = 0; t < trials; ++t) {
    flagcx_mesh_net_build_config_t config = FLAGCX_MESH_NET_BUILD_CONFIG_INITIALIZER;
    config.builder = (flagcx_mesh_builder_t)builderOf(argv[4]);
    config.timeout_s = 5.0;
    config.tag_base += t * (nranks + 1);
    std::vector<void *> send(nranks), recv(nranks);
    double t0 = now();
    flagcx_mesh_result_t rc = flagcx_mesh_net_build_full_mesh(&net, &boot, &config, send.data(), recv.data());
    double took = now() - t0;
    std::string err = rc ? flagcx_mesh_last_error() : "";
    if (rc == FLAGCX_MESH_OK) flagcx_mesh_net_close_full_mesh(&net, nranks, send.data(), recv.data());
    // Every rank's outcome to rank 0 (the bootstrap is intact unless a rank died).
    std::vector<char> all(256 * nranks, 0);
    snprintf(&all[256 * rank], 256, "%s: %s", outcome(rc, err.c_str()).c_str(), err.c_str());
    if (g_die_rank >= 0) {
      printf("rank %d (%.1f s): %s\n", rank, took, &all[256 * rank]);
      fflush(stdout);
      _exit(rc == FLAGCX_MESH_OK ? 0 : 3);  // the bootstrap was aborted: no more collectives
    }
    if (bootstrapCollAllGather(state, all.data(), 256)) return 1;
    if (rank == 0) {
      std::string worst = "completed";
      const char *first = "";
      for (int r = 0; r < nranks; ++r) {
        std::string o(&all[256 * r], strcspn(&all[256 * r], ":"));
        if (o != "completed" && (worst == "completed" || o == "miswired" || o == "hung")) worst = o, first = &all[256 * r];
      }
      printf("trial %d: %s%s%s\n", t, worst.c_str(), *first ? " -- " : "", first);
      bad += worst != "completed";
    }
  }
  bootstrapClose(state);
  return 0;
}
