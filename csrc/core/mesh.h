// A built full mesh of TCP connections between nranks processes.
//
// Construction is collective: every rank calls Mesh(nranks, unique_id, rank)
// and the call returns once all connections exist, their identity has been
// checked over the wire, and every rank has reached the same point; or it
// throws Error on every rank, naming what is missing. Methods are safe to call
// from several threads; operations on one (peer, context) are serialised.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <vector>

#include "bootstrap/client.h"
#include "bootstrap/unique_id.h"
#include "core/mesh_builder.h"
#include "core/onesided.h"
#include "core/progress.h"
#include "core/window.h"

namespace fxm {

struct MeshOptions {
  int contexts = 1;
  double timeout_s = 0;           // whole build; 0: FLAGCX_MESH_TIMEOUT (default 60)
  double header_timeout_s = 5.0;  // per accepted connection
  int max_inflight = 64;          // outgoing connects in flight
  int64_t epoch = -1;  // the unique id's when negative; another is refused by the root
  uint64_t max_unreceived = 1ull << 30;  // per (peer, ctx) mailbox, see Engine
  // Called after each phase ("listen", "rendezvous", "connect", "wiring");
  // a hook for tests and tracing. May throw to abort the build.
  std::function<void(const std::string&)> on_phase;
};

struct PhaseTimes {
  double listen = 0, rendezvous = 0, connect = 0, wiring = 0, total = 0;  // seconds
};

class Mesh {
 public:
  Mesh(int nranks, const uint8_t* unique_id, size_t unique_id_len, int rank,
       const MeshOptions& options);
  ~Mesh();
  Mesh(const Mesh&) = delete;
  Mesh& operator=(const Mesh&) = delete;

  int rank() const { return rank_; }
  int nranks() const { return nranks_; }
  int contexts() const { return contexts_; }
  int tcp_lanes() const { return lanes_; }  // connections per (peer, context) (FLAGCX_MESH_TCP_LANES)
  // Diagnostics (tests pick one lane's socket by it): the local port of this rank's send
  // connection to (peer, ctx) on each lane, lane 0 first.
  std::vector<int> tcp_lane_ports(int peer, int ctx) const;
  const PhaseTimes& times() const { return times_; }
  const BuildStats& stats() const { return stats_; }
  Engine::ParkCounts park_counts() const { return engine_ ? engine_->park_counts() : Engine::ParkCounts{0, 0}; }
  Engine::AdmitCounts admit_counts() const { return engine_ ? engine_->admit_counts() : Engine::AdmitCounts{0, 0}; }
  Engine::AnswerCounts answer_counts() const { return engine_ ? engine_->answer_counts() : Engine::AnswerCounts{0, 0}; }
  std::string mesh_id_hex() const { return wire::mesh_id_hex(mesh_id_); }
  std::string describe() const;
  bool closed() const { return closed_.load(); }

  // Two-sided messages on the (peer, ctx) connections. send() copies the
  // message into the progress engine's queue and returns (waiting up to
  // timeout_s only while too many bytes are already queued for that pair);
  // recv() waits up to timeout_s for the next message. Every timeout_s of
  // an operation: 0 is the mesh's timeout, +inf no limit (deadline_for).
  void send(int peer, const void* data, size_t len, int ctx, double timeout_s);
  std::vector<uint8_t> recv(int peer, int ctx, double timeout_s);

  // One-sided windows and operations (see onesided.h). Registration and
  // deregistration are collective.
  uint32_t register_window(void* base, uint64_t size);
  uint32_t alloc_window(uint64_t size);
  uint32_t signal_window(uint64_t nslots);
  uint32_t register_device_window(void* base, uint64_t size);  // CUDA device memory
  uint32_t alloc_device_window(uint64_t size, int device);
  // Takes part in a registration this rank cannot provide: every rank fails, naming it.
  [[noreturn]] void refuse_registration(const std::string& reason);
  void deregister(uint32_t index);
  std::shared_ptr<Window> window(uint32_t index);
  void put(const PutArgs& a);
  void batch_put(const std::vector<PutArgs>& ops);  // all validated before any is issued
  void get(const PutArgs& a);
  uint64_t read_signal(uint32_t win, uint64_t slot);
  void wait_signal(uint32_t win, uint64_t slot, uint64_t expected, double timeout_s);
  void wait_signal_on_stream(uint32_t win, uint64_t slot, uint64_t expected, void* stream, double timeout_s);
  void flush(int peer, double timeout_s);  // peer -1: all peers
  uint64_t read_counter();
  void wait_counter(uint64_t value, double timeout_s);

  // Collectives over the bootstrap root.
  bootstrap::Parts allgather(const std::vector<uint8_t>& mine, double timeout_s);
  void barrier(double timeout_s);
  // A collective taking part as `call` (kind and window index): for tests that
  // forge what a peer publishes.
  bootstrap::Parts collective(const std::vector<uint8_t>& mine, double timeout_s, const bootstrap::Call& call);

  // Closes every connection and leaves the bootstrap. Idempotent; operations
  // blocked in other threads return with Error(kClosed).
  void close();

 private:
  void build(const bootstrap::UniqueId& id, const MeshOptions& opt, const Deadline& deadline);
  std::vector<tcp::SockAddr> rendezvous(const bootstrap::UniqueId& id, const Deadline& deadline);
  void wiring_check(const Deadline& deadline);
  // The builder's connections (peer-major, ncontexts * lanes_ wire contexts) in the engine's
  // order: connection lane * (nranks * contexts) + peer * contexts + ctx (lane 0 first).
  Connections lanes_in_engine_order(Connections built) const;
  void wait_readable(int fd, int peer, const Deadline& deadline, const char* doing);
  void check_peer(int peer, int ctx, const char* op) const;
  void check_open(const char* op) const;
  [[noreturn]] void fail_io(const tcp::IoResult& r, int peer, int ctx, const char* doing) const;
  [[noreturn]] void fail_build_io(const tcp::IoResult& r, int peer, int ctx, const char* doing,
                                  const Deadline& deadline);
  std::string who() const { return "rank " + std::to_string(rank_) + ": "; }
  Deadline deadline_for(double timeout_s, const std::string& call) const;
  void keep_for_streams();

  int nranks_;
  int rank_;
  int contexts_;
  int lanes_ = 1;  // tcp connections per (peer, context): the smallest FLAGCX_MESH_TCP_LANES of all ranks
  uint32_t epoch_ = 0;
  wire::MeshId mesh_id_{};
  crypto::Key key_{};  // this epoch's key (wire::derive_key): proves every connection
  tcp::SockAddr listen_addr_;
  PhaseTimes times_;
  BuildStats stats_;
  std::unique_ptr<bootstrap::Client> boot_;
  double timeout_s_ = 60;  // collectives after the build (registration)
  Connections conns_;
  WindowTable windows_;
  std::unique_ptr<Engine> engine_;
  Engine* kept_engine_ = nullptr;  // never destroyed: CUDA streams may still report to it
  std::unique_ptr<OneSided> onesided_;
  std::shared_timed_mutex life_mu_;  // shared by operations, exclusive by close()
  std::atomic<bool> closed_{false};
};

}  // namespace fxm
