// uckpt._uckpt: the extension behind `import uckpt` (see python/uckpt/__init__.py).
// Bindings only: each file binds its own role.
#include <torch/python.h>

#include "py_config.h"
#include "py_dist.h"
#include "py_engine.h"
#include "py_initialize.h"
#include "script_api.h"

namespace py = pybind11;
using namespace pybind11::literals;

PYBIND11_MODULE(_uckpt, m) {
  py::module_::import("torch");  // the tensor and process-group types
  m.doc() = "uckpt's training engine with DeepSpeed's Python API";
  uckpt::python::BindConfig(m);
  uckpt::python::BindEngineCore(m);
  uckpt::python::BindInitialize(m);
  uckpt::python::BindDistributed(m);
  uckpt::python::BindScriptFunctions(m);
  // C++ exceptions arrive as pybind11's defaults: invalid_argument -> ValueError, runtime_error -> RuntimeError,
  // except the batch-size check, which DeepSpeed asserts: BatchSizeError is a RuntimeError and an AssertionError.
  // A raw reference kept for the process: a static py::object would be released after the interpreter is gone.
  static PyObject* batch_error =
      py::module_::import("builtins")
          .attr("type")("BatchSizeError",
                        py::make_tuple(py::handle(PyExc_RuntimeError), py::handle(PyExc_AssertionError)),
                        py::dict("__module__"_a = "uckpt._uckpt",
                                 "__doc__"_a = "The batch sizes disagree (DeepSpeed 0.14.5 raises AssertionError)."))
          .release()
          .ptr();
  m.attr("BatchSizeError") = py::handle(batch_error);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const uckpt::engine::BatchSizeError& e) {
      PyErr_SetString(batch_error, e.what());
    }
  });
}
