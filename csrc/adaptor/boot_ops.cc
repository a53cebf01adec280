#include "adaptor/boot_ops.h"

#include <cmath>
#include <cstring>

#include "bootstrap/unique_id.h"
#include "base/env.h"

namespace fxm::adaptor {
namespace {

thread_local std::string t_detail;

// timeout_s > 0: the caller's deadline; else the bootstrap's default (NaN refused).
Deadline deadline_of(const flagcx_mesh_bootstrap* b, double timeout_s) {
  if (std::isnan(timeout_s)) fail(Code::kInvalidArgument, b->rank, 0, "bootstrap: timeout is NaN");
  if (timeout_s > 0) return Deadline::after_seconds(timeout_s);
  return Deadline::after_seconds(b->timeout_s > 0 ? b->timeout_s : default_timeout_s());
}

// Runs an op: 0 on success, else the Error's code (never 0), detail kept.
template <class F>
int run_op(F&& body) {
  t_detail.clear();
  try {
    body();
    return 0;
  } catch (const Error& e) {
    t_detail = e.what();
    return e.code() == Code::kOk ? static_cast<int>(Code::kInternal) : static_cast<int>(e.code());
  } catch (const std::exception& e) {
    t_detail = e.what();
    return static_cast<int>(Code::kInternal);
  }
}

int op_allgather(void* ctx, void* data, size_t bytes, double timeout_s) {
  auto* b = static_cast<flagcx_mesh_bootstrap*>(ctx);
  return run_op([&] {
    uint8_t* all = static_cast<uint8_t*>(data);
    std::vector<uint8_t> mine(all + bytes * b->rank, all + bytes * (b->rank + 1));
    bootstrap::Parts parts = b->client->allgather(mine, deadline_of(b, timeout_s));
    for (int r = 0; r < b->nranks; ++r) {
      if (parts[r].size() != bytes) {
        fail(Code::kProtocol, r, 0, "rank " + std::to_string(b->rank) + ": bootstrap allgather: rank " +
                                        std::to_string(r) + " gave " + std::to_string(parts[r].size()) +
                                        " bytes, expected " + std::to_string(bytes));
      }
      if (bytes) std::memcpy(all + bytes * r, parts[r].data(), bytes);
    }
  });
}

int op_send(void* ctx, int peer, int tag, const void* data, size_t size, double timeout_s) {
  auto* b = static_cast<flagcx_mesh_bootstrap*>(ctx);
  return run_op([&] { b->client->send(peer, static_cast<uint32_t>(tag), data, size, deadline_of(b, timeout_s)); });
}

int op_recv(void* ctx, int peer, int tag, void* data, size_t size, double timeout_s) {
  auto* b = static_cast<flagcx_mesh_bootstrap*>(ctx);
  return run_op([&] {
    if (peer < 0 || peer >= b->nranks) {
      fail(Code::kInvalidArgument, peer, 0, "rank " + std::to_string(b->rank) + ": bootstrap recv: peer " +
                                                std::to_string(peer) + " out of range");
    }
    std::vector<uint8_t> got = b->client->recv(peer, static_cast<uint32_t>(tag), deadline_of(b, timeout_s));
    if (got.size() != size) {
      fail(Code::kProtocol, peer, 0, "rank " + std::to_string(b->rank) + ": bootstrap recv from rank " +
                                         std::to_string(peer) + " (tag " + std::to_string(tag) + "): got " +
                                         std::to_string(got.size()) + " bytes, expected " + std::to_string(size));
    }
    if (size) std::memcpy(data, got.data(), size);
  });
}

}  // namespace

std::unique_ptr<flagcx_mesh_bootstrap> bootstrap_create(int nranks, const uint8_t* id, size_t id_len,
                                                       int rank, double timeout_s) {
  if (nranks < 1 || rank < 0 || rank >= nranks) {
    fail(Code::kInvalidArgument, -1, 0, "bootstrap: rank " + std::to_string(rank) + " / nranks " +
                                            std::to_string(nranks) + " out of range");
  }
  bootstrap::UniqueId uid = bootstrap::decode_unique_id(id, id_len);
  auto b = std::make_unique<flagcx_mesh_bootstrap>();
  b->rank = rank;
  b->nranks = nranks;
  b->timeout_s = build_timeout_s(timeout_s, "bootstrap: timeout");
  b->client = std::make_unique<bootstrap::Client>(uid, rank, nranks, Deadline::after_seconds(b->timeout_s));
  return b;
}

void bootstrap_fill_ops(flagcx_mesh_bootstrap* boot, flagcx_mesh_bootstrap_ops_t* ops) {
  // The 0.2 layout only: this bootstrap has deadlines of its own and needs no abort hook, and
  // a caller compiled against 0.2 has no room for one (its struct ends there).
  ops->size = FLAGCX_MESH_BOOTSTRAP_OPS_SIZE_V1;
  ops->ctx = boot;
  ops->rank = boot->rank;
  ops->nranks = boot->nranks;
  ops->allgather = &op_allgather;
  ops->send = &op_send;
  ops->recv = &op_recv;
}

std::string boot_detail_suffix(const flagcx_mesh_bootstrap_ops_t& ops) {
  if (ops.allgather != &op_allgather || t_detail.empty()) return "";  // another bootstrap's ops
  return ": " + t_detail;
}

}  // namespace fxm::adaptor
