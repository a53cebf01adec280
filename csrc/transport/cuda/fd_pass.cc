#include "transport/cuda/fd_pass.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "base/status.h"

namespace fxm::cuda {
namespace {

constexpr size_t kMaxFds = 250;  // SCM_RIGHTS carries at most 253 per message

sockaddr_un abstract_addr(const std::string& name, socklen_t* len) {
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  size_t n = std::min(name.size(), sizeof(a.sun_path) - 1);
  std::memcpy(a.sun_path + 1, name.data(), n);  // sun_path[0] == 0: abstract
  *len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + n);
  return a;
}

std::string random_name() {
  uint8_t r[12];
  if (::getrandom(r, sizeof(r), 0) != static_cast<ssize_t>(sizeof(r))) {
    fail(Code::kSystem, -1, errno, "getrandom for an fd socket name");
  }
  static const char* hexd = "0123456789abcdef";
  std::string s = "fxm-fd-";
  for (uint8_t b : r) {
    s += hexd[b >> 4];
    s += hexd[b & 15];
  }
  return s;
}

bool wait_fd(int fd, short events, int timeout_ms) {
  pollfd p{fd, events, 0};
  return ::poll(&p, 1, timeout_ms) == 1 && (p.revents & events);
}

}  // namespace

FdServer::FdServer(std::vector<int> fds, uint64_t token) : fds_(std::move(fds)), token_(token) {
  if (fds_.size() > kMaxFds) fail(Code::kInvalidArgument, -1, 0, "a device window of more than 250 cuMem mappings");
  listen_fd_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (listen_fd_ < 0) fail(Code::kSystem, -1, errno, "socket(AF_UNIX) to pass cuMem fds");
  name_ = random_name();
  socklen_t len = 0;
  sockaddr_un a = abstract_addr(name_, &len);
  if (::bind(listen_fd_, reinterpret_cast<sockaddr*>(&a), len) != 0 || ::listen(listen_fd_, 64) != 0) {
    int err = errno;
    ::close(listen_fd_);
    fail(Code::kSystem, -1, err, "binding the unix socket that passes cuMem fds");
  }
  stop_fd_ = ::eventfd(0, EFD_CLOEXEC);
  if (stop_fd_ < 0) {
    int err = errno;
    ::close(listen_fd_);
    fail(Code::kSystem, -1, err, "eventfd for the server of cuMem fds");
  }
  thread_ = std::thread([this] { serve(); });
}

FdServer::~FdServer() {
  uint64_t one = 1;
  if (::write(stop_fd_, &one, sizeof(one)) < 0) {}
  thread_.join();
  ::close(stop_fd_);
  ::close(listen_fd_);
}

void FdServer::serve() {
  for (;;) {
    pollfd p[2] = {{listen_fd_, POLLIN, 0}, {stop_fd_, POLLIN, 0}};
    if (::poll(p, 2, -1) < 0 && errno != EINTR) return;
    if (p[1].revents) return;
    if (!(p[0].revents & POLLIN)) continue;
    int conn = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (conn < 0) continue;
    answer(conn);
    ::close(conn);
  }
}

// One request from a process of this user: 8 bytes of token within 200 ms,
// answered by the fds and their count. Anything else is closed at once.
void FdServer::answer(int conn) const {
  ucred cred{};
  socklen_t len = sizeof(cred);
  if (::getsockopt(conn, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0 || cred.uid != ::getuid()) return;
  uint64_t token = 0;
  if (!wait_fd(conn, POLLIN, 200) || ::recv(conn, &token, sizeof(token), MSG_WAITALL) != sizeof(token)) return;
  if (token != token_) return;
  uint32_t count = static_cast<uint32_t>(fds_.size());
  iovec iov{&count, sizeof(count)};
  std::vector<char> control(CMSG_SPACE(sizeof(int) * kMaxFds));
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  if (count > 0) {
    msg.msg_control = control.data();
    msg.msg_controllen = CMSG_SPACE(sizeof(int) * count);
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * count);
    std::memcpy(CMSG_DATA(c), fds_.data(), sizeof(int) * count);
  }
  ::sendmsg(conn, &msg, MSG_NOSIGNAL);
}

std::vector<int> fetch_fds(const std::string& name, uint64_t token, size_t count, int timeout_ms,
                           std::string* why) {
  int s = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  socklen_t len = 0;
  sockaddr_un a = abstract_addr(name, &len);
  if (s < 0 || ::connect(s, reinterpret_cast<sockaddr*>(&a), len) != 0) {
    *why = std::string("its fd socket is unreachable (") + std::strerror(errno) + "; another network namespace?)";
    if (s >= 0) ::close(s);
    return {};
  }
  std::vector<int> fds;
  uint32_t got = 0;
  iovec iov{&got, sizeof(got)};
  std::vector<char> control(CMSG_SPACE(sizeof(int) * kMaxFds));
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control.data();
  msg.msg_controllen = control.size();
  bool sent = ::send(s, &token, sizeof(token), MSG_NOSIGNAL) == sizeof(token);
  if (sent && wait_fd(s, POLLIN, timeout_ms) && ::recvmsg(s, &msg, MSG_CMSG_CLOEXEC) == sizeof(got)) {
    for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
      if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
      size_t n = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      fds.resize(n);
      std::memcpy(fds.data(), CMSG_DATA(c), n * sizeof(int));
    }
  }
  ::close(s);
  if (fds.size() != count || got != count) {
    for (int fd : fds) ::close(fd);
    *why = "its fd socket passed " + std::to_string(fds.size()) + " of " + std::to_string(count) + " cuMem fds";
    return {};
  }
  return fds;
}

}  // namespace fxm::cuda
