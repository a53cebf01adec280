#include "bootstrap/root.h"

#include <poll.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "base/env.h"
#include "base/log.h"
#include "bootstrap/exit_wait.h"
#include "bootstrap/root_release.h"
#include "bootstrap/proto.h"

namespace fxm::bootstrap {
namespace {

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
const char* const kStepNames[] = {"", "", "silent", "closed", "garbage", "foreign mesh",
                                  "bad authentication", "overflow"};

struct Client {
  tcp::Fd fd;
  bool joined = false;
  bool gone = false;  // said BYE or was lost
  bool contributed = false;
  bool refused = false;  // its part was too large: `part` holds why
  std::vector<uint8_t> part;
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
  void lose(int rank, const std::string& why);
  void broadcast(const Msg& m, int except);
  void send_to(int rank, const Msg& m);
  void flush(int rank);
  void drain();
  void check_deadlines();
  std::string missing_ranks() const;

  tcp::Fd listener_;
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

void Root::run() {
  bool released = false;
  while (!finished() && !life_->stop_requested() && !(released = release_requested())) poll_once();
  if (life_->stop_requested()) tell_stopping();
  drain();
  end_release(released);
  log_strangers();
  life_->done();
  FXM_DEBUG(-1, "bootstrap root " + wire::mesh_id_hex(id_.mesh_id) + " exits");
}

// release_root() asked: an id no rank has joined ends now; one in use goes on.
bool Root::release_requested() {
  if (!release_->requested()) return false;
  if (joined_ == 0) return true;
  release_->decline();
  return false;
}

// The root ends: its port closes before release_root() hears of it.
void Root::end_release(bool released) {
  unregister_root(id_.mesh_id);
  listener_.reset();
  pending_.clear();
  if (released) FXM_DEBUG(-1, "bootstrap root " + wire::mesh_id_hex(id_.mesh_id) + " released unused");
  release_->finished(released);
}

// A rank that left (BYE), failed or was lost: nothing more is read or written.
void Root::retire(int rank) {
  Client& c = clients_[rank];
  c.gone = true;
  c.fd.reset();
  c.out.clear();
  c.out_off = 0;
  life_->left(rank);
}

// The process exits and its wait for the connected ranks expired: say why the
// root goes away (drain() gives it a moment to reach them).
void Root::tell_stopping() {
  std::string why = life_->stop_reason();
  broadcast({MsgType::kError, Code::kPeerLost, -1, seq_, {why.begin(), why.end()}}, -1);
}

bool Root::finished() const {
  if (failed_) return true;
  if (!fatal_.empty()) {  // done once every rank was told and the joined ones left
    for (size_t r = 0; r < told_.size(); ++r) {
      if (!told_[r] || (clients_[r].joined && !clients_[r].gone)) return false;
    }
    return true;
  }
  if (nranks_ == 0 || joined_ < static_cast<int>(nranks_)) return false;
  for (const Client& c : clients_) {
    if (!c.gone) return false;
  }
  return true;
}

void Root::poll_once() {
  std::vector<pollfd> fds;
  if (listener_) fds.push_back({listener_.get(), POLLIN, 0});
  for (const Pending& p : pending_) fds.push_back({p.fd.get(), POLLIN, 0});
  for (const Client& c : clients_) {
    short events = POLLIN | (c.queued() ? POLLOUT : 0);
    if (c.joined && !c.gone) fds.push_back({c.fd.get(), events, 0});
  }
  ::poll(fds.data(), fds.size(), 100);
  accept_all();
  for (size_t i = pending_.size(); i-- > 0;) on_pending(i);
  for (size_t r = 0; r < clients_.size(); ++r) {
    if (clients_[r].joined && !clients_[r].gone) flush(static_cast<int>(r));
    if (clients_[r].joined && !clients_[r].gone) on_client(static_cast<int>(r));
  }
  check_deadlines();
}

void Root::accept_all() {
  for (int taken = 0; listener_ && taken < kAcceptBatch; ++taken) {
    tcp::SockAddr from;
    int err = 0;
    tcp::Fd fd = tcp::accept_one(listener_.get(), &from, &err);
    if (!fd) return;
    if (pending_.size() >= kMaxPending) make_room();
    pending_.push_back({std::move(fd), Deadline::after_seconds(kJoinHeaderTimeoutS), {}});
    on_pending(pending_.size() - 1);  // a rank's hello is usually there already
  }
}

// Closes the oldest pending connection that has not sent a valid hello (else
// the oldest of all): a flood of idle or garbage connections cannot crowd out
// a rank that is halfway through its handshake.
void Root::make_room() {
  size_t victim = 0;
  for (size_t i = 0; i < pending_.size(); ++i) {
    if (!pending_[i].challenged) {
      victim = i;
      break;
    }
  }
  pending_.erase(pending_.begin() + static_cast<long>(victim));
  ++strangers_[static_cast<size_t>(Step::kOverflow)];
}

void Root::on_pending(size_t i) {
  Step st = step_pending(pending_[i]);
  if (st == Step::kWait) return;
  if (st != Step::kDone) {
    ++strangers_[static_cast<size_t>(st)];
    FXM_DEBUG(-1, std::string("bootstrap root: closed an unproved connection (") + kStepNames[static_cast<int>(st)] + ")");
  }
  pending_.erase(pending_.begin() + static_cast<long>(i));
}

// Reads what the current step of the handshake expects; acts on it once whole.
Step Root::step_pending(Pending& p) {
  if (p.deadline.expired()) return Step::kSilent;
  size_t payload = p.challenged ? kJoinPayload : kHelloPayload;
  size_t whole = kMsgHeaderSize + payload;
  uint8_t tmp[kMsgHeaderSize + kHelloPayload];
  tcp::IoResult r = tcp::read_some(p.fd.get(), tmp, whole - p.buf.size());
  p.buf.insert(p.buf.end(), tmp, tmp + r.done);
  if (!r.ok()) return Step::kClosed;
  Msg m;
  uint64_t len = 0;
  MsgType want = p.challenged ? MsgType::kJoin : MsgType::kHello;
  if (p.buf.size() >= kMsgHeaderSize &&
      (!decode_header(p.buf.data(), &m, &len) || m.type != want || len != payload)) {
    return Step::kGarbage;
  }
  if (p.buf.size() < whole) return Step::kWait;
  m.payload.assign(p.buf.begin() + kMsgHeaderSize, p.buf.end());
  p.buf.clear();
  return p.challenged ? on_join(p, m) : on_hello(p, m);
}

// Answers a hello of this mesh with the root's nonce and its proof of the key
// (of the epoch the rank names: a rank of another epoch is told so later).
Step Root::on_hello(Pending& p, const Msg& m) {
  if (!decode_hello(m.payload, &p.info) || p.info.mesh_id != id_.mesh_id || p.info.version != kProtoVersion) {
    return Step::kForeign;
  }
  p.hello = m;
  crypto::random_bytes(p.nonce.data(), p.nonce.size());
  ChallengeInfo c{p.nonce, root_proof(id_.key_for(p.info.epoch), m, p.nonce)};
  Msg out{MsgType::kChallenge, Code::kOk, m.rank, 0, encode_challenge(c)};
  if (!send_msg(p.fd.get(), out, Deadline::after_seconds(0.1)).ok()) return Step::kClosed;
  p.challenged = true;
  return Step::kWait;
}

Step Root::on_join(Pending& p, const Msg& m) {
  JoinInfo j;
  if (!decode_join(m.payload, &j)) return Step::kGarbage;
  wire::Mac want = join_proof(id_.key_for(p.info.epoch), p.hello, p.nonce, j.nranks, j.timeout_ms);
  if (!crypto::equal_ct(want.data(), j.mac.data(), want.size())) return Step::kBadAuth;
  admit(p, j);
  return Step::kDone;
}

// Why a join that proved the key is refused ("" when it is not).
std::string Root::refusal(int rank, uint32_t epoch, const JoinInfo& j) const {
  std::string r = "rank " + std::to_string(rank);
  if (epoch != id_.epoch) {
    return r + " joined with epoch " + std::to_string(epoch) + ", but the unique id is of epoch " +
           std::to_string(id_.epoch) + " (a rank of another run of the job)";
  }
  if (j.nranks == 0 || j.nranks > kMaxRanks)
    return "nranks=" + std::to_string(j.nranks) + " is outside [1, " + std::to_string(kMaxRanks) + "]";
  if (nranks_ != 0 && j.nranks != nranks_)
    return r + " joined with nranks=" + std::to_string(j.nranks) + " but others use nranks=" + std::to_string(nranks_);
  if (rank < 0 || static_cast<uint32_t>(rank) >= j.nranks)
    return r + " out of range for nranks=" + std::to_string(j.nranks);
  return "";
}

void Root::refuse(Pending& p, Code code, int rank, const std::string& why) {
  Msg err{MsgType::kError, code, rank, 0, {why.begin(), why.end()}};
  send_msg(p.fd.get(), err, Deadline::after_seconds(1));
  FXM_WARN(-1, "bootstrap root refused a join: " + why);
}

// Two processes claim one rank: every rank, joined or still to come, fails
// with an error naming it (the first joiner would otherwise win silently).
void Root::fail_duplicate(Pending& p, int rank) {
  fatal_rank_ = rank;
  fatal_ = "rank " + std::to_string(rank) + " joined the bootstrap root twice: two processes were started as rank " +
           std::to_string(rank) + " (check the launcher); the build fails on every rank";
  FXM_WARN(-1, "bootstrap root: " + fatal_);
  Msg err{MsgType::kError, Code::kInvalidArgument, rank, seq_, {fatal_.begin(), fatal_.end()}};
  send_msg(p.fd.get(), err, Deadline::after_seconds(1));
  broadcast(err, -1);
  for (size_t r = 0; r < clients_.size(); ++r) told_[r] = told_[r] || clients_[r].joined;
}

void Root::admit(Pending& p, const JoinInfo& j) {
  int rank = p.hello.rank;
  std::string why = refusal(rank, p.info.epoch, j);
  if (!why.empty()) return refuse(p, Code::kInvalidArgument, rank, why);
  if (!fatal_.empty()) {
    refuse(p, Code::kInvalidArgument, fatal_rank_, fatal_);
    told_[rank] = true;
    return;
  }
  if (nranks_ != 0 && clients_[rank].joined) return fail_duplicate(p, rank);
  if (nranks_ == 0) {
    nranks_ = j.nranks;
    clients_.resize(nranks_);
    told_.assign(nranks_, false);
    timeout_s_ = j.timeout_ms / 1000.0;
    join_deadline_ = Deadline::never();  // from now on the ranks' deadlines bound the wait
  }
  // Expire a little before the earliest rank's own deadline, so that ranks
  // hear which ranks are missing rather than a bare timeout.
  double left = j.timeout_ms / 1000.0;
  join_deadline_ = join_deadline_.min(Deadline::after_seconds(left - std::min(1.0, left / 10)));
  Client& c = clients_[rank];
  c.fd = std::move(p.fd);
  c.joined = true;
  send_to(rank, Msg{MsgType::kAdmitted, Code::kOk, rank, 0, {}});  // before anything held for it
  life_->joined(rank, j.timeout_ms / 1000.0);
  for (const Msg& held : c.held) send_to(rank, held);
  c.held.clear();
  c.held_bytes = 0;
  ++joined_;
}

void Root::log_strangers() const {
  std::string s;
  for (int k = static_cast<int>(Step::kSilent); k < static_cast<int>(Step::kCount); ++k) {
    if (strangers_[k]) s += (s.empty() ? "" : ", ") + std::to_string(strangers_[k]) + " " + kStepNames[k];
  }
  if (!s.empty()) FXM_INFO(-1, "bootstrap root: closed connections that did not prove the key: " + s);
}

void Root::on_client(int rank) {
  Client& c = clients_[rank];
  pollfd pfd{c.fd.get(), POLLIN, 0};
  if (::poll(&pfd, 1, 0) <= 0) return;
  Msg m;
  tcp::IoResult r = recv_msg(c.fd.get(), &m, Deadline::after_seconds(kWriteTimeoutS));
  if (!r.ok()) {
    lose(rank, "rank " + std::to_string(rank) +
                   " was lost: its bootstrap connection closed (" + r.describe() +
                   "; the process exited, crashed or was killed)");
    return;
  }
  switch (m.type) {
    case MsgType::kAllgather: on_allgather(rank, m); break;
    case MsgType::kSend: on_relay(rank, m); break;
    case MsgType::kAbortReq:  // the rank failed and closes right after
      retire(rank);
      lost_.push_back(rank);
      broadcast({MsgType::kAbort, m.code, rank, 0, m.payload}, rank);
      maybe_complete();
      break;
    case MsgType::kBye:  // the rank closed: a later collective cannot complete
      retire(rank);
      if (first_left_ < 0) first_left_ = rank;
      maybe_complete();
      break;
    default:
      lose(rank, "rank " + std::to_string(rank) + " sent an unexpected bootstrap message");
  }
}

void Root::on_allgather(int rank, Msg& m) {
  Client& c = clients_[rank];
  if (m.seq != seq_ || c.contributed) {
    lose(rank, "rank " + std::to_string(rank) + " is out of step in bootstrap collective " +
                   std::to_string(seq_) + " (sent " + std::to_string(m.seq) + ")");
    return;
  }
  c.contributed = true;
  c.refused = m.code == Code::kInvalidArgument;
  c.part = std::move(m.payload);
  maybe_complete();
}

// Forwards a point-to-point message. A rank that is gone gets nothing; one that
// has not joined yet gets it when it joins. The client checks the range too.
void Root::on_relay(int src, Msg& m) {
  int dst = m.rank;
  if (m.payload.size() > kMaxRelayPayload) {
    lose(src, "rank " + std::to_string(src) + " relayed " + std::to_string(m.payload.size()) +
                  " bytes, above the relay limit of " + std::to_string(kMaxRelayPayload));
    return;
  }
  if (dst < 0 || static_cast<uint32_t>(dst) >= nranks_) {
    lose(src, "rank " + std::to_string(src) + " relayed a message to rank " + std::to_string(dst) +
                  ", outside [0, " + std::to_string(nranks_) + ")");
    return;
  }
  Msg out{MsgType::kDeliver, Code::kOk, src, m.seq, std::move(m.payload)};
  Client& d = clients_[dst];
  if (d.gone) return;
  if (d.joined) {
    send_to(dst, out);
  } else if (d.held.size() < kMaxHeld && d.held_bytes + out.payload.size() <= kMaxHeldBytes) {
    d.held_bytes += out.payload.size();
    d.held.push_back(std::move(out));
  } else {
    FXM_WARN(-1, "bootstrap root: dropped a message from rank " + std::to_string(src) + " to rank " +
                     std::to_string(dst) + " (too many held before it joined)");
  }
}

void Root::maybe_complete() {
  if (joined_ < static_cast<int>(nranks_)) return;
  if (!lost_.empty()) {
    fail_pending(lost_.front(), "bootstrap collective failed: rank " + std::to_string(lost_.front()) +
                                    " failed or was lost");
    return;
  }
  if (first_left_ >= 0) {
    fail_pending(first_left_, "bootstrap collective #" + std::to_string(seq_) + " cannot complete: rank " +
                                  std::to_string(first_left_) + " left (closed its mesh or bootstrap)");
    return;
  }
  for (const Client& c : clients_) {
    if (!c.contributed) return;
  }
  if (refuse_oversized()) return;
  std::vector<std::vector<uint8_t>> parts;
  for (const Client& c : clients_) parts.push_back(c.part);
  Msg res{MsgType::kResult, Code::kOk, -1, seq_, encode_result(parts)};
  for (size_t r = 0; r < clients_.size(); ++r) {
    clients_[r].contributed = false;
    clients_[r].part.clear();
    send_to(static_cast<int>(r), res);
  }
  if (++seq_ >= kListenCollectives) listener_.reset();  // no strangers after this
}

// Every rank has contributed: when a rank refused its part, or the result
// would not fit kMaxPayload, every rank gets kError(kInvalidArgument) for this
// collective instead of its result, and the next collective goes on.
bool Root::refuse_oversized() {
  int rank = -1;
  std::string why;
  uint64_t total = 0;
  for (size_t r = 0; r < clients_.size(); ++r) {
    total += 8 + clients_[r].part.size();
    if (clients_[r].refused && rank < 0) {
      rank = static_cast<int>(r);
      why = std::string(clients_[r].part.begin(), clients_[r].part.end());
    }
  }
  if (rank < 0 && total <= kMaxPayload) return false;
  if (rank < 0) {
    rank = 0;
    for (size_t r = 1; r < clients_.size(); ++r) {
      if (clients_[r].part.size() > clients_[rank].part.size()) rank = static_cast<int>(r);
    }
    why = "the result would be " + std::to_string(total) + " bytes, above the root's reply limit of " +
          std::to_string(kMaxPayload) + " (rank " + std::to_string(rank) + " contributed the most, " +
          std::to_string(clients_[rank].part.size()) + " bytes)";
  }
  Msg refusal{MsgType::kError, Code::kInvalidArgument, rank, seq_, {why.begin(), why.end()}};
  for (size_t r = 0; r < clients_.size(); ++r) {
    clients_[r].contributed = clients_[r].refused = false;
    clients_[r].part.clear();
    send_to(static_cast<int>(r), refusal);
  }
  if (++seq_ >= kListenCollectives) listener_.reset();  // as after a result
  return true;
}

// Answers every rank waiting in the current collective with `why`, naming `rank`.
void Root::fail_pending(int rank, const std::string& why) {
  for (size_t r = 0; r < clients_.size(); ++r) {
    if (clients_[r].contributed && !clients_[r].gone) {
      send_to(static_cast<int>(r), {MsgType::kError, Code::kPeerLost, rank, seq_, {why.begin(), why.end()}});
      clients_[r].contributed = clients_[r].refused = false;
    }
  }
}

void Root::lose(int rank, const std::string& why) {
  Client& c = clients_[rank];
  if (c.gone) return;
  retire(rank);
  lost_.push_back(rank);
  FXM_INFO(-1, "bootstrap root: " + why);
  broadcast({MsgType::kAbort, Code::kPeerLost, rank, 0, {why.begin(), why.end()}}, rank);
  maybe_complete();
}

void Root::broadcast(const Msg& m, int except) {
  for (size_t r = 0; r < clients_.size(); ++r) {
    if (static_cast<int>(r) != except && clients_[r].joined && !clients_[r].gone) {
      send_to(static_cast<int>(r), m);
    }
  }
}

// Queues m for the rank and writes what the socket takes now; the rest goes
// out as the rank reads (POLLOUT in poll_once). A rank that cannot be written
// to, or lets kMaxQueuedBytes pile up, is lost and the others are told.
void Root::send_to(int rank, const Msg& m) {
  Client& c = clients_[rank];
  if (c.gone) return;
  if (c.queued() + kMsgHeaderSize + m.payload.size() > kMaxQueuedBytes) {
    lose(rank, "rank " + std::to_string(rank) + " was lost: it does not read from the bootstrap root (" +
                   std::to_string(c.queued()) + " bytes queued for it)");
    return;
  }
  append_msg(m, &c.out);
  flush(rank);
}

void Root::flush(int rank) {
  Client& c = clients_[rank];
  while (!c.gone && c.queued() > 0) {
    tcp::IoResult r = tcp::write_some(c.fd.get(), c.out.data() + c.out_off, c.queued());
    c.out_off += r.done;
    if (!r.ok()) {
      lose(rank, "rank " + std::to_string(rank) + " was lost: the bootstrap root could not write to it (" +
                     r.describe() + ")");
      return;
    }
    if (r.done == 0) break;  // the socket is full: the rest when it polls writable
  }
  if (c.queued() == 0) {
    c.out.clear();
    c.out_off = 0;
  } else if (c.out_off > (1u << 20)) {
    c.out.erase(c.out.begin(), c.out.begin() + static_cast<long>(c.out_off));
    c.out_off = 0;
  }
}

// On exit (everyone left, or the rendezvous failed): the last notices still
// queued get a short blocking chance to reach their ranks.
void Root::drain() {
  Deadline d = Deadline::after_seconds(kDrainTimeoutS);
  for (Client& c : clients_) {
    if (!c.gone && c.fd && c.queued() > 0) tcp::write_full(c.fd.get(), c.out.data() + c.out_off, c.queued(), d);
  }
}

std::string Root::missing_ranks() const {
  std::string s;
  int count = 0;
  for (size_t r = 0; r < clients_.size(); ++r) {
    if (clients_[r].joined) continue;
    if (count++ < 32) s += (s.empty() ? "" : ", ") + std::to_string(r);
  }
  if (count > 32) s += ", ...";
  return "[" + s + "] (" + std::to_string(count) + " of " + std::to_string(nranks_) + ")";
}

void Root::check_deadlines() {
  if ((nranks_ != 0 && joined_ == static_cast<int>(nranks_)) || !join_deadline_.expired()) return;
  if (nranks_ == 0) {
    failed_ = true;  // nobody came within the idle limit
    return;
  }
  char secs[32];
  std::snprintf(secs, sizeof(secs), "%.1f", timeout_s_);
  std::string why = std::string("rendezvous timed out (build timeout ") + secs + " s): ranks " +
                    missing_ranks() + " never joined the bootstrap root";
  int first_missing = 0;
  while (clients_[first_missing].joined) ++first_missing;
  broadcast({MsgType::kError, Code::kTimeout, first_missing, 0, {why.begin(), why.end()}}, -1);
  FXM_WARN(-1, "bootstrap root: " + why);
  failed_ = true;
}

}  // namespace

void start_root(tcp::Fd listener, const UniqueId& id) {
  auto root = std::make_shared<Root>(std::move(listener), id);
  std::thread([root] { root->run(); }).detach();
}

}  // namespace fxm::bootstrap
