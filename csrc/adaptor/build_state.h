// State shared by the builders: the listener, the peers' handles, the comms
// opened so far (closed again unless the build succeeds), the memory
// registrations (deregistered before their comm is closed), the deadline and
// its watchdog over the bootstrap, and checked calls into the adaptor and the
// bootstrap that turn a non-zero return into an Error naming the call, the
// peer, the round and the rank. The adaptor and bootstrap structs are copied
// in this version's layout (older layouts upgraded by build.cc).
// Owned by one build on one thread (the watchdog has its own).
#pragma once

#include <cstdint>
#include <deque>
#include <string>
#include <vector>

#include "adaptor/builder.h"
#include "adaptor/watchdog.h"
#include "base/clock.h"
#include "base/status.h"
#include "base/wire.h"

namespace fxm::adaptor {

const char* builder_name(int builder);

class Build {
 public:
  // net and boot: validated structs of any accepted layout.
  Build(const NetAdaptor& net, const BootOps& boot, const BuildConfig& config);
  ~Build();  // closes whatever was not handed out
  Build(const Build&) = delete;
  Build& operator=(const Build&) = delete;

  // listen(), then allgather {handle, nonce, key share}; build_id() is rank
  // 0's nonce, build_key() a hash of every rank's random key share.
  void listen_and_gather();
  // One step of connect to `peer` (no-op once done); true when done.
  bool step_connect(int peer, int round);
  // One accept; the comm taken (or NULL) is returned and owned by the Build
  // until filed with file_recv() or dropped with drop_recv().
  void* step_accept(int round);
  void file_recv(int slot, void* comm);
  void drop_recv(void* comm);
  // Zeroed bytes that live as long as the Build, i.e. until after every comm
  // it still holds is closed: buffers of posted isend/irecv requests must
  // outlive the comms when a build fails half-way.
  uint8_t* buffer(size_t bytes);
  // Registers [data, data + size) on comm when the adaptor has reg_mr (else
  // NULL); deregistered before comm is closed.
  void* reg(void* comm, void* data, size_t size, int peer, const std::string& step);
  // isend/irecv with checked results: the request, or NULL for "not yet,
  // call again with the same arguments" (IB's contract).
  void* isend(void* comm, const void* data, size_t size, void* mhandle, int peer, const std::string& step);
  void* irecv(void* comm, void* data, size_t size, void* mhandle, int peer, const std::string& step);
  bool test(void* request, int peer, const std::string& step);
  // Bootstrap point-to-point, bounded by the build deadline.
  void boot_send(int peer, int tag, const void* data, size_t size, int round);
  void boot_recv(int peer, int tag, void* data, size_t size, int round);
  // Throws kTimeout with `what` once the deadline passed.
  void check_deadline(const std::string& what, int peer) const;
  // Hands the comms to the caller's arrays; closes the listener and any
  // connection accepted but never filed.
  void finish(void** send_comms, void** recv_comms);

  [[noreturn]] void fail_at(Code code, int peer, const std::string& what) const;
  std::string who() const;  // "rank 3 (ordered build)"
  bool carries_bytes() const { return net_.isend != nullptr; }
  const NetAdaptor& net() const { return net_; }
  int rank() const { return rank_; }
  int nranks() const { return n_; }
  uint64_t build_id() const { return build_id_; }
  const crypto::Key& build_key() const { return build_key_; }
  int tag(int round) const { return config_.tag_base + round; }
  const BuildConfig& config() const { return config_; }
  void* send_comm(int peer) const { return send_[peer]; }
  void* recv_comm(int peer) const { return recv_[peer]; }
  const Deadline& deadline() const { return deadline_; }

 private:
  void check_call(int rc, const char* call, int peer, int round) const;
  double seconds_left() const;  // of the build's deadline, at least 1 ms
  [[noreturn]] void boot_failed(int rc, int peer, const std::string& what) const;
  void close_all();
  void close_recv_comm(void* comm);
  void release_mrs(void* comm);  // deregisters what was registered on comm
  template <class F>
  int boot_call(F&& call);

  NetAdaptor net_;  // this layout; isend/irecv of a V1 adaptor are called as V1
  bool io_v1_;
  BootOps boot_;
  BuildConfig config_;
  int rank_, n_;
  double timeout_s_;
  Deadline deadline_;
  uint64_t build_id_ = 0;
  crypto::Key build_key_{};
  void* listen_ = nullptr;
  std::vector<std::vector<uint8_t>> handles_;  // writable copies, one per peer
  std::vector<void*> send_, recv_;
  std::vector<void*> unfiled_;  // accepted, not yet filed
  std::vector<std::pair<void*, void*>> mrs_;  // (comm, mhandle)
  std::deque<std::vector<uint8_t>> buffers_;  // see buffer(); freed after ~Build closed every comm
  Watchdog watchdog_;  // last: stopped first, before anything it might use goes
};

// Polite spinning for state machines that returned "in progress":
// sched_yield first, then short sleeps.
void backoff(int* spins);

// The identity record sent over new connections (the tagged header and the
// wiring check) is the project's one connection header, wire::ConnHeader,
// with the build id in the first 8 bytes of its mesh id, followed by an
// HMAC-SHA256 of it under the build key. The adaptor's comms carry bytes one
// way only, so this cannot be a challenge-response: the key is fresh per build
// and known only to the ranks that took part in the bootstrap allgather
// (docs/security.md says what that does and does not stop).
constexpr size_t kIdentitySize = wire::kConnHeaderSize + wire::kMacSize;
void encode_identity(uint64_t build_id, const crypto::Key& key, int src, int dst, int nranks,
                     uint8_t out[kIdentitySize]);
// "" when `in` is a header of build `build_id` from a rank of nranks to `me`
// with a valid MAC; else why not (a wire::reject_name).
std::string decode_identity(const uint8_t in[kIdentitySize], uint64_t build_id, const crypto::Key& key, int me,
                            int nranks, wire::ConnHeader* out);

// This layout's copies of validated structs of an accepted (older) layout:
// fields the caller's layout lacks are NULL.
NetAdaptor upgrade_adaptor(const NetAdaptor& net);
BootOps upgrade_boot(const BootOps& boot);

// Sends one message and waits for it (posting again while the adaptor says
// "call again"); and the same for a batch over several comms. Registered
// through Build::reg. Used by the tagged build and the wiring check.
struct Transfer {
  void* comm = nullptr;
  uint8_t* data = nullptr;  // from Build::buffer()
  size_t size = 0;
  bool send = false;
  int peer = -1;            // for messages; -1 unknown (an accepted comm)
  void* mhandle = nullptr;
  void* request = nullptr;
  bool done = false;
  // One step: post if not posted, else test. True when something moved.
  bool step(Build& b, const std::string& what);
};

// The builders (build.cc validates and dispatches).
void build_legacy(Build& b);
void build_ordered(Build& b);
void build_tagged(Build& b);
// Over each send comm tell the peer who we are; over each recv comm check it
// is the slot's peer. kProtocol "miswired: ..." on a mismatch.
void wiring_check(Build& b);

}  // namespace fxm::adaptor
