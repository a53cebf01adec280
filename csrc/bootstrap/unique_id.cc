#include "bootstrap/unique_id.h"

#include <cstring>

#include "base/env.h"
#include "bootstrap/root.h"
#include "bootstrap/root_release.h"
#include "base/status.h"

namespace fxm::bootstrap {
namespace {

constexpr uint32_t kIdMagic = 0x554d5846;  // "FXMU"
constexpr uint16_t kIdVersion = 2;
constexpr size_t kChecksumOffset = 44;

constexpr size_t kEpochOffset = 48;
constexpr size_t kSecretOffset = 52;

// FNV-1a over every byte but the checksum's own four.
uint32_t checksum(const uint8_t* p) {
  uint32_t h = 2166136261u;
  for (size_t i = 0; i < kUniqueIdSize; ++i) {
    if (i < kChecksumOffset || i >= kChecksumOffset + 4) h = (h ^ p[i]) * 16777619u;
  }
  return h;
}

}  // namespace

wire::MeshId random_mesh_id() {
  wire::MeshId id{};
  crypto::random_bytes(id.data(), id.size());
  return id;
}

UniqueIdBytes encode_unique_id(const UniqueId& id) {
  UniqueIdBytes b{};
  std::memcpy(b.data(), &kIdMagic, 4);
  std::memcpy(b.data() + 4, &kIdVersion, 2);
  tcp::addr_to_wire(id.root, b.data() + 8);
  std::memcpy(b.data() + 28, id.mesh_id.data(), 16);
  std::memcpy(b.data() + kEpochOffset, &id.epoch, 4);
  std::memcpy(b.data() + kSecretOffset, id.secret.data(), id.secret.size());
  uint32_t sum = checksum(b.data());
  std::memcpy(b.data() + kChecksumOffset, &sum, 4);
  return b;
}

UniqueId decode_unique_id(const uint8_t* b, size_t len) {
  if (len != kUniqueIdSize) {
    fail(Code::kInvalidArgument, -1, 0,
         "unique id must be " + std::to_string(kUniqueIdSize) + " bytes, got " + std::to_string(len));
  }
  uint32_t magic, sum;
  uint16_t version;
  std::memcpy(&magic, b, 4);
  std::memcpy(&version, b + 4, 2);
  std::memcpy(&sum, b + kChecksumOffset, 4);
  if (magic != kIdMagic) fail(Code::kInvalidArgument, -1, 0, "not a flagcx_mesh unique id (bad magic)");
  if (version != kIdVersion) {
    fail(Code::kInvalidArgument, -1, 0, "unique id version " + std::to_string(version) +
                                            " is not supported (this library speaks " +
                                            std::to_string(kIdVersion) + ")");
  }
  if (sum != checksum(b)) fail(Code::kInvalidArgument, -1, 0, "unique id is corrupted (checksum mismatch)");
  UniqueId id;
  if (!tcp::addr_from_wire(b + 8, &id.root)) {
    fail(Code::kInvalidArgument, -1, 0, "unique id holds an unknown address family");
  }
  std::memcpy(id.mesh_id.data(), b + 28, 16);
  std::memcpy(&id.epoch, b + kEpochOffset, 4);
  std::memcpy(id.secret.data(), b + kSecretOffset, id.secret.size());
  return id;
}

UniqueIdBytes get_unique_id(uint32_t epoch) {
  root_idle_timeout_s();  // a malformed FLAGCX_MESH_ROOT_IDLE_TIMEOUT is refused here
  UniqueId id;
  id.mesh_id = random_mesh_id();
  id.epoch = epoch;
  crypto::random_bytes(id.secret.data(), id.secret.size());
  int err = 0;
  tcp::Fd listener = tcp::listen_on(tcp::local_address(), &id.root, &err);
  if (!listener) {
    fail(Code::kSystem, -1, err, "get_unique_id: listen on " + tcp::local_address().str());
  }
  start_root(std::move(listener), id);
  return encode_unique_id(id);
}

bool release_unique_id(const uint8_t* bytes, size_t len) {
  return release_root(decode_unique_id(bytes, len).mesh_id);
}

}  // namespace fxm::bootstrap
