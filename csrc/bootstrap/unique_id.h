// The unique id: 256 opaque bytes made by one process (which then hosts the
// rendezvous root) and carried to every rank by any channel.
// Layout (version 2): magic "FXMU" 0, version 4, root address 8 (20 bytes),
// mesh id 28 (16 bytes), checksum 44 (FNV-1a over every other byte), epoch 48,
// secret key 52 (32 bytes); the rest is zero. The key never goes on the wire:
// joins and connections prove they hold it (docs/security.md).
#pragma once

#include <array>
#include <cstdint>

#include "base/wire.h"
#include "transport/tcp/socket.h"

namespace fxm::bootstrap {

constexpr size_t kUniqueIdSize = 256;
using UniqueIdBytes = std::array<uint8_t, kUniqueIdSize>;

struct UniqueId {
  tcp::SockAddr root;
  wire::MeshId mesh_id{};
  uint32_t epoch = 0;
  crypto::Key secret{};
  // The key every handshake of this mesh uses (wire::derive_key).
  crypto::Key key() const { return wire::derive_key(secret, mesh_id, epoch); }
  crypto::Key key_for(uint32_t e) const { return wire::derive_key(secret, mesh_id, e); }
};

UniqueIdBytes encode_unique_id(const UniqueId& id);
// Throws Error(kInvalidArgument) saying what is wrong with the bytes.
UniqueId decode_unique_id(const uint8_t* bytes, size_t len);

// Makes a fresh random mesh id and secret key for `epoch`, starts the
// rendezvous root in this process (listening on an ephemeral port of the
// chosen interface) and returns the id.
UniqueIdBytes get_unique_id(uint32_t epoch = 0);

// Ends the root of an id this process made, when no rank has joined it: its
// thread ends and its port closes before this returns true. False when the id
// is not one of this process's live roots or a rank has joined it (that root
// lives on as usual). Throws Error(kInvalidArgument) for malformed bytes.
bool release_unique_id(const uint8_t* bytes, size_t len);

// 16 random bytes from the kernel.
wire::MeshId random_mesh_id();

}  // namespace fxm::bootstrap
