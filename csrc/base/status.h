// Error type of the core: every failure carries a code, the peer rank it
// concerns (-1 when none), the errno that decided it (0 when none), the name
// of the agent it concerns ("" when none: mesh errors) and a message saying
// what was being done.
#pragma once

#include <stdexcept>
#include <string>

namespace fxm {

enum class Code : int {
  kOk = 0,
  kInvalidArgument = 1,  // bad input from the caller; nothing was changed
  kTimeout = 2,          // a deadline expired
  kPeerLost = 3,         // a peer (or the rendezvous root) went away
  kProtocol = 4,         // malformed, foreign or inconsistent data on the wire
  kSystem = 5,           // a system call failed (errno says which way)
  kClosed = 6,           // the object was used after close()
  kInternal = 7,         // a bug in this library
};

const char* code_name(Code code);

class Error : public std::runtime_error {
 public:
  Error(Code code, int peer, int sys_errno, const std::string& what, std::string peer_name = "");
  Code code() const { return code_; }
  int peer() const { return peer_; }
  int sys_errno() const { return errno_; }
  const std::string& peer_name() const { return peer_name_; }

 private:
  Code code_;
  int peer_;
  int errno_;
  std::string peer_name_;
};

// Throws Error; `what` should name the rank, the peer and the operation.
[[noreturn]] void fail(Code code, int peer, int sys_errno, const std::string& what);
// Throws `e` again naming the agent it concerns (kept when it names one already).
[[noreturn]] void rethrow_naming(const Error& e, const std::string& peer_name);

// "errno 111 (Connection refused)"
std::string errno_text(int err);

}  // namespace fxm
