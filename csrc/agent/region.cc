// The bytes agents exchange: region descriptors and agent metadata.
// Little-endian, versioned by a magic of their own; decode refuses anything
// malformed (a short buffer, trailing bytes, a name too long).
#include <cstring>

#include "agent/agent.h"
#include "base/status.h"

namespace fxm::agent {
namespace {

constexpr uint32_t kRegionMagic = 0x52415846;    // "FXAR"
constexpr uint32_t kMetadataMagic = 0x4d415846;  // "FXAM"
constexpr size_t kMaxName = 200;

struct Writer {
  std::vector<uint8_t> b;
  template <typename T>
  void put(T v) {
    const uint8_t* p = reinterpret_cast<const uint8_t*>(&v);
    b.insert(b.end(), p, p + sizeof(T));
  }
  void bytes(const void* p, size_t n) { b.insert(b.end(), static_cast<const uint8_t*>(p), static_cast<const uint8_t*>(p) + n); }
  void str(const std::string& s) {
    put<uint32_t>(static_cast<uint32_t>(s.size()));
    bytes(s.data(), s.size());
  }
};

struct Reader {
  const std::vector<uint8_t>& b;
  const char* what;
  size_t off = 0;
  void need(size_t n) const {
    if (n > b.size() - off) fail(Code::kInvalidArgument, -1, 0, std::string(what) + ": truncated (" + std::to_string(b.size()) + " bytes)");
  }
  template <typename T>
  T get() {
    need(sizeof(T));
    T v;
    std::memcpy(&v, b.data() + off, sizeof(T));
    off += sizeof(T);
    return v;
  }
  void bytes(void* p, size_t n) {
    need(n);
    std::memcpy(p, b.data() + off, n);
    off += n;
  }
  std::string str(size_t max) {
    uint32_t n = get<uint32_t>();
    if (n > max) fail(Code::kInvalidArgument, -1, 0, std::string(what) + ": a field of " + std::to_string(n) + " bytes (at most " + std::to_string(max) + ")");
    std::string s(n, '\0');
    bytes(s.data(), n);
    return s;
  }
  void end() const {
    if (off != b.size()) fail(Code::kInvalidArgument, -1, 0, std::string(what) + ": " + std::to_string(b.size() - off) + " trailing bytes");
  }
};

}  // namespace

std::string incarnation_hex(const Incarnation& i) { return wire::mesh_id_hex(i).substr(0, 12); }

uint64_t AgentStats::total_rejected() const {
  uint64_t n = 0;
  for (uint64_t v : rejected) n += v;
  return n;
}

std::vector<uint8_t> RegionDesc::encode() const {
  Writer w;
  w.put<uint32_t>(kRegionMagic);
  w.str(agent);
  w.bytes(incarnation.data(), incarnation.size());
  w.put<uint32_t>(index);
  w.put<uint64_t>(size);
  w.put<uint32_t>(static_cast<uint32_t>(kind));
  w.put<uint32_t>(static_cast<uint32_t>(window.size()));
  w.bytes(window.data(), window.size());
  return w.b;
}

RegionDesc RegionDesc::decode(const std::vector<uint8_t>& bytes) {
  Reader r{bytes, "region descriptor"};
  if (r.get<uint32_t>() != kRegionMagic) fail(Code::kInvalidArgument, -1, 0, "region descriptor: not a region descriptor (bad magic)");
  RegionDesc d;
  d.agent = r.str(kMaxName);
  r.bytes(d.incarnation.data(), d.incarnation.size());
  d.index = r.get<uint32_t>();
  d.size = r.get<uint64_t>();
  uint32_t kind = r.get<uint32_t>();
  uint32_t n = r.get<uint32_t>();
  r.need(n);
  d.window.assign(bytes.begin() + r.off, bytes.begin() + r.off + n);
  r.off += n;
  r.end();
  WindowDesc wd;
  if (kind < 1 || kind > 4 || !WindowDesc::decode(d.window, &wd) || wd.size != d.size ||
      static_cast<uint32_t>(wd.kind) != kind) {
    fail(Code::kInvalidArgument, -1, 0, "region descriptor of agent " + d.agent + ": malformed window description");
  }
  d.kind = static_cast<WindowKind>(kind);
  return d;
}

std::vector<uint8_t> Metadata::encode() const {
  Writer w;
  w.put<uint32_t>(kMetadataMagic);
  w.str(name);
  w.bytes(incarnation.data(), incarnation.size());
  uint8_t a[tcp::kWireAddrSize];
  tcp::addr_to_wire(address, a);
  w.bytes(a, sizeof(a));
  return w.b;
}

Metadata Metadata::decode(const std::vector<uint8_t>& bytes) {
  Reader r{bytes, "agent metadata"};
  if (r.get<uint32_t>() != kMetadataMagic) fail(Code::kInvalidArgument, -1, 0, "agent metadata: not agent metadata (bad magic)");
  Metadata m;
  m.name = r.str(kMaxName);
  r.bytes(m.incarnation.data(), m.incarnation.size());
  uint8_t a[tcp::kWireAddrSize];
  r.bytes(a, sizeof(a));
  r.end();
  if (!tcp::addr_from_wire(a, &m.address)) fail(Code::kInvalidArgument, -1, 0, "agent metadata of " + m.name + ": malformed address");
  return m;
}

}  // namespace fxm::agent
