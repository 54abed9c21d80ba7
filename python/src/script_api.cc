// The engine's smaller attributes and initialize()'s optimizer checks (see script_api.h).
#include "script_api.h"

#include <iostream>
#include <set>

#include "ckpt/export.h"
#include "engine/config.h"
#include "py_engine.h"
#include "py_values.h"

namespace uckpt::python {

using namespace pybind11::literals;

namespace {

std::string ClassName(py::handle obj) { return py::str(obj.get_type().attr("__name__")).cast<std::string>(); }

// A class of DeepSpeed's ops, uckpt's or DeepSpeed's own copy: matched by name and package.
bool IsOpsClass(py::handle cls, const std::set<std::string>& names) {
  const std::string module = py::str(cls.attr("__module__")).cast<std::string>();
  const bool ours = module.rfind("uckpt.", 0) == 0 || module.rfind("deepspeed.", 0) == 0;
  return ours && names.count(py::str(cls.attr("__name__")).cast<std::string>()) > 0;
}

// deepspeed.runtime.zero.utils.ZERO_SUPPORTED_OPTIMIZERS: matched by exact type, as DeepSpeed does.
bool ZeroTestedClientOptimizer(py::handle optimizer) {
  py::handle cls = optimizer.get_type();
  py::module_ optim = py::module_::import("torch.optim");
  for (const char* name : {"Adam", "AdamW", "Adagrad"})
    if (cls.is(optim.attr(name))) return true;
  return IsOpsClass(cls, {"FusedAdam", "DeepSpeedCPUAdam", "DeepSpeedCPUAdagrad", "DeepSpeedCPULion", "FusedLion"});
}

// The optimizer DeepSpeed builds for a config type is one of those for adam, adamw, adagrad and lion.
bool ZeroTestedConfigOptimizer(const nlohmann::json& config) {
  if (!config.contains("optimizer") || !config["optimizer"].is_object()) return true;
  const auto& o = config["optimizer"];
  if (!o.contains("type") || !o["type"].is_string()) return true;  // the config's parser says what is wrong
  std::string t = o["type"].get<std::string>();
  for (auto& c : t) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return t == "adam" || t == "adamw" || t == "adagrad" || t == "lion";
}

bool FlagOr(const nlohmann::json& config, const char* key, bool fallback) {
  return config.contains(key) && config[key].is_boolean() ? config[key].get<bool>() : fallback;
}

int ZeroStage(const nlohmann::json& config) {
  if (!config.contains("zero_optimization") || !config["zero_optimization"].is_object()) return 0;
  const auto& z = config["zero_optimization"];
  return z.contains("stage") && z["stage"].is_number_integer() ? z["stage"].get<int>() : 0;
}

// zero_optimization.offload_optimizer.device "cpu" (or the legacy cpu_offload: true).
bool OffloadsOptimizer(const nlohmann::json& config) {
  if (!config.contains("zero_optimization") || !config["zero_optimization"].is_object()) return false;
  const auto& z = config["zero_optimization"];
  if (z.contains("cpu_offload") && z["cpu_offload"].is_boolean() && z["cpu_offload"].get<bool>()) return true;
  if (!z.contains("offload_optimizer") || !z["offload_optimizer"].is_object()) return false;
  const auto& o = z["offload_optimizer"];
  return o.contains("device") && o["device"].is_string() && o["device"].get<std::string>() != "none";
}

}  // namespace

void CheckZeroOptimizer(py::handle optimizer, const nlohmann::json& config, bool rank0) {
  const bool client = !optimizer.is_none();
  if (client && OffloadsOptimizer(config) && FlagOr(config, "zero_force_ds_cpu_optimizer", true) &&
      !IsOpsClass(optimizer.get_type(), {"DeepSpeedCPUAdam"}))
    throw py::value_error(
        "uckpt.initialize: ZeRO-Offload with a client optimizer (" + ClassName(optimizer) +
        ") is refused, as DeepSpeed 0.14.5 refuses it: pass uckpt.ops.adam.DeepSpeedCPUAdam, give the config an "
        "'optimizer' section, or set \"zero_force_ds_cpu_optimizer\": false");
  if (ZeroStage(config) == 0) return;
  const bool tested = client ? ZeroTestedClientOptimizer(optimizer) : ZeroTestedConfigOptimizer(config);
  if (tested) return;
  if (!FlagOr(config, "zero_allow_untested_optimizer", false))
    throw py::value_error("uckpt.initialize: You are using an untested ZeRO Optimizer (" +
                          (client ? ClassName(optimizer) : config["optimizer"]["type"].get<std::string>()) +
                          "). Please add <\"zero_allow_untested_optimizer\": true> in the configuration file to use "
                          "it (DeepSpeed 0.14.5 refuses it too)");
  if (rank0) std::cerr << "uckpt: **** You are using ZeRO with an untested optimizer, proceed with caution *****\n";
}

py::object OptimizerName(const std::string& client_optimizer_class, const nlohmann::json& config) {
  if (!client_optimizer_class.empty()) return py::str(client_optimizer_class);
  if (!config.contains("optimizer") || !config["optimizer"].is_object() || !config["optimizer"].contains("type") ||
      !config["optimizer"]["type"].is_string())
    return py::none();
  const std::string type = config["optimizer"]["type"].get<std::string>();
  std::string lower = type;
  for (auto& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  static const std::set<std::string> own{"adagrad", "adam",   "adamw",  "lamb",  "onebitadam", "zerooneadam",
                                         "onebitlamb", "muadam", "muadamw", "musgd", "lion"};
  return py::str(own.count(lower) ? lower : type);
}

std::string DeepSpeedOptimizerClass(const PyEngine& e) {
  const int stage = e.engine().zero_stage();
  if (e.engine().bf16_enabled() && stage <= 1 && !OffloadsOptimizer(e.settings().config)) return "BF16_Optimizer";
  if (stage == 0) return "torch";  // (stage 0 in fp16 is refused at initialize)
  return stage == 3 ? "DeepSpeedZeroOptimizer_Stage3" : "DeepSpeedZeroOptimizer";
}

namespace {

void RequireZeroOptimizer(const PyEngine& e, const char* attribute) {
  const std::string cls = DeepSpeedOptimizerClass(e);
  if (cls == "BF16_Optimizer" || cls == "torch")
    throw py::attribute_error(std::string("the optimizer has no attribute '") + attribute +
                              "': DeepSpeed's optimizer here is " +
                              (cls == "torch" ? "the torch optimizer itself" : "its bf16 wrapper (BF16_Optimizer)") +
                              ", which keeps none");
}

// DeepSpeed's get_loss_scale: fp16's "loss_scale" (0, dynamic, when absent); 1.0 in bf16; 0 otherwise.
py::object ConfigLossScale(const PyEngine& e) {
  const auto& c = e.settings().config;
  if (e.engine().fp16_enabled()) {
    const bool given = c.contains("fp16") && c["fp16"].is_object() && c["fp16"].contains("loss_scale");
    return given ? JsonToPy(c["fp16"]["loss_scale"]) : py::object(py::int_(0));
  }
  if (e.engine().bf16_enabled()) return py::float_(1.0);
  return py::int_(0);
}

}  // namespace

py::object OptimizerOverflow(const PyEngine& e) {
  RequireZeroOptimizer(e, "overflow");
  return py::bool_(e.engine().last_step().skipped);
}

py::object OptimizerLossScale(const PyEngine& e, const char* attribute) {
  RequireZeroOptimizer(e, attribute);
  return py::float_(e.engine().loss_scale());
}

void BindScriptApi(py::module_& m) {
  auto engine = py::reinterpret_borrow<py::class_<PyEngine, std::shared_ptr<PyEngine>>>(m.attr("Engine"));
  engine
      .def("optimizer_name",
           [](const PyEngine& e) { return OptimizerName(e.settings().client_optimizer, e.settings().config); })
      .def("steps_per_print", [](const PyEngine& e) { return e.settings().config.value("steps_per_print", 10); })
      // DeepSpeed's: the config's wall_clock_breakdown, or an enabled flops profiler.
      .def("wall_clock_breakdown",
           [](const PyEngine& e) {
             const auto& c = e.settings().config;
             const bool profiler = c.contains("flops_profiler") && c["flops_profiler"].is_object() &&
                                   c["flops_profiler"].value("enabled", false);
             return c.value("wall_clock_breakdown", false) || profiler;
           })
      .def("set_gradient_accumulation_boundary",
           [](PyEngine& e, py::object is_boundary) {  // None: the micro-step count decides again
             e.engine().SetGradientAccumulationBoundary(is_boundary.is_none() ? std::nullopt
                                                                               : std::optional<bool>(py::bool_(is_boundary)));
           },
           "is_boundary"_a)
      .def("was_step_applied", [](const PyEngine& e) { return e.engine().last_step_applied(); })
      // DeepSpeed's: the config's gradient_clipping (0.0 when absent), its loss_scale rule, and whether that is 0.
      .def("gradient_clipping",
           [](const PyEngine& e) -> py::object {
             const auto& c = e.settings().config;
             return c.contains("gradient_clipping") ? JsonToPy(c["gradient_clipping"]) : py::object(py::float_(0.0));
           })
      .def("loss_scale", [](const PyEngine& e) { return ConfigLossScale(e); })
      .def("dynamic_loss_scale", [](const PyEngine& e) { return ConfigLossScale(e).equal(py::int_(0)); })
      .def("set_train_batch_size", [](PyEngine& e, int64_t n) { e.engine().SetTrainBatchSize(n); },
           "train_batch_size"_a)
      // DeepSpeed's removes its optimizer's gradient hooks; the engine stays usable for forward.
      // (no_sync: DeepSpeed 0.14.5's engine has none and looks it up on the module, as uckpt's does.)
      .def("destroy", [](PyEngine&) {})
      // The config's "uckpt" section (checked by the config parser) for the pure-Python modules.
      .def("_uckpt_config", [](const PyEngine& e) {
        const auto& c = e.settings().config;
        const bool has = c.contains("uckpt") && c["uckpt"].is_object();
        return py::module_::import("json").attr("loads")(has ? c["uckpt"].dump() : std::string("{}"));
      });

  m.def(
      "export_fp32",
      [](const std::string& checkpoint, const std::string& out) {
        py::gil_scoped_release no_gil;
        ckpt::ExportSafetensors(checkpoint, out, DType::kFloat32);
      },
      "checkpoint"_a, "out"_a, "The fp32 weights of a ZeRO checkpoint's tag folder as a safetensors file");
  m.def("scheduler_types", [] { return engine::SchedulerTypes(); }, "The config scheduler types the engine runs");
}

}  // namespace uckpt::python
