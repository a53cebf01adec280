// The C ABI of the net-adaptor builders and the own bootstrap as ops:
// argument checks, then the core; every call through guard().
#include "adaptor/boot_ops.h"
#include "adaptor/builder.h"
#include "capi/guard.h"

using fxm::capi::guard;
using fxm::capi::require;

extern "C" {

flagcx_mesh_result_t flagcx_mesh_net_build_full_mesh(const flagcx_mesh_net_adaptor_t* net,
                                                     const flagcx_mesh_bootstrap_ops_t* boot,
                                                     const flagcx_mesh_net_build_config_t* config,
                                                     void** send_comms, void** recv_comms) {
  return guard("flagcx_mesh_net_build_full_mesh", [&] {
    require(net, "net");
    require(boot, "boot");
    require(config, "config");
    require(send_comms, "send_comms");
    require(recv_comms, "recv_comms");
    fxm::adaptor::build_full_mesh(net, boot, config, send_comms, recv_comms);
  });
}

flagcx_mesh_result_t flagcx_mesh_net_close_full_mesh(const flagcx_mesh_net_adaptor_t* net, int nranks,
                                                     void** send_comms, void** recv_comms) {
  return guard("flagcx_mesh_net_close_full_mesh", [&] {
    require(net, "net");
    fxm::adaptor::close_full_mesh(net, nranks, send_comms, recv_comms);
  });
}

flagcx_mesh_result_t flagcx_mesh_bootstrap_init(flagcx_mesh_bootstrap_t* boot, int nranks,
                                                const flagcx_mesh_unique_id_t* id, int rank, double timeout_s) {
  return guard("flagcx_mesh_bootstrap_init", [&] {
    require(boot, "boot");
    require(id, "id");
    auto b = fxm::adaptor::bootstrap_create(nranks, reinterpret_cast<const uint8_t*>(id->internal),
                                            sizeof(id->internal), rank, timeout_s);
    *boot = b.release();
  });
}

flagcx_mesh_result_t flagcx_mesh_bootstrap_get_ops(flagcx_mesh_bootstrap_t boot, flagcx_mesh_bootstrap_ops_t* ops) {
  return guard("flagcx_mesh_bootstrap_get_ops", [&] {
    require(boot, "boot");
    require(ops, "ops");
    fxm::adaptor::bootstrap_fill_ops(boot, ops);
  });
}

flagcx_mesh_result_t flagcx_mesh_bootstrap_destroy(flagcx_mesh_bootstrap_t boot) {
  return guard("flagcx_mesh_bootstrap_destroy", [&] { delete boot; });
}

}  // extern "C"
