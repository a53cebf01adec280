// Tagged build: connect to every peer (self included) at once, accept until n
// connections are filed. Each send side first sends a small identity header
// {magic, version, src, dst, build id} over its new connection; the accept
// side reads it and files the connection into recv slot src. Connections
// with garbage, another build's id, a wrong destination or a duplicate
// source are closed and counted, and the build goes on.
#include <cstring>
#include <memory>

#include "adaptor/build_state.h"
#include "base/log.h"

namespace fxm::adaptor {
namespace {

constexpr size_t kMaxUnread = 1024;

// Header bytes come from Build::buffer(): posted requests may still point at
// them while a failed build closes the comms.
struct Outgoing {
  uint8_t* header = nullptr;
  void* request = nullptr;
  bool sent = false;
};

struct Incoming {
  void* comm = nullptr;
  uint8_t* header = nullptr;
  void* request = nullptr;
};

class Tagged {
 public:
  explicit Tagged(Build& b) : b_(b), out_(static_cast<size_t>(b.nranks())) {}
  void run();

 private:
  bool step_outgoing(int peer);
  bool step_accept();
  bool step_incoming(size_t i);
  void file(Incoming& in);
  [[noreturn]] void timed_out() const;

  Build& b_;
  std::vector<Outgoing> out_;
  std::vector<std::unique_ptr<Incoming>> in_;  // accepted, header not read yet (stable buffers)
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

bool Tagged::step_outgoing(int peer) {
  Outgoing& o = out_[peer];
  if (o.sent) return false;
  if (!o.request) {
    if (!b_.step_connect(peer, -1)) return false;
    o.header = b_.buffer(kIdentitySize);
    encode_identity(b_.build_id(), b_.rank(), peer, b_.nranks(), o.header);
    o.request = b_.isend(b_.send_comm(peer), o.header, kIdentitySize, peer, "identity header");
    return true;
  }
  if (!b_.test(o.request, peer, "identity header")) return false;
  o.sent = true;
  ++sent_;
  return true;
}

bool Tagged::step_accept() {
  if (in_.size() >= kMaxUnread) return false;  // headers not read yet: enough to do
  void* comm = b_.step_accept(-1);
  if (!comm) return false;
  in_.push_back(std::make_unique<Incoming>());
  Incoming& in = *in_.back();
  in.comm = comm;
  in.header = b_.buffer(kIdentitySize);
  in.request = b_.irecv(comm, in.header, kIdentitySize, -1, "identity header");
  return true;
}

bool Tagged::step_incoming(size_t i) {
  if (!b_.test(in_[i]->request, -1, "identity header")) return false;
  std::unique_ptr<Incoming> in = std::move(in_[i]);
  in_.erase(in_.begin() + static_cast<long>(i));
  file(*in);
  return true;
}

void Tagged::file(Incoming& in) {
  wire::ConnHeader id;
  std::string why = decode_identity(in.header, b_.build_id(), b_.rank(), b_.nranks(), &id);
  if (why.empty() && b_.recv_comm(id.src)) {
    why = std::string(wire::reject_name(wire::Reject::kDuplicate)) + " (a second connection from rank " +
          std::to_string(id.src) + ")";
  }
  if (!why.empty()) {
    FXM_WARN(b_.rank(), b_.who() + ": refused a connection: " + why);
    ++refused_;
    b_.drop_recv(in.comm);
    return;
  }
  b_.file_recv(id.src, in.comm);
  ++filed_;
}

void Tagged::timed_out() const {
  std::string send_missing, recv_missing;
  int first = -1;
  for (int p = 0; p < b_.nranks(); ++p) {
    if (!out_[p].sent) {
      send_missing += (send_missing.empty() ? "" : ",") + std::to_string(p);
      if (first < 0) first = p;
    }
    if (!b_.recv_comm(p)) {
      recv_missing += (recv_missing.empty() ? "" : ",") + std::to_string(p);
      if (first < 0) first = p;
    }
  }
  b_.check_deadline("connections to ranks [" + send_missing + "] and from ranks [" + recv_missing +
                        "] not done; " + std::to_string(in_.size()) + " accepted without a header yet, " +
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
