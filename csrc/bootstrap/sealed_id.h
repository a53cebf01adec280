// Handing a unique id to the ranks of a mesh they already share, without its
// secret in clear: the id is sealed under a key derived from the shared mesh's
// secret (an HMAC-SHA256 keystream with a fresh nonce, then an HMAC tag over
// nonce and ciphertext) and sent through the mesh's bootstrap. Used by the
// selftest and the mesh benchmark, which build mesh after mesh.
#pragma once

#include <cstdint>
#include <vector>

#include "bootstrap/unique_id.h"

namespace fxm::bootstrap {

// nonce (16) | ciphertext (kUniqueIdSize) | tag (32).
std::vector<uint8_t> seal_unique_id(const UniqueId& shared, const UniqueIdBytes& next);
// Throws Error(kProtocol) when the tag does not check (not sealed by a holder of `shared`).
UniqueIdBytes unseal_unique_id(const UniqueId& shared, const std::vector<uint8_t>& sealed);

}  // namespace fxm::bootstrap
