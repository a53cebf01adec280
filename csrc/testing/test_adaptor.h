// A network adaptor shaped like FlagCX's, over loopback TCP: a listen handle
// is a constant magic plus an address (no rank, no identity), each listener
// has one FIFO OS accept queue, and connect/accept are non-blocking state
// machines. Modes (flagcx_mesh_testing.h): IB and IB_STRICT, where a connect
// completes only after the acceptor's accept() took it (accept writes one
// byte back) and IB_STRICT adds IB's NULL requests and registration; SOCKET,
// where a connect completes in the kernel backlog and a connection is
// several sockets that accept files by their index byte. connect and accept
// each wait a random 0..jitter_us (seeded) before acting, returning "in
// progress" until then; a connect to one of this adaptor's own listeners
// waits self_connect_delay_us more. With carry_bytes, isend/irecv/test move
// small messages over the connection.
// Ownership: the adaptor owns every listener, connect state, comm and
// request and memory registration it hands out; destroy frees whatever is left. Thread-safety: all
// calls lock one mutex per adaptor.
#pragma once

#include "flagcx_mesh_testing.h"

namespace fxm::adaptor {

// Throws Error(kInvalidArgument) for a bad config.
void test_adaptor_create(const flagcx_mesh_test_adaptor_config_t* config, flagcx_mesh_net_adaptor_t* net);
// Frees the adaptor in net->ctx (NULL ctx: nothing) and clears *net.
void test_adaptor_destroy(flagcx_mesh_net_adaptor_t* net);
// True when net was filled by test_adaptor_create.
bool is_test_adaptor(const flagcx_mesh_net_adaptor_t* net);

}  // namespace fxm::adaptor
