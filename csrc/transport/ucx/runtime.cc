#include "transport/ucx/runtime.h"

#include <poll.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "base/clock.h"
#include "base/env.h"
#include "base/log.h"
#include "base/status.h"
#include "base/thread_name.h"

namespace fxm::ucx {
namespace {

// How long the progress thread spins after the last op was posted while ops are in flight.
constexpr int64_t kSpinAfterOpNs = 200'000'000;

// How long the progress thread spins after the worker last had something to do (a target
// receiving a stream of puts over UCX's tcp: the next bytes come before a sleep would end).
constexpr int64_t kSpinAfterProgressNs = 1'000'000;

// How long a close may take before its request is let go (UCX frees it once it completes): a
// forced close awaits no answer from the peer; an unforced one flushes, which a dead peer never answers.
constexpr double kCloseSeconds = 10.0;

// The resources ucp_context_print_info() lists ("#      resource 1  :  md 1  dev 1  flags -- tcp/eth0").
std::vector<std::string> parse_resources(const std::string& info) {
  std::vector<std::string> out;
  size_t at = 0;
  while (at < info.size()) {
    size_t end = info.find('\n', at);
    if (end == std::string::npos) end = info.size();
    std::string line = info.substr(at, end - at);
    at = end + 1;
    size_t flags = line.find("flags -- ");
    if (line.find("resource") == std::string::npos || flags == std::string::npos) continue;
    std::string tl = line.substr(flags + 9);
    while (!tl.empty() && (tl.back() == ' ' || tl.back() == '\r')) tl.pop_back();
    if (!tl.empty()) out.push_back(tl);
  }
  return out;
}

}  // namespace

// ------------------------------------------------------------ Endpoint

Endpoint::~Endpoint() {
  if (ep_ == nullptr) return;
  std::lock_guard<std::mutex> lock(rt_->mu());
  RequestParams p;
  p.op_attr_mask = kOpFlags;
  p.flags = peer_errors_ ? kCloseForce : 0;  // UCX: a forced close needs peer error handling on both sides
  void* request = rt_->api().ucp_ep_close_nbx(ep_, &p);
  if (is_error(request)) {
    FXM_INFO(-1, "ucx: closing the endpoint to " + peer_ + ": " + status_text(status_of(request)));
  } else if (request != nullptr) {
    rt_->finish_close(request, peer_);  // never waited for here: the caller may hold an engine
  }
}

std::string Endpoint::failure() const {
  Status s = failed_.load();
  return s == kOk ? "" : status_text(s);
}

std::shared_ptr<FlushGroup> Endpoint::open_group() {
  if (!open_ || open_->issued) open_ = std::make_shared<FlushGroup>();
  return open_;
}

void Endpoint::on_error(void* arg, Ep, Status status) {
  auto* e = static_cast<Endpoint*>(arg);
  e->failed_.store(status);
  FXM_WARN(-1, "ucx: the endpoint to " + e->peer_ + " failed: " + status_text(status));
}

// ------------------------------------------------------------ Registration

Registration::~Registration() {
  std::lock_guard<std::mutex> lock(rt_->mu());
  Status s = rt_->api().ucp_mem_unmap(rt_->context(), memh_);
  if (s != kOk) FXM_INFO(-1, "ucx: ucp_mem_unmap: " + status_text(s));
}

// ------------------------------------------------------------ Runtime

Runtime* Runtime::get(std::string* why) {
  static std::string error;
  static Runtime* rt = [] {
    const Library& lib = library();
    if (!lib.api) {
      error = lib.error;
      return static_cast<Runtime*>(nullptr);
    }
    auto* r = new Runtime();  // lives as long as the process: endpoints and registrations may outlive any owner
    if (!r->open(lib, &error)) {
      delete r;
      r = nullptr;
      FXM_WARN(-1, "ucx: " + error);
      return r;
    }
    FXM_INFO(-1, "ucx: " + r->describe());
    std::thread([r] {
      name_this_thread("fxm-ucx");
      r->run();
    }).detach();
    std::atexit([] { Runtime::get(nullptr)->stop(); });
    return r;
  }();
  if (!rt && why) *why = error;
  return rt;
}

bool Runtime::open(const Library& lib, std::string* why) {
  api_ = lib.api;
  ConfigT* config = nullptr;
  Status s = api_->ucp_config_read(nullptr, nullptr, &config);
  if (s != kOk) return *why = "ucp_config_read: " + status_text(s), false;
  Params params;
  params.features = kFeatureRma | kFeatureWakeup;
  s = api_->ucp_init_version(lib.major, lib.minor, &params, config, &context_);
  if (s != kOk) {  // no transport with wake-up events: the progress thread polls instead
    params.features = kFeatureRma;
    s = api_->ucp_init_version(lib.major, lib.minor, &params, config, &context_);
  }
  api_->ucp_config_release(config);
  if (s != kOk) return *why = "ucp_init: " + status_text(s), false;
  WorkerParams wp;
  s = api_->ucp_worker_create(context_, &wp, &worker_);
  if (s != kOk) return *why = "ucp_worker_create: " + status_text(s), false;
  if ((params.features & kFeatureWakeup) == 0 || api_->ucp_worker_get_efd(worker_, &efd_) != kOk) efd_ = -1;
  AddressT* addr = nullptr;
  size_t len = 0;
  s = api_->ucp_worker_get_address(worker_, &addr, &len);
  if (s != kOk) return *why = "ucp_worker_get_address: " + status_text(s), false;
  address_.assign(reinterpret_cast<const char*>(addr), len);
  api_->ucp_worker_release_address(worker_, addr);
  read_transports();
  describe_ = "UCX " + lib.version + " from " + lib.path + ", transports ";
  for (size_t i = 0; i < transports_.size(); ++i) describe_ += (i ? ", " : "") + transports_[i];
  return true;
}

void Runtime::read_transports() {
  char* buf = nullptr;
  size_t len = 0;
  FILE* f = ::open_memstream(&buf, &len);
  if (f == nullptr) return;
  api_->ucp_context_print_info(context_, f);
  std::fclose(f);
  transports_ = parse_resources(std::string(buf, len));
  std::free(buf);
}

int64_t Runtime::now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

bool Runtime::progress_locked() {
  bool any = false;
  while (api_->ucp_worker_progress(worker_) != 0) any = true;
  if (!closing_.empty()) reap_closes_locked();
  return any;
}

void Runtime::finish_close(void* request, std::string peer) {
  closing_.push_back({request, std::move(peer), Deadline::after_seconds(kCloseSeconds)});
  last_op_ns_.store(now_ns(), std::memory_order_relaxed);  // the progress thread looks at it soon
}

void Runtime::reap_closes_locked() {
  for (Closing& c : closing_) {
    Status s = api_->ucp_request_check_status(c.request);
    if (s == kInProgress && !c.deadline.expired()) continue;
    if (s == kInProgress) {
      FXM_INFO(-1, "ucx: closing the endpoint to " + c.peer + ": no answer within " +
                       std::to_string(kCloseSeconds) + " s (left to UCX)");
    } else if (s != kOk) {
      FXM_INFO(-1, "ucx: closing the endpoint to " + c.peer + ": " + status_text(s));
    }
    api_->ucp_request_free(c.request);  // one still in progress is freed by UCX when it completes
    c.request = nullptr;
  }
  closing_.erase(std::remove_if(closing_.begin(), closing_.end(), [](const Closing& c) { return !c.request; }),
                 closing_.end());
}

// Progresses the worker: without sleeping while ops are in flight, else sleeping on
// its event fd once armed (or a short nap where there is none).
void Runtime::run() {
  running_ = true;
  int64_t last_progress_ns = 0;
  while (!stopping_.load()) {
    int64_t now = now_ns();
    bool busy = (busy_.load() > 0 && now - last_op_ns_.load(std::memory_order_relaxed) < kSpinAfterOpNs) ||
                now - last_progress_ns < kSpinAfterProgressNs;
    bool armed = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (progress_locked()) last_progress_ns = now;
      armed = !busy && efd_ >= 0 && api_->ucp_worker_arm(worker_) == kOk;
    }
    if (busy) {
      std::this_thread::yield();
    } else if (armed) {
      pollfd p{efd_, POLLIN, 0};
      ::poll(&p, 1, 20);
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
  running_ = false;
}

void Runtime::stop() {
  stopping_ = true;
  while (running_.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
}

// FLAGCX_MESH_UCX_ERROR_MODE: auto (default), peer or none; else refused. peer: UCX fails a dead
// peer's endpoint and its requests. none: a dead peer is seen by the connection's loss alone (its
// ops still fail with PeerLost). auto: peer where the pair shares a network transport other than
// tcp (rc, dc, ud: UCX keeps its zero-copy puts there), none otherwise: over UCX's tcp, peer error
// handling makes UCX emulate puts with active messages, about half the rate (docs/rdma.md).
bool peer_error_handling(bool fabric) {
  std::string mode = ucx_error_mode_env();
  if (mode.empty() || mode == "auto") return fabric;
  if (mode == "peer") return true;
  if (mode == "none") return false;
  fail(Code::kInvalidArgument, -1, 0, "FLAGCX_MESH_UCX_ERROR_MODE=" + mode + " is not one of auto, peer, none");
}

std::shared_ptr<Endpoint> Runtime::endpoint(const std::string& address, const std::string& peer, bool fabric) {
  std::vector<std::shared_ptr<Endpoint>> seen;  // released after the lock (the last reference closes one)
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = endpoints_.begin(); it != endpoints_.end();) {
    std::shared_ptr<Endpoint> e = it->second.lock();
    seen.push_back(e);
    if (!e) {
      it = endpoints_.erase(it);
      continue;
    }
    if (it->first == address && e->failure().empty()) return e;
    ++it;
  }
  // The handler's argument exists before the endpoint: the Endpoint first, its handle set after.
  auto e = std::make_shared<Endpoint>(this, peer);
  Ep ep = nullptr;
  bool peer_errors = peer_error_handling(fabric);
  Status s = create_ep(address, e.get(), peer_errors, &ep);
  if (s != kOk && peer_errors) {  // no transport to the peer detects its failure (shared memory): the connection's loss does
    FXM_INFO(-1, "ucx: no transport to " + peer + " detects a peer's failure (" + status_text(s) +
                     "); its endpoint is made without (the connection's loss still fails its ops)");
    peer_errors = false;
    s = create_ep(address, e.get(), false, &ep);
  }
  if (s != kOk) {
    fail(Code::kPeerLost, -1, 0, "ucx: connecting to " + peer + "'s worker: ucp_ep_create: " + status_text(s));
  }
  e->set_ep(ep, peer_errors);
  endpoints_.push_back({address, e});
  return e;
}

Status Runtime::create_ep(const std::string& address, Endpoint* e, bool peer_errors, Ep* ep) {
  EpParams p;
  p.address = reinterpret_cast<const AddressT*>(address.data());
  p.err_mode = peer_errors ? kErrModePeer : kErrModeNone;
  p.err_cb = &Endpoint::on_error;
  p.err_arg = e;
  return api_->ucp_ep_create(worker_, &p, ep);
}

std::unique_ptr<Registration> Runtime::map(void* base, uint64_t size, bool cuda, std::string* why) {
  std::lock_guard<std::mutex> lock(mu_);
  MemMapParams p;
  p.address = base;
  p.length = size;
  if (cuda) {
    p.field_mask |= kMapMemoryType;
    p.memory_type = kMemoryCuda;
  }
  Mem memh = nullptr;
  Status s = api_->ucp_mem_map(context_, &p, &memh);
  if (s != kOk) return *why = "ucp_mem_map: " + status_text(s), nullptr;
  void* packed = nullptr;
  size_t len = 0;
  s = api_->ucp_rkey_pack(context_, memh, &packed, &len);
  if (s != kOk) {
    api_->ucp_mem_unmap(context_, memh);
    return *why = "ucp_rkey_pack: " + status_text(s), nullptr;
  }
  std::string rkey(static_cast<const char*>(packed), len);
  api_->ucp_rkey_buffer_release(packed);
  return std::make_unique<Registration>(this, memh, std::move(rkey));
}

}  // namespace fxm::ucx
