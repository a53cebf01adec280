#include "core/window.h"

#include <algorithm>
#include <cstring>

#include "base/env.h"
#include "base/status.h"

namespace fxm {

const char* path_name(Path p) {
  switch (p) {
    case Path::kSelf: return "self";
    case Path::kShm: return "shm";
    case Path::kCma: return "cma";
    case Path::kTcp: return "tcp";
  }
  return "?";
}

const char* kind_name(WindowKind k) {
  switch (k) {
    case WindowKind::kUser: return "user";
    case WindowKind::kShm: return "shm";
    case WindowKind::kSignal: return "signal";
  }
  return "?";
}

ForcedTransport forced_transport() {
  std::string s = transport_env();
  if (s == "tcp") return ForcedTransport::kTcp;
  if (s == "cma") return ForcedTransport::kCma;
  if (s == "shm") return ForcedTransport::kShm;
  if (!s.empty() && s != "auto") {
    fail(Code::kInvalidArgument, -1, 0, "FLAGCX_MESH_TRANSPORT=" + s + " is not one of auto, tcp, cma, shm");
  }
  return ForcedTransport::kAuto;
}

namespace {

template <typename T>
void put(std::vector<uint8_t>& b, T v) {
  const uint8_t* p = reinterpret_cast<const uint8_t*>(&v);
  b.insert(b.end(), p, p + sizeof(T));
}

void put_str(std::vector<uint8_t>& b, const std::string& s) {
  put<uint32_t>(b, static_cast<uint32_t>(s.size()));
  b.insert(b.end(), s.begin(), s.end());
}

struct Reader {
  const std::vector<uint8_t>& b;
  size_t off = 0;
  bool ok = true;
  template <typename T>
  T get() {
    T v{};
    if (off + sizeof(T) > b.size()) {
      ok = false;
      return v;
    }
    std::memcpy(&v, b.data() + off, sizeof(T));
    off += sizeof(T);
    return v;
  }
  std::string str() {
    uint32_t n = get<uint32_t>();
    if (!ok || n > 4096 || off + n > b.size()) {
      ok = false;
      return {};
    }
    std::string s(b.begin() + off, b.begin() + off + n);
    off += n;
    return s;
  }
};

}  // namespace

std::vector<uint8_t> WindowDesc::encode() const {
  std::vector<uint8_t> b;
  put<uint32_t>(b, static_cast<uint32_t>(kind));
  put<uint64_t>(b, size);
  put<uint64_t>(b, addr);
  put<int32_t>(b, pid);
  put_str(b, host);
  put_str(b, shm_name);
  return b;
}

bool WindowDesc::decode(const std::vector<uint8_t>& b, WindowDesc* out) {
  Reader r{b};
  uint32_t kind = r.get<uint32_t>();
  out->size = r.get<uint64_t>();
  out->addr = r.get<uint64_t>();
  out->pid = r.get<int32_t>();
  out->host = r.str();
  out->shm_name = r.str();
  if (kind < 1 || kind > 3) return false;
  out->kind = static_cast<WindowKind>(kind);
  return r.ok && r.off == b.size();
}

std::string Window::mode() const {
  // How this rank reaches the other ranks' copies: the most common path.
  int count[4] = {0, 0, 0, 0};
  for (const PeerView& v : peers) ++count[static_cast<int>(v.path)];
  Path best = Path::kSelf;
  int most = 0;
  for (Path p : {Path::kShm, Path::kCma, Path::kTcp}) {
    if (count[static_cast<int>(p)] > most) {
      best = p;
      most = count[static_cast<int>(p)];
    }
  }
  return path_name(best);
}

std::string Window::describe() const {
  std::string s = "window #" + std::to_string(index) + " (" + kind_name(kind) + ", " +
                  std::to_string(size) + " bytes, mode " + mode() + "): ";
  for (size_t r = 0; r < peers.size(); ++r) {
    s += (r ? ", " : "") + std::string("peer ") + std::to_string(r) + " " + path_name(peers[r].path);
    if (!peers[r].why.empty()) s += " (" + peers[r].why + ")";
  }
  return s;
}

}  // namespace fxm
