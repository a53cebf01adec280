#include "transport/tcp/socket.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "base/status.h"

namespace fxm::tcp {

Fd& Fd::operator=(Fd&& o) noexcept {
  if (this != &o) {
    reset();
    fd_ = o.release();
  }
  return *this;
}

int Fd::release() {
  int fd = fd_;
  fd_ = -1;
  return fd;
}

void Fd::reset() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

std::string SockAddr::str() const {
  char host[INET6_ADDRSTRLEN] = "?";
  if (ss.ss_family == AF_INET) {
    auto* a = reinterpret_cast<const sockaddr_in*>(&ss);
    inet_ntop(AF_INET, &a->sin_addr, host, sizeof(host));
    return std::string(host) + ":" + std::to_string(port());
  }
  if (ss.ss_family == AF_INET6) {
    auto* a = reinterpret_cast<const sockaddr_in6*>(&ss);
    inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof(host));
    return "[" + std::string(host) + "]:" + std::to_string(port());
  }
  return "<unknown address family>";
}

uint16_t SockAddr::port() const {
  if (ss.ss_family == AF_INET) return ntohs(reinterpret_cast<const sockaddr_in*>(&ss)->sin_port);
  if (ss.ss_family == AF_INET6) return ntohs(reinterpret_cast<const sockaddr_in6*>(&ss)->sin6_port);
  return 0;
}

void SockAddr::set_port(uint16_t p) {
  if (ss.ss_family == AF_INET) reinterpret_cast<sockaddr_in*>(&ss)->sin_port = htons(p);
  if (ss.ss_family == AF_INET6) reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port = htons(p);
}

void addr_to_wire(const SockAddr& a, uint8_t out[kWireAddrSize]) {
  std::memset(out, 0, kWireAddrSize);
  uint16_t fam = a.ss.ss_family == AF_INET6 ? 6 : 4;
  uint16_t port = a.port();
  std::memcpy(out, &fam, 2);
  std::memcpy(out + 2, &port, 2);
  if (fam == 4) {
    std::memcpy(out + 4, &reinterpret_cast<const sockaddr_in*>(&a.ss)->sin_addr, 4);
  } else {
    std::memcpy(out + 4, &reinterpret_cast<const sockaddr_in6*>(&a.ss)->sin6_addr, 16);
  }
}

bool addr_from_wire(const uint8_t in[kWireAddrSize], SockAddr* out) {
  uint16_t fam, port;
  std::memcpy(&fam, in, 2);
  std::memcpy(&port, in + 2, 2);
  *out = SockAddr{};
  if (fam == 4) {
    auto* a = reinterpret_cast<sockaddr_in*>(&out->ss);
    a->sin_family = AF_INET;
    std::memcpy(&a->sin_addr, in + 4, 4);
    out->len = sizeof(sockaddr_in);
  } else if (fam == 6) {
    auto* a = reinterpret_cast<sockaddr_in6*>(&out->ss);
    a->sin6_family = AF_INET6;
    std::memcpy(&a->sin6_addr, in + 4, 16);
    out->len = sizeof(sockaddr_in6);
  } else {
    return false;
  }
  out->set_port(port);
  return true;
}

std::string IoResult::describe() const {
  switch (kind) {
    case kOk: return "ok";
    case kTimeout: return "timed out";
    case kClosed: return "connection closed by peer";
    case kError: return errno_text(err);
  }
  return "?";
}

namespace {

void set_common_options(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

int new_socket(int family, int* err) {
  int fd = ::socket(family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) *err = errno;
  return fd;
}

bool poll_one(int fd, short events, const Deadline& deadline) {
  pollfd p{fd, events, 0};
  while (true) {
    int rc = ::poll(&p, 1, deadline.poll_ms(1000));
    if (rc > 0) return true;
    if (rc < 0 && errno != EINTR) return true;  // let the I/O call report it
    if (deadline.expired()) return false;
  }
}

}  // namespace

Fd listen_on(const SockAddr& bind_addr, SockAddr* bound, int* err) {
  Fd fd(new_socket(bind_addr.ss.ss_family, err));
  if (!fd) return Fd();
  int one = 1;
  setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (::bind(fd.get(), reinterpret_cast<const sockaddr*>(&bind_addr.ss), bind_addr.len) != 0 ||
      ::listen(fd.get(), SOMAXCONN) != 0) {
    *err = errno;
    return Fd();
  }
  *bound = bind_addr;
  socklen_t len = sizeof(bound->ss);
  getsockname(fd.get(), reinterpret_cast<sockaddr*>(&bound->ss), &len);
  bound->len = len;
  return fd;
}

Fd connect_start(const SockAddr& to, int* err) {
  Fd fd(new_socket(to.ss.ss_family, err));
  if (!fd) return Fd();
  set_common_options(fd.get());
  int rc = ::connect(fd.get(), reinterpret_cast<const sockaddr*>(&to.ss), to.len);
  if (rc != 0 && errno != EINPROGRESS) {
    *err = errno;
    return Fd();
  }
  return fd;
}

int connect_error(int fd) {
  int soerr = 0;
  socklen_t len = sizeof(soerr);
  if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &len) != 0) return errno;
  return soerr;
}

Fd accept_one(int listen_fd, SockAddr* from, int* err) {
  from->len = sizeof(from->ss);
  int fd = ::accept4(listen_fd, reinterpret_cast<sockaddr*>(&from->ss), &from->len,
                     SOCK_NONBLOCK | SOCK_CLOEXEC);
  if (fd < 0) {
    *err = (errno == EAGAIN || errno == EWOULDBLOCK) ? 0 : errno;
    return Fd();
  }
  set_common_options(fd);
  return Fd(fd);
}

IoResult write_full(int fd, const void* buf, size_t len, const Deadline& deadline) {
  IoResult r;
  auto* p = static_cast<const char*>(buf);
  while (r.done < len) {
    ssize_t n = ::send(fd, p + r.done, len - r.done, MSG_NOSIGNAL);
    if (n > 0) {
      r.done += static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK) {
      r.kind = (errno == EPIPE || errno == ECONNRESET) ? IoResult::kClosed : IoResult::kError;
      r.err = errno;
      return r;
    }
    if (!poll_one(fd, POLLOUT, deadline)) {
      r.kind = IoResult::kTimeout;
      return r;
    }
  }
  return r;
}

IoResult write_some(int fd, const void* buf, size_t len) {
  IoResult r;
  while (true) {
    ssize_t n = ::send(fd, buf, len, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n >= 0) {
      r.done = static_cast<size_t>(n);
      return r;
    }
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return r;
    r.kind = (errno == EPIPE || errno == ECONNRESET) ? IoResult::kClosed : IoResult::kError;
    r.err = errno;
    return r;
  }
}

IoResult read_some(int fd, void* buf, size_t len) { return read_some2(fd, buf, len, nullptr, 0); }

IoResult read_some2(int fd, void* first, size_t first_len, void* second, size_t second_len) {
  IoResult r;
  iovec iov[2] = {{first, first_len}, {second, second_len}};
  msghdr mh{};
  mh.msg_iov = iov;
  mh.msg_iovlen = second_len > 0 ? 2 : 1;
  while (true) {
    ssize_t n = ::recvmsg(fd, &mh, 0);
    if (n > 0) {
      r.done = static_cast<size_t>(n);
      return r;
    }
    if (n == 0) {
      r.kind = IoResult::kClosed;
      return r;
    }
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return r;
    r.kind = errno == ECONNRESET ? IoResult::kClosed : IoResult::kError;
    r.err = errno;
    return r;
  }
}

IoResult read_full(int fd, void* buf, size_t len, const Deadline& deadline) {
  IoResult total;
  auto* p = static_cast<char*>(buf);
  while (total.done < len) {
    IoResult r = read_some(fd, p + total.done, len - total.done);
    total.done += r.done;
    if (!r.ok()) {
      total.kind = r.kind;
      total.err = r.err;
      return total;
    }
    if (r.done == 0 && !poll_one(fd, POLLIN, deadline)) {
      total.kind = IoResult::kTimeout;
      return total;
    }
  }
  return total;
}

}  // namespace fxm::tcp
