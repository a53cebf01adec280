/*
 * latency.c: small-message latency of flagcx_mesh through its C ABI, beside a
 * raw TCP socket measured in the same run.
 *
 * Two ranks. Rank 0 times, rank 1 answers; each test runs in blocks that
 * alternate with the others, so a change of load on the host hits every test
 * alike. Four tests:
 *   put_signal  8-byte put_signal -> peer's wait_signal returns -> it answers
 *               the same way; one way = half the round trip.
 *   socket      8-byte write -> peer's read returns -> it writes 8 bytes back
 *               (TCP loopback, TCP_NODELAY, blocking); one way = half.
 *   put_flush   one blocking 4 KiB put + flush (remote completion), rank 0 only.
 *   socket_ack  4 KiB write -> peer reads it all -> 8-byte ack read back.
 * The path comes from the environment (FLAGCX_MESH_TRANSPORT=shm | tcp).
 *
 * Usually run by `python -m flagcx_mesh.bench latency`, which compiles this
 * file against the installed package. By hand:
 *   cc -O2 -std=c99 latency.c $(python -m flagcx_mesh.config --cflags --libs) -o latency
 *   FLAGCX_MESH_TRANSPORT=tcp python -m flagcx_mesh.launch -n 2 -- ./latency [--iters N]
 *     [--warmup N] [--blocks N] [--out FILE.json]
 * Rank 0 prints the figures (median and p99 in microseconds), or writes them
 * as JSON to --out.
 */
#define _POSIX_C_SOURCE 200809L
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "flagcx_mesh.h"

#define SMALL 8
#define LARGE 4096
#define TIMEOUT_S 60.0

#define CHECK(call)                                                                      \
  do {                                                                                   \
    flagcx_mesh_result_t r_ = (call);                                                    \
    if (r_ != FLAGCX_MESH_OK) {                                                          \
      fprintf(stderr, "latency: %s failed: %s\n  %s\n", #call,                           \
              flagcx_mesh_result_string(r_), flagcx_mesh_last_error());                  \
      exit(1);                                                                           \
    }                                                                                    \
  } while (0)

static void die(const char *what) {
  fprintf(stderr, "latency: %s: %s\n", what, strerror(errno));
  exit(1);
}

typedef struct {
  flagcx_mesh_comm_t comm;
  int rank, peer;
  uint32_t src, dst, sig;  /* 4 KiB data windows and a 2-slot signal window */
  uint64_t got;            /* signals this rank has received so far */
  int sock;                /* raw TCP connection to the peer */
  char buf[LARGE];
} Bench;

typedef enum { PUT_SIGNAL, SOCKET, PUT_FLUSH, SOCKET_ACK, NTESTS } TestId;

static const char *const kNames[NTESTS] = {"put_signal", "socket", "put_flush", "socket_ack"};
static const double kScale[NTESTS] = {0.5, 0.5, 1.0, 1.0}; /* ping-pongs report one way */

static double now_us(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec * 1e6 + (double)t.tv_nsec / 1e3;
}

/* ------------------------------------------------------------ the raw socket */

static void write_all(int fd, const char *p, size_t n) {
  while (n > 0) {
    ssize_t w = write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) die("socket write");
    p += w;
    n -= (size_t)w;
  }
}

static void read_all(int fd, char *p, size_t n) {
  while (n > 0) {
    ssize_t r = read(fd, p, n);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) die("socket read");
    p += r;
    n -= (size_t)r;
  }
}

static int listen_loopback(uint16_t *port) {
  struct sockaddr_in a;
  socklen_t len = sizeof(a);
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  memset(&a, 0, sizeof(a));
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (fd < 0 || bind(fd, (struct sockaddr *)&a, sizeof(a)) != 0 || listen(fd, 1) != 0) die("listen");
  if (getsockname(fd, (struct sockaddr *)&a, &len) != 0) die("getsockname");
  *port = ntohs(a.sin_port);
  return fd;
}

static int connect_loopback(uint16_t port) {
  struct sockaddr_in a;
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  memset(&a, 0, sizeof(a));
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(port);
  if (fd < 0 || connect(fd, (struct sockaddr *)&a, sizeof(a)) != 0) die("connect");
  return fd;
}

/* Rank 1 listens and tells rank 0 its port through a signal slot of its own window. */
static void open_socket(Bench *b) {
  uint32_t port_win;
  uint64_t port = 0;
  int one = 1;
  CHECK(flagcx_mesh_signal_window(b->comm, 1, &port_win));
  if (b->rank == 1) {
    uint16_t p;
    int lst = listen_loopback(&p);
    CHECK(flagcx_mesh_signal(b->comm, 0, port_win, 0, p));
    b->sock = accept(lst, NULL, NULL);
    close(lst);
  } else {
    CHECK(flagcx_mesh_wait_signal(b->comm, port_win, 0, 1, TIMEOUT_S));
    CHECK(flagcx_mesh_read_signal(b->comm, port_win, 0, &port));
    b->sock = connect_loopback((uint16_t)port);
  }
  if (b->sock < 0 || setsockopt(b->sock, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one)) != 0) die("socket");
  CHECK(flagcx_mesh_flush(b->comm, -1, TIMEOUT_S));
  CHECK(flagcx_mesh_window_deregister(b->comm, port_win));
}

/* ------------------------------------------------------------ one iteration */

/* Rank 0 sends first and waits for the answer; rank 1 the other way round. */
static void put_signal_once(Bench *b) {
  if (b->rank == 0) {
    CHECK(flagcx_mesh_put_signal(b->comm, b->peer, b->src, 0, b->dst, 0, SMALL, b->sig, 0, 1));
  }
  CHECK(flagcx_mesh_wait_signal(b->comm, b->sig, (uint64_t)(1 - b->rank), ++b->got, TIMEOUT_S));
  if (b->rank == 1) {
    CHECK(flagcx_mesh_put_signal(b->comm, b->peer, b->src, 0, b->dst, 0, SMALL, b->sig, 1, 1));
  }
}

static void socket_once(Bench *b) {
  if (b->rank == 0) write_all(b->sock, b->buf, SMALL);
  read_all(b->sock, b->buf, SMALL);
  if (b->rank == 1) write_all(b->sock, b->buf, SMALL);
}

static void put_flush_once(Bench *b) {
  if (b->rank != 0) return; /* passive target: its progress thread lands the data */
  CHECK(flagcx_mesh_put(b->comm, b->peer, b->src, 0, b->dst, 0, LARGE));
  CHECK(flagcx_mesh_flush(b->comm, b->peer, TIMEOUT_S));
}

static void socket_ack_once(Bench *b) {
  if (b->rank == 0) {
    write_all(b->sock, b->buf, LARGE);
    read_all(b->sock, b->buf, SMALL);
  } else {
    read_all(b->sock, b->buf, LARGE);
    write_all(b->sock, b->buf, SMALL);
  }
}

static void run_once(Bench *b, TestId t) {
  switch (t) {
    case PUT_SIGNAL: put_signal_once(b); break;
    case SOCKET: socket_once(b); break;
    case PUT_FLUSH: put_flush_once(b); break;
    default: socket_ack_once(b); break;
  }
}

/* n iterations of test t; times (us, scaled to one way) go to out when not NULL. */
static void run_block(Bench *b, TestId t, long n, double *out) {
  CHECK(flagcx_mesh_barrier(b->comm, TIMEOUT_S));
  for (long i = 0; i < n; ++i) {
    double t0 = now_us();
    run_once(b, t);
    if (out) out[i] = (now_us() - t0) * kScale[t];
  }
}

/* ------------------------------------------------------------ figures */

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

typedef struct {
  double median, p99, min;
} Figures;

static Figures summarize(double *v, long n) {
  Figures f;
  long k99 = (long)((double)n * 0.99);
  qsort(v, (size_t)n, sizeof(double), cmp_double);
  f.median = n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
  f.p99 = v[k99 < n ? k99 : n - 1];
  f.min = v[0];
  return f;
}

typedef struct {
  long iters, warmup, blocks;
  const char *out;
} Options;

static long positive(const char *flag, const char *text) {
  char *end;
  long v = strtol(text, &end, 10);
  if (*text == '\0' || *end != '\0' || v < 1) {
    fprintf(stderr, "latency: %s needs a positive integer, got '%s'\n", flag, text);
    exit(2);
  }
  return v;
}

static void usage(void) {
  fprintf(stderr, "usage: latency [--iters N] [--warmup N] [--blocks N] [--out FILE.json]\n");
  exit(2);
}

static Options parse(int argc, char **argv) {
  Options o = {10000, 1000, 10, NULL};
  for (int i = 1; i < argc; i += 2) {
    const char *a = argv[i], *v = argv[i + 1];
    if (v == NULL) usage();
    if (strcmp(a, "--iters") == 0) o.iters = positive(a, v);
    else if (strcmp(a, "--warmup") == 0) o.warmup = positive(a, v);
    else if (strcmp(a, "--blocks") == 0) o.blocks = positive(a, v);
    else if (strcmp(a, "--out") == 0) o.out = v;
    else usage();
  }
  if (o.blocks > o.iters) o.blocks = o.iters;
  return o;
}

static void report(const Bench *b, const Options *o, const Figures *f, FILE *out, int json) {
  const char *data_path, *sig_path;
  CHECK(flagcx_mesh_window_path(b->comm, b->dst, b->peer, &data_path));
  CHECK(flagcx_mesh_window_path(b->comm, b->sig, b->peer, &sig_path));
  if (json) {
    fprintf(out, "{\"data_path\": \"%s\", \"signal_path\": \"%s\", \"iters\": %ld, \"warmup\": %ld, \"results\": {",
            data_path, sig_path, o->iters, o->warmup);
    for (int t = 0; t < NTESTS; ++t) {
      fprintf(out, "%s\"%s\": {\"median_us\": %.4f, \"p99_us\": %.4f, \"min_us\": %.4f}", t ? ", " : "",
              kNames[t], f[t].median, f[t].p99, f[t].min);
    }
    fprintf(out, "}}\n");
    return;
  }
  fprintf(out, "data path %s, signal path %s, %ld iterations (+%ld warm-up), us:\n", data_path, sig_path,
          o->iters, o->warmup);
  for (int t = 0; t < NTESTS; ++t) {
    fprintf(out, "  %-11s median %9.3f  p99 %9.3f  min %9.3f\n", kNames[t], f[t].median, f[t].p99, f[t].min);
  }
  fprintf(out, "  put_signal / socket: median %.2fx, p99 %.2fx; put_flush / socket_ack: median %.2fx, p99 %.2fx\n",
          f[PUT_SIGNAL].median / f[SOCKET].median, f[PUT_SIGNAL].p99 / f[SOCKET].p99,
          f[PUT_FLUSH].median / f[SOCKET_ACK].median, f[PUT_FLUSH].p99 / f[SOCKET_ACK].p99);
}

static void setup(Bench *b) {
  void *base;
  int nranks;
  memset(b, 0, sizeof(*b));
  CHECK(flagcx_mesh_comm_init_from_env(&b->comm, NULL));
  CHECK(flagcx_mesh_comm_rank(b->comm, &b->rank));
  CHECK(flagcx_mesh_comm_nranks(b->comm, &nranks));
  if (nranks != 2) {
    fprintf(stderr, "latency: needs exactly 2 ranks, got %d\n", nranks);
    exit(2);
  }
  b->peer = 1 - b->rank;
  CHECK(flagcx_mesh_window_alloc(b->comm, LARGE, &b->src, &base));
  memset(base, 1, LARGE);
  CHECK(flagcx_mesh_window_alloc(b->comm, LARGE, &b->dst, &base));
  CHECK(flagcx_mesh_signal_window(b->comm, 2, &b->sig));
  open_socket(b);
}

int main(int argc, char **argv) {
  Options o = parse(argc, argv);
  Bench *b = malloc(sizeof(Bench));
  double *samples[NTESTS];
  Figures f[NTESTS];
  if (b == NULL) return 1;
  setup(b);
  for (int t = 0; t < NTESTS; ++t) {
    samples[t] = malloc(sizeof(double) * (size_t)o.iters);
    if (samples[t] == NULL) return 1;
    run_block(b, (TestId)t, o.warmup, NULL);
  }
  for (long k = 0; k < o.blocks; ++k) { /* the tests take turns, block by block */
    long lo = o.iters * k / o.blocks, hi = o.iters * (k + 1) / o.blocks;
    for (int t = 0; t < NTESTS; ++t) run_block(b, (TestId)t, hi - lo, samples[t] + lo);
  }
  CHECK(flagcx_mesh_flush(b->comm, -1, TIMEOUT_S));
  CHECK(flagcx_mesh_barrier(b->comm, TIMEOUT_S));
  if (b->rank == 0) {
    for (int t = 0; t < NTESTS; ++t) f[t] = summarize(samples[t], o.iters);
    FILE *out = o.out ? fopen(o.out, "w") : stdout;
    if (out == NULL) die(o.out);
    report(b, &o, f, out, o.out != NULL);
    if (out != stdout) fclose(out);
  }
  close(b->sock);
  CHECK(flagcx_mesh_comm_destroy(b->comm));
  for (int t = 0; t < NTESTS; ++t) free(samples[t]);
  free(b);
  return 0;
}
