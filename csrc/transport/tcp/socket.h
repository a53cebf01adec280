// TCP socket helpers shared by the bootstrap and the mesh builder.
// All sockets are non-blocking; the *_full helpers wait with poll() up to a
// deadline. Nothing here throws: results say what happened, callers decide.
#pragma once

#include <netinet/in.h>
#include <sys/socket.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "base/clock.h"

namespace fxm::tcp {

// Owns one file descriptor; move-only.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& o) noexcept : fd_(o.release()) {}
  Fd& operator=(Fd&& o) noexcept;
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() { reset(); }
  int get() const { return fd_; }
  int release();
  void reset();
  explicit operator bool() const { return fd_ >= 0; }

 private:
  int fd_ = -1;
};

// A socket address; port 0 means "any port" when listening.
struct SockAddr {
  sockaddr_storage ss{};
  socklen_t len = 0;
  std::string str() const;  // "192.0.2.2:4711" or "[::1]:4711"
  uint16_t port() const;
  void set_port(uint16_t port);
};

// Fixed 20-byte form of an address for unique ids and address exchange.
constexpr size_t kWireAddrSize = 20;
void addr_to_wire(const SockAddr& a, uint8_t out[kWireAddrSize]);
bool addr_from_wire(const uint8_t in[kWireAddrSize], SockAddr* out);

// The address this process listens on and publishes (port 0). Chosen once per
// process from FLAGCX_MESH_IFNAME or automatically, and logged at INFO.
const SockAddr& local_address();
// One line saying which interface was chosen and why.
const std::string& local_address_reason();

struct IoResult {
  enum Kind { kOk, kTimeout, kClosed, kError } kind = kOk;
  int err = 0;       // errno for kError
  size_t done = 0;   // bytes moved before the outcome
  bool ok() const { return kind == kOk; }
  std::string describe() const;
};

// Listens (backlog SOMAXCONN) on `bind_addr`; `bound` receives the real port.
// Returns an invalid Fd and sets *err on failure.
Fd listen_on(const SockAddr& bind_addr, SockAddr* bound, int* err);
// Starts a non-blocking connect; the Fd is valid while the connect is in
// progress or done. On immediate failure returns an invalid Fd and sets *err.
Fd connect_start(const SockAddr& to, int* err);
// Outcome of a connect once the socket polled writable: 0 or an errno.
int connect_error(int fd);
// Accepts one connection (non-blocking); invalid Fd when none is pending.
Fd accept_one(int listen_fd, SockAddr* from, int* err);

IoResult write_full(int fd, const void* buf, size_t len, const Deadline& deadline);
IoResult read_full(int fd, void* buf, size_t len, const Deadline& deadline);
// One non-blocking write; kOk with done==0 means "the socket is full".
IoResult write_some(int fd, const void* buf, size_t len);
// One non-blocking read; kOk with done==0 means "nothing yet".
IoResult read_some(int fd, void* buf, size_t len);
// The same into two buffers, filled in order (one system call).
IoResult read_some2(int fd, void* first, size_t first_len, void* second, size_t second_len);

}  // namespace fxm::tcp
