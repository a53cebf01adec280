#include "transport/binding.h"

#include <sys/sysmacros.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <vector>

#include "base/hmac.h"
#include "base/status.h"
#include "transport/cma/cma.h"
#include "transport/cma/peer_process.h"
#include "transport/path.h"

namespace fxm {
namespace {

void put_u64(crypto::Sha256& h, uint64_t v) { h.update(&v, sizeof(v)); }

std::string hex(uint64_t v) {
  char b[24];
  std::snprintf(b, sizeof(b), "0x%llx", static_cast<unsigned long long>(v));
  return b;
}

}  // namespace

// The whole description in its canonical encoding (WindowDesc::encode() of what decode() read:
// a flag is 0 or 1, every string and list at its length): every byte a peer may vary in a
// descriptor of one registration is sealed, so one registration has one valid descriptor
// (Connection keys its paths on the seal: one per live registration, however many byte-variants
// a peer hands out).
uint64_t window_seal(const WindowDesc& d, uint32_t index) {
  crypto::Sha256 h;
  static const char kLabel[] = "flagcx_mesh window seal v2";
  h.update(kLabel, sizeof(kLabel));
  put_u64(h, index);
  std::vector<uint8_t> enc = d.encode();
  put_u64(h, enc.size());
  h.update(enc.data(), enc.size());
  crypto::Digest g = h.finish();
  uint64_t v = 0;
  std::memcpy(&v, g.data(), sizeof(v));
  return v == 0 ? 1 : v;
}

// /proc/<pid>/stat field 22 (clock ticks after boot), 0 when unknown: with the pid, one process.
uint64_t process_start_time(pid_t pid) {
  std::string path = "/proc/" + std::to_string(pid) + "/stat";
  FILE* f = std::fopen(path.c_str(), "r");
  if (!f) return 0;
  char buf[2048];
  size_t n = std::fread(buf, 1, sizeof buf - 1, f);
  std::fclose(f);
  buf[n] = 0;
  const char* p = std::strrchr(buf, ')');  // the command name may hold spaces and parentheses
  if (!p) return 0;
  ++p;
  for (int field = 2; field < 21 && *p; ++field) {  // to the space before field 22
    p = std::strchr(p + 1, ' ');
    if (!p) return 0;
  }
  unsigned long long t = 0;
  return std::sscanf(p, " %llu", &t) == 1 ? t : 0;
}

std::string peer_words(const PathRequest& req) {
  return req.peer_is_agent ? std::string("the peer agent") : "rank " + std::to_string(req.peer);
}

namespace {

// "" when the described pid is the peer's process here, else why not (naming the field).
std::string prove_process(const PathRequest& req, const WindowDesc& d) {
  if (d.host != req.host) return "peer is on another host";
  if (d.pid_ns.empty() || d.pid_ns != req.pid_ns) {
    return "peer is in another PID namespace (" + (d.pid_ns.empty() ? std::string("unknown") : d.pid_ns) +
           ", here " + (req.pid_ns.empty() ? std::string("unknown") : req.pid_ns) + "): its pid means nothing here";
  }
  uint64_t started = process_start_time(d.pid);  // (a reused pid is another process: not the cached verdict)
  std::pair<int32_t, uint64_t> who{d.pid, started};
  if (req.proven && started != 0 && req.proven->count(who)) return "";
  std::string process = cma::holds_other_end(d.pid, req.peer_socket);
  if (!process.empty()) return "field pid: the published pid is not " + peer_words(req) + "'s process: " + process;
  if (req.proven && started != 0) req.proven->insert(who);
  return "";
}

}  // namespace

Binding bind_to_peer(const PathRequest& req, const WindowDesc& d) {
  Binding b;
  b.process = prove_process(req, d);
  if (!b.process.empty()) return b;
  uint64_t seal = 0;
  int err = d.size == 0 ? EINVAL : cma::read(d.pid, d.cookie_addr, &seal, sizeof(seal));
  if (err != 0) {
    b.seal_unreadable = err == EPERM || err == ENOSYS;
    b.sealed = "process_vm_readv not permitted: " + errno_text(err);
    return b;
  }
  if (seal == 0) {
    b.sealed = "window #" + std::to_string(req.win_index) + " of " + peer_words(req) +
               " was deregistered there (field cookie: its seal is 0)";
    b.mismatch = true;
  } else if (seal != (req.seal != 0 ? req.seal : window_seal(d, req.win_index))) {
    b.sealed = "the description of window #" + std::to_string(req.win_index) + " is not what " + peer_words(req) +
               " registered (field index, address, size, segment or export changed: its seal at " +
               hex(d.cookie_addr) + " in pid " + std::to_string(d.pid) + " does not match)";
    b.mismatch = true;
  }
  return b;
}

// /proc/<pid>/maps: "start-end perms offset major:minor inode path", read a whole line at a time:
// a path runs to any length, and a fixed-size read would take its tail (which the process chose)
// for a line of its own. Only a shared writable mapping ("rw?s") is the process's segment.
std::string maps_file_at(pid_t pid, uint64_t addr, uint64_t bytes, uint64_t st_dev, uint64_t st_ino) {
  std::string path = "/proc/" + std::to_string(pid) + "/maps";
  FILE* f = std::fopen(path.c_str(), "r");  // stdio: the core uses no iostreams (no C++ locale)
  if (!f) return "cannot read " + path + ": " + errno_text(errno);
  char* line = nullptr;
  size_t cap = 0;
  std::string seen, verdict;
  bool found = false;
  while (!found && ::getline(&line, &cap, f) >= 0) {
    unsigned long long lo = 0, hi = 0, off = 0, ino = 0;
    unsigned maj = 0, min = 0;
    char perms[5] = {};
    if (std::sscanf(line, "%llx-%llx %4s %llx %x:%x %llu", &lo, &hi, perms, &off, &maj, &min, &ino) != 7) continue;
    if (lo != addr) continue;
    if (ino != st_ino || makedev(maj, min) != st_dev || off != 0) {
      seen = "it maps another file there";
      continue;
    }
    if (perms[0] != 'r' || perms[1] != 'w' || perms[3] != 's') {
      seen = std::string("it maps the file there as \"") + perms + "\", not shared and writable";
      continue;
    }
    found = true;
    if (hi - lo < bytes) verdict = "it maps only " + std::to_string(hi - lo) + " bytes of it there";
  }
  std::free(line);
  std::fclose(f);
  if (found) return verdict;
  return seen.empty() ? "it maps no file at " + hex(addr) : seen;
}

namespace {

// cuda-ipc exports opened here for agents: handle bytes -> the process that opened it first.
struct Claim {
  pid_t pid;
  uint64_t started;
  std::string words;
};
std::mutex claims_mu;
auto* claims = new std::map<std::string, Claim>();  // never destroyed (static order)

// With claims_mu held: who holds `key` other than (pid, started), "" when none (a holder whose
// process is gone, its pid free or reused, holds nothing).
std::string other_holder(const std::string& key, pid_t pid, uint64_t started) {
  auto it = claims->find(key);
  if (it == claims->end()) return "";
  const Claim& c = it->second;
  if (c.pid == pid && c.started == started && started != 0) return "";
  if (c.started != 0 && process_start_time(c.pid) == c.started) return c.words;
  claims->erase(it);
  return "";
}

}  // namespace

std::string export_holder(const std::string& key, pid_t pid) {
  std::lock_guard<std::mutex> lock(claims_mu);
  return other_holder(key, pid, process_start_time(pid));
}

std::string claim_export(const std::string& key, pid_t pid, const std::string& words) {
  uint64_t started = process_start_time(pid);
  std::lock_guard<std::mutex> lock(claims_mu);
  std::string other = other_holder(key, pid, started);
  if (!other.empty()) return other;
  if (started == 0) return "(a process whose start time cannot be read)";
  claims->emplace(key, Claim{pid, started, words});
  return "";
}

std::string first_difference(const WindowDesc& a, const WindowDesc& b) {
  if (a.kind != b.kind) return "kind";
  if (a.size != b.size) return "size";
  if (a.addr != b.addr) return "address";
  if (a.pid != b.pid) return "pid";
  if (a.host != b.host) return "host";
  if (a.pid_ns != b.pid_ns) return "pid namespace";
  if (a.shm_name != b.shm_name) return "shm name";
  if (a.cookie_addr != b.cookie_addr) return "cookie address";
  if (a.cookie != b.cookie) return "cookie";
  if (a.dev.ordinal != b.dev.ordinal) return "device";
  if (std::memcmp(a.dev.ipc_handle.reserved, b.dev.ipc_handle.reserved, cuda::kIpcHandleSize) != 0) return "IPC handle";
  if (a.dev.ipc != b.dev.ipc) return "IPC flag";
  if (a.dev.ipc_offset != b.dev.ipc_offset) return "IPC offset";
  if (a.dev.vmm.size() != b.dev.vmm.size()) return "cuMem mappings";
  for (size_t i = 0; i < a.dev.vmm.size(); ++i) {
    if (a.dev.vmm[i].offset != b.dev.vmm[i].offset || a.dev.vmm[i].size != b.dev.vmm[i].size) return "cuMem mappings";
  }
  if (a.fd_socket != b.fd_socket) return "fd server";
  if (a.fd_token != b.fd_token) return "fd token";
  if (a.ucx_rkey != b.ucx_rkey) return "UCX rkey";
  if (a.ucx_transports != b.ucx_transports) return "UCX transports";
  if (a.ucx_worker != b.ucx_worker) return "UCX worker address";
  return "";
}

}  // namespace fxm
