// Argument checks and dispatch for flagcx_mesh_net_build_full_mesh.
#include <climits>
#include <cmath>
#include <cstring>

#include "adaptor/build_state.h"

namespace fxm::adaptor {
namespace {

[[noreturn]] void bad(const std::string& what) { fail(Code::kInvalidArgument, -1, 0, what); }

}  // namespace

static_assert(sizeof(flagcx_mesh_builder_t) == sizeof(int), "the builder enum is an int in C");

int builder_of(const BuildConfig& config) {
  int v;
  std::memcpy(&v, &config.builder, sizeof(v));
  return v;
}

void set_builder(BuildConfig* config, int builder) { std::memcpy(&config->builder, &builder, sizeof(builder)); }

void validate_adaptor(const NetAdaptor* net) {
  if (!net) bad("net is NULL");
  constexpr size_t v1 = FLAGCX_MESH_NET_ADAPTOR_SIZE_V1;
  if (net->size != v1 && net->size < sizeof(NetAdaptor)) {
    bad("net->size is " + std::to_string(net->size) + ": expected sizeof(flagcx_mesh_net_adaptor_t) = " +
        std::to_string(sizeof(NetAdaptor)) + ", or " + std::to_string(v1) +
        " (FLAGCX_MESH_NET_ADAPTOR_SIZE_V1, the 0.2 layout without reg_mr/dereg_mr)");
  }
  if (net->handle_size < 1 || net->handle_size > FLAGCX_MESH_NET_HANDLE_MAX) {
    bad("net->handle_size is " + std::to_string(net->handle_size) + ", must be in [1, " +
        std::to_string(FLAGCX_MESH_NET_HANDLE_MAX) + "]");
  }
  if (!net->listen || !net->connect || !net->accept) bad("net->listen, connect and accept must all be set");
  if (!net->close_send || !net->close_recv || !net->close_listen) {
    bad("net->close_send, close_recv and close_listen must all be set");
  }
  int optional = (net->isend != nullptr) + (net->irecv != nullptr) + (net->test != nullptr);
  if (optional != 0 && optional != 3) bad("net->isend, irecv and test must be all set or all NULL");
  if (net->size == v1) return;  // no registration fields
  if ((net->reg_mr != nullptr) != (net->dereg_mr != nullptr)) bad("net->reg_mr and dereg_mr must be both set or both NULL");
  if (net->reg_mr && !optional) bad("net->reg_mr is set but isend/irecv/test are not: nothing would use it");
}

void validate_boot(const BootOps* boot) {
  if (!boot) bad("boot is NULL");
  constexpr size_t v1 = FLAGCX_MESH_BOOTSTRAP_OPS_SIZE_V1;
  if (boot->size != v1 && boot->size < sizeof(BootOps)) {
    bad("boot->size is " + std::to_string(boot->size) + ": expected sizeof(flagcx_mesh_bootstrap_ops_t) = " +
        std::to_string(sizeof(BootOps)) + ", or " + std::to_string(v1) +
        " (FLAGCX_MESH_BOOTSTRAP_OPS_SIZE_V1, the 0.2 layout without abort)");
  }
  if (boot->nranks < 1 || boot->rank < 0 || boot->rank >= boot->nranks) {
    bad("boot->rank " + std::to_string(boot->rank) + " / nranks " + std::to_string(boot->nranks) +
        " out of range");
  }
  if (!boot->allgather) bad("boot->allgather is NULL");
}

void validate_config(const BuildConfig* config, const BootOps& boot) {
  if (!config) bad("config is NULL");
  if (config->size < sizeof(BuildConfig)) {
    bad("config->size is " + std::to_string(config->size) +
        ", expected at least sizeof(flagcx_mesh_net_build_config_t) = " + std::to_string(sizeof(BuildConfig)));
  }
  int builder = builder_of(*config);
  if (builder < FLAGCX_MESH_BUILD_LEGACY || builder > FLAGCX_MESH_BUILD_TAGGED) {
    bad("config->builder " + std::to_string(builder) + " is not LEGACY (0), ORDERED (1) or TAGGED (2)");
  }
  if (!std::isfinite(config->timeout_s) || config->timeout_s < 0) bad("config->timeout_s must be finite and >= 0");
  if (config->tag_base < 0 || config->tag_base > INT_MAX - boot.nranks) {
    bad("config->tag_base " + std::to_string(config->tag_base) + ": tags tag_base..tag_base+nranks must fit in int");
  }
  if (builder == FLAGCX_MESH_BUILD_ORDERED && (!boot.send || !boot.recv)) {
    bad("the ordered builder needs boot->send and boot->recv");
  }
}

void build_full_mesh(const NetAdaptor* net, const BootOps* boot, const BuildConfig* config,
                     void** send_comms, void** recv_comms) {
  validate_adaptor(net);
  validate_boot(boot);
  validate_config(config, *boot);
  if (!send_comms || !recv_comms) bad("send_comms and recv_comms must not be NULL");
  Build b(*net, *boot, *config);
  switch (builder_of(*config)) {
    case FLAGCX_MESH_BUILD_LEGACY: build_legacy(b); break;
    case FLAGCX_MESH_BUILD_ORDERED: build_ordered(b); break;
    case FLAGCX_MESH_BUILD_TAGGED: build_tagged(b); break;
  }
  if (builder_of(*config) != FLAGCX_MESH_BUILD_TAGGED && config->wiring_check && b.carries_bytes()) wiring_check(b);
  b.finish(send_comms, recv_comms);
}

void close_full_mesh(const NetAdaptor* net, int nranks, void** send_comms, void** recv_comms) {
  validate_adaptor(net);
  if (nranks < 0) bad("nranks must be >= 0");
  if (nranks > 0 && (!send_comms || !recv_comms)) bad("send_comms and recv_comms must not be NULL");
  std::string first;
  int first_peer = -1;
  for (int p = 0; p < nranks; ++p) {
    int rs = send_comms[p] ? net->close_send(net->ctx, send_comms[p]) : 0;
    int rr = recv_comms[p] ? net->close_recv(net->ctx, recv_comms[p]) : 0;
    send_comms[p] = recv_comms[p] = nullptr;
    if ((rs || rr) && first.empty()) {
      first = std::string(rs ? "close_send" : "close_recv") + " for peer rank " + std::to_string(p) +
              " returned " + std::to_string(rs ? rs : rr);
      first_peer = p;
    }
  }
  if (!first.empty()) fail(Code::kSystem, first_peer, 0, "adaptor " + first);
}

}  // namespace fxm::adaptor
