/*
 * stream_wait.c: how long after a host-side signal a CUDA stream that waits on
 * it (flagcx_mesh_wait_signal_on_stream) passes, measured from C.
 *
 * Two ranks on one host. For each iteration rank 1 queues the wait on its
 * stream, records an event after it and tells rank 0 (a host signal); rank 0
 * waits for that, spins 200 us (the stream is surely waiting by then), takes
 * the time and signals; rank 1 spins on cuEventQuery and takes the time when
 * the event completes. Both clocks are CLOCK_MONOTONIC of the one host. Rank 1
 * then hands its times to rank 0 through a window (get), and rank 0 prints the
 * median, p10 and p90 in microseconds (or writes them as JSON to --out).
 *
 * The CUDA driver is opened with dlopen (FLAGCX_MESH_CUDA_DRIVER or
 * libcuda.so.1): no CUDA header is needed. Usually run by
 * `python -m flagcx_mesh.bench stream-wait`, which compiles it.
 */
#define _POSIX_C_SOURCE 200809L
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "flagcx_mesh.h"

#define CHECK(call)                                                                  \
  do {                                                                               \
    flagcx_mesh_result_t r_ = (call);                                                \
    if (r_ != FLAGCX_MESH_OK) {                                                      \
      fprintf(stderr, "stream_wait: %s failed: %s\n", #call, flagcx_mesh_last_error()); \
      exit(1);                                                                       \
    }                                                                                \
  } while (0)

typedef struct {
  int (*init)(unsigned);
  int (*device_get)(int *, int);
  int (*primary_ctx_retain)(void **, int);
  int (*ctx_set_current)(void *);
  int (*stream_create)(void **, unsigned);
  int (*event_create)(void **, unsigned);
  int (*event_record)(void *, void *);
  int (*event_query)(void *);
} Cuda;

static void *need(void *lib, const char *name) {
  void *f = dlsym(lib, name);
  if (f == NULL) {
    fprintf(stderr, "stream_wait: the CUDA driver has no %s\n", name);
    exit(1);
  }
  return f;
}

static Cuda load_cuda(void) {
  const char *path = getenv("FLAGCX_MESH_CUDA_DRIVER");
  void *lib = dlopen(path && *path ? path : "libcuda.so.1", RTLD_NOW);
  if (lib == NULL) {
    fprintf(stderr, "stream_wait: no CUDA driver: %s\n", dlerror());
    exit(1);
  }
  Cuda c;
  *(void **)&c.init = need(lib, "cuInit");
  *(void **)&c.device_get = need(lib, "cuDeviceGet");
  *(void **)&c.primary_ctx_retain = need(lib, "cuDevicePrimaryCtxRetain");
  *(void **)&c.ctx_set_current = need(lib, "cuCtxSetCurrent");
  *(void **)&c.stream_create = need(lib, "cuStreamCreate");
  *(void **)&c.event_create = need(lib, "cuEventCreate");
  *(void **)&c.event_record = need(lib, "cuEventRecord");
  *(void **)&c.event_query = need(lib, "cuEventQuery");
  return c;
}

static long long now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static int cmp_ll(const void *a, const void *b) {
  long long x = *(const long long *)a, y = *(const long long *)b;
  return (x > y) - (x < y);
}

static void waiter(flagcx_mesh_comm_t comm, uint32_t sig, long long *t, int iters, Cuda *cu, void *stream) {
  void *ev = NULL;
  if (cu->event_create(&ev, 2 /* disable timing */) != 0) exit(1);
  for (int i = 1; i <= iters; ++i) {
    CHECK(flagcx_mesh_wait_signal_on_stream(comm, sig, 0, (uint64_t)i, stream, 30.0));
    if (cu->event_record(ev, stream) != 0) exit(1);
    CHECK(flagcx_mesh_signal(comm, 0, sig, 1, 1));  /* waiting now */
    while (cu->event_query(ev) == 600 /* not ready */) {
    }
    t[i - 1] = now_ns();
  }
}

static void signaller(flagcx_mesh_comm_t comm, uint32_t sig, long long *t, int iters) {
  for (int i = 1; i <= iters; ++i) {
    CHECK(flagcx_mesh_wait_signal(comm, sig, 1, (uint64_t)i, 30.0));
    long long until = now_ns() + 200000;
    while (now_ns() < until) {
    }
    t[i - 1] = now_ns();
    CHECK(flagcx_mesh_signal(comm, 1, sig, 0, 1));
  }
}

static void report(long long *sent, long long *passed, int iters, const char *out) {
  long long *d = malloc(sizeof(long long) * (size_t)iters);
  for (int i = 0; i < iters; ++i) d[i] = passed[i] - sent[i];
  qsort(d, (size_t)iters, sizeof(long long), cmp_ll);
  double med = d[iters / 2] / 1e3, p10 = d[iters / 10] / 1e3, p90 = d[(iters * 9) / 10] / 1e3;
  FILE *f = out ? fopen(out, "w") : stdout;
  if (out)
    fprintf(f, "{\"iters\": %d, \"median_us\": %.2f, \"p10_us\": %.2f, \"p90_us\": %.2f}\n", iters, med, p10, p90);
  else
    printf("stream wait from C: passes %.2f us after a host-side signal (median of %d; p10 %.2f, p90 %.2f)\n",
           med, iters, p10, p90);
  if (out) fclose(f);
  free(d);
}

int main(int argc, char **argv) {
  int iters = 1000;
  const char *out = NULL;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (strcmp(argv[i], "--iters") == 0) iters = atoi(argv[i + 1]);
    else if (strcmp(argv[i], "--out") == 0) out = argv[i + 1];
  }
  if (iters < 10) iters = 10;
  flagcx_mesh_comm_t comm;
  CHECK(flagcx_mesh_comm_init_from_env(&comm, NULL));
  int rank = 0;
  CHECK(flagcx_mesh_comm_rank(comm, &rank));
  uint32_t sig, times;
  void *base = NULL;
  CHECK(flagcx_mesh_signal_window(comm, 2, &sig));
  CHECK(flagcx_mesh_window_alloc(comm, sizeof(long long) * (uint64_t)iters * 2, &times, &base));
  long long *t = base;  /* [0, iters): this rank's times; [iters, 2 iters): the peer's, on rank 0 */
  if (rank == 1) {
    Cuda cu = load_cuda();
    void *ctx = NULL, *stream = NULL;
    int dev = 0;
    if (cu.init(0) || cu.device_get(&dev, 0) || cu.primary_ctx_retain(&ctx, dev) || cu.ctx_set_current(ctx) ||
        cu.stream_create(&stream, 1 /* non-blocking */)) {
      fprintf(stderr, "stream_wait: CUDA set-up failed\n");
      return 1;
    }
    waiter(comm, sig, t, iters, &cu, stream);
  } else {
    signaller(comm, sig, t, iters);
  }
  CHECK(flagcx_mesh_barrier(comm, 60.0));
  if (rank == 0) {
    uint64_t n = sizeof(long long) * (uint64_t)iters;
    CHECK(flagcx_mesh_get(comm, 1, times, 0, times, n, n));
    CHECK(flagcx_mesh_flush(comm, 1, 60.0));
    report(t, t + iters, iters, out);
  }
  CHECK(flagcx_mesh_barrier(comm, 60.0));
  CHECK(flagcx_mesh_comm_destroy(comm));
  return 0;
}
