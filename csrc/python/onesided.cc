// Bindings of windows and one-sided operations; thin, the GIL released
// around everything that can wait.
#include <pybind11/stl.h>

#include "python/bindings.h"

namespace fxm_py {

using fxm::Mesh;
using fxm::PutArgs;

ByteView::ByteView(const py::object& obj, bool writable) {
  int flags = PyBUF_SIMPLE | (writable ? PyBUF_WRITABLE : 0);
  if (PyObject_GetBuffer(obj.ptr(), &view_, flags) != 0) throw py::error_already_set();
}

namespace {

fxm::SignalSpec signal_spec(const Mesh& m, uint32_t win, uint64_t slot, uint64_t value, const std::string& op) {
  if (op != "add" && op != "set") {
    fxm::fail(fxm::Code::kInvalidArgument, -1, 0,
              "rank " + std::to_string(m.rank()) + ": signal op must be 'add' or 'set', got '" + op + "'");
  }
  fxm::SignalSpec s;
  s.on = true;
  s.set = op == "set";
  s.win = win;
  s.slot = slot;
  s.value = value;
  return s;
}

uint32_t register_buffer(Mesh& m, const py::object& obj) {
  ByteView view(obj, true);  // the Python Window keeps the exporter alive
  void* base = view.data();
  size_t size = view.size();
  py::gil_scoped_release release;
  return m.register_window(base, size);
}

py::dict window_info(Mesh& m, uint32_t index) {
  std::shared_ptr<fxm::Window> w = m.window(index);
  py::dict d;
  d["index"] = w->index;
  d["kind"] = fxm::kind_name(w->kind);
  d["size"] = w->size;
  d["mode"] = w->mode();
  d["describe"] = w->describe();
  py::list paths, peer_sizes;
  for (const fxm::PeerView& v : w->peers) {
    paths.append(py::make_tuple(v.path->name(), v.why));
    peer_sizes.append(v.size);
  }
  d["paths"] = paths;
  d["peer_sizes"] = peer_sizes;  // bytes of each rank's copy (signal windows: nslots * 8)
  d["device"] = w->device;        // CUDA device ordinal of this rank's copy, -1: host memory
  d["address"] = reinterpret_cast<uintptr_t>(w->base);
  return d;
}

// The bytes of a library-allocated window, exported through the buffer
// protocol. It holds the segment: a view outlives deregistration safely.
struct WindowMemory {
  std::shared_ptr<fxm::shm::Segment> seg;
  uint8_t* base;
  size_t size;
};

WindowMemory window_memory(Mesh& m, uint32_t index) {
  std::shared_ptr<fxm::Window> w = m.window(index);
  if (w->kind == fxm::WindowKind::kUser) throw py::value_error("user windows are the caller's own buffer");
  if (w->kind == fxm::WindowKind::kDevice) throw py::value_error("a device window's bytes are on the GPU");
  // Inside the window, deregister (another thread) cannot drop the segment while it is copied.
  if (!w->enter(true)) {
    throw fxm::Error(fxm::Code::kInvalidArgument, -1, 0,
                     "window #" + std::to_string(index) + " was deregistered");
  }
  WindowMemory mem{w->seg, w->base, static_cast<size_t>(w->size)};
  w->leave();
  return mem;
}

using Stream = std::optional<uint64_t>;  // a CUDA stream handle (0: the legacy default stream)

PutArgs with_stream(PutArgs a, const Stream& stream) {
  a.stream_set = stream.has_value();
  a.stream = reinterpret_cast<void*>(static_cast<uintptr_t>(stream.value_or(0)));
  return a;
}

uint32_t register_device(Mesh& m, uint64_t ptr, uint64_t nbytes) {
  py::gil_scoped_release release;
  return m.register_device_window(reinterpret_cast<void*>(static_cast<uintptr_t>(ptr)), nbytes);
}

void wait_signal_stream(Mesh& m, uint32_t win, uint64_t slot, uint64_t expected, uint64_t stream, double timeout) {
  py::gil_scoped_release release;
  m.wait_signal_on_stream(win, slot, expected, reinterpret_cast<void*>(static_cast<uintptr_t>(stream)), timeout);
}

void put(Mesh& m, int peer, uint32_t src_win, uint64_t src_off, uint32_t dst_win, uint64_t dst_off,
         uint64_t size, int ctx, const Stream& stream) {
  PutArgs a = with_stream({peer, ctx, src_win, src_off, dst_win, dst_off, size, {}}, stream);
  py::gil_scoped_release release;
  m.put(a);
}

void put_signal(Mesh& m, int peer, uint32_t src_win, uint64_t src_off, uint32_t dst_win, uint64_t dst_off,
                uint64_t size, uint32_t sig_win, uint64_t slot, uint64_t value, const std::string& op, int ctx,
                const Stream& stream) {
  fxm::SignalSpec sig = signal_spec(m, sig_win, slot, value, op);
  PutArgs a = with_stream({peer, ctx, src_win, src_off, dst_win, dst_off, size, sig}, stream);
  py::gil_scoped_release release;
  m.put(a);
}

void get(Mesh& m, int peer, uint32_t src_win, uint64_t src_off, uint32_t dst_win, uint64_t dst_off,
         uint64_t size, int ctx, const Stream& stream) {
  PutArgs a = with_stream({peer, ctx, src_win, src_off, dst_win, dst_off, size, {}}, stream);
  py::gil_scoped_release release;
  m.get(a);
}

// entries: (src_off, dst_off, size) triples; all validated before any is issued.
void batch_put(Mesh& m, int peer, uint32_t src_win, uint32_t dst_win,
               const std::vector<std::tuple<uint64_t, uint64_t, uint64_t>>& entries, int ctx, const Stream& stream) {
  std::vector<PutArgs> ops;
  ops.reserve(entries.size());
  for (const auto& [src_off, dst_off, size] : entries) {
    ops.push_back(with_stream(PutArgs{peer, ctx, src_win, src_off, dst_win, dst_off, size, {}}, stream));
  }
  py::gil_scoped_release release;
  m.batch_put(ops);
}

// entries: an (n, 3) array of unsigned 64-bit (src_off, dst_off, size), read in place.
void batch_put_array(Mesh& m, int peer, uint32_t src_win, uint32_t dst_win, const py::buffer& entries, int ctx,
                     const Stream& stream) {
  py::buffer_info b = entries.request();
  bool u64 = b.itemsize == 8 && (b.format == "Q" || b.format == "L" || b.format == "K" || b.format == "<Q");
  if (!u64 || b.ndim != 2 || b.shape[1] != 3 || b.strides[1] != 8 || b.strides[0] != 24) {
    throw fxm::Error(fxm::Code::kInvalidArgument, peer, 0,
                     "batch_put: entries must be a C-contiguous (n, 3) array of uint64, got format '" + b.format +
                         "' with " + std::to_string(b.ndim) + " dimension(s)");
  }
  const uint64_t* e = static_cast<const uint64_t*>(b.ptr);
  std::vector<PutArgs> ops(static_cast<size_t>(b.shape[0]));
  for (size_t i = 0; i < ops.size(); ++i) {
    ops[i] = with_stream(PutArgs{peer, ctx, src_win, e[3 * i], dst_win, e[3 * i + 1], e[3 * i + 2], {}}, stream);
  }
  py::gil_scoped_release release;
  m.batch_put(ops);
}

}  // namespace

void bind_onesided(py::class_<Mesh>& cls) {
  using py::arg;
  py::class_<WindowMemory>(cls, "WindowMemory", py::buffer_protocol())
      .def_buffer([](WindowMemory& wm) {
        return py::buffer_info(wm.base, 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(wm.size)}, {static_cast<py::ssize_t>(1)});
      });
  auto nogil = py::call_guard<py::gil_scoped_release>();
  cls.def("register_window", &register_buffer, arg("buffer"))
      .def("alloc_window", &Mesh::alloc_window, arg("nbytes"), nogil)
      .def("register_device_window", &register_device, arg("ptr"), arg("nbytes"))
      .def("alloc_device_window", &Mesh::alloc_device_window, arg("nbytes"), arg("device"), nogil)
      .def("wait_signal_stream", &wait_signal_stream, arg("win"), arg("slot"), arg("expected"), arg("stream"),
           arg("timeout"))
      .def("signal_window", &Mesh::signal_window, arg("nslots"), nogil)
      .def("refuse_registration", &Mesh::refuse_registration, arg("reason"), nogil)
      .def("deregister", &Mesh::deregister, arg("index"), nogil)
      .def("window_info", &window_info, arg("index"))
      .def("window_memory", &window_memory, arg("index"))
      .def("put", &put, arg("peer"), arg("src_win"), arg("src_off"), arg("dst_win"), arg("dst_off"),
           arg("size"), arg("context"), arg("stream") = py::none())
      .def("put_signal", &put_signal, arg("peer"), arg("src_win"), arg("src_off"), arg("dst_win"),
           arg("dst_off"), arg("size"), arg("sig_win"), arg("slot"), arg("value"), arg("op"), arg("context"),
           arg("stream") = py::none())
      .def("get", &get, arg("peer"), arg("src_win"), arg("src_off"), arg("dst_win"), arg("dst_off"),
           arg("size"), arg("context"), arg("stream") = py::none())
      .def("batch_put", &batch_put, arg("peer"), arg("src_win"), arg("dst_win"), arg("entries"), arg("context"),
           arg("stream") = py::none())
      .def("batch_put_array", &batch_put_array, arg("peer"), arg("src_win"), arg("dst_win"), arg("entries"),
           arg("context"), arg("stream") = py::none())
      .def("read_signal", &Mesh::read_signal, arg("win"), arg("slot"), nogil)
      .def("wait_signal", &Mesh::wait_signal, arg("win"), arg("slot"), arg("expected"), arg("timeout"), nogil)
      .def("flush", &Mesh::flush, arg("peer"), arg("timeout"), nogil)
      .def("read_counter", &Mesh::read_counter, nogil)
      .def("wait_counter", &Mesh::wait_counter, arg("value"), arg("timeout"), nogil);
}

}  // namespace fxm_py
