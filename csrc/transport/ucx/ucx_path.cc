#include "transport/ucx/ucx_path.h"

#include <cerrno>
#include <mutex>
#include <set>

#include "base/env.h"
#include "base/log.h"
#include "base/status.h"
#include "transport/binding.h"
#include "transport/ucx/runtime.h"

namespace fxm {
namespace {

using ucx::Runtime;

// Completes a put once the flush of its group completed; the first probe of a
// group to be polled issues the flush (covering every put posted before it).
class FlushProbe : public CompletionProbe {
 public:
  FlushProbe(Runtime* rt, std::shared_ptr<ucx::Endpoint> ep, std::shared_ptr<ucx::FlushGroup> g)
      : rt_(rt), busy_(rt), ep_(std::move(ep)), g_(std::move(g)) {}
  bool done() override {
    std::lock_guard<std::mutex> lock(rt_->mu());
    if (!g_->issued) issue();
    if (!g_->finished) poll();
    return g_->finished;
  }
  std::string error() const override { return g_->error; }
  bool peer_lost() const override { return !g_->error.empty() && !ep_->failure().empty(); }

 private:
  void issue() {
    g_->issued = true;
    ucx::RequestParams p;
    void* r = rt_->api().ucp_ep_flush_nbx(ep_->ep(), &p);
    if (ucx::is_request(r)) return void(g_->request = r);
    finish(r == nullptr ? ucx::kOk : ucx::status_of(r));
  }
  void poll() {
    rt_->progress_locked();
    ucx::Status s = rt_->api().ucp_request_check_status(g_->request);
    if (s == ucx::kInProgress) return;
    rt_->api().ucp_request_free(g_->request);
    g_->request = nullptr;
    finish(s);
  }
  void finish(ucx::Status s) {
    g_->finished = true;
    if (s != ucx::kOk) g_->error = "ucx: flush to " + ep_->peer() + ": " + ucx::status_text(s);
  }
  Runtime* rt_;
  Runtime::Busy busy_;
  std::shared_ptr<ucx::Endpoint> ep_;
  std::shared_ptr<ucx::FlushGroup> g_;
};

// Completes a get once its request completed (its data is here).
class RequestProbe : public CompletionProbe {
 public:
  RequestProbe(Runtime* rt, std::shared_ptr<ucx::Endpoint> ep, void* request)
      : rt_(rt), busy_(rt), ep_(std::move(ep)), request_(request) {}
  bool done() override {
    std::lock_guard<std::mutex> lock(rt_->mu());
    if (request_ == nullptr) return true;
    rt_->progress_locked();
    ucx::Status s = rt_->api().ucp_request_check_status(request_);
    if (s == ucx::kInProgress) return false;
    rt_->api().ucp_request_free(request_);
    request_ = nullptr;
    if (s != ucx::kOk) error_ = "ucx: get from " + ep_->peer() + ": " + ucx::status_text(s);
    return true;
  }
  std::string error() const override { return error_; }
  bool peer_lost() const override { return !error_.empty() && !ep_->failure().empty(); }

 private:
  Runtime* rt_;
  Runtime::Busy busy_;
  std::shared_ptr<ucx::Endpoint> ep_;
  void* request_;
  std::string error_;
};

}  // namespace

UcxPath::UcxPath(Runtime* rt, std::shared_ptr<ucx::Endpoint> ep, void* rkey, uint64_t remote_base, Outbox* outbox,
                 int peer)
    : rt_(rt), ep_(std::move(ep)), rkey_(rkey), remote_base_(remote_base), outbox_(outbox), peer_(peer) {}

UcxPath::~UcxPath() { release(); }

void UcxPath::release() {
  if (!ep_) return;
  {
    std::lock_guard<std::mutex> lock(rt_->mu());
    rt_->api().ucp_rkey_destroy(static_cast<ucx::Rkey>(rkey_));
  }
  ep_.reset();  // the endpoint closes with its last path
}

void UcxPath::check_healthy(const char* op) const {
  if (!ep_) fail(Code::kClosed, peer_, 0, std::string("ucx: ") + op + ": the window was closed");
  std::string lost = ep_->failure();
  if (!lost.empty()) fail(Code::kPeerLost, peer_, 0, std::string("ucx: ") + op + " to " + ep_->peer() + ": " + lost);
}

// The local buffer's memory type, told to UCX for device memory (not left to its detection).
ucx::RequestParams UcxPath::params_for(const PathOp& op) {
  ucx::RequestParams p;
  if (op.local_device >= 0) {
    p.op_attr_mask |= ucx::kOpMemoryType;
    p.memory_type = ucx::kMemoryCuda;
  }
  return p;
}

void* UcxPath::post_put(const PathOp& op) {
  ucx::RequestParams p = params_for(op);
  void* r = rt_->api().ucp_put_nbx(ep_->ep(), op.local, op.len, remote_base_ + op.remote_off,
                                   static_cast<ucx::Rkey>(rkey_), &p);
  if (ucx::is_error(r)) {
    fail(Code::kPeerLost, peer_, 0, "ucx: put to " + ep_->peer() + ": " + ucx::status_text(ucx::status_of(r)));
  }
  return r;
}

// A put the core's signal follows: done when its flush completed (0), else an errno (the op goes over tcp).
int UcxPath::put_and_flush(const PathOp& op) {
  check_healthy("put");
  std::lock_guard<std::mutex> lock(rt_->mu());
  void* r = post_put(op);
  if (r != nullptr) rt_->api().ucp_request_free(r);
  ucx::RequestParams p;
  void* flush = rt_->api().ucp_ep_flush_nbx(ep_->ep(), &p);
  if (flush == nullptr) return 0;
  if (ucx::is_error(flush)) return EIO;
  Deadline deadline = op.deadline.min(Deadline::after_seconds(default_timeout_s()));
  ucx::Status s = ucx::kInProgress;
  while ((s = rt_->api().ucp_request_check_status(flush)) == ucx::kInProgress && !deadline.expired()) {
    rt_->progress_locked();
  }
  if (s == ucx::kInProgress) return ETIMEDOUT;  // (the request stays UCX's: it completes or fails with the endpoint)
  rt_->api().ucp_request_free(flush);
  if (s != ucx::kOk) FXM_WARN(-1, "ucx: flush to " + ep_->peer() + ": " + ucx::status_text(s));
  return s == ucx::kOk ? 0 : EIO;
}

int UcxPath::put(const PathOp& op) {
  if (op.sig != nullptr) return put_and_flush(op);
  check_healthy("put");
  std::shared_ptr<ucx::FlushGroup> group;
  {
    std::lock_guard<std::mutex> lock(rt_->mu());
    void* r = post_put(op);
    if (r != nullptr) rt_->api().ucp_request_free(r);  // its completion is the flush's
    group = ep_->open_group();
  }
  outbox_->issued_probe(peer_, op.ctx, PathKind::kUcx, std::make_unique<FlushProbe>(rt_, ep_, std::move(group)), 1);
  return 0;
}

int UcxPath::get(const PathOp& op) {
  check_healthy("get");
  void* r = nullptr;
  {
    std::lock_guard<std::mutex> lock(rt_->mu());
    ucx::RequestParams p = params_for(op);
    r = rt_->api().ucp_get_nbx(ep_->ep(), op.local, op.len, remote_base_ + op.remote_off,
                               static_cast<ucx::Rkey>(rkey_), &p);
  }
  if (ucx::is_error(r)) {
    fail(Code::kPeerLost, peer_, 0, "ucx: get from " + ep_->peer() + ": " + ucx::status_text(ucx::status_of(r)));
  }
  outbox_->issued_probe(peer_, op.ctx, PathKind::kUcx, std::make_unique<RequestProbe>(rt_, ep_, r), 1);
  return 0;
}

// ------------------------------------------------------------ the factory

namespace {

// Forced: a refusal is the error that names why; automatic: a reason for describe().
std::unique_ptr<Path> refuse(const PathRequest& req, const std::string& reason, std::string* why) {
  if (req.forced == ForcedTransport::kUcx) {
    fail(Code::kInvalidArgument, req.peer, 0,
         "FLAGCX_MESH_TRANSPORT=ucx: no ucx path to " + peer_words(req) + ": " + reason);
  }
  if (why) *why = "ucx: " + reason;
  return nullptr;
}

// Empty, or why UCX here cannot move this op's device memory (either side's).
std::string device_memory_refusal(const PathRequest& req, const WindowDesc& d, const Runtime& rt) {
  if (d.kind != WindowKind::kDevice && req.device < 0) return "";
  if (!device_memory_transports(rt.transports()).empty()) return "";
  return std::string(req.device >= 0 ? "this rank's copy" : "the peer's window") +
         " is device memory and UCX here offers no transport for CUDA memory (cuda_copy, cuda_ipc, gdr_copy: "
         "a UCX built with CUDA, and UCX_TLS naming one if set); it offers " + join_transports(rt.transports());
}

std::string what_moves(const PathRequest& req, const WindowDesc& d, const Runtime& rt, const std::string& net,
                       const ucx::Endpoint& ep) {
  std::string s = "ucx: " + rt.describe();
  if (d.kind == WindowKind::kDevice || req.device >= 0) {
    s += "; device memory through " + device_memory_transports(rt.transports());
  }
  s += net.empty() ? "" : "; network transport " + net;
  return s + (ep.peer_errors() ? "; a dead peer: UCX's peer error handling" : "; a dead peer: the connection's loss");
}

}  // namespace

std::unique_ptr<Path> make_ucx_path(const PathRequest& req, const WindowDesc& d, std::string* why) {
  bool forced = req.forced == ForcedTransport::kUcx;
  if (!forced && ucx_lib_env().empty()) return nullptr;  // UCX is not wanted: nothing to say
  if (req.forced != ForcedTransport::kAuto && !forced) return nullptr;
  if (d.kind == WindowKind::kSignal || req.kind == WindowKind::kSignal) {
    if (why) *why = "ucx: signal windows take the core's own paths";
    return nullptr;
  }
  bool device = d.kind == WindowKind::kDevice || req.kind == WindowKind::kDevice;
  if (device && req.forced_cuda != ForcedCudaPath::kAuto) {  // the device path named takes precedence
    if (why) *why = "ucx: FLAGCX_MESH_CUDA_PATH names the path to device memory";
    return nullptr;
  }
  std::string error;
  Runtime* rt = Runtime::get(&error);
  if (rt == nullptr) return refuse(req, error, why);
  std::string no_device = device_memory_refusal(req, d, *rt);
  if (!no_device.empty()) return refuse(req, no_device, why);
  if (d.ucx_rkey.empty()) return refuse(req, "the peer did not register this window with UCX", why);
  // On one host, the description is bound as a mapping is (binding.h: the peer's process, the seal
  // of its registration); across hosts nothing here can read the seal (docs/rdma.md, "Binding").
  std::string unbound = req.binding && d.host == req.host ? req.binding->for_mapping() : "";
  if (!unbound.empty()) return refuse(req, unbound, why);
  if (req.ucx_worker.empty()) return refuse(req, "the peer's connection carried no UCX worker address", why);
  std::string net = common_network_transport(rt->transports(), split_transports(d.ucx_transports));
  if (!forced && net.empty()) {
    return refuse(req, "no network transport other than tcp that both sides' UCX offer (here: " +
                           join_transports(rt->transports()) + ")", why);
  }
  std::shared_ptr<ucx::Endpoint> ep = rt->endpoint(req.ucx_worker, peer_words(req), !net.empty());
  ucx::Rkey rkey = nullptr;
  {
    std::lock_guard<std::mutex> lock(rt->mu());
    ucx::Status s = rt->api().ucp_ep_rkey_unpack(ep->ep(), d.ucx_rkey.data(), &rkey);
    if (s != ucx::kOk) return refuse(req, "the description's rkey: ucp_ep_rkey_unpack: " + ucx::status_text(s), why);
  }
  if (why) *why = what_moves(req, d, *rt, net, *ep);
  return std::make_unique<UcxPath>(rt, std::move(ep), rkey, d.addr, req.outbox, req.peer);
}

bool ucx_wanted() { return transport_env() == "ucx" || !ucx_lib_env().empty(); }

std::unique_ptr<ucx::Registration> register_with_ucx(void* base, uint64_t size, bool cuda, WindowDesc* d,
                                                     bool with_worker) {
  if (!ucx_wanted() || size == 0) return nullptr;
  std::string why;
  Runtime* rt = Runtime::get(&why);
  if (rt && cuda && device_memory_transports(rt->transports()).empty()) {
    rt = nullptr;
    why = "it is device memory and UCX here offers no transport for CUDA memory (cuda_copy, cuda_ipc, gdr_copy)";
  }
  std::unique_ptr<ucx::Registration> reg = rt ? rt->map(base, size, cuda, &why) : nullptr;
  if (!reg) {
    FXM_WARN(-1, "ucx: a window of " + std::to_string(size) + " bytes is not registered with UCX: " + why);
    return nullptr;
  }
  d->ucx_rkey = reg->rkey();
  d->ucx_transports = join_transports(rt->transports());
  if (with_worker) d->ucx_worker = rt->address();
  return reg;
}

std::string ucx_worker_address() {
  if (!ucx_wanted()) return "";
  Runtime* rt = Runtime::get(nullptr);
  return rt ? rt->address() : "";
}

// ------------------------------------------------------------ selection

namespace {

std::string transport_name(const std::string& tl_dev) { return tl_dev.substr(0, tl_dev.find('/')); }

bool is_network(const std::string& tl) {
  static const std::set<std::string> local{"self", "tcp", "sysv", "posix", "xpmem", "knem", "cma",
                                           "cuda_copy", "cuda_ipc", "gdr_copy", "rocm_copy", "rocm_ipc",
                                           "rocm_gdr", "ze_copy", "ze_ipc", "ze_gpu"};
  return !tl.empty() && local.count(tl) == 0;
}

}  // namespace

std::string common_network_transport(const std::vector<std::string>& mine, const std::vector<std::string>& theirs) {
  std::set<std::string> other;
  for (const std::string& t : theirs) other.insert(transport_name(t));
  for (const std::string& t : mine) {
    std::string tl = transport_name(t);
    if (is_network(tl) && other.count(tl)) return tl;
  }
  return "";
}

std::string device_memory_transports(const std::vector<std::string>& tls) {
  static const std::set<std::string> cuda{"cuda_copy", "cuda_ipc", "gdr_copy"};
  std::set<std::string> seen;
  std::string s;
  for (const std::string& t : tls) {
    std::string tl = transport_name(t);
    if (cuda.count(tl) && seen.insert(tl).second) s += (s.empty() ? "" : ",") + tl;
  }
  return s;
}

std::string join_transports(const std::vector<std::string>& tls) {
  std::string s;
  for (size_t i = 0; i < tls.size(); ++i) s += (i ? "," : "") + tls[i];
  return s;
}

std::vector<std::string> split_transports(const std::string& s) {
  std::vector<std::string> out;
  size_t at = 0;
  while (at < s.size()) {
    size_t end = s.find(',', at);
    if (end == std::string::npos) end = s.size();
    if (end > at) out.push_back(s.substr(at, end - at));
    at = end + 1;
  }
  return out;
}

}  // namespace fxm
