// Result strings, the thread's last error and the runtime version.
#include <new>
#include <stdexcept>
#include <string>

#include "capi/guard.h"

namespace fxm::capi {
namespace {

struct LastError {
  std::string text;
  int peer = -1;
  int sys_errno = 0;
  std::string peer_name;  // the agent it concerns ("" when none)
};

LastError& last() {
  thread_local LastError e;
  return e;
}

}  // namespace

flagcx_mesh_result_t record_error(const char* call, Code code, int peer, int sys_errno,
                                  const std::string& what, const std::string& peer_name) {
  LastError& e = last();
  e.text = std::string(call) + ": " + what;
  e.peer = peer;
  e.sys_errno = sys_errno;
  e.peer_name = peer_name;
  return static_cast<flagcx_mesh_result_t>(code);
}

void clear_error() {
  LastError& e = last();
  if (e.text.empty() && e.peer == -1 && e.sys_errno == 0 && e.peer_name.empty()) return;  // the common case
  e.text.clear();
  e.peer = -1;
  e.sys_errno = 0;
  e.peer_name.clear();
}

flagcx_mesh_result_t current_exception_result(const char* call) {
  try {
    throw;
  } catch (const Error& e) {
    return record_error(call, e.code(), e.peer(), e.sys_errno(), e.what(), e.peer_name());
  } catch (const std::bad_alloc&) {
    return record_error(call, Code::kSystem, -1, ENOMEM, "out of memory");
  } catch (const std::exception& e) {
    return record_error(call, Code::kInternal, -1, 0, std::string("unexpected error: ") + e.what());
  } catch (...) {
    return record_error(call, Code::kInternal, -1, 0, "unexpected non-standard exception");
  }
}

void require(const void* ptr, const char* name) {
  if (ptr == nullptr) fail(Code::kInvalidArgument, -1, 0, std::string(name) + " is NULL");
}

}  // namespace fxm::capi

using fxm::capi::last;

extern "C" {

int flagcx_mesh_version(void) { return FLAGCX_MESH_VERSION_CODE; }

const char* flagcx_mesh_result_string(flagcx_mesh_result_t result) {
  switch (result) {
    case FLAGCX_MESH_OK: return "success";
    case FLAGCX_MESH_INVALID_ARGUMENT: return "invalid argument: bad input from the caller, nothing was changed";
    case FLAGCX_MESH_TIMED_OUT: return "timed out: a deadline expired before the peers answered";
    case FLAGCX_MESH_PEER_LOST: return "peer lost: a peer or the rendezvous root went away";
    case FLAGCX_MESH_PROTOCOL: return "protocol error: malformed, foreign or miswired data on the wire";
    case FLAGCX_MESH_SYSTEM: return "system error: a system call failed (see the errno)";
    case FLAGCX_MESH_CLOSED: return "closed: the handle was used after it was closed";
    case FLAGCX_MESH_INTERNAL: return "internal error: a bug in flagcx_mesh";
    case FLAGCX_MESH_NUM_RESULTS: break;
  }
  return "unknown result code (not one flagcx_mesh returns)";
}

const char* flagcx_mesh_last_error(void) { return last().text.c_str(); }
int flagcx_mesh_last_error_peer(void) { return last().peer; }
int flagcx_mesh_last_error_errno(void) { return last().sys_errno; }
const char* flagcx_mesh_last_error_peer_name(void) { return last().peer_name.c_str(); }

}  // extern "C"
