// deepspeed.initialize's work in C++: the config parsed once, the model, the
// optimizer and the scheduler into an engine core (py_engine.h), which
// Python's initialize wraps in its DeepSpeedEngine; and the stage-3
// parameters' gathering for uckpt.zero.GatheredParameters.
#pragma once

#include <torch/csrc/utils/pybind.h>

namespace uckpt::python {

namespace py = pybind11;

// (engine core, dataloader or None), with the config ResolveConfig gave.
py::tuple Initialize(py::object model, py::object optimizer, py::object model_parameters, py::object training_data,
                     py::object lr_scheduler, py::object mpu, py::object collate_fn, py::object config,
                     py::list partitioned);

// uckpt.zero.GatheredParameters: the stage-3 parameters among `params` (an
// iterable of tensors), each by the engine holding it, gathered (true) or
// released with modifier_rank (-1: writes discarded); tensors of no engine,
// or of an engine at stages 0-2, are left alone. Returns how many were
// stage 3's.
int GatherParameters(py::object params, bool gather, int modifier_rank);

// initialize, gather_parameters.
void BindInitialize(py::module_& m);

}  // namespace uckpt::python
