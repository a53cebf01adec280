// pybind11 bindings: thin; the GIL is released around everything that blocks.
// Errors become flagcx_mesh.errors classes through errors._from_core().
#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>

#include "bootstrap/sealed_id.h"
#include "bootstrap/unique_id.h"
#include "base/log.h"
#include "base/env.h"
#include "agent/agent.h"
#include "core/mesh.h"
#include "base/status.h"
#include "base/wire.h"
#include "python/bindings.h"
#include "transport/cuda/device_memory.h"
#include "transport/cuda/driver.h"
#include "transport/cuda/staged_payload.h"
#include "transport/ucx/runtime.h"
#include "transport/ucx/ucx_path.h"

namespace py = pybind11;
using fxm::Mesh;

namespace {

void translate_error(std::exception_ptr p) {
  try {
    if (p) std::rethrow_exception(p);
  } catch (const fxm::Error& e) {
    py::object errors = py::module_::import("flagcx_mesh.errors");
    // A message may quote bytes a peer sent (a forged descriptor's agent name): never a
    // UnicodeDecodeError instead of the error itself.
    std::string what = e.what();
    PyObject* decoded = PyUnicode_DecodeUTF8(what.data(), static_cast<Py_ssize_t>(what.size()), "backslashreplace");
    if (!decoded) {  // (out of memory): the error's own words in ASCII, never a null object
      PyErr_Clear();
      decoded = PyUnicode_DecodeASCII(what.data(), static_cast<Py_ssize_t>(what.size()), "replace");
    }
    if (!decoded) {
      PyErr_Clear();
      decoded = PyUnicode_FromString("(the error's text could not be decoded)");
    }
    if (!decoded) throw py::error_already_set();
    py::object text = py::reinterpret_steal<py::object>(decoded);
    py::object exc = errors.attr("_from_core")(static_cast<int>(e.code()), e.peer(), e.sys_errno(), text,
                                                e.peer_name());
    PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
  }
}

std::unique_ptr<Mesh> make_mesh(int nranks, const py::bytes& uid, int rank, int contexts,
                                double timeout, double header_timeout, int max_inflight,
                                uint64_t max_unreceived,
                                int64_t epoch, py::object on_phase) {
  std::string id = uid;
  fxm::MeshOptions opt;
  opt.contexts = contexts;
  opt.timeout_s = timeout;
  opt.header_timeout_s = header_timeout;
  opt.max_inflight = max_inflight;
  opt.max_unreceived = max_unreceived;
  opt.epoch = epoch;
  if (!on_phase.is_none()) {
    opt.on_phase = [on_phase](const std::string& phase) {
      py::gil_scoped_acquire gil;
      on_phase(phase);
    };
  }
  std::unique_ptr<Mesh> mesh;
  {
    py::gil_scoped_release release;
    mesh = std::make_unique<Mesh>(nranks, reinterpret_cast<const uint8_t*>(id.data()), id.size(),
                                  rank, opt);
  }
  return mesh;
}

py::dict timings(const Mesh& m) {
  const fxm::PhaseTimes& t = m.times();
  py::dict d;
  d["listen"] = t.listen;
  d["rendezvous"] = t.rendezvous;
  d["connect"] = t.connect;
  d["wiring"] = t.wiring;
  d["total"] = t.total;
  return d;
}

py::dict stats(const Mesh& m) {
  py::dict rejected;
  const fxm::BuildStats& s = m.stats();
  for (size_t i = 1; i < s.rejected.size(); ++i) {
    if (s.rejected[i]) rejected[fxm::wire::reject_name(static_cast<fxm::wire::Reject>(i))] = s.rejected[i];
  }
  py::dict d;
  d["rejected"] = rejected;
  d["rejected_total"] = s.total_rejected();
  d["connect_retries"] = s.connect_retries;
  d["accept_fd_exhausted"] = s.accept_fd_exhausted;
  // The most staging the staged puts of this process held for one peer at once (docs/gpu.md).
  d["staged_bytes_peak"] = fxm::cuda::staged_bytes_peak();
  fxm::Engine::ParkCounts parks = m.park_counts();
  d["progress_parks"] = parks.parks;
  d["progress_late_wakes"] = parks.late_wakes;
  fxm::Engine::AdmitCounts admits = m.admit_counts();
  d["tcp_early_admits"] = admits.early;
  d["tcp_admit_limit_waits"] = admits.limit_waits;
  // Memory get answers to peers hold now, and the most at once (bounded per peer: docs/design.md).
  fxm::Engine::AnswerCounts answers = m.answer_counts();
  d["get_answer_bytes_held"] = answers.held;
  d["get_answer_bytes_peak"] = answers.peak;
  return d;
}

void send(Mesh& m, int peer, const py::object& data, int ctx, double timeout) {
  fxm_py::ByteView view(data, false);
  py::gil_scoped_release release;
  m.send(peer, view.data(), view.size(), ctx, timeout);
}

py::bytes recv(Mesh& m, int peer, int ctx, double timeout) {
  std::vector<uint8_t> out;
  {
    py::gil_scoped_release release;
    out = m.recv(peer, ctx, timeout);
  }
  return py::bytes(reinterpret_cast<const char*>(out.data()), out.size());
}

// kind 0: a plain allgather; another kind (bootstrap::CallKind) takes part in
// that collective with raw bytes (the tests forge a peer's window description).
py::list allgather(Mesh& m, const py::bytes& mine, double timeout, uint16_t kind, uint32_t index) {
  std::string s = mine;
  fxm::bootstrap::Parts parts;
  {
    py::gil_scoped_release release;
    std::vector<uint8_t> v(s.begin(), s.end());
    parts = kind == 0 ? m.allgather(v, timeout)
                      : m.collective(v, timeout, {static_cast<fxm::bootstrap::CallKind>(kind), index});
  }
  py::list out;
  for (const auto& p : parts) out.append(py::bytes(reinterpret_cast<const char*>(p.data()), p.size()));
  return out;
}

void bind_mesh(py::module_& m) {
  py::class_<Mesh> cls(m, "Mesh");
  cls
      .def(py::init(&make_mesh), py::arg("nranks"), py::arg("unique_id"), py::arg("rank"),
           py::arg("contexts") = 1, py::arg("timeout") = 0.0, py::arg("header_timeout") = 5.0,
           py::arg("max_inflight") = 64, py::arg("max_unreceived") = 1ull << 30, py::arg("epoch") = -1,
           py::arg("on_phase") = py::none())
      .def_property_readonly("rank", &Mesh::rank)
      .def_property_readonly("nranks", &Mesh::nranks)
      .def_property_readonly("contexts", &Mesh::contexts)
      .def_property_readonly("tcp_lanes", &Mesh::tcp_lanes)
      .def("tcp_lane_ports", &Mesh::tcp_lane_ports, py::arg("peer"), py::arg("ctx") = 0)
      .def_property_readonly("mesh_id", &Mesh::mesh_id_hex)
      .def_property_readonly("closed", &Mesh::closed)
      .def("describe", &Mesh::describe)
      .def("timings", &timings)
      .def("stats", &stats)
      .def("send", &send, py::arg("peer"), py::arg("data"), py::arg("context"), py::arg("timeout"))
      .def("recv", &recv, py::arg("peer"), py::arg("context"), py::arg("timeout"))
      .def("allgather", &allgather, py::arg("data"), py::arg("timeout"), py::arg("call_kind") = 0,
           py::arg("call_index") = 0)
      .def("barrier", &Mesh::barrier, py::arg("timeout"), py::call_guard<py::gil_scoped_release>())
      .def("close", &Mesh::close, py::call_guard<py::gil_scoped_release>());
  fxm_py::bind_onesided(cls);
}

fxm::wire::ConnHeader header_from_dict(const py::dict& d) {
  fxm::wire::ConnHeader h;
  if (d.contains("magic")) h.magic = d["magic"].cast<uint32_t>();
  if (d.contains("version")) h.version = d["version"].cast<uint16_t>();
  h.role = static_cast<fxm::wire::Role>(d["role"].cast<uint16_t>());
  std::string id = d["mesh_id"].cast<py::bytes>();
  if (id.size() != 16) throw py::value_error("mesh_id must be 16 bytes");
  std::memcpy(h.mesh_id.data(), id.data(), 16);
  h.epoch = d["epoch"].cast<uint32_t>();
  h.src = d["src"].cast<int32_t>();
  h.dst = d["dst"].cast<int32_t>();
  h.context = d["context"].cast<uint32_t>();
  h.nranks = d["nranks"].cast<uint32_t>();
  h.ncontexts = d["ncontexts"].cast<uint32_t>();
  if (d.contains("ext_len")) h.ext_len = d["ext_len"].cast<uint32_t>();
  return h;
}

py::bytes wire_encode(const py::dict& d) {
  uint8_t out[fxm::wire::kConnHeaderSize];
  fxm::wire::ConnHeader h = header_from_dict(d);
  fxm::wire::encode(h, out);
  if (d.contains("magic")) std::memcpy(out, &h.magic, 4);  // allow forging a bad magic
  return py::bytes(reinterpret_cast<const char*>(out), sizeof(out));
}

// Decodes and validates like the mesh listener does; returns the verdict
// ("accepted" or the reject reason) and the decoded fields.
py::tuple wire_check(const py::bytes& raw, const py::dict& expect) {
  std::string b = raw;
  if (b.size() != fxm::wire::kConnHeaderSize) {
    return py::make_tuple(fxm::wire::reject_name(fxm::wire::Reject::kTruncated), py::none());
  }
  fxm::wire::ConnHeader h;
  fxm::wire::Reject why = fxm::wire::decode(reinterpret_cast<const uint8_t*>(b.data()), &h);
  if (why != fxm::wire::Reject::kNone) return py::make_tuple(fxm::wire::reject_name(why), py::none());
  fxm::wire::ConnHeader e = header_from_dict(expect);
  fxm::wire::Expect ex{e.mesh_id, e.epoch, e.dst, e.nranks, e.ncontexts, e.role};
  why = fxm::wire::validate(h, ex);
  py::dict d;
  d["role"] = static_cast<int>(h.role);
  d["mesh_id"] = py::bytes(reinterpret_cast<const char*>(h.mesh_id.data()), 16);
  d["epoch"] = h.epoch;
  d["src"] = h.src;
  d["dst"] = h.dst;
  d["context"] = h.context;
  d["nranks"] = h.nranks;
  d["ncontexts"] = h.ncontexts;
  return py::make_tuple(fxm::wire::reject_name(why), d);
}

py::dict unique_id_info(const py::bytes& raw) {
  std::string b = raw;
  fxm::bootstrap::UniqueId id =
      fxm::bootstrap::decode_unique_id(reinterpret_cast<const uint8_t*>(b.data()), b.size());
  py::dict d;
  d["root"] = id.root.str();
  d["mesh_id"] = fxm::wire::mesh_id_hex(id.mesh_id);
  d["epoch"] = id.epoch;
  return d;
}

py::bytes digest_bytes(const fxm::crypto::Digest& d) {
  return py::bytes(reinterpret_cast<const char*>(d.data()), d.size());
}

fxm::crypto::Key key_arg(const py::bytes& raw, const char* what) {
  std::string s = raw;
  fxm::crypto::Key k;
  if (s.size() != k.size()) throw py::value_error(std::string(what) + " must be 32 bytes");
  std::memcpy(k.data(), s.data(), k.size());
  return k;
}

// Test hooks of the key proofs (docs/security.md): SHA-256 and HMAC against
// published vectors, and the MACs a holder of the key would send.
void bind_crypto(py::module_& m) {
  m.def("_sha256", [](const py::bytes& data) {
    std::string s = data;
    return digest_bytes(fxm::crypto::sha256(s.data(), s.size()));
  });
  m.def("_hmac_sha256", [](const py::bytes& key, const py::bytes& data) {
    std::string k = key, s = data;
    return digest_bytes(fxm::crypto::hmac_sha256(k.data(), k.size(), s.data(), s.size()));
  });
  m.def("_derive_key", [](const py::bytes& secret, const py::bytes& mesh_id, uint32_t epoch) {
    std::string id = mesh_id;
    fxm::wire::MeshId mid{};
    if (id.size() != mid.size()) throw py::value_error("mesh_id must be 16 bytes");
    std::memcpy(mid.data(), id.data(), mid.size());
    return digest_bytes(fxm::wire::derive_key(key_arg(secret, "secret"), mid, epoch));
  });
  m.def("_handshake_mac", [](const py::bytes& key, int role, const py::bytes& hello, const py::bytes& answer) {
    std::string h = hello, a = answer;
    if (h.size() < fxm::wire::kHelloSize || a.size() < fxm::wire::kHelloSize) {
      throw py::value_error("hello and answer must hold a header and a nonce");
    }
    return digest_bytes(fxm::wire::handshake_mac(key_arg(key, "key"), static_cast<fxm::wire::Role>(role),
                                                 reinterpret_cast<const uint8_t*>(h.data()),
                                                 reinterpret_cast<const uint8_t*>(a.data())));
  });
  m.def("_equal_ct", [](const py::bytes& a, const py::bytes& b) {
    std::string x = a, y = b;
    return x.size() == y.size() && fxm::crypto::equal_ct(x.data(), y.data(), x.size());
  });
}

void bind_wire(py::module_& m) {
  m.def("_wire_encode", &wire_encode, "Encode a connection header (test helper).");
  m.def("_wire_check", &wire_check, "Decode + validate a header like the listener (test helper).");
  m.def("_unique_id_info", &unique_id_info, "Decode a unique id: root address and mesh id.");
  m.attr("CONN_HEADER_SIZE") = fxm::wire::kConnHeaderSize;
  m.attr("WIRE_VERSION") = fxm::wire::kVersion;
  m.attr("NONCE_SIZE") = fxm::wire::kNonceSize;
  m.attr("MAC_SIZE") = fxm::wire::kMacSize;
  m.attr("UNIQUE_ID_SIZE") = fxm::bootstrap::kUniqueIdSize;
  m.attr("AGENT_MAX_NOTIFICATION_BYTES") = fxm::agent::kMaxNotificationBytes;
  m.attr("MAX_MESSAGE_BYTES") = fxm::Engine::kMaxMessageBytes;
  m.attr("ROLE_CONNECT") = static_cast<int>(fxm::wire::Role::kConnect);
  m.attr("ROLE_ACCEPT") = static_cast<int>(fxm::wire::Role::kAccept);
  m.attr("ROLE_AGENT_CONNECT") = static_cast<int>(fxm::wire::Role::kAgentConnect);
  m.attr("ROLE_AGENT_ACCEPT") = static_cast<int>(fxm::wire::Role::kAgentAccept);
}

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "flagcx_mesh C++ core (private; use the flagcx_mesh package)";
  py::register_exception_translator(&translate_error);
  m.def("get_unique_id", [](uint32_t epoch) {
    fxm::bootstrap::UniqueIdBytes b;
    {
      py::gil_scoped_release release;
      b = fxm::bootstrap::get_unique_id(epoch);
    }
    return py::bytes(reinterpret_cast<const char*>(b.data()), b.size());
  }, py::arg("epoch") = 0);
  m.def("seal_unique_id", [](const py::bytes& shared, const py::bytes& next) {
    std::string s = shared, n = next;
    fxm::bootstrap::UniqueIdBytes nb{};
    fxm::bootstrap::UniqueId sid = fxm::bootstrap::decode_unique_id(reinterpret_cast<const uint8_t*>(s.data()), s.size());
    fxm::bootstrap::decode_unique_id(reinterpret_cast<const uint8_t*>(n.data()), n.size());
    std::memcpy(nb.data(), n.data(), nb.size());
    std::vector<uint8_t> out = fxm::bootstrap::seal_unique_id(sid, nb);
    return py::bytes(reinterpret_cast<const char*>(out.data()), out.size());
  }, py::arg("shared"), py::arg("next"),
        "Seals unique id `next` under the secret of unique id `shared` (for ranks that hold `shared`).");
  m.def("unseal_unique_id", [](const py::bytes& shared, const py::bytes& sealed) {
    std::string s = shared, x = sealed;
    fxm::bootstrap::UniqueId sid = fxm::bootstrap::decode_unique_id(reinterpret_cast<const uint8_t*>(s.data()), s.size());
    fxm::bootstrap::UniqueIdBytes b = fxm::bootstrap::unseal_unique_id(sid, std::vector<uint8_t>(x.begin(), x.end()));
    return py::bytes(reinterpret_cast<const char*>(b.data()), b.size());
  }, py::arg("shared"), py::arg("sealed"), "The unique id sealed by seal_unique_id (ProtocolError when forged).");
  m.def("release_unique_id", [](const py::bytes& raw) {
    std::string b = raw;
    py::gil_scoped_release release;
    return fxm::bootstrap::release_unique_id(reinterpret_cast<const uint8_t*>(b.data()), b.size());
  }, "End the root of an unused unique id made by this process; True when it was ended.");
  m.def("cuda_driver_error", [] { return fxm::cuda::driver() != nullptr ? std::string() : fxm::cuda::driver_error(); },
        "Why no CUDA driver could be loaded (\"\" when one is).");
  m.def("staged_waits", [] {
    py::dict d;
    for (const auto& [name, v] : fxm::cuda::staged_waits()) d[name] = v;
    return d;
  }, "Where this process's staged path waited since it started (flagcx_mesh.cuda.staged_waits).");
  m.def("device_of", [](uintptr_t addr) { return fxm::cuda::device_of(reinterpret_cast<const void*>(addr)); },
        py::arg("addr"), "The CUDA device of the device memory at addr; -1 for host memory or without a CUDA driver.");
  m.def("log_capture", &fxm::log_capture, py::arg("on"),
        "On: the core's log lines go to a bounded queue (log_take) instead of stderr.");
  m.def("log_take", [](double timeout, size_t max) {
        std::vector<fxm::CapturedLine> lines;
        uint64_t dropped = 0;
        {
          py::gil_scoped_release release;
          lines = fxm::log_take(timeout, max, &dropped);
        }
        py::list out;
        for (const auto& l : lines) out.append(py::make_tuple(static_cast<int>(l.level), l.text));
        return py::make_tuple(out, dropped);
      }, py::arg("timeout"), py::arg("max") = 1000,
        "([(level 0=error..3=debug, text)], lines dropped since the last call), waiting up to timeout for the first.");
  m.def("_ucx_set_wheel_library", &fxm::ucx::set_wheel_library, py::arg("path"),
        "The libucp of the libucx wheel (set by the package at import, before UCX is first opened).");
  m.def("ucx_info", [] {
        std::string why;
        fxm::ucx::Runtime* rt = nullptr;
        {
          py::gil_scoped_release release;
          rt = fxm::ucx::Runtime::get(&why);
        }
        py::dict d;
        d["loaded"] = rt != nullptr;
        d["library"] = fxm::ucx::library().path;
        d["version"] = fxm::ucx::library().version;
        d["transports"] = rt ? rt->transports() : std::vector<std::string>{};
        d["describe"] = rt ? rt->describe() : std::string();
        d["error"] = why;
        return d;
      }, "Opens UCX (once per process) and says what was loaded: library, version, transports, or why not.");
  m.def("_ucx_common_network_transport", &fxm::common_network_transport, py::arg("mine"), py::arg("theirs"),
        "The network transport automatic selection would take ucx for (\"\" when none; test helper).");
  m.def("_ucx_peer_error_handling", &fxm::ucx::peer_error_handling, py::arg("fabric"),
        "Whether an endpoint gets UCX's peer error handling under FLAGCX_MESH_UCX_ERROR_MODE, for a pair that "
        "shares a network transport other than tcp (fabric) or not (test helper).");
  m.def("_ucx_device_memory_transports", &fxm::device_memory_transports, py::arg("transports"),
        "The transports among these that move CUDA memory, \",\"-joined (\"\" when none: device memory is not "
        "registered with UCX; test helper).");
  m.def("default_timeout", [] { return fxm::default_timeout_s(); },
        "FLAGCX_MESH_TIMEOUT as the core read it (seconds; default 60).");
  m.def("local_address", [] { return fxm::tcp::local_address_reason(); },
        "Which address this process listens on and why (interface choice).");
  m.def("local_host", [] {
    std::string a = fxm::tcp::local_address().str();
    return a.substr(0, a.rfind(':'));
  }, "The host part of the address this process listens on.");
  bind_mesh(m);
  bind_wire(m);
  bind_crypto(m);
  fxm_py::bind_adaptor(m);
  fxm_py::bind_agent(m);
}
