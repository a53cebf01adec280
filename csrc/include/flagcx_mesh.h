/*
 * flagcx_mesh.h: the stable C ABI of flagcx_mesh (C99).
 *
 * Every call returns a flagcx_mesh_result_t. On failure the calling thread's
 * last error (flagcx_mesh_last_error()) says what failed, on which rank and
 * with which peer and errno; output parameters are written only on success.
 * Handles are opaque. Config and vtable structs begin with their size (set it
 * to sizeof the struct); a size below this version's is refused, and a later
 * version that grows a struct will still accept this version's size.
 *
 * Link: cc prog.c $(python -m flagcx_mesh.config --cflags --libs)
 *   or CMake: find_package(flagcx_mesh) + target_link_libraries(t flagcx_mesh::flagcx_mesh)
 *   or pkg-config --cflags --libs flagcx_mesh
 */
#ifndef FLAGCX_MESH_H_
#define FLAGCX_MESH_H_

#include <stddef.h>
#include <stdint.h>

#define FLAGCX_MESH_VERSION_MAJOR 0
#define FLAGCX_MESH_VERSION_MINOR 4
#define FLAGCX_MESH_VERSION_PATCH 0
#define FLAGCX_MESH_VERSION_CODE \
  (FLAGCX_MESH_VERSION_MAJOR * 10000 + FLAGCX_MESH_VERSION_MINOR * 100 + FLAGCX_MESH_VERSION_PATCH)

#if defined(__GNUC__)
#define FLAGCX_MESH_API __attribute__((visibility("default")))
#else
#define FLAGCX_MESH_API
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------ results */

/* Fixed values; the same codes as flagcx_mesh.errors in Python. */
typedef enum {
  FLAGCX_MESH_OK = 0,
  FLAGCX_MESH_INVALID_ARGUMENT = 1, /* bad input from the caller; nothing was changed */
  FLAGCX_MESH_TIMED_OUT = 2,        /* a deadline expired */
  FLAGCX_MESH_PEER_LOST = 3,        /* a peer (or the rendezvous root) went away */
  FLAGCX_MESH_PROTOCOL = 4,         /* malformed, foreign or miswired data on the wire */
  FLAGCX_MESH_SYSTEM = 5,           /* a system call failed (see the errno) */
  FLAGCX_MESH_CLOSED = 6,           /* the handle was used after it was closed */
  FLAGCX_MESH_INTERNAL = 7,         /* a bug in this library */
  FLAGCX_MESH_NUM_RESULTS = 8,
  /* Deprecated alias of FLAGCX_MESH_TIMED_OUT (until 0.4 the code's name, which is also the
   * environment variable's); kept so that existing programs build; use FLAGCX_MESH_TIMED_OUT. */
  FLAGCX_MESH_TIMEOUT = FLAGCX_MESH_TIMED_OUT
} flagcx_mesh_result_t;

/* Runtime version: FLAGCX_MESH_VERSION_CODE of the loaded library. */
FLAGCX_MESH_API int flagcx_mesh_version(void);
/* A fixed description of a result code (never NULL, also for unknown values). */
FLAGCX_MESH_API const char *flagcx_mesh_result_string(flagcx_mesh_result_t result);
/* What the last failed call on this thread did wrong, naming the call, the rank
 * and the peer; "" when the last call succeeded. Valid until the next call. */
FLAGCX_MESH_API const char *flagcx_mesh_last_error(void);
/* The peer rank (-1: none) and errno (0: none) of this thread's last error. */
FLAGCX_MESH_API int flagcx_mesh_last_error_peer(void);
FLAGCX_MESH_API int flagcx_mesh_last_error_errno(void);
/* The name of the agent this thread's last error concerns (the peer of an agent
 * connection's call or handle); "" when none. Valid until the next call. */
FLAGCX_MESH_API const char *flagcx_mesh_last_error_peer_name(void);

/* ---------------------------------------------------------------- unique id */

#define FLAGCX_MESH_UNIQUE_ID_BYTES 256
typedef struct {
  char internal[FLAGCX_MESH_UNIQUE_ID_BYTES];
} flagcx_mesh_unique_id_t;

/* Makes an id and starts the rendezvous root in this process, which must stay
 * alive until every rank has joined. Carry the bytes to all ranks any way. */
FLAGCX_MESH_API flagcx_mesh_result_t flagcx_mesh_get_unique_id(flagcx_mesh_unique_id_t *id);
/* Ends the rendezvous root of an id this process made and no rank has joined:
 * its thread ends and its port closes before this returns. *released (may be
 * NULL) is 1 then, 0 when the id is not a live root of this process or a rank
 * has joined it (that root lives on). An unused root also ends by itself after
 * FLAGCX_MESH_ROOT_IDLE_TIMEOUT seconds (600). */
FLAGCX_MESH_API flagcx_mesh_result_t flagcx_mesh_release_unique_id(const flagcx_mesh_unique_id_t *id,
                                                                   int *released);
/* 512 hex characters (as the launcher's FLAGCX_MESH_UNIQUE_ID) -> id. */
FLAGCX_MESH_API flagcx_mesh_result_t flagcx_mesh_unique_id_from_hex(const char *hex,
                                                                    flagcx_mesh_unique_id_t *id);

/* ------------------------------------------------------------- communicator */

typedef struct flagcx_mesh_comm *flagcx_mesh_comm_t;

typedef struct {
  size_t size;       /* sizeof(flagcx_mesh_config_t) */
  int contexts;      /* independent connection sets per peer pair (>= 1) */
  double timeout_s;  /* whole build and later collectives; 0: FLAGCX_MESH_TIMEOUT (60) */
  int max_inflight;  /* outgoing connects in flight while building */
} flagcx_mesh_config_t;

#define FLAGCX_MESH_CONFIG_INITIALIZER {sizeof(flagcx_mesh_config_t), 1, 0.0, 64}

/* Collective: blocks until all nranks have joined and the mesh is built and
 * checked, or fails on every rank naming the missing peers. Thread-safe;
 * several communicators may be built at once. config may be NULL. */
FLAGCX_MESH_API flagcx_mesh_result_t flagcx_mesh_comm_init(flagcx_mesh_comm_t *comm, int nranks,
                                                           const flagcx_mesh_unique_id_t *id, int rank,
                                                           const flagcx_mesh_config_t *config);
/* The same, with rank, nranks and id from the embedded launcher's environment
 * (FLAGCX_MESH_RANK, FLAGCX_MESH_NRANKS, FLAGCX_MESH_UNIQUE_ID). */
FLAGCX_MESH_API flagcx_mesh_result_t flagcx_mesh_comm_init_from_env(flagcx_mesh_comm_t *comm,
                                                                    const flagcx_mesh_config_t *config);
/* Closes every connection and frees the handle (NULL is accepted). Waits in
 * other threads on this communicator return FLAGCX_MESH_CLOSED first. */
FLAGCX_MESH_API flagcx_mesh_result_t flagcx_mesh_comm_destroy(flagcx_mesh_comm_t comm);
FLAGCX_MESH_API flagcx_mesh_result_t flagcx_mesh_comm_rank(flagcx_mesh_comm_t comm, int *rank);
FLAGCX_MESH_API flagcx_mesh_result_t flagcx_mesh_comm_nranks(flagcx_mesh_comm_t comm, int *nranks);
/* Collective barrier over the rendezvous root; timeout_s 0: the comm's timeout. */
FLAGCX_MESH_API flagcx_mesh_result_t flagcx_mesh_barrier(flagcx_mesh_comm_t comm, double timeout_s);

/* ------------------------------------------------------------------ windows */

/* All registrations are collective, and the index is the registration order,
 * the same on every rank. */
FLAGCX_MESH_API flagcx_mesh_result_t flagcx_mesh_window_register(flagcx_mesh_comm_t comm, void *base,
                                                                 uint64_t size, uint32_t *index);
/* Library-allocated shared memory (the fastest path on one host). */
FLAGCX_MESH_API flagcx_mesh_result_t flagcx_mesh_window_alloc(flagcx_mesh_comm_t comm, uint64_t size,
                                                              uint32_t *index, void **base);
/* A window of nslots 64-bit signal slots, all zero. */
FLAGCX_MESH_API flagcx_mesh_result_t flagcx_mesh_signal_window(flagcx_mesh_comm_t comm, uint64_t nslots,
                                                               uint32_t *index);
/* Where a window's memory lives. CUDA memory needs the NVIDIA driver at run
 * time (libcuda.so.1, loaded on first use; no CUDA header is needed here). */
typedef enum {
  FLAGCX_MESH_MEM_HOST = 0,
  FLAGCX_MESH_MEM_CUDA = 1
} flagcx_mesh_mem_type_t;
/* flagcx_mesh_window_register for host or CUDA device memory (a cudaMalloc /
 * torch allocation, or cuMem memory with a POSIX fd handle). */
FLAGCX_MESH_API flagcx_mesh_result_t flagcx_mesh_window_register_mem(flagcx_mesh_comm_t comm, void *base,
                                                                     uint64_t size, flagcx_mesh_mem_type_t mem_type,
                                                                     uint32_t *index);
/* flagcx_mesh_window_alloc in host shared memory (device ignored) or in CUDA
 * memory of device `device` (cuMem with a POSIX fd handle); *base gets the
 * window's address (a device address for CUDA). */
FLAGCX_MESH_API flagcx_mesh_result_t flagcx_mesh_window_alloc_mem(flagcx_mesh_comm_t comm, uint64_t size,
                                                                  flagcx_mesh_mem_type_t mem_type, int device,
                                                                  uint32_t *index, void **base);
/* Collective: flushes, then every rank drops the window. */
FLAGCX_MESH_API flagcx_mesh_result_t flagcx_mesh_window_deregister(flagcx_mesh_comm_t comm, uint32_t index);
/* The path that reaches peer's copy of the window: "self", "shm", "cma",
 * "tcp", or for CUDA memory "cuda-self", "cuda-vmm", "cuda-ipc", "staged"
 * (a static string). flagcx_mesh_window_describe says why a faster path
 * was not taken. */
FLAGCX_MESH_API flagcx_mesh_result_t flagcx_mesh_window_path(flagcx_mesh_comm_t comm, uint32_t index,
                                                             int peer, const char **path);
/* Per-peer paths with the reason each fallback was taken, NUL-terminated,
 * truncated to len bytes; *needed (may be NULL) gets the full length + 1. */
FLAGCX_MESH_API flagcx_mesh_result_t flagcx_mesh_window_describe(flagcx_mesh_comm_t comm, uint32_t index,
                                                                 char *buf, size_t len, size_t *needed);

/* --------------------------------------------------------------- operations */

/* Every timeout_s of a call below (and of the barrier and the agent calls): 0 is the comm's
 * (the agent's) timeout, a number > 0 is seconds, INFINITY no limit; a negative number or NaN
 * fails with FLAGCX_MESH_INVALID_ARGUMENT naming the call's timeout (docs/python-api.md,
 * "Timeouts": the one rule of the library). */

/* Non-blocking, FIFO per peer, thread-safe. Offsets and sizes are in bytes and
 * are checked against both windows before anything is written. */
FLAGCX_MESH_API flagcx_mesh_result_t flagcx_mesh_put(flagcx_mesh_comm_t comm, int peer, uint32_t src_win,
                                                     uint64_t src_off, uint32_t dst_win, uint64_t dst_off,
                                                     uint64_t size);
/* put, then ADD sig_value to slot sig_slot of peer's signal window sig_win,
 * after the data is visible there. size 0: signal only. */
FLAGCX_MESH_API flagcx_mesh_result_t flagcx_mesh_put_signal(flagcx_mesh_comm_t comm, int peer,
                                                            uint32_t src_win, uint64_t src_off,
                                                            uint32_t dst_win, uint64_t dst_off, uint64_t size,
                                                            uint32_t sig_win, uint64_t sig_slot,
                                                            uint64_t sig_value);
FLAGCX_MESH_API flagcx_mesh_result_t flagcx_mesh_signal(flagcx_mesh_comm_t comm, int peer, uint32_t sig_win,
                                                        uint64_t sig_slot, uint64_t sig_value);
/* Reads peer's window src_win into this rank's window dst_win. */
FLAGCX_MESH_API flagcx_mesh_result_t flagcx_mesh_get(flagcx_mesh_comm_t comm, int peer, uint32_t src_win,
                                                     uint64_t src_off, uint32_t dst_win, uint64_t dst_off,
                                                     uint64_t size);
/* This rank's slot value. */
FLAGCX_MESH_API flagcx_mesh_result_t flagcx_mesh_read_signal(flagcx_mesh_comm_t comm, uint32_t sig_win,
                                                             uint64_t sig_slot, uint64_t *value);
/* Waits until this rank's slot reached expected: (int64)(value - expected) >= 0,
 * the stream wait's rule (docs/gpu.md). FLAGCX_MESH_TIMED_OUT after
 * timeout_s, FLAGCX_MESH_PEER_LOST when the last signaller went away. */
FLAGCX_MESH_API flagcx_mesh_result_t flagcx_mesh_wait_signal(flagcx_mesh_comm_t comm, uint32_t sig_win,
                                                             uint64_t sig_slot, uint64_t expected,
                                                             double timeout_s);
/* Stream-ordered variants. stream is a CUstream / cudaStream_t (NULL: the
 * legacy default stream): the op starts after the stream's earlier work and
 * completes in its order (its signal is applied from the stream). */
FLAGCX_MESH_API flagcx_mesh_result_t flagcx_mesh_put_on_stream(flagcx_mesh_comm_t comm, int peer, uint32_t src_win,
                                                               uint64_t src_off, uint32_t dst_win, uint64_t dst_off,
                                                               uint64_t size, void *stream);
FLAGCX_MESH_API flagcx_mesh_result_t flagcx_mesh_put_signal_on_stream(flagcx_mesh_comm_t comm, int peer,
                                                                      uint32_t src_win, uint64_t src_off,
                                                                      uint32_t dst_win, uint64_t dst_off,
                                                                      uint64_t size, uint32_t sig_win,
                                                                      uint64_t sig_slot, uint64_t sig_value,
                                                                      void *stream);
FLAGCX_MESH_API flagcx_mesh_result_t flagcx_mesh_signal_on_stream(flagcx_mesh_comm_t comm, int peer,
                                                                  uint32_t sig_win, uint64_t sig_slot,
                                                                  uint64_t sig_value, void *stream);
FLAGCX_MESH_API flagcx_mesh_result_t flagcx_mesh_get_on_stream(flagcx_mesh_comm_t comm, int peer, uint32_t src_win,
                                                               uint64_t src_off, uint32_t dst_win, uint64_t dst_off,
                                                               uint64_t size, void *stream);
/* Queues on stream a wait until this rank's slot is >= expected and returns
 * at once; where the driver has no stream memory operations it waits on the
 * host instead (up to timeout_s). */
FLAGCX_MESH_API flagcx_mesh_result_t flagcx_mesh_wait_signal_on_stream(flagcx_mesh_comm_t comm, uint32_t sig_win,
                                                                       uint64_t sig_slot, uint64_t expected,
                                                                       void *stream, double timeout_s);
/* Waits until every op issued to peer (-1: all peers) has completed remotely. */
FLAGCX_MESH_API flagcx_mesh_result_t flagcx_mesh_flush(flagcx_mesh_comm_t comm, int peer, double timeout_s);
/* Ops issued by this rank that have completed remotely, and a wait for it. */
FLAGCX_MESH_API flagcx_mesh_result_t flagcx_mesh_read_counter(flagcx_mesh_comm_t comm, uint64_t *value);
FLAGCX_MESH_API flagcx_mesh_result_t flagcx_mesh_wait_counter(flagcx_mesh_comm_t comm, uint64_t value,
                                                              double timeout_s);

/* ------------------------------------------------------------------ agents */

/* Dynamic peers (docs/agent.md): an agent registers memory locally and serves
 * whichever agents connect, each proving the shared secret. Descriptors and
 * metadata are bytes to send to peers by any channel. Calls that return bytes
 * take buf and *len (in: its capacity); on success *len is what was written;
 * when buf is too small they fail with FLAGCX_MESH_INVALID_ARGUMENT and set
 * *len to the size needed. */
typedef struct flagcx_mesh_agent *flagcx_mesh_agent_t;
/* The most bytes one notification may hold (64 MiB); a larger one is refused with
 * FLAGCX_MESH_INVALID_ARGUMENT before anything moves. */
#define FLAGCX_MESH_AGENT_MAX_NOTIFICATION_BYTES ((size_t)64 << 20)
typedef struct flagcx_mesh_agent_conn *flagcx_mesh_agent_conn_t;
typedef struct flagcx_mesh_agent_handle *flagcx_mesh_agent_handle_t;

/* One transfer of a batch: size bytes at local_offset of the local region
 * (its descriptor) and at remote_offset of the peer's region. */
typedef struct {
  const void *local;
  size_t local_len;
  uint64_t local_offset;
  const void *remote;
  size_t remote_len;
  uint64_t remote_offset;
  uint64_t size;
} flagcx_mesh_agent_xfer_t;

/* secret NULL or "": FLAGCX_MESH_AGENT_SECRET; timeout_s 0: FLAGCX_MESH_TIMEOUT. */
FLAGCX_MESH_API flagcx_mesh_result_t flagcx_mesh_agent_create(flagcx_mesh_agent_t *agent, const char *name,
                                                              const char *secret, double timeout_s);
/* Closes every connection and region; its handles and connections may still be freed (nothing else). */
FLAGCX_MESH_API flagcx_mesh_result_t flagcx_mesh_agent_destroy(flagcx_mesh_agent_t agent);
FLAGCX_MESH_API flagcx_mesh_result_t flagcx_mesh_agent_metadata(flagcx_mesh_agent_t agent, void *buf, size_t *len);
/* Registers host memory; the region's descriptor goes to desc. */
FLAGCX_MESH_API flagcx_mesh_result_t flagcx_mesh_agent_register(flagcx_mesh_agent_t agent, void *base, uint64_t size,
                                                                void *desc, size_t *desc_len);
/* Registers CUDA device memory [base, base + size) of one allocation (a cudaMalloc or
 * cuMem pointer); peers reach it over cuda-self, cuda-vmm, cuda-ipc or staged
 * (docs/agent.md). INVALID_ARGUMENT when it is not device memory or no driver loads. */
FLAGCX_MESH_API flagcx_mesh_result_t flagcx_mesh_agent_register_device(flagcx_mesh_agent_t agent, void *base,
                                                                       uint64_t size, void *desc, size_t *desc_len);
FLAGCX_MESH_API flagcx_mesh_result_t flagcx_mesh_agent_deregister(flagcx_mesh_agent_t agent, const void *desc,
                                                                  size_t desc_len, double timeout_s);
/* Connects to the agent whose metadata this is (an open connection to it is reused). */
FLAGCX_MESH_API flagcx_mesh_result_t flagcx_mesh_agent_connect(flagcx_mesh_agent_t agent, const void *metadata,
                                                               size_t metadata_len, double timeout_s,
                                                               flagcx_mesh_agent_conn_t *conn);
/* The agent's counters as one JSON object, NUL-terminated (*len counts the NUL): the
 * keys of Python's agent.stats(), e.g. {"accepted":2,"connected":1,"accept_fd_exhausted":0,
 * "get_answer_bytes_held":0,"get_answer_bytes_peak":0,"notification_drains":3,"waiter_reads":2,
 * "progress_late_wakes":0,
 * "rejected":{"bad authentication":1}}.
 * 1024 bytes hold every key; a short buffer fails with *len set to the size needed. */
FLAGCX_MESH_API flagcx_mesh_result_t flagcx_mesh_agent_stats(flagcx_mesh_agent_t agent, char *buf, size_t *len);
/* One line per open connection, "NAME INCARNATION ADDRESS\n" (NAME at most 200 bytes,
 * INCARNATION in hex), NUL-terminated; "" when none. */
FLAGCX_MESH_API flagcx_mesh_result_t flagcx_mesh_agent_peers(flagcx_mesh_agent_t agent, char *buf, size_t *len);
/* Allocates size bytes of zero-filled shared memory and registers it (local peers reach it
 * over shm): its address into *base, its descriptor into desc (as flagcx_mesh_agent_register). */
FLAGCX_MESH_API flagcx_mesh_result_t flagcx_mesh_agent_alloc(flagcx_mesh_agent_t agent, uint64_t size, void **base,
                                                             void *desc, size_t *desc_len);
/* The path transfers to the peer's region remote take from local (NULL: from host memory):
 * "self", "shm", "cma", "tcp", "cuda-self", "cuda-vmm", "cuda-ipc" or "staged",
 * NUL-terminated (16 bytes hold any). Chosen on first use, as a transfer would. */
FLAGCX_MESH_API flagcx_mesh_result_t flagcx_mesh_agent_path_to(flagcx_mesh_agent_conn_t conn, const void *remote,
                                                               size_t remote_len, const void *local, size_t local_len,
                                                               char *buf, size_t *len);
/* Drops this reference to the connection (the agent keeps it open). */
FLAGCX_MESH_API flagcx_mesh_result_t flagcx_mesh_agent_conn_release(flagcx_mesh_agent_conn_t conn);
/* Writes (is_read 0) or reads nops transfers, all checked before any byte
 * moves; the notification (NULL: none) follows the data. */
FLAGCX_MESH_API flagcx_mesh_result_t flagcx_mesh_agent_transfer(flagcx_mesh_agent_conn_t conn, int is_read,
                                                                const flagcx_mesh_agent_xfer_t *ops, size_t nops,
                                                                const void *notification, size_t notification_len,
                                                                flagcx_mesh_agent_handle_t *handle);
/* flagcx_mesh_agent_transfer ordered on a CUDA stream (a CUstream / cudaStream_t;
 * NULL: the legacy default stream): it starts after the work queued on the
 * stream so far, as conn.write(stream=...) does (docs/agent.md, "Streams"). */
FLAGCX_MESH_API flagcx_mesh_result_t flagcx_mesh_agent_transfer_on_stream(flagcx_mesh_agent_conn_t conn, int is_read,
                                                                          const flagcx_mesh_agent_xfer_t *ops, size_t nops,
                                                                          const void *notification,
                                                                          size_t notification_len, void *stream,
                                                                          flagcx_mesh_agent_handle_t *handle);
/* Queues on stream (of the current device; NULL: the legacy default stream) a
 * wait: its later work runs once a notification of exactly these len bytes
 * arrived (from agent peer; NULL or "": any) and returns at once; the wait
 * consumes that notification. One already arrived and unread releases it at
 * once. Released too after timeout_s (0: the agent's timeout), when that peer
 * is gone, or when the agent is destroyed: the stream always proceeds, and
 * flagcx_mesh_agent_handle_wait on *handle returns the cause (TIMEOUT,
 * PEER_LOST, CLOSED; flagcx_mesh_last_error names the peer). See docs/agent.md,
 * "Stream waits on notifications". */
FLAGCX_MESH_API flagcx_mesh_result_t flagcx_mesh_agent_stream_wait_notification(flagcx_mesh_agent_t agent,
                                                                                const void *data, size_t len,
                                                                                const char *peer, void *stream,
                                                                                double timeout_s,
                                                                                flagcx_mesh_agent_handle_t *handle);
/* *done: 1 once the transfer completed or failed (wait says which); for a
 * stream wait, once it was released. */
FLAGCX_MESH_API flagcx_mesh_result_t flagcx_mesh_agent_handle_test(flagcx_mesh_agent_handle_t handle, int *done);
/* timeout_s 0: the agent's timeout (a stream wait: until it is released, which its own timeout bounds). */
FLAGCX_MESH_API flagcx_mesh_result_t flagcx_mesh_agent_handle_wait(flagcx_mesh_agent_handle_t handle, double timeout_s);
/* *ops, *bytes: the transfer's ops and the bytes they move, known when the call returned (0 for a
 * stream wait); either may be NULL. */
FLAGCX_MESH_API flagcx_mesh_result_t flagcx_mesh_agent_handle_size(flagcx_mesh_agent_handle_t handle, size_t *ops,
                                                                  uint64_t *bytes);
FLAGCX_MESH_API flagcx_mesh_result_t flagcx_mesh_agent_handle_free(flagcx_mesh_agent_handle_t handle);
/* The next notification, waiting up to timeout_s (FLAGCX_MESH_TIMEOUT when
 * none came): its bytes into buf, the sender's name (NUL-terminated,
 * truncated to peer_cap) into peer. */
FLAGCX_MESH_API flagcx_mesh_result_t flagcx_mesh_agent_notification(flagcx_mesh_agent_t agent, double timeout_s,
                                                                    char *peer, size_t peer_cap, void *buf,
                                                                    size_t *len);
/* Waits on the host for agent peer's notification of exactly data_len bytes
 * at data (data NULL: its next one, whatever its bytes): its bytes into buf
 * (*len: buf's capacity in, the bytes out), consumed; other notifications stay
 * for flagcx_mesh_agent_notification. One already arrived and unread returns
 * at once. Fails with PEER_LOST (flagcx_mesh_last_error names the peer) when
 * peer is gone before sending it, TIMEOUT after timeout_s (0: the agent's
 * timeout). A buf too short for it fails
 * (INVALID_ARGUMENT, *len set to the size needed) and leaves it queued. See
 * docs/agent.md, "Waiting for a peer's notification". */
FLAGCX_MESH_API flagcx_mesh_result_t flagcx_mesh_agent_wait_notification(flagcx_mesh_agent_t agent, const char *peer,
                                                                         const void *data, size_t data_len,
                                                                         double timeout_s, void *buf, size_t *len);

/* Makes a flagcx_mesh_agent_notification (or flagcx_mesh_agent_await_notifications) waiting in
 * another thread return now (TIMED_OUT when nothing had come); with none waiting, the next one
 * returns at once. Wakes do not add up. For a thread that waits on notifications and takes work
 * from other threads too. */
FLAGCX_MESH_API flagcx_mesh_result_t flagcx_mesh_agent_wake_notifications(flagcx_mesh_agent_t agent);
/* Waits up to timeout_s seconds (0: not at all) until flagcx_mesh_agent_notification has something
 * to return, taking nothing: *ready 1 once it has, 0 at the deadline or when
 * flagcx_mesh_agent_wake_notifications woke it (SUCCESS either way). For a thread that waits, then
 * takes what arrived under a lock of its own that another thread may take first. */
FLAGCX_MESH_API flagcx_mesh_result_t flagcx_mesh_agent_await_notifications(flagcx_mesh_agent_t agent,
                                                                           double timeout_s, int *ready);

#ifdef __cplusplus
}
#endif

#include "flagcx_mesh_net.h"

#endif /* FLAGCX_MESH_H_ */
