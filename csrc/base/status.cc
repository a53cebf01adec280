#include "base/status.h"

#include <cstring>
#include <utility>

namespace fxm {

const char* code_name(Code code) {
  switch (code) {
    case Code::kOk: return "ok";
    case Code::kInvalidArgument: return "invalid argument";
    case Code::kTimeout: return "timeout";
    case Code::kPeerLost: return "peer lost";
    case Code::kProtocol: return "protocol error";
    case Code::kSystem: return "system error";
    case Code::kClosed: return "closed";
    case Code::kInternal: return "internal error";
  }
  return "unknown code";
}

Error::Error(Code code, int peer, int sys_errno, const std::string& what, std::string peer_name)
    : std::runtime_error(what), code_(code), peer_(peer), errno_(sys_errno), peer_name_(std::move(peer_name)) {}

void rethrow_naming(const Error& e, const std::string& peer_name) {
  if (!e.peer_name().empty()) throw e;
  throw Error(e.code(), e.peer(), e.sys_errno(), e.what(), peer_name);
}

void fail(Code code, int peer, int sys_errno, const std::string& what) {
  std::string msg = what;
  if (sys_errno != 0) msg += ": " + errno_text(sys_errno);
  throw Error(code, peer, sys_errno, msg);
}

std::string errno_text(int err) {
  char buf[128];
  const char* text = strerror_r(err, buf, sizeof(buf));  // GNU variant
  return "errno " + std::to_string(err) + " (" + text + ")";
}

}  // namespace fxm
