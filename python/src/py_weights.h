// The Python engine's weight-file methods (py_weights.cc).
#pragma once

#include "py_engine.h"

namespace uckpt::python {

// Adds them to m.Engine (registered before the call).
void BindWeightsIO(py::module_& m);

}  // namespace uckpt::python
