// The bytes agents exchange: region descriptors and agent metadata.
// Little-endian, versioned by a magic of their own; decode refuses anything
// malformed (a short buffer, trailing bytes, a name too long).
#include <cstring>

#include "agent/agent.h"
#include "base/bytes.h"
#include "base/status.h"

namespace fxm::agent {
namespace {

constexpr uint32_t kRegionMagic = 0x52415846;    // "FXAR"
constexpr uint32_t kMetadataMagic = 0x4d415846;  // "FXAM"

// Fails the decode of `what` with the reader's first problem, if any.
void check(const bytes::Reader& r, const char* what) {
  if (!r.ok()) fail(Code::kInvalidArgument, -1, 0, std::string(what) + ": " + r.error);
}

// Reads the leading magic of `what`: a short buffer, or another magic (then
// "<what>: <wrong> (bad magic)"), fails the decode.
void expect_magic(bytes::Reader& r, uint32_t magic, const char* what, const char* wrong) {
  uint32_t got = r.get<uint32_t>();
  check(r, what);
  if (got != magic) fail(Code::kInvalidArgument, -1, 0, std::string(what) + ": " + wrong + " (bad magic)");
}

}  // namespace

std::string incarnation_hex(const Incarnation& i) { return wire::mesh_id_hex(i).substr(0, 12); }

void check_notification_size(size_t n, const std::string& what) {
  if (n <= kMaxNotificationBytes) return;
  fail(Code::kInvalidArgument, -1, 0,
       what + ": a notification of " + std::to_string(n) + " bytes exceeds the limit of " +
           std::to_string(kMaxNotificationBytes) + " bytes (64 MiB): send bulk data with a write");
}

uint64_t AgentStats::total_rejected() const {
  uint64_t n = 0;
  for (uint64_t v : rejected) n += v;
  return n;
}

std::vector<std::pair<std::string, uint64_t>> AgentStats::counters() const {
  return {{"accepted", accepted},
          {"connected", connected},
          {"accept_fd_exhausted", accept_fd_exhausted},
          {"get_answer_bytes_held", answer_bytes_held},
          {"get_answer_bytes_peak", answer_bytes_peak},
          {"notification_drains", notification_drains},
          {"waiter_reads", waiter_reads},
          {"progress_late_wakes", late_wakes}};
}

std::vector<std::pair<std::string, uint64_t>> AgentStats::rejections() const {
  std::vector<std::pair<std::string, uint64_t>> out;
  for (size_t i = 0; i < rejected.size(); ++i) {
    if (rejected[i]) out.emplace_back(wire::reject_name(static_cast<wire::Reject>(i)), rejected[i]);
  }
  return out;
}

std::vector<uint8_t> RegionDesc::encode() const {
  bytes::Writer w;
  w.put<uint32_t>(kRegionMagic);
  w.str(agent);
  w.raw(incarnation.data(), incarnation.size());
  w.put<uint32_t>(index);
  w.put<uint64_t>(size);
  w.put<uint32_t>(static_cast<uint32_t>(kind));
  w.put<uint32_t>(static_cast<uint32_t>(window.size()));
  w.raw(window.data(), window.size());
  return std::move(w.b);
}

RegionDesc RegionDesc::decode(const std::vector<uint8_t>& b) {
  bytes::Reader r{b};
  expect_magic(r, kRegionMagic, "region descriptor", "not a region descriptor");
  RegionDesc d;
  d.agent = r.str(kMaxAgentName);
  r.raw(d.incarnation.data(), d.incarnation.size());
  d.index = r.get<uint32_t>();
  d.size = r.get<uint64_t>();
  uint32_t kind = r.get<uint32_t>();
  d.window = r.blob(r.get<uint32_t>());
  r.at_end();
  check(r, "region descriptor");
  WindowDesc wd;
  if (kind < 1 || kind > 4 || !WindowDesc::decode(d.window, &wd) || wd.size != d.size ||
      static_cast<uint32_t>(wd.kind) != kind) {
    fail(Code::kInvalidArgument, -1, 0, "region descriptor of agent " + d.agent + ": malformed window description");
  }
  d.kind = static_cast<WindowKind>(kind);
  return d;
}

namespace {

// FNV-1a over the metadata's bytes before its checksum: metadata travels by any channel, and a
// changed byte must read as corrupt, never as another incarnation, name or address.
uint32_t metadata_checksum(const uint8_t* p, size_t n) {
  uint32_t h = 2166136261u;
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 16777619u;
  return h;
}

}  // namespace

std::vector<uint8_t> Metadata::encode() const {
  bytes::Writer w;
  w.put<uint32_t>(kMetadataMagic);
  w.str(name);
  w.raw(incarnation.data(), incarnation.size());
  uint8_t a[tcp::kWireAddrSize];
  tcp::addr_to_wire(address, a);
  w.raw(a, sizeof(a));
  w.put<uint32_t>(metadata_checksum(w.b.data(), w.b.size()));
  return std::move(w.b);
}

Metadata Metadata::decode(const std::vector<uint8_t>& b) {
  bytes::Reader r{b};
  expect_magic(r, kMetadataMagic, "agent metadata", "not agent metadata");
  uint32_t sum = 0;
  if (b.size() >= 8) std::memcpy(&sum, b.data() + b.size() - 4, 4);
  if (b.size() < 8 || sum != metadata_checksum(b.data(), b.size() - 4)) {
    fail(Code::kInvalidArgument, -1, 0, "agent metadata is corrupt: its checksum does not match its " +
                                            std::to_string(b.size()) + " bytes (they changed on the way)");
  }
  Metadata m;
  m.name = r.str(kMaxAgentName);
  r.raw(m.incarnation.data(), m.incarnation.size());
  uint8_t a[tcp::kWireAddrSize];
  r.raw(a, sizeof(a));
  r.get<uint32_t>();  // the checksum, checked above
  r.at_end();
  check(r, "agent metadata");
  if (!tcp::addr_from_wire(a, &m.address)) fail(Code::kInvalidArgument, -1, 0, "agent metadata of " + m.name + ": malformed address");
  return m;
}

}  // namespace fxm::agent
