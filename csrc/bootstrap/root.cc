#include "bootstrap/root.h"

#include <poll.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "base/log.h"
#include "base/thread_name.h"
#include "bootstrap/root_state.h"

namespace fxm::bootstrap {
namespace root_impl {

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
  bool paused = shortage_.paused();  // one look a round: the fd left out and the timeout agree
  if (listener_) fds.push_back({paused ? -1 : listener_.get(), POLLIN, 0});  // -1: not polled
  for (const Pending& p : pending_) fds.push_back({p.fd.get(), POLLIN, 0});
  for (const Client& c : clients_) {
    short events = POLLIN | (c.queued() ? POLLOUT : 0);
    if (c.joined && !c.gone) fds.push_back({c.fd.get(), events, 0});
  }
  ::poll(fds.data(), fds.size(), paused ? shortage_.resume().poll_ms(100) : 100);
  if (!paused) accept_all();
  for (size_t i = pending_.size(); i-- > 0;) on_pending(i);
  for (size_t r = 0; r < clients_.size(); ++r) {
    if (clients_[r].joined && !clients_[r].gone) flush(static_cast<int>(r));
    if (clients_[r].joined && !clients_[r].gone) on_client(static_cast<int>(r));
  }
  check_deadlines();
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
  if (m.payload.size() < kCallSize || !decode_call(m.payload.data(), &c.call)) {
    lose(rank, "rank " + std::to_string(rank) + " sent bootstrap collective " + std::to_string(seq_) +
                   " without a valid call (a rank of an older protocol?)");
    return;
  }
  c.contributed = true;
  c.refused = m.code == Code::kInvalidArgument;
  c.part.assign(m.payload.begin() + kCallSize, m.payload.end());
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
  if (refuse_mismatched_calls() || refuse_oversized()) return;
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
  refuse_collective(rank, why);
  return true;
}

// Every rank has contributed: when two ranks called different collectives (a
// barrier against a registration, two kinds of registration, two windows),
// every rank fails naming both calls, and the next collective goes on.
bool Root::refuse_mismatched_calls() {
  size_t ref = 0;  // a rank that refused a registration matches any: compare with one that did not
  while (ref + 1 < clients_.size() && clients_[ref].call.kind == CallKind::kRefusedRegistration) ++ref;
  for (size_t r = 0; r < clients_.size(); ++r) {
    if (calls_match(clients_[ref].call, clients_[r].call)) continue;
    size_t a = std::min(ref, r), b = std::max(ref, r);
    std::string why = "rank " + std::to_string(a) + " called " + call_name(clients_[a].call) + " while rank " +
                      std::to_string(b) + " called " + call_name(clients_[b].call) +
                      " (every rank must make the same collective calls in the same order)";
    FXM_WARN(-1, "bootstrap root: collective #" + std::to_string(seq_) + ": " + why);
    refuse_collective(static_cast<int>(b), why);
    return true;
  }
  return false;
}

// Answers the current collective on every rank with kError(kInvalidArgument,
// `why`, naming `rank`) instead of its result; the next collective goes on.
void Root::refuse_collective(int rank, const std::string& why) {
  Msg refusal{MsgType::kError, Code::kInvalidArgument, rank, seq_, {why.begin(), why.end()}};
  for (size_t r = 0; r < clients_.size(); ++r) {
    clients_[r].contributed = clients_[r].refused = false;
    clients_[r].part.clear();
    send_to(static_cast<int>(r), refusal);
  }
  if (++seq_ >= kListenCollectives) listener_.reset();  // as after a result
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

}  // namespace root_impl

void start_root(tcp::Fd listener, const UniqueId& id) {
  auto root = std::make_shared<root_impl::Root>(std::move(listener), id);
  std::thread([root] {
    name_this_thread("fxm-root");
    root->run();
  }).detach();
}

}  // namespace fxm::bootstrap
