// The C ABI of a communicator: unique id, init/destroy, windows and one-sided
// operations, each a thin wrapper over fxm::Mesh through capi::guard.
#include <cstring>
#include <memory>
#include <string>

#include "bootstrap/unique_id.h"
#include "capi/guard.h"
#include "base/env.h"
#include "core/mesh.h"

struct flagcx_mesh_comm {
  std::unique_ptr<fxm::Mesh> mesh;
};

namespace fxm::capi {
namespace {

[[noreturn]] void bad(const std::string& what) { fail(Code::kInvalidArgument, -1, 0, what); }

Mesh& mesh_of(flagcx_mesh_comm_t comm) {
  if (comm == nullptr || !comm->mesh) bad("comm is NULL");
  return *comm->mesh;
}

MeshOptions options_from(const flagcx_mesh_config_t* config) {
  MeshOptions opt;
  if (config == nullptr) return opt;
  if (config->size < sizeof(flagcx_mesh_config_t)) {
    bad("config->size is " + std::to_string(config->size) + ", expected at least sizeof(flagcx_mesh_config_t) = " +
        std::to_string(sizeof(flagcx_mesh_config_t)) + " (initialise it with FLAGCX_MESH_CONFIG_INITIALIZER)");
  }
  opt.contexts = config->contexts;
  opt.timeout_s = config->timeout_s;
  opt.max_inflight = config->max_inflight;
  return opt;
}

flagcx_mesh_comm_t make_comm(int nranks, const flagcx_mesh_unique_id_t* id, int rank,
                             const flagcx_mesh_config_t* config) {
  require(id, "id");
  MeshOptions opt = options_from(config);
  auto comm = std::make_unique<flagcx_mesh_comm>();
  comm->mesh = std::make_unique<Mesh>(nranks, reinterpret_cast<const uint8_t*>(id->internal),
                                      FLAGCX_MESH_UNIQUE_ID_BYTES, rank, opt);
  return comm.release();
}

int hex_digit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

void decode_hex(const char* hex, flagcx_mesh_unique_id_t* out) {
  size_t len = std::strlen(hex);
  if (len != 2 * FLAGCX_MESH_UNIQUE_ID_BYTES) {
    bad("a unique id in hex has " + std::to_string(2 * FLAGCX_MESH_UNIQUE_ID_BYTES) +
        " characters, got " + std::to_string(len));
  }
  flagcx_mesh_unique_id_t id;
  for (size_t i = 0; i < FLAGCX_MESH_UNIQUE_ID_BYTES; ++i) {
    int hi = hex_digit(hex[2 * i]), lo = hex_digit(hex[2 * i + 1]);
    if (hi < 0 || lo < 0) bad("character " + std::to_string(2 * i) + " of the unique id is not hex");
    id.internal[i] = static_cast<char>(hi * 16 + lo);
  }
  bootstrap::decode_unique_id(reinterpret_cast<const uint8_t*>(id.internal), sizeof(id.internal));
  *out = id;
}

PutArgs put_args(int peer, uint32_t src_win, uint64_t src_off, uint32_t dst_win, uint64_t dst_off,
                 uint64_t size) {
  PutArgs a;
  a.peer = peer;
  a.src_win = src_win;
  a.src_off = src_off;
  a.dst_win = dst_win;
  a.dst_off = dst_off;
  a.size = size;
  return a;
}

// A registration this rank cannot take part in: every rank fails naming it.
[[noreturn]] void refuse(Mesh& m, const std::string& why) {
  m.refuse_registration("rank " + std::to_string(m.rank()) + ": " + why);
}

PutArgs on_stream(PutArgs a, void* stream) {
  a.stream_set = true;
  a.stream = stream;
  return a;
}

void add_signal(PutArgs* a, uint32_t sig_win, uint64_t sig_slot, uint64_t sig_value) {
  a->sig.on = true;
  a->sig.set = false;
  a->sig.win = sig_win;
  a->sig.slot = sig_slot;
  a->sig.value = sig_value;
}

}  // namespace
}  // namespace fxm::capi

using fxm::capi::guard;
using fxm::capi::mesh_of;
using fxm::capi::require;

extern "C" {

flagcx_mesh_result_t flagcx_mesh_get_unique_id(flagcx_mesh_unique_id_t* id) {
  return guard("flagcx_mesh_get_unique_id", [&] {
    require(id, "id");
    fxm::bootstrap::UniqueIdBytes bytes = fxm::bootstrap::get_unique_id();
    std::memcpy(id->internal, bytes.data(), bytes.size());
  });
}

flagcx_mesh_result_t flagcx_mesh_release_unique_id(const flagcx_mesh_unique_id_t* id, int* released) {
  return guard("flagcx_mesh_release_unique_id", [&] {
    require(id, "id");
    bool done = fxm::bootstrap::release_unique_id(reinterpret_cast<const uint8_t*>(id->internal),
                                                  FLAGCX_MESH_UNIQUE_ID_BYTES);
    if (released != nullptr) *released = done ? 1 : 0;
  });
}

flagcx_mesh_result_t flagcx_mesh_unique_id_from_hex(const char* hex, flagcx_mesh_unique_id_t* id) {
  return guard("flagcx_mesh_unique_id_from_hex", [&] {
    require(hex, "hex");
    require(id, "id");
    fxm::capi::decode_hex(hex, id);
  });
}

flagcx_mesh_result_t flagcx_mesh_comm_init(flagcx_mesh_comm_t* comm, int nranks, const flagcx_mesh_unique_id_t* id,
                                           int rank, const flagcx_mesh_config_t* config) {
  return guard("flagcx_mesh_comm_init", [&] {
    require(comm, "comm");
    *comm = fxm::capi::make_comm(nranks, id, rank, config);
  });
}

flagcx_mesh_result_t flagcx_mesh_comm_init_from_env(flagcx_mesh_comm_t* comm, const flagcx_mesh_config_t* config) {
  return guard("flagcx_mesh_comm_init_from_env", [&] {
    require(comm, "comm");
    fxm::LauncherEnv env = fxm::launcher_env();
    flagcx_mesh_unique_id_t id;
    fxm::capi::decode_hex(env.unique_id_hex.c_str(), &id);
    *comm = fxm::capi::make_comm(env.nranks, &id, env.rank, config);
  });
}

flagcx_mesh_result_t flagcx_mesh_comm_destroy(flagcx_mesh_comm_t comm) {
  return guard("flagcx_mesh_comm_destroy", [&] {
    if (comm == nullptr) return;
    std::unique_ptr<flagcx_mesh_comm> owned(comm);
    if (owned->mesh) owned->mesh->close();
  });
}

flagcx_mesh_result_t flagcx_mesh_comm_rank(flagcx_mesh_comm_t comm, int* rank) {
  return guard("flagcx_mesh_comm_rank", [&] {
    require(rank, "rank");
    *rank = mesh_of(comm).rank();
  });
}

flagcx_mesh_result_t flagcx_mesh_comm_nranks(flagcx_mesh_comm_t comm, int* nranks) {
  return guard("flagcx_mesh_comm_nranks", [&] {
    require(nranks, "nranks");
    *nranks = mesh_of(comm).nranks();
  });
}

flagcx_mesh_result_t flagcx_mesh_barrier(flagcx_mesh_comm_t comm, double timeout_s) {
  return guard("flagcx_mesh_barrier", [&] { mesh_of(comm).barrier(timeout_s); });
}

flagcx_mesh_result_t flagcx_mesh_window_register(flagcx_mesh_comm_t comm, void* base, uint64_t size,
                                                 uint32_t* index) {
  return guard("flagcx_mesh_window_register", [&] {
    fxm::Mesh& m = mesh_of(comm);
    if (index == nullptr) fxm::capi::refuse(m, "index is NULL");
    if (base == nullptr) fxm::capi::refuse(m, "base is NULL");
    *index = m.register_window(base, size);
  });
}

flagcx_mesh_result_t flagcx_mesh_window_alloc(flagcx_mesh_comm_t comm, uint64_t size, uint32_t* index,
                                              void** base) {
  return guard("flagcx_mesh_window_alloc", [&] {
    fxm::Mesh& m = mesh_of(comm);
    if (index == nullptr) fxm::capi::refuse(m, "index is NULL");
    if (base == nullptr) fxm::capi::refuse(m, "base is NULL");
    uint32_t i = m.alloc_window(size);
    *base = m.window(i)->base;
    *index = i;
  });
}

flagcx_mesh_result_t flagcx_mesh_window_register_mem(flagcx_mesh_comm_t comm, void* base, uint64_t size,
                                                     flagcx_mesh_mem_type_t mem_type, uint32_t* index) {
  if (mem_type == FLAGCX_MESH_MEM_HOST) return flagcx_mesh_window_register(comm, base, size, index);
  return guard("flagcx_mesh_window_register_mem", [&] {
    fxm::Mesh& m = mesh_of(comm);
    if (mem_type != FLAGCX_MESH_MEM_CUDA) fxm::capi::refuse(m, "mem_type " + std::to_string(mem_type) + " is unknown");
    if (index == nullptr) fxm::capi::refuse(m, "index is NULL");
    if (base == nullptr) fxm::capi::refuse(m, "base is NULL");
    *index = m.register_device_window(base, size);
  });
}

flagcx_mesh_result_t flagcx_mesh_window_alloc_mem(flagcx_mesh_comm_t comm, uint64_t size,
                                                  flagcx_mesh_mem_type_t mem_type, int device, uint32_t* index,
                                                  void** base) {
  if (mem_type == FLAGCX_MESH_MEM_HOST) return flagcx_mesh_window_alloc(comm, size, index, base);
  return guard("flagcx_mesh_window_alloc_mem", [&] {
    fxm::Mesh& m = mesh_of(comm);
    if (mem_type != FLAGCX_MESH_MEM_CUDA) fxm::capi::refuse(m, "mem_type " + std::to_string(mem_type) + " is unknown");
    if (index == nullptr) fxm::capi::refuse(m, "index is NULL");
    if (base == nullptr) fxm::capi::refuse(m, "base is NULL");
    uint32_t i = m.alloc_device_window(size, device);
    *base = m.window(i)->base;
    *index = i;
  });
}

flagcx_mesh_result_t flagcx_mesh_signal_window(flagcx_mesh_comm_t comm, uint64_t nslots, uint32_t* index) {
  return guard("flagcx_mesh_signal_window", [&] {
    fxm::Mesh& m = mesh_of(comm);
    if (index == nullptr) fxm::capi::refuse(m, "index is NULL");
    *index = m.signal_window(nslots);
  });
}

flagcx_mesh_result_t flagcx_mesh_window_deregister(flagcx_mesh_comm_t comm, uint32_t index) {
  return guard("flagcx_mesh_window_deregister", [&] { mesh_of(comm).deregister(index); });
}

flagcx_mesh_result_t flagcx_mesh_window_path(flagcx_mesh_comm_t comm, uint32_t index, int peer,
                                             const char** path) {
  return guard("flagcx_mesh_window_path", [&] {
    fxm::Mesh& m = mesh_of(comm);
    require(path, "path");
    std::shared_ptr<fxm::Window> w = m.window(index);
    if (peer < 0 || peer >= m.nranks()) {
      fxm::fail(fxm::Code::kInvalidArgument, peer, 0,
                "peer " + std::to_string(peer) + " is out of range for nranks=" + std::to_string(m.nranks()));
    }
    *path = w->peers.at(static_cast<size_t>(peer)).path->name();
  });
}

flagcx_mesh_result_t flagcx_mesh_window_describe(flagcx_mesh_comm_t comm, uint32_t index, char* buf, size_t len,
                                                 size_t* needed) {
  return guard("flagcx_mesh_window_describe", [&] {
    std::string text = mesh_of(comm).window(index)->describe();
    if (buf == nullptr && len > 0) fxm::capi::bad("buf is NULL but len is " + std::to_string(len));
    if (len > 0) {
      size_t n = std::min(len - 1, text.size());
      std::memcpy(buf, text.data(), n);
      buf[n] = '\0';
    }
    if (needed != nullptr) *needed = text.size() + 1;
  });
}

flagcx_mesh_result_t flagcx_mesh_put(flagcx_mesh_comm_t comm, int peer, uint32_t src_win, uint64_t src_off,
                                     uint32_t dst_win, uint64_t dst_off, uint64_t size) {
  return guard("flagcx_mesh_put", [&] {
    mesh_of(comm).put(fxm::capi::put_args(peer, src_win, src_off, dst_win, dst_off, size));
  });
}

flagcx_mesh_result_t flagcx_mesh_put_signal(flagcx_mesh_comm_t comm, int peer, uint32_t src_win, uint64_t src_off,
                                            uint32_t dst_win, uint64_t dst_off, uint64_t size, uint32_t sig_win,
                                            uint64_t sig_slot, uint64_t sig_value) {
  return guard("flagcx_mesh_put_signal", [&] {
    fxm::PutArgs a = fxm::capi::put_args(peer, src_win, src_off, dst_win, dst_off, size);
    fxm::capi::add_signal(&a, sig_win, sig_slot, sig_value);
    mesh_of(comm).put(a);
  });
}

flagcx_mesh_result_t flagcx_mesh_signal(flagcx_mesh_comm_t comm, int peer, uint32_t sig_win, uint64_t sig_slot,
                                        uint64_t sig_value) {
  return guard("flagcx_mesh_signal", [&] {
    fxm::PutArgs a = fxm::capi::put_args(peer, 0, 0, 0, 0, 0);
    fxm::capi::add_signal(&a, sig_win, sig_slot, sig_value);
    mesh_of(comm).put(a);
  });
}

flagcx_mesh_result_t flagcx_mesh_get(flagcx_mesh_comm_t comm, int peer, uint32_t src_win, uint64_t src_off,
                                     uint32_t dst_win, uint64_t dst_off, uint64_t size) {
  return guard("flagcx_mesh_get", [&] {
    mesh_of(comm).get(fxm::capi::put_args(peer, src_win, src_off, dst_win, dst_off, size));
  });
}

flagcx_mesh_result_t flagcx_mesh_read_signal(flagcx_mesh_comm_t comm, uint32_t sig_win, uint64_t sig_slot,
                                             uint64_t* value) {
  return guard("flagcx_mesh_read_signal", [&] {
    require(value, "value");
    *value = mesh_of(comm).read_signal(sig_win, sig_slot);
  });
}

flagcx_mesh_result_t flagcx_mesh_wait_signal(flagcx_mesh_comm_t comm, uint32_t sig_win, uint64_t sig_slot,
                                             uint64_t expected, double timeout_s) {
  return guard("flagcx_mesh_wait_signal",
               [&] { mesh_of(comm).wait_signal(sig_win, sig_slot, expected, timeout_s); });
}

flagcx_mesh_result_t flagcx_mesh_put_on_stream(flagcx_mesh_comm_t comm, int peer, uint32_t src_win, uint64_t src_off,
                                               uint32_t dst_win, uint64_t dst_off, uint64_t size, void* stream) {
  return guard("flagcx_mesh_put_on_stream", [&] {
    mesh_of(comm).put(fxm::capi::on_stream(fxm::capi::put_args(peer, src_win, src_off, dst_win, dst_off, size), stream));
  });
}

flagcx_mesh_result_t flagcx_mesh_put_signal_on_stream(flagcx_mesh_comm_t comm, int peer, uint32_t src_win,
                                                      uint64_t src_off, uint32_t dst_win, uint64_t dst_off,
                                                      uint64_t size, uint32_t sig_win, uint64_t sig_slot,
                                                      uint64_t sig_value, void* stream) {
  return guard("flagcx_mesh_put_signal_on_stream", [&] {
    fxm::PutArgs a = fxm::capi::put_args(peer, src_win, src_off, dst_win, dst_off, size);
    fxm::capi::add_signal(&a, sig_win, sig_slot, sig_value);
    mesh_of(comm).put(fxm::capi::on_stream(a, stream));
  });
}

flagcx_mesh_result_t flagcx_mesh_signal_on_stream(flagcx_mesh_comm_t comm, int peer, uint32_t sig_win,
                                                  uint64_t sig_slot, uint64_t sig_value, void* stream) {
  return flagcx_mesh_put_signal_on_stream(comm, peer, 0, 0, 0, 0, 0, sig_win, sig_slot, sig_value, stream);
}

flagcx_mesh_result_t flagcx_mesh_get_on_stream(flagcx_mesh_comm_t comm, int peer, uint32_t src_win, uint64_t src_off,
                                               uint32_t dst_win, uint64_t dst_off, uint64_t size, void* stream) {
  return guard("flagcx_mesh_get_on_stream", [&] {
    mesh_of(comm).get(fxm::capi::on_stream(fxm::capi::put_args(peer, src_win, src_off, dst_win, dst_off, size), stream));
  });
}

flagcx_mesh_result_t flagcx_mesh_wait_signal_on_stream(flagcx_mesh_comm_t comm, uint32_t sig_win, uint64_t sig_slot,
                                                       uint64_t expected, void* stream, double timeout_s) {
  return guard("flagcx_mesh_wait_signal_on_stream", [&] {
    mesh_of(comm).wait_signal_on_stream(sig_win, sig_slot, expected, stream, timeout_s);
  });
}

flagcx_mesh_result_t flagcx_mesh_flush(flagcx_mesh_comm_t comm, int peer, double timeout_s) {
  return guard("flagcx_mesh_flush", [&] { mesh_of(comm).flush(peer, timeout_s); });
}

flagcx_mesh_result_t flagcx_mesh_read_counter(flagcx_mesh_comm_t comm, uint64_t* value) {
  return guard("flagcx_mesh_read_counter", [&] {
    require(value, "value");
    *value = mesh_of(comm).read_counter();
  });
}

flagcx_mesh_result_t flagcx_mesh_wait_counter(flagcx_mesh_comm_t comm, uint64_t value, double timeout_s) {
  return guard("flagcx_mesh_wait_counter", [&] { mesh_of(comm).wait_counter(value, timeout_s); });
}

}  // extern "C"
