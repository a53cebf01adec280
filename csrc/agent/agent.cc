#include "agent/agent.h"

#include <fcntl.h>
#include <netdb.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>

#include "agent/connection.h"
#include "agent/handshake.h"
#include "agent/name_probe.h"
#include "agent/stream_wait.h"
#include "base/env.h"
#include "base/log.h"
#include "base/status.h"
#include "base/thread_name.h"
#include "core/window_setup.h"
#include "transport/ucx/ucx_path.h"

namespace fxm::agent {
namespace {

std::string checked_name(const std::string& name) {
  if (name.empty() || name.size() > kMaxAgentName) {
    fail(Code::kInvalidArgument, -1, 0, "Agent: the name must be 1.." + std::to_string(kMaxAgentName) +
                                            " bytes, got " + std::to_string(name.size()));
  }
  return name;
}

// "host:port" or "[v6]:port", numeric or a name getaddrinfo() resolves.
bool parse_host_port(const std::string& s, tcp::SockAddr* out) {
  size_t colon = s.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == s.size()) return false;
  std::string host = s.substr(0, colon), port = s.substr(colon + 1);
  if (host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (::getaddrinfo(host.c_str(), port.c_str(), &hints, &res) != 0 || res == nullptr) return false;
  std::memcpy(&out->ss, res->ai_addr, res->ai_addrlen);
  out->len = static_cast<socklen_t>(res->ai_addrlen);
  ::freeaddrinfo(res);
  return true;
}

}  // namespace

Agent::Agent(const AgentOptions& o)
    : name_(checked_name(o.name)), header_timeout_s_(o.header_timeout_s), admit_(o.admit), host_(shm::host_id()) {
  LogSpeaker speaker(who());
  require_valid_env();  // a malformed FLAGCX_MESH_LOG or timeout variable fails here
  std::string secret = o.secret.empty() ? agent_secret_env() : o.secret;
  if (secret.empty()) {
    fail(Code::kInvalidArgument, -1, 0, who() + "no secret: pass one or set FLAGCX_MESH_AGENT_SECRET "
                                                "(every peer must prove the same)");
  }
  key_ = wire::agent_key(secret);
  if (o.timeout_s != 0) check_timeout(o.timeout_s, "Agent: timeout", false);
  timeout_s_ = o.timeout_s > 0 ? o.timeout_s : default_timeout_s();
  if (!(header_timeout_s_ > 0)) fail(Code::kInvalidArgument, -1, 0, who() + "header_timeout must be > 0");
  forced_transport();  // a bad FLAGCX_MESH_TRANSPORT (or _CUDA_PATH) fails here, not at the first transfer
  forced_cuda_path();
  tcp_lanes_ = tcp_lanes_env(2 * kPlannedConnections);
  tcp_lane_spin_us_env();  // a bad value fails here, not in a connection's engine
  crypto::random_bytes(incarnation_.data(), incarnation_.size());
  listen_in_port_range();
  wake_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (wake_fd_ < 0) fail(Code::kSystem, -1, errno, who() + "eventfd for the listener");
  inbox_ = std::make_unique<NotificationInbox>(this);
  closer_ = std::make_unique<Closer>();
  listener_ = std::thread([this] {
    name_this_thread("fxm-listen");
    listen_loop();
  });
  FXM_INFO(-1, who() + "incarnation " + incarnation_hex(incarnation_) + " listens on " + listen_addr_.str());
}

// The listener on the first free port of FLAGCX_MESH_AGENT_PORTS (any free port without it).
void Agent::listen_in_port_range() {
  PortRange ports = agent_ports_env();
  tcp::SockAddr bind = tcp::local_address();
  int err = 0;
  for (int port = ports.first; port <= ports.last; ++port) {
    bind.set_port(static_cast<uint16_t>(port));
    listen_fd_ = tcp::listen_on(bind, &listen_addr_, &err);
    if (listen_fd_) return;
    if (err != EADDRINUSE) break;
  }
  std::string where = ports.first == 0 ? bind.str()
                                       : bind.str() + " (every port of FLAGCX_MESH_AGENT_PORTS=" +
                                             std::to_string(ports.first) + "-" + std::to_string(ports.last) + ")";
  fail(Code::kSystem, -1, err, who() + "listening on " + where);
}

Agent::~Agent() { close(); }

void Agent::require_open(const char* call) const {
  if (closed_) fail(Code::kClosed, -1, 0, who() + call + ": the agent was closed");
}

void Agent::check_peer_name(const char* call, const std::string& peer) const {
  if (peer.empty() || peer.size() > kMaxAgentName) {
    fail(Code::kInvalidArgument, -1, 0, who() + call + ": a peer name is 1.." + std::to_string(kMaxAgentName) +
                                            " bytes");
  }
}

std::vector<uint8_t> Agent::metadata() const {
  require_open("metadata");
  return Metadata{name_, incarnation_, listen_addr_}.encode();
}

AgentStats Agent::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  AgentStats s = stats_;
  s.notification_drains = inbox_->drains();
  for (const auto& c : conns_) {
    Engine::AnswerCounts a = c->answer_counts();
    s.answer_bytes_held += a.held;
    s.answer_bytes_peak = std::max(s.answer_bytes_peak, a.peak);
    s.waiter_reads += c->waiter_reads();
    s.late_wakes += c->late_wakes();
  }
  return s;
}

// ------------------------------------------------------------ regions

// Null with FLAGCX_MESH_AGENT_COOKIE_TABLE=off (peers then read each cookie back through cma).
std::unique_ptr<cma::CookieTable> Agent::make_cookie_table() const {
  std::string v = agent_cookie_table_env();
  if (v == "off") {
    FXM_INFO(-1, who() + "FLAGCX_MESH_AGENT_COOKIE_TABLE=off: peers read cookies through cma");
    return nullptr;
  }
  if (!v.empty() && v != "auto") {
    FXM_WARN(-1, who() + "FLAGCX_MESH_AGENT_COOKIE_TABLE=" + v + " is neither auto nor off: taken as auto");
  }
  auto t = std::make_unique<cma::CookieTable>();
  if (!t->ok()) FXM_INFO(-1, who() + "no cookie table (" + t->why_not() + "): peers read cookies through cma");
  return t;
}

// In the cookie table where it can be (a peer's check is then a load), else in memory of its own.
void Agent::set_cookie(Window* w) {
  if (!cookie_table_tried_) {
    cookies_ = make_cookie_table();
    cookie_table_tried_ = true;
  }
  w->nonce = random_cookie();
  uint64_t* slot = cookies_ ? cookies_->slot(w->index) : nullptr;
  if (!slot) return w->own_cookie(0);  // sealed once described (add_region)
  *slot = 0;
  w->cookie = slot;
}

RegionDesc Agent::add_region(std::shared_ptr<Window> w, const std::string& shm_name) {
  require_open("register");
  std::lock_guard<std::mutex> lock(mu_);  // one index per window, in order
  w->index = windows_.next_index();
  set_cookie(w.get());
  WindowDesc d = describe_local(*w, host_, shm_name);
  if (w->dev) describe_device(w, &d);
  if (w->kind != WindowKind::kSignal) w->ucx_reg = register_with_ucx(w->base, w->size, w->dev != nullptr, &d, false);
  seal_window(*w, d);  // peers bind the descriptor to this registration (transport/binding.h)
  w->own.set({-1, w->index, w->nonce, reinterpret_cast<uint64_t>(w->base), w->size});
  windows_.add(w);
  return RegionDesc{name_, incarnation_, w->index, w->size, w->kind, d.encode()};
}

RegionDesc Agent::register_memory(void* base, uint64_t size) {
  if (base == nullptr && size != 0) fail(Code::kInvalidArgument, -1, 0, who() + "register: a null buffer");
  auto w = std::make_shared<Window>();
  w->kind = WindowKind::kUser;
  w->base = static_cast<uint8_t*>(base);
  w->size = size;
  return add_region(std::move(w), "");
}

RegionDesc Agent::register_device(void* base, uint64_t size) {
  if (base == nullptr) fail(Code::kInvalidArgument, -1, 0, who() + "register: a null device pointer");
  std::shared_ptr<Window> w;
  try {
    w = wrap_device_window(base, size);
  } catch (const Error& e) {
    fail(e.code(), -1, e.sys_errno(), who() + "register: " + e.what());
  }
  return add_region(std::move(w), "");
}

// The segment keeps its name until deregister (peers map it when they first
// use it); the agent unlinks it then, or at close.
RegionDesc Agent::alloc(uint64_t size) {
  if (size == 0) fail(Code::kInvalidArgument, -1, 0, who() + "alloc: size must be > 0");
  auto w = std::make_shared<Window>();
  w->kind = WindowKind::kShm;
  w->seg = std::make_shared<shm::Segment>(shm::Segment::create_unique(size));
  w->base = w->seg->data();
  w->size = size;
  std::string name = w->seg->name();
  return add_region(std::move(w), name);
}

uint8_t* Agent::region_base(uint32_t index) const {
  Window* w = windows_.find(index);
  return w && w->live.load() && w->kind != WindowKind::kDevice ? w->base : nullptr;
}

std::shared_ptr<Window> Agent::window_for(const RegionDesc& d, const char* op, bool* entered) const {
  auto what = [&] { return who() + op + ": local region #" + std::to_string(d.index); };  // on failure only
  if (d.agent != name_ || d.incarnation != incarnation_) {
    fail(Code::kInvalidArgument, -1, 0, what() + " is agent " + d.agent + "'s (incarnation " +
                                            incarnation_hex(d.incarnation) + "), not this agent's");
  }
  std::shared_ptr<Window> w = windows_.get(d.index);
  if (!w || !w->enter()) fail(Code::kInvalidArgument, -1, 0, what() + " was deregistered");
  *entered = true;
  return w;
}

void Agent::deregister(const RegionDesc& region, double timeout_s) {
  require_open("deregister");
  check_call_timeout(timeout_s, who() + "deregister: timeout");
  bool entered = false;
  std::shared_ptr<Window> w = window_for(region, "deregister", &entered);
  w->leave();
  if (w->closing.exchange(true)) {
    fail(Code::kInvalidArgument, -1, 0, who() + "deregister: region #" + std::to_string(region.index) +
                                            " is already being closed");
  }
  Deadline deadline = Deadline::after_seconds(timeout_s > 0 ? timeout_s : timeout_s_);
  std::vector<std::shared_ptr<Connection>> conns;
  {
    std::lock_guard<std::mutex> lock(mu_);
    conns = conns_;
  }
  try {
    for (auto& c : conns) c->flush(deadline);  // ops in flight from (or into) its memory
  } catch (const Error&) {
    w->closing = false;  // this agent's own transfer still uses it: it stays registered
    throw;
  }
  revoke(*w, deadline);
  uint32_t busy = std::max(w->users.load(), w->cut_off.load());  // still inside, or cut off already
  if (w->seg) w->seg->unlink();
  w->ucx_reg.reset();  // UCX's mapping goes before the memory it maps
  w->seg.reset();
  drop_exports(*w);
  if (busy != 0) {
    fail(Code::kTimeout, -1, 0, who() + "deregister: region #" + std::to_string(region.index) + " was closed, but " +
                                    std::to_string(busy) + " transfer(s) of peers were still landing in it (or " +
                                    "reading from it) when the timeout passed: they were cut off (the rest of their " +
                                    "bytes goes to a sink, the peers' handles fail naming the region), and the " +
                                    "region may hold part of what they wrote");
  }
}

// Closes a region to peers: new frames and answers are refused at once, those in flight are
// waited for until `deadline` (Window::users), and then cut off: no frame lands in it and no
// answer reads it once this returns (a frame still landing sends its remaining bytes to a sink;
// an answer still reading fails its connection). The caller reads Window::users for what was cut.
// No cma or device path can be chosen for it again. Same-host peers that already mapped it or checked its cookie are out of
// reach: see docs/agent.md, "Deregistering".
void Agent::revoke(Window& w, const Deadline& deadline) {
  w.sealed = true;  // new frames and answers are refused; those inside may finish until the deadline
  if (w.cookie) __atomic_store_n(w.cookie, 0, __ATOMIC_RELEASE);  // no path can be chosen for it again (as seal_window)
  w.own.reset();
  while (w.users.load() != 0 && !deadline.expired()) std::this_thread::sleep_for(std::chrono::microseconds(50));
  w.live = false;  // what is still inside is cut off at its next read or copy
  // One socket read or one chunk's copy at most: a short wait, past the deadline too.
  Deadline grace = Deadline::after_seconds(std::max(1.0, deadline.seconds_left()));
  if (!w.wait_io(grace)) {
    FXM_ERROR(-1, who() + "deregister: region #" + std::to_string(w.index) + ": a copy into it did not end");
  }
  if (w.kind == WindowKind::kDevice && w.dev) {  // copies up queued on the landing stream before
    try {
      cuda::wait_for_stream(w.device, cuda::landing_stream(w.device), grace,
                            who() + "deregister: region #" + std::to_string(w.index));
    } catch (const Error& e) {
      FXM_ERROR(-1, e.what());
    }
  }
}

// The exports go in the descriptor except the cuMem fds: those are made on a
// peer's first fetch (lookup_fds), so a registration costs a few driver
// queries and no export a peer may never use.
void Agent::describe_device(const std::shared_ptr<Window>& w, WindowDesc* d) {
  d->dev = w->dev->export_for_peers(false);
  if (d->dev.vmm.empty()) return;
  std::lock_guard<std::mutex> lock(exports_mu_);
  try {
    if (!fd_server_) {
      fd_server_ = std::make_unique<cuda::FdServer>([this](uint64_t t, std::vector<int>* fds) { return lookup_fds(t, fds); });
    }
  } catch (const Error& e) {
    d->dev.vmm.clear();
    d->dev.why_no_vmm = std::string("no fd server: ") + e.what();
    return;
  }
  d->fd_token = random_cookie();
  d->fd_socket = fd_server_->name();
  exports_[d->fd_token] = w;
}

bool Agent::lookup_fds(uint64_t token, std::vector<int>* out) {
  std::lock_guard<std::mutex> lock(exports_mu_);
  auto it = exports_.find(token);
  if (it == exports_.end()) return false;
  std::shared_ptr<Window> w = it->second.lock();
  if (!w || !w->live.load()) return false;
  std::string why;
  std::vector<int> fds = w->dev->export_fds(&why);
  if (fds.empty()) FXM_WARN(-1, who() + "region #" + std::to_string(w->index) + ": " + why + " (its peers take another path)");
  for (int fd : fds) {
    int twin = ::fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (twin >= 0) out->push_back(twin);
  }
  return true;
}

// A closed device region's exports: no peer fetches its cuMem fds any more
// (peers that mapped it keep their mapping until their connection closes).
void Agent::drop_exports(const Window& w) {
  if (!w.dev) return;
  {
    std::lock_guard<std::mutex> lock(exports_mu_);
    for (auto it = exports_.begin(); it != exports_.end();) {
      auto held = it->second.lock();
      it = !held || held.get() == &w ? exports_.erase(it) : std::next(it);
    }
  }
  w.dev->drop_fds();
}

// ------------------------------------------------------------ connections

std::string Agent::judge(const PeerInfo& p) const {
  auto it = superseded_.find(p.name);
  if (it != superseded_.end() && it->second.count(p.incarnation)) {
    return "incarnation " + incarnation_hex(p.incarnation) + " of agent " + p.name +
           " was superseded by a newer one (that agent restarted)";
  }
  if (p.name == name_ && p.incarnation == incarnation_) return "it claims to be this agent";
  return "";
}

// The old incarnation's connections stay in the table, ended: the inbox's next sweep keeps what
// they delivered and nobody read yet (its engine read up to the old peer's end, or up to the
// probe's limit for a hung one), and they leave the table then.
std::string Agent::adopt(const std::shared_ptr<Connection>& c) {
  std::vector<std::shared_ptr<Connection>> old;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) return "agent " + name_ + " is closing";
    std::string why = judge(c->peer());
    if (!why.empty()) return why;
    for (auto& k : conns_) {
      if (k->peer().name == c->peer().name && k->peer().incarnation != c->peer().incarnation) {
        superseded_[k->peer().name].insert(k->peer().incarnation);
        old.push_back(k);
      }
    }
    conns_.push_back(c);
    if (c->initiated()) ++stats_.connected;
    else ++stats_.accepted;
  }
  for (auto& k : old) {
    std::string why = "incarnation " + incarnation_hex(k->peer().incarnation) + " of agent " + k->peer().name +
                      " was superseded by incarnation " + incarnation_hex(c->peer().incarnation) +
                      " (it restarted: its old connection had ended or stopped answering)";
    k->retire(why);
    closer_->close(k, why);
  }
  return "";
}

std::vector<std::shared_ptr<Connection>> Agent::rivals(const PeerInfo& p) const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::shared_ptr<Connection>> out;
  for (const auto& k : conns_) {
    if (k->peer().name == p.name && k->peer().incarnation != p.incarnation && !k->ended()) out.push_back(k);
  }
  return out;
}

std::string Agent::settle_name(const PeerInfo& p, const Deadline& deadline) const {
  std::vector<std::shared_ptr<Connection>> r = rivals(p);
  if (r.empty()) return "";
  NameProbe probe(std::move(r), deadline.min(Deadline::after_seconds(NameProbe::kLimitS)));
  while (true) {
    NameProbe::Verdict v = probe.step();
    if (v == NameProbe::Verdict::kAlive) return probe.refusal(p);
    if (v == NameProbe::Verdict::kGone) return "";
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

std::shared_ptr<Connection> Agent::find(const std::string& name, const Incarnation& inc) const {
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& c : conns_) {
    if (c->peer().name == name && c->peer().incarnation == inc && !c->ended()) return c;
  }
  return nullptr;
}

std::shared_ptr<Connection> Agent::dial(const tcp::SockAddr& to, const Metadata* expect, const Deadline& d) {
  require_open("connect");
  hs::Ident me{name_, expect ? expect->incarnation : Incarnation{}};
  me.lanes = static_cast<uint8_t>(tcp_lanes_);
  me.ucx_worker = ucx_worker_address();  // "" unless UCX is wanted (transport/ucx/ucx_path.h)
  crypto::random_bytes(reinterpret_cast<uint8_t*>(&me.token), sizeof(me.token));
  hs::Dialed got = hs::dial(to, me, incarnation_, key_, d, who());
  int lanes = std::min(tcp_lanes_, got.lanes);
  auto c = std::make_shared<Connection>(this, std::move(got.fd), got.peer, true, lanes, me.token);
  me.expect = got.peer.incarnation;
  join_lanes(*c, to, me, d);
  std::string why;
  if (expect && c->peer().name != expect->name) {
    why = "the agent there is " + c->peer().name + ", not the " + expect->name + " its metadata names";
  } else if (!expect) {
    why = settle_name(c->peer(), d);  // another live agent of that name: not this one (metadata: settled before)
  }
  if (!why.empty()) {
    c->close(why);
    fail(Code::kInvalidArgument, -1, 0, who() + "connect to " + to.str() + ": " + why);
  }
  why = adopt(c);
  if (!why.empty()) fail(Code::kInvalidArgument, -1, 0, who() + "connect to " + to.str() + ": " + why);
  try {
    c->start();
  } catch (const std::exception& e) {  // no engine (no thread, no eventfd): not left filed, never started
    c->close(std::string("it could not start: ") + e.what());
    forget(c);
    throw;
  }
  return c;
}

void Agent::join_lanes(Connection& c, const tcp::SockAddr& to, hs::Ident me, const Deadline& d) {
  me.lanes = static_cast<uint8_t>(c.tcp_lanes());
  me.ucx_worker.clear();  // lane 0 carried it
  std::vector<hs::Dialed> lanes = hs::dial_lanes(to, me, incarnation_, key_, d, who());
  for (size_t k = 0; k < lanes.size(); ++k) c.add_lane(static_cast<int>(k + 1), std::move(lanes[k].fd));
}

std::shared_ptr<Connection> Agent::connect(const std::vector<uint8_t>& metadata, double timeout_s) {
  check_call_timeout(timeout_s, who() + "connect: timeout");
  Metadata m = Metadata::decode(metadata);
  if (auto c = find(m.name, m.incarnation)) return c;
  {
    std::lock_guard<std::mutex> lock(mu_);
    std::string why = judge(PeerInfo{m.name, m.incarnation, m.address.str()});
    if (!why.empty()) fail(Code::kInvalidArgument, -1, 0, who() + "connect: " + why);
  }
  Deadline d = Deadline::after_seconds(timeout_s > 0 ? timeout_s : timeout_s_);
  std::string why = settle_name(PeerInfo{m.name, m.incarnation, m.address.str()}, d);  // before it admits us
  if (!why.empty()) fail(Code::kInvalidArgument, -1, 0, who() + "connect to " + m.address.str() + ": " + why);
  return dial(m.address, &m, d);
}

std::shared_ptr<Connection> Agent::connect_address(const std::string& host_port, double timeout_s) {
  check_call_timeout(timeout_s, who() + "connect: timeout");
  tcp::SockAddr to;
  if (!parse_host_port(host_port, &to)) {
    fail(Code::kInvalidArgument, -1, 0, who() + "connect: \"" + host_port + "\" is not host:port");
  }
  return dial(to, nullptr, Deadline::after_seconds(timeout_s > 0 ? timeout_s : timeout_s_));
}

std::shared_ptr<Connection> Agent::connection(const std::string& name) const {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = conns_.rbegin(); it != conns_.rend(); ++it) {
    if ((*it)->peer().name == name && !(*it)->ended()) return *it;
  }
  return nullptr;
}

std::vector<PeerInfo> Agent::peers() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<PeerInfo> out;
  for (const auto& c : conns_) {
    if (!c->ended()) out.push_back(c->peer());
  }
  return out;
}

// Connections whose peer is gone leave the table (their handles keep them).
std::vector<std::shared_ptr<Connection>> Agent::take_ended() {
  std::vector<std::shared_ptr<Connection>> dead;
  std::lock_guard<std::mutex> lock(mu_);
  // One test per connection: one that ends between two tests would be dropped without its close.
  conns_.erase(std::remove_if(conns_.begin(), conns_.end(),
                              [&dead](const std::shared_ptr<Connection>& c) {
                                if (!c->ended()) return false;
                                dead.push_back(c);
                                return true;
                              }),
               conns_.end());
  return dead;
}

void Agent::forget(const std::shared_ptr<Connection>& c) {
  std::lock_guard<std::mutex> lock(mu_);
  conns_.erase(std::remove(conns_.begin(), conns_.end(), c), conns_.end());
}

std::vector<Notification> Agent::notifications(double timeout_s, size_t most) {
  require_open("notifications");
  check_call_timeout(timeout_s, who() + "notifications: timeout");
  return inbox_->take(timeout_s, most);
}

void Agent::wake_notifications() { inbox_->wake(); }

bool Agent::await_notifications(double timeout_s) {
  require_open("await_notifications");
  check_call_timeout(timeout_s, who() + "await_notifications: timeout");
  return inbox_->await_any(timeout_s);
}

NotificationWait Agent::stream_wait_notification(const std::vector<uint8_t>& bytes, const std::string& peer,
                                                 void* stream, double timeout_s) {
  require_open("stream_wait_notification");
  check_call_timeout(timeout_s, who() + "stream_wait_notification: timeout");
  if (!peer.empty()) check_peer_name("stream_wait_notification", peer);
  return inbox_->stream_wait(bytes, peer, stream, timeout_s);
}

std::shared_ptr<WaitState> Agent::watch_notification(const std::vector<uint8_t>& bytes,
                                                     std::shared_ptr<Connection> conn, double timeout_s,
                                                     std::function<void(const WaitState&)> on_release) {
  require_open("a watch for a notification");
  check_call_timeout(timeout_s, who() + "a watch for a notification: timeout");
  return inbox_->watch_for(bytes, std::move(conn), timeout_s > 0 ? timeout_s : timeout_s_, std::move(on_release));
}

bool Agent::withdraw_watch(const std::shared_ptr<WaitState>& w) { return inbox_->withdraw(w); }

Notification Agent::wait_notification(const std::vector<uint8_t>* bytes, const std::string& peer, double timeout_s) {
  require_open("wait_notification");
  check_peer_name("wait_notification", peer);
  check_call_timeout(timeout_s, who() + "wait_notification: timeout");
  return inbox_->host_wait(bytes, peer, timeout_s > 0 ? timeout_s : timeout_s_);
}

void Agent::unread(std::vector<Notification> ns) { inbox_->unread(std::move(ns)); }

void Agent::claim_notifications(std::vector<uint8_t> prefix,
                                std::function<bool(const std::shared_ptr<Connection>&, Notification&)> fn) {
  require_open("claim_notifications");
  if (!inbox_->claim(std::move(prefix), std::move(fn))) {
    fail(Code::kInvalidArgument, -1, 0,
         who() + "claim_notifications: the prefix is claimed already (one claim per prefix)");
  }
}

void Agent::unclaim_notifications(const std::vector<uint8_t>& prefix) { inbox_->unclaim(prefix); }

void Agent::deliver_notification(Notification n) { inbox_->deliver(std::move(n)); }

void Agent::close() {
  if (closed_.exchange(true)) return;
  inbox_->close();  // every stream wait released (before the connections close: it was the agent, not a peer)
  uint64_t one = 1;
  if (wake_fd_ >= 0 && ::write(wake_fd_, &one, sizeof(one)) < 0) FXM_WARN(-1, who() + "waking the listener failed");
  if (listener_.joinable()) listener_.join();
  closer_->stop();  // the closes handed to it are done
  std::vector<std::shared_ptr<Connection>> conns;
  {
    std::lock_guard<std::mutex> lock(mu_);
    conns.swap(conns_);
  }
  for (auto& c : conns) c->close_for_agent();
  std::unique_ptr<cuda::FdServer> server;
  {
    std::lock_guard<std::mutex> lock(exports_mu_);  // its thread takes this lock: stopped outside it
    server.swap(fd_server_);
  }
  server.reset();
  for (auto& w : windows_.all()) {  // the engines stopped: nothing lands any more
    w->live = false;
    if (w->cookie) __atomic_store_n(w->cookie, 0, __ATOMIC_RELEASE);
    w->own.reset();
    w->wait_io(Deadline::after_seconds(1));
    if (w->seg) w->seg->unlink();
    drop_exports(*w);
  }
  listen_fd_.reset();
  if (wake_fd_ >= 0) ::close(wake_fd_);
  wake_fd_ = -1;
}

}  // namespace fxm::agent
