// Building a full mesh over a network adaptor with no identity on the wire
// (FlagCX's IB adaptor and its kin): the three builders behind
// flagcx_mesh_net_build_full_mesh. The adaptor and bootstrap are the C
// structs of capi/flagcx_mesh_net.h (plain data; no C ABI code is used here).
// Thread-safety: a build uses its adaptor and bootstrap from the calling
// thread only; different builds may run at once on different adaptors.
#pragma once

#include "flagcx_mesh.h"

namespace fxm::adaptor {

using NetAdaptor = flagcx_mesh_net_adaptor_t;
using BootOps = flagcx_mesh_bootstrap_ops_t;
using BuildConfig = flagcx_mesh_net_build_config_t;

// The builder field as a plain int: a C caller may store any int in the
// enum, which C++ must not load as the enum type before it is checked.
int builder_of(const BuildConfig& config);
void set_builder(BuildConfig* config, int builder);

// Each throws Error(kInvalidArgument) naming the bad field.
void validate_adaptor(const NetAdaptor* net);
void validate_boot(const BootOps* boot);
void validate_config(const BuildConfig* config, const BootOps& boot);

// Validates everything, then builds. send_comms / recv_comms hold
// boot->nranks entries and are written only on success; on failure every
// comm the build opened is closed and Error names the rank, round, peer and
// step (kTimeout when a deadline expired, kProtocol for miswiring).
void build_full_mesh(const NetAdaptor* net, const BootOps* boot, const BuildConfig* config,
                     void** send_comms, void** recv_comms);

// Closes every non-NULL entry and sets it to NULL; throws for the first
// close that failed after trying them all.
void close_full_mesh(const NetAdaptor* net, int nranks, void** send_comms, void** recv_comms);

}  // namespace fxm::adaptor
