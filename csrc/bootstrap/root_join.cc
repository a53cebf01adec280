#include <poll.h>

#include <algorithm>
#include <string>

#include "base/log.h"
#include "base/status.h"
#include "bootstrap/root_state.h"

namespace fxm::bootstrap::root_impl {
namespace {

const char* const kStepNames[] = {"", "", "silent", "closed", "garbage", "foreign mesh",
                                  "bad authentication", "overflow"};

}  // namespace

void Root::accept_all() {
  for (int taken = 0; listener_ && taken < kAcceptBatch; ++taken) {
    tcp::SockAddr from;
    int err = 0;
    tcp::Fd fd = tcp::accept_one(listener_.get(), &from, &err);
    if (!fd) {
      if (FdShortage::no_descriptor(err)) on_no_descriptor(err);
      return;
    }
    std::string shortage = shortage_.ended();
    if (!shortage.empty()) FXM_WARN(-1, "bootstrap root: accepts again, after " + shortage);
    if (pending_.size() >= kMaxPending) make_room();
    pending_.push_back({std::move(fd), Deadline::after_seconds(kJoinHeaderTimeoutS), {}});
    on_pending(pending_.size() - 1);  // a rank's hello is usually there already
  }
}

// Out of descriptors: said once per episode, the listener left unpolled for a pause that doubles
// while accept keeps failing (before, the root's loop polled it again at once, as fast as it ran).
void Root::on_no_descriptor(int err) {
  if (shortage_.failed()) {
    FXM_WARN(-1, "bootstrap root: accept failed: " + errno_text(err) +
                     "; joins wait in the backlog until descriptors are freed (" + FdShortage::retry_text() + ")");
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
}  // namespace fxm::bootstrap::root_impl
