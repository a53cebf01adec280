// Bindings for the net-adaptor builders: a bootstrap (rendezvous root plus
// point-to-point relay) and one build trial over the test adaptor. The GIL
// is released around everything that blocks.
#include <pybind11/stl.h>

#include "adaptor/boot_ops.h"
#include "testing/trial.h"
#include "python/bindings.h"

namespace fxm_py {
namespace {

using fxm::adaptor::TrialOptions;
using fxm::adaptor::TrialResult;

// Owns a flagcx_mesh bootstrap; close() (or destruction) says goodbye. Every
// call holds a reference while the GIL is released, so close() from another
// thread never frees a bootstrap in use: it wakes the call instead (which
// then fails) and the last holder says goodbye.
class NetBootstrap {
 public:
  NetBootstrap(int nranks, const py::bytes& uid, int rank, double timeout) {
    std::string id = uid;
    py::gil_scoped_release release;
    boot_ = fxm::adaptor::bootstrap_create(nranks, reinterpret_cast<const uint8_t*>(id.data()), id.size(),
                                           rank, timeout);
    fxm::adaptor::bootstrap_fill_ops(boot_.get(), &ops_);
  }
  int rank() const { return ops_.rank; }
  int nranks() const { return ops_.nranks; }
  std::shared_ptr<flagcx_mesh_bootstrap> hold() const {
    if (!boot_) fxm::fail(fxm::Code::kClosed, -1, 0, "NetBootstrap is closed");
    return boot_;
  }
  const flagcx_mesh_bootstrap_ops_t& ops() const { return ops_; }
  void close() {
    std::shared_ptr<flagcx_mesh_bootstrap> b = std::move(boot_);
    if (!b) return;
    py::gil_scoped_release release;
    if (b.use_count() > 1) b->client->interrupt();  // a call in another thread is using it
  }

 private:
  std::shared_ptr<flagcx_mesh_bootstrap> boot_;
  flagcx_mesh_bootstrap_ops_t ops_{};
};

fxm::Deadline after(double timeout) { return fxm::Deadline::after_seconds(timeout); }

py::list allgather(NetBootstrap& b, const py::bytes& mine, double timeout) {
  std::string s = mine;
  fxm::bootstrap::Parts parts;
  auto held = b.hold();
  {
    py::gil_scoped_release release;
    parts = held->client->allgather(std::vector<uint8_t>(s.begin(), s.end()), after(timeout));
  }
  py::list out;
  for (const auto& p : parts) out.append(py::bytes(reinterpret_cast<const char*>(p.data()), p.size()));
  return out;
}

void send(NetBootstrap& b, int peer, uint32_t tag, const py::bytes& data, double timeout) {
  std::string s = data;
  auto held = b.hold();
  py::gil_scoped_release release;
  held->client->send(peer, tag, s.data(), s.size(), after(timeout));
}

py::bytes recv(NetBootstrap& b, int peer, uint32_t tag, double timeout) {
  std::vector<uint8_t> out;
  auto held = b.hold();
  {
    py::gil_scoped_release release;
    out = held->client->recv(peer, tag, after(timeout));
  }
  return py::bytes(reinterpret_cast<const char*>(out.data()), out.size());
}

int builder_code(const py::object& builder) {
  if (py::isinstance<py::int_>(builder)) return builder.cast<int>();
  std::string name = builder.cast<std::string>();
  if (name == "legacy") return FLAGCX_MESH_BUILD_LEGACY;
  if (name == "ordered") return FLAGCX_MESH_BUILD_ORDERED;
  if (name == "tagged") return FLAGCX_MESH_BUILD_TAGGED;
  fxm::fail(fxm::Code::kInvalidArgument, -1, 0, "unknown builder '" + name + "' (legacy, ordered or tagged)");
}

int mode_code(const std::string& mode) {
  if (mode == "ib") return FLAGCX_MESH_TEST_ADAPTOR_IB;
  if (mode == "ib-strict") return FLAGCX_MESH_TEST_ADAPTOR_IB_STRICT;
  if (mode == "socket") return FLAGCX_MESH_TEST_ADAPTOR_SOCKET;
  fxm::fail(fxm::Code::kInvalidArgument, -1, 0, "unknown adaptor mode '" + mode + "' (ib, ib-strict or socket)");
}

py::dict trial(NetBootstrap& b, const py::object& builder, uint32_t jitter_us, uint64_t seed, double timeout,
               bool carry_bytes, uint32_t self_connect_delay_us, bool wiring_check, int tag_base, bool verify,
               const std::string& fail_call, int fail_after, const std::string& stranger, const std::string& mode,
               uint32_t socks_per_conn, const std::string& bootstrap, bool fail_exits) {
  TrialOptions o;
  o.mode = mode_code(mode), o.socks_per_conn = socks_per_conn, o.bootstrap = bootstrap, o.fail_exits = fail_exits;
  o.builder = builder_code(builder);
  o.jitter_us = jitter_us, o.seed = seed, o.timeout_s = timeout, o.carry_bytes = carry_bytes;
  o.self_connect_delay_us = self_connect_delay_us, o.wiring_check = wiring_check, o.tag_base = tag_base;
  o.verify = verify, o.fail_call = fail_call, o.fail_after = fail_after;
  if (stranger != "" && stranger != "garbage" && stranger != "silent" && stranger != "forged") {
    fxm::fail(fxm::Code::kInvalidArgument, -1, 0, "stranger must be '', 'garbage', 'silent' or 'forged'");
  }
  o.stranger = stranger;
  auto held = b.hold();
  const flagcx_mesh_bootstrap_ops_t& ops = b.ops();
  TrialResult r;
  {
    py::gil_scoped_release release;
    r = fxm::adaptor::run_trial(ops, o);
  }
  py::dict d;
  d["outcome"] = r.outcome, d["code"] = r.code, d["peer"] = r.peer, d["error"] = r.error;
  d["seconds"] = r.seconds, d["outputs_untouched"] = r.outputs_untouched, d["verified"] = r.verified;
  d["bad_closes"] = r.bad_closes, d["left_open"] = r.left_open;
  d["mr_left"] = r.mr_left, d["bad_deregs"] = r.bad_deregs, d["boot_aborted"] = r.boot_aborted;
  return d;
}

}  // namespace

void bind_adaptor(py::module_& m) {
  py::class_<NetBootstrap>(m, "NetBootstrap")
      .def(py::init<int, const py::bytes&, int, double>(), py::arg("nranks"), py::arg("unique_id"),
           py::arg("rank"), py::arg("timeout") = 0.0)
      .def_property_readonly("rank", &NetBootstrap::rank)
      .def_property_readonly("nranks", &NetBootstrap::nranks)
      .def("allgather", &allgather, py::arg("data"), py::arg("timeout"))
      .def("barrier", [](NetBootstrap& b, double t) { allgather(b, py::bytes(), t); }, py::arg("timeout"))
      .def("send", &send, py::arg("peer"), py::arg("tag"), py::arg("data"), py::arg("timeout") = 10.0)
      .def("recv", &recv, py::arg("peer"), py::arg("tag"), py::arg("timeout"))
      .def("close", &NetBootstrap::close);
  m.def("net_trial", &trial, py::arg("boot"), py::arg("builder"), py::arg("jitter_us") = 0, py::arg("seed") = 1,
        py::arg("timeout") = 10.0, py::arg("carry_bytes") = true, py::arg("self_connect_delay_us") = 0,
        py::arg("wiring_check") = true, py::arg("tag_base") = 0x6d780000, py::arg("verify") = true,
        py::arg("fail_call") = "", py::arg("fail_after") = 0, py::arg("stranger") = "", py::arg("mode") = "ib",
        py::arg("socks_per_conn") = 1, py::arg("bootstrap") = "own", py::arg("fail_exits") = false,
        "One build over a fresh test adaptor on every rank (collective over boot). Returns "
        "{outcome: completed|hung|miswired|failed, code, peer, error, seconds, outputs_untouched, "
        "verified, bad_closes, left_open, mr_left, bad_deregs, boot_aborted}; raises InvalidArgument "
        "for bad arguments.");
  py::dict builders;
  builders["legacy"] = static_cast<int>(FLAGCX_MESH_BUILD_LEGACY);
  builders["ordered"] = static_cast<int>(FLAGCX_MESH_BUILD_ORDERED);
  builders["tagged"] = static_cast<int>(FLAGCX_MESH_BUILD_TAGGED);
  m.attr("NET_BUILDERS") = builders;
}

}  // namespace fxm_py
