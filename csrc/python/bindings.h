// Pieces of the pybind11 module defined in separate files.
#pragma once

#include <pybind11/pybind11.h>

#include "core/mesh.h"

namespace fxm_py {

namespace py = pybind11;

// Adds the window and one-sided operation methods to the Mesh class.
void bind_onesided(py::class_<fxm::Mesh>& cls);

// NetBootstrap and net_trial: the net-adaptor builders over the test adaptor.
void bind_adaptor(py::module_& m);

// AgentCore, AgentConnection, AgentHandle (csrc/python/agent.cc).
void bind_agent(py::module_& m);

// A contiguous view of any buffer-protocol object, released on destruction.
class ByteView {
 public:
  ByteView(const py::object& obj, bool writable);
  ~ByteView() { PyBuffer_Release(&view_); }
  ByteView(const ByteView&) = delete;
  ByteView& operator=(const ByteView&) = delete;
  void* data() const { return view_.buf; }
  size_t size() const { return static_cast<size_t>(view_.len); }

 private:
  Py_buffer view_{};
};

}  // namespace fxm_py
