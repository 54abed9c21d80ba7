// uckpt._uckpt: the extension behind `import uckpt` (see python/uckpt/__init__.py).
#include <torch/python.h>

#include "py_engine.h"
#include "script_api.h"
#include "py_weights.h"

namespace py = pybind11;
using namespace pybind11::literals;
using uckpt::BackwardOptions;
using uckpt::python::PyEngine;

namespace {

// What DeepSpeed's initialize returns as the optimizer: its param groups (the
// same dicts every time; writes take effect at the next optimizer step). The
// update itself happens in engine.step().
struct EngineOptimizer {
  std::shared_ptr<PyEngine> engine;
};

// The config's lr schedule; the engine steps it at each boundary (as
// DeepSpeed's engine steps its scheduler), and step() steps it once more.
struct EngineScheduler {
  std::shared_ptr<PyEngine> engine;
};

}  // namespace

PYBIND11_MODULE(_uckpt, m) {
  py::module_::import("torch");  // the tensor and process-group types
  m.doc() = "uckpt's training engine with DeepSpeed's Python API";

  py::class_<EngineOptimizer>(m, "EngineOptimizer")
      .def_property_readonly("param_groups", [](const EngineOptimizer& o) { return o.engine->ParamGroups(); })
      // DeepSpeed's ZeRO optimizers' zero_grad: each trainable parameter's .grad set to None, or zeroed.
      .def("zero_grad",
           [](const EngineOptimizer& o, bool set_to_none) {
             for (py::handle group : o.engine->ParamGroups())
               for (py::handle p : group["params"]) {
                 if (set_to_none) {
                   p.attr("grad") = py::none();
                 } else if (!p.attr("grad").is_none()) {
                   p.attr("grad").attr("zero_")();  // in place: the engine's gradient views stay attached
                 }
               }
           },
           "set_to_none"_a = true)
      .def("step",
           [](EngineOptimizer&, py::args, py::kwargs) {
             throw std::runtime_error(
                 "engine.optimizer.step() is not supported by uckpt: the update runs in engine.step() (with the "
                 "gradient-accumulation boundary, the lr schedule and the step counters); call engine.step()");
           })
      .def("backward",
           [](EngineOptimizer&, py::args, py::kwargs) {
             throw std::runtime_error(
                 "engine.optimizer.backward() is not supported by uckpt: call engine.backward(loss) (which also "
                 "reduces the gradients across ranks, as DeepSpeed's engine.backward does)");
           })
      // ZeRO stage 0 in fp32 with a client torch optimizer: that optimizer's own; elsewhere refused by name.
      .def("state_dict", [](EngineOptimizer& o) { return o.engine->OptimizerStateDict(); })
      .def("load_state_dict", [](EngineOptimizer& o, py::object sd) { o.engine->LoadOptimizerStateDict(sd); },
           "state_dict"_a)
      .def_property_readonly("overflow", [](const EngineOptimizer& o) { return uckpt::python::OptimizerOverflow(*o.engine); })
      // Read as DeepSpeed's ZeRO optimizers'; DeepSpeed's can also be set, uckpt's cannot.
      .def_property(
          "loss_scale", [](const EngineOptimizer& o) { return uckpt::python::OptimizerLossScale(*o.engine, "loss_scale"); },
          [](EngineOptimizer&, py::object) {
            throw std::runtime_error("setting engine.optimizer.loss_scale is not supported by uckpt");
          })
      .def_property(
          "cur_scale", [](const EngineOptimizer& o) { return uckpt::python::OptimizerLossScale(*o.engine, "cur_scale"); },
          [](EngineOptimizer&, py::object) {
            throw std::runtime_error("setting engine.optimizer.cur_scale is not supported by uckpt");
          })
      .def_property_readonly("_deepspeed_class",
                             [](const EngineOptimizer& o) { return uckpt::python::DeepSpeedOptimizerClass(*o.engine); })
      .def("__repr__", [](const EngineOptimizer&) { return std::string("<uckpt ZeRO optimizer>"); });

  py::class_<EngineScheduler>(m, "EngineScheduler")
      .def("get_lr", [](const EngineScheduler& s) { return s.engine->SchedulerLr(); })
      .def("get_last_lr", [](const EngineScheduler& s) { return s.engine->SchedulerLastLr(); })
      .def("state_dict", [](const EngineScheduler& s) { return s.engine->SchedulerState(); })
      .def("step", [](EngineScheduler& s, py::args a, py::kwargs k) { s.engine->StepScheduler(a, k); })
      // DeepSpeed's schedulers' count of updates, -1 before the first.
      .def_property_readonly("last_batch_iteration",
                             [](const EngineScheduler& s) { return s.engine->engine().lr_schedule_iteration(); })
      // The config's scheduler type: the deepspeed.runtime.lr_schedules class DeepSpeed builds.
      .def_property_readonly("_deepspeed_class", [](const EngineScheduler& s) {
        return s.engine->settings().scheduler_type;
      });

  py::class_<PyEngine, std::shared_ptr<PyEngine>>(m, "Engine")
      .def("__call__", &PyEngine::Call)
      .def("forward", &PyEngine::Call)
      .def(
          "backward",
          [](PyEngine& e, py::object loss, bool allreduce_gradients, bool /*release_loss*/, bool retain_graph,
             bool scale_wrt_gas) {
            // DeepSpeed 0.14.5 skips its gradient reduction then (at every stage); uckpt always reduces.
            // release_loss does nothing in DeepSpeed 0.14.5.
            if (!allreduce_gradients)
              throw py::value_error("engine.backward: allreduce_gradients=False is not supported by uckpt "
                                    "(the gradients are always reduced)");
            BackwardOptions o;
            o.retain_graph = retain_graph;
            o.scale_wrt_gas = scale_wrt_gas;
            return e.Backward(loss, o);
          },
          "loss"_a, "allreduce_gradients"_a = true, "release_loss"_a = false, "retain_graph"_a = false,
          "scale_wrt_gas"_a = true)
      .def("step", &PyEngine::Step, "lr_kwargs"_a = py::none())
      .def("zero_grad", &PyEngine::ZeroGrad)
      .def("is_gradient_accumulation_boundary",
           [](const PyEngine& e) { return e.engine().IsGradientAccumulationBoundary(); })
      .def(
          "save_checkpoint",
          [](PyEngine& e, py::object dir, py::object tag, py::object client_state, bool save_latest,
             bool exclude_frozen) {
            if (exclude_frozen)
              throw py::value_error("engine.save_checkpoint: exclude_frozen_parameters=True is not supported by uckpt");
            return e.SaveCheckpoint(dir, tag, client_state, save_latest);
          },
          "save_dir"_a, "tag"_a = py::none(),
           "client_state"_a = py::dict(), "save_latest"_a = true, "exclude_frozen_parameters"_a = false)
      .def(
          "load_checkpoint",
          [](PyEngine& e, py::object dir, py::object tag, bool strict, bool opt, bool sched, bool module_only,
             py::object custom_load_fn) {
            if (!custom_load_fn.is_none())
              throw py::value_error("engine.load_checkpoint: custom_load_fn is not supported by uckpt");
            if (!strict)
              throw py::value_error("engine.load_checkpoint: load_module_strict=False is not supported by uckpt "
                                    "(the module's parameters and buffers must match the checkpoint's)");
            return e.LoadCheckpoint(dir, tag, opt, sched, module_only);
          },
          "load_dir"_a, "tag"_a = py::none(), "load_module_strict"_a = true, "load_optimizer_states"_a = true,
          "load_lr_scheduler_states"_a = true, "load_module_only"_a = false, "custom_load_fn"_a = py::none())
      .def("load_universal_checkpoint", &PyEngine::LoadUniversal)
      .def("train", [](PyEngine& e, bool mode) { e.Train(mode); }, "mode"_a = true)
      .def("eval", [](PyEngine& e) { e.Train(false); })
      .def("get_lr", &PyEngine::GetLr)
      .def("get_global_grad_norm", &PyEngine::GlobalGradNorm)
      .def("gradient_accumulation_steps", [](const PyEngine& e) { return e.engine().gradient_accumulation_steps(); })
      .def("train_batch_size", [](const PyEngine& e) { return e.engine().train_batch_size(); })
      .def("train_micro_batch_size_per_gpu",
           [](const PyEngine& e) { return e.engine().train_micro_batch_size_per_gpu(); })
      .def("fp16_enabled", [](const PyEngine& e) { return e.engine().fp16_enabled(); })
      .def("bfloat16_enabled", [](const PyEngine& e) { return e.engine().bf16_enabled(); })
      .def("zero_optimization_stage", [](const PyEngine& e) { return e.engine().zero_stage(); })
      // (parameter, this rank's partition) at stage 3: DeepSpeed's ds_tensor (uckpt.zero).
      .def("_parameter_partitions", [](const PyEngine& e) { return e.engine().ParameterPartitions(); })
      .def("zero_optimization", [](const PyEngine& e) { return e.engine().zero_stage() > 0; })
      .def_property_readonly("module", &PyEngine::module)
      .def_property_readonly("local_rank", [](const PyEngine& e) { return e.engine().local_rank(); })
      .def_property_readonly("global_rank", [](const PyEngine& e) { return e.engine().rank(); })
      .def_property_readonly("world_size", [](const PyEngine& e) { return e.engine().world_size(); })
      .def_property_readonly("dp_world_size", [](const PyEngine& e) { return e.engine().world_size(); })
      .def_property_readonly("global_steps", [](const PyEngine& e) { return e.engine().global_steps(); })
      .def_property_readonly("global_samples", [](const PyEngine& e) { return e.engine().global_samples(); })
      .def_property_readonly("micro_steps", [](const PyEngine& e) { return e.engine().micro_steps(); })
      .def_property_readonly("skipped_steps", [](const PyEngine& e) { return e.engine().skipped_steps(); })
      .def_property_readonly("device", [](const PyEngine& e) {  // a torch.device, as DeepSpeed's
        return py::module_::import("torch").attr("device")(e.engine().device().str());
      })
      .def_property_readonly("optimizer",
                             [](std::shared_ptr<PyEngine> e) -> py::object {
                               if (!e->settings().has_optimizer) return py::none();  // DeepSpeed's, without one
                               return py::cast(EngineOptimizer{std::move(e)});
                             })
      .def_property_readonly("lr_scheduler",
                             [](std::shared_ptr<PyEngine> e) -> py::object {
                               if (!e->client_scheduler().is_none()) return e->client_scheduler();
                               if (!e->settings().has_scheduler) return py::none();
                               return py::cast(EngineScheduler{std::move(e)});
                             })
      // Anything else (parameters(), state_dict(), a model's own attributes) is the module's.
      .def("__getattr__", [](const PyEngine& e, const std::string& name) { return e.module().attr(name.c_str()); });

  uckpt::python::BindWeightsIO(m);

  m.def("resolve_config", &uckpt::python::ResolveConfig, "args"_a, "config"_a);
  m.def("initialize", &uckpt::python::Initialize, "model"_a = py::none(),
        "optimizer"_a = py::none(), "model_parameters"_a = py::none(), "training_data"_a = py::none(),
        "lr_scheduler"_a = py::none(), "mpu"_a = py::none(), "collate_fn"_a = py::none(), "config"_a = py::none(),
        "partitioned"_a = py::list());
  m.def("_finish_checkpoints", &uckpt::python::FinishCheckpointsAtExit,
        "At exit: the live engines' saves published and made durable (uckpt.comm's teardown).");
  m.def("_release_process_groups", &uckpt::python::ReleaseTorchDistributedGroups,
        "At exit: the live engines stop using torch.distributed's process group (uckpt.comm's teardown).");
  m.def("init_distributed", &uckpt::python::InitDistributed, "dist_backend"_a = py::none(),
        "auto_mpi_discovery"_a = true, "distributed_port"_a = 29500, "verbose"_a = true, "timeout"_a = py::none(),
        "init_method"_a = py::none(), "dist_init_required"_a = py::none(), "config"_a = py::none(), "rank"_a = -1,
        "world_size"_a = -1);
  m.def("gather_parameters", &uckpt::python::GatherParameters, "params"_a, "gather"_a, "modifier_rank"_a = -1);
  m.def("add_config_arguments", &uckpt::python::AddConfigArguments, "parser"_a);
  uckpt::python::BindScriptApi(m);

  // C++ exceptions the engine throws arrive as Python's ValueError / RuntimeError (pybind11's
  // defaults: invalid_argument -> ValueError, runtime_error -> RuntimeError).
}
