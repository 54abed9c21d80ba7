// The class EngineCore: the C++ engine as Python's DeepSpeedEngine and its
// optimizer and scheduler views (python/uckpt/runtime/) call it. Thin: each
// method is one call of PyEngine or uckpt::Engine; the DeepSpeed signatures,
// their refusals and the Python-only attributes live in the Python classes.
#include "py_engine.h"
#include "py_weights.h"
#include "script_api.h"

namespace uckpt::python {

using namespace pybind11::literals;

namespace {

using Core = py::class_<PyEngine, std::shared_ptr<PyEngine>>;

void BindTraining(Core& c) {
  c.def(
       "backward",
       [](PyEngine& e, py::object loss, bool retain_graph, bool scale_wrt_gas) {
         BackwardOptions o;
         o.retain_graph = retain_graph;
         o.scale_wrt_gas = scale_wrt_gas;
         return e.Backward(loss, o);
       },
       "loss"_a, "retain_graph"_a, "scale_wrt_gas"_a)
      .def("step", &PyEngine::Step, "lr_kwargs"_a)
      .def("is_gradient_accumulation_boundary",
           [](const PyEngine& e) { return e.engine().IsGradientAccumulationBoundary(); })
      .def(
          "set_gradient_accumulation_boundary",
          [](PyEngine& e, py::object is_boundary) {  // None: the micro-step count decides again
            e.engine().SetGradientAccumulationBoundary(
                is_boundary.is_none() ? std::nullopt : std::optional<bool>(py::bool_(is_boundary)));
          },
          "is_boundary"_a)
      .def("was_step_applied", [](const PyEngine& e) { return e.engine().stats().last_step_applied(); })
      .def("train", &PyEngine::Train, "mode"_a)
      .def(
          "set_train_batch_size", [](PyEngine& e, int64_t n) { e.engine().settings().SetTrainBatchSize(n); },
          "train_batch_size"_a)
      .def("parameter_partitions", [](const PyEngine& e) { return e.engine().weights().ParameterPartitions(); });
}

void BindCheckpoints(Core& c) {
  c.def("save_checkpoint", &PyEngine::SaveCheckpoint, "save_dir"_a, "tag"_a, "client_state"_a,
        "exclude_frozen_parameters"_a)
      .def("load_checkpoint", &PyEngine::LoadCheckpoint, "load_dir"_a, "tag"_a, "load_module_strict"_a,
           "load_optimizer_states"_a, "load_lr_scheduler_states"_a, "load_module_only"_a)
      .def("last_load",  // what the last load_checkpoint did (uckpt's own)
           [](const PyEngine& e) {
             const LoadStats& l = e.engine().stats().last_load();
             py::dict d;
             d["fingerprint"] = l.fingerprint;
             d["fingerprint_s"] = l.fingerprint_s;
             d["optimizer_bytes_read"] = l.optimizer_bytes_read;
             return d;
           })
      .def("load_weights", &LoadWeights, "path"_a, "name_map"_a, "strict"_a, "strip_prefix"_a, "add_prefix"_a)
      .def("save_16bit_model", &Save16bitModel, "save_dir"_a, "save_filename"_a, "exclude_frozen_parameters"_a)
      .def("zero_gather_16bit_weights_on_model_save",
           [](const PyEngine& e) { return e.engine().settings().zero_gather_16bit_weights_on_model_save(); })
      .def("consolidated_16bit_state_dict", &Consolidated, "exclude_frozen_parameters"_a);
}

void BindState(Core& c) {
  c.def("parsed_config", [](const PyEngine& e) { return e.settings().config; })
      .def("device", [](const PyEngine& e) { return e.engine().settings().device().str(); })
      .def("local_rank", [](const PyEngine& e) { return e.engine().settings().local_rank(); })
      .def("global_rank", [](const PyEngine& e) { return e.engine().settings().rank(); })
      .def("world_size", [](const PyEngine& e) { return e.engine().settings().world_size(); })
      .def("global_steps", [](const PyEngine& e) { return e.engine().stats().global_steps(); })
      .def("global_samples", [](const PyEngine& e) { return e.engine().stats().global_samples(); })
      .def("micro_steps", [](const PyEngine& e) { return e.engine().stats().micro_steps(); })
      .def("skipped_steps", [](const PyEngine& e) { return e.engine().stats().skipped_steps(); })
      .def("get_lr", &PyEngine::GetLr)
      .def("get_global_grad_norm", &PyEngine::GlobalGradNorm)
      .def("gradient_accumulation_steps",
           [](const PyEngine& e) { return e.engine().settings().gradient_accumulation_steps(); })
      .def("train_batch_size", [](const PyEngine& e) { return e.engine().settings().train_batch_size(); })
      .def("train_micro_batch_size_per_gpu",
           [](const PyEngine& e) { return e.engine().settings().train_micro_batch_size_per_gpu(); })
      // initialize's optimizer= after a callable built it ("" if none).
      .def("client_optimizer_class", [](const PyEngine& e) { return e.settings().client_optimizer; });
}

void BindOptimizerView(Core& c) {
  c.def("has_optimizer", [](const PyEngine& e) { return e.settings().has_optimizer; })
      .def("param_groups", &PyEngine::ParamGroups)
      .def("optimizer_step", &PyEngine::OptimizerStep)
      .def("optimizer_state_dict", &PyEngine::OptimizerStateDict)
      .def("load_optimizer_state_dict", &PyEngine::LoadOptimizerStateDict, "state_dict"_a)
      .def("optimizer_overflow", &OptimizerOverflow)
      .def("optimizer_loss_scale",
           [](const PyEngine& e, const std::string& name) { return OptimizerLossScale(e, name.c_str()); })
      .def("optimizer_class", &DeepSpeedOptimizerClass);
}

void BindSchedulerView(Core& c) {
  c.def("client_scheduler", [](const PyEngine& e) -> py::object { return e.client_scheduler(); })
      .def("has_config_scheduler",
           [](const PyEngine& e) { return e.settings().has_optimizer && e.settings().has_scheduler(); })
      .def("scheduler_get_lr", &PyEngine::SchedulerLr)
      .def("scheduler_get_last_lr", &PyEngine::SchedulerLastLr)
      .def("scheduler_state_dict", &PyEngine::SchedulerState)
      .def("scheduler_step", &PyEngine::StepScheduler)
      .def("scheduler_last_batch_iteration",
           [](const PyEngine& e) { return e.engine().optimizer().lr_schedule_iteration(); })
      .def("scheduler_type", [](const PyEngine& e) { return e.settings().scheduler_type(); });
}

}  // namespace

void BindEngineCore(py::module_& m) {
  Core core(m, "EngineCore", "uckpt's C++ engine behind uckpt.runtime.engine.DeepSpeedEngine");
  BindTraining(core);
  BindCheckpoints(core);
  BindState(core);
  BindOptimizerView(core);
  BindSchedulerView(core);
  m.def("_finish_checkpoints", &FinishCheckpointsAtExit,
        "At exit: the live engines' saves published and made durable (uckpt.comm's teardown).");
}

}  // namespace uckpt::python
