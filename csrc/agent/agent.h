// An agent: one process's endpoint for dynamic peers. It registers memory
// locally (no peer involved), listens on an ephemeral port of the chosen
// interface, and serves whichever agents connect, each proving the shared
// secret with the mesh's handshake (wire.h: header, nonces, HMAC proofs, here
// in the agent roles with both names bound into the MACs).
//
// Each connection is one TCP socket, or several (its tcp lanes, as many as
// the smaller FLAGCX_MESH_TCP_LANES of both sides), driven by one small
// progress Engine of its own (a 2-party pair: the peer is the engine's only peer, one context),
// so a peer that dies fails only its own handles, and every engine lands
// frames in the agent's one WindowTable: a region's index is the window index
// a peer's frames name. Paths to a peer's regions (self / shm / cma / tcp,
// and for device memory cuda-self / cuda-vmm / cuda-ipc / staged, path.h)
// are chosen per connection on first use and cached.
//
// Layering: csrc/agent sits beside adaptor and capi, above core; the core
// never includes it. Thread-safe: every public call may come from any thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "agent/doorbell.h"
#include "base/clock.h"
#include "base/wire.h"
#include "core/window.h"
#include "transport/cma/cookie_table.h"
#include "transport/tcp/socket.h"

namespace fxm::agent {

using Incarnation = wire::MeshId;  // random per Agent object (a restart is a new one)
constexpr size_t kMaxAgentName = 200;  // bytes of an agent's name
// The most bytes one notification may hold (docs/agent.md, "Sizes"): notifications are control
// messages; bulk data goes by write. A larger one is refused before anything moves.
constexpr size_t kMaxNotificationBytes = 64ull << 20;
// Throws Error(kInvalidArgument) naming `what` when n exceeds kMaxNotificationBytes.
void check_notification_size(size_t n, const std::string& what);
std::string incarnation_hex(const Incarnation& i);

// Who is at the other end of a connection (proved by the handshake).
struct PeerInfo {
  std::string name;
  Incarnation incarnation{};
  std::string address;  // where it connected from, or where we connected to
  std::string ucx_worker;  // its UCX worker address, from the handshake ("" when it sent none)
};

// A registered region as peers address it. encode() gives the bytes an
// application sends to peers; decode() refuses malformed bytes.
struct RegionDesc {
  std::string agent;
  Incarnation incarnation{};
  uint32_t index = 0;
  uint64_t size = 0;
  WindowKind kind = WindowKind::kUser;
  std::vector<uint8_t> window;  // WindowDesc::encode() of the region
  std::vector<uint8_t> encode() const;
  static RegionDesc decode(const std::vector<uint8_t>& bytes);  // throws InvalidArgument
};

// What agent.metadata() carries: enough to connect and check who answers.
struct Metadata {
  std::string name;
  Incarnation incarnation{};
  tcp::SockAddr address;
  std::vector<uint8_t> encode() const;
  static Metadata decode(const std::vector<uint8_t>& bytes);  // throws InvalidArgument
};

struct AgentOptions {
  std::string name;    // 1..200 bytes
  std::string secret;  // empty: FLAGCX_MESH_AGENT_SECRET (one of them is required)
  double timeout_s = 0;           // connect deadline and default op wait; 0: FLAGCX_MESH_TIMEOUT
  double header_timeout_s = 5.0;  // an accepted connection's handshake must complete within it
  // Called on the listener thread for every peer that proved the secret:
  // "" admits it, anything else refuses it with that reason (the peer is told).
  std::function<std::string(const PeerInfo&)> admit;
};

class Connection;
class Agent;
namespace hs {
struct Ident;
}
class NotificationInbox;
class NotificationWait;
struct WaitState;
class Closer;

// One transfer of a batch: bytes [local_off, +size) of a local region and
// [remote_off, +size) of a peer's region.
struct Xfer {
  const RegionDesc* local = nullptr;
  uint64_t local_off = 0;
  const RegionDesc* remote = nullptr;
  uint64_t remote_off = 0;
  uint64_t size = 0;
};

// The CUDA stream a transfer is ordered on: set, it starts after the work
// queued on `stream` so far (0: the legacy default stream), as the mesh's
// stream ops do (docs/agent.md, "Streams").
struct StreamArg {
  bool set = false;
  void* stream = nullptr;
};

// The completion of one write / read call (all its transfers, and its
// notification). wait() throws the call's error: PeerLost naming the peer
// when it died, InvalidArgument when the target refused an op, Timeout.
class Handle {
 public:
  Handle() = default;
  // pending: in flight until the connection's async op count reaches `target`
  // (else completed when issued: synchronous paths).
  Handle(std::shared_ptr<Connection> conn, uint64_t target, bool pending, bool is_read, size_t count,
         uint64_t bytes = 0)
      : conn_(std::move(conn)), target_(target), pending_(pending), is_read_(is_read), count_(count), bytes_(bytes) {}
  bool done() const;  // complete, or failed (wait() then says why)
  // done(), after polling the completion of its device copies (what a wait does between its
  // looks; done() alone sees a device copy complete only once some thread polled it).
  bool poll() const;
  void wait(double timeout_s) const;  // <= 0: the agent's timeout
  std::string call() const;  // "write of 3 transfer(s) to agent b" (made when asked: not on the op's path)
  size_t count() const { return count_; }  // its ops
  uint64_t bytes() const { return bytes_; }  // the bytes of its ops

 private:
  std::shared_ptr<Connection> conn_;  // null: a handle of no call
  uint64_t target_ = 0;
  bool pending_ = false;
  bool is_read_ = false;
  size_t count_ = 0;
  uint64_t bytes_ = 0;
};

struct Notification {
  std::string peer;
  Incarnation incarnation{};
  std::vector<uint8_t> bytes;
};

// Counters of the listener (rejected by wire::Reject reason) and of connections.
struct AgentStats {
  std::array<uint64_t, static_cast<size_t>(wire::Reject::kCount)> rejected{};
  uint64_t accepted = 0;
  uint64_t connected = 0;
  uint64_t accept_fd_exhausted = 0;  // accepts that failed for want of descriptors (EMFILE, ENFILE, ...)
  // Memory the answers to peers' reads hold now (all connections), and the most one
  // connection's answers held at once (bounded per peer: docs/agent.md).
  uint64_t answer_bytes_held = 0;
  uint64_t answer_bytes_peak = 0;
  // The times the threads waiting for notifications drained the connections: once per arrival,
  // wake or deadline (agent/doorbell.h), not once per tick.
  uint64_t notification_drains = 0;
  // The socket reads of peers' frames that threads waiting on this agent (for notifications, an
  // op's completion) made themselves, over the open connections: frames no wake-up of the
  // progress thread was needed for (docs/agent.md, "How a notification reaches its waiter").
  uint64_t waiter_reads = 0;
  // The polls of the connections' progress threads that ran out their timer although they had
  // been handed a frame (a lost wake-up; none is expected), over the open connections.
  uint64_t late_wakes = 0;
  uint64_t total_rejected() const;
  // The counters by name, in the order stats() documents them (docs/agent.md): the
  // Python dict and the C ABI's JSON are both made from this list.
  std::vector<std::pair<std::string, uint64_t>> counters() const;
  // The refusals by reason (only reasons counted at least once).
  std::vector<std::pair<std::string, uint64_t>> rejections() const;
};

class Agent {
 public:
  explicit Agent(const AgentOptions& options);
  ~Agent();
  Agent(const Agent&) = delete;
  Agent& operator=(const Agent&) = delete;

  const std::string& name() const { return name_; }
  const Incarnation& incarnation() const { return incarnation_; }
  std::string address() const { return listen_addr_.str(); }
  std::vector<uint8_t> metadata() const;
  AgentStats stats() const;

  // Local registration: user memory (host), or shared memory the agent
  // allocates (local peers map it: the shm path). No peer is involved.
  RegionDesc register_memory(void* base, uint64_t size);
  // CUDA device memory [base, base + size) of one allocation. The descriptor
  // carries its legacy IPC handle and its cuMem mappings' layout; the
  // mappings' fds are made when a peer first asks the agent's fd server for
  // them (with the region's token) and kept until deregister. Peers on this
  // host map it (cuda-vmm / cuda-ipc), this process copies directly
  // (cuda-self), others go through host memory (staged). See docs/agent.md.
  RegionDesc register_device(void* base, uint64_t size);
  RegionDesc alloc(uint64_t size);
  uint8_t* region_base(uint32_t index) const;  // host regions: their bytes (device regions: null)
  // Waits (up to timeout_s) for this agent's ops in flight from the region
  // (Timeout: it stays registered), then closes it: peers' later ops on it are
  // refused, and a peer's put still landing in it is cut off (its rest goes to a
  // sink). Raises Timeout, with the region closed, when a peer's transfer was
  // still landing in it (or reading it) at the timeout: it may hold part of it.
  // Never returns while a tcp or staged frame can still write into it.
  void deregister(const RegionDesc& region, double timeout_s);

  // Connects (deadline: timeout_s, <= 0: the agent's) to the agent that
  // published `metadata`, or to "host:port" (whoever proves the secret there).
  // An open connection to that same agent incarnation is reused.
  std::shared_ptr<Connection> connect(const std::vector<uint8_t>& metadata, double timeout_s);
  std::shared_ptr<Connection> connect_address(const std::string& host_port, double timeout_s);
  // The open connection to agent `name` (either direction), or null.
  std::shared_ptr<Connection> connection(const std::string& name) const;
  std::vector<PeerInfo> peers() const;

  // Notifications that arrived (in order per connection; at most `most`, the first ones),
  // waiting up to timeout_s for the first one (0: only those already there).
  // (A notification that a pending stream wait matches goes to that wait instead.)
  std::vector<Notification> notifications(double timeout_s, size_t most = SIZE_MAX);
  // Makes a notifications() call waiting in another thread return now (with what arrived,
  // maybe nothing); with none waiting, the next call returns at once (wakes do not add up).
  void wake_notifications();
  // Waits as notifications() does, taking nothing: true once notifications() has something to
  // return (false at the deadline, or when woken by wake_notifications()).
  bool await_notifications(double timeout_s);
  // Queues on `stream` (of the current device; 0: the legacy default stream) a
  // wait that holds the stream's later work until a notification of exactly
  // `bytes` (from agent `peer`, "" : any) arrived; one already here and unread
  // releases it at once. Released too, with the wait's error set, after
  // timeout_s (<= 0: the agent's timeout), when that peer is gone, or at close.
  // See docs/agent.md, "Stream waits on notifications".
  NotificationWait stream_wait_notification(const std::vector<uint8_t>& bytes, const std::string& peer,
                                            void* stream, double timeout_s);
  // Waits on the host for agent `peer`'s notification of exactly `bytes` (null: its
  // next one, whatever its bytes) and returns it, consumed (others stay for
  // notifications()); one already here and unread returns at once. Throws PeerLost
  // naming the peer when it is gone first, Timeout after timeout_s (0: the agent's
  // timeout; < 0 or NaN: InvalidArgument), Closed when the agent closes.
  // See docs/agent.md, "Waiting for a peer's notification".
  Notification wait_notification(const std::vector<uint8_t>* bytes, const std::string& peer, double timeout_s);
  // Watches `conn` for its peer's notification of exactly `bytes` without a thread waiting:
  // `on_release` runs once, as it arrives (consumed: notifications() never returns it) or with
  // the watch's error (PeerLost when `conn` ends first, Timeout after timeout_s, Closed at close).
  // It runs in whichever thread drains the connections, with the inbox's lock held: short, and no
  // call on this agent. withdraw_watch() takes one out before that (false: it was released).
  // See NotificationInbox::watch_for (stream_wait.h).
  std::shared_ptr<WaitState> watch_notification(const std::vector<uint8_t>& bytes, std::shared_ptr<Connection> conn,
                                                double timeout_s, std::function<void(const WaitState&)> on_release);
  bool withdraw_watch(const std::shared_ptr<WaitState>& w);
  // Puts notifications taken by notifications() but not read back in front of the unread ones.
  void unread(std::vector<Notification> ns);
  // Notifications whose bytes start with `prefix` are offered to `fn` as they are drained, with the
  // connection they came on, before any wait or notifications() sees them; fn returning true
  // consumes one (false leaves it as if no claim were there). fn runs with the inbox's lock held,
  // in whichever thread drains (a watcher thread drains while a claim is installed): short, and no
  // call on this agent. One claim per prefix: a second is refused (kInvalidArgument) until
  // unclaim_notifications() took the first out (fn never runs once it returned). See NotificationInbox::claim (stream_wait.h).
  void claim_notifications(std::vector<uint8_t> prefix,
                           std::function<bool(const std::shared_ptr<Connection>&, Notification&)> fn);
  void unclaim_notifications(const std::vector<uint8_t>& prefix);
  // Hands a notification a claim took back: a wait matches it, else notifications() returns it
  // (after those already there), a call waiting in notifications() at once.
  void deliver_notification(Notification n);

  void close();  // idempotent: stops the listener, closes every connection and region
  bool closed() const { return closed_.load(); }
  // Throws Closed naming the call once close() began: every call but the accessors
  // (name, incarnation, address, stats, peers, closed) and close itself.
  void require_open(const char* call) const;
  // Throws InvalidArgument naming the call unless `peer` is an agent name (1..kMaxAgentName bytes).
  void check_peer_name(const char* call, const std::string& peer) const;
  double timeout_s() const { return timeout_s_; }
  int tcp_lanes() const { return tcp_lanes_; }  // the lanes this agent offers (FLAGCX_MESH_TCP_LANES)
  // Sockets planned per lane when the default lanes are fitted to RLIMIT_NOFILE (base/env.h):
  // two fds for each of this many connections.
  static constexpr uint64_t kPlannedConnections = 64;

 private:
  friend class Connection;
  friend class Listener;
  friend class NotificationInbox;
  struct Pending;
  void listen_in_port_range();
  void listen_loop();
  std::shared_ptr<Window> window_for(const RegionDesc& d, const char* op, bool* entered) const;
  void describe_device(const std::shared_ptr<Window>& w, WindowDesc* d);
  bool lookup_fds(uint64_t token, std::vector<int>* fds);  // the fd server's answer to a token
  void drop_exports(const Window& w);
  void revoke(Window& w, const Deadline& deadline);  // deregister: closes it to peers (agent.cc)
  RegionDesc add_region(std::shared_ptr<Window> w, const std::string& shm_name);
  void set_cookie(Window* w);  // with mu_ held
  std::unique_ptr<cma::CookieTable> make_cookie_table() const;
  // Files a connection unless judge() refuses it ("" or why not, atomically
  // with the judgement); retires connections to other incarnations of that peer's
  // name (the caller's NameProbe found none alive): they end at once, the closer
  // closes them, and the inbox keeps what they delivered.
  std::string adopt(const std::shared_ptr<Connection>& c);
  // The open connections whose peer carries p's name under another incarnation.
  std::vector<std::shared_ptr<Connection>> rivals(const PeerInfo& p) const;
  // "" when no live agent holds p's name, else why p is refused (a NameProbe run to its end,
  // up to `deadline` or NameProbe::kLimitS: a connector's thread, which may wait).
  std::string settle_name(const PeerInfo& p, const Deadline& deadline) const;
  // "" when a peer with this identity may connect, else why not (with mu_ held).
  std::string judge(const PeerInfo& p) const;
  std::shared_ptr<Connection> find(const std::string& name, const Incarnation& inc) const;
  // expect: the metadata dialed (the peer must carry its name and incarnation; the name was settled
  // before), or null (connect by address: the name, learnt in the handshake, is settled here).
  std::shared_ptr<Connection> dial(const tcp::SockAddr& to, const Metadata* expect, const Deadline& d);
  // Dials lanes 1.. of c (lane 0 was admitted) with the same handshake.
  void join_lanes(Connection& c, const tcp::SockAddr& to, hs::Ident me, const Deadline& d);
  // Takes the connections whose peer is gone out of the table (one test each) and returns them:
  // the inbox keeps what they still hold (NotificationInbox::sweep), then closes them.
  std::vector<std::shared_ptr<Connection>> take_ended();
  // Drops `c` from the table (a connection that never started: it holds no notification to keep).
  void forget(const std::shared_ptr<Connection>& c);
  std::string who() const { return "agent " + name_ + ": "; }

  std::string name_;
  Incarnation incarnation_{};
  crypto::Key key_{};
  double timeout_s_ = 60;
  double header_timeout_s_ = 5;
  int tcp_lanes_ = 1;
  std::function<std::string(const PeerInfo&)> admit_;
  std::string host_;
  tcp::Fd listen_fd_;
  tcp::SockAddr listen_addr_;
  int wake_fd_ = -1;
  std::thread listener_;
  WindowTable windows_;
  // The regions' cookies, in memory peers on this host map (made with the first region, under mu_;
  // null with FLAGCX_MESH_AGENT_COOKIE_TABLE=off).
  std::unique_ptr<cma::CookieTable> cookies_;
  bool cookie_table_tried_ = false;
  mutable std::mutex mu_;  // conns_, superseded_, stats_, region bookkeeping
  std::vector<std::shared_ptr<Connection>> conns_;
  std::map<std::string, std::set<Incarnation>> superseded_;  // per name: incarnations replaced by a newer one
  AgentStats stats_;
  std::atomic<bool> closed_{false};
  // Device regions' cuMem fds, served on one abstract socket to the peers that
  // send a region's token; the server starts with the first such region.
  std::mutex exports_mu_;
  std::map<uint64_t, std::weak_ptr<Window>> exports_;  // token -> region
  std::unique_ptr<cuda::FdServer> fd_server_;
  // What wakes the inbox's waiters (doorbell.h): rung by every connection's engine as a
  // notification lands or its peer ends (shared: a connection may outlive this agent).
  std::shared_ptr<Doorbell> bell_ = std::make_shared<Doorbell>();
  std::unique_ptr<NotificationInbox> inbox_;  // notifications not yet read, and the stream waits on them
  std::unique_ptr<Closer> closer_;  // closes retired connections off the listener's thread
};

}  // namespace fxm::agent
