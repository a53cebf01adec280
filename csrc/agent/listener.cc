// The agent's listener thread: accepts connections, runs the acceptor's side
// of the handshake for each (hello, answer, proof, verdict) in one poll loop,
// and files the admitted ones. Bounded like the mesh listener: each accepted
// connection has the header deadline to complete its handshake (a silent
// client is closed), at most kMaxPending are pending at once (beyond that the
// oldest without a valid header goes first), and every refusal is counted by
// its wire::Reject reason. A connection of several tcp lanes is filed when its
// lane 0 is admitted and started when its last lane joined; one whose lanes
// did not all join within the header deadline, or whose connector closed its
// lane 0 before, is closed and leaves the agent's table. A lane 0 whose name an
// open connection carries under another incarnation is held, its verdict unsent,
// while a NameProbe asks that incarnation whether it is alive (a Claim): alive,
// the newcomer is refused; ended or silent for NameProbe::kLimitS, it is admitted
// and the old connections retired. Out of file descriptors the listener stops
// polling its socket for a growing pause (FdShortage): the connections wait in
// the kernel's backlog until descriptors are freed. Nothing here waits on the
// inbox or on a peer: every step is bounded (a verdict's write, 1 s at most).
#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "agent/connection.h"
#include "agent/handshake.h"
#include "agent/name_probe.h"
#include "agent/stream_wait.h"
#include "base/log.h"
#include "transport/ucx/ucx_path.h"
#include "base/status.h"
#include "base/fd_shortage.h"
#include "core/pending_bound.h"

namespace fxm::agent {
namespace {

constexpr size_t kMaxPending = 256;
constexpr int kAcceptBatch = 64;
constexpr double kSweepEveryS = 0.1;  // connections whose peer left are closed that often (sweep)
constexpr double kClaimPollS = 0.002;  // a held claim's probe is stepped that often

struct Incoming {
  tcp::Fd fd;
  tcp::SockAddr from;
  Deadline deadline;
  enum Stage { kHello, kIdent, kProof } stage = kHello;
  uint8_t hello[wire::kHelloSize];
  uint8_t answer[wire::kHelloSize];
  uint8_t proof[wire::kProofSize];
  std::vector<uint8_t> ident, my_ident;
  size_t got = 0;
  bool header_ok = false;
  bool finished = false;
  wire::ConnHeader h;
};

// An admitted connection whose other tcp lanes have not all joined yet.
struct AwaitingLanes {
  std::shared_ptr<Connection> conn;
  Deadline deadline;
};

// A proved lane 0 whose name another incarnation holds: its verdict waits for the probe.
struct Claim {
  Incoming in;
  PeerInfo peer;
  hs::Ident theirs;
  std::unique_ptr<NameProbe> probe;  // null once settled
};

}  // namespace

class Listener {
 public:
  explicit Listener(Agent& a) : a_(a) {}
  void run();

 private:
  void accept_all();
  void on_no_descriptor(int err);
  void make_room();
  void on_readable(Incoming& in);
  bool fill(Incoming& in, uint8_t* buf, size_t want);
  void on_hello(Incoming& in);
  void answer(Incoming& in);
  void on_proof(Incoming& in);
  std::string judge(const PeerInfo& peer, const Incarnation& expect, wire::Reject* code);
  void admit(Incoming& in, const PeerInfo& peer, const hs::Ident& theirs);
  void hold_claim(Incoming& in, const PeerInfo& peer, const hs::Ident& theirs,
                  std::vector<std::shared_ptr<Connection>> rivals);
  void step_claims();
  void settle(Incoming& in, const PeerInfo& peer, const hs::Ident& theirs, std::string why, wire::Reject code);
  bool awaiting_full(const hs::Ident& theirs) const;
  void join_lane(Incoming& in, const PeerInfo& peer, const hs::Ident& theirs);
  void expire_awaiting();
  void on_awaiting_hangup(const std::vector<pollfd>& fds, size_t first);
  void start(Connection& c);
  void reject(Incoming& in, wire::Reject why, const std::string& detail = "");
  // reject() in two steps, for a refusal the peer is told: counted before the verdict goes (the
  // refused peer may read this agent's stats as soon as it has its verdict), closed after it.
  void count_rejection(wire::Reject why);
  void close_rejected(Incoming& in, wire::Reject why, const std::string& detail);
  void poll_once();

  Agent& a_;
  std::vector<Incoming> in_;
  std::vector<AwaitingLanes> awaiting_;
  std::vector<Claim> claims_;
  FdShortage shortage_;
};

void Listener::run() {
  Deadline sweep_at = Deadline::after_seconds(kSweepEveryS);
  while (!a_.closed_.load()) {
    poll_once();
    // Peers that left: their sockets and threads go now, their notifications stay. Never waited
    // for: while a call holds the inbox, the next round tries again.
    if (sweep_at.expired() && a_.inbox_->sweep(false)) sweep_at = Deadline::after_seconds(kSweepEveryS);
    for (Incoming& in : in_) {
      if (!in.finished && in.deadline.expired()) reject(in, wire::Reject::kSilent);
    }
    in_.erase(std::remove_if(in_.begin(), in_.end(), [](const Incoming& i) { return i.finished; }), in_.end());
    step_claims();
    expire_awaiting();
  }
}

// Closes the connections whose lanes did not all join in time and drops them from the agent's
// table too, so that their sockets close now (they never started: nothing to keep).
void Listener::expire_awaiting() {
  for (AwaitingLanes& w : awaiting_) {
    if (!w.conn || !w.deadline.expired()) continue;
    w.conn->close("its tcp lanes did not all join within the header timeout (" +
                  std::to_string(a_.header_timeout_s_) + " s)");
    FXM_WARN(-1, a_.who() + "closed the connection of agent " + w.conn->peer().name + ": its tcp lanes did not all join");
    a_.forget(w.conn);
    w.conn.reset();
  }
  awaiting_.erase(std::remove_if(awaiting_.begin(), awaiting_.end(), [](const AwaitingLanes& w) { return !w.conn; }),
                  awaiting_.end());
}

void Listener::poll_once() {
  bool paused = shortage_.paused();  // a negative fd is not polled
  std::vector<pollfd> fds{{a_.wake_fd_, POLLIN, 0}, {paused ? -1 : a_.listen_fd_.get(), POLLIN, 0}};
  for (Incoming& in : in_) fds.push_back({in.fd.get(), POLLIN, 0});
  Deadline next = Deadline::after_seconds(0.1);
  if (paused) next = next.min(shortage_.resume());
  if (!claims_.empty()) next = next.min(Deadline::after_seconds(kClaimPollS));
  for (Incoming& in : in_) next = next.min(in.deadline);
  size_t first_awaiting = fds.size();
  for (AwaitingLanes& w : awaiting_) {  // their lane 0: the connector sends nothing there before its lanes joined
    next = next.min(w.deadline);
    fds.push_back({w.conn ? w.conn->fd() : -1, POLLRDHUP, 0});
  }
  int rc = ::poll(fds.data(), fds.size(), next.poll_ms());
  if (rc <= 0) return;
  size_t n = in_.size();  // accept_all() may add more
  for (size_t k = 0; k < n; ++k) {
    if (fds[k + 2].revents) on_readable(in_[k]);
  }
  if (fds[1].revents) accept_all();
  on_awaiting_hangup(fds, first_awaiting);
}

// A connector that gave up between lane 0 and its lanes (it died, or a lane failed) closed lane 0:
// its connection is closed and leaves the table now, not at the header deadline. (revents were
// taken before this round's lanes joined, so a connection started since saw no traffic then.)
void Listener::on_awaiting_hangup(const std::vector<pollfd>& fds, size_t first) {
  for (size_t k = first; k < fds.size(); ++k) {
    AwaitingLanes& w = awaiting_[k - first];  // awaiting_ only grows within a round
    if (!w.conn || !(fds[k].revents & (POLLRDHUP | POLLHUP | POLLERR))) continue;
    w.conn->close("its connector closed tcp lane 0 before every lane joined");
    FXM_INFO(-1, a_.who() + "closed the connection of agent " + w.conn->peer().name +
                     ": it closed tcp lane 0 before every lane joined");
    a_.forget(w.conn);
    w.conn.reset();
  }
}

void Listener::accept_all() {
  for (int taken = 0; taken < kAcceptBatch; ++taken) {
    Incoming in;
    int err = 0;
    in.fd = tcp::accept_one(a_.listen_fd_.get(), &in.from, &err);
    if (!in.fd) {
      if (FdShortage::no_descriptor(err)) return on_no_descriptor(err);
      if (err != 0 && err != ECONNABORTED && err != EINTR && err != EAGAIN) {
        FXM_WARN(-1, a_.who() + "accept on the agent listener failed: " + errno_text(err));
      }
      return;
    }
    std::string shortage = shortage_.ended();
    if (!shortage.empty()) FXM_WARN(-1, a_.who() + "the agent listener accepts again, after " + shortage);
    in.deadline = Deadline::after_seconds(a_.header_timeout_s_);
    make_room();
    in_.push_back(std::move(in));
    on_readable(in_.back());
  }
}

// Counted each time; said once per episode; the pause doubles while accept keeps failing.
void Listener::on_no_descriptor(int err) {
  {
    std::lock_guard<std::mutex> lock(a_.mu_);
    ++a_.stats_.accept_fd_exhausted;
  }
  if (shortage_.failed()) {
    FXM_WARN(-1, a_.who() + "accept on the agent listener failed: " + errno_text(err) +
                     "; new connections wait in the backlog until descriptors are freed (" + FdShortage::retry_text() +
                     ")");
  }
}

void Listener::make_room() {
  if (Incoming* victim = pending_victim(in_, kMaxPending)) reject(*victim, wire::Reject::kOverflow);
}

// Reads toward `want` bytes in buf; true once they are all there.
bool Listener::fill(Incoming& in, uint8_t* buf, size_t want) {
  tcp::IoResult r = tcp::read_some(in.fd.get(), buf + in.got, want - in.got);
  in.got += r.done;
  if (!r.ok()) {
    // A dialer that read this agent's proof and hangs up before sending its own found that
    // proof wrong: it holds another secret (read_answer() in handshake.cc closes then).
    bool left_unproved = in.stage == Incoming::kProof && in.got == 0 &&
                         (r.kind == tcp::IoResult::kClosed || (r.kind == tcp::IoResult::kError && r.err == ECONNRESET));
    if (left_unproved) {
      reject(in, wire::Reject::kBadAuth, "it hung up on this agent's proof without proving the secret: another secret");
    } else {
      reject(in, wire::Reject::kTruncated);
    }
    return false;
  }
  return in.got == want;
}

void Listener::on_readable(Incoming& in) {
  if (in.finished) return;
  if (in.stage == Incoming::kHello) {
    if (!in.header_ok && in.got < wire::kConnHeaderSize) {
      if (fill(in, in.hello, wire::kConnHeaderSize)) on_hello(in);
      return;
    }
    if (fill(in, in.hello, wire::kHelloSize)) {
      in.stage = Incoming::kIdent;
      in.got = 0;
    }
    return;
  }
  if (in.stage == Incoming::kIdent) {
    if (fill(in, in.ident.data(), in.ident.size())) answer(in);
    return;
  }
  if (fill(in, in.proof, sizeof(in.proof))) on_proof(in);
}

void Listener::on_hello(Incoming& in) {
  wire::Reject why = hs::check_header(in.hello, wire::Role::kAgentConnect, &in.h);
  if (why != wire::Reject::kNone) return reject(in, why);
  in.header_ok = true;
  in.ident.resize(in.h.ext_len);
}

void Listener::answer(Incoming& in) {
  hs::Ident theirs;
  if (!hs::decode_ident(in.ident, &theirs)) return reject(in, wire::Reject::kBadShape);
  hs::Ident me{a_.name_, in.h.mesh_id};
  me.lanes = theirs.lane == 0 ? static_cast<uint8_t>(a_.tcp_lanes_) : theirs.lanes;  // lane 0: this side's offer
  me.lane = theirs.lane;
  me.token = theirs.token;
  if (theirs.lane == 0 && !theirs.ucx_worker.empty()) me.ucx_worker = ucx_worker_address();
  in.my_ident = hs::encode_ident(me);
  wire::encode(hs::header(wire::Role::kAgentAccept, a_.incarnation_, static_cast<uint32_t>(in.my_ident.size())),
               in.answer);
  crypto::random_bytes(in.answer + wire::kConnHeaderSize, wire::kNonceSize);
  wire::Mac m = hs::mac(a_.key_, wire::Role::kAgentAccept, in.hello, in.answer, in.ident, in.my_ident);
  std::vector<uint8_t> out(in.answer, in.answer + wire::kHelloSize);
  out.insert(out.end(), m.begin(), m.end());
  out.insert(out.end(), in.my_ident.begin(), in.my_ident.end());
  tcp::IoResult r = tcp::write_full(in.fd.get(), out.data(), out.size(), Deadline::after_seconds(1));
  if (!r.ok()) return reject(in, wire::Reject::kTruncated);
  in.stage = Incoming::kProof;
  in.got = 0;
}

// "" when the peer that proved the secret may connect, else why not (*code: how it is counted).
std::string Listener::judge(const PeerInfo& peer, const Incarnation& expect, wire::Reject* code) {
  static const Incarnation kAny{};
  *code = wire::Reject::kStaleIncarnation;
  if (expect != kAny && expect != a_.incarnation_) {
    return "it expects incarnation " + wire::mesh_id_hex(expect) + " of agent " + a_.name_ + ", which is " +
           wire::mesh_id_hex(a_.incarnation_) + " (this agent restarted since its metadata was made)";
  }
  {
    std::lock_guard<std::mutex> lock(a_.mu_);
    std::string why = a_.judge(peer);
    if (!why.empty()) return why;
  }
  if (!a_.admit_) return "";
  *code = wire::Reject::kPolicy;
  try {
    return a_.admit_(peer);
  } catch (const std::exception& e) {
    return std::string("the admission policy failed: ") + e.what();
  }
}

// The peer proved the secret: a lane 0 is judged and filed, a later lane joins its connection.
void Listener::on_proof(Incoming& in) {
  wire::Mac want = hs::mac(a_.key_, wire::Role::kAgentConnect, in.hello, in.answer, in.ident, in.my_ident);
  if (!crypto::equal_ct(want.data(), in.proof, want.size())) return reject(in, wire::Reject::kBadAuth);
  hs::Ident theirs;
  hs::decode_ident(in.ident, &theirs);
  PeerInfo peer{theirs.name, in.h.mesh_id, in.from.str(), theirs.ucx_worker};
  if (theirs.lane == 0) return admit(in, peer, theirs);
  join_lane(in, peer, theirs);
}

// Judges the peer; one whose name another incarnation holds waits for the probe of that one.
void Listener::admit(Incoming& in, const PeerInfo& peer, const hs::Ident& theirs) {
  wire::Reject code = wire::Reject::kOverflow;
  std::string why = awaiting_full(theirs) ? "too many connections of this agent's peers await their tcp lanes (" +
                                                std::to_string(kMaxPending) + "); try again"
                                          : judge(peer, theirs.expect, &code);
  if (why.empty()) {
    std::vector<std::shared_ptr<Connection>> rivals = a_.rivals(peer);
    if (!rivals.empty() && claims_.size() < kMaxPending) return hold_claim(in, peer, theirs, std::move(rivals));
    if (!rivals.empty()) {
      why = "too many agents' names are being settled here (" + std::to_string(kMaxPending) + "); try again";
      code = wire::Reject::kOverflow;
    }
  }
  settle(in, peer, theirs, std::move(why), code);
}

void Listener::hold_claim(Incoming& in, const PeerInfo& peer, const hs::Ident& theirs,
                          std::vector<std::shared_ptr<Connection>> rivals) {
  FXM_INFO(-1, a_.who() + "agent " + peer.name + " (incarnation " + incarnation_hex(peer.incarnation) +
                   ") claims a name an open connection carries: asking the incarnation there whether it is alive");
  Deadline limit = Deadline::after_seconds(NameProbe::kLimitS);
  claims_.push_back({std::move(in), peer, theirs, std::make_unique<NameProbe>(std::move(rivals), limit)});
  in.finished = true;  // its socket moved into the claim
}

// Settles the claims whose probe has its answer: refused when that name's holder is alive.
void Listener::step_claims() {
  for (Claim& c : claims_) {
    NameProbe::Verdict v = c.probe->step();
    if (v == NameProbe::Verdict::kPending) continue;
    std::string why = v == NameProbe::Verdict::kAlive ? c.probe->refusal(c.peer) : "";
    if (!why.empty()) FXM_WARN(-1, a_.who() + why);
    c.probe.reset();
    settle(c.in, c.peer, c.theirs, std::move(why), wire::Reject::kNameInUse);
  }
  claims_.erase(std::remove_if(claims_.begin(), claims_.end(), [](const Claim& c) { return !c.probe; }),
                claims_.end());
}

// Files the peer ("" why), tells it the verdict, starts it (or awaits its other lanes).
void Listener::settle(Incoming& in, const PeerInfo& peer, const hs::Ident& theirs, std::string why,
                      wire::Reject code) {
  std::shared_ptr<Connection> c;
  if (why.empty()) {
    int lanes = std::min<int>(theirs.lanes, a_.tcp_lanes_);
    try {
      c = std::make_shared<Connection>(&a_, std::move(in.fd), peer, false, lanes, theirs.token);
    } catch (const std::exception& e) {
      return reject(in, wire::Reject::kTruncated, e.what());
    }
    why = a_.adopt(c);  // filed before the verdict: what the peer is told is what the table holds
    if (!why.empty()) code = wire::Reject::kStaleIncarnation;
  }
  if (!why.empty()) count_rejection(code);
  std::vector<uint8_t> v = hs::verdict_frame(why);
  int fd = c ? c->fd() : in.fd.get();
  tcp::IoResult r = tcp::write_full(fd, v.data(), v.size(), Deadline::after_seconds(1));
  if (!why.empty()) return close_rejected(in, code, why);
  in.finished = true;
  if (!r.ok()) return c->close("sending the admission failed: " + r.describe());
  if (c->lanes_joined()) return start(*c);
  awaiting_.push_back({c, Deadline::after_seconds(a_.header_timeout_s_)});
}

// Connections awaiting their lanes are bounded as pending handshakes are: beyond kMaxPending a
// new one of several lanes is refused (and told why) rather than filed.
bool Listener::awaiting_full(const hs::Ident& theirs) const {
  if (std::min<int>(theirs.lanes, a_.tcp_lanes_) <= 1) return false;
  auto live = std::count_if(awaiting_.begin(), awaiting_.end(), [](const AwaitingLanes& w) { return w.conn != nullptr; });
  return static_cast<size_t>(live) >= kMaxPending;
}

// Lane k of an admitted connection of that same peer: "" and the lane is added
// (the connection starts with its last lane), else the peer is told why not.
void Listener::join_lane(Incoming& in, const PeerInfo& peer, const hs::Ident& theirs) {
  AwaitingLanes* w = nullptr;
  for (AwaitingLanes& k : awaiting_) {
    if (k.conn && k.conn->lane_token() == theirs.token && k.conn->peer().name == peer.name &&
        k.conn->peer().incarnation == peer.incarnation) {
      w = &k;
    }
  }
  std::string why = "no connection of this agent awaits a tcp lane " + std::to_string(theirs.lane) +
                    " (it was closed, or its lanes did not join in time)";
  if (w) why = theirs.lanes == w->conn->tcp_lanes() ? w->conn->lane_refused(theirs.lane)
                                                    : "its connection has " + std::to_string(w->conn->tcp_lanes()) +
                                                          " tcp lanes, not " + std::to_string(theirs.lanes);
  if (!why.empty()) count_rejection(wire::Reject::kUnknownLane);
  std::vector<uint8_t> v = hs::verdict_frame(why);
  tcp::IoResult r = tcp::write_full(in.fd.get(), v.data(), v.size(), Deadline::after_seconds(1));
  if (!why.empty()) return close_rejected(in, wire::Reject::kUnknownLane, why);
  if (!r.ok()) return reject(in, wire::Reject::kTruncated, "sending the lane's admission failed");
  in.finished = true;
  bool all = false;
  try {
    all = w->conn->add_lane(theirs.lane, std::move(in.fd));
  } catch (const std::exception& e) {  // no fd for its dup
    w->conn->close(std::string("its tcp lane could not be added: ") + e.what());
    w->conn.reset();
    return;
  }
  if (!all) return;
  start(*w->conn);
  w->conn.reset();
}

// An engine that cannot start (no thread, no eventfd) closes its connection; the listener goes on.
void Listener::start(Connection& c) {
  try {
    c.start();
  } catch (const std::exception& e) {
    FXM_WARN(-1, a_.who() + "the connection of agent " + c.peer().name + " could not start: " + e.what());
    c.close(std::string("it could not start: ") + e.what());
  }
}

void Listener::reject(Incoming& in, wire::Reject why, const std::string& detail) {
  count_rejection(why);
  close_rejected(in, why, detail);
}

void Listener::count_rejection(wire::Reject why) {
  std::lock_guard<std::mutex> lock(a_.mu_);
  ++a_.stats_.rejected[static_cast<size_t>(why)];
}

void Listener::close_rejected(Incoming& in, wire::Reject why, const std::string& detail) {
  FXM_INFO(-1, a_.who() + "closed a connection from " + in.from.str() + " to the agent listener: " +
                   wire::reject_name(why) + (detail.empty() ? "" : " (" + detail + ")"));
  in.fd.reset();
  in.finished = true;
}

void Agent::listen_loop() {
  LogSpeaker speaker(who());
  Listener l(*this);
  try {
    l.run();
  } catch (const std::exception& e) {
    FXM_ERROR(-1, who() + "the listener stopped: " + e.what());
  }
}

}  // namespace fxm::agent
