// Bindings of the agent (csrc/agent): AgentCore, AgentConnection,
// AgentHandle. Descriptors travel as bytes (RegionDesc::encode); every call
// that may block releases the GIL. The admission policy from Python is a set
// of names (a Python callback on the listener thread could deadlock a close).
#include <array>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include <pybind11/stl.h>

#include "agent/agent.h"
#include "agent/block_pull.h"
#include "agent/block_rows.h"
#include "agent/connection.h"
#include "agent/stream_wait.h"
#include "agent/want.h"
#include "python/bindings.h"

namespace fxm_py {
namespace {

// A timeout argument as the core takes it (flagcx_mesh/_timeouts.py's call_timeout, for the
// one core type Python hands out unwrapped): None is 0.0 (the agent's timeout); anything but
// a real number is refused naming `what`; the core checks the value.
double call_timeout(const py::object& timeout, const char* what) {
  if (timeout.is_none()) return 0.0;
  if (!PyBool_Check(timeout.ptr()) && (PyFloat_Check(timeout.ptr()) || PyLong_Check(timeout.ptr()) ||
                                       PyObject_HasAttrString(timeout.ptr(), "__float__"))) {
    return timeout.cast<double>();
  }
  fxm::fail(fxm::Code::kInvalidArgument, -1, 0,
            std::string(what) + " must be a number of seconds or None, got " + py::repr(timeout).cast<std::string>());
}

using fxm::agent::Agent;
using fxm::agent::Connection;
using fxm::agent::Handle;
using fxm::agent::RegionDesc;

std::vector<uint8_t> to_vec(const py::bytes& b) {
  std::string s = b;
  return std::vector<uint8_t>(s.begin(), s.end());
}

// A bytes-like argument (bytes, bytearray, memoryview, a numpy array: anything with a buffer)
// copied out; anything else (a str included: no encoding is guessed) is refused naming it.
// `check_size` (if any) sees the byte count before anything is copied, and throws to refuse it.
using SizeCheck = void (*)(size_t n, const std::string& what);
std::vector<uint8_t> bytes_arg(const py::handle& o, const char* name, SizeCheck check_size = nullptr) {
  if (PyBytes_Check(o.ptr())) {
    if (check_size) check_size(static_cast<size_t>(PyBytes_GET_SIZE(o.ptr())), name);
    return to_vec(py::reinterpret_borrow<py::bytes>(o));
  }
  if (PyUnicode_Check(o.ptr()) || !PyObject_CheckBuffer(o.ptr())) {
    fxm::fail(fxm::Code::kInvalidArgument, -1, 0, std::string(name) + " must be bytes-like (bytes, bytearray, "
                                                    "memoryview), not " + Py_TYPE(o.ptr())->tp_name);
  }
  Py_buffer view;
  if (PyObject_GetBuffer(o.ptr(), &view, PyBUF_C_CONTIGUOUS) != 0) {
    PyErr_Clear();
    fxm::fail(fxm::Code::kInvalidArgument, -1, 0, std::string(name) + " must be a C-contiguous buffer");
  }
  if (check_size) {
    try {
      check_size(static_cast<size_t>(view.len), name);
    } catch (...) {
      PyBuffer_Release(&view);
      throw;
    }
  }
  const uint8_t* p = static_cast<const uint8_t*>(view.buf);
  std::vector<uint8_t> out(p, p + view.len);
  PyBuffer_Release(&view);
  return out;
}

py::bytes to_bytes(const std::vector<uint8_t>& v) { return py::bytes(reinterpret_cast<const char*>(v.data()), v.size()); }

RegionDesc region(const py::bytes& b) { return RegionDesc::decode(to_vec(b)); }

py::dict region_info(const RegionDesc& d) {
  py::dict out;
  out["agent"] = d.agent;
  out["incarnation"] = fxm::agent::incarnation_hex(d.incarnation);
  out["index"] = d.index;
  out["size"] = d.size;
  out["kind"] = fxm::kind_name(d.kind);
  return out;
}

std::shared_ptr<Agent> make_agent(const std::string& name, const std::string& secret, std::optional<double> timeout,
                                  double header_timeout, const py::object& allow) {
  fxm::agent::AgentOptions o;
  o.name = name;
  o.secret = secret;
  o.timeout_s = timeout.value_or(0.0);
  o.header_timeout_s = header_timeout;
  if (!allow.is_none()) {
    auto names = std::make_shared<std::set<std::string>>(allow.cast<std::set<std::string>>());
    o.admit = [names](const fxm::agent::PeerInfo& p) {
      return names->count(p.name) ? std::string() : "agent " + p.name + " is not in this agent's allow list";
    };
  }
  py::gil_scoped_release release;
  return std::make_shared<Agent>(o);
}

// Decoded descriptors by their bytes. A connector names the same few regions in every call, and
// decoding one (its agent's name, its window) cost as much on the host as a small op's copy.
// Decoding is a function of the bytes alone, so a hit is what a decode would give; refusals
// (another agent's, a stale incarnation, a range) are checked per op as before. Bounded (cleared
// when full); used with the GIL held. shared_ptr: a call keeps what it looked up if a later
// lookup of the same call clears the cache.
using SharedDesc = std::shared_ptr<const RegionDesc>;
constexpr size_t kDecodedDescsMax = 4096;

// The last few descriptor objects looked up, by identity (a bytes object's contents never change):
// a connector passes the same bytes objects call after call, and a hit costs no copy or hash. Each
// entry holds a reference, so no other object can take its address while it is here.
struct RecentDesc {
  PyObject* obj = nullptr;
  SharedDesc desc;
};
constexpr size_t kRecentDescs = 8;

SharedDesc decoded_by_bytes(const py::handle& h);

SharedDesc decoded_region(const py::handle& h) {
  static RecentDesc recent[kRecentDescs];  // never destroyed: references are dropped only on eviction
  static size_t next = 0;
  for (const RecentDesc& r : recent) {
    if (r.obj == h.ptr()) return r.desc;
  }
  SharedDesc d = decoded_by_bytes(h);
  if (PyBytes_CheckExact(h.ptr())) {
    RecentDesc& slot = recent[next++ % kRecentDescs];
    PyObject* old = slot.obj;
    slot.obj = h.inc_ref().ptr();
    slot.desc = d;
    Py_XDECREF(old);
  }
  return d;
}

SharedDesc decoded_by_bytes(const py::handle& h) {
  static auto* cache = new std::unordered_map<std::string, SharedDesc>();  // never destroyed: used until exit
  char* data = nullptr;
  Py_ssize_t n = 0;
  if (!PyBytes_Check(h.ptr()) || PyBytes_AsStringAndSize(h.ptr(), &data, &n) != 0) {
    return std::make_shared<const RegionDesc>(region(h.cast<py::bytes>()));  // cast raises the type error
  }
  std::string key(data, static_cast<size_t>(n));
  auto it = cache->find(key);
  if (it != cache->end()) return it->second;
  auto d = std::make_shared<const RegionDesc>(RegionDesc::decode(std::vector<uint8_t>(key.begin(), key.end())));
  if (cache->size() >= kDecodedDescsMax) cache->clear();
  cache->emplace(std::move(key), d);
  return d;
}

// A call's handle as Python holds it: the core's Handle and a reference to the connection's Python
// object, which keeps the connection's agent alive as long as the handle (a reference costs less per
// call than pybind11's keep_alive table).
// The owner is declared first, so destroyed last: the connection is released before its agent may go.
struct PyHandle {
  PyHandle(Handle h, py::handle connection) : owner(py::reinterpret_borrow<py::object>(connection)), h(std::move(h)) {}
  py::object owner;
  Handle h;
};

// What a call takes beside its ops: its notification (bytes or None) and its stream (handle or None).
struct CallArgs {
  CallArgs(const py::object& notif, const std::optional<uint64_t>& stream) : has_notification(!notif.is_none()) {
    if (has_notification) notification = bytes_arg(notif, "notification", &fxm::agent::check_notification_size);
    on.set = stream.has_value();
    on.stream = reinterpret_cast<void*>(static_cast<uintptr_t>(stream.value_or(0)));
  }
  const std::vector<uint8_t>* notification_or_null() const { return has_notification ? &notification : nullptr; }
  bool has_notification;
  std::vector<uint8_t> notification;
  fxm::agent::StreamArg on;
};

// The call, with the GIL released; with `wait_s`, also its wait (before the GIL is taken back).
Handle issue(Connection& c, const std::vector<fxm::agent::Xfer>& xs, bool is_read, const py::object& notif,
             const std::optional<uint64_t>& stream, std::optional<double> wait_s = std::nullopt) {
  CallArgs a(notif, stream);
  py::gil_scoped_release release;
  Handle h = c.transfer(xs, is_read, a.notification_or_null(), a.on);
  if (wait_s) h.wait(*wait_s);
  return h;
}

// Which argument, for an error: "local", or "op 3: local" in a batch (made on failure only).
std::string arg_name(const char* name, long op) { return (op < 0 ? "" : "op " + std::to_string(op) + ": ") + name; }

// A region as a call names it: a Region (its `descriptor`), descriptor bytes, a bytearray or a
// memoryview of them; anything else is refused, naming `which`. Held: a bytearray's bytes are made here.
py::object descriptor_arg(const py::handle& d, const char* which, long op = -1) {
  if (PyBytes_CheckExact(d.ptr())) return py::reinterpret_borrow<py::object>(d);
  static PyObject* name = PyUnicode_InternFromString("descriptor");  // never freed: used until exit
  py::object got = py::reinterpret_steal<py::object>(PyObject_GetAttr(d.ptr(), name));
  if (got && PyBytes_Check(got.ptr())) return got;
  if (!got) {
    if (!PyErr_ExceptionMatches(PyExc_AttributeError)) throw py::error_already_set();  // the attribute raised
    PyErr_Clear();  // no such attribute: bytes-like, or refused below
  }
  if (PyByteArray_Check(d.ptr()) || PyMemoryView_Check(d.ptr()) || PyBytes_Check(d.ptr())) {
    PyObject* b = PyBytes_FromObject(d.ptr());  // fails on a released memoryview
    if (b == nullptr) throw py::error_already_set();
    return py::reinterpret_steal<py::object>(b);
  }
  fxm::fail(fxm::Code::kInvalidArgument, -1, 0,
            arg_name(which, op) + " must be a Region or descriptor bytes (bytes, bytearray, memoryview), not " +
                Py_TYPE(d.ptr())->tp_name);
}

// An offset or size: a non-negative int below 2**64 (not a bool).
uint64_t count_arg(const py::handle& v, const char* name, long op = -1) {
  PyObject* o = v.ptr();
  if (PyLong_Check(o) && !PyBool_Check(o)) {
    unsigned long long x = PyLong_AsUnsignedLongLong(o);
    if (!(x == static_cast<unsigned long long>(-1) && PyErr_Occurred())) return x;
    PyErr_Clear();  // negative, or 2**64 and over
  }
  fxm::fail(fxm::Code::kInvalidArgument, -1, 0,
            arg_name(name, op) + " must be a non-negative int below 2**64, got " + py::repr(v).cast<std::string>());
}

// A batch: `ops` holds (local, local_offset, remote, remote_offset, size) sequences, checked as
// write() checks its arguments. Each distinct region object is looked up once per call (a batch
// names a few regions many times: one KV layer is thousands of blocks of two regions): by object
// (alive in `ops`), a call names few, scanned; past kScanned, a map too.
PyHandle transfer(const py::handle& self, Connection& c, const py::list& ops, bool is_read, const py::object& notif,
                  const std::optional<uint64_t>& stream) {
  constexpr size_t kScanned = 16;
  struct Held {
    PyObject* key;
    py::object bytes;  // its descriptor bytes
    SharedDesc desc;
  };
  std::vector<Held> held;
  std::unordered_map<PyObject*, const RegionDesc*> more;
  auto desc_of = [&](const py::handle& h, const char* which, long op) -> const RegionDesc* {
    for (size_t i = 0; i < held.size() && i < kScanned; ++i) {
      if (held[i].key == h.ptr()) return held[i].desc.get();
    }
    if (held.size() >= kScanned) {
      auto it = more.find(h.ptr());
      if (it != more.end()) return it->second;
    }
    py::object b = descriptor_arg(h, which, op);
    SharedDesc d = decoded_region(b);
    held.push_back({h.ptr(), std::move(b), std::move(d)});
    if (held.size() > kScanned) more[h.ptr()] = held.back().desc.get();
    return held.back().desc.get();
  };
  std::vector<fxm::agent::Xfer> xs;
  xs.reserve(ops.size());
  for (const py::handle& item : ops) {
    long i = static_cast<long>(xs.size());
    if (!PyTuple_Check(item.ptr()) && (!PySequence_Check(item.ptr()) || PyUnicode_Check(item.ptr()) ||
                                       PyBytes_Check(item.ptr()))) {
      fxm::fail(fxm::Code::kInvalidArgument, -1, 0,
                arg_name((std::string("a transfer is (local, local_offset, remote, remote_offset, size), not ") +
                          Py_TYPE(item.ptr())->tp_name).c_str(), i));
    }
    py::tuple t = PyTuple_Check(item.ptr()) ? py::reinterpret_borrow<py::tuple>(item)
                                            : py::tuple(py::reinterpret_borrow<py::object>(item));
    if (t.size() != 5) {
      fxm::fail(fxm::Code::kInvalidArgument, -1, 0,
                arg_name("a transfer is (local, local_offset, remote, remote_offset, size)", i));
    }
    uint64_t lo = count_arg(t[1], "local_offset", i), ro = count_arg(t[3], "remote_offset", i);
    uint64_t n = count_arg(t[4], "size", i);
    xs.push_back({desc_of(t[0], "local", i), lo, desc_of(t[2], "remote", i), ro, n});
  }
  return PyHandle(issue(c, xs, is_read, notif, stream), self);
}

// A buffer's struct format without its byte-order prefix ('<', '=', '@': this host's order).
std::string native_format(const py::buffer_info& b) {
  std::string f = b.format;
  if (!f.empty() && (f[0] == '<' || f[0] == '=' || f[0] == '@')) f.erase(0, 1);
  return f;
}

// A one-dimensional, contiguous buffer of int64 block ids (array.array('q'), a ctypes array); the
// object passed keeps the memory for the call.
struct Ids {
  py::buffer_info info;  // held (the buffer stays exported) while the ids are read
  const int64_t* at() const { return static_cast<const int64_t*>(info.ptr); }
  size_t n() const { return static_cast<size_t>(info.shape[0]); }
};
Ids ids_arg(const py::buffer& ids, const char* which) {
  Ids out{ids.request()};
  std::string f = native_format(out.info);
  const py::buffer_info& b = out.info;
  if (b.itemsize != 8 || (f != "q" && f != "l") || b.ndim != 1 || (b.shape[0] > 1 && b.strides[0] != 8)) {
    fxm::fail(fxm::Code::kInvalidArgument, -1, 0, std::string("block rows: ") + which +
                                                      " must be a contiguous buffer of int64, got format '" + b.format + "'");
  }
  return out;
}

// The regions a table names by index: one Region / descriptor, or a sequence of them.
std::vector<SharedDesc> region_list(const py::handle& regions, const char* which) {
  std::vector<SharedDesc> out;
  if (PyList_Check(regions.ptr()) || PyTuple_Check(regions.ptr())) {
    py::sequence seq = py::reinterpret_borrow<py::sequence>(regions);
    out.reserve(seq.size());
    for (size_t i = 0; i < seq.size(); ++i) {
      std::string name = std::string(which) + "[" + std::to_string(i) + "]";
      out.push_back(decoded_region(descriptor_arg(seq[i], name.c_str())));
    }
  } else {
    out.push_back(decoded_region(descriptor_arg(regions, which)));
  }
  if (out.empty()) fxm::fail(fxm::Code::kInvalidArgument, -1, 0, std::string(which) + " names no region");
  return out;
}

// One cell of an (n, 3) or (n, 5) table of 8-byte integers, by its strides; a negative one is refused.
struct TableView {
  const char* base;
  py::ssize_t rows, cols, row_stride, col_stride;
  bool is_signed;
  uint64_t at(py::ssize_t r, py::ssize_t c, const char* name) const {
    const char* p = base + r * row_stride + c * col_stride;
    int64_t v;
    std::memcpy(&v, p, 8);
    if (is_signed && v < 0) {
      fxm::fail(fxm::Code::kInvalidArgument, -1, 0, arg_name(name, static_cast<long>(r)) + " is negative (" +
                                                      std::to_string(v) + ")");
    }
    return static_cast<uint64_t>(v);
  }
};

TableView table_view(const py::buffer_info& b) {
  std::string f = native_format(b);
  bool eight = b.itemsize == 8 && (f == "q" || f == "Q" || f == "l" || f == "L");
  if (!eight || b.ndim != 2 || (b.shape[1] != 3 && b.shape[1] != 5)) {
    fxm::fail(fxm::Code::kInvalidArgument, -1, 0,
              "table must be an (n, 5) or (n, 3) array of 64-bit integers (int64 or uint64), got format '" +
                  b.format + "', " + std::to_string(b.ndim) + " dimension(s)" +
                  (b.ndim == 2 ? ", " + std::to_string(b.shape[1]) + " columns" : std::string()));
  }
  return {static_cast<const char*>(b.ptr), b.shape[0], b.shape[1], b.strides[0], b.strides[1],
          f == "q" || f == "l"};
}

// A table of ops: rows (local_index, local_offset, remote_index, remote_offset, size), or
// (local_offset, remote_offset, size) with one region on each side; decoded here, no Python
// object per op. Indices name entries of `locals` / `remotes`.
PyHandle transfer_table(const py::handle& self, Connection& c, const py::object& locals, const py::object& remotes,
                        const py::object& table, bool is_read, const py::object& notif,
                        const std::optional<uint64_t>& stream) {
  std::vector<SharedDesc> l = region_list(locals, "local"), r = region_list(remotes, "remote");
  if (!PyObject_CheckBuffer(table.ptr())) {
    fxm::fail(fxm::Code::kInvalidArgument, -1, 0, std::string("table must be an array (numpy, a CPU torch tensor, a "
                                                              "buffer), not ") + Py_TYPE(table.ptr())->tp_name);
  }
  py::buffer_info b = py::reinterpret_borrow<py::buffer>(table).request();
  TableView t = table_view(b);
  bool indexed = t.cols == 5;
  if (!indexed && (l.size() != 1 || r.size() != 1)) {
    fxm::fail(fxm::Code::kInvalidArgument, -1, 0, "a table of 3 columns names one local and one remote region; "
                                                  "give 5 columns (with region indices) for several");
  }
  std::vector<fxm::agent::Xfer> xs(static_cast<size_t>(t.rows));
  for (py::ssize_t i = 0; i < t.rows; ++i) {
    uint64_t li = indexed ? t.at(i, 0, "local index") : 0, ri = indexed ? t.at(i, 2, "remote index") : 0;
    if (li >= l.size() || ri >= r.size()) {
      bool local = li >= l.size();
      fxm::fail(fxm::Code::kInvalidArgument, -1, 0,
                arg_name(local ? "local index" : "remote index", static_cast<long>(i)) + " " +
                    std::to_string(local ? li : ri) + " names no region (" + std::to_string(local ? l.size() : r.size()) +
                    " given)");
    }
    py::ssize_t at = indexed ? 1 : 0;
    xs[i] = {l[li].get(), t.at(i, at, "local offset"), r[ri].get(), t.at(i, at + (indexed ? 2 : 1), "remote offset"),
             t.at(i, at + (indexed ? 3 : 2), "size")};
  }
  return PyHandle(issue(c, xs, is_read, notif, stream), self);
}

// One op, its fields as arguments (write() and read(): no list or tuple to build and take apart,
// every argument checked here, not in Python: the per-call cost of a blocking connector). It holds
// its descriptors: another thread's lookup may drop them from the cache while this call runs.
struct OneOp {
  OneOp(const py::handle& local, const py::handle& remote, const py::handle& size, const py::handle& local_off,
        const py::handle& remote_off)
      : local_offset(count_arg(local_off, "local_offset")), remote_offset(count_arg(remote_off, "remote_offset")),
        bytes(count_arg(size, "size")), local_desc(descriptor_arg(local, "local")),
        remote_desc(descriptor_arg(remote, "remote")),
        l(decoded_region(local_desc)), r(decoded_region(remote_desc)),
        xs{{l.get(), local_offset, r.get(), remote_offset, bytes}} {}
  uint64_t local_offset, remote_offset, bytes;
  py::object local_desc, remote_desc;
  SharedDesc l, r;
  std::vector<fxm::agent::Xfer> xs;
};

PyHandle transfer_one(const py::handle& self, Connection& c, const py::handle& local, const py::handle& remote,
                      const py::handle& size, const py::handle& local_off, const py::handle& remote_off,
                      bool is_read, const py::object& notif, const std::optional<uint64_t>& stream) {
  OneOp op(local, remote, size, local_off, remote_off);
  return PyHandle(issue(c, op.xs, is_read, notif, stream), self);
}

// One op issued and waited for in one call (write_sync / read_sync): no handle object, the GIL
// released once. The errors are what the handle's wait() would raise.
void transfer_one_sync(Connection& c, const py::handle& local, const py::handle& remote, const py::handle& size,
                       const py::handle& local_off, const py::handle& remote_off, bool is_read,
                       const py::object& notif, const std::optional<uint64_t>& stream, std::optional<double> timeout) {
  OneOp op(local, remote, size, local_off, remote_off);
  issue(c, op.xs, is_read, notif, stream, timeout.value_or(0.0));
}

// A read of a request's blocks for the puller: per KV cache group (tables, local ids, remote ids).
fxm::agent::PullJob pull_job(uint64_t token, std::shared_ptr<Connection> conn, const py::object& locals,
                             const py::object& remotes, const py::list& groups, const py::object& on_landed,
                             const py::object& on_failed) {
  fxm::agent::PullJob j;
  j.token = token;
  j.conn = std::move(conn);
  for (SharedDesc& d : region_list(locals, "local")) j.locals.push_back(std::move(d));
  for (SharedDesc& d : region_list(remotes, "remote")) j.remotes.push_back(std::move(d));
  for (const py::handle& g : groups) {
    py::tuple t = py::reinterpret_borrow<py::tuple>(g);
    fxm::agent::PullGroup pg;
    for (const py::handle& r : py::reinterpret_borrow<py::sequence>(t[0])) {
      pg.tables.push_back(r.cast<std::shared_ptr<fxm::agent::BlockRows>>());
    }
    Ids l = ids_arg(py::reinterpret_borrow<py::buffer>(t[1]), "local ids");
    Ids rm = ids_arg(py::reinterpret_borrow<py::buffer>(t[2]), "remote ids");
    pg.local_ids.assign(l.at(), l.at() + l.n());
    pg.remote_ids.assign(rm.at(), rm.at() + rm.n());
    j.groups.push_back(std::move(pg));
  }
  if (!on_landed.is_none()) j.on_landed = bytes_arg(on_landed, "on_landed", &fxm::agent::check_notification_size);
  if (!on_failed.is_none()) j.on_failed = bytes_arg(on_failed, "on_failed", &fxm::agent::check_notification_size);
  return j;
}

// int64 ids: a buffer of them (array.array('q'), numpy) or a sequence of ints.
std::vector<int64_t> id_list(const py::handle& ids, const char* which) {
  if (PyObject_CheckBuffer(ids.ptr())) {
    Ids b = ids_arg(py::reinterpret_borrow<py::buffer>(ids), which);
    return std::vector<int64_t>(b.at(), b.at() + b.n());
  }
  return ids.cast<std::vector<int64_t>>();
}

std::array<uint32_t, 4> part_arg(const py::handle& part) {
  auto v = part.cast<std::vector<uint32_t>>();
  if (v.size() != 4) {
    fxm::fail(fxm::Code::kInvalidArgument, -1, 0, "part must be (si, sn, di, dn), got " + std::to_string(v.size()) + " values");
  }
  return {v[0], v[1], v[2], v[3]};
}

void bind_wants(py::module_& m) {
  using fxm::agent::Want;
  m.attr("WANT_PREFIX") = py::bytes(reinterpret_cast<const char*>(fxm::agent::kWantPrefix.data()),
                                    fxm::agent::kWantPrefix.size());
  m.def("_encode_want", [](const std::string& req, const py::object& answer, const py::handle& part, uint32_t readers,
                           std::vector<uint64_t> counts, const py::handle& dst) {
    Want w;
    w.req = req;
    w.answer = bytes_arg(answer, "answer");
    std::array<uint32_t, 4> p = part_arg(part);
    w.si = p[0], w.sn = p[1], w.di = p[2], w.dn = p[3];
    w.readers = readers;
    w.counts = std::move(counts);
    w.dst = id_list(dst, "dst");
    return to_bytes(fxm::agent::encode_want(w));
  }, py::arg("req"), py::arg("answer"), py::arg("part"), py::arg("readers"), py::arg("counts"), py::arg("dst"),
        "A want's bytes (agent/want.h); InvalidArgument for what _parse_want would refuse.");
  m.def("_parse_want", [](const py::bytes& data) {
    char* p = nullptr;
    Py_ssize_t n = 0;
    PyBytes_AsStringAndSize(data.ptr(), &p, &n);
    Want w;
    std::string why;
    if (!fxm::agent::parse_want(reinterpret_cast<const uint8_t*>(p), static_cast<size_t>(n), &w, &why)) {
      throw py::value_error(why);
    }
    PyObject* req = PyUnicode_DecodeUTF8(w.req.data(), static_cast<Py_ssize_t>(w.req.size()), nullptr);
    if (req == nullptr) {
      PyErr_Clear();
      throw py::value_error("a want: its req is not UTF-8");
    }
    py::object dst = py::module_::import("array").attr("array")(
        "q", py::bytes(reinterpret_cast<const char*>(w.dst.data()), w.dst.size() * sizeof(int64_t)));
    py::list counts;
    for (uint64_t c : w.counts) counts.append(c);
    return py::make_tuple(py::reinterpret_steal<py::str>(req), to_bytes(w.answer),
                          py::make_tuple(w.si, w.sn, w.di, w.dn), w.readers, counts, dst);
  }, py::arg("data"),
        "(req, answer, (si, sn, di, dn), readers, counts, dst: array('q')) of a want; ValueError saying why for "
        "anything else.");
}

// What the puller serves wants with: per group the tables (a list of _BlockRows, empty for a group
// without layers).
std::vector<std::vector<std::shared_ptr<const fxm::agent::BlockRows>>> group_tables_arg(const py::list& groups) {
  std::vector<std::vector<std::shared_ptr<const fxm::agent::BlockRows>>> out;
  for (const py::handle& g : groups) {
    out.emplace_back();
    for (const py::handle& r : py::reinterpret_borrow<py::sequence>(g)) {
      out.back().push_back(r.cast<std::shared_ptr<fxm::agent::BlockRows>>());
    }
  }
  return out;
}

void bind_serving(py::class_<fxm::agent::BlockPuller, std::shared_ptr<fxm::agent::BlockPuller>>& c) {
  using fxm::agent::BlockPuller;
  c.attr("SERVED_STARTED") = fxm::agent::kServedStarted;  // the kinds of take_served()'s events
  c.attr("SERVED_ENDED") = fxm::agent::kServedEnded;
  c.attr("SERVED_LATE") = fxm::agent::kServedLate;
  c.def("serve_wants", &BlockPuller::serve_wants, py::arg("on"), py::call_guard<py::gil_scoped_release>(),
        "Claims the agent's wants (notifications starting with WANT_PREFIX) for the core to serve (False: no more).")
      .def("offer", [](BlockPuller& p, uint64_t token, std::string req, const py::list& groups, double timeout) {
        std::vector<std::vector<int64_t>> held;
        for (const py::handle& g : groups) held.push_back(id_list(g, "held ids"));
        py::gil_scoped_release release;
        p.offer(token, std::move(req), std::move(held), timeout);
      }, py::arg("token"), py::arg("req"), py::arg("groups"), py::arg("timeout") = 0.0,
           "The blocks held for req (int64 ids per KV cache group) its wants are served from; a push not over "
           "within timeout (0: the agent's) is reported late.")
      .def("withdraw", &BlockPuller::withdraw, py::arg("token"), py::call_guard<py::gil_scoped_release>(),
           "Takes token's offer out (its later wants go to notifications()); the pushes of it still in flight.")
      .def("in_flight", &BlockPuller::in_flight, py::arg("token"), py::call_guard<py::gil_scoped_release>())
      .def("serve_layout", [](BlockPuller& p, std::shared_ptr<Connection> conn, const py::handle& part,
                              const py::object& locals, const py::object& remotes, const py::list& group_tables) {
        std::vector<std::shared_ptr<const RegionDesc>> l, r;
        for (SharedDesc& d : region_list(locals, "local")) l.push_back(std::move(d));
        for (SharedDesc& d : region_list(remotes, "remote")) r.push_back(std::move(d));
        auto tables = group_tables_arg(group_tables);
        std::array<uint32_t, 4> pt = part_arg(part);
        py::gil_scoped_release release;
        p.serve_layout(std::move(conn), pt, std::move(l), std::move(r), std::move(tables));
      }, py::arg("conn"), py::arg("part"), py::arg("locals"), py::arg("remotes"), py::arg("group_tables"),
           "The tables wants of part (si, sn, di, dn) arriving on conn with len(group_tables) groups are served "
           "with (per group a list of _BlockRows, empty for a group without layers).")
      .def("resubmit", [](BlockPuller& p, const std::shared_ptr<Connection>& conn, const py::bytes& data) {
        std::vector<uint8_t> bytes = to_vec(data);
        py::gil_scoped_release release;
        return p.resubmit(conn, std::move(bytes));
      }, py::arg("conn"), py::arg("data"),
           "Serves a want that arrived on conn and was handed back, as if just claimed (handed back again "
           "when still not served); False while wants are not served.")
      .def("forget_layouts", &BlockPuller::forget_layouts, py::arg("conn"), py::call_guard<py::gil_scoped_release>(),
           "Forgets the tables of every part served on conn (its wants are handed back until serve_layout).")
      .def("take_served", [](BlockPuller& p) {
        std::vector<fxm::agent::ServedEvent> got;
        {
          py::gil_scoped_release release;
          got = p.take_served();
        }
        py::list out;
        for (const auto& e : got) {
          out.append(py::make_tuple(e.token, e.push, e.kind, e.peer, fxm::agent::incarnation_hex(e.incarnation),
                                    e.readers, e.ops, e.bytes, e.error, e.at_s));
        }
        return out;
      }, "The served events since the last take: (token, push, kind: 1 started, 2 ended, 3 late, peer, "
         "incarnation, readers, ops, bytes, error or '', when: time.monotonic()).");
}

void bind_block_puller(py::module_& m) {
  using fxm::agent::BlockPuller;
  py::class_<BlockPuller, std::shared_ptr<BlockPuller>> c(
      m, "_BlockPuller", "Reads of requests' blocks on a thread of their own (agent/block_pull.h; vllm/transfer.py)");
  bind_serving(c);
  c.def(py::init<std::shared_ptr<Agent>>(), py::arg("agent"))
      .def("submit", [](BlockPuller& p, uint64_t token, std::shared_ptr<Connection> conn, const py::object& locals,
                        const py::object& remotes, const py::list& groups, const py::object& on_landed,
                        const py::object& on_failed) {
        p.submit(pull_job(token, std::move(conn), locals, remotes, groups, on_landed, on_failed));
      }, py::arg("token"), py::arg("conn"), py::arg("locals"), py::arg("remotes"), py::arg("groups"),
           py::arg("on_landed") = py::none(), py::arg("on_failed") = py::none(),
           "Queues a read: groups are (tables, local ids, remote ids), ids buffers of int64.")
      .def("await_answer", [](BlockPuller& p, uint64_t token, std::shared_ptr<Connection> conn,
                              const py::object& answer, const py::object& on_landed, double timeout) {
        fxm::agent::AnswerJob j{token, std::move(conn),
                                bytes_arg(answer, "answer", &fxm::agent::check_notification_size)};
        if (!on_landed.is_none()) j.on_landed = bytes_arg(on_landed, "on_landed", &fxm::agent::check_notification_size);
        j.timeout_s = timeout;
        py::gil_scoped_release release;
        p.await_answer(std::move(j));
      }, py::arg("token"), py::arg("conn"), py::arg("answer"), py::arg("on_landed") = py::none(),
           py::arg("timeout") = 0.0,
           "Awaits the peer's notification of exactly `answer` on conn (a push's done); once it came, on_landed "
           "goes to the peer and the outcome is posted (ops and bytes 0).")
      .def("forget", &BlockPuller::forget, py::arg("token"), py::call_guard<py::gil_scoped_release>(),
           "Stops awaiting token's answer: no outcome, no ack.")
      .def("cancel", &BlockPuller::cancel, py::arg("token"))
      .def("take", [](BlockPuller& p) {
        py::list out;
        for (const auto& o : p.take()) {
          out.append(py::make_tuple(o.token, o.error, o.ops, o.bytes, o.cancelled, o.at_s));
        }
        return out;
      }, "The outcomes since the last take: (token, error or '', ops, bytes, cancelled, when: time.monotonic()).")
      .def("seq", &BlockPuller::seq)
      .def("wait", &BlockPuller::wait, py::arg("seen"), py::arg("timeout"), py::call_guard<py::gil_scoped_release>())
      .def("wake", &BlockPuller::wake)
      .def("close", &BlockPuller::close, py::call_guard<py::gil_scoped_release>());
}

// The connection's Python object beside the connection (the handle holds the former).
template <typename... Args>
auto with_self(PyHandle (*f)(const py::handle&, Connection&, Args...)) {
  return [f](py::object self, Args... args) { return f(self, self.cast<Connection&>(), args...); };
}

void bind_connection(py::module_& m) {
  py::class_<Connection, std::shared_ptr<Connection>>(m, "AgentConnection")
      .def_property_readonly("peer_name", [](const Connection& c) { return c.peer().name; })
      .def_property_readonly("peer_incarnation", [](const Connection& c) { return fxm::agent::incarnation_hex(c.peer().incarnation); })
      .def_property_readonly("peer_address", [](const Connection& c) { return c.peer().address; })
      .def_property_readonly("initiated", &Connection::initiated)
      .def_property_readonly("tcp_lanes", &Connection::tcp_lanes)
      .def("gone", &Connection::gone)
      .def("transfer", with_self(&transfer), py::arg("ops"), py::arg("is_read"), py::arg("notification") = py::none(),
           py::arg("stream") = py::none())  // a handle keeps its connection (and so its agent) alive
      .def("transfer_table", with_self(&transfer_table), py::arg("locals"), py::arg("remotes"), py::arg("table"),
           py::arg("is_read"), py::arg("notification") = py::none(), py::arg("stream") = py::none())
      .def("transfer_one", with_self(&transfer_one), py::arg("local"), py::arg("remote"), py::arg("size"),
           py::arg("local_offset"), py::arg("remote_offset"), py::arg("is_read"), py::arg("notification") = py::none(),
           py::arg("stream") = py::none())
      .def("transfer_one_sync", &transfer_one_sync, py::arg("local"), py::arg("remote"), py::arg("size"),
           py::arg("local_offset"), py::arg("remote_offset"), py::arg("is_read"), py::arg("notification") = py::none(),
           py::arg("stream") = py::none(), py::arg("timeout") = py::none())
      .def("notify", [](Connection& c, const py::object& b) {
        std::vector<uint8_t> v = bytes_arg(b, "data");
        py::gil_scoped_release release;
        c.notify(v);
      })
      .def("path_to", [](Connection& c, const py::bytes& b, const py::object& local) {
        RegionDesc r = region(b);
        if (local.is_none()) return c.path_to(r, nullptr);
        RegionDesc l = region(local.cast<py::bytes>());
        return c.path_to(r, &l);
      }, py::arg("remote"), py::arg("local") = py::none())
      .def("close", [](Connection& c) {
        py::gil_scoped_release release;
        c.close("closed by this agent");
      });
  py::class_<PyHandle>(m, "AgentHandle",
                     "The completion of one write/read call (flagcx_mesh.agent.Handle): done() polls; wait(timeout) "
                     "raises the call's error (PeerLost naming the peer, InvalidArgument when the target refused, "
                     "MeshTimeout); call names the call; ops and nbytes: its ops and their bytes.")
      .def("done", [](const PyHandle& p) { return p.h.done(); }, py::call_guard<py::gil_scoped_release>())
      .def("wait", [](const PyHandle& p, const py::object& timeout) {
        double seconds = call_timeout(timeout, "wait: timeout");
        py::gil_scoped_release release;
        p.h.wait(seconds);
      }, py::arg("timeout") = py::none())
      .def_property_readonly("call", [](const PyHandle& p) { return p.h.call(); })
      .def_property_readonly("ops", [](const PyHandle& p) { return p.h.count(); })
      .def_property_readonly("nbytes", [](const PyHandle& p) { return p.h.bytes(); })
      .def("__repr__", [](const PyHandle& p) {
        py::gil_scoped_release release;
        return "Handle(" + p.h.call() + (p.h.done() ? ", done)" : ", pending)");
      });
  using fxm::agent::NotificationWait;
  py::class_<NotificationWait>(m, "AgentNotificationWait")
      .def("done", &NotificationWait::done, py::call_guard<py::gil_scoped_release>())
      .def("wait", [](const NotificationWait& w, std::optional<double> timeout) { w.wait(timeout.value_or(0.0)); },
           py::arg("timeout") = py::none(), py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("error", &NotificationWait::error)
      .def_property_readonly("sender", &NotificationWait::sender);
}

}  // namespace

void bind_agent(py::module_& m) {
  bind_connection(m);
  py::class_<Agent, std::shared_ptr<Agent>>(m, "AgentCore")
      .def(py::init(&make_agent), py::arg("name"), py::arg("secret") = "", py::arg("timeout") = py::none(),
           py::arg("header_timeout") = 5.0, py::arg("allow") = py::none())
      .def_property_readonly("name", &Agent::name)
      .def_property_readonly("incarnation", [](const Agent& a) { return fxm::agent::incarnation_hex(a.incarnation()); })
      .def_property_readonly("address", &Agent::address)
      .def_property_readonly("timeout", &Agent::timeout_s)
      .def("metadata", [](const Agent& a) { return to_bytes(a.metadata()); })
      .def("register", [](Agent& a, const py::object& buffer) {
        ByteView view(buffer, true);  // the Python Region keeps the exporter alive
        return to_bytes(a.register_memory(view.data(), view.size()).encode());
      })
      .def("register_device", [](Agent& a, uint64_t ptr, uint64_t nbytes) {
        return to_bytes(a.register_device(reinterpret_cast<void*>(static_cast<uintptr_t>(ptr)), nbytes).encode());
      }, py::arg("ptr"), py::arg("nbytes"))
      .def("alloc", [](Agent& a, uint64_t size) { return to_bytes(a.alloc(size).encode()); })
      .def("region_view", [](Agent& a, const py::bytes& b) -> py::object {
        RegionDesc d = region(b);
        uint8_t* base = a.region_base(d.index);
        if (!base || d.agent != a.name() || d.incarnation != a.incarnation()) return py::none();
        return py::memoryview::from_memory(base, static_cast<py::ssize_t>(d.size));
      })
      .def("deregister", [](Agent& a, const py::bytes& b, std::optional<double> timeout_or_none) {
        double timeout = timeout_or_none.value_or(0.0);
        RegionDesc d = region(b);
        py::gil_scoped_release release;
        a.deregister(d, timeout);
      }, py::arg("region"), py::arg("timeout") = py::none())
      .def("connect", [](Agent& a, const py::bytes& md, const py::object& timeout_or_none) {
        double timeout = call_timeout(timeout_or_none, "connect: timeout");
        std::vector<uint8_t> v = to_vec(md);
        py::gil_scoped_release release;
        return a.connect(v, timeout);
      }, py::arg("metadata"), py::arg("timeout") = py::none(), py::keep_alive<0, 1>())  // a connection keeps its agent
      .def("connect_address", [](Agent& a, const std::string& address, const py::object& timeout_or_none) {
        double timeout = call_timeout(timeout_or_none, "connect: timeout");
        py::gil_scoped_release release;
        return a.connect_address(address, timeout);
      }, py::arg("address"), py::arg("timeout") = py::none(), py::keep_alive<0, 1>())
      .def("connection", &Agent::connection, py::keep_alive<0, 1>())
      .def("peers", [](const Agent& a) {
        py::list out;
        for (const auto& p : a.peers()) out.append(py::make_tuple(p.name, fxm::agent::incarnation_hex(p.incarnation), p.address));
        return out;
      })
      .def("wake_notifications", &Agent::wake_notifications)
      .def("await_notifications", [](Agent& a, std::optional<double> timeout_or_none) {
        double timeout = timeout_or_none.value_or(0.0);
        py::gil_scoped_release release;
        return a.await_notifications(timeout);
      }, py::arg("timeout") = py::none())
      .def("notifications", [](Agent& a, std::optional<double> timeout_or_none) {
        double timeout = timeout_or_none.value_or(0.0);
        std::vector<fxm::agent::Notification> got;
        {
          py::gil_scoped_release release;
          got = a.notifications(timeout);
        }
        py::list out;
        for (const auto& n : got) out.append(py::make_tuple(n.peer, fxm::agent::incarnation_hex(n.incarnation), to_bytes(n.bytes)));
        return out;
      }, py::arg("timeout") = py::none())
      .def("stream_wait_notification", [](Agent& a, const py::object& data, uint64_t stream, const std::string& peer,
                                          std::optional<double> timeout_or_none) {
        double timeout = timeout_or_none.value_or(0.0);
        std::vector<uint8_t> v = bytes_arg(data, "data");
        py::gil_scoped_release release;
        return a.stream_wait_notification(v, peer, reinterpret_cast<void*>(static_cast<uintptr_t>(stream)), timeout);
      }, py::arg("data"), py::arg("stream"), py::arg("peer") = "", py::arg("timeout") = py::none())
      .def("wait_notification", [](Agent& a, const std::string& peer, const py::object& data,
                                   std::optional<double> timeout) {
        std::optional<std::vector<uint8_t>> v;
        if (!data.is_none()) v = bytes_arg(data, "data");
        fxm::agent::Notification n;
        {
          py::gil_scoped_release release;
          n = a.wait_notification(v ? &*v : nullptr, peer, timeout.value_or(0.0));
        }
        return py::make_tuple(n.peer, fxm::agent::incarnation_hex(n.incarnation), to_bytes(n.bytes));
      }, py::arg("peer"), py::arg("data") = py::none(), py::arg("timeout") = py::none())
      .def("stats", [](const Agent& a) {
        fxm::agent::AgentStats s = a.stats();
        py::dict rejected;
        for (const auto& [reason, n] : s.rejections()) rejected[py::str(reason)] = n;
        py::dict out;
        for (const auto& [name, n] : s.counters()) out[py::str(name)] = n;
        out["rejected"] = rejected;
        return out;
      })
      .def("close", &Agent::close, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("closed", &Agent::closed);
  py::class_<fxm::agent::BlockRows, std::shared_ptr<fxm::agent::BlockRows>>(m, "_BlockRows",
                                    "A request's op table from its block ids (agent/block_rows.h; vllm/layout.py)")
      .def(py::init([](const std::vector<std::array<int64_t, 4>>& layers, std::vector<int64_t> src_runs,
                       std::vector<int64_t> dst_runs, int64_t size, bool dense, int64_t src_blocks, int64_t dst_blocks) {
             std::vector<fxm::agent::BlockLayer> ls;
             for (const auto& [si, ss, di, ds] : layers) ls.push_back({si, ss, di, ds});
             return fxm::agent::BlockRows(std::move(ls), std::move(src_runs), std::move(dst_runs), size, dense,
                                          src_blocks, dst_blocks);
           }),
           py::arg("layers"), py::arg("src_runs"), py::arg("dst_runs"), py::arg("size"), py::arg("dense"),
           py::arg("src_blocks"), py::arg("dst_blocks"))
      .def("rows", [](const fxm::agent::BlockRows& b, const py::buffer& src, const py::buffer& dst) -> py::object {
        Ids s = ids_arg(src, "src"), d = ids_arg(dst, "dst");
        if (s.n() != d.n()) {
          fxm::fail(fxm::Code::kInvalidArgument, -1, 0, "block rows: " + std::to_string(s.n()) + " source ids, " +
                                                            std::to_string(d.n()) + " destination ids");
        }
        std::vector<int64_t> out;
        if (!b.rows(s.at(), d.at(), s.n(), &out)) return py::none();
        return py::reinterpret_steal<py::object>(
            PyByteArray_FromStringAndSize(reinterpret_cast<const char*>(out.data()), out.size() * sizeof(int64_t)));
      }, py::arg("src"), py::arg("dst"),
           "The table's rows as a bytearray of int64 (5 a row); None when an id is out of range.");
  bind_block_puller(m);
  bind_wants(m);
  m.def("region_info", [](const py::bytes& b) { return region_info(region(b)); },
        "The fields of a region descriptor (InvalidArgument when malformed).");
}

}  // namespace fxm_py
