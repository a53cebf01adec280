/*
 * flagcx_mesh_net.h: building a full mesh over a network adaptor that has no
 * identity on the wire (FlagCX's IB adaptor: a listen handle with a constant
 * magic, one FIFO accept queue per listener, non-blocking connect/accept state
 * machines). Included by flagcx_mesh.h; C99.
 *
 * The call that replaces the loop in FlagCX's flagcxOneSideBuildOneContext
 * (once per context) is flagcx_mesh_net_build_full_mesh() with
 * FLAGCX_MESH_BUILD_ORDERED; integrations/flagcx/ in the source tree holds
 * that patch and the glue it needs. FLAGCX_MESH_BUILD_TAGGED also works where
 * the adaptor carries bytes and meets its precondition (below).
 */
#ifndef FLAGCX_MESH_NET_H_
#define FLAGCX_MESH_NET_H_

#include <stddef.h> /* offsetof */
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define FLAGCX_MESH_NET_HANDLE_MAX 128

/* A network adaptor, shaped like FlagCX's. Every function returns 0 on
 * success; any other value is a failure and is reported with the call and
 * peer. `ctx` is passed back to every call.
 *
 * Layouts: fields are only ever appended. size == sizeof(flagcx_mesh_net_adaptor_t)
 * is this layout; size == FLAGCX_MESH_NET_ADAPTOR_SIZE_V1 is the layout of
 * flagcx_mesh 0.2 (no reg_mr/dereg_mr, and isend/irecv without the mhandle
 * argument: see flagcx_mesh_net_io_v1_fn), accepted as an adaptor that needs
 * no registration. A size between the two is refused; a larger one (a later
 * version's struct) is read as this layout. The mhandle argument arrived in
 * 0.3 (FLAGCX_MESH_VERSION_MINOR 3): an adaptor written for this header must
 * not be handed to a 0.2 library, which would call isend/irecv without it. */
typedef struct flagcx_mesh_net_adaptor {
  size_t size;        /* sizeof(flagcx_mesh_net_adaptor_t) */
  const char *name;
  void *ctx;
  size_t handle_size; /* bytes of a listen handle, 1..FLAGCX_MESH_NET_HANDLE_MAX */
  int (*listen)(void *ctx, void *handle, void **listen_comm);
  /* Non-blocking: returns 0 with *send_comm == NULL while in progress. `handle`
   * is this rank's writable copy of the peer's listen handle (an adaptor may
   * keep its connect state in it, as FlagCX's does); each is used for one
   * connection. Whether a connect completes before the peer accepts (sockets:
   * in the kernel backlog) or only once it did (IB) is the adaptor's affair. */
  int (*connect)(void *ctx, void *handle, void **send_comm);
  /* Non-blocking: takes the first connection in the listener's queue, or
   * returns 0 with *recv_comm == NULL when none is ready yet. */
  int (*accept)(void *ctx, void *listen_comm, void **recv_comm);
  /* A failed build closes comms that may still have isend/irecv requests
   * posted: closing must cancel them (their buffers stay valid until the
   * close returns). There is no call to abandon a connect still in progress:
   * the adaptor keeps such state until it frees it itself. */
  int (*close_send)(void *ctx, void *send_comm);
  int (*close_recv)(void *ctx, void *recv_comm);
  int (*close_listen)(void *ctx, void *listen_comm);
  /* Optional (all three NULL when the adaptor cannot carry bytes before memory
   * registration): small transfers used for identity headers and the wiring
   * check. IB's contract: returning 0 with *request == NULL means "not yet,
   * call again" (IB does so until the peer posted its side); the build calls
   * again with the same arguments. mhandle is what reg_mr returned for a
   * range holding [data, data + size) on this comm (NULL when reg_mr is
   * NULL). test() sets *done to 1 once the request completed (and frees it). */
  int (*isend)(void *ctx, void *send_comm, const void *data, size_t size, void *mhandle, void **request);
  int (*irecv)(void *ctx, void *recv_comm, void *data, size_t size, void *mhandle, void **request);
  int (*test)(void *ctx, void *request, int *done);
  /* ---- appended after FLAGCX_MESH_NET_ADAPTOR_SIZE_V1 ---- */
  /* Optional (both set or both NULL): memory registration, as IB's regMr /
   * deregMr. When set, the build registers every buffer it sends from or
   * receives into, on the comm that carries it, before the transfer, and
   * deregisters each handle before it closes that comm (on a failed build a
   * request may still be posted on the buffer then: closing cancels it). */
  int (*reg_mr)(void *ctx, void *comm, void *data, size_t size, void **mhandle);
  int (*dereg_mr)(void *ctx, void *comm, void *mhandle);
} flagcx_mesh_net_adaptor_t;

/* The isend/irecv of the 0.2 layout (size == FLAGCX_MESH_NET_ADAPTOR_SIZE_V1):
 * the same, without mhandle. Such an adaptor stores these in isend/irecv. */
typedef int (*flagcx_mesh_net_isend_v1_fn)(void *ctx, void *send_comm, const void *data, size_t size,
                                           void **request);
typedef int (*flagcx_mesh_net_irecv_v1_fn)(void *ctx, void *recv_comm, void *data, size_t size, void **request);
#define FLAGCX_MESH_NET_ADAPTOR_SIZE_V1 offsetof(flagcx_mesh_net_adaptor_t, reg_mr)

/* An out-of-band bootstrap, shaped like FlagCX's (bootstrapCollAllGather,
 * bootstrapSend, bootstrapRecv). Every function returns 0 on success,
 * FLAGCX_MESH_TIMED_OUT (2) when its deadline expired, any other value on
 * failure. timeout_s is what is left of the build's deadline: a bootstrap
 * that supports deadlines fails after it (one that does not may ignore it,
 * as FlagCX's does: then give it an abort hook, or a rank that dies
 * mid-build leaves the others blocked in recv for ever).
 * size == FLAGCX_MESH_BOOTSTRAP_OPS_SIZE_V1 (no abort field, flagcx_mesh 0.2)
 * is accepted as a bootstrap without an abort hook. */
typedef struct flagcx_mesh_bootstrap_ops {
  size_t size; /* sizeof(flagcx_mesh_bootstrap_ops_t) */
  void *ctx;
  int rank;
  int nranks;
  /* In place: data holds nranks blocks of `bytes` each; this rank's block is
   * filled in, every block is filled on return. */
  int (*allgather)(void *ctx, void *data, size_t bytes, double timeout_s);
  int (*send)(void *ctx, int peer, int tag, const void *data, size_t size, double timeout_s);
  /* Blocks until the message with (peer, tag) arrives. */
  int (*recv)(void *ctx, int peer, int tag, void *data, size_t size, double timeout_s);
  /* ---- appended after FLAGCX_MESH_BOOTSTRAP_OPS_SIZE_V1 ---- */
  /* Optional. When set, a build runs a watchdog thread that calls it once,
   * from that thread, if the build's deadline passes while the build is
   * blocked in one of the calls above: that call (and any later one) must
   * then return non-zero soon. The bootstrap may be unusable afterwards (the
   * build has failed). Never called after a build returned. */
  int (*abort)(void *ctx);
} flagcx_mesh_bootstrap_ops_t;

#define FLAGCX_MESH_BOOTSTRAP_OPS_SIZE_V1 offsetof(flagcx_mesh_bootstrap_ops_t, abort)

typedef enum {
  /* FlagCX's loop as shipped, with a deadline added so that its hang is
   * reported instead of spinning forever. For reproducing the race only. */
  FLAGCX_MESH_BUILD_LEGACY = 0,
  /* Ordered pairwise rounds; in round i a rank connects to rank+i only after
   * rank+i said over the bootstrap that its round-i accept is next, so an
   * accept queue never holds another round's connection. Round 0 is self. */
  FLAGCX_MESH_BUILD_ORDERED = 1,
  /* Every connection carries identity headers over the adaptor and is filed
   * by them; needs isend/irecv/test. Precondition: each accept delivers one
   * whole connection, i.e. the comm an accept returns carries only what one
   * connect's comm sends. FlagCX's socket adaptor with several sockets per
   * connection breaks it (its accept takes sockets one at a time from the
   * listener, so connections arriving together get mixed). The identity
   * header is sent FLAGCX_MESH_TAGGED_IDENTITY_COPIES times and every copy
   * must agree: a mixed connection fails the build with an error saying the
   * precondition is violated (never a miswired mesh), provided the adaptor
   * spreads consecutive messages over at most that many sockets. Over such
   * an adaptor use ORDERED, which never has two connections in flight to one
   * listener. */
  FLAGCX_MESH_BUILD_TAGGED = 2
} flagcx_mesh_builder_t;

#define FLAGCX_MESH_TAGGED_IDENTITY_COPIES 4

typedef struct {
  size_t size;                   /* sizeof(flagcx_mesh_net_build_config_t) */
  flagcx_mesh_builder_t builder;
  double timeout_s;              /* whole build; 0: FLAGCX_MESH_TIMEOUT (60) */
  int wiring_check;              /* 1: confirm identities over isend/irecv when available */
  int tag_base;                  /* bootstrap send/recv tags used: tag_base .. tag_base + nranks */
} flagcx_mesh_net_build_config_t;

#define FLAGCX_MESH_NET_BUILD_CONFIG_INITIALIZER \
  {sizeof(flagcx_mesh_net_build_config_t), FLAGCX_MESH_BUILD_ORDERED, 0.0, 1, 0x6d780000}

/* Collective over boot: builds send_comms[p] (to p) and recv_comms[p] (from p)
 * for every p, self included; both arrays hold boot->nranks entries and are
 * written only on success (every registration the build made is then
 * deregistered). On failure every memory handle is deregistered and every
 * comm the adaptor handed to this call (listen, send and recv comms) is
 * closed exactly once, and the last error names the round, the peer and the
 * step. With boot->abort set, a watchdog thread runs during the call. */
FLAGCX_MESH_API flagcx_mesh_result_t flagcx_mesh_net_build_full_mesh(
    const flagcx_mesh_net_adaptor_t *net, const flagcx_mesh_bootstrap_ops_t *boot,
    const flagcx_mesh_net_build_config_t *config, void **send_comms, void **recv_comms);

/* Closes what flagcx_mesh_net_build_full_mesh built (entries may be NULL). */
FLAGCX_MESH_API flagcx_mesh_result_t flagcx_mesh_net_close_full_mesh(const flagcx_mesh_net_adaptor_t *net,
                                                                     int nranks, void **send_comms,
                                                                     void **recv_comms);

/* flagcx_mesh's own bootstrap (the unique id's rendezvous root), as ops.
 * send/recv are relayed by the root; a recv fails at once when the root
 * reports that a rank failed or was lost. Its ops return flagcx_mesh_result_t
 * values (FLAGCX_MESH_TIMED_OUT, FLAGCX_MESH_PEER_LOST, ...). */
typedef struct flagcx_mesh_bootstrap *flagcx_mesh_bootstrap_t;
FLAGCX_MESH_API flagcx_mesh_result_t flagcx_mesh_bootstrap_init(flagcx_mesh_bootstrap_t *boot, int nranks,
                                                                const flagcx_mesh_unique_id_t *id, int rank,
                                                                double timeout_s);
/* Fills ops for boot; valid while boot lives. Only the fields of the 0.2 layout are
 * written, and ops->size is set to FLAGCX_MESH_BOOTSTRAP_OPS_SIZE_V1 (no abort hook: this
 * bootstrap's calls have deadlines of their own), so a 0.2 caller's smaller struct is safe. */
FLAGCX_MESH_API flagcx_mesh_result_t flagcx_mesh_bootstrap_get_ops(flagcx_mesh_bootstrap_t boot,
                                                                   flagcx_mesh_bootstrap_ops_t *ops);
FLAGCX_MESH_API flagcx_mesh_result_t flagcx_mesh_bootstrap_destroy(flagcx_mesh_bootstrap_t boot);

#ifdef __cplusplus
}
#endif

#endif /* FLAGCX_MESH_NET_H_ */
