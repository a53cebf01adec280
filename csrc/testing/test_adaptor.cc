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

#include "base/clock.h"
#include "base/status.h"
#include "transport/tcp/socket.h"

namespace fxm::adaptor {
namespace {

constexpr uint64_t kHandleMagic = 0x4b4e'494c'4d58'4621ull;  // constant, like the IB adaptor's
constexpr size_t kHandleSize = 64;
constexpr size_t kAddrOff = 8, kStateOff = 32;  // [magic][addr 20][pad][connect state ptr]
const char* const kName = "flagcx_mesh-test (loopback TCP, IB-like)";

struct Listener {
  tcp::Fd fd;
  std::string addr;
  bool waiting = false;  // a jittered accept is pending
  Clock::time_point act_at{};
};

struct Connect {
  enum Stage { kFresh, kWaiting, kConnecting, kAwaitAck } stage = kFresh;
  Clock::time_point act_at{};
  tcp::SockAddr to;
  tcp::Fd fd;
};

struct Comm {
  tcp::Fd fd;
};

struct Request {
  void* comm;  // closing it cancels the request
  int fd;
  bool send;
  uint8_t* buf;
  size_t size, done = 0;
};

class TestAdaptor {
 public:
  explicit TestAdaptor(const flagcx_mesh_test_adaptor_config_t& c) : cfg_(c), rng_(c.seed) {}
  int listen(void* handle, void** listen_comm);
  int connect(void* handle, void** send_comm);
  int accept(void* listen_comm, void** recv_comm);
  int close_comm(void* comm);
  int close_listen(void* listen_comm);
  int start(void* comm, bool send, const void* data, size_t size, void** request);
  int test(void* request, int* done);

  std::mutex mu;

 private:
  Clock::time_point jittered(uint32_t extra_us);
  int step_connect(Connect& c);
  int progress(Request& r);
  void* new_comm(tcp::Fd fd);

  flagcx_mesh_test_adaptor_config_t cfg_;
  std::mt19937_64 rng_;
  std::set<std::string> own_;  // this adaptor's listening addresses
  std::map<void*, std::unique_ptr<Listener>> listeners_;
  std::map<void*, std::unique_ptr<Connect>> connects_;
  std::map<void*, std::unique_ptr<Comm>> comms_;
  std::map<void*, std::unique_ptr<Request>> requests_;
};

Clock::time_point TestAdaptor::jittered(uint32_t extra_us) {
  uint64_t us = extra_us;
  if (cfg_.jitter_us) us += std::uniform_int_distribution<uint64_t>(0, cfg_.jitter_us)(rng_);
  return Clock::now() + std::chrono::microseconds(us);
}

void* TestAdaptor::new_comm(tcp::Fd fd) {
  int one = 1;
  setsockopt(fd.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  auto c = std::make_unique<Comm>();
  c->fd = std::move(fd);
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
  uint8_t ack = 0;
  tcp::IoResult r = tcp::read_some(c->fd.get(), &ack, 1);
  if (!r.ok()) return r.err ? r.err : ECONNRESET;
  if (r.done == 0) return 0;
  *send_comm = new_comm(std::move(c->fd));
  connects_.erase(c);
  void* none = nullptr;
  std::memcpy(h + kStateOff, &none, sizeof(none));
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
  tcp::SockAddr from;
  int err = 0;
  tcp::Fd fd = tcp::accept_one(l.fd.get(), &from, &err);
  if (!fd) return err;  // 0: nothing in the queue yet
  l.waiting = false;
  uint8_t ack = 1;
  tcp::IoResult r = tcp::write_full(fd.get(), &ack, 1, Deadline::after_seconds(1));
  if (!r.ok()) return r.err ? r.err : ECONNRESET;
  *recv_comm = new_comm(std::move(fd));
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

int TestAdaptor::start(void* comm, bool send, const void* data, size_t size, void** request) {
  auto it = comms_.find(comm);
  if (it == comms_.end()) return EINVAL;
  auto r = std::make_unique<Request>(Request{comm, it->second->fd.get(), send,
                                             static_cast<uint8_t*>(const_cast<void*>(data)), size});
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
int c_isend(void* ctx, void* c, const void* d, size_t n, void** r) {
  return locked(ctx, [&](TestAdaptor& a) { return a.start(c, true, d, n, r); });
}
int c_irecv(void* ctx, void* c, void* d, size_t n, void** r) {
  return locked(ctx, [&](TestAdaptor& a) { return a.start(c, false, d, n, r); });
}
int c_test(void* ctx, void* r, int* done) { return locked(ctx, [&](TestAdaptor& a) { return a.test(r, done); }); }

}  // namespace

void test_adaptor_create(const flagcx_mesh_test_adaptor_config_t* config, flagcx_mesh_net_adaptor_t* net) {
  if (!config || !net) fail(Code::kInvalidArgument, -1, 0, "test adaptor: config and net must not be NULL");
  if (config->size < sizeof(*config)) {
    fail(Code::kInvalidArgument, -1, 0, "test adaptor: config->size is " + std::to_string(config->size) +
                                            ", expected at least sizeof(flagcx_mesh_test_adaptor_config_t) = " +
                                            std::to_string(sizeof(*config)));
  }
  if (config->jitter_us > 10'000'000 || config->self_connect_delay_us > 60'000'000) {
    fail(Code::kInvalidArgument, -1, 0, "test adaptor: jitter_us must be <= 10 s and self_connect_delay_us <= 60 s");
  }
  flagcx_mesh_net_adaptor_t out{};
  out.size = sizeof(out);
  out.name = kName;
  out.ctx = new TestAdaptor(*config);
  out.handle_size = kHandleSize;
  out.listen = &c_listen;
  out.connect = &c_connect;
  out.accept = &c_accept;
  out.close_send = &c_close;
  out.close_recv = &c_close;
  out.close_listen = &c_close_listen;
  if (config->carry_bytes) {
    out.isend = &c_isend;
    out.irecv = &c_irecv;
    out.test = &c_test;
  }
  *net = out;
}

bool is_test_adaptor(const flagcx_mesh_net_adaptor_t* net) {
  return net && net->size == sizeof(*net) && net->listen == &c_listen && net->ctx;
}

void test_adaptor_destroy(flagcx_mesh_net_adaptor_t* net) {
  if (!net) fail(Code::kInvalidArgument, -1, 0, "test adaptor: net is NULL");
  if (net->ctx && !is_test_adaptor(net)) {
    fail(Code::kInvalidArgument, -1, 0, "test adaptor: net was not made by flagcx_mesh_test_adaptor_create");
  }
  delete static_cast<TestAdaptor*>(net->ctx);
  *net = flagcx_mesh_net_adaptor_t{};
}

}  // namespace fxm::adaptor
