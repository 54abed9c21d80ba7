// deepspeed.initialize: the config, the model, the optimizer and the
// scheduler into an engine core (see py_initialize.h).
#include "py_initialize.h"

#include <torch/csrc/autograd/python_variable.h>

#include <iostream>
#include <map>

#include "engine/engine_access.h"
#include "engine/host_threads.h"
#include "module_shell.h"
#include "py_config.h"
#include "py_dist.h"
#include "py_engine.h"
#include "py_param_groups.h"
#include "py_values.h"
#include "script_api.h"

namespace uckpt::python {

using namespace pybind11::literals;

namespace {

// ---- Checks of what uckpt does not do. ----

// A client element-wise optimizer at ZeRO stage 0 runs in fp32 only: in
// fp16/bf16 DeepSpeed wraps it in FP16_UnfusedOptimizer / BF16_Optimizer,
// whose steps and checkpoint files uckpt does not reproduce. Nor does uckpt
// number frozen parameters among the optimizer's state ids, as the torch
// optimizer's own state_dict (DeepSpeed's stage-0 file) does.
void RefuseStage0Unsupported(py::handle optimizer, const engine::TrainConfig& config) {
  if (config.zero.stage != 0) return;
  size_t frozen = 0;
  for (auto g : optimizer.attr("param_groups"))
    for (auto p : g["params"]) frozen += !p.attr("requires_grad").cast<bool>();
  if (frozen > 0)
    throw py::value_error("uckpt.initialize: optimizer " + TypeName(optimizer) + " at ZeRO stage 0 holds " +
                          std::to_string(frozen) +
                          " frozen parameter(s) (requires_grad=False) in its param groups, "
                          "which DeepSpeed's stage-0 checkpoint numbers among the optimizer's state ids and uckpt "
                          "does not; build it on the trainable parameters only (p for p in model.parameters() if "
                          "p.requires_grad), or use ZeRO stage 1-3");
  // fp16: DeepSpeed's FP16_UnfusedOptimizer around it, which the engine keeps (engine/fp16_stage0.cc).
  if (!config.bf16) return;
  throw py::value_error("uckpt.initialize: optimizer " + TypeName(optimizer) +
                        " at ZeRO stage 0 in bf16 is not "
                        "supported by uckpt (DeepSpeed wraps it in its BF16_Optimizer; uckpt runs it at stage 0 in "
                        "fp32 and fp16, and in bf16 at stages 1-3)");
}

void RefuseUnsupported(py::handle model, py::handle mpu, const nlohmann::json& config, const std::string& source) {
  if (!mpu.is_none())
    throw py::value_error("uckpt.initialize: model parallelism (mpu=) is not supported by uckpt (data parallel only)");
  if (std::string what = FindUnsupportedModule(model); !what.empty())
    throw py::value_error("uckpt.initialize: " + what);
  for (const char* key : {"pipeline", "moe", "tensor_parallel", "sequence_parallel_size"})
    if (config.contains(key))
      throw py::value_error(source + ": '" + key + "' is not supported by uckpt (data parallel ZeRO only)");
}

py::object MakeDataLoader(py::handle data, const Engine& e, py::handle collate_fn, bool drop_last) {
  py::module_ data_mod = py::module_::import("torch.utils.data");
  py::object sampler = py::module_::import("torch.utils.data.distributed")
                           .attr("DistributedSampler")(data, "num_replicas"_a = e.settings().world_size(),
                                                       "rank"_a = e.settings().rank());
  // The config's dataloader_drop_last, as DeepSpeed's loader passes it on.
  py::dict kw("batch_size"_a = e.settings().train_micro_batch_size_per_gpu(), "sampler"_a = sampler,
              "drop_last"_a = drop_last);
  if (!collate_fn.is_none()) kw["collate_fn"] = collate_fn;
  return data_mod.attr("DataLoader")(data, **kw);
}

// The first tensor in `values` (a tuple of forward arguments or an output)
// replaced by f(tensor); TypeError naming `what` when there is none.
template <typename F>
py::object WithFirstTensor(py::handle values, const std::string& what, F&& f) {
  if (THPVariable_Check(values.ptr()))
    return py::reinterpret_steal<py::object>(THPVariable_Wrap(f(THPVariable_Unpack(values.ptr()))));
  if (py::isinstance<py::tuple>(values) || py::isinstance<py::list>(values)) {
    py::list items = py::list(py::reinterpret_borrow<py::object>(values));
    for (size_t k = 0; k < items.size(); ++k)
      if (THPVariable_Check(items[k].ptr())) {
        items[k] = py::reinterpret_steal<py::object>(THPVariable_Wrap(f(THPVariable_Unpack(items[k].ptr()))));
        return py::isinstance<py::tuple>(values) ? py::object(py::tuple(items)) : py::object(items);
      }
  }
  throw py::type_error("uckpt ZeRO stage 3: " + what +
                       " holds no tensor (a gather unit needs its input and output "
                       "hidden states as tensors)");
}

// Stage 3: unit i's parameters are gathered by a forward pre-hook and freed
// by a forward hook, through the engine's autograd identities (EnterUnit /
// ExitUnit), which gather and free them again in backward. The unit's
// `forward` called directly (not through the module's __call__, so without
// the hooks) does the same around itself.
void RegisterUnitHooks(const std::shared_ptr<PyEngine>& engine, const std::vector<GatherUnit>& units) {
  std::weak_ptr<PyEngine> weak = engine;
  for (size_t i = 0; i < units.size(); ++i) {
    const std::string name = "gather unit " + std::to_string(i) + " (" + TypeName(units[i].module) + ")";
    auto hooked = std::make_shared<int>(0);  // calls inside the hooks (the forward below must not enter again)
    auto enter = [weak, i, name](py::handle args) {
      auto e = weak.lock();
      if (!e) return py::object(py::none());
      return WithFirstTensor(args, name + "'s positional arguments", [&](const at::Tensor& x) {
        py::gil_scoped_release no_gil;
        return e->engine().EnterUnit(i, x);
      });
    };
    auto exit = [weak, i, name](py::handle out) {
      auto e = weak.lock();
      if (!e) return py::object(py::none());
      return WithFirstTensor(out, name + "'s output", [&](const at::Tensor& y) {
        py::gil_scoped_release no_gil;
        return e->engine().ExitUnit(i, y);
      });
    };
    units[i].module.attr("register_forward_pre_hook")(py::cpp_function([enter, hooked](py::object, py::tuple args) {
      py::object r = enter(args);
      ++*hooked;
      return r;
    }));
    units[i].module.attr("register_forward_hook")(
        py::cpp_function([exit, hooked](py::object, py::object, py::object out) {
          --*hooked;
          return exit(out);
        }));
    py::object forward = units[i].module.attr("forward");  // the bound method
    units[i].module.attr("forward") =
        py::cpp_function([enter, exit, hooked, forward, weak](py::args args, py::kwargs kwargs) {
          if (*hooked > 0 || weak.expired()) return forward(*args, **kwargs);
          py::object entered = enter(args);
          ++*hooked;
          py::object out;
          try {
            out = forward(*entered, **kwargs);
          } catch (...) {
            --*hooked;
            throw;
          }
          --*hooked;
          return exit(out);
        });
  }
}

// Non-persistent buffers are not in the shell (nor in state_dict): moved and
// cast here as DeepSpeed's module.to(device) and module.half()/bfloat16() do
// (floating ones only; at fp32 nothing is cast).
void MoveNonPersistentBuffers(py::handle model, const Engine& e) {
  py::module_ torch = py::module_::import("torch");
  py::object device = torch.attr("device")(e.settings().device().str());
  py::object dtype = py::none();
  if (e.settings().fp16_enabled()) dtype = torch.attr("float16");
  if (e.settings().bf16_enabled()) dtype = torch.attr("bfloat16");
  for (auto m : model.attr("modules")()) {
    if (!py::hasattr(m, "_non_persistent_buffers_set")) continue;
    py::dict buffers = m.attr("_buffers");
    for (auto name : m.attr("_non_persistent_buffers_set")) {
      if (!buffers.contains(name) || !THPVariable_Check(buffers[name].ptr())) continue;
      py::object t = buffers[name].attr("to")(device);
      if (!dtype.is_none() && t.attr("is_floating_point")().cast<bool>()) t = t.attr("to")(dtype);
      buffers[name] = t;
    }
  }
}

// For uckpt.zero.GatheredParameters: the engine of each parameter (by its
// TensorImpl), engines numbered in creation order (the same on every rank).
struct EngineRef {
  uint64_t order = 0;
  std::weak_ptr<PyEngine> engine;
};
std::map<const void*, EngineRef> g_engine_of;
uint64_t g_engines_created = 0;

void RegisterParameters(const std::shared_ptr<PyEngine>& engine, const torch::nn::Module& shell) {
  for (auto it = g_engine_of.begin(); it != g_engine_of.end();)
    it = it->second.engine.expired() ? g_engine_of.erase(it) : std::next(it);
  const uint64_t order = g_engines_created++;
  for (const auto& t : shell.parameters(/*recurse=*/true)) g_engine_of[t.unsafeGetTensorImpl()] = {order, engine};
}

// uckpt's engine keeps at least one trainable parameter, also without an optimizer.
void RefuseFrozenWithoutOptimizer(py::handle model) {
  for (auto p : model.attr("parameters")())
    if (p.attr("requires_grad").cast<bool>()) return;
  throw py::value_error(
      "uckpt.initialize: without an optimizer uckpt still needs a module with a parameter that "
      "requires grad (uckpt's engine does not wrap a fully frozen module; run it as a plain "
      "torch module)");
}

// zero.Init's (param, ds_shape, ds_tensor) triples (uckpt.zero's
// zero_init_partitions), for the engine to take as partitions (it refuses
// them unless the config's stage is 3, before reading their freed values).
std::vector<PartitionedParameter> ZeroInitPartitions(py::list partitioned) {
  std::vector<PartitionedParameter> out;
  for (auto item : partitioned) {
    auto t = item.cast<py::tuple>();
    out.push_back({THPVariable_Unpack(t[0].ptr()), t[1].cast<std::vector<int64_t>>(), THPVariable_Unpack(t[2].ptr())});
  }
  return out;
}

// initialize's config, parsed once: its "optimizer" and "scheduler" sections
// give way to initialize's optimizer and lr_scheduler (DeepSpeed's rule);
// `notes` say so, for rank 0 to print.
EngineSettings ParseInitializeConfig(const nlohmann::json& given, const std::string& source, py::handle optimizer,
                                     const OptimizerPlan& plan, bool client_scheduler, py::handle lr_scheduler,
                                     std::vector<std::string>& notes) {
  engine::SectionOverrides overrides;
  if (!optimizer.is_none()) overrides.optimizer = plan.section;  // null: the client's optimizer steps itself
  // The scheduler: the client's over the config's, and none without an optimizer (DeepSpeed configures it only with
  // one).
  if (given.contains("scheduler") && (client_scheduler || !plan.has_optimizer)) {
    notes.push_back(std::string("the config's 'scheduler' section is not used: ") +
                    (client_scheduler ? "the lr_scheduler passed to initialize is, as DeepSpeed does"
                                      : "there is no optimizer, and DeepSpeed builds no scheduler without one"));
    overrides.drop_scheduler = true;
  }
  if (!plan.has_optimizer && !lr_scheduler.is_none())
    notes.push_back("lr_scheduler is not used: there is no optimizer (DeepSpeed ignores it then too)");
  EngineSettings settings;
  settings.config = engine::ParseConfig(given, source, overrides);
  if (settings.config.snapshot_interval > 0)
    throw py::value_error(source +
                          ": checkpoint.snapshot_interval (snapshots in host memory) is read by `uckpt train` only, "
                          "not yet by initialize(); remove the key (docs/reliability.md)");
  if (!optimizer.is_none()) settings.client_optimizer = TypeName(optimizer);
  settings.has_optimizer = plan.has_optimizer;
  settings.client_step = plan.client_step;
  return settings;
}

// The engine's options: the communicator, the groups, a client's optimizer step and stage 3's units.
EngineOptions MakeEngineOptions(py::handle model, py::handle optimizer, OptimizerPlan& plan,
                                const engine::TrainConfig& config, const std::shared_ptr<torch::nn::Module>& shell,
                                std::vector<GatherUnit>& units, py::list partitioned) {
  EngineOptions options;
  options.device = PickDevice();
  options.comm = CommFromTorchDistributed(options.device);
  CheckZeroOptimizer(optimizer, config, options.comm->rank() == 0);
  // The program's torch.set_num_threads, else OMP_NUM_THREADS, else this rank's share of the host.
  engine::ApplyHostThreads(0, "", "set OMP_NUM_THREADS or call torch.set_num_threads before initialize to change",
                           options.comm->rank() == 0);
  options.param_groups = std::move(plan.groups);
  options.forward_only = !plan.has_optimizer;  // DeepSpeed's engine without an optimizer only casts its module
  if (plan.client_step) {
    RefuseStage0Unsupported(optimizer, config);
    options.optimizer_step = ClientOptimizerStep(optimizer, plan.engine_group_of);
    options.optimizer_param_group = ClientParamGroup(optimizer, plan.engine_group_of);
  }
  if (config.zero.stage == 3) {
    units = FindGatherUnits(model, shell);
    for (const auto& u : units) options.gather_units.push_back(u.shell);
  }
  options.partitioned = ZeroInitPartitions(partitioned);
  return options;
}

}  // namespace

py::tuple Initialize(py::object model, py::object optimizer, py::object model_parameters, py::object training_data,
                     py::object lr_scheduler, py::object mpu, py::object collate_fn, py::object config,
                     py::list partitioned) {
  if (model.is_none()) throw py::value_error("uckpt.initialize: model is required");
  std::string source;
  const nlohmann::json given = ConfigToJson(config, source);
  RefuseUnsupported(model, mpu, given, source);
  // As DeepSpeed: model_parameters as a list (a generator is read once), and a
  // client optimizer that is not an optimizer object is a callable building one from them.
  if (!model_parameters.is_none()) model_parameters = py::list(model_parameters);
  if (!optimizer.is_none() && !py::hasattr(optimizer, "param_groups") && PyCallable_Check(optimizer.ptr()))
    optimizer =
        optimizer(model_parameters.is_none() ? py::object(py::list(model.attr("parameters")())) : model_parameters);
  OptimizerPlan plan = PlanOptimizer(optimizer, model_parameters, given.contains("optimizer"));
  const bool client_scheduler = plan.has_optimizer && PyObject_IsTrue(lr_scheduler.ptr()) == 1;
  std::vector<std::string> notes;
  EngineSettings settings =
      ParseInitializeConfig(given, source, optimizer, plan, client_scheduler, lr_scheduler, notes);
  if (!plan.has_optimizer) RefuseFrozenWithoutOptimizer(model);
  auto shell = BuildModuleShell(model);
  std::vector<GatherUnit> units;
  EngineOptions options = MakeEngineOptions(model, optimizer, plan, settings.config, shell, units, partitioned);
  std::unique_ptr<Engine> engine;
  {
    py::gil_scoped_release no_gil;
    engine = engine::MakeEngine(shell, settings.config, std::move(options));
  }
  MoveNonPersistentBuffers(model, *engine);
  if (engine->settings().rank() == 0) {
    for (const auto& w : engine->settings().warnings()) std::cerr << "uckpt: " << w << "\n";
    if (!plan.warning.empty()) std::cerr << "uckpt: " << plan.warning << "\n";
    for (const auto& n : notes) std::cerr << "uckpt: " << n << "\n";
  }
  py::object dataloader = training_data.is_none() ? py::none()
                                                  : MakeDataLoader(training_data, *engine, collate_fn,
                                                                   settings.config.dataloader_drop_last);
  auto core = std::make_shared<PyEngine>(model, shell, std::move(engine), std::move(settings));
  core->UseParamGroups(optimizer, std::move(plan.engine_group_of));
  if (!optimizer.is_none()) core->TakeClientState();
  if (client_scheduler) core->UseClientScheduler(lr_scheduler);
  RegisterUnitHooks(core, units);
  RegisterParameters(core, *shell);
  return py::make_tuple(py::cast(core), dataloader);
}

int GatherParameters(py::object params, bool gather, int modifier_rank) {
  // Each engine's own tensors, engines in creation order: every rank calls the same collectives.
  std::map<uint64_t, std::pair<std::shared_ptr<PyEngine>, std::vector<at::Tensor>>> by_engine;
  for (auto item : params) {
    if (!THPVariable_Check(item.ptr()))
      throw py::type_error("uckpt.zero.GatheredParameters: params holds a " + TypeName(item) + ", not a tensor");
    at::Tensor t = THPVariable_Unpack(item.ptr());
    auto it = g_engine_of.find(t.unsafeGetTensorImpl());
    if (it == g_engine_of.end()) continue;  // not a parameter of an engine: whole, nothing to do
    auto e = it->second.engine.lock();
    if (!e) continue;
    auto& entry = by_engine[it->second.order];
    entry.first = e;
    entry.second.push_back(t);
  }
  int partitioned = 0;
  for (auto& [order, entry] : by_engine) {
    auto& [e, tensors] = entry;
    if (e->settings().config.zero.stage != 3)
      continue;  // stages 0-2: parameters are whole, DeepSpeed's context does nothing
    partitioned += static_cast<int>(tensors.size());
    py::gil_scoped_release no_gil;
    if (gather) e->engine().GatherParameters(tensors);
    else e->engine().ReleaseParameters(tensors, modifier_rank);
  }
  return partitioned;
}

void BindInitialize(py::module_& m) {
  m.def("initialize", &Initialize, "model"_a = py::none(), "optimizer"_a = py::none(),
        "model_parameters"_a = py::none(), "training_data"_a = py::none(), "lr_scheduler"_a = py::none(),
        "mpu"_a = py::none(), "collate_fn"_a = py::none(), "config"_a = py::none(), "partitioned"_a = py::list(),
        "deepspeed.initialize's work: (the engine core, the dataloader or None)");
  m.def("gather_parameters", &GatherParameters, "params"_a, "gather"_a, "modifier_rank"_a = -1);
}

}  // namespace uckpt::python
