/* flagcx_mesh_testing.h: test doubles for the FlagCX drop-in, in
 * libflagcx_mesh_testing.so (link with -lflagcx_mesh_testing -lflagcx_mesh).
 * Not part of libflagcx_mesh.so: production code never links it. */
#ifndef FLAGCX_MESH_TESTING_H_
#define FLAGCX_MESH_TESTING_H_

#include "flagcx_mesh.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A test adaptor that behaves like FlagCX's IB adaptor, over loopback TCP
 * (127.0.0.1, ephemeral ports):
 * no identity on the wire, one FIFO accept queue per listener, and a connect
 * that completes only once the other side's accept has taken it. connect and
 * accept each wait a random 0..jitter_us before acting (seeded by seed). */
typedef struct {
  size_t size;        /* sizeof(flagcx_mesh_test_adaptor_config_t) */
  uint32_t jitter_us; /* 0: none */
  uint64_t seed;
  int carry_bytes;    /* 1: provide isend/irecv/test */
  /* Extra delay before a rank's connect to its own listener: forces the order
   * in which FlagCX's loop files a peer's connection into the self slot. */
  uint32_t self_connect_delay_us;
} flagcx_mesh_test_adaptor_config_t;

#define FLAGCX_MESH_TEST_ADAPTOR_CONFIG_INITIALIZER \
  {sizeof(flagcx_mesh_test_adaptor_config_t), 0, 1, 1, 0}

FLAGCX_MESH_API flagcx_mesh_result_t flagcx_mesh_test_adaptor_create(
    const flagcx_mesh_test_adaptor_config_t *config, flagcx_mesh_net_adaptor_t *net);
FLAGCX_MESH_API flagcx_mesh_result_t flagcx_mesh_test_adaptor_destroy(flagcx_mesh_net_adaptor_t *net);
/* Why this thread's last call of this library failed ("" after a success). */
FLAGCX_MESH_API const char *flagcx_mesh_test_last_error(void);

#ifdef __cplusplus
}
#endif

#endif /* FLAGCX_MESH_TESTING_H_ */
