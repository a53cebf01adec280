// One authenticated connection between two agents: its sockets (its tcp
// lanes, lane 0 first), the progress Engine that owns them (a 2-party pair:
// the peer is the engine's peer 0, one context; large puts to host regions
// are striped over the lanes, as the mesh's are) and the paths to the peer's
// regions, chosen on first use.
#pragma once

#include <atomic>
#include <map>
#include <tuple>
#include <utility>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "agent/agent.h"
#include "agent/doorbell.h"
#include "base/env.h"
#include "base/status.h"
#include "core/progress.h"
#include "transport/cma/cookie_table.h"
#include "transport/cuda/streams.h"

namespace fxm::agent {

class Connection : public std::enable_shared_from_this<Connection> {
 public:
  // Takes the socket (lane 0) of a finished handshake; with lanes > 1 the
  // other lanes' sockets come through add_lane(). start() starts its engine
  // once every lane is there (calls before it wait up to the header timeout).
  Connection(Agent* agent, tcp::Fd fd, PeerInfo peer, bool initiated, int lanes = 1, uint64_t token = 0);
  void start();
  int fd() const { return conns_.recv[0].get(); }
  int tcp_lanes() const { return static_cast<int>(conns_.recv.size()); }
  uint64_t lane_token() const { return token_; }  // the connector's tag of it (handshake.h)
  // "" when the socket of `lane` may be added now, else why not.
  std::string lane_refused(int lane) const;
  // Adds that socket (after lane_refused() said ""); true once every lane is there.
  bool add_lane(int lane, tcp::Fd fd);
  bool lanes_joined() const;
  ~Connection();
  Connection(const Connection&) = delete;
  Connection& operator=(const Connection&) = delete;

  const PeerInfo& peer() const { return peer_; }
  const Agent& agent() const { return *agent_; }  // whose connection it is
  bool initiated() const { return initiated_; }
  // "" while usable, else why not (lost, closed, superseded by a restart).
  std::string gone() const;
  std::string peer_end() const;  // how the peer ended in the engine's view ("" while it has not)
  // gone() is not "" (one lock, no text: what every call tests first).
  bool ended() const;
  // Writes (is_read false) or reads a batch; all of it is checked before
  // anything moves. The notification (when given) follows the data on this
  // connection and reaches the target after the data landed. `notified` (when given): a
  // notification that would wait here for the transfer's own copies (a read, device copies the
  // socket does not order) is not sent; *notified says whether it went (the caller sends it once
  // the transfer completed).
  Handle transfer(const std::vector<Xfer>& ops, bool is_read, const std::vector<uint8_t>* notification,
                  StreamArg stream = {}, bool* notified = nullptr);
  // Sends a notification alone (FIFO after earlier transfers on this connection).
  void notify(const std::vector<uint8_t>& bytes);
  // Non-blocking: appends the notifications that arrived.
  void take_notifications(std::vector<Notification>* out);
  // A waiter for notifications reads the connection itself (Engine::help_read: lane 0, when no
  // other thread reads it, never with device regions here); true when it read some frames.
  bool help_read();
  // That waiter stops reading and sleeps: the progress thread reads lane 0 again (Engine::unpark).
  void unpark();
  // Closes (kBye to the peer, engine stopped); `why` is what later calls say.
  void close(const std::string& why);
  // close(), because this agent closed: later calls on it raise Closed ("this agent was
  // closed"), not PeerLost (no peer went).
  void close_for_agent();
  Code lost_code() const;
  // Marks it closed (`why`: what later calls say, ended() true) without stopping its engine,
  // which may wait for a hung peer: close() follows, off the caller's thread (Agent's closer).
  // Its gets into device memory are settled first (Engine::settle_device_gets, bounded by the
  // timeout), so no copy up of one lands after a waiter learned of the end.
  void retire(const std::string& why);
  // Liveness (NameProbe): started() once its engine runs; ping() asks the peer's engine for an
  // ack and returns a mark that answered(mark) passes once the answer came (started only).
  bool started() const { return ready_.load(std::memory_order_acquire); }
  uint64_t ping();
  bool answered(uint64_t mark) const;
  // The path name a transfer to `remote` takes from `local` (null: from host memory).
  std::string path_to(const RegionDesc& remote, const RegionDesc* local);

  // For Handle.
  bool reached(uint64_t target) const;
  void poll_completions() const;  // the engine's device copies that completed are counted (Handle::poll)
  // On failure the error names the call, `describe`'s words (made then only).
  void wait(uint64_t target, const Deadline& deadline, const Handle& describe) const;
  void flush(const Deadline& deadline);  // this agent's ops on it completed (errors swallowed)
  double agent_timeout() const { return agent_->timeout_s(); }
  uint64_t waiter_reads() const {  // the reads of the peer's frames that waiting threads made themselves
    return ready_.load(std::memory_order_acquire) ? engine_->waiter_reads() : 0;
  }
  uint64_t late_wakes() const {  // the progress thread's lost wake-ups (Engine::ParkCounts)
    return ready_.load(std::memory_order_acquire) ? engine_->park_counts().late_wakes : 0;
  }
  Engine::AnswerCounts answer_counts() const {  // the memory answers to the peer's reads hold
    return ready_.load(std::memory_order_acquire) ? engine_->answer_counts() : Engine::AnswerCounts{0, 0};
  }

 private:
  bool joined_locked() const;  // lanes_joined() with state_mu_ held
  struct Checked;
  struct LocalWindows {  // one call's local regions, each looked up once
    // (Inline: the last region again, as a batch's ops name it many times in a row.)
    const Window* of(const Agent& agent, const RegionDesc& d, const char* call) {
      return last_desc == &d ? last : find(agent, d, call);
    }
    const Window* find(const Agent& agent, const RegionDesc& d, const char* call);
    std::vector<const RegionDesc*> descs;
    std::vector<std::shared_ptr<Window>> held;
    std::unordered_map<const RegionDesc*, const Window*> more;  // past the first few
    const RegionDesc* last_desc = nullptr;
    const Window* last = nullptr;
    const RegionDesc* last_remote = nullptr;  // the last remote descriptor found to be of the peer's incarnation
  };
  // op: the op's index in a batch of several (its errors name it), -1 for a call of one op.
  Checked check(const Xfer& x, const char* call, long op, LocalWindows* locals) const;
  // check()'s refusal of op `op` ("<who>: <call> op <op> of <size> bytes <why>"); local_size:
  // of its local window, for kLocalRange.
  enum class Refusal { kMissing, kAgent, kIncarnation, kRemoteRange, kLocalRange };
  [[noreturn]] void fail_op(const Xfer& x, const char* call, long op, Refusal why, uint64_t local_size = 0) const;
  // The path to `remote` from local memory on `device` (-1: host memory), with op_mu_ held.
  PeerView& view_of(const RegionDesc& remote, int device);
  [[noreturn]] void fail_mismatch(const RegionDesc& remote, const WindowDesc& d, const std::string& why) const;
  // Done at once; in flight on the engine's sockets (ordered before a notification sent after them);
  // in flight elsewhere (a device stream, UCX), which a notification waits for.
  enum class Issued { kDone, kEngine, kUnordered };
  struct Batch;  // one call's device copies, issued together
  Issued issue(const Checked& c, bool is_read, const StreamArg& stream, Batch* batch);
  // An op of the run that issue() started (Batch::in_run()): only queued.
  Issued queue_in_run(const Checked& c, bool is_read, const StreamArg& stream, Batch* batch);
  void issue_batch(Batch* batch);
  bool queue_host(Path* p, PeerView& v, const PathOp& op, Batch* batch);
  bool queue_staged(Path* p, const PathOp& op, Batch* batch);
  bool queue_blocks(Path* p, const PathOp& op, Batch* batch);
  void issue_blocks(Batch* batch);
  void issue_staged(Batch* batch);
  void issue_host(Batch* batch);
  void issue_all(const std::vector<Checked>& checked, bool is_read, const StreamArg& stream, bool* async,
                 bool* unordered);
  void order_on(const StreamArg& stream, Path* p, int device, PathOp* op);
  void forget_if_idle();
  Issued post(Path* p, PeerView& v, const PathOp& op, bool is_read);
  // cma, shm and device paths: throws once the peer closed the region (`mapped`: shm and device
  // paths pass when the cookie cannot be read here at all).
  void check_cookie(const RegionDesc& remote, const PeerView& view, bool mapped);
  const PeerView* cookie_checked_ = nullptr;  // the remote region (view) whose cookie this call read back (op_mu_)
  struct CookieRef {
    int32_t pid;
    uint64_t addr, value;
  };
  std::map<const PeerView*, CookieRef> cookie_refs_;  // per view (views_ never drops one): its pid, cookie address and seal
  cma::PeerCookies peer_cookies_;             // the peer's cookie table, mapped on first use
  // Throws the engine's error `e` as this call's, in the agents' words, naming the peer agent;
  // `handle`: the call's handle, whose ops and bytes its words give.
  [[noreturn]] void fail_call(const Error& e, const std::string& call, const Handle* handle = nullptr) const;
  std::string who() const;
  // (Inline: asked per op; started_engine() waits for a start under way.)
  Engine& engine() const { return ready_.load(std::memory_order_acquire) ? *engine_ : started_engine(); }
  Engine& started_engine() const;

  Agent* agent_;
  std::shared_ptr<Doorbell> bell_;  // the agent's: rung as a notification lands, the peer ends, or this closes
  PeerInfo peer_;
  bool initiated_;
  uint64_t token_;
  // send and recv per lane: one socket each (the engine writes one fd, reads its dup); an
  // empty recv[k]: lane k has not joined yet (state_mu_ until start, then the engine's).
  Connections conns_;
  std::unique_ptr<Engine> engine_;
  std::mutex op_mu_;   // FIFO of calls on this connection; views_
  // One path per (remote region index, local device or -1, the seal of its descriptor): a path is
  // bound to the descriptor as presented (transport/binding.h), never reused for another that
  // names the index, and byte-variants of one registration's descriptor share it (the seal covers
  // its canonical encoding). At most max_views_ (FLAGCX_MESH_AGENT_MAX_VIEWS, docs/agent.md):
  // beyond it a new descriptor is refused (each view may hold a mapping of the peer's memory).
  using ViewKey = std::tuple<uint32_t, int, uint64_t>;
  struct Held {
    PeerView view;
    std::vector<uint8_t> window;  // the descriptor it was bound for (error texts name a changed field)
  };
  std::map<ViewKey, Held> views_;  // never drops one: pointers to its views stay valid
  std::set<std::pair<int32_t, uint64_t>> proven_;  // (pid, start time) proven the peer's process (binding.h)
  const size_t max_views_ = agent_max_views_env();
  // The descriptor bytes a view was found for, so an op finds it without hashing or allocating:
  // window bytes -> (index, device, view); cleared when it holds 4 * max_views_ entries.
  struct Seen {
    uint32_t index;
    int device;
    PeerView* view;
  };
  std::map<std::string, std::vector<Seen>, std::less<>> seen_;
  // This call's last lookup (a batch names few regions many times); reset per call, as its
  // descriptors live only until it returns.
  const RegionDesc* last_remote_ = nullptr;
  int last_device_ = 0;
  PeerView* last_view_ = nullptr;
  PeerView& bind_view(const RegionDesc& remote, const WindowDesc& d, int device, const ViewKey& key);
  cuda::StreamFence fence_;  // device copies of this connection in issue order across streams (under op_mu_)
  std::atomic<uint64_t> async_issued_{0};
  mutable std::mutex state_mu_;
  std::string closed_why_;
  std::atomic<bool> closed_{false};  // closed_why_ is set
  std::atomic<bool> agent_closed_{false};  // by close_for_agent()
  std::atomic<bool> stopped_{false};
  std::atomic<bool> ready_{false};  // engine_ is set
};

}  // namespace fxm::agent
