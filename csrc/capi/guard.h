// The C ABI's one error path: runs a call's body, turns any exception into a
// result code and records this thread's last error (call, rank, peer, errno).
#pragma once

#include <string>

#include "flagcx_mesh.h"
#include "base/status.h"

namespace fxm::capi {

// Records this thread's last error; returns its code.
flagcx_mesh_result_t record_error(const char* call, Code code, int peer, int sys_errno,
                                  const std::string& what, const std::string& peer_name = "");
void clear_error();
flagcx_mesh_result_t current_exception_result(const char* call);

// Throws Error(kInvalidArgument) "<name> is NULL" when ptr is NULL (guard
// prefixes the call's name).
void require(const void* ptr, const char* name);

template <class F>
flagcx_mesh_result_t guard(const char* call, F&& body) {
  try {
    body();
    clear_error();
    return FLAGCX_MESH_OK;
  } catch (...) {
    return current_exception_result(call);
  }
}

}  // namespace fxm::capi
