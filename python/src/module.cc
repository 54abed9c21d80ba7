// uckpt._uckpt: the extension behind `import uckpt` (see python/uckpt/__init__.py).
// Bindings only: each file binds its own role.
#include <torch/python.h>

#include "py_config.h"
#include "py_dist.h"
#include "py_engine.h"
#include "py_initialize.h"
#include "script_api.h"

namespace py = pybind11;

PYBIND11_MODULE(_uckpt, m) {
  py::module_::import("torch");  // the tensor and process-group types
  m.doc() = "uckpt's training engine with DeepSpeed's Python API";
  uckpt::python::BindConfig(m);
  uckpt::python::BindEngineCore(m);
  uckpt::python::BindInitialize(m);
  uckpt::python::BindDistributed(m);
  uckpt::python::BindScriptFunctions(m);
  // C++ exceptions arrive as pybind11's defaults: invalid_argument -> ValueError, runtime_error -> RuntimeError.
}
