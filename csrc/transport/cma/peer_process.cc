#include "transport/cma/peer_process.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <sys/socket.h>
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
  std::string inode = socket_inode(pid, there, here);
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
