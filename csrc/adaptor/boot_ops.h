// flagcx_mesh's own bootstrap (the unique id's rendezvous root and its
// point-to-point relay) presented as flagcx_mesh_bootstrap_ops_t.
// The ops may be called from any thread (bootstrap::Client serialises).
#pragma once

#include <memory>
#include <string>

#include "bootstrap/client.h"
#include "flagcx_mesh.h"

// The C ABI's opaque flagcx_mesh_bootstrap_t points to one of these.
struct flagcx_mesh_bootstrap {
  std::unique_ptr<fxm::bootstrap::Client> client;
  int rank = 0;
  int nranks = 0;
  double timeout_s = 0;  // default for allgather and send; recv takes its own
};

namespace fxm::adaptor {

// Joins the rendezvous named by the unique id bytes; throws Error.
std::unique_ptr<flagcx_mesh_bootstrap> bootstrap_create(int nranks, const uint8_t* id, size_t id_len,
                                                       int rank, double timeout_s);
// Fills every field of *ops (its size included).
void bootstrap_fill_ops(flagcx_mesh_bootstrap* boot, flagcx_mesh_bootstrap_ops_t* ops);

// When ops are this bootstrap's: why this thread's last failed op failed, as
// ": <message>" ("" when none, or when ops belong to another bootstrap).
std::string boot_detail_suffix(const flagcx_mesh_bootstrap_ops_t& ops);

}  // namespace fxm::adaptor
