/*
 * put_signal.c: every rank puts a block into the next rank's window with a
 * signal, waits for the block from the previous rank and checks it.
 *
 * Build against the installed package with one line, then launch N ranks:
 *   cc -std=c99 examples/c/put_signal.c $(python -m flagcx_mesh.config --cflags --libs) -o put_signal
 *   python -m flagcx_mesh.launch -n 4 -- ./put_signal
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "flagcx_mesh.h"

#define BLOCK_BYTES (1u << 20)
#define ROUNDS 8

#define CHECK(call)                                                                      \
  do {                                                                                   \
    flagcx_mesh_result_t r_ = (call);                                                    \
    if (r_ != FLAGCX_MESH_OK) {                                                          \
      fprintf(stderr, "FAILED %s: %s\n  %s\n", #call, flagcx_mesh_result_string(r_),     \
              flagcx_mesh_last_error());                                                 \
      exit(1);                                                                           \
    }                                                                                    \
  } while (0)

static unsigned char pattern(int rank, int round, size_t i) {
  return (unsigned char)(rank * 31 + round * 7 + (int)(i % 251));
}

/* A bad call fails cleanly: a code, and a message naming the call and the peer. */
static void show_error_reporting(flagcx_mesh_comm_t comm, int nranks, uint32_t win, uint32_t sig) {
  flagcx_mesh_result_t r = flagcx_mesh_put_signal(comm, nranks, win, 0, win, 0, 8, sig, 0, 1);
  if (r != FLAGCX_MESH_INVALID_ARGUMENT) {
    fprintf(stderr, "FAILED: a put to rank %d (out of range) returned %d\n", nranks, (int)r);
    exit(1);
  }
  printf("refused as expected: %s (peer %d)\n", flagcx_mesh_last_error(), flagcx_mesh_last_error_peer());
}

int main(void) {
  flagcx_mesh_comm_t comm;
  int rank, nranks;
  CHECK(flagcx_mesh_comm_init_from_env(&comm, NULL));
  CHECK(flagcx_mesh_comm_rank(comm, &rank));
  CHECK(flagcx_mesh_comm_nranks(comm, &nranks));
  int next = (rank + 1) % nranks, prev = (rank + nranks - 1) % nranks;

  unsigned char *src = malloc(BLOCK_BYTES);
  uint32_t src_win, dst_win, sig_win;
  void *dst;
  if (src == NULL) return 1;
  CHECK(flagcx_mesh_window_register(comm, src, BLOCK_BYTES, &src_win));
  CHECK(flagcx_mesh_window_alloc(comm, BLOCK_BYTES, &dst_win, &dst));
  CHECK(flagcx_mesh_signal_window(comm, 1, &sig_win));
  const char *path;
  CHECK(flagcx_mesh_window_path(comm, dst_win, next, &path));
  printf("rank %d of %d (library %d): puts to rank %d over %s\n", rank, nranks, flagcx_mesh_version(), next,
         path);

  for (int round = 0; round < ROUNDS; ++round) {
    for (size_t i = 0; i < BLOCK_BYTES; ++i) src[i] = pattern(rank, round, i);
    CHECK(flagcx_mesh_put_signal(comm, next, src_win, 0, dst_win, 0, BLOCK_BYTES, sig_win, 0, 1));
    CHECK(flagcx_mesh_wait_signal(comm, sig_win, 0, (uint64_t)round + 1, 30.0));
    const unsigned char *got = dst;
    for (size_t i = 0; i < BLOCK_BYTES; ++i) {
      if (got[i] != pattern(prev, round, i)) {
        fprintf(stderr, "FAILED: round %d byte %zu from rank %d is %u\n", round, i, prev, got[i]);
        return 1;
      }
    }
    CHECK(flagcx_mesh_flush(comm, next, 30.0));
    CHECK(flagcx_mesh_barrier(comm, 30.0)); /* the next round may overwrite dst */
  }
  show_error_reporting(comm, nranks, dst_win, sig_win);
  uint64_t done;
  CHECK(flagcx_mesh_read_counter(comm, &done));
  CHECK(flagcx_mesh_comm_destroy(comm));
  free(src);
  printf("rank %d: PASS %d rounds of %u bytes from rank %d (%llu ops completed)\n", rank, ROUNDS,
         BLOCK_BYTES, prev, (unsigned long long)done);
  return 0;
}
