#include "core/mesh_builder.h"

#include <poll.h>

#include <algorithm>
#include <cstring>
#include <cstdio>
#include <set>

#include "base/log.h"
#include "base/status.h"
#include "base/fd_shortage.h"
#include "core/pending_bound.h"

namespace fxm {

uint64_t BuildStats::total_rejected() const {
  uint64_t n = 0;
  for (uint64_t v : rejected) n += v;
  return n;
}

// "3 (unsupported version: 2, wrong epoch: 1)": a rank of another build is named as such.
static std::string rejected_summary(const BuildStats& st) {
  std::string why;
  for (size_t r = 1; r < st.rejected.size(); ++r) {
    if (st.rejected[r] == 0) continue;
    why += (why.empty() ? "" : ", ") + std::string(wire::reject_name(static_cast<wire::Reject>(r))) + ": " +
           std::to_string(st.rejected[r]);
    if (r == static_cast<size_t>(wire::Reject::kBadVersion)) {
      why += " (a rank of another flagcx_mesh build? this one speaks wire version " + std::to_string(wire::kVersion) + ")";
    }
  }
  return std::to_string(st.total_rejected()) + (why.empty() ? "" : " (" + why + ")");
}

namespace {

using wire::kAnswerSize;
using wire::kConnHeaderSize;
using wire::kHelloSize;
constexpr double kConnectAttemptS = 5.0;
// Connections taken from the listener per poll round: every accepted one is
// read at least once before a flood can push it out of the pending table.
constexpr int kAcceptBatch = 64;

struct Outgoing {
  enum State { kQueued, kConnecting, kAwaitAck, kAwaitConfirm, kBackoff, kDone } state = kQueued;
  int peer = 0;
  int ctx = 0;
  tcp::Fd fd;
  Deadline attempt;
  Clock::time_point retry_at;
  uint8_t hello[kHelloSize];  // our header + nonce, as sent
  uint8_t ack[kAnswerSize];   // the acceptor's header + nonce + MAC
  size_t got = 0;
  int backoff_ms = 5;
  std::string last_error;
};

// An accepted connection until it proved the key: hello (its header + nonce),
// our answer (header + nonce + MAC), then its proof.
struct Incoming {
  tcp::Fd fd;
  tcp::SockAddr from;
  Deadline deadline;
  uint8_t hello[kHelloSize];
  uint8_t answer[kHelloSize];     // our header + nonce, as sent
  uint8_t proof[wire::kProofSize];
  size_t got = 0;                 // of hello, then of proof
  bool header_ok = false;         // its header passed validate()
  bool answered = false;
  bool finished = false;
  wire::ConnHeader h;
};

class Builder {
 public:
  Builder(const BuildPlan& plan, BuildStats* stats);
  Connections run();

 private:
  int slot(int peer, int ctx) const { return peer * p_.ncontexts + ctx; }
  bool complete() const { return sends_done_ == total_ && recvs_done_ == total_; }
  wire::ConnHeader my_header(int peer, int ctx, wire::Role role) const;
  void start_connects();
  void begin_attempt(Outgoing& o);
  void retry(Outgoing& o, const std::string& why);
  void on_outgoing(Outgoing& o, short revents);
  void on_ack(Outgoing& o);
  void on_confirm(Outgoing& o);
  wire::Reject check_answer(const Outgoing& o) const;
  void accept_all();
  void on_no_descriptor(int err);
  void make_room();
  void on_incoming(Incoming& in);
  void check_hello_header(Incoming& in);
  void answer_hello(Incoming& in);
  void check_proof(Incoming& in);
  void reject(Incoming& in, wire::Reject why);
  void answer_version(Incoming& in);
  void poll_once();
  void expire_timers();
  int poll_timeout_ms(bool accept_paused) const;
  void on_bootstrap();
  [[noreturn]] void fail_timeout(const std::string& cause = "mesh build deadline expired");
  std::string who() const { return "rank " + std::to_string(p_.rank) + ": "; }

  const BuildPlan& p_;
  BuildStats* stats_;
  int total_;
  std::vector<Outgoing> out_;
  std::vector<int> order_;
  size_t next_ = 0;
  int inflight_ = 0;
  std::vector<Incoming> in_;
  Connections conns_;
  int sends_done_ = 0;
  int recvs_done_ = 0;
  FdShortage shortage_;  // out of descriptors, the listener is not polled for a while
};

Builder::Builder(const BuildPlan& plan, BuildStats* stats)
    : p_(plan), stats_(stats), total_(plan.nranks * plan.ncontexts), out_(total_) {
  conns_.send.resize(total_);
  conns_.recv.resize(total_);
  for (int i = 0; i < p_.nranks; ++i) {  // ordered pairwise rounds: peer = rank + i
    int peer = (p_.rank + i) % p_.nranks;
    for (int c = 0; c < p_.ncontexts; ++c) {
      Outgoing& o = out_[slot(peer, c)];
      o.peer = peer;
      o.ctx = c;
      order_.push_back(slot(peer, c));
    }
  }
  in_.reserve(64);
}

wire::ConnHeader Builder::my_header(int peer, int ctx, wire::Role role) const {
  wire::ConnHeader h;
  h.role = role;
  h.mesh_id = p_.mesh_id;
  h.epoch = p_.epoch;
  h.src = p_.rank;
  h.dst = peer;
  h.context = static_cast<uint32_t>(ctx);
  h.nranks = static_cast<uint32_t>(p_.nranks);
  h.ncontexts = static_cast<uint32_t>(p_.ncontexts);
  return h;
}

Connections Builder::run() {
  while (!complete()) {
    if (p_.deadline.expired()) fail_timeout();
    start_connects();
    poll_once();
    expire_timers();
  }
  // Connections still unidentified when the build ends are closed: count them.
  for (Incoming& in : in_) {
    if (!in.finished) reject(in, wire::Reject::kSilent);
  }
  return std::move(conns_);
}

void Builder::start_connects() {
  while (inflight_ < p_.max_inflight && next_ < order_.size()) {
    begin_attempt(out_[order_[next_++]]);
  }
  for (Outgoing& o : out_) {
    if (o.state == Outgoing::kBackoff && Clock::now() >= o.retry_at) begin_attempt(o);
  }
}

void Builder::begin_attempt(Outgoing& o) {
  if (o.state == Outgoing::kQueued) ++inflight_;
  int err = 0;
  o.fd = tcp::connect_start(p_.peers[o.peer], &err);
  o.got = 0;
  if (!o.fd) {
    retry(o, "connect: " + errno_text(err));
    return;
  }
  o.state = Outgoing::kConnecting;
  o.attempt = Deadline::after_seconds(kConnectAttemptS);
}

void Builder::retry(Outgoing& o, const std::string& why) {
  o.fd.reset();
  o.last_error = why;
  o.state = Outgoing::kBackoff;
  o.retry_at = Clock::now() + std::chrono::milliseconds(o.backoff_ms);
  o.backoff_ms = std::min(o.backoff_ms * 2, 1000);
  ++stats_->connect_retries;
  FXM_DEBUG(p_.rank, "retrying connection to peer " + std::to_string(o.peer) + " ctx " +
                         std::to_string(o.ctx) + ": " + why);
}

void Builder::on_outgoing(Outgoing& o, short revents) {
  if (o.state == Outgoing::kConnecting) {
    int err = tcp::connect_error(o.fd.get());
    if (err != 0) return retry(o, "connect to " + p_.peers[o.peer].str() + ": " + errno_text(err));
    wire::encode(my_header(o.peer, o.ctx, wire::Role::kConnect), o.hello);
    crypto::random_bytes(o.hello + kConnHeaderSize, wire::kNonceSize);
    tcp::IoResult r = tcp::write_full(o.fd.get(), o.hello, kHelloSize, Deadline::after_seconds(1));
    if (!r.ok()) return retry(o, "sending the connection header: " + r.describe());
    o.state = Outgoing::kAwaitAck;
  } else if (o.state == Outgoing::kAwaitAck && (revents & (POLLIN | POLLHUP | POLLERR))) {
    on_ack(o);
  } else if (o.state == Outgoing::kAwaitConfirm && (revents & (POLLIN | POLLHUP | POLLERR))) {
    on_confirm(o);
  }
}

// The acceptor's header must name this connection, and its MAC prove the key
// over both nonces (so neither an impostor nor a recording can answer).
wire::Reject Builder::check_answer(const Outgoing& o) const {
  wire::ConnHeader h;
  wire::Expect e{p_.mesh_id, p_.epoch, p_.rank, static_cast<uint32_t>(p_.nranks),
                 static_cast<uint32_t>(p_.ncontexts), wire::Role::kAccept};
  wire::Reject why = wire::decode(o.ack, &h);
  if (why == wire::Reject::kNone) why = wire::validate(h, e);
  if (why == wire::Reject::kNone && (h.src != o.peer || h.context != static_cast<uint32_t>(o.ctx))) {
    why = wire::Reject::kWrongDst;
  }
  if (why != wire::Reject::kNone) return why;
  wire::Mac mac = wire::handshake_mac(p_.key, wire::Role::kAccept, o.hello, o.ack);
  bool ok = crypto::equal_ct(mac.data(), o.ack + kHelloSize, mac.size());
  return ok ? wire::Reject::kNone : wire::Reject::kBadAuth;
}

void Builder::on_ack(Outgoing& o) {
  tcp::IoResult r = tcp::read_some(o.fd.get(), o.ack + o.got, kAnswerSize - o.got);
  o.got += r.done;
  if (!r.ok()) return retry(o, "peer closed the connection before answering: " + r.describe());
  if (o.got < kAnswerSize) return;
  wire::Reject why = check_answer(o);
  if (why != wire::Reject::kNone) {
    fail(Code::kProtocol, o.peer, 0,
         who() + "the listener at " + p_.peers[o.peer].str() + " published for peer " +
             std::to_string(o.peer) + " answered with a bad header (" + wire::reject_name(why) +
             "); is that address used by another process?");
  }
  wire::Mac proof = wire::handshake_mac(p_.key, wire::Role::kConnect, o.hello, o.ack);
  r = tcp::write_full(o.fd.get(), proof.data(), proof.size(), Deadline::after_seconds(1));
  if (!r.ok()) return retry(o, "sending the key proof: " + r.describe());
  o.state = Outgoing::kAwaitConfirm;
}

// The acceptor filed the connection (its confirm byte), or closed it: it judged our proof late
// (past its header timeout: a proof that lost packets) or wrong, and we connect again. Counted
// done on the proof alone, a connection the acceptor dropped left its slot empty for good.
void Builder::on_confirm(Outgoing& o) {
  uint8_t confirm = 0;
  tcp::IoResult r = tcp::read_some(o.fd.get(), &confirm, 1);
  if (r.ok() && r.done == 0) return;  // (woken with nothing to read)
  if (!r.ok() || confirm != wire::kConfirmByte) {
    return retry(o, r.ok() ? "the acceptor's confirmation was not its confirm byte"
                           : "the acceptor closed the connection after our key proof (too late for its "
                             "header timeout, or refused): " + r.describe());
  }
  conns_.send[slot(o.peer, o.ctx)] = std::move(o.fd);
  o.state = Outgoing::kDone;
  --inflight_;
  ++sends_done_;
}

void Builder::accept_all() {
  for (int taken = 0; taken < kAcceptBatch; ++taken) {
    Incoming in;
    int err = 0;
    in.fd = tcp::accept_one(p_.listen_fd, &in.from, &err);
    if (!in.fd) {
      if (FdShortage::no_descriptor(err)) return on_no_descriptor(err);
      if (err != 0 && err != ECONNABORTED && err != EINTR) {
        FXM_WARN(p_.rank, "accept on the mesh listener failed: " + errno_text(err));
      }
      return;
    }
    std::string shortage = shortage_.ended();
    if (!shortage.empty()) FXM_WARN(p_.rank, "the mesh listener accepts again, after " + shortage);
    in.deadline = Deadline::after_seconds(p_.header_timeout_s);
    make_room();
    in_.push_back(std::move(in));
    on_incoming(in_.back());  // a peer's hello is usually there already
  }
}

// Out of descriptors: said once per episode, the listener left unpolled for a pause that doubles
// while accept keeps failing (before, the loop retried at once, as fast as it ran, with a warning
// each time).
void Builder::on_no_descriptor(int err) {
  ++stats_->accept_fd_exhausted;
  if (shortage_.failed()) {
    FXM_WARN(p_.rank, "accept on the mesh listener failed: " + errno_text(err) +
                          "; peers' connections wait in the backlog until descriptors are freed (" +
                          FdShortage::retry_text() + ")");
  }
}

// Beyond the bound of connections that did not prove the key yet, closes one
// (core/pending_bound.h). Marks only (poll_once indexes in_ while it dispatches).
void Builder::make_room() {
  if (Incoming* victim = pending_victim(in_, static_cast<size_t>(4 * total_ + 256))) {
    reject(*victim, wire::Reject::kOverflow);
  }
}

void Builder::on_incoming(Incoming& in) {
  if (in.finished) return;
  size_t want = in.answered ? wire::kProofSize : kHelloSize;
  uint8_t* buf = in.answered ? in.proof : in.hello;
  tcp::IoResult r = tcp::read_some(in.fd.get(), buf + in.got, want - in.got);
  in.got += r.done;
  if (!r.ok()) return reject(in, wire::Reject::kTruncated);
  if (!in.answered && !in.header_ok && in.got >= kConnHeaderSize) check_hello_header(in);
  if (in.finished || in.got < want) return;
  if (in.answered) return check_proof(in);
  answer_hello(in);
}

// Judged as soon as the 64 header bytes are in (before its nonce).
void Builder::check_hello_header(Incoming& in) {
  wire::Expect e{p_.mesh_id, p_.epoch, p_.rank, static_cast<uint32_t>(p_.nranks),
                 static_cast<uint32_t>(p_.ncontexts), wire::Role::kConnect};
  wire::Reject why = wire::decode(in.hello, &in.h);
  if (why == wire::Reject::kNone) why = wire::validate(in.h, e);
  if (why == wire::Reject::kNone && conns_.recv[slot(in.h.src, in.h.context)]) why = wire::Reject::kDuplicate;
  if (why == wire::Reject::kBadVersion) answer_version(in);
  if (why != wire::Reject::kNone) return reject(in, why);
  in.header_ok = true;
}

// A connector of another wire version gets an answer of its size whose header carries this
// build's version (and no mesh id, nonce or proof): a rank of an older build then fails at once,
// saying the listener "answered with a bad header (unsupported version)", instead of retrying
// until its build deadline.
void Builder::answer_version(Incoming& in) {
  wire::ConnHeader h;
  h.role = wire::Role::kAccept;
  h.src = p_.rank;
  uint8_t out[kAnswerSize] = {};
  wire::encode(h, out);
  tcp::write_full(in.fd.get(), out, sizeof(out), Deadline::after_seconds(0.2));  // best effort
}

// Our header, a fresh nonce and our proof over both nonces; its proof is next.
void Builder::answer_hello(Incoming& in) {
  wire::encode(my_header(in.h.src, static_cast<int>(in.h.context), wire::Role::kAccept), in.answer);
  crypto::random_bytes(in.answer + kConnHeaderSize, wire::kNonceSize);
  uint8_t out[kAnswerSize];
  std::memcpy(out, in.answer, kHelloSize);
  wire::Mac mac = wire::handshake_mac(p_.key, wire::Role::kAccept, in.hello, in.answer);
  std::memcpy(out + kHelloSize, mac.data(), mac.size());
  tcp::IoResult r = tcp::write_full(in.fd.get(), out, sizeof(out), Deadline::after_seconds(1));
  if (!r.ok()) return reject(in, wire::Reject::kTruncated);
  in.answered = true;
  in.got = 0;
}

// A proven connection is filed and confirmed to its connector (one byte), which counts it only
// then (on_confirm).
void Builder::check_proof(Incoming& in) {
  wire::Mac want = wire::handshake_mac(p_.key, wire::Role::kConnect, in.hello, in.answer);
  if (!crypto::equal_ct(want.data(), in.proof, want.size())) return reject(in, wire::Reject::kBadAuth);
  if (conns_.recv[slot(in.h.src, static_cast<int>(in.h.context))]) return reject(in, wire::Reject::kDuplicate);
  const uint8_t confirm = wire::kConfirmByte;
  tcp::IoResult r = tcp::write_full(in.fd.get(), &confirm, 1, Deadline::after_seconds(1));
  if (!r.ok()) return reject(in, wire::Reject::kTruncated);
  conns_.recv[slot(in.h.src, static_cast<int>(in.h.context))] = std::move(in.fd);
  in.finished = true;
  ++recvs_done_;
}

void Builder::reject(Incoming& in, wire::Reject why) {
  ++stats_->rejected[static_cast<size_t>(why)];
  FXM_INFO(p_.rank, "closed a connection from " + in.from.str() + " to the mesh listener: " +
                        wire::reject_name(why));
  in.fd.reset();
  in.finished = true;
}

void Builder::poll_once() {
  std::vector<pollfd> fds;
  std::vector<int> owner;  // -1 listener, -2 bootstrap, >=0 outgoing slot, <=-3 incoming
  bool paused = shortage_.paused();  // one look a round: the fd left out and the timeout agree
  fds.push_back({paused ? -1 : p_.listen_fd, POLLIN, 0});  // a negative fd is not polled
  owner.push_back(-1);
  if (p_.bootstrap_fd >= 0) {
    fds.push_back({p_.bootstrap_fd, POLLIN, 0});
    owner.push_back(-2);
  }
  for (int s = 0; s < total_; ++s) {
    const Outgoing& o = out_[s];
    if (o.state != Outgoing::kConnecting && o.state != Outgoing::kAwaitAck && o.state != Outgoing::kAwaitConfirm) {
      continue;
    }
    fds.push_back({o.fd.get(), static_cast<short>(o.state == Outgoing::kConnecting ? POLLOUT : POLLIN), 0});
    owner.push_back(s);
  }
  for (size_t i = 0; i < in_.size(); ++i) {
    fds.push_back({in_[i].fd.get(), POLLIN, 0});
    owner.push_back(-3 - static_cast<int>(i));
  }
  int rc = ::poll(fds.data(), fds.size(), poll_timeout_ms(paused));
  if (rc < 0 && errno != EINTR) fail(Code::kSystem, -1, errno, who() + "poll during mesh build");
  for (size_t k = 0; rc > 0 && k < fds.size(); ++k) {
    if (fds[k].revents == 0) continue;
    if (owner[k] == -1) accept_all();
    else if (owner[k] == -2) on_bootstrap();
    else if (owner[k] >= 0) on_outgoing(out_[owner[k]], fds[k].revents);
    else on_incoming(in_[-3 - owner[k]]);
  }
  in_.erase(std::remove_if(in_.begin(), in_.end(), [](const Incoming& i) { return i.finished; }),
            in_.end());
}

int Builder::poll_timeout_ms(bool accept_paused) const {
  Deadline next = p_.deadline.min(Deadline::after_seconds(0.1));
  if (accept_paused) next = next.min(shortage_.resume());
  for (const Outgoing& o : out_) {
    if (o.state == Outgoing::kBackoff) {
      Deadline d;
      d = Deadline::after_seconds(std::chrono::duration<double>(o.retry_at - Clock::now()).count());
      next = next.min(d);
    }
  }
  return next.poll_ms();
}

void Builder::expire_timers() {
  for (Incoming& in : in_) {
    if (!in.finished && in.deadline.expired()) reject(in, wire::Reject::kSilent);
  }
  for (Outgoing& o : out_) {
    // Only unanswered SYNs are retried; a connection already carrying our
    // header waits for its answer (a retry could leave a stale twin behind).
    if (o.state == Outgoing::kConnecting && o.attempt.expired()) {
      retry(o, "connect to " + p_.peers[o.peer].str() + " did not complete within 5 s");
    }
  }
}

// The root pushed a failure notice. When another rank's build deadline
// expired first, report what THIS rank is missing (naming the peers at fault)
// rather than blaming the rank that happened to time out first.
void Builder::on_bootstrap() {
  try {
    p_.on_bootstrap_readable();
  } catch (const Error& e) {
    if (e.code() != Code::kTimeout || complete()) throw;
    fail_timeout("mesh build deadline expired on rank " + std::to_string(e.peer()));
  }
}

void Builder::fail_timeout(const std::string& cause) {
  std::set<int> peers;
  std::string missing;
  int count = 0;
  auto add = [&](const std::string& item, int peer) {
    peers.insert(peer);
    if (++count <= 16) missing += (missing.empty() ? "" : ", ") + item;
  };
  for (int s = 0; s < total_; ++s) {
    const Outgoing& o = out_[s];
    std::string pc = "(peer " + std::to_string(o.peer) + ", ctx " + std::to_string(o.ctx) + ")";
    if (o.state != Outgoing::kDone) {
      const char* st = o.state == Outgoing::kAwaitAck       ? "no answer to our header"
                       : o.state == Outgoing::kAwaitConfirm ? "no confirmation of our key proof"
                       : o.state == Outgoing::kQueued       ? "not started"
                                                            : "connecting";
      add("send->" + pc + " [" + st + (o.last_error.empty() ? "" : "; last error: " + o.last_error) + "]",
          o.peer);
    }
    if (!conns_.recv[s]) add("recv<-" + pc + " [never arrived]", o.peer);
  }
  if (count > 16) missing += ", ... (" + std::to_string(count - 16) + " more)";
  std::string plist;
  for (int p : peers) plist += (plist.empty() ? "" : ", ") + std::to_string(p);
  fail(Code::kTimeout, *peers.begin(), 0,
       who() + cause + " with " + std::to_string(count) + " of " +
           std::to_string(2 * total_) + " connections missing; peers not connected: [" + plist +
           "]; missing: " + missing + "; foreign connections rejected: " + rejected_summary(*stats_));
}

}  // namespace

Connections build_mesh(const BuildPlan& plan, BuildStats* stats) {
  Builder b(plan, stats);
  return b.run();
}

}  // namespace fxm
