// The C ABI of the test adaptor (libflagcx_mesh_testing.so): argument
// checks, then the adaptor; every call through guard().
#include "capi/guard.h"
#include "flagcx_mesh_testing.h"
#include "testing/test_adaptor.h"

using fxm::capi::guard;
using fxm::capi::require;

extern "C" {

flagcx_mesh_result_t flagcx_mesh_test_adaptor_create(const flagcx_mesh_test_adaptor_config_t* config,
                                                     flagcx_mesh_net_adaptor_t* net) {
  return guard("flagcx_mesh_test_adaptor_create", [&] {
    require(config, "config");
    require(net, "net");
    fxm::adaptor::test_adaptor_create(config, net);
  });
}

flagcx_mesh_result_t flagcx_mesh_test_adaptor_destroy(flagcx_mesh_net_adaptor_t* net) {
  return guard("flagcx_mesh_test_adaptor_destroy", [&] {
    require(net, "net");
    fxm::adaptor::test_adaptor_destroy(net);
  });
}

}  // extern "C"

// The error of this thread's last test-adaptor call ("" after a success):
// this library keeps its own record, apart from libflagcx_mesh.so's.
extern "C" FLAGCX_MESH_API const char* flagcx_mesh_test_last_error(void) {
  return flagcx_mesh_last_error();
}
