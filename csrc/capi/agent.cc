// The agents' C ABI (flagcx_mesh_agent_* in flagcx_mesh.h) over csrc/agent.
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>

#include "agent/agent.h"
#include "agent/connection.h"
#include "agent/stream_wait.h"
#include "capi/guard.h"

using fxm::Code;
using fxm::fail;
using fxm::capi::guard;
using fxm::capi::require;

struct flagcx_mesh_agent {
  std::unique_ptr<fxm::agent::Agent> a;
  std::mutex mu;  // one notification taker at a time (it takes one; the others stay the agent's)
};
struct flagcx_mesh_agent_conn {
  std::shared_ptr<fxm::agent::Connection> c;
};
struct flagcx_mesh_agent_handle {  // a transfer's completion, or a stream wait on a notification
  fxm::agent::Handle h;
  std::optional<fxm::agent::NotificationWait> stream_wait;
};

namespace {

std::vector<uint8_t> bytes_of(const void* p, size_t n, const char* name) {
  require(p, name);
  const uint8_t* b = static_cast<const uint8_t*>(p);
  return std::vector<uint8_t>(b, b + n);
}

// Copies v out (all of it or nothing), else fails saying the size needed (*len set to it).
void give(const std::vector<uint8_t>& v, void* buf, size_t* len) {
  require(len, "len");
  size_t cap = *len;
  *len = v.size();
  if (buf == nullptr || cap < v.size()) {
    fail(Code::kInvalidArgument, -1, 0, "the buffer holds " + std::to_string(cap) + " bytes; " +
                                            std::to_string(v.size()) + " are needed (*len says so)");
  }
  std::memcpy(buf, v.data(), v.size());
}

// A NUL-terminated text out, as give() does bytes (*len counts the NUL).
void give_text(const std::string& text, char* buf, size_t* len) {
  std::vector<uint8_t> v(text.begin(), text.end());
  v.push_back(0);
  give(v, buf, len);
}

void json_string(std::string* out, const std::string& s) {
  *out += '"';
  for (char c : s) {
    if (c == '"' || c == '\\') *out += '\\';
    if (static_cast<unsigned char>(c) < 0x20) continue;  // (names hold none)
    *out += c;
  }
  *out += '"';
}

// agent.stats() as one JSON object: the counters, then "rejected": {reason: count}.
std::string stats_json(const fxm::agent::AgentStats& s) {
  std::string out = "{";
  for (const auto& [name, n] : s.counters()) {
    json_string(&out, name);
    out += ":" + std::to_string(n) + ",";
  }
  out += "\"rejected\":{";
  bool first = true;
  for (const auto& [reason, n] : s.rejections()) {
    if (!first) out += ",";
    first = false;
    json_string(&out, reason);
    out += ":" + std::to_string(n);
  }
  return out + "}}";
}

}  // namespace

extern "C" {

flagcx_mesh_result_t flagcx_mesh_agent_create(flagcx_mesh_agent_t* agent, const char* name, const char* secret,
                                              double timeout_s) {
  return guard("flagcx_mesh_agent_create", [&] {
    require(agent, "agent");
    require(name, "name");
    fxm::agent::AgentOptions o;
    o.name = name;
    o.secret = secret ? secret : "";
    o.timeout_s = timeout_s;
    auto w = std::make_unique<flagcx_mesh_agent>();
    w->a = std::make_unique<fxm::agent::Agent>(o);
    *agent = w.release();
  });
}

flagcx_mesh_result_t flagcx_mesh_agent_destroy(flagcx_mesh_agent_t agent) {
  return guard("flagcx_mesh_agent_destroy", [&] {
    if (agent == nullptr) return;
    agent->a->close();
    delete agent;
  });
}

flagcx_mesh_result_t flagcx_mesh_agent_metadata(flagcx_mesh_agent_t agent, void* buf, size_t* len) {
  return guard("flagcx_mesh_agent_metadata", [&] {
    require(agent, "agent");
    give(agent->a->metadata(), buf, len);
  });
}

namespace {

// Registers host (device false) or CUDA device memory; the descriptor goes to desc.
void check_desc_out(void* desc, size_t* desc_len) {
  require(desc_len, "desc_len");
  if (desc == nullptr) fail(Code::kInvalidArgument, -1, 0, "desc is NULL");
}

// A new region's descriptor out; one that does not fit is deregistered again (nothing stays
// registered that the caller cannot name) and the call fails saying the size needed.
void give_region(flagcx_mesh_agent_t agent, const fxm::agent::RegionDesc& d, void* desc, size_t* desc_len) {
  std::vector<uint8_t> enc = d.encode();
  if (*desc_len < enc.size()) {
    *desc_len = enc.size();
    agent->a->deregister(d, 0);
    fail(Code::kInvalidArgument, -1, 0, "desc holds too few bytes; " + std::to_string(enc.size()) + " are needed");
  }
  give(enc, desc, desc_len);
}

flagcx_mesh_result_t register_region(const char* call, flagcx_mesh_agent_t agent, void* base, uint64_t size,
                                     bool device, void* desc, size_t* desc_len) {
  return guard(call, [&] {
    require(agent, "agent");
    check_desc_out(desc, desc_len);
    give_region(agent, device ? agent->a->register_device(base, size) : agent->a->register_memory(base, size), desc,
                desc_len);
  });
}

}  // namespace

flagcx_mesh_result_t flagcx_mesh_agent_register(flagcx_mesh_agent_t agent, void* base, uint64_t size, void* desc,
                                                size_t* desc_len) {
  return register_region("flagcx_mesh_agent_register", agent, base, size, false, desc, desc_len);
}

flagcx_mesh_result_t flagcx_mesh_agent_register_device(flagcx_mesh_agent_t agent, void* base, uint64_t size,
                                                       void* desc, size_t* desc_len) {
  return register_region("flagcx_mesh_agent_register_device", agent, base, size, true, desc, desc_len);
}

flagcx_mesh_result_t flagcx_mesh_agent_deregister(flagcx_mesh_agent_t agent, const void* desc, size_t desc_len,
                                                  double timeout_s) {
  return guard("flagcx_mesh_agent_deregister", [&] {
    require(agent, "agent");
    agent->a->deregister(fxm::agent::RegionDesc::decode(bytes_of(desc, desc_len, "desc")), timeout_s);
  });
}

flagcx_mesh_result_t flagcx_mesh_agent_connect(flagcx_mesh_agent_t agent, const void* metadata, size_t metadata_len,
                                               double timeout_s, flagcx_mesh_agent_conn_t* conn) {
  return guard("flagcx_mesh_agent_connect", [&] {
    require(agent, "agent");
    require(conn, "conn");
    auto c = agent->a->connect(bytes_of(metadata, metadata_len, "metadata"), timeout_s);
    *conn = new flagcx_mesh_agent_conn{std::move(c)};
  });
}

flagcx_mesh_result_t flagcx_mesh_agent_stats(flagcx_mesh_agent_t agent, char* buf, size_t* len) {
  return guard("flagcx_mesh_agent_stats", [&] {
    require(agent, "agent");
    give_text(stats_json(agent->a->stats()), buf, len);
  });
}

flagcx_mesh_result_t flagcx_mesh_agent_peers(flagcx_mesh_agent_t agent, char* buf, size_t* len) {
  return guard("flagcx_mesh_agent_peers", [&] {
    require(agent, "agent");
    std::string text;
    for (const auto& p : agent->a->peers()) {
      text += p.name + " " + fxm::agent::incarnation_hex(p.incarnation) + " " + p.address + "\n";
    }
    give_text(text, buf, len);
  });
}

flagcx_mesh_result_t flagcx_mesh_agent_alloc(flagcx_mesh_agent_t agent, uint64_t size, void** base, void* desc,
                                             size_t* desc_len) {
  return guard("flagcx_mesh_agent_alloc", [&] {
    require(agent, "agent");
    require(base, "base");
    check_desc_out(desc, desc_len);
    fxm::agent::RegionDesc d = agent->a->alloc(size);
    give_region(agent, d, desc, desc_len);
    *base = agent->a->region_base(d.index);
  });
}

flagcx_mesh_result_t flagcx_mesh_agent_path_to(flagcx_mesh_agent_conn_t conn, const void* remote, size_t remote_len,
                                               const void* local, size_t local_len, char* buf, size_t* len) {
  return guard("flagcx_mesh_agent_path_to", [&] {
    require(conn, "conn");
    fxm::agent::RegionDesc r = fxm::agent::RegionDesc::decode(bytes_of(remote, remote_len, "remote"));
    if (local == nullptr) {
      give_text(conn->c->path_to(r, nullptr), buf, len);
      return;
    }
    fxm::agent::RegionDesc l = fxm::agent::RegionDesc::decode(bytes_of(local, local_len, "local"));
    give_text(conn->c->path_to(r, &l), buf, len);
  });
}

flagcx_mesh_result_t flagcx_mesh_agent_conn_release(flagcx_mesh_agent_conn_t conn) {
  return guard("flagcx_mesh_agent_conn_release", [&] { delete conn; });
}

namespace {

flagcx_mesh_result_t transfer(const char* call, flagcx_mesh_agent_conn_t conn, int is_read,
                              const flagcx_mesh_agent_xfer_t* ops, size_t nops, const void* notification,
                              size_t notification_len, fxm::agent::StreamArg stream, flagcx_mesh_agent_handle_t* handle) {
  return guard(call, [&] {
    require(conn, "conn");
    require(handle, "handle");
    if (nops > 0) require(ops, "ops");
    std::vector<fxm::agent::RegionDesc> descs;
    descs.reserve(2 * nops);
    for (size_t i = 0; i < nops; ++i) {
      descs.push_back(fxm::agent::RegionDesc::decode(bytes_of(ops[i].local, ops[i].local_len, "ops[i].local")));
      descs.push_back(fxm::agent::RegionDesc::decode(bytes_of(ops[i].remote, ops[i].remote_len, "ops[i].remote")));
    }
    std::vector<fxm::agent::Xfer> xs;
    for (size_t i = 0; i < nops; ++i) {
      xs.push_back({&descs[2 * i], ops[i].local_offset, &descs[2 * i + 1], ops[i].remote_offset, ops[i].size});
    }
    std::vector<uint8_t> n;
    if (notification) fxm::agent::check_notification_size(notification_len, "notification");
    if (notification) n = bytes_of(notification, notification_len, "notification");
    fxm::agent::Handle h = conn->c->transfer(xs, is_read != 0, notification ? &n : nullptr, stream);
    *handle = new flagcx_mesh_agent_handle{std::move(h), std::nullopt};
  });
}

}  // namespace

flagcx_mesh_result_t flagcx_mesh_agent_transfer(flagcx_mesh_agent_conn_t conn, int is_read,
                                                const flagcx_mesh_agent_xfer_t* ops, size_t nops,
                                                const void* notification, size_t notification_len,
                                                flagcx_mesh_agent_handle_t* handle) {
  return transfer("flagcx_mesh_agent_transfer", conn, is_read, ops, nops, notification, notification_len, {}, handle);
}

flagcx_mesh_result_t flagcx_mesh_agent_transfer_on_stream(flagcx_mesh_agent_conn_t conn, int is_read,
                                                          const flagcx_mesh_agent_xfer_t* ops, size_t nops,
                                                          const void* notification, size_t notification_len,
                                                          void* stream, flagcx_mesh_agent_handle_t* handle) {
  return transfer("flagcx_mesh_agent_transfer_on_stream", conn, is_read, ops, nops, notification, notification_len,
                  {true, stream}, handle);
}

flagcx_mesh_result_t flagcx_mesh_agent_stream_wait_notification(flagcx_mesh_agent_t agent, const void* data,
                                                                size_t len, const char* peer, void* stream,
                                                                double timeout_s, flagcx_mesh_agent_handle_t* handle) {
  return guard("flagcx_mesh_agent_stream_wait_notification", [&] {
    require(agent, "agent");
    require(handle, "handle");
    std::vector<uint8_t> bytes = len > 0 ? bytes_of(data, len, "data") : std::vector<uint8_t>();
    auto w = agent->a->stream_wait_notification(bytes, peer ? peer : "", stream, timeout_s);
    *handle = new flagcx_mesh_agent_handle{fxm::agent::Handle(), std::move(w)};
  });
}

flagcx_mesh_result_t flagcx_mesh_agent_handle_test(flagcx_mesh_agent_handle_t handle, int* done) {
  return guard("flagcx_mesh_agent_handle_test", [&] {
    require(handle, "handle");
    require(done, "done");
    *done = (handle->stream_wait ? handle->stream_wait->done() : handle->h.done()) ? 1 : 0;
  });
}

flagcx_mesh_result_t flagcx_mesh_agent_handle_size(flagcx_mesh_agent_handle_t handle, size_t* ops, uint64_t* bytes) {
  return guard("flagcx_mesh_agent_handle_size", [&] {
    require(handle, "handle");
    if (ops) *ops = handle->h.count();
    if (bytes) *bytes = handle->h.bytes();
  });
}

flagcx_mesh_result_t flagcx_mesh_agent_handle_wait(flagcx_mesh_agent_handle_t handle, double timeout_s) {
  return guard("flagcx_mesh_agent_handle_wait", [&] {
    require(handle, "handle");
    if (handle->stream_wait) handle->stream_wait->wait(timeout_s);
    else handle->h.wait(timeout_s);
  });
}

flagcx_mesh_result_t flagcx_mesh_agent_handle_free(flagcx_mesh_agent_handle_t handle) {
  return guard("flagcx_mesh_agent_handle_free", [&] { delete handle; });
}

flagcx_mesh_result_t flagcx_mesh_agent_notification(flagcx_mesh_agent_t agent, double timeout_s, char* peer,
                                                    size_t peer_cap, void* buf, size_t* len) {
  return guard("flagcx_mesh_agent_notification", [&] {
    require(agent, "agent");
    require(len, "len");
    std::lock_guard<std::mutex> lock(agent->mu);
    std::vector<fxm::agent::Notification> got = agent->a->notifications(timeout_s, 1);  // (the others stay the agent's)
    if (got.empty()) fail(Code::kTimeout, -1, 0, "no notification within " + std::to_string(timeout_s) + " s");
    fxm::agent::Notification& n = got.front();
    try {
      give(n.bytes, buf, len);
    } catch (...) {
      agent->a->unread(std::move(got));  // a short buffer leaves it queued
      throw;
    }
    if (peer && peer_cap > 0) {
      size_t k = std::min(peer_cap - 1, n.peer.size());
      std::memcpy(peer, n.peer.data(), k);
      peer[k] = '\0';
    }
  });
}

// No lock: it takes nothing (a taker holding the agent's lock may be waiting).
flagcx_mesh_result_t flagcx_mesh_agent_await_notifications(flagcx_mesh_agent_t agent, double timeout_s, int* ready) {
  return guard("flagcx_mesh_agent_await_notifications", [&] {
    require(agent, "agent");
    require(ready, "ready");
    *ready = 0;
    *ready = agent->a->await_notifications(timeout_s) ? 1 : 0;
  });
}

// No lock: the call it wakes holds the agent's.
flagcx_mesh_result_t flagcx_mesh_agent_wake_notifications(flagcx_mesh_agent_t agent) {
  return guard("flagcx_mesh_agent_wake_notifications", [&] {
    require(agent, "agent");
    agent->a->wake_notifications();
  });
}

flagcx_mesh_result_t flagcx_mesh_agent_wait_notification(flagcx_mesh_agent_t agent, const char* peer,
                                                         const void* data, size_t data_len, double timeout_s,
                                                         void* buf, size_t* len) {
  return guard("flagcx_mesh_agent_wait_notification", [&] {
    require(agent, "agent");
    require(peer, "peer");
    require(len, "len");
    std::optional<std::vector<uint8_t>> want;
    if (data) want = bytes_of(data, data_len, "data");
    std::lock_guard<std::mutex> lock(agent->mu);
    fxm::agent::Notification n = agent->a->wait_notification(want ? &*want : nullptr, peer, timeout_s);
    try {
      give(n.bytes, buf, len);
    } catch (...) {
      agent->a->unread({std::move(n)});  // a short buffer leaves it queued
      throw;
    }
  });
}

}  // extern "C"
