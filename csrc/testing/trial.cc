#include "testing/trial.h"

#include <array>
#include <cstring>
#include <memory>
#include <map>
#include <set>
#include <vector>

#include "adaptor/build_state.h"
#include <unistd.h>

#include "base/status.h"
#include "testing/no_deadline_boot.h"
#include "testing/test_adaptor.h"

namespace fxm::adaptor {
namespace {

// Wraps an adaptor; the chosen call fails once, on its (after + 1)-th use.
// It also keeps account of the comms handed out, so that a trial can prove
// every one was closed exactly once.
struct Fault {
  NetAdaptor inner{};
  std::string call;
  int after = 0;
  int seen = 0;
  bool exits = false;    // the chosen call ends the process instead of failing
  std::set<void*> open;  // comms returned by listen / connect / accept, not closed yet
  int bad_closes = 0;    // closes of a comm that was not open (double or foreign)
  std::set<void*> mrs;   // registrations not deregistered yet
  std::set<void*> connecting;  // handles connect was called with
  int bad_deregs = 0;
  // stranger: before its first real connect, open one more connection to the
  // same peer that sends it garbage ("garbage"), nothing ("silent"), or
  // ("forged") every copy of this rank's own identity header to that peer with
  // a wrong MAC, as one who read the header off the wire but lacks the key.
  std::string stranger;
  std::map<void*, std::vector<uint8_t>> handle_of;  // send comm -> the handle it connected to
  std::vector<uint8_t> foreign_handle;
  void* foreign_comm = nullptr;
  void* foreign_req = nullptr;
  uint8_t garbage[kIdentitySize] = {};
  bool hit(const char* name) {
    bool now = !call.empty() && call == name && seen++ == after;
    if (now && exits) _exit(kInjectedExit);  // a rank that dies mid-build
    return now;
  }
  // Drives the stranger's connect; true once its garbage is on the way.
  bool stranger_sent(const void* handle) {
    if (stranger.empty() || foreign_req || (foreign_comm && stranger == "silent")) return true;
    if (foreign_handle.empty()) {
      const uint8_t* h = static_cast<const uint8_t*>(handle);
      foreign_handle.assign(h, h + inner.handle_size);
      std::memset(garbage, 0xab, sizeof(garbage));
    }
    if (!foreign_comm && inner.connect(inner.ctx, foreign_handle.data(), &foreign_comm) != 0) return true;
    if (!foreign_comm) return false;
    if (stranger == "silent" || stranger == "forged") return true;
    inner.isend(inner.ctx, foreign_comm, garbage, sizeof(garbage), nullptr, &foreign_req);
    int done = 0;  // 64 bytes fit the socket buffer: the first test sends them
    if (foreign_req && inner.test(inner.ctx, foreign_req, &done) != 0) done = 1;
    return true;
  }
  // "forged": when this rank sends its identity to the stranger's peer, the
  // stranger sends the same header with its MAC altered.
  void forge_from(void* comm, const void* data, size_t size) {
    if (stranger != "forged" || !foreign_comm || foreign_req || size != kIdentitySize) return;
    auto it = handle_of.find(comm);
    if (it == handle_of.end() || it->second != foreign_handle) return;
    std::memcpy(garbage, data, size);
    garbage[size - 1] ^= 1;
    for (int copy = 0; copy < FLAGCX_MESH_TAGGED_IDENTITY_COPIES; ++copy) {  // all a real rank sends
      foreign_req = nullptr;
      if (inner.isend(inner.ctx, foreign_comm, garbage, sizeof(garbage), nullptr, &foreign_req) != 0) return;
      int done = 0;
      for (int spins = 0; foreign_req && !done && spins < 1000000; ++spins) {
        if (inner.test(inner.ctx, foreign_req, &done) != 0) return;
      }
    }
  }
  void close_stranger() {
    if (foreign_comm) inner.close_send(inner.ctx, foreign_comm);
  }
  int opened(int rc, void** comm) {
    if (rc == 0 && *comm) open.insert(*comm);
    return rc;
  }
  void closing(void* comm) { bad_closes += open.erase(comm) == 0; }
};

Fault* F(void* ctx) { return static_cast<Fault*>(ctx); }
int f_listen(void* c, void* h, void** l) {
  return F(c)->hit("listen") ? kInjectedFault : F(c)->opened(F(c)->inner.listen(F(c)->inner.ctx, h, l), l);
}
int f_connect(void* c, void* h, void** s) {
  if (!F(c)->stranger_sent(h)) return 0;  // still in progress: the real connect waits behind it
  // connect counts connections (a new handle), not the calls polling one
  bool fresh = F(c)->connecting.insert(h).second;
  if (fresh && F(c)->hit("connect")) return kInjectedFault;
  int rc = F(c)->opened(F(c)->inner.connect(F(c)->inner.ctx, h, s), s);
  if (rc == 0 && *s) {
    const uint8_t* b = static_cast<const uint8_t*>(h);
    F(c)->handle_of[*s].assign(b, b + F(c)->inner.handle_size);
  }
  return rc;
}
int f_accept(void* c, void* l, void** r) {
  return F(c)->hit("accept") ? kInjectedFault : F(c)->opened(F(c)->inner.accept(F(c)->inner.ctx, l, r), r);
}
int f_close_send(void* c, void* s) { return F(c)->closing(s), F(c)->inner.close_send(F(c)->inner.ctx, s); }
int f_close_recv(void* c, void* r) { return F(c)->closing(r), F(c)->inner.close_recv(F(c)->inner.ctx, r); }
int f_close_listen(void* c, void* l) { return F(c)->closing(l), F(c)->inner.close_listen(F(c)->inner.ctx, l); }
int f_isend(void* c, void* s, const void* d, size_t n, void* mh, void** q) {
  if (F(c)->hit("isend")) return kInjectedFault;
  F(c)->forge_from(s, d, n);
  return F(c)->inner.isend(F(c)->inner.ctx, s, d, n, mh, q);
}
int f_irecv(void* c, void* r, void* d, size_t n, void* mh, void** q) {
  return F(c)->hit("irecv") ? kInjectedFault : F(c)->inner.irecv(F(c)->inner.ctx, r, d, n, mh, q);
}
int f_reg(void* c, void* comm, void* d, size_t n, void** mh) {
  if (F(c)->hit("reg_mr")) return kInjectedFault;
  int rc = F(c)->inner.reg_mr(F(c)->inner.ctx, comm, d, n, mh);
  if (rc == 0) F(c)->mrs.insert(*mh);
  return rc;
}
int f_dereg(void* c, void* comm, void* mh) {
  F(c)->bad_deregs += F(c)->mrs.erase(mh) == 0;
  return F(c)->inner.dereg_mr(F(c)->inner.ctx, comm, mh);
}
int f_test(void* c, void* q, int* done) { return F(c)->hit("test") ? kInjectedFault : F(c)->inner.test(F(c)->inner.ctx, q, done); }

NetAdaptor wrap(Fault* f) {
  NetAdaptor w = f->inner;
  w.ctx = f;
  w.listen = &f_listen, w.connect = &f_connect, w.accept = &f_accept;
  w.close_send = &f_close_send, w.close_recv = &f_close_recv, w.close_listen = &f_close_listen;
  if (f->inner.isend) w.isend = &f_isend, w.irecv = &f_irecv, w.test = &f_test;
  if (f->inner.reg_mr) w.reg_mr = &f_reg, w.dereg_mr = &f_dereg;
  return w;
}

// One message over a built comm, with the adaptor's contract: registered
// when it wants, posted again while it answers NULL. 0 or an adaptor error.
struct Msg {
  void* comm;
  bool send;
  uint8_t* data;
  void* mh = nullptr;
  void* req = nullptr;
  bool done = false;
  int step(const NetAdaptor& net) {
    if (done) return 0;
    if (!req) {
      return send ? net.isend(net.ctx, comm, data, kIdentitySize, mh, &req)
                  : net.irecv(net.ctx, comm, data, kIdentitySize, mh, &req);
    }
    int finished = 0, rc = net.test(net.ctx, req, &finished);
    if (finished) done = true;
    return rc;
  }
};

// Over the built comms: every rank sends {src, dst} on send[p] and checks
// recv[p] brings {p, me}. Throws kProtocol / kTimeout / kSystem.
void verify(const NetAdaptor& net, int me, int n, void** send, void** recv, const Deadline& deadline) {
  std::vector<std::array<uint8_t, kIdentitySize>> out(n), in(n);
  std::vector<Msg> msgs;
  for (int p = 0; p < n; ++p) {
    encode_identity(0, crypto::Key{}, me, p, n, out[p].data());
    msgs.push_back(Msg{send[p], true, out[p].data()});
    msgs.push_back(Msg{recv[p], false, in[p].data()});
  }
  struct Deregister {  // on every way out, before the caller closes the comms
    const NetAdaptor& net;
    std::vector<Msg>& msgs;
    ~Deregister() {
      for (Msg& m : msgs) {
        if (m.mh) net.dereg_mr(net.ctx, m.comm, m.mh);
      }
    }
  } deregister{net, msgs};
  for (Msg& m : msgs) {
    if (net.reg_mr && net.reg_mr(net.ctx, m.comm, m.data, kIdentitySize, &m.mh)) {
      fail(Code::kSystem, -1, 0, "rank " + std::to_string(me) + ": verify: reg_mr failed");
    }
  }
  int spins = 0;
  for (size_t left = msgs.size(); left > 0;) {
    for (size_t i = 0; i < msgs.size(); ++i) {
      int peer = static_cast<int>(i / 2);
      bool was = msgs[i].done;
      if (msgs[i].step(net)) fail(Code::kSystem, peer, 0, "rank " + std::to_string(me) + ": verify: adaptor call with rank " + std::to_string(peer) + " failed");
      left -= msgs[i].done && !was;
      if (!msgs[i].done && deadline.expired()) fail(Code::kTimeout, peer, 0, "rank " + std::to_string(me) + ": verify: nothing from rank " + std::to_string(peer));
    }
    backoff(&spins);
  }
  for (int p = 0; p < n; ++p) {
    wire::ConnHeader id;
    std::string why = decode_identity(in[p].data(), 0, crypto::Key{}, me, n, &id);
    if (!why.empty() || id.src != p || id.dst != me) {
      fail(Code::kProtocol, p, 0, "rank " + std::to_string(me) + ": verify: miswired: recv slot " + std::to_string(p) +
                                      " holds rank " + std::to_string(id.src) + "'s connection" + (why.empty() ? "" : " (" + why + ")"));
    }
  }
}

std::string outcome_of(const Error& e) {
  if (e.code() == Code::kTimeout) return "hung";
  if (e.code() == Code::kProtocol && std::string(e.what()).find("miswired") != std::string::npos) return "miswired";
  return "failed";
}

void* const kSentinel = reinterpret_cast<void*>(static_cast<uintptr_t>(0x5e47));

void build_and_check(const NetAdaptor& net, const BootOps& boot, const TrialOptions& opt, TrialResult* res) {
  BuildConfig cfg{sizeof(BuildConfig), FLAGCX_MESH_BUILD_ORDERED, opt.timeout_s, opt.wiring_check ? 1 : 0,
                  opt.tag_base};
  set_builder(&cfg, opt.builder);
  int n = boot.nranks;
  std::vector<void*> send(n, kSentinel), recv(n, kSentinel);
  Clock::time_point t0 = Clock::now();
  Deadline deadline = Deadline::after_seconds(opt.timeout_s);
  try {
    build_full_mesh(&net, &boot, &cfg, send.data(), recv.data());
  } catch (const Error&) {
    res->seconds = seconds_since(t0);
    for (int p = 0; p < n; ++p) res->outputs_untouched &= send[p] == kSentinel && recv[p] == kSentinel;
    throw;
  }
  res->seconds = seconds_since(t0);
  try {
    if (opt.verify && net.isend) verify(net, boot.rank, n, send.data(), recv.data(), deadline);
  } catch (const Error&) {
    close_full_mesh(&net, n, send.data(), recv.data());
    throw;
  }
  res->verified = opt.verify && net.isend;
  close_full_mesh(&net, n, send.data(), recv.data());
}

// The bootstrap a trial builds over: the caller's, or FlagCX's model of it.
std::unique_ptr<NoDeadlineBoot> boot_model(const BootOps& boot, const std::string& kind) {
  if (kind == "own") return nullptr;
  if (kind == "flagcx" || kind == "flagcx-noabort") return std::make_unique<NoDeadlineBoot>(boot, kind == "flagcx");
  fail(Code::kInvalidArgument, -1, 0, "bootstrap must be 'own', 'flagcx' or 'flagcx-noabort', not '" + kind + "'");
}

}  // namespace

TrialResult run_trial(const BootOps& boot, const TrialOptions& opt) {
  if (!opt.stranger.empty() && opt.mode != FLAGCX_MESH_TEST_ADAPTOR_IB) {
    fail(Code::kInvalidArgument, -1, 0, "strangers are only sent over the test adaptor's IB mode");
  }
  std::unique_ptr<NoDeadlineBoot> model = boot_model(boot, opt.bootstrap);
  flagcx_mesh_test_adaptor_config_t tc{sizeof(tc), opt.jitter_us, opt.seed, opt.carry_bytes ? 1 : 0,
                                       opt.self_connect_delay_us, opt.mode, opt.socks_per_conn};
  NetAdaptor net{};
  test_adaptor_create(&tc, &net);
  Fault fault;
  fault.inner = net;
  fault.call = opt.fail_call;
  fault.after = opt.fail_after;
  fault.exits = opt.fail_exits;
  fault.stranger = opt.carry_bytes || opt.stranger == "silent" ? opt.stranger : "";
  NetAdaptor used = wrap(&fault);
  TrialResult res;
  try {
    build_and_check(used, model ? model->ops() : boot, opt, &res);
    res.outcome = "completed";
  } catch (const Error& e) {
    if (e.code() == Code::kInvalidArgument) {
      test_adaptor_destroy(&net);
      throw;
    }
    res.outcome = outcome_of(e);
    res.code = static_cast<int>(e.code());
    res.peer = e.peer();
    res.error = e.what();
  }
  fault.close_stranger();
  res.bad_closes = fault.bad_closes;
  res.left_open = static_cast<int>(fault.open.size());
  res.mr_left = static_cast<int>(fault.mrs.size());
  res.bad_deregs = fault.bad_deregs;
  res.boot_aborted = model && model->aborted();
  test_adaptor_destroy(&net);
  return res;
}

}  // namespace fxm::adaptor
