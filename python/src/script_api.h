// What DeepSpeed scripts call besides training itself: the optimizer's
// DeepSpeed class and its loss-scale attributes, initialize()'s checks of a
// client optimizer, and the module functions the pure-Python modules build on
// (the fp32 export, the scheduler types).
#pragma once

#include <torch/csrc/utils/pybind.h>

#include "engine/config.h"

namespace uckpt::python {

namespace py = pybind11;

// DeepSpeed 0.14.5's checks of the optimizer at initialize, before the engine
// is built: with ZeRO-Offload a client optimizer must be a DeepSpeedCPUAdam
// unless zero_force_ds_cpu_optimizer is false; at ZeRO stages 1-3 the
// optimizer must be one DeepSpeed tested with ZeRO unless
// zero_allow_untested_optimizer is true (then rank 0 warns). ValueError with
// DeepSpeed's advice otherwise.
void CheckZeroOptimizer(py::handle optimizer, const engine::TrainConfig& config, bool rank0);

class PyEngine;
// The class of the optimizer DeepSpeed's initialize returns for this run:
// "DeepSpeedZeroOptimizer" (stages 1-2), "DeepSpeedZeroOptimizer_Stage3",
// "BF16_Optimizer" (bf16 at stage 0), or "torch" (the
// torch optimizer itself, at stage 0 otherwise).
std::string DeepSpeedOptimizerClass(const PyEngine& engine);

// Attributes of DeepSpeed's ZeRO optimizers, each an AttributeError naming it
// where DeepSpeed's optimizer is the torch optimizer or BF16_Optimizer, which
// have none.
// optimizer.overflow: whether the last update was skipped for an fp16 overflow.
py::object OptimizerOverflow(const PyEngine& engine);
// optimizer.loss_scale and optimizer.cur_scale: the loss scale (1 outside fp16).
py::object OptimizerLossScale(const PyEngine& engine, const char* attribute);

// The module functions export_fp32 and scheduler_types.
void BindScriptFunctions(py::module_& m);

}  // namespace uckpt::python
