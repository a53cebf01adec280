/* flagcx_mesh_testing.h: test doubles for the FlagCX drop-in, in
 * libflagcx_mesh_testing.so (link with -lflagcx_mesh_testing -lflagcx_mesh).
 * Not part of libflagcx_mesh.so: production code never links it. */
#ifndef FLAGCX_MESH_TESTING_H_
#define FLAGCX_MESH_TESTING_H_

#include "flagcx_mesh.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A test adaptor shaped like FlagCX's net adaptors, over loopback TCP
 * (127.0.0.1, ephemeral ports): no identity on the wire, one FIFO accept
 * queue per listener. connect and accept each wait a random 0..jitter_us
 * before acting (seeded by seed). Modes:
 *  IB         a connect completes only once the other side's accept took it;
 *             isend/irecv always hand out a request; no reg_mr (the 0.2 model).
 *  IB_STRICT  as IB, and as IB's verbs adaptor: isend returns a NULL request
 *             ("call again") until the peer has posted the matching irecv,
 *             irecv returns NULL once per message before it posts, and both
 *             refuse (EFAULT) a buffer not covered by a reg_mr handle on that
 *             comm.
 *  SOCKET     as FlagCX's socket adaptor: a connect completes in the kernel
 *             backlog, before the peer accepts; each connection is
 *             socks_per_conn sockets opened one after the other, each sending
 *             its 1-byte index; accept takes sockets one at a time from the
 *             listener and files each by that index (a duplicate index
 *             replaces the earlier socket, which is closed), so connections
 *             arriving together get mixed; message j of a comm travels on
 *             socket j % socks_per_conn (an empty slot: ENOTCONN). reg_mr
 *             is provided and always succeeds. */
#define FLAGCX_MESH_TEST_ADAPTOR_IB 0
#define FLAGCX_MESH_TEST_ADAPTOR_IB_STRICT 1
#define FLAGCX_MESH_TEST_ADAPTOR_SOCKET 2
#define FLAGCX_MESH_TEST_ADAPTOR_MAX_SOCKS 4

typedef struct {
  size_t size;        /* sizeof(flagcx_mesh_test_adaptor_config_t) */
  uint32_t jitter_us; /* 0: none */
  uint64_t seed;
  int carry_bytes;    /* 1: provide isend/irecv/test */
  /* Extra delay before a rank's connect to its own listener: forces the order
   * in which FlagCX's loop files a peer's connection into the self slot. */
  uint32_t self_connect_delay_us;
  /* ---- appended after FLAGCX_MESH_TEST_ADAPTOR_CONFIG_SIZE_V1 (0.2: mode IB) ---- */
  int mode;                /* FLAGCX_MESH_TEST_ADAPTOR_IB, _IB_STRICT or _SOCKET */
  uint32_t socks_per_conn; /* SOCKET mode: 1..FLAGCX_MESH_TEST_ADAPTOR_MAX_SOCKS (0: 1) */
} flagcx_mesh_test_adaptor_config_t;

#define FLAGCX_MESH_TEST_ADAPTOR_CONFIG_SIZE_V1 offsetof(flagcx_mesh_test_adaptor_config_t, mode)
#define FLAGCX_MESH_TEST_ADAPTOR_CONFIG_INITIALIZER \
  {sizeof(flagcx_mesh_test_adaptor_config_t), 0, 1, 1, 0, FLAGCX_MESH_TEST_ADAPTOR_IB, 1}

FLAGCX_MESH_API flagcx_mesh_result_t flagcx_mesh_test_adaptor_create(
    const flagcx_mesh_test_adaptor_config_t *config, flagcx_mesh_net_adaptor_t *net);
FLAGCX_MESH_API flagcx_mesh_result_t flagcx_mesh_test_adaptor_destroy(flagcx_mesh_net_adaptor_t *net);
/* Why this thread's last call of this library failed ("" after a success). */
FLAGCX_MESH_API const char *flagcx_mesh_test_last_error(void);

/* Fetches `count` cuMem fds from a device window's fd server (the abstract
 * unix socket `name`, without its leading NUL) as a peer's import does, within
 * timeout_ms: the number fetched (the fds are closed again), or -1 with the
 * reason in why (why_len bytes, NUL-terminated). */
FLAGCX_MESH_API int flagcx_mesh_test_fetch_fds(const char *name, uint64_t token, size_t count, int timeout_ms,
                                               char *why, size_t why_len);

#ifdef __cplusplus
}
#endif

#endif /* FLAGCX_MESH_TESTING_H_ */
