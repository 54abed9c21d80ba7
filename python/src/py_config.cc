// The config parsed once, read by Python through a typed object (see py_config.h).
#include "py_config.h"

#include <cmath>
#include <iostream>

#include "py_values.h"

namespace uckpt::python {

using namespace pybind11::literals;
using engine::TrainConfig;

py::object ResolveConfig(py::handle args, py::handle config) {
  auto from = [&](const char* name) -> py::object {
    return !args.is_none() && py::hasattr(args, name) ? py::object(args.attr(name)) : py::object(py::none());
  };
  py::object given = from("deepspeed_config");
  // As DeepSpeed's initialize: the deprecated name moves to the new one, and a config from two places is refused.
  if (py::object deprecated = from("deepscale_config"); !deprecated.is_none()) {
    std::cerr << "uckpt: warning: --deepscale_config is deprecated, please use --deepspeed_config\n";
    if (!given.is_none())
      throw py::value_error(
          "uckpt.initialize: args has both deepscale_config and deepspeed_config; pass one "
          "(DeepSpeed 0.14.5 refuses both too)");
    args.attr("deepspeed_config") = deprecated;
    args.attr("deepscale_config") = py::none();
    given = deprecated;
  }
  if (!given.is_none() && !config.is_none())
    throw py::value_error(
        "uckpt.initialize: a config was given both as config= and as args.deepspeed_config; pass "
        "one (DeepSpeed 0.14.5 refuses both too)");
  if (!config.is_none()) return py::reinterpret_borrow<py::object>(config);
  if (!given.is_none()) return given;
  throw py::value_error(
      "uckpt.initialize: no config: pass config= (a dict or a JSON path) or args with --deepspeed_config");
}

py::object AddConfigArguments(py::object parser) {
  py::object group = parser.attr("add_argument_group")("DeepSpeed", "DeepSpeed configurations");
  group.attr("add_argument")("--deepspeed", "default"_a = false, "action"_a = "store_true",
                             "help"_a = "Enable DeepSpeed (uckpt)");
  group.attr("add_argument")("--deepspeed_config", "default"_a = py::none(), "type"_a = py::type::handle_of(py::str()),
                             "help"_a = "DeepSpeed json configuration file.");
  group.attr("add_argument")("--deepscale", "default"_a = false, "action"_a = "store_true",
                             "help"_a = "Deprecated: --deepspeed");
  group.attr("add_argument")("--deepscale_config", "default"_a = py::none(), "type"_a = py::type::handle_of(py::str()),
                             "help"_a = "Deprecated: --deepspeed_config");
  return parser;
}

namespace {

// A whole number as Python's int (DeepSpeed hands back the JSON's value: 0, 128), else a float.
py::object Number(double v) {
  if (v == static_cast<double>(static_cast<int64_t>(v))) return py::int_(static_cast<int64_t>(v));
  return py::float_(v);
}

// DeepSpeed's get_loss_scale: fp16's loss_scale (0, dynamic, when absent); 1.0 in bf16; 0 otherwise.
py::object LossScale(const TrainConfig& c) {
  if (c.fp16.enabled) return Number(c.fp16.loss_scale);
  if (c.bf16) return py::float_(1.0);
  return py::int_(0);
}

// zero.Init's config: parsed as initialize parses it (a DeepSpeedConfig arrives as its _param_dict).
TrainConfig ParseConfigObject(py::handle config) {
  std::string source;
  const nlohmann::json json = ConfigToJson(config, source, "uckpt.zero.Init");
  return engine::ParseConfig(json, source);
}

}  // namespace

void BindConfig(py::module_& m) {
  // Read-only: the engine was built from it; a change would do nothing.
  py::class_<TrainConfig>(m, "Config", "A parsed DeepSpeed config (engine._config), with DeepSpeedConfig's names")
      .def_property_readonly("zero_optimization_stage", [](const TrainConfig& c) { return c.zero.stage; })
      .def_property_readonly("zero_enabled", [](const TrainConfig& c) { return c.zero.stage > 0; })
      .def_property_readonly("fp16_enabled", [](const TrainConfig& c) { return c.fp16.enabled; })
      .def_property_readonly("bfloat16_enabled", [](const TrainConfig& c) { return c.bf16; })
      .def_property_readonly("loss_scale", &LossScale)
      .def_property_readonly("gradient_clipping", [](const TrainConfig& c) { return c.gradient_clipping; })
      .def_property_readonly("steps_per_print",
                             [](const TrainConfig& c) -> py::object {
                               if (c.steps_per_print_nonfinite) return py::float_(*c.steps_per_print_nonfinite);
                               return py::int_(c.steps_per_print);
                             })
      .def_property_readonly("wall_clock_breakdown", [](const TrainConfig& c) { return c.wall_clock_breakdown; })
      .def_property_readonly("load_universal_checkpoint", [](const TrainConfig& c) { return c.load_universal; })
      .def_property_readonly("dataloader_drop_last", [](const TrainConfig& c) { return c.dataloader_drop_last; })
      .def_property_readonly("zero_allow_untested_optimizer",
                             [](const TrainConfig& c) { return c.zero_allow_untested_optimizer; })
      .def_property_readonly("zero_force_ds_cpu_optimizer",
                             [](const TrainConfig& c) { return c.zero_force_ds_cpu_optimizer; })
      // DeepSpeed lower-cases the names of its own optimizers (Adam and AdamW are all the parser takes).
      .def_property_readonly("optimizer_name",
                             [](const TrainConfig& c) -> py::object {
                               return c.has_optimizer_section
                                          ? py::object(py::str(c.optimizer.type == "Adam" ? "adam" : "adamw"))
                                          : py::object(py::none());
                             })
      .def_property_readonly("scheduler_name",
                             [](const TrainConfig& c) -> py::object {
                               return c.scheduler.type.empty() ? py::object(py::none())
                                                               : py::object(py::str(c.scheduler.type));
                             })
      // uckpt's names, for zero.Init and the pure-Python modules.
      .def_property_readonly("offload_optimizer", [](const TrainConfig& c) { return c.zero.offload_optimizer_cpu; })
      .def_property_readonly("offload_param", [](const TrainConfig& c) { return c.zero.offload_param_cpu; })
      .def_property_readonly("offload_param_pin_memory",
                             [](const TrainConfig& c) { return c.zero.offload_param_pin_memory; })
      .def_property_readonly("override_module_apply", [](const TrainConfig& c) { return c.zero.override_module_apply; })
      .def_property_readonly("uckpt_section", [](const TrainConfig& c) { return JsonToPy(c.uckpt_section); })
      .def_property_readonly("warnings", [](const TrainConfig& c) { return c.warnings; })
      // DeepSpeedConfig's answers (uckpt.runtime.config) and the engine's forward (fp16.auto_cast).
      .def_property_readonly("raw", [](const TrainConfig& c) { return JsonToPy(c.raw); })
      .def_property_readonly("prescale_gradients", [](const TrainConfig& c) { return c.prescale_gradients; })
      .def_property_readonly("gradient_predivide_factor",
                             [](const TrainConfig& c) { return Number(c.gradient_predivide_factor); })
      // DeepSpeed's get_fp16_auto_cast: None when fp16 is off.
      .def_property_readonly("fp16_auto_cast",
                             [](const TrainConfig& c) -> py::object {
                               return c.fp16.enabled ? py::object(py::bool_(c.fp16.auto_cast)) : py::object(py::none());
                             })
      // DeepSpeed's get_dynamic_loss_scale_args: set only in fp16 when the config writes one of its keys.
      .def_property_readonly("dynamic_loss_scale_args",
                             [](const TrainConfig& c) -> py::object {
                               if (!c.fp16.enabled || !c.fp16.dynamic_keys_given) return py::none();
                               py::dict d;
                               d["init_scale"] = Number(std::ldexp(1.0, c.fp16.initial_scale_power));
                               d["scale_window"] = c.fp16.loss_scale_window;
                               d["delayed_shift"] = c.fp16.hysteresis;
                               d["consecutive_hysteresis"] = c.fp16.consecutive_hysteresis;
                               d["min_scale"] = Number(c.fp16.min_loss_scale);
                               return d;
                             })
      // (train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps) at `world_size` ranks.
      .def(
          "batch_sizes",
          [](const TrainConfig& c, int world_size) {
            const engine::BatchSizes b = engine::ResolveBatchSizes(c.train_batch_size, c.train_micro_batch_size_per_gpu,
                                                                   c.gradient_accumulation_steps, world_size);
            return py::make_tuple(b.train_batch_size, b.micro_batch, b.gradient_accumulation_steps);
          },
          "world_size"_a);
  m.def("parse_config", &ParseConfigObject, "config"_a,
        "A config (a dict or a JSON path) parsed as initialize parses it");
  m.def("resolve_config", &ResolveConfig, "args"_a, "config"_a);
  m.def("add_config_arguments", &AddConfigArguments, "parser"_a);
}

}  // namespace uckpt::python
