// Weights alone on the engine core: what Python's DeepSpeedEngine calls for
// load_weights, save_16bit_model (and save_fp16_model) and
// _zero3_consolidated_16bit_state_dict.
#pragma once

#include "py_engine.h"

namespace uckpt::python {

// Engine::LoadWeights; returns torch's _IncompatibleKeys(missing_keys, unexpected_keys).
py::object LoadWeights(PyEngine& e, py::object path, py::object name_map, bool strict, const std::string& strip_prefix,
                       const std::string& add_prefix);
// DeepSpeed's save_16bit_model: False (nothing written) at stage 3 without gathering on save.
bool Save16bitModel(PyEngine& e, py::object save_dir, py::object save_filename, bool exclude_frozen);
// The whole 16-bit state dict on rank 0 (None on the others).
py::object Consolidated(PyEngine& e, bool exclude_frozen);

}  // namespace uckpt::python
