// Choice of the address this process listens on and publishes.
//   FLAGCX_MESH_IFNAME=eth0      the interface of that name (or name prefix)
//   FLAGCX_MESH_IFNAME=10.0.0.5  that address literally
//   unset                        the first up IPv4 interface that is not
//                                loopback/docker/virbr, else loopback
#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>

#include <cstring>
#include <mutex>
#include <string>

#include "base/env.h"
#include "base/log.h"
#include "base/status.h"
#include "transport/tcp/socket.h"

namespace fxm::tcp {
namespace {

struct Choice {
  SockAddr addr;
  std::string reason;
};

bool parse_literal(const std::string& s, SockAddr* out) {
  *out = SockAddr{};
  auto* a4 = reinterpret_cast<sockaddr_in*>(&out->ss);
  if (inet_pton(AF_INET, s.c_str(), &a4->sin_addr) == 1) {
    a4->sin_family = AF_INET;
    out->len = sizeof(sockaddr_in);
    return true;
  }
  auto* a6 = reinterpret_cast<sockaddr_in6*>(&out->ss);
  if (inet_pton(AF_INET6, s.c_str(), &a6->sin6_addr) == 1) {
    a6->sin6_family = AF_INET6;
    out->len = sizeof(sockaddr_in6);
    return true;
  }
  return false;
}

bool usable(const ifaddrs* ifa) {
  if (ifa->ifa_addr == nullptr || !(ifa->ifa_flags & IFF_UP)) return false;
  int fam = ifa->ifa_addr->sa_family;
  if (fam != AF_INET && fam != AF_INET6) return false;
  if (fam == AF_INET6) {
    auto* a6 = reinterpret_cast<const sockaddr_in6*>(ifa->ifa_addr);
    if (IN6_IS_ADDR_LINKLOCAL(&a6->sin6_addr)) return false;
  }
  return true;
}

bool excluded_by_default(const char* name) {
  static const char* prefixes[] = {"lo", "docker", "virbr", "veth", "br-"};
  for (const char* p : prefixes) {
    if (std::strncmp(name, p, std::strlen(p)) == 0) return true;
  }
  return false;
}

SockAddr from_ifa(const ifaddrs* ifa) {
  SockAddr a;
  a.len = ifa->ifa_addr->sa_family == AF_INET ? sizeof(sockaddr_in) : sizeof(sockaddr_in6);
  std::memcpy(&a.ss, ifa->ifa_addr, a.len);
  a.set_port(0);
  return a;
}

// Finds an interface by rule: exact name, then name prefix, then automatic.
const ifaddrs* find_interface(const ifaddrs* list, const std::string& want) {
  for (int pass = 0; pass < 2; ++pass) {
    for (const ifaddrs* ifa = list; ifa; ifa = ifa->ifa_next) {
      if (!usable(ifa)) continue;
      bool ipv4 = ifa->ifa_addr->sa_family == AF_INET;
      if (want.empty()) {
        if ((pass == 0) == ipv4 && !excluded_by_default(ifa->ifa_name)) return ifa;
      } else if (pass == 0 ? want == ifa->ifa_name
                           : std::strncmp(ifa->ifa_name, want.c_str(), want.size()) == 0) {
        if (ipv4 || pass == 1) return ifa;
      }
    }
  }
  return nullptr;
}

std::string host_of(const SockAddr& a) {
  std::string s = a.str();  // "10.0.0.5:0" or "[fd00::2]:0"
  s = s.substr(0, s.rfind(':'));
  return s.size() > 1 && s.front() == '[' ? s.substr(1, s.size() - 2) : s;
}

// "lo 127.0.0.1, eth0 10.0.0.5": what FLAGCX_MESH_IFNAME may name.
std::string interfaces_up() {
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return "(getifaddrs failed: " + errno_text(errno) + ")";
  std::string out;
  for (const ifaddrs* ifa = list; ifa; ifa = ifa->ifa_next) {
    if (!usable(ifa)) continue;
    out += (out.empty() ? "" : ", ") + std::string(ifa->ifa_name) + " " + host_of(from_ifa(ifa));
  }
  freeifaddrs(list);
  return out.empty() ? "none" : out;
}

[[noreturn]] void fail_ifname(const std::string& want, int err, const std::string& why) {
  fail(Code::kInvalidArgument, -1, err,
       "FLAGCX_MESH_IFNAME=" + want + " " + why + "; interfaces up: " + interfaces_up() +
           "; set FLAGCX_MESH_IFNAME to one of these names or addresses, or unset it");
}

// An address literal this host cannot bind (EADDRNOTAVAIL) is not one of its own.
void check_local(const std::string& want, const SockAddr& lit) {
  int fd = ::socket(lit.ss.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return;  // the listener reports it
  bool foreign = ::bind(fd, reinterpret_cast<const sockaddr*>(&lit.ss), lit.len) != 0 && errno == EADDRNOTAVAIL;
  ::close(fd);
  if (foreign) fail_ifname(want, EADDRNOTAVAIL, "is not an address of this host");
}

SockAddr loopback() {
  SockAddr a;
  parse_literal("127.0.0.1", &a);
  return a;
}

Choice choose() {
  const std::string& want = env_config().ifname;
  SockAddr lit;
  if (!want.empty() && parse_literal(want, &lit)) {
    check_local(want, lit);
    return {lit, "address " + want + " from FLAGCX_MESH_IFNAME"};
  }
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) {
    return {loopback(), "loopback (getifaddrs failed: " + errno_text(errno) + ")"};
  }
  const ifaddrs* ifa = find_interface(list, want);
  Choice c;
  if (ifa != nullptr) {
    c.addr = from_ifa(ifa);
    c.reason = std::string("interface ") + ifa->ifa_name +
               (want.empty() ? " (automatic; set FLAGCX_MESH_IFNAME to override)"
                             : " (from FLAGCX_MESH_IFNAME)");
  } else if (!want.empty()) {
    freeifaddrs(list);
    fail_ifname(want, 0, "matches no interface that is up with an address");
  } else {
    c.addr = loopback();
    c.reason = "loopback (no other interface is up)";
  }
  freeifaddrs(list);
  c.addr.set_port(0);
  return c;
}

const Choice& chosen() {
  static std::once_flag once;
  static Choice choice;
  std::call_once(once, [] {
    choice = choose();
    std::string host = choice.addr.str();
    host = host.substr(0, host.rfind(':'));
    choice.reason = "listening on " + host + ": " + choice.reason;
    FXM_INFO(-1, choice.reason);
  });
  return choice;
}

}  // namespace

const SockAddr& local_address() { return chosen().addr; }
const std::string& local_address_reason() { return chosen().reason; }

}  // namespace fxm::tcp
