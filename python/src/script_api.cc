// The engine's smaller attributes and initialize()'s optimizer checks (see script_api.h).
#include "script_api.h"

#include <iostream>
#include <set>

#include "ckpt/export.h"
#include "py_engine.h"
#include "py_values.h"

namespace uckpt::python {

using namespace pybind11::literals;

namespace {

// A class of DeepSpeed's ops, uckpt's or DeepSpeed's own copy: matched by name and package.
bool IsOpsClass(py::handle cls, const std::set<std::string>& names) {
  const std::string module = py::str(cls.attr("__module__")).cast<std::string>();
  const bool ours = module.rfind("uckpt.", 0) == 0 || module.rfind("deepspeed.", 0) == 0;
  return ours && names.count(py::str(cls.attr("__name__")).cast<std::string>()) > 0;
}

// deepspeed.runtime.zero.utils.ZERO_SUPPORTED_OPTIMIZERS: matched by exact type, as DeepSpeed does.
bool ZeroTestedClientOptimizer(py::handle optimizer) {
  py::handle cls = py::type::handle_of(optimizer);
  py::module_ optim = py::module_::import("torch.optim");
  for (const char* name : {"Adam", "AdamW", "Adagrad"})
    if (cls.is(optim.attr(name))) return true;
  return IsOpsClass(cls, {"FusedAdam", "DeepSpeedCPUAdam", "DeepSpeedCPUAdagrad", "DeepSpeedCPULion", "FusedLion"});
}

}  // namespace

void CheckZeroOptimizer(py::handle optimizer, const engine::TrainConfig& config, bool rank0) {
  // The config's optimizer is Adam or AdamW (the parser refuses other types): DeepSpeed tests both with ZeRO.
  if (optimizer.is_none()) return;
  if (config.zero.offload_optimizer_cpu && config.zero_force_ds_cpu_optimizer &&
      !IsOpsClass(py::type::handle_of(optimizer), {"DeepSpeedCPUAdam"}))
    throw py::value_error(
        "uckpt.initialize: ZeRO-Offload with a client optimizer (" + TypeName(optimizer) +
        ") is refused, as DeepSpeed 0.14.5 refuses it: pass uckpt.ops.adam.DeepSpeedCPUAdam, give the config an "
        "'optimizer' section, or set \"zero_force_ds_cpu_optimizer\": false");
  if (config.zero.stage == 0 || ZeroTestedClientOptimizer(optimizer)) return;
  if (!config.zero_allow_untested_optimizer)
    throw py::value_error("uckpt.initialize: You are using an untested ZeRO Optimizer (" + TypeName(optimizer) +
                          "). Please add <\"zero_allow_untested_optimizer\": true> in the configuration file to use "
                          "it (DeepSpeed 0.14.5 refuses it too)");
  if (rank0) std::cerr << "uckpt: **** You are using ZeRO with an untested optimizer, proceed with caution *****\n";
}

std::string DeepSpeedOptimizerClass(const PyEngine& e) {
  const int stage = e.engine().settings().zero_stage();
  // DeepSpeed 0.14.5 wraps bf16 in BF16_Optimizer at stage 0 only (get_data_types: bf16 accumulation under
  // ZeRO; stage 1's BF16_Optimizer needs grad_accum_dtype fp32, which uckpt refuses).
  if (e.engine().settings().bf16_enabled() && stage == 0) return "BF16_Optimizer";
  if (stage == 0 && e.engine().settings().fp16_enabled()) {  // DeepSpeed's wrapper: FP16_Optimizer around its FusedAdam
    const engine::TrainConfig& c = e.settings().config;
    return e.settings().client_step || c.optimizer.torch_adam ? "FP16_UnfusedOptimizer" : "FP16_Optimizer";
  }
  if (stage == 0) return "torch";
  return stage == 3 ? "DeepSpeedZeroOptimizer_Stage3" : "DeepSpeedZeroOptimizer";
}

namespace {

void RequireZeroOptimizer(const PyEngine& e, const char* attribute) {
  const std::string cls = DeepSpeedOptimizerClass(e);
  if (cls == "BF16_Optimizer" || cls == "torch")
    throw py::attribute_error(
        std::string("the optimizer has no attribute '") + attribute + "': DeepSpeed's optimizer here is " +
        (cls == "torch" ? "the torch optimizer itself" : "its bf16 wrapper (BF16_Optimizer)") + ", which keeps none");
}

}  // namespace

py::object OptimizerOverflow(const PyEngine& e) {
  RequireZeroOptimizer(e, "overflow");
  return py::bool_(e.engine().optimizer().overflow());
}

py::object OptimizerLossScale(const PyEngine& e, const char* attribute) {
  RequireZeroOptimizer(e, attribute);
  return py::float_(e.engine().optimizer().loss_scale());
}

void BindScriptFunctions(py::module_& m) {
  m.def(
      "export_fp32",
      [](const std::string& checkpoint, const std::string& out) {
        py::gil_scoped_release no_gil;
        ckpt::ExportSafetensors(checkpoint, out, DType::kFloat32);
      },
      "checkpoint"_a, "out"_a, "The fp32 weights of a ZeRO checkpoint's tag folder as a safetensors file");
  m.def(
      "scheduler_types", [] { return engine::SchedulerTypes(); }, "The config scheduler types the engine runs");
}

}  // namespace uckpt::python
