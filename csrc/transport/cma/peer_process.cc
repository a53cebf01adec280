#include "transport/cma/peer_process.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <linux/inet_diag.h>
#include <linux/netlink.h>
#include <linux/sock_diag.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "base/status.h"

namespace fxm::cma {
namespace {

// An endpoint as /proc/<pid>/net/tcp{,6} prints it: the address as 32-bit words
// in host order ("%08X" each), ":", the port ("%04X"). IPv4 addresses mapped
// into IPv6 are printed in their IPv4 form, so both families compare equal.
std::string proc_endpoint(const uint8_t* addr, size_t len, uint16_t port) {
  static const uint8_t kMapped[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
  if (len == 16 && std::memcmp(addr, kMapped, 12) == 0) {
    addr += 12;
    len = 4;
  }
  std::string s;
  char b[16];
  for (size_t i = 0; i < len; i += 4) {
    uint32_t w = 0;
    std::memcpy(&w, addr + i, 4);
    std::snprintf(b, sizeof(b), "%08X", w);
    s += b;
  }
  std::snprintf(b, sizeof(b), ":%04X", port);
  return s + b;
}

bool endpoint_of(const sockaddr_storage& ss, std::string* out) {
  if (ss.ss_family == AF_INET) {
    const auto& a = reinterpret_cast<const sockaddr_in&>(ss);
    *out = proc_endpoint(reinterpret_cast<const uint8_t*>(&a.sin_addr), 4, ntohs(a.sin_port));
    return true;
  }
  if (ss.ss_family == AF_INET6) {
    const auto& a = reinterpret_cast<const sockaddr_in6&>(ss);
    *out = proc_endpoint(a.sin6_addr.s6_addr, 16, ntohs(a.sin6_port));
    return true;
  }
  return false;
}

// Normalises a "/proc/net/tcp6" endpoint of a mapped IPv4 address to the IPv4 form.
std::string normalise(const std::string& e) {
  if (e.size() == 37 && e.compare(0, 24, "0000000000000000FFFF0000") == 0) return e.substr(24);
  return e;
}

// The inode of the socket in pid's network namespace whose local end is
// `local` and remote end `remote`, or "" when there is none.
std::string socket_inode(pid_t pid, const std::string& local, const std::string& remote) {
  for (const char* table : {"tcp", "tcp6"}) {  // stdio: the core uses no iostreams (no C++ locale)
    std::string path = "/proc/" + std::to_string(pid) + "/net/" + table;
    FILE* f = std::fopen(path.c_str(), "r");
    if (!f) continue;
    char line[512], l[64], r[64], inode[32];
    std::string found;
    bool header = true;
    while (found.empty() && std::fgets(line, sizeof line, f)) {
      if (header) { header = false; continue; }
      // sl local remote st tx:rx tr:when retrnsmt uid timeout inode
      if (std::sscanf(line, "%*s %63s %63s %*s %*s %*s %*s %*s %*s %31s", l, r, inode) != 3) continue;
      if (normalise(l) == local && normalise(r) == remote && std::string(inode) != "0") found = inode;
    }
    std::fclose(f);
    if (!found.empty()) return found;
  }
  return "";
}

bool same_net_namespace(pid_t pid) {
  struct stat mine{}, theirs{};
  std::string path = "/proc/" + std::to_string(pid) + "/ns/net";
  return ::stat("/proc/self/ns/net", &mine) == 0 && ::stat(path.c_str(), &theirs) == 0 &&
         mine.st_ino == theirs.st_ino && mine.st_dev == theirs.st_dev;
}

void put_endpoint(const sockaddr_storage& ss, __be16* port, __be32* addr) {
  if (ss.ss_family == AF_INET) {
    const auto& a = reinterpret_cast<const sockaddr_in&>(ss);
    *port = a.sin_port;
    std::memcpy(addr, &a.sin_addr, 4);
  } else {
    const auto& a = reinterpret_cast<const sockaddr_in6&>(ss);
    *port = a.sin6_port;
    std::memcpy(addr, &a.sin6_addr, 16);
  }
}

// The inode of the TCP socket of this network namespace whose local end is
// `local` and remote end `remote`, asked of the kernel by its 4-tuple (one
// sock_diag lookup; /proc/<pid>/net/tcp walks every bucket of the host's
// connection table, milliseconds each time); "" when there is none.
std::string diag_inode(const sockaddr_storage& local, const sockaddr_storage& remote) {
  int fd = ::socket(AF_NETLINK, SOCK_DGRAM | SOCK_CLOEXEC, NETLINK_SOCK_DIAG);
  if (fd < 0) return "";
  struct {
    nlmsghdr h;
    inet_diag_req_v2 r;
  } req{};
  req.h.nlmsg_len = sizeof(req);
  req.h.nlmsg_type = SOCK_DIAG_BY_FAMILY;
  req.h.nlmsg_flags = NLM_F_REQUEST;  // no NLM_F_DUMP: the one socket of this id
  req.r.sdiag_family = static_cast<uint8_t>(local.ss_family);
  req.r.sdiag_protocol = IPPROTO_TCP;
  req.r.idiag_states = ~0u;
  put_endpoint(local, &req.r.id.idiag_sport, req.r.id.idiag_src);
  put_endpoint(remote, &req.r.id.idiag_dport, req.r.id.idiag_dst);
  req.r.id.idiag_cookie[0] = req.r.id.idiag_cookie[1] = INET_DIAG_NOCOOKIE;
  std::string inode;
  alignas(nlmsghdr) char buf[1024];
  if (::send(fd, &req, sizeof(req), 0) == static_cast<ssize_t>(sizeof(req))) {
    ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    auto* h = reinterpret_cast<nlmsghdr*>(buf);
    if (n > 0 && NLMSG_OK(h, static_cast<unsigned>(n)) && h->nlmsg_type == SOCK_DIAG_BY_FAMILY &&
        h->nlmsg_len >= NLMSG_LENGTH(sizeof(inet_diag_msg))) {
      auto* m = static_cast<inet_diag_msg*>(NLMSG_DATA(h));
      if (m->idiag_inode != 0) inode = std::to_string(m->idiag_inode);
    }
  }
  ::close(fd);
  return inode;
}

}  // namespace

std::string holds_other_end(pid_t pid, int fd) {
  sockaddr_storage mine{}, theirs{};
  socklen_t n1 = sizeof(mine), n2 = sizeof(theirs);
  std::string here, there;
  if (fd < 0 || ::getsockname(fd, reinterpret_cast<sockaddr*>(&mine), &n1) != 0 ||
      ::getpeername(fd, reinterpret_cast<sockaddr*>(&theirs), &n2) != 0 || !endpoint_of(mine, &here) ||
      !endpoint_of(theirs, &there)) {
    return "this rank has no TCP connection to the peer to check its pid against";
  }
  // The peer's end, in the peer's network namespace: asked of the kernel when that is
  // this one, else looked up in the peer's table.
  std::string inode = same_net_namespace(pid) ? diag_inode(theirs, mine) : "";
  if (inode.empty()) inode = socket_inode(pid, there, here);
  std::string claim = "pid " + std::to_string(pid);
  if (inode.empty()) return claim + " holds no end of this rank's connection to the peer";
  std::string dir = "/proc/" + std::to_string(pid) + "/fd";
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return "cannot list " + dir + " to check the peer's pid: " + errno_text(errno);
  const std::string want = "socket:[" + inode + "]";
  bool found = false;
  char link[64];
  while (dirent* e = ::readdir(d)) {
    ssize_t len = ::readlinkat(::dirfd(d), e->d_name, link, sizeof(link) - 1);
    if (len > 0 && want.compare(0, std::string::npos, link, static_cast<size_t>(len)) == 0) {
      found = true;
      break;
    }
  }
  ::closedir(d);
  return found ? "" : claim + " holds no end of this rank's connection to the peer";
}

}  // namespace fxm::cma
