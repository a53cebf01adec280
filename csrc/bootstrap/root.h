// The rendezvous root: a detached thread in the process that made the unique
// id. It admits exactly nranks JOINs that prove the mesh key (a
// challenge-response over fresh nonces, proto.h), then serves
// allgather (barrier = empty allgather) for the joined ranks, and tells every
// rank when another failed or was lost; a collective begun after a rank said
// BYE fails at once naming it. A second join of one rank fails every rank,
// naming it. It exits when every rank has said BYE or gone,
// when the join deadline expires, when release_root() asks before any rank
// joined (bootstrap/root_release.h), or after FLAGCX_MESH_ROOT_IDLE_TIMEOUT
// (600 s) with no join. The process
// that hosts it waits at exit for the ranks that joined (bootstrap/exit_wait.h).
#pragma once

#include "bootstrap/unique_id.h"
#include "transport/tcp/socket.h"

namespace fxm::bootstrap {

// Takes ownership of `listener`; returns at once.
void start_root(tcp::Fd listener, const UniqueId& id);

}  // namespace fxm::bootstrap
