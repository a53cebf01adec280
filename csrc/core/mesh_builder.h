// Builds the full mesh of one rank: for every (peer, context), self included,
// a send connection (this rank connects to the peer's listener) and a receive
// connection (the peer connects to this rank's listener).
//
// Every connection opens with a wire::ConnHeader naming the mesh, epoch,
// source, destination and context; the acceptor validates it and answers with
// its own. Incoming connections are filed by that identity, never by arrival
// order; foreign or malformed ones are closed and counted. Outgoing connects
// go in ordered pairwise rounds (peer = rank+i) only to bound how many are in
// flight. Everything runs in one poll() loop with deadlines, which also
// watches the bootstrap for failure notices from other ranks.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "base/clock.h"
#include "base/wire.h"
#include "transport/tcp/socket.h"

namespace fxm {

struct BuildStats {
  std::array<uint64_t, static_cast<size_t>(wire::Reject::kCount)> rejected{};
  uint64_t connect_retries = 0;
  uint64_t accept_fd_exhausted = 0;  // accepts that failed for want of descriptors (EMFILE, ENFILE, ...)
  uint64_t total_rejected() const;
};

struct BuildPlan {
  int rank = 0;
  int nranks = 0;
  int ncontexts = 1;
  wire::MeshId mesh_id{};
  uint32_t epoch = 0;
  crypto::Key key{};                 // the epoch's key: each connection proves it, both ways
  std::vector<tcp::SockAddr> peers;  // listening address of every rank
  int listen_fd = -1;
  int bootstrap_fd = -1;             // polled; readable means a failure notice
  std::function<void()> on_bootstrap_readable;  // must throw
  Deadline deadline;
  double header_timeout_s = 5.0;
  int max_inflight = 64;
};

// Connections indexed [peer * ncontexts + context].
struct Connections {
  std::vector<tcp::Fd> send;
  std::vector<tcp::Fd> recv;
};

// Runs the build loop; throws Error (kTimeout listing the missing
// (peer, context) pairs, kPeerLost, kProtocol) on failure.
Connections build_mesh(const BuildPlan& plan, BuildStats* stats);

}  // namespace fxm
