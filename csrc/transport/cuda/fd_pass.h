// Passing a window's cuMem fds to peers on the same host: the owner serves
// them on an abstract unix socket (SCM_RIGHTS) for the length of the
// registration collective; a peer proves it was told the window's random
// token (published through the bootstrap) before it gets any fd. Abstract
// sockets belong to a network namespace: a peer in another one cannot connect
// and takes another path (describe() says so).
//
// Nothing a connecting process does holds the owner or another peer: the
// server polls its listener, its stop eventfd and up to kFdMaxClients
// connections at once, each of which must send its whole token within
// kFdClientMs (else it is closed); over the bound the oldest is closed. The
// fetching side bounds its connect, send and receive by one deadline.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <thread>
#include <vector>

namespace fxm::cuda {

constexpr int kFdClientMs = 200;    // a connection's time to send its whole token
constexpr size_t kFdMaxClients = 64;  // connections read at once; more: the oldest is closed

// The fds to pass to whoever sent `token` (false: none, the connection is
// closed): descriptors of its own, which the server closes once sent. Called
// on the server's thread.
using FdLookup = std::function<bool(uint64_t token, std::vector<int>* fds)>;

class FdServer {
 public:
  // Serves dup()s of `fds` (not owned) to whoever sends `token`; throws Error(kSystem).
  FdServer(std::vector<int> fds, uint64_t token);
  // Serves what `lookup` answers for each token (the fds of many windows, made on demand).
  explicit FdServer(FdLookup lookup);
  ~FdServer();  // stops serving at once (signals the server thread, which never blocks elsewhere)
  FdServer(const FdServer&) = delete;
  FdServer& operator=(const FdServer&) = delete;
  const std::string& name() const { return name_; }  // the abstract socket's name (no leading NUL)

 private:
  void serve() const;
  FdLookup lookup_;
  std::string name_;
  int listen_fd_ = -1;  // non-blocking
  int stop_fd_ = -1;    // eventfd that ends serve()
  std::thread thread_;
};

// Fetches `count` fds from the server `name` within `timeout_ms` (connect,
// token and answer together). Empty with *why set when it cannot (another
// network namespace, refused, a server that accepted or answered nothing in time).
// With expect_pid > 0, the server must be that process (SO_PEERCRED): a
// description naming another process's server is refused before the token is sent
// (0: any server, for the fd-server tests only).
std::vector<int> fetch_fds(const std::string& name, uint64_t token, size_t count, int timeout_ms,
                           std::string* why, int expect_pid);

}  // namespace fxm::cuda
