#include "transport/cuda/fd_pass.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "base/clock.h"
#include "base/status.h"
#include "base/thread_name.h"

namespace fxm::cuda {
namespace {

constexpr size_t kMaxFds = 250;        // SCM_RIGHTS carries at most 253 per message
constexpr int kAcceptsPerRound = 64;   // then the connections already read get their turn
constexpr int kAcceptBackoffMs = 10;   // after accept() failed for want of descriptors

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

// The answer to a valid token: the fds' count, with the fds. Never blocks
// (the connection's send buffer is empty); a client that is gone gets nothing.
void send_fds(int conn, const std::vector<int>& fds) {
  uint32_t count = static_cast<uint32_t>(fds.size());
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
    std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * count);
  }
  if (::sendmsg(conn, &msg, MSG_NOSIGNAL | MSG_DONTWAIT) < 0) {}
}

bool same_user(int conn) {
  ucred cred{};
  socklen_t len = sizeof(cred);
  return ::getsockopt(conn, SOL_SOCKET, SO_PEERCRED, &cred, &len) == 0 && cred.uid == ::getuid();
}

// One accepted connection of this user, reading its token (non-blocking).
struct Client {
  int fd = -1;
  Clock::time_point deadline;
  uint8_t token[8] = {};
  size_t got = 0;
};

// The connections being read, oldest first. Each is closed once it sent its
// token (answered when valid), closed its end, failed, or ran past its deadline.
class Clients {
 public:
  explicit Clients(const FdLookup& lookup) : lookup_(lookup) {}
  ~Clients() {
    for (const Client& c : list_) ::close(c.fd);
  }
  Clients(const Clients&) = delete;
  Clients& operator=(const Clients&) = delete;

  void add(int fd);  // reads it at once; over kFdMaxClients the oldest is closed
  void add_polls(std::vector<pollfd>* p) const {
    for (const Client& c : list_) p->push_back({c.fd, POLLIN, 0});
  }
  void serve(const pollfd* p);  // p[i]: list_[i] as add_polls() put it
  int poll_ms() const;          // until the earliest deadline; -1: none
  void drop_expired();

 private:
  bool read(Client* c) const;  // true: keep reading it
  const FdLookup& lookup_;
  std::vector<Client> list_;
};

void Clients::add(int fd) {
  Client c;
  c.fd = fd;
  c.deadline = Clock::now() + std::chrono::milliseconds(kFdClientMs);
  if (!read(&c)) {
    ::close(fd);
    return;
  }
  if (list_.size() >= kFdMaxClients) {
    ::close(list_.front().fd);
    list_.erase(list_.begin());
  }
  list_.push_back(c);
}

bool Clients::read(Client* c) const {
  ssize_t r = ::recv(c->fd, c->token + c->got, sizeof(c->token) - c->got, MSG_DONTWAIT);
  if (r < 0) return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR;
  if (r == 0) return false;
  c->got += static_cast<size_t>(r);
  if (c->got < sizeof(c->token)) return true;
  uint64_t token = 0;
  std::memcpy(&token, c->token, sizeof(token));
  std::vector<int> fds;
  if (lookup_(token, &fds) && fds.size() <= kMaxFds) send_fds(c->fd, fds);
  for (int fd : fds) ::close(fd);
  return false;
}

void Clients::serve(const pollfd* p) {
  std::vector<Client> kept;
  for (size_t i = 0; i < list_.size(); ++i) {
    bool keep = !(p[i].revents & (POLLIN | POLLHUP | POLLERR)) || read(&list_[i]);
    if (keep) {
      kept.push_back(list_[i]);
    } else {
      ::close(list_[i].fd);
    }
  }
  list_.swap(kept);
}

int Clients::poll_ms() const {
  if (list_.empty()) return -1;
  Clock::time_point first = list_.front().deadline;
  for (const Client& c : list_) first = std::min(first, c.deadline);
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(first - Clock::now()).count();
  return static_cast<int>(std::max<long long>(0, left + 1));
}

void Clients::drop_expired() {
  Clock::time_point now = Clock::now();
  std::vector<Client> kept;
  for (const Client& c : list_) {
    if (c.deadline > now) {
      kept.push_back(c);
    } else {
      ::close(c.fd);
    }
  }
  list_.swap(kept);
}

// Takes up to kAcceptsPerRound new connections; false when accept() lacked
// descriptors (the caller waits a little before trying again).
bool accept_round(int listen_fd, Clients* clients) {
  for (int i = 0; i < kAcceptsPerRound; ++i) {
    int conn = ::accept4(listen_fd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (conn < 0) {
      return !(errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM);
    }
    if (same_user(conn)) {
      clients->add(conn);
    } else {
      ::close(conn);
    }
  }
  return true;
}

}  // namespace

namespace {

// Answers dup()s of `fds` to `token` (a descriptor that cannot be duplicated is
// left out: the peer then counts them short).
FdLookup fixed_fds(std::vector<int> fds, uint64_t token) {
  if (fds.size() > kMaxFds) fail(Code::kInvalidArgument, -1, 0, "a device window of more than 250 cuMem mappings");
  return [fds = std::move(fds), token](uint64_t asked, std::vector<int>* out) {
    if (asked != token) return false;
    for (int fd : fds) {
      int twin = ::fcntl(fd, F_DUPFD_CLOEXEC, 0);
      if (twin >= 0) out->push_back(twin);
    }
    return true;
  };
}

}  // namespace

FdServer::FdServer(std::vector<int> fds, uint64_t token) : FdServer(fixed_fds(std::move(fds), token)) {}

FdServer::FdServer(FdLookup lookup) : lookup_(std::move(lookup)) {
  listen_fd_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
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
  thread_ = std::thread([this] {
    name_this_thread("fxm-fdserver");
    serve();
  });
}

FdServer::~FdServer() {
  uint64_t one = 1;
  if (::write(stop_fd_, &one, sizeof(one)) < 0) {}
  thread_.join();  // serve() waits only in poll(), which the eventfd ends
  ::close(stop_fd_);
  ::close(listen_fd_);
}

// Polls the stop eventfd, the listener and every connection being read; the
// only wait is poll(), bounded by the earliest connection's deadline.
void FdServer::serve() const {
  Clients clients(lookup_);
  bool accepting = true;
  for (;;) {
    std::vector<pollfd> p = {{stop_fd_, POLLIN, 0}, {listen_fd_, static_cast<short>(accepting ? POLLIN : 0), 0}};
    clients.add_polls(&p);
    int wait = clients.poll_ms();
    if (!accepting && (wait < 0 || wait > kAcceptBackoffMs)) wait = kAcceptBackoffMs;
    int n = ::poll(p.data(), p.size(), wait);
    if (n < 0 && errno != EINTR) return;
    if (n > 0 && p[0].revents) return;
    if (n > 0) clients.serve(p.data() + 2);
    accepting = n <= 0 || !(p[1].revents & POLLIN) || accept_round(listen_fd_, &clients);
    clients.drop_expired();
  }
}

namespace {

std::string ms_text(int ms) { return std::to_string(ms) + " ms"; }

// A connected socket (then non-blocking), or -1 with *why set. A unix
// socket's connect() waits while the server's backlog is full: SO_SNDTIMEO
// bounds that wait (a non-blocking connect would only answer EAGAIN).
int connect_within(const std::string& name, const Deadline& d, int timeout_ms, std::string* why) {
  int s = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (s < 0) {
    *why = std::string("no socket to reach its fd server (") + std::strerror(errno) + ")";
    return -1;
  }
  socklen_t len = 0;
  sockaddr_un a = abstract_addr(name, &len);
  int rc = -1;
  int err = ETIMEDOUT;
  while (!d.expired()) {
    long left_us = static_cast<long>(d.seconds_left() * 1e6) + 1;
    timeval tv{left_us / 1000000, left_us % 1000000};
    ::setsockopt(s, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
    rc = ::connect(s, reinterpret_cast<sockaddr*>(&a), len);
    err = errno;
    if (rc == 0 || err != EINTR) break;
  }
  if (rc == 0 && ::fcntl(s, F_SETFL, ::fcntl(s, F_GETFL) | O_NONBLOCK) == 0) return s;
  if (rc == 0) err = errno;  // connected, but fcntl failed
  ::close(s);
  if (rc != 0 && (err == EAGAIN || err == ETIMEDOUT || err == EINTR)) {
    *why = "its fd server accepted no connection within " + ms_text(timeout_ms) + " (its backlog stayed full)";
  } else {
    *why = std::string("its fd server is unreachable (") + std::strerror(err) + "; another network namespace?)";
  }
  return -1;
}

// Waits for `events` on s until d; false when it expired (or poll failed).
bool wait_until(int s, short events, const Deadline& d) {
  for (;;) {
    pollfd p{s, events, 0};
    int n = ::poll(&p, 1, d.poll_ms());
    if (n > 0) return true;
    if (n == 0 || errno != EINTR || d.expired()) return false;
  }
}

bool send_token(int s, uint64_t token, const Deadline& d) {
  const uint8_t* b = reinterpret_cast<const uint8_t*>(&token);
  size_t sent = 0;
  while (sent < sizeof(token)) {
    if (!wait_until(s, POLLOUT, d)) return false;
    ssize_t r = ::send(s, b + sent, sizeof(token) - sent, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (r < 0 && errno != EAGAIN && errno != EINTR) return false;
    if (r > 0) sent += static_cast<size_t>(r);
  }
  return true;
}

void take_fds(msghdr* msg, std::vector<int>* fds) {
  for (cmsghdr* c = CMSG_FIRSTHDR(msg); c != nullptr; c = CMSG_NXTHDR(msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    size_t n = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    size_t at = fds->size();
    fds->resize(at + n);
    std::memcpy(fds->data() + at, CMSG_DATA(c), n * sizeof(int));
  }
}

// The answer (count, then fds) until d; false when it did not come in time
// (a server that closed early leaves *got short).
bool recv_answer(int s, uint32_t* got, std::vector<int>* fds, const Deadline& d) {
  uint8_t* b = reinterpret_cast<uint8_t*>(got);
  size_t have = 0;
  std::vector<char> control(CMSG_SPACE(sizeof(int) * kMaxFds));
  while (have < sizeof(*got)) {
    if (!wait_until(s, POLLIN, d)) return false;
    iovec iov{b + have, sizeof(*got) - have};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.data();
    msg.msg_controllen = control.size();
    ssize_t r = ::recvmsg(s, &msg, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
    if (r == 0) return true;
    if (r < 0 && errno != EAGAIN && errno != EINTR) return true;
    if (r > 0) {
      have += static_cast<size_t>(r);
      take_fds(&msg, fds);
    }
  }
  return true;
}

}  // namespace

std::vector<int> fetch_fds(const std::string& name, uint64_t token, size_t count, int timeout_ms,
                           std::string* why, int expect_pid) {
  Deadline d = Deadline::after_seconds(timeout_ms / 1000.0);
  int s = connect_within(name, d, timeout_ms, why);
  if (s < 0) return {};
  ucred cred{};
  socklen_t len = sizeof(cred);
  if (expect_pid > 0 && (::getsockopt(s, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0 || cred.pid != expect_pid)) {
    ::close(s);  // its token is not sent to another process
    *why = "field fd server: it is served by pid " + std::to_string(cred.pid) + ", not by the peer's process (pid " +
           std::to_string(expect_pid) + ")";
    return {};
  }
  std::vector<int> fds;
  uint32_t got = 0;
  bool in_time = send_token(s, token, d) && recv_answer(s, &got, &fds, d);
  ::close(s);
  if (in_time && fds.size() == count && got == count) return fds;
  for (int fd : fds) ::close(fd);
  if (!in_time) {
    *why = "its fd server did not answer within " + ms_text(timeout_ms);
  } else {
    *why = "its fd server passed " + std::to_string(fds.size()) + " of " + std::to_string(count) + " cuMem fds";
  }
  return {};
}

}  // namespace fxm::cuda
