#include "testing/test_adaptor.h"

#include <arpa/inet.h>
#include <netinet/tcp.h>
#include <poll.h>

#include <cerrno>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <vector>

#include "base/clock.h"
#include "base/status.h"
#include "transport/tcp/socket.h"

namespace fxm::adaptor {
namespace {

constexpr uint64_t kHandleMagic = 0x4b4e'494c'4d58'4621ull;  // constant, like the IB adaptor's
constexpr size_t kHandleSize = 64;
constexpr size_t kAddrOff = 8, kStateOff = 32;  // [magic][addr 20][pad][connect state ptr]

const char* name_of(int mode) {
  switch (mode) {
    case FLAGCX_MESH_TEST_ADAPTOR_IB_STRICT: return "flagcx_mesh-test (loopback TCP, IB-strict)";
    case FLAGCX_MESH_TEST_ADAPTOR_SOCKET: return "flagcx_mesh-test (loopback TCP, socket-like)";
  }
  return "flagcx_mesh-test (loopback TCP, IB-like)";
}

// A comm: one socket per slot (IB modes: one slot). Message j travels on
// slot j % slots.size(); an empty slot (a mixed accept) fails its messages.
struct Comm {
  std::vector<tcp::Fd> socks;
  size_t next = 0;  // messages posted so far (one direction per comm)
  int cts = 0;      // IB-strict send side: irecvs the peer posted, not yet used
  bool recv_null_given = false;  // IB-strict recv side: this message's NULL was handed out
};

struct Listener {
  tcp::Fd fd;
  std::string addr;
  bool waiting = false;  // a jittered accept is pending
  Clock::time_point act_at{};
  tcp::Fd unindexed;                  // SOCKET: accepted, index byte not read yet
  std::unique_ptr<Comm> partial;      // SOCKET: the comm being assembled
  uint32_t taken = 0;                 // SOCKET: sockets filed into `partial`
};

struct Connect {
  enum Stage { kFresh, kWaiting, kConnecting, kAwaitAck } stage = kFresh;
  Clock::time_point act_at{};
  tcp::SockAddr to;
  tcp::Fd fd;
  std::unique_ptr<Comm> comm;  // SOCKET: the sockets connected so far
};

struct Request {
  void* comm;  // closing it cancels the request
  int fd;
  bool send;
  uint8_t* buf;
  size_t size, done = 0;
};

struct Mr {
  void* comm;
  const uint8_t* base;
  size_t size;
};

class TestAdaptor {
 public:
  explicit TestAdaptor(const flagcx_mesh_test_adaptor_config_t& c) : cfg_(c), rng_(c.seed) {}
  int listen(void* handle, void** listen_comm);
  int connect(void* handle, void** send_comm);
  int accept(void* listen_comm, void** recv_comm);
  int close_comm(void* comm);
  int close_listen(void* listen_comm);
  int start(void* comm, bool send, const void* data, size_t size, void* mhandle, void** request);
  int test(void* request, int* done);
  int reg(void* comm, const void* data, size_t size, void** mhandle);
  int dereg(void* comm, void* mhandle);

  std::mutex mu;

 private:
  bool strict() const { return cfg_.mode == FLAGCX_MESH_TEST_ADAPTOR_IB_STRICT; }
  bool socket_like() const { return cfg_.mode == FLAGCX_MESH_TEST_ADAPTOR_SOCKET; }
  Clock::time_point jittered(uint32_t extra_us);
  int step_connect(Connect& c);
  int finish_connect(Connect& c, void** send_comm);
  int accept_socket(Listener& l, void** recv_comm);
  bool registered(void* comm, const void* data, size_t size, void* mhandle) const;
  int strict_gate(Comm& c, bool send, void** request);
  int progress(Request& r);
  void* keep(std::unique_ptr<Comm> c);
  std::unique_ptr<Comm> one_socket_comm(tcp::Fd fd);

  flagcx_mesh_test_adaptor_config_t cfg_;
  std::mt19937_64 rng_;
  std::set<std::string> own_;  // this adaptor's listening addresses
  std::map<void*, std::unique_ptr<Listener>> listeners_;
  std::map<void*, std::unique_ptr<Connect>> connects_;
  std::map<void*, std::unique_ptr<Comm>> comms_;
  std::map<void*, std::unique_ptr<Request>> requests_;
  std::map<void*, std::unique_ptr<Mr>> mrs_;
};

Clock::time_point TestAdaptor::jittered(uint32_t extra_us) {
  uint64_t us = extra_us;
  if (cfg_.jitter_us) us += std::uniform_int_distribution<uint64_t>(0, cfg_.jitter_us)(rng_);
  return Clock::now() + std::chrono::microseconds(us);
}

void nodelay(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

std::unique_ptr<Comm> TestAdaptor::one_socket_comm(tcp::Fd fd) {
  nodelay(fd.get());
  auto c = std::make_unique<Comm>();
  c->socks.push_back(std::move(fd));
  return c;
}

void* TestAdaptor::keep(std::unique_ptr<Comm> c) {
  void* key = c.get();
  comms_[key] = std::move(c);
  return key;
}

int TestAdaptor::listen(void* handle, void** listen_comm) {
  tcp::SockAddr any;
  auto* sin = reinterpret_cast<sockaddr_in*>(&any.ss);
  sin->sin_family = AF_INET;
  sin->sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  any.len = sizeof(sockaddr_in);
  tcp::SockAddr bound;
  int err = 0;
  auto l = std::make_unique<Listener>();
  l->fd = tcp::listen_on(any, &bound, &err);
  if (!l->fd) return err ? err : EIO;
  l->addr = bound.str();
  own_.insert(l->addr);
  uint8_t* h = static_cast<uint8_t*>(handle);
  std::memset(h, 0, kHandleSize);
  std::memcpy(h, &kHandleMagic, 8);
  tcp::addr_to_wire(bound, h + kAddrOff);
  *listen_comm = l.get();
  listeners_[l.get()] = std::move(l);
  return 0;
}

int TestAdaptor::connect(void* handle, void** send_comm) {
  uint8_t* h = static_cast<uint8_t*>(handle);
  uint64_t magic = 0;
  std::memcpy(&magic, h, 8);
  if (magic != kHandleMagic) return EPROTO;
  Connect* c = nullptr;
  std::memcpy(&c, h + kStateOff, sizeof(c));
  if (!c) {  // first call on this handle: the state lives in the adaptor, its key in the handle
    auto fresh = std::make_unique<Connect>();
    if (!tcp::addr_from_wire(h + kAddrOff, &fresh->to)) return EPROTO;
    c = fresh.get();
    connects_[c] = std::move(fresh);
    std::memcpy(h + kStateOff, &c, sizeof(c));
  } else if (!connects_.count(c)) {
    return EINVAL;  // a handle reused after its connection completed
  }
  int rc = step_connect(*c);
  if (rc != 0 || c->stage != Connect::kAwaitAck) return rc;
  rc = finish_connect(*c, send_comm);
  if (rc == 0 && *send_comm) {
    connects_.erase(c);
    void* none = nullptr;
    std::memcpy(h + kStateOff, &none, sizeof(none));
  }
  return rc;
}

// kAwaitAck: IB modes wait for the acceptor's byte; SOCKET sends this
// socket's index and goes on with the next socket, done after the last.
int TestAdaptor::finish_connect(Connect& c, void** send_comm) {
  if (!socket_like()) {
    uint8_t ack = 0;
    tcp::IoResult r = tcp::read_some(c.fd.get(), &ack, 1);
    if (!r.ok()) return r.err ? r.err : ECONNRESET;
    if (r.done == 0) return 0;
    *send_comm = keep(one_socket_comm(std::move(c.fd)));
    return 0;
  }
  if (!c.comm) c.comm = std::make_unique<Comm>();
  auto index = static_cast<uint8_t>(c.comm->socks.size());
  tcp::IoResult r = tcp::write_full(c.fd.get(), &index, 1, Deadline::after_seconds(1));
  if (!r.ok()) return r.err ? r.err : ECONNRESET;
  nodelay(c.fd.get());
  c.comm->socks.push_back(std::move(c.fd));
  uint32_t k = cfg_.socks_per_conn ? cfg_.socks_per_conn : 1;
  if (c.comm->socks.size() < k) {
    c.stage = Connect::kWaiting;  // the next socket, at once
    return 0;
  }
  *send_comm = keep(std::move(c.comm));
  return 0;
}

int TestAdaptor::step_connect(Connect& c) {
  if (c.stage == Connect::kFresh) {
    bool self = own_.count(c.to.str()) != 0;
    c.act_at = jittered(self ? cfg_.self_connect_delay_us : 0);
    c.stage = Connect::kWaiting;
  }
  if (c.stage == Connect::kWaiting) {
    if (Clock::now() < c.act_at) return 0;
    int err = 0;
    c.fd = tcp::connect_start(c.to, &err);
    if (!c.fd) return err ? err : EIO;
    c.stage = Connect::kConnecting;
  }
  if (c.stage == Connect::kConnecting) {
    pollfd p{c.fd.get(), POLLOUT, 0};
    if (::poll(&p, 1, 0) <= 0) return 0;
    int err = tcp::connect_error(c.fd.get());
    if (err) return err;
    c.stage = Connect::kAwaitAck;
  }
  return 0;
}

int TestAdaptor::accept(void* listen_comm, void** recv_comm) {
  auto it = listeners_.find(listen_comm);
  if (it == listeners_.end()) return EINVAL;
  Listener& l = *it->second;
  if (!l.waiting) {
    l.act_at = jittered(0);
    l.waiting = true;
  }
  if (Clock::now() < l.act_at) return 0;
  if (socket_like()) return accept_socket(l, recv_comm);
  tcp::SockAddr from;
  int err = 0;
  tcp::Fd fd = tcp::accept_one(l.fd.get(), &from, &err);
  if (!fd) return err;  // 0: nothing in the queue yet
  l.waiting = false;
  uint8_t ack = 1;
  tcp::IoResult r = tcp::write_full(fd.get(), &ack, 1, Deadline::after_seconds(1));
  if (!r.ok()) return r.err ? r.err : ECONNRESET;
  *recv_comm = keep(one_socket_comm(std::move(fd)));
  return 0;
}

// SOCKET: takes sockets one at a time, whoever sent them, filing each by its
// index byte, until socks_per_conn were taken (FlagCX's socket accept).
int TestAdaptor::accept_socket(Listener& l, void** recv_comm) {
  uint32_t k = cfg_.socks_per_conn ? cfg_.socks_per_conn : 1;
  if (!l.partial) l.partial = std::make_unique<Comm>(), l.partial->socks.resize(k), l.taken = 0;
  while (l.taken < k) {
    if (!l.unindexed) {
      tcp::SockAddr from;
      int err = 0;
      l.unindexed = tcp::accept_one(l.fd.get(), &from, &err);
      if (!l.unindexed) return err;  // 0: nothing in the queue yet
    }
    uint8_t index = 0;
    tcp::IoResult r = tcp::read_some(l.unindexed.get(), &index, 1);
    if (!r.ok()) return r.err ? r.err : ECONNRESET;
    if (r.done == 0) return 0;
    if (index >= k) return EPROTO;
    nodelay(l.unindexed.get());
    l.partial->socks[index] = std::move(l.unindexed);  // a duplicate index replaces (closes) the earlier one
    ++l.taken;
  }
  l.waiting = false;
  *recv_comm = keep(std::move(l.partial));
  return 0;
}

int TestAdaptor::close_comm(void* comm) {
  if (!comms_.erase(comm)) return EINVAL;
  for (auto it = requests_.begin(); it != requests_.end();) {  // cancel what was posted on it
    it = it->second->comm == comm ? requests_.erase(it) : std::next(it);
  }
  return 0;
}

int TestAdaptor::close_listen(void* listen_comm) {
  auto it = listeners_.find(listen_comm);
  if (it == listeners_.end()) return EINVAL;
  own_.erase(it->second->addr);
  listeners_.erase(it);
  return 0;
}

int TestAdaptor::reg(void* comm, const void* data, size_t size, void** mhandle) {
  if (!comms_.count(comm) || !data || !size) return EINVAL;
  auto m = std::make_unique<Mr>(Mr{comm, static_cast<const uint8_t*>(data), size});
  *mhandle = m.get();
  mrs_[m.get()] = std::move(m);
  return 0;
}

int TestAdaptor::dereg(void* comm, void* mhandle) {
  auto it = mrs_.find(mhandle);
  if (it == mrs_.end() || it->second->comm != comm) return EINVAL;
  mrs_.erase(it);
  return 0;
}

bool TestAdaptor::registered(void* comm, const void* data, size_t size, void* mhandle) const {
  auto it = mrs_.find(mhandle);
  if (it == mrs_.end() || it->second->comm != comm) return false;
  const uint8_t* p = static_cast<const uint8_t*>(data);
  return p >= it->second->base && p + size <= it->second->base + it->second->size;
}

// IB-strict: an isend waits for the peer's irecv (its clear-to-send byte);
// an irecv hands out one NULL per message, then posts and sends that byte.
int TestAdaptor::strict_gate(Comm& c, bool send, void** request) {
  int fd = c.socks[0].get();
  if (send) {
    uint8_t cts[64];
    tcp::IoResult r = tcp::read_some(fd, cts, sizeof(cts));
    if (!r.ok()) return r.err ? r.err : ECONNRESET;
    c.cts += static_cast<int>(r.done);
    if (c.cts == 0) return *request = nullptr, 0;
    --c.cts;
    return -1;  // go on and post
  }
  if (!c.recv_null_given) {
    c.recv_null_given = true;
    return *request = nullptr, 0;
  }
  c.recv_null_given = false;
  uint8_t cts = 1;
  tcp::IoResult r = tcp::write_full(fd, &cts, 1, Deadline::after_seconds(1));
  if (!r.ok()) return r.err ? r.err : ECONNRESET;
  return -1;
}

int TestAdaptor::start(void* comm, bool send, const void* data, size_t size, void* mhandle, void** request) {
  auto it = comms_.find(comm);
  if (it == comms_.end()) return EINVAL;
  Comm& c = *it->second;
  *request = nullptr;
  if (strict()) {
    if (!registered(comm, data, size, mhandle)) return EFAULT;  // IB cannot send unregistered memory
    int rc = strict_gate(c, send, request);
    if (rc >= 0) return rc;
  }
  const tcp::Fd& fd = c.socks[c.next++ % c.socks.size()];
  if (!fd) return ENOTCONN;  // a slot a mixed accept left empty
  auto r = std::make_unique<Request>(Request{comm, fd.get(), send, static_cast<uint8_t*>(const_cast<void*>(data)), size});
  *request = r.get();
  requests_[r.get()] = std::move(r);
  return 0;
}

int TestAdaptor::progress(Request& r) {
  while (r.done < r.size) {
    ssize_t k = r.send ? ::send(r.fd, r.buf + r.done, r.size - r.done, MSG_NOSIGNAL | MSG_DONTWAIT)
                       : ::recv(r.fd, r.buf + r.done, r.size - r.done, MSG_DONTWAIT);
    if (k > 0) {
      r.done += static_cast<size_t>(k);
      continue;
    }
    if (k == 0) return ECONNRESET;  // the other side closed mid-message
    if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
    if (errno != EINTR) return errno;
  }
  return 0;
}

int TestAdaptor::test(void* request, int* done) {
  auto it = requests_.find(request);
  if (it == requests_.end()) return EINVAL;
  int rc = progress(*it->second);
  *done = rc == 0 && it->second->done == it->second->size;
  if (*done || rc) requests_.erase(it);
  return rc;
}

TestAdaptor* self(void* ctx) { return static_cast<TestAdaptor*>(ctx); }

template <class F>
int locked(void* ctx, F&& body) {
  std::lock_guard<std::mutex> lock(self(ctx)->mu);
  return body(*self(ctx));
}

int c_listen(void* ctx, void* h, void** l) { return locked(ctx, [&](TestAdaptor& a) { return a.listen(h, l); }); }
int c_connect(void* ctx, void* h, void** s) { return locked(ctx, [&](TestAdaptor& a) { return a.connect(h, s); }); }
int c_accept(void* ctx, void* l, void** r) { return locked(ctx, [&](TestAdaptor& a) { return a.accept(l, r); }); }
int c_close(void* ctx, void* c) { return locked(ctx, [&](TestAdaptor& a) { return a.close_comm(c); }); }
int c_close_listen(void* ctx, void* l) { return locked(ctx, [&](TestAdaptor& a) { return a.close_listen(l); }); }
int c_isend(void* ctx, void* c, const void* d, size_t n, void* mh, void** r) {
  return locked(ctx, [&](TestAdaptor& a) { return a.start(c, true, d, n, mh, r); });
}
int c_irecv(void* ctx, void* c, void* d, size_t n, void* mh, void** r) {
  return locked(ctx, [&](TestAdaptor& a) { return a.start(c, false, d, n, mh, r); });
}
int c_test(void* ctx, void* r, int* done) { return locked(ctx, [&](TestAdaptor& a) { return a.test(r, done); }); }
int c_reg(void* ctx, void* c, void* d, size_t n, void** mh) {
  return locked(ctx, [&](TestAdaptor& a) { return a.reg(c, d, n, mh); });
}
int c_dereg(void* ctx, void* c, void* mh) { return locked(ctx, [&](TestAdaptor& a) { return a.dereg(c, mh); }); }

[[noreturn]] void bad(const std::string& what) { fail(Code::kInvalidArgument, -1, 0, "test adaptor: " + what); }

// The caller's config in this layout (a 0.2 config is mode IB).
flagcx_mesh_test_adaptor_config_t checked(const flagcx_mesh_test_adaptor_config_t* config) {
  constexpr size_t v1 = FLAGCX_MESH_TEST_ADAPTOR_CONFIG_SIZE_V1;
  if (config->size != v1 && config->size < sizeof(*config)) {
    bad("config->size is " + std::to_string(config->size) + ", expected sizeof(flagcx_mesh_test_adaptor_config_t) = " +
        std::to_string(sizeof(*config)) + " or " + std::to_string(v1) + " (FLAGCX_MESH_TEST_ADAPTOR_CONFIG_SIZE_V1)");
  }
  flagcx_mesh_test_adaptor_config_t c{};
  std::memcpy(&c, config, std::min(config->size, sizeof(c)));
  if (config->size == v1) c.mode = FLAGCX_MESH_TEST_ADAPTOR_IB, c.socks_per_conn = 1;
  if (c.jitter_us > 10'000'000 || c.self_connect_delay_us > 60'000'000) {
    bad("jitter_us must be <= 10 s and self_connect_delay_us <= 60 s");
  }
  if (c.mode < FLAGCX_MESH_TEST_ADAPTOR_IB || c.mode > FLAGCX_MESH_TEST_ADAPTOR_SOCKET) {
    bad("mode " + std::to_string(c.mode) + " is not IB (0), IB_STRICT (1) or SOCKET (2)");
  }
  if (c.socks_per_conn > FLAGCX_MESH_TEST_ADAPTOR_MAX_SOCKS) {
    bad("socks_per_conn must be <= " + std::to_string(FLAGCX_MESH_TEST_ADAPTOR_MAX_SOCKS));
  }
  if (c.socks_per_conn > 1 && c.mode != FLAGCX_MESH_TEST_ADAPTOR_SOCKET) bad("socks_per_conn > 1 needs mode SOCKET");
  if (c.mode == FLAGCX_MESH_TEST_ADAPTOR_IB_STRICT && !c.carry_bytes) bad("mode IB_STRICT needs carry_bytes");
  return c;
}

}  // namespace

void test_adaptor_create(const flagcx_mesh_test_adaptor_config_t* config, flagcx_mesh_net_adaptor_t* net) {
  if (!config || !net) bad("config and net must not be NULL");
  flagcx_mesh_test_adaptor_config_t c = checked(config);
  flagcx_mesh_net_adaptor_t out{};
  out.size = sizeof(out);
  out.name = name_of(c.mode);
  out.ctx = new TestAdaptor(c);
  out.handle_size = kHandleSize;
  out.listen = &c_listen;
  out.connect = &c_connect;
  out.accept = &c_accept;
  out.close_send = &c_close;
  out.close_recv = &c_close;
  out.close_listen = &c_close_listen;
  if (c.carry_bytes) {
    out.isend = &c_isend;
    out.irecv = &c_irecv;
    out.test = &c_test;
    if (c.mode != FLAGCX_MESH_TEST_ADAPTOR_IB) out.reg_mr = &c_reg, out.dereg_mr = &c_dereg;
  }
  *net = out;
}

bool is_test_adaptor(const flagcx_mesh_net_adaptor_t* net) {
  return net && net->size == sizeof(*net) && net->listen == &c_listen && net->ctx;
}

void test_adaptor_destroy(flagcx_mesh_net_adaptor_t* net) {
  if (!net) bad("net is NULL");
  if (net->ctx && !is_test_adaptor(net)) bad("net was not made by flagcx_mesh_test_adaptor_create");
  delete static_cast<TestAdaptor*>(net->ctx);
  *net = flagcx_mesh_net_adaptor_t{};
}

}  // namespace fxm::adaptor
