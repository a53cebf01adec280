// Tagged build: connect to every peer (self included) at once, accept until n
// connections are filed. Each send side sends an identity header {magic,
// version, src, dst, build id} FLAGCX_MESH_TAGGED_IDENTITY_COPIES times, one
// message after the other, over its new connection; the accept side reads
// the copies and files the connection into recv slot src once all agree.
// Connections whose first copy is garbage, another build's, for another
// destination or a duplicate source are closed and counted, and the build
// goes on. Copies that disagree mean the adaptor's accept assembled one
// connection from several (the precondition in flagcx_mesh_net.h): the build
// fails and says so, rather than file a connection that is not one.
#include <cstring>
#include <memory>

#include "adaptor/build_state.h"
#include "base/log.h"

namespace fxm::adaptor {
namespace {

constexpr size_t kMaxUnread = 1024;
constexpr int kCopies = FLAGCX_MESH_TAGGED_IDENTITY_COPIES;
const char* const kStep = "identity header";
const char* const kPrecondition =
    "the tagged builder needs an adaptor whose accept delivers one whole connection (see "
    "FLAGCX_MESH_BUILD_TAGGED in flagcx_mesh_net.h); an accept that takes sockets one at a time "
    "from the listener (FlagCX's socket adaptor with several sockets per connection) mixes "
    "connections that arrive together: use FLAGCX_MESH_BUILD_ORDERED";

// One connection's copies, sent or received one after the other. Buffers
// come from Build::buffer(): posted requests may still point at them while a
// failed build closes the comms.
struct Side {
  Transfer io;
  int copies_done = 0;
  uint8_t* first = nullptr;  // receive side: copy 0, which the others must equal
};

class Tagged {
 public:
  explicit Tagged(Build& b) : b_(b), out_(static_cast<size_t>(b.nranks())) {}
  void run();

 private:
  bool step_outgoing(int peer);
  bool step_accept();
  bool step_incoming(size_t i);
  bool copy_arrived(size_t i);  // false when the connection was dropped
  bool step_copy(Side& s, int peer);
  void file(size_t i, const wire::ConnHeader& id);
  [[noreturn]] void timed_out() const;

  Build& b_;
  std::vector<Side> out_;
  std::vector<std::unique_ptr<Side>> in_;  // accepted, not filed yet (stable buffers)
  int filed_ = 0, sent_ = 0, refused_ = 0;
};

void Tagged::run() {
  int n = b_.nranks(), spins = 0;
  while (filed_ < n || sent_ < n) {
    bool progress = false;
    for (int p = 0; p < n; ++p) progress |= step_outgoing(p);
    progress |= step_accept();
    for (size_t i = in_.size(); i-- > 0;) progress |= step_incoming(i);
    if (filed_ == n && sent_ == n) break;
    if (b_.deadline().expired()) timed_out();
    if (progress) spins = 0;
    backoff(&spins);
  }
  if (refused_) FXM_INFO(b_.rank(), b_.who() + ": refused " + std::to_string(refused_) + " connection(s)");
}

// An adaptor failure while identities travel may be a broken precondition.
bool Tagged::step_copy(Side& s, int peer) {
  try {
    return s.io.step(b_, kStep);
  } catch (const Error& e) {
    if (e.code() != Code::kSystem) throw;
    fail(e.code(), peer, e.sys_errno(), std::string(e.what()) + "; if this adaptor's accept can mix connections, " +
                                            kPrecondition);
  }
}

bool Tagged::step_outgoing(int peer) {
  Side& o = out_[peer];
  if (o.copies_done == kCopies) return false;
  if (!o.io.comm) {
    if (!b_.step_connect(peer, -1)) return false;
    o.io.comm = b_.send_comm(peer), o.io.send = true, o.io.peer = peer, o.io.size = kIdentitySize;
    o.io.data = b_.buffer(kIdentitySize);
    encode_identity(b_.build_id(), b_.build_key(), b_.rank(), peer, b_.nranks(), o.io.data);
    o.io.mhandle = b_.reg(o.io.comm, o.io.data, kIdentitySize, peer, kStep);
  }
  if (!step_copy(o, peer)) return false;
  if (o.io.done && ++o.copies_done < kCopies) o.io.done = false;  // the next copy, same bytes
  if (o.copies_done == kCopies) ++sent_;
  return true;
}

bool Tagged::step_accept() {
  if (in_.size() >= kMaxUnread) return false;  // headers not read yet: enough to do
  void* comm = b_.step_accept(-1);
  if (!comm) return false;
  in_.push_back(std::make_unique<Side>());
  Side& s = *in_.back();
  s.io.comm = comm, s.io.size = kIdentitySize;
  s.io.data = b_.buffer(kIdentitySize);
  s.io.mhandle = b_.reg(comm, s.io.data, kIdentitySize, -1, kStep);
  return true;
}

bool Tagged::step_incoming(size_t i) {
  Side& s = *in_[i];
  if (!step_copy(s, -1)) return false;
  if (s.io.done) copy_arrived(i);
  return true;
}

bool Tagged::copy_arrived(size_t i) {
  Side& s = *in_[i];
  wire::ConnHeader id;
  std::string why = decode_identity(s.io.data, b_.build_id(), b_.build_key(), b_.rank(), b_.nranks(), &id);
  if (s.copies_done == 0) {
    if (why.empty() && b_.recv_comm(id.src)) {
      why = std::string(wire::reject_name(wire::Reject::kDuplicate)) + " (a second connection from rank " +
            std::to_string(id.src) + ")";
    }
    if (!why.empty()) {  // a stranger's connection: refused, the build goes on
      FXM_WARN(b_.rank(), b_.who() + ": refused a connection: " + why);
      ++refused_;
      b_.drop_recv(s.io.comm);
      in_.erase(in_.begin() + static_cast<long>(i));
      return false;
    }
    s.first = b_.buffer(kIdentitySize);
    std::memcpy(s.first, s.io.data, kIdentitySize);
  } else if (std::memcmp(s.first, s.io.data, kIdentitySize) != 0) {
    wire::ConnHeader first;
    decode_identity(s.first, b_.build_id(), b_.build_key(), b_.rank(), b_.nranks(), &first);
    std::string from = why.empty() ? "rank " + std::to_string(id.src) : "unreadable bytes (" + why + ")";
    b_.fail_at(Code::kProtocol, first.src,
               "accept delivered a mixed connection: copy 1 of its identity header came from rank " +
                   std::to_string(first.src) + ", copy " + std::to_string(s.copies_done + 1) + " from " + from +
                   "; " + kPrecondition);
  }
  if (++s.copies_done < kCopies) {
    s.io.done = false;  // receive the next copy into the same buffer
    return true;
  }
  file(i, id);
  return true;
}

void Tagged::file(size_t i, const wire::ConnHeader& id) {
  if (b_.recv_comm(id.src)) {  // two connections claim the same source: keep the first
    FXM_WARN(b_.rank(), b_.who() + ": refused a connection: a second connection from rank " + std::to_string(id.src));
    ++refused_;
    b_.drop_recv(in_[i]->io.comm);
    in_.erase(in_.begin() + static_cast<long>(i));
    return;
  }
  b_.file_recv(id.src, in_[i]->io.comm);
  in_.erase(in_.begin() + static_cast<long>(i));
  ++filed_;
}

void Tagged::timed_out() const {
  std::string send_missing, recv_missing;
  int first = -1;
  for (int p = 0; p < b_.nranks(); ++p) {
    if (out_[p].copies_done < kCopies) {
      send_missing += (send_missing.empty() ? "" : ",") + std::to_string(p);
      if (first < 0) first = p;
    }
    if (!b_.recv_comm(p)) {
      recv_missing += (recv_missing.empty() ? "" : ",") + std::to_string(p);
      if (first < 0) first = p;
    }
  }
  b_.check_deadline("connections to ranks [" + send_missing + "] and from ranks [" + recv_missing +
                        "] not done; " + std::to_string(in_.size()) + " accepted without all header copies yet, " +
                        std::to_string(refused_) + " refused",
                    first);
  b_.fail_at(Code::kInternal, first, "timed_out called before the deadline");
}

}  // namespace

void build_tagged(Build& b) {
  if (!b.carries_bytes()) {
    b.fail_at(Code::kInvalidArgument, -1,
              "the tagged builder needs an adaptor with isend/irecv/test (this one cannot carry bytes "
              "before memory registration); use FLAGCX_MESH_BUILD_ORDERED");
  }
  b.listen_and_gather();
  Tagged(b).run();
}

}  // namespace fxm::adaptor
