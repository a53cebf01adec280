#include "bootstrap/client.h"

#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <thread>

#include "base/log.h"
#include "bootstrap/exit_wait.h"

namespace fxm::bootstrap {

Client::Client(const UniqueId& id, int rank, int nranks, const Deadline& deadline, int64_t epoch)
    : root_(id.root), rank_(rank), nranks_(nranks) {
  uint32_t e = epoch < 0 ? id.epoch : static_cast<uint32_t>(epoch);
  int backoff_ms = 10;
  while (!try_join(id, e, deadline)) {
    if (deadline.expired()) {
      fail(Code::kTimeout, -1, 0, "rank " + std::to_string(rank_) + ": the bootstrap root at " + root_.str() +
                                      " kept closing the connection before the join handshake was done");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(std::min(backoff_ms, deadline.poll_ms())));
    backoff_ms = std::min(backoff_ms * 2, 200);
  }
  track_client(this);
}

bool Client::try_join(const UniqueId& id, uint32_t epoch, const Deadline& deadline) {
  connect_root(deadline);
  std::string doing = "joining the bootstrap root at " + root_.str();
  HelloInfo h;
  h.mesh_id = id.mesh_id;
  h.epoch = epoch;
  crypto::random_bytes(h.nonce.data(), h.nonce.size());
  Msg hello{MsgType::kHello, Code::kOk, rank_, 0, encode_hello(h)};
  if (!send_msg(fd_.get(), hello, deadline).ok()) return false;
  Msg m;
  tcp::IoResult r = recv_msg(fd_.get(), &m, deadline.min(Deadline::after_seconds(5)));
  if (r.kind == tcp::IoResult::kClosed || (r.kind == tcp::IoResult::kTimeout && !deadline.expired())) return false;
  if (!r.ok()) raise_io(r, doing);
  crypto::Key key = id.key_for(epoch);
  ChallengeInfo c;
  if (m.type != MsgType::kChallenge || !decode_challenge(m.payload, &c) ||
      !crypto::equal_ct(c.mac.data(), root_proof(key, hello, c.nonce).data(), c.mac.size())) {
    fail(Code::kProtocol, -1, 0, "rank " + std::to_string(rank_) + ": " + doing +
                                     ": it did not prove that it holds this unique id's key (another process "
                                     "at that address, or a unique id altered on its way)");
  }
  JoinInfo j;
  j.nranks = static_cast<uint32_t>(nranks_);
  j.timeout_ms = static_cast<uint32_t>(std::clamp(deadline.seconds_left(), 0.0, 4e6) * 1000);
  j.mac = join_proof(key, hello, c.nonce, j.nranks, j.timeout_ms);
  r = send_msg(fd_.get(), {MsgType::kJoin, Code::kOk, rank_, 0, encode_join(j)}, deadline);
  if (r.kind == tcp::IoResult::kClosed) return false;
  if (!r.ok()) raise_io(r, doing);
  return admitted(doing, deadline);
}

// The root's answer to a join: filed (true), or the connection closed before
// it was (false: the root dropped the handshake, at its deadline or to make
// room; the caller joins again). A refusal raises it.
bool Client::admitted(const std::string& doing, const Deadline& deadline) {
  Msg m;
  tcp::IoResult r = recv_msg(fd_.get(), &m, deadline);
  if (r.kind == tcp::IoResult::kClosed) return false;
  if (!r.ok()) raise_io(r, doing);
  if (m.type != MsgType::kAdmitted) raise(m, doing);  // a refusal (kError) names its reason
  return true;
}

Client::~Client() {
  untrack_client(this);
  bye();
}

namespace {

// A root on another host that refuses every connection this long is taken as gone.
constexpr double kRefusedGiveUpS = 5.0;

// Whether `a` is an address of this host (binding to it works).
bool on_this_host(const tcp::SockAddr& a) {
  tcp::SockAddr probe = a, bound;
  probe.set_port(0);
  int err = 0;
  return static_cast<bool>(tcp::listen_on(probe, &bound, &err));
}

}  // namespace

// The root listens from the moment its unique id exists until its mesh is
// built (or it exits), so a refused connection means the id was used already
// or its root is gone: said at once for a root on this host, after
// kRefusedGiveUpS for a remote one (the network may refuse for a moment).
void Client::check_refused(int err, Clock::time_point* refused_since) {
  if (err != ECONNREFUSED) {
    *refused_since = Clock::time_point{};
    return;
  }
  if (*refused_since == Clock::time_point{}) *refused_since = Clock::now();
  if (!on_this_host(root_) && seconds_since(*refused_since) < kRefusedGiveUpS) return;
  fail(Code::kInvalidArgument, -1, err,
       "rank " + std::to_string(rank_) + ": the bootstrap root at " + root_.str() +
           " refused the connection: this unique id was already used (its root takes joins only until its "
           "mesh is built: a unique id, and the launcher's, serves one mesh) or the process that made it "
           "is gone; make a new unique id for a new mesh");
}

void Client::connect_root(const Deadline& deadline) {
  int backoff_ms = 10;
  int err = 0;
  Clock::time_point refused_since{};  // none yet
  while (true) {
    fd_ = tcp::connect_start(root_, &err);
    if (fd_) {
      pollfd p{fd_.get(), POLLOUT, 0};
      ::poll(&p, 1, deadline.min(Deadline::after_seconds(2)).poll_ms());
      err = p.revents ? tcp::connect_error(fd_.get()) : ETIMEDOUT;
      if (err == 0) return;
      fd_.reset();
    }
    check_refused(err, &refused_since);
    if (deadline.expired()) {
      fail(Code::kTimeout, -1, err,
           "rank " + std::to_string(rank_) + ": cannot reach the bootstrap root at " + root_.str() +
               " (the process that made the unique id must be alive and reachable)");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(std::min(backoff_ms, deadline.poll_ms())));
    backoff_ms = std::min(backoff_ms * 2, 500);
  }
}

void Client::check_open(const std::string& doing) {
  if (!fd_) fail(Code::kClosed, -1, 0, "rank " + std::to_string(rank_) + ": bootstrap is closed");
  if (!broken_.empty()) fail(Code::kProtocol, -1, 0, "rank " + std::to_string(rank_) + ": " + doing + ": " + broken_);
}

Parts Client::allgather(const std::vector<uint8_t>& mine, const Deadline& deadline, const Call& call) {
  std::lock_guard<std::mutex> lock(mu_);
  std::string doing = call_name(call) + " (bootstrap collective #" + std::to_string(seq_) + ")";
  check_open(doing);
  std::string too_big = oversized_part(mine.size());
  Msg out{MsgType::kAllgather, Code::kOk, rank_, seq_, std::vector<uint8_t>(kCallSize)};
  encode_call(call, out.payload.data());
  if (too_big.empty()) {
    out.payload.insert(out.payload.end(), mine.begin(), mine.end());
  } else {  // the others hear of it through the root, so every rank stays in step
    out.code = Code::kInvalidArgument;
    out.payload.insert(out.payload.end(), too_big.begin(), too_big.end());
  }
  write_msg(out, doing, deadline);
  Msg m = next_msg(doing, deadline);
  if (m.type == MsgType::kError && m.code == Code::kInvalidArgument && m.seq == seq_) {
    ++seq_;  // refused by the root (this rank's part or another's): the stream stays usable
    fail(Code::kInvalidArgument, m.rank, 0, "rank " + std::to_string(rank_) + ": " + doing + " refused: " + m.text());
  }
  if (m.type != MsgType::kResult || m.seq != seq_) raise(m, doing);
  Parts parts;
  if (!decode_result(m.payload, static_cast<size_t>(nranks_), &parts)) {
    fail(Code::kProtocol, -1, 0, "rank " + std::to_string(rank_) + ": " + doing + ": malformed result");
  }
  ++seq_;
  return parts;
}

// Why `size` bytes cannot be this rank's part of an allgather ("" when they can).
std::string Client::oversized_part(size_t size) const {
  uint64_t limit = max_allgather_part(static_cast<uint64_t>(nranks_));
  if (size <= limit) return "";
  return "rank " + std::to_string(rank_) + " contributed " + std::to_string(size) + " bytes, above the limit of " +
         std::to_string(limit) + " bytes per rank for " + std::to_string(nranks_) + " ranks (a result of nranks x (8 + part) bytes must fit the root's " +
         std::to_string(kMaxPayload >> 20) + " MiB reply limit)";
}

Msg Client::next_msg(const std::string& doing, const Deadline& deadline) {
  while (true) {
    Msg m;
    tcp::IoResult r = recv_msg(fd_.get(), &m, deadline);
    if (!r.ok()) {
      // Our contribution stands at the root and its late result would answer the
      // next call (or be cut in half): refuse later collectives rather than
      // return another collective's data.
      if (r.kind == tcp::IoResult::kTimeout) {
        broken_ = "collective #" + std::to_string(seq_) +
                  " timed out on this rank, so the collectives are out of step (close the mesh)";
      } else if (r.err == EPROTO) {
        broken_ = "a message from the root could not be read (bad header or above " +
                  std::to_string(kMaxPayload >> 20) + " MiB), so the stream is out of step (close the mesh)";
      }
      raise_io(r, doing);
    }
    if (m.type != MsgType::kDeliver) return m;
    stash(m);
  }
}

void Client::write_msg(const Msg& m, const std::string& doing, const Deadline& deadline) {
  std::lock_guard<std::mutex> wlock(wmu_);
  if (!fd_) fail(Code::kClosed, -1, 0, "rank " + std::to_string(rank_) + ": " + doing + ": bootstrap is closed");
  tcp::IoResult r = send_msg(fd_.get(), m, deadline);
  if (r.ok()) return;
  // Part of a message on the stream would make the next one garbage: end the
  // connection, so the root loses this rank and tells the others.
  if (r.done > 0) ::shutdown(fd_.get(), SHUT_RDWR);
  raise_io(r, doing);
}

void Client::stash(Msg& m) {
  if (inbox_bytes_ + m.payload.size() > kMaxInboxBytes) {
    fail(Code::kProtocol, m.rank, 0, "rank " + std::to_string(rank_) + ": more than " +
                                         std::to_string(kMaxInboxBytes >> 20) + " MiB of relayed messages " +
                                         "not received (the last from rank " + std::to_string(m.rank) + ", tag " +
                                         std::to_string(m.seq) + ")");
  }
  inbox_bytes_ += m.payload.size();
  inbox_[{m.rank, m.seq}].push_back(std::move(m.payload));
}

bool Client::take(int peer, uint32_t tag, std::vector<uint8_t>* out) {
  auto it = inbox_.find({peer, tag});
  if (it == inbox_.end()) return false;
  *out = std::move(it->second.front());
  it->second.pop_front();
  inbox_bytes_ -= out->size();
  if (it->second.empty()) inbox_.erase(it);
  return true;
}

void Client::send(int peer, uint32_t tag, const void* data, size_t size, const Deadline& deadline) {
  std::string doing = "bootstrap send to rank " + std::to_string(peer) + " (tag " + std::to_string(tag) + ")";
  std::string who = "rank " + std::to_string(rank_) + ": ";
  if (peer < 0 || peer >= nranks_) {
    fail(Code::kInvalidArgument, peer, 0, who + doing + ": peer outside [0, " + std::to_string(nranks_) + ")");
  }
  if (size > kMaxRelayPayload || (size > 0 && data == nullptr)) {
    fail(Code::kInvalidArgument, peer, 0, who + doing + ": bad payload (" + std::to_string(size) +
                                              " bytes; relayed messages carry at most " +
                                              std::to_string(kMaxRelayPayload) + ")");
  }
  const uint8_t* p = static_cast<const uint8_t*>(data);
  write_msg({MsgType::kSend, Code::kOk, peer, tag, std::vector<uint8_t>(p, p + size)}, doing, deadline);
}

std::vector<uint8_t> Client::recv(int peer, uint32_t tag, const Deadline& deadline) {
  std::lock_guard<std::mutex> lock(mu_);
  std::string doing = "bootstrap recv from rank " + std::to_string(peer) + " (tag " + std::to_string(tag) + ")";
  if (peer < 0 || peer >= nranks_) {
    fail(Code::kInvalidArgument, peer, 0, "rank " + std::to_string(rank_) + ": " + doing + ": peer outside [0, " +
                                              std::to_string(nranks_) + ")");
  }
  check_open(doing);
  std::vector<uint8_t> out;
  while (!take(peer, tag, &out)) {
    pollfd p{fd_.get(), POLLIN, 0};
    int rc = ::poll(&p, 1, deadline.poll_ms(1000));
    if (rc < 0 && errno != EINTR) fail(Code::kSystem, peer, errno, "rank " + std::to_string(rank_) + ": " + doing + ": poll");
    if (rc <= 0) {
      if (deadline.expired()) {
        fail(Code::kTimeout, peer, 0, "rank " + std::to_string(rank_) + ": " + doing +
                                          ": timed out, rank " + std::to_string(peer) + " sent nothing with this tag");
      }
      continue;
    }
    // Readable: read one whole message (never leave half of one behind).
    Msg m;
    tcp::IoResult r = recv_msg(fd_.get(), &m, Deadline::after_seconds(10.0));
    if (r.kind == tcp::IoResult::kTimeout) broken_ = "a message from the root was cut short";
    if (!r.ok()) raise_io(r, doing);
    if (m.type != MsgType::kDeliver) raise(m, doing);  // a failure notice or garbage
    stash(m);
  }
  return out;
}

void Client::raise_pending(const Deadline& deadline) {
  std::lock_guard<std::mutex> lock(mu_);
  Msg m;
  tcp::IoResult r = recv_msg(fd_.get(), &m, deadline);
  if (!r.ok()) raise_io(r, "waiting on the bootstrap root");
  raise(m, "waiting on the bootstrap root");
}

void Client::raise(const Msg& m, const std::string& doing) {
  std::string who = "rank " + std::to_string(rank_) + ": ";
  if (m.type == MsgType::kAbort || m.type == MsgType::kError) {
    // A rank that failed is lost to the mesh, except when its deadline merely
    // expired: the build timed out, so keep saying so.
    Code code = m.code;
    if (m.type == MsgType::kAbort && code != Code::kTimeout) code = Code::kPeerLost;
    if (code == Code::kOk) code = Code::kPeerLost;
    fail(code, m.rank, 0, who + m.text());
  }
  fail(Code::kProtocol, -1, 0, who + doing + ": unexpected message type " +
                                   std::to_string(static_cast<int>(m.type)) + " from the root");
}

void Client::raise_io(const tcp::IoResult& r, const std::string& doing) {
  std::string who = "rank " + std::to_string(rank_) + ": " + doing + ": ";
  if (r.kind == tcp::IoResult::kTimeout) {
    fail(Code::kTimeout, -1, 0, who + "timed out waiting for the other ranks through the bootstrap root at " +
                                    root_.str() + " (it named no missing rank in time: is this rank's link to it down?)");
  }
  if (r.kind == tcp::IoResult::kClosed) {
    fail(Code::kPeerLost, -1, r.err, who + "lost the bootstrap root at " + root_.str() +
                                       " (the process that made the unique id exited or was killed)");
  }
  fail(r.err == EPROTO ? Code::kProtocol : Code::kSystem, -1, r.err,
       who + "talking to the bootstrap root at " + root_.str());
}

void Client::abort(Code code, const std::string& reason) {
  std::lock_guard<std::mutex> lock(mu_);
  std::lock_guard<std::mutex> wlock(wmu_);
  if (!fd_) return;
  Msg m{MsgType::kAbortReq, code, rank_, 0, {reason.begin(), reason.end()}};
  send_msg(fd_.get(), m, Deadline::after_seconds(1));
  fd_.reset();
}

void Client::interrupt() {
  int fd = fd_.get();
  if (fd >= 0) ::shutdown(fd, SHUT_RDWR);
}

void Client::leave_at_exit() {
  std::unique_lock<std::mutex> lock(mu_, std::try_to_lock);
  std::unique_lock<std::mutex> wlock(wmu_, std::try_to_lock);
  if (!lock.owns_lock() || !wlock.owns_lock()) {
    interrupt();  // a call in another thread holds it: it fails, the root loses this rank
    return;
  }
  if (!fd_) return;
  send_msg(fd_.get(), {MsgType::kBye, Code::kOk, rank_, 0, {}}, Deadline::after_seconds(1));
  fd_.reset();
}

void Client::bye() {
  std::lock_guard<std::mutex> lock(mu_);
  std::lock_guard<std::mutex> wlock(wmu_);
  if (!fd_) return;
  send_msg(fd_.get(), {MsgType::kBye, Code::kOk, rank_, 0, {}}, Deadline::after_seconds(1));
  fd_.reset();
}

}  // namespace fxm::bootstrap
