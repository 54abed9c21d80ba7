// The config as Python hands it over (a dict or a JSON path), parsed once in
// C++ (engine/config.h) into the typed TrainConfig that Python reads through
// the class Config (DeepSpeedConfig's attribute names), and initialize's
// rules for where the config comes from.
#pragma once

#include <torch/csrc/utils/pybind.h>

#include "engine/config.h"

namespace uckpt::python {

namespace py = pybind11;

// deepspeed.initialize's config: config= (a dict or a JSON path) or
// args.deepspeed_config (args.deepscale_config, deprecated, is moved there);
// both, or neither, is a ValueError, as DeepSpeed asserts.
py::object ResolveConfig(py::handle args, py::handle config);

// deepspeed.add_config_arguments: --deepspeed, --deepspeed_config (and the old --deepscale names).
py::object AddConfigArguments(py::object parser);

// Config (TrainConfig as Python reads it), parse_config, resolve_config, add_config_arguments.
void BindConfig(py::module_& m);

}  // namespace uckpt::python
