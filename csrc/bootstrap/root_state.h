// The rendezvous root's state and its steps (bootstrap/root.h says what it
// does): root.cc runs the loop and the collectives, root_join.cc the join
// handshake. Internal to the bootstrap layer.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "base/env.h"
#include "base/fd_shortage.h"
#include "bootstrap/exit_wait.h"
#include "bootstrap/proto.h"
#include "bootstrap/root_release.h"
#include "bootstrap/unique_id.h"

namespace fxm::bootstrap::root_impl {

constexpr double kJoinHeaderTimeoutS = 5.0;
constexpr double kWriteTimeoutS = 10.0;      // to read a message a client has begun
constexpr double kDrainTimeoutS = 1.0;       // for queued output when the root exits
constexpr size_t kMaxQueuedBytes = 1ull << 30;  // output queued for a client that does not read
// Connections that have not proved the key yet: beyond this many, the one
// that made the least progress (no valid hello) is closed to make room.
constexpr size_t kMaxPending = 256;
constexpr int kAcceptBatch = 64;  // per poll round: each is read before a flood can push it out
// The listener stays open until the ranks' second collective after every rank
// joined (a Mesh's build ends with its second, the final barrier), so that a
// second process started as an already joined rank is still heard.
constexpr uint32_t kListenCollectives = 2;
constexpr uint32_t kMaxRanks = 1u << 20;
constexpr size_t kMaxHeld = 4096;  // relayed messages waiting for a rank to join
constexpr size_t kMaxHeldBytes = 64u << 20;  // and their bytes, per rank

// A connection that has not yet proved the key (proto.h, the join handshake).
struct Pending {
  tcp::Fd fd;
  Deadline deadline;
  std::vector<uint8_t> buf;
  bool challenged = false;  // its hello was read and answered: a kJoin is due
  Msg hello;                // as received: the MACs cover it
  HelloInfo info;
  Nonce nonce{};            // the root's
};

// What became of a pending connection.
enum class Step { kWait, kDone, kSilent, kClosed, kGarbage, kForeign, kBadAuth, kOverflow, kCount };

struct Client {
  tcp::Fd fd;
  bool joined = false;
  bool gone = false;  // said BYE or was lost
  bool contributed = false;
  bool refused = false;  // its part was too large: `part` holds why
  std::vector<uint8_t> part;
  Call call;  // what the rank called (proto.h): every rank's must match
  std::vector<Msg> held;  // relayed to this rank before it joined
  size_t held_bytes = 0;
  std::vector<uint8_t> out;  // queued output: the root never blocks writing
  size_t out_off = 0;        // bytes of `out` already written
  size_t queued() const { return out.size() - out_off; }
};

class Root {
 public:
  Root(tcp::Fd listener, const UniqueId& id)
      : listener_(std::move(listener)), id_(id), life_(track_root(wire::mesh_id_hex(id.mesh_id).substr(0, 8))),
        release_(register_root(id.mesh_id)) {}
  void run();

 private:
  bool release_requested();
  void end_release(bool released);
  bool finished() const;
  void retire(int rank);
  void fail_pending(int rank, const std::string& why);
  void tell_stopping();
  void poll_once();
  void accept_all();
  void on_no_descriptor(int err);
  void on_pending(size_t i);
  void make_room();
  Step step_pending(Pending& p);
  Step on_hello(Pending& p, const Msg& m);
  Step on_join(Pending& p, const Msg& m);
  void admit(Pending& p, const JoinInfo& j);
  std::string refusal(int rank, uint32_t epoch, const JoinInfo& j) const;
  void refuse(Pending& p, Code code, int rank, const std::string& why);
  void fail_duplicate(Pending& p, int rank);
  void log_strangers() const;
  void on_client(int rank);
  void on_allgather(int rank, Msg& m);
  void on_relay(int src, Msg& m);
  void maybe_complete();
  bool refuse_oversized();
  bool refuse_mismatched_calls();
  void refuse_collective(int rank, const std::string& why);
  void lose(int rank, const std::string& why);
  void broadcast(const Msg& m, int except);
  void send_to(int rank, const Msg& m);
  void flush(int rank);
  void drain();
  void check_deadlines();
  std::string missing_ranks() const;

  tcp::Fd listener_;
  FdShortage shortage_;  // out of descriptors, the listener is not polled for a while
  UniqueId id_;
  uint64_t strangers_[static_cast<size_t>(Step::kCount)] = {};  // closed unproved, by why
  std::string fatal_;            // set by a duplicate join: every rank fails with it
  int fatal_rank_ = -1;
  std::vector<bool> told_;       // ranks that were sent fatal_
  std::vector<Pending> pending_;
  std::vector<Client> clients_;
  uint32_t nranks_ = 0;
  int joined_ = 0;
  Deadline join_deadline_ = Deadline::after_seconds(env_config().root_idle_s);
  double timeout_s_ = 0;
  uint32_t seq_ = 0;
  std::vector<int> lost_;
  int first_left_ = -1;  // the first rank that said BYE: no later collective can complete
  bool failed_ = false;
  std::shared_ptr<RootLife> life_;  // what this process's exit waits for
  std::shared_ptr<RootRelease> release_;  // release_root() of an unused id
};

}  // namespace fxm::bootstrap::root_impl
