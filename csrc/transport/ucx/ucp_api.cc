#include "transport/ucx/ucp_api.h"

#include <dlfcn.h>

#include <mutex>
#include <vector>

#include "base/env.h"

namespace fxm::ucx {
namespace {

std::mutex& hint_mu() {
  static std::mutex mu;
  return mu;
}
std::string& wheel_hint() {
  static std::string path;
  return path;
}

#define FXM_UCP_ENTRY(name) {#name, reinterpret_cast<void**>(&api.name)}

bool resolve_all(void* lib, Api& api, std::string* error) {
  struct Entry {
    const char* name;
    void** slot;
  } entries[] = {
      FXM_UCP_ENTRY(ucp_get_version), FXM_UCP_ENTRY(ucs_status_string), FXM_UCP_ENTRY(ucp_config_read),
      FXM_UCP_ENTRY(ucp_config_release), FXM_UCP_ENTRY(ucp_init_version), FXM_UCP_ENTRY(ucp_cleanup),
      FXM_UCP_ENTRY(ucp_context_print_info), FXM_UCP_ENTRY(ucp_worker_create), FXM_UCP_ENTRY(ucp_worker_destroy),
      FXM_UCP_ENTRY(ucp_worker_get_address), FXM_UCP_ENTRY(ucp_worker_release_address),
      FXM_UCP_ENTRY(ucp_worker_progress), FXM_UCP_ENTRY(ucp_worker_get_efd), FXM_UCP_ENTRY(ucp_worker_arm),
      FXM_UCP_ENTRY(ucp_ep_create), FXM_UCP_ENTRY(ucp_ep_close_nbx), FXM_UCP_ENTRY(ucp_ep_flush_nbx),
      FXM_UCP_ENTRY(ucp_mem_map), FXM_UCP_ENTRY(ucp_mem_unmap), FXM_UCP_ENTRY(ucp_rkey_pack),
      FXM_UCP_ENTRY(ucp_rkey_buffer_release), FXM_UCP_ENTRY(ucp_ep_rkey_unpack), FXM_UCP_ENTRY(ucp_rkey_destroy),
      FXM_UCP_ENTRY(ucp_put_nbx), FXM_UCP_ENTRY(ucp_get_nbx), FXM_UCP_ENTRY(ucp_request_check_status),
      FXM_UCP_ENTRY(ucp_request_free),
  };
  for (const Entry& e : entries) {
    *e.slot = ::dlsym(lib, e.name);
    if (*e.slot == nullptr) {
      *error = std::string("it has no ") + e.name + " (UCX 1.10 or later is needed)";
      return false;
    }
  }
  return true;
}

#undef FXM_UCP_ENTRY

// Where to look, in order, each with the words that say where it came from.
std::vector<std::pair<std::string, std::string>> candidates() {
  std::string env = ucx_lib_env();
  if (!env.empty()) return {{env, "FLAGCX_MESH_UCX_LIB"}};
  std::vector<std::pair<std::string, std::string>> c;
  {
    std::lock_guard<std::mutex> lock(hint_mu());
    if (!wheel_hint().empty()) c.push_back({wheel_hint(), "the libucx wheel"});
  }
  c.push_back({"libucp.so.0", "the system"});
  return c;
}

Library load() {
  static Api api{};
  Library l;
  std::string tried;
  for (const auto& [path, where] : candidates()) {
    void* lib = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      const char* why = ::dlerror();
      tried += (tried.empty() ? "" : "; ") + where + ": " + (why ? why : path + " not found");
      continue;
    }
    std::string error;
    if (!resolve_all(lib, api, &error)) {
      tried += (tried.empty() ? "" : "; ") + where + ": " + path + ": " + error;
      continue;
    }
    unsigned release = 0;
    api.ucp_get_version(&l.major, &l.minor, &release);
    l.api = &api;
    l.path = path + " (" + where + ")";
    l.version = std::to_string(l.major) + "." + std::to_string(l.minor) + "." + std::to_string(release);
    return l;
  }
  l.error = "no UCX library: " + tried +
            " (install the [ucx] extra, or name libucp with FLAGCX_MESH_UCX_LIB)";
  return l;
}

}  // namespace

void set_wheel_library(const std::string& path) {
  std::lock_guard<std::mutex> lock(hint_mu());
  wheel_hint() = path;
}

const Library& library() {
  static const Library l = load();
  return l;
}

std::string status_text(Status s) {
  const Library& l = library();
  const char* text = l.api ? l.api->ucs_status_string(s) : nullptr;
  return std::string(text ? text : "UCX status") + " (" + std::to_string(s) + ")";
}

}  // namespace fxm::ucx
