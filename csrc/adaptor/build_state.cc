#include "adaptor/build_state.h"

#include <sched.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <thread>

#include "adaptor/boot_ops.h"
#include "base/env.h"
#include "base/log.h"

namespace fxm::adaptor {

const char* builder_name(int builder) {
  switch (builder) {
    case FLAGCX_MESH_BUILD_LEGACY: return "legacy";
    case FLAGCX_MESH_BUILD_ORDERED: return "ordered";
    case FLAGCX_MESH_BUILD_TAGGED: return "tagged";
  }
  return "unknown";
}

NetAdaptor upgrade_adaptor(const NetAdaptor& net) {
  NetAdaptor out{};
  std::memcpy(&out, &net, std::min(net.size, sizeof(out)));
  out.size = sizeof(out);
  return out;
}

BootOps upgrade_boot(const BootOps& boot) {
  BootOps out{};
  std::memcpy(&out, &boot, std::min(boot.size, sizeof(out)));
  out.size = sizeof(out);
  return out;
}

Build::Build(const NetAdaptor& net, const BootOps& boot, const BuildConfig& config)
    : net_(upgrade_adaptor(net)), io_v1_(net.size < sizeof(NetAdaptor)), boot_(upgrade_boot(boot)),
      config_(config), rank_(boot.rank), n_(boot.nranks),
      timeout_s_(build_timeout_s(config.timeout_s, "build config: timeout_s")),
      deadline_(Deadline::after_seconds(timeout_s_)),
      send_(static_cast<size_t>(n_), nullptr), recv_(static_cast<size_t>(n_), nullptr),
      watchdog_(boot_, deadline_) {}

Build::~Build() {
  watchdog_.stop();
  close_all();
}

void Build::release_mrs(void* comm) {
  for (auto it = mrs_.begin(); it != mrs_.end();) {
    if (it->first != comm) {
      ++it;
      continue;
    }
    net_.dereg_mr(net_.ctx, it->first, it->second);
    it = mrs_.erase(it);
  }
}

void Build::close_recv_comm(void* comm) {
  release_mrs(comm);
  net_.close_recv(net_.ctx, comm);
}

void Build::close_all() {
  // Failure path: best effort, results ignored (the build already failed).
  for (void*& c : send_) {
    if (c) release_mrs(c), net_.close_send(net_.ctx, c);
    c = nullptr;
  }
  for (void*& c : recv_) {
    if (c) close_recv_comm(c);
    c = nullptr;
  }
  for (void* c : unfiled_) close_recv_comm(c);
  unfiled_.clear();
  if (listen_) net_.close_listen(net_.ctx, listen_);
  listen_ = nullptr;
}

std::string Build::who() const {
  return "rank " + std::to_string(rank_) + " (" + builder_name(builder_of(config_)) + " build over '" +
         (net_.name ? net_.name : "adaptor") + "')";
}

void Build::fail_at(Code code, int peer, const std::string& what) const {
  fail(code, peer, 0, who() + ": " + what);
}

void Build::check_call(int rc, const char* call, int peer, int round) const {
  if (rc == 0) return;
  std::string where = round >= 0 ? "round " + std::to_string(round) + ": " : "";
  std::string target = peer >= 0 ? " (peer rank " + std::to_string(peer) + ")" : "";
  fail_at(Code::kSystem, peer, where + "adaptor " + call + target + " returned " + std::to_string(rc));
}

void Build::check_deadline(const std::string& what, int peer) const {
  if (deadline_.expired()) {
    char secs[32];
    std::snprintf(secs, sizeof(secs), "%.2f", timeout_s_);
    fail_at(Code::kTimeout, peer, what + " (build deadline of " + secs + " s expired)");
  }
}

void Build::listen_and_gather() {
  size_t hs = net_.handle_size, block = hs + 8 + build_key_.size();
  std::vector<uint8_t> all(block * static_cast<size_t>(n_), 0);
  uint8_t* mine = all.data() + block * static_cast<size_t>(rank_);
  check_call(net_.listen(net_.ctx, mine, &listen_), "listen", -1, -1);
  std::random_device rd;
  uint64_t nonce = (static_cast<uint64_t>(rd()) << 32) ^ rd() ^ static_cast<uint64_t>(rank_ + 1);
  std::memcpy(mine + hs, &nonce, 8);
  crypto::random_bytes(mine + hs + 8, build_key_.size());
  double left = seconds_left();
  int rc = boot_call([&] { return boot_.allgather(boot_.ctx, all.data(), block, left); });
  if (rc != 0) boot_failed(rc, -1, "bootstrap allgather of the listen handles");
  std::memcpy(&build_id_, all.data() + hs, 8);
  crypto::Sha256 shares;
  static const char kLabel[] = "flagcx_mesh tagged build key";
  shares.update(kLabel, sizeof(kLabel));
  for (int p = 0; p < n_; ++p) shares.update(all.data() + block * static_cast<size_t>(p) + hs + 8, build_key_.size());
  build_key_ = shares.finish();
  handles_.resize(static_cast<size_t>(n_));
  for (int p = 0; p < n_; ++p) {
    const uint8_t* h = all.data() + block * static_cast<size_t>(p);
    handles_[p].assign(h, h + hs);
  }
}

bool Build::step_connect(int peer, int round) {
  if (send_[peer]) return true;
  void* comm = nullptr;
  check_call(net_.connect(net_.ctx, handles_[peer].data(), &comm), "connect", peer, round);
  send_[peer] = comm;
  return comm != nullptr;
}

void* Build::step_accept(int round) {
  void* comm = nullptr;
  check_call(net_.accept(net_.ctx, listen_, &comm), "accept", -1, round);
  if (comm) unfiled_.push_back(comm);
  return comm;
}

void Build::file_recv(int slot, void* comm) {
  unfiled_.erase(std::remove(unfiled_.begin(), unfiled_.end(), comm), unfiled_.end());
  recv_[slot] = comm;
}

uint8_t* Build::buffer(size_t bytes) {
  buffers_.emplace_back(bytes, 0);
  return buffers_.back().data();
}

void Build::drop_recv(void* comm) {
  unfiled_.erase(std::remove(unfiled_.begin(), unfiled_.end(), comm), unfiled_.end());
  for (void*& c : recv_) {
    if (c == comm) c = nullptr;
  }
  close_recv_comm(comm);
}

void* Build::reg(void* comm, void* data, size_t size, int peer, const std::string& step) {
  if (!net_.reg_mr) return nullptr;
  void* mh = nullptr;
  int rc = net_.reg_mr(net_.ctx, comm, data, size, &mh);
  if (rc != 0) check_call(rc, ("reg_mr (" + step + ")").c_str(), peer, -1);
  mrs_.emplace_back(comm, mh);
  return mh;
}

void* Build::isend(void* comm, const void* data, size_t size, void* mhandle, int peer, const std::string& step) {
  void* req = nullptr;
  int rc = io_v1_ ? reinterpret_cast<flagcx_mesh_net_isend_v1_fn>(net_.isend)(net_.ctx, comm, data, size, &req)
                  : net_.isend(net_.ctx, comm, data, size, mhandle, &req);
  if (rc != 0) check_call(rc, ("isend (" + step + ")").c_str(), peer, -1);
  return req;
}

void* Build::irecv(void* comm, void* data, size_t size, void* mhandle, int peer, const std::string& step) {
  void* req = nullptr;
  int rc = io_v1_ ? reinterpret_cast<flagcx_mesh_net_irecv_v1_fn>(net_.irecv)(net_.ctx, comm, data, size, &req)
                  : net_.irecv(net_.ctx, comm, data, size, mhandle, &req);
  if (rc != 0) check_call(rc, ("irecv (" + step + ")").c_str(), peer, -1);
  return req;
}

bool Transfer::step(Build& b, const std::string& what) {
  if (done) return false;
  if (!request) {
    request = send ? b.isend(comm, data, size, mhandle, peer, what) : b.irecv(comm, data, size, mhandle, peer, what);
    return request != nullptr;
  }
  if (!b.test(request, peer, what)) return false;
  request = nullptr;
  done = true;
  return true;
}

bool Build::test(void* request, int peer, const std::string& step) {
  int done = 0;
  int rc = net_.test(net_.ctx, request, &done);
  if (rc != 0) check_call(rc, ("test (" + step + ")").c_str(), peer, -1);
  return done != 0;
}

double Build::seconds_left() const { return std::max(deadline_.seconds_left(), 1e-3); }

template <class F>
int Build::boot_call(F&& call) {
  watchdog_.enter();
  int rc = call();
  watchdog_.leave();
  return rc;
}

// A bootstrap op returned rc != 0: a timeout when it says so or the build's
// deadline passed, else the peer (or the bootstrap) is lost.
void Build::boot_failed(int rc, int peer, const std::string& what) const {
  std::string text = what + " returned " + std::to_string(rc) + boot_detail_suffix(boot_);
  if (watchdog_.aborted()) {
    text += " (interrupted by the bootstrap's abort hook at the build deadline)";
  }
  check_deadline(text, peer);
  fail_at(rc == FLAGCX_MESH_TIMED_OUT ? Code::kTimeout : Code::kPeerLost, peer, text);
}

void Build::boot_send(int peer, int tag, const void* data, size_t size, int round) {
  std::string what = "round " + std::to_string(round) + ": bootstrap send of the readiness token to rank " +
                     std::to_string(peer);
  check_deadline(what, peer);
  double left = seconds_left();
  int rc = boot_call([&] { return boot_.send(boot_.ctx, peer, tag, data, size, left); });
  if (rc != 0) boot_failed(rc, peer, what);
}

void Build::boot_recv(int peer, int tag, void* data, size_t size, int round) {
  std::string what = "round " + std::to_string(round) + ": waiting for the readiness token of rank " +
                     std::to_string(peer) + " (its accept for this round)";
  check_deadline(what, peer);
  double left = seconds_left();
  int rc = boot_call([&] { return boot_.recv(boot_.ctx, peer, tag, data, size, left); });
  if (rc != 0) boot_failed(rc, peer, what + ": bootstrap recv");
}

void Build::finish(void** send_comms, void** recv_comms) {
  watchdog_.stop();  // no bootstrap call is left: the hook must not fire after this
  if (watchdog_.aborted()) {  // it fired as a call was returning: the bootstrap may be unusable now
    fail_at(Code::kTimeout, -1, "the build deadline passed during a bootstrap call and the bootstrap's "
                                "abort hook was called; the build is failed, since the bootstrap may be unusable");
  }
  for (int p = 0; p < n_; ++p) {
    if (!send_[p] || !recv_[p]) fail_at(Code::kInternal, p, "build ended with an empty slot");
  }
  std::vector<std::pair<void*, void*>> mrs = std::move(mrs_);
  mrs_.clear();
  int dereg_rc = 0;  // every handle is deregistered; the first failure is reported after
  for (auto& [comm, mh] : mrs) {  // every transfer completed: the handles can go
    int rc = net_.dereg_mr(net_.ctx, comm, mh);
    if (dereg_rc == 0) dereg_rc = rc;
  }
  check_call(dereg_rc, "dereg_mr", -1, -1);
  void* listener = listen_;
  listen_ = nullptr;  // closed exactly once, whatever close_listen returns
  if (listener) check_call(net_.close_listen(net_.ctx, listener), "close_listen", -1, -1);
  for (int p = 0; p < n_; ++p) {
    send_comms[p] = send_[p];
    recv_comms[p] = recv_[p];
    send_[p] = recv_[p] = nullptr;
  }
  // Accepted but never filed (a tagged build's strangers whose header had not
  // arrived yet): not part of the mesh, so closed here.
  if (!unfiled_.empty()) {
    FXM_INFO(rank_, who() + ": closed " + std::to_string(unfiled_.size()) + " unidentified connection(s)");
  }
  for (void* c : unfiled_) close_recv_comm(c);
  unfiled_.clear();
}

void backoff(int* spins) {
  if (++*spins < 64) {
    sched_yield();
  } else {
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

namespace {

wire::MeshId mesh_id_of(uint64_t build_id) {
  wire::MeshId id{};
  std::memcpy(id.data(), &build_id, sizeof(build_id));
  return id;
}

wire::Mac identity_mac(const crypto::Key& key, const uint8_t header[wire::kConnHeaderSize]) {
  static const char kLabel[] = "flagcx_mesh identity";
  return crypto::Hmac(key.data(), key.size()).update(kLabel, sizeof(kLabel)).update(header, wire::kConnHeaderSize).finish();
}

}  // namespace

void encode_identity(uint64_t build_id, const crypto::Key& key, int src, int dst, int nranks,
                     uint8_t out[kIdentitySize]) {
  wire::ConnHeader h;
  h.mesh_id = mesh_id_of(build_id);
  h.src = src;
  h.dst = dst;
  h.nranks = static_cast<uint32_t>(nranks);
  h.ncontexts = 1;
  wire::encode(h, out);
  wire::Mac mac = identity_mac(key, out);
  std::memcpy(out + wire::kConnHeaderSize, mac.data(), mac.size());
}

std::string decode_identity(const uint8_t in[kIdentitySize], uint64_t build_id, const crypto::Key& key, int me,
                            int nranks, wire::ConnHeader* out) {
  wire::Reject r = wire::decode(in, out);
  if (r == wire::Reject::kNone) {
    wire::Expect e;
    e.mesh_id = mesh_id_of(build_id);
    e.me = me;
    e.nranks = static_cast<uint32_t>(nranks);
    e.ncontexts = 1;
    r = wire::validate(*out, e);
  }
  if (r == wire::Reject::kNone) {
    wire::Mac mac = identity_mac(key, in);
    if (!crypto::equal_ct(mac.data(), in + wire::kConnHeaderSize, mac.size())) r = wire::Reject::kBadAuth;
  }
  return r == wire::Reject::kNone ? "" : wire::reject_name(r);
}

}  // namespace fxm::adaptor
