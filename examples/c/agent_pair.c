/*
 * agent_pair.c: a prefill agent writes a KV-shaped batch of blocks into a decode
 * agent's region and notifies it; the decode waits for the notification, checks
 * every byte and prints what it saw. Two processes (this one forks), no launcher:
 * agents need no rendezvous, only each other's metadata (sent here over a pipe).
 *
 *   cc -std=c99 examples/c/agent_pair.c $(python -m flagcx_mesh.config --cflags --libs) -o agent_pair
 *   FLAGCX_MESH_AGENT_SECRET=any-shared-secret ./agent_pair
 */
#define _POSIX_C_SOURCE 200809L
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include "flagcx_mesh.h"

#define BLOCKS 64
#define BLOCK_BYTES (64u << 10)
#define REGION_BYTES ((size_t)BLOCKS * BLOCK_BYTES)
#define DESC_CAP 4096
#define TIMEOUT_S 30.0

#define CHECK(call)                                                                      \
  do {                                                                                   \
    flagcx_mesh_result_t r_ = (call);                                                    \
    if (r_ != FLAGCX_MESH_OK) {                                                          \
      fprintf(stderr, "FAILED %s: %s\n  %s\n", #call, flagcx_mesh_result_string(r_),     \
              flagcx_mesh_last_error());                                                 \
      exit(1);                                                                           \
    }                                                                                    \
  } while (0)

static unsigned char pattern(size_t block, size_t i) { return (unsigned char)(block * 13 + i % 251); }

/* A message on a pipe: its length, then its bytes. */
static void send_blob(int fd, const void *p, size_t n) {
  uint64_t len = n;
  if (write(fd, &len, sizeof len) != (ssize_t)sizeof len || write(fd, p, n) != (ssize_t)n) exit(2);
}
static size_t recv_blob(int fd, void *p, size_t cap) {
  uint64_t len = 0;
  if (read(fd, &len, sizeof len) != (ssize_t)sizeof len || len > cap) exit(2);
  size_t got = 0;
  while (got < len) {
    ssize_t k = read(fd, (char *)p + got, len - got);
    if (k <= 0) exit(2);
    got += (size_t)k;
  }
  return (size_t)len;
}

/* The decode: publishes its metadata and region, then waits for the prefill's notification. */
static int decode(int to_prefill) {
  flagcx_mesh_agent_t agent;
  CHECK(flagcx_mesh_agent_create(&agent, "decode-0", NULL, TIMEOUT_S));
  unsigned char *kv = calloc(1, REGION_BYTES);
  unsigned char meta[DESC_CAP], desc[DESC_CAP];
  size_t meta_len = sizeof meta, desc_len = sizeof desc;
  CHECK(flagcx_mesh_agent_register(agent, kv, REGION_BYTES, desc, &desc_len));
  CHECK(flagcx_mesh_agent_metadata(agent, meta, &meta_len));
  send_blob(to_prefill, meta, meta_len);
  send_blob(to_prefill, desc, desc_len);

  char peer[256], note[64];
  size_t note_len = sizeof note - 1;
  CHECK(flagcx_mesh_agent_notification(agent, TIMEOUT_S, peer, sizeof peer, note, &note_len));
  note[note_len] = '\0';
  size_t wrong = 0;
  for (size_t b = 0; b < BLOCKS; ++b) {  /* the prefill wrote block b into slot BLOCKS-1-b */
    const unsigned char *slot = kv + (BLOCKS - 1 - b) * (size_t)BLOCK_BYTES;
    for (size_t i = 0; i < BLOCK_BYTES; ++i) wrong += slot[i] != pattern(b, i);
  }
  char stats[1024], peers[1024];
  size_t stats_len = sizeof stats, peers_len = sizeof peers;
  CHECK(flagcx_mesh_agent_stats(agent, stats, &stats_len));
  CHECK(flagcx_mesh_agent_peers(agent, peers, &peers_len));
  printf("decode: notification \"%s\" from %s; %zu wrong bytes in %d blocks\n", note, peer, wrong, BLOCKS);
  printf("decode: stats %s\ndecode: peers %s", stats, peers);
  CHECK(flagcx_mesh_agent_deregister(agent, desc, desc_len, TIMEOUT_S));
  CHECK(flagcx_mesh_agent_destroy(agent));
  free(kv);
  return wrong == 0 && strcmp(peer, "prefill-0") == 0 ? 0 : 1;
}

/* The prefill: connects, writes every block into the decode's region (reversed) in one batch.
 * Its agent stays open (*out) until the decode is done with it (main destroys it). */
static int prefill(int from_decode, flagcx_mesh_agent_t *out) {
  unsigned char meta[DESC_CAP], remote[DESC_CAP], local[DESC_CAP];
  size_t meta_len = recv_blob(from_decode, meta, sizeof meta);
  size_t remote_len = recv_blob(from_decode, remote, sizeof remote);
  flagcx_mesh_agent_t agent;
  CHECK(flagcx_mesh_agent_create(&agent, "prefill-0", NULL, TIMEOUT_S));
  void *base = NULL;
  size_t local_len = sizeof local;
  CHECK(flagcx_mesh_agent_alloc(agent, REGION_BYTES, &base, local, &local_len));
  unsigned char *kv = base;
  for (size_t b = 0; b < BLOCKS; ++b)
    for (size_t i = 0; i < BLOCK_BYTES; ++i) kv[b * BLOCK_BYTES + i] = pattern(b, i);

  flagcx_mesh_agent_conn_t conn;
  CHECK(flagcx_mesh_agent_connect(agent, meta, meta_len, TIMEOUT_S, &conn));
  char path[32];
  size_t path_len = sizeof path;
  CHECK(flagcx_mesh_agent_path_to(conn, remote, remote_len, local, local_len, path, &path_len));
  flagcx_mesh_agent_xfer_t ops[BLOCKS];
  for (size_t b = 0; b < BLOCKS; ++b) {
    flagcx_mesh_agent_xfer_t op = {local, local_len, b * BLOCK_BYTES,
                                   remote, remote_len, (BLOCKS - 1 - b) * (uint64_t)BLOCK_BYTES, BLOCK_BYTES};
    ops[b] = op;
  }
  flagcx_mesh_agent_handle_t h;
  const char note[] = "kv ready";
  CHECK(flagcx_mesh_agent_transfer(conn, 0, ops, BLOCKS, note, strlen(note), &h));
  CHECK(flagcx_mesh_agent_handle_wait(h, TIMEOUT_S));
  CHECK(flagcx_mesh_agent_handle_free(h));
  printf("prefill: wrote %d blocks of %u bytes over %s\n", BLOCKS, BLOCK_BYTES, path);
  CHECK(flagcx_mesh_agent_conn_release(conn));
  *out = agent;
  return 0;
}

int main(void) {
  int fds[2];
  if (pipe(fds) != 0) return 2;
  fflush(stdout);
  pid_t child = fork();
  if (child < 0) return 2;
  if (child == 0) {
    close(fds[0]);
    exit(decode(fds[1]));
  }
  close(fds[1]);
  flagcx_mesh_agent_t agent = NULL;
  int rc = prefill(fds[0], &agent);
  int status = 0;
  if (waitpid(child, &status, 0) != child) return 2;
  CHECK(flagcx_mesh_agent_destroy(agent));
  int decode_rc = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  printf("%s\n", rc == 0 && decode_rc == 0 ? "agent_pair: OK" : "agent_pair: FAILED");
  return rc != 0 ? rc : decode_rc;
}
