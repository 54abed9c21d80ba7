// initialize() and the engine's calls (see py_engine.h).
#include "py_engine.h"

#include <torch/csrc/autograd/python_variable.h>

#include <cstdlib>
#include <iostream>
#include <set>

#include "module_shell.h"
#include "py_values.h"
#include "uckpt/process_group.h"

namespace uckpt::python {

using namespace pybind11::literals;

namespace {

std::string TypeName(py::handle h) { return py::str(h.get_type().attr("__name__")).cast<std::string>(); }

// ZeRO stages the Python package drives. Stage 3 gathers each unit's
// parameters from forward hooks on the Python module (RegisterUnitHooks).
bool StageSupported(int stage) { return stage >= 0 && stage <= 3; }

// ---- Optimizer: DeepSpeed's client optimizer or model_parameters into the
// config's optimizer section and the engine's param groups. ----

struct GroupHparams {
  std::optional<double> lr, weight_decay, beta1, beta2, eps;
};

GroupHparams ReadGroup(py::handle g, const std::string& what) {
  GroupHparams h;
  auto d = g.cast<py::dict>();
  if (d.contains("lr")) h.lr = d["lr"].cast<double>();
  if (d.contains("weight_decay")) h.weight_decay = d["weight_decay"].cast<double>();
  if (d.contains("eps")) h.eps = d["eps"].cast<double>();
  if (d.contains("betas")) {
    auto b = d["betas"].cast<py::sequence>();
    if (py::len(b) != 2) throw py::value_error(what + ": betas must be two numbers");
    h.beta1 = b[0].cast<double>();
    h.beta2 = b[1].cast<double>();
  }
  if (d.contains("amsgrad") && d["amsgrad"].cast<bool>())
    throw py::value_error(what + ": amsgrad is not supported by uckpt's Adam");
  return h;
}

// The trainable tensors of one group (frozen ones stay out of the optimizer, as DeepSpeed filters them).
std::vector<at::Tensor> TrainableTensors(py::handle params, const std::string& what) {
  std::vector<at::Tensor> out;
  for (auto p : params) {
    if (!THPVariable_Check(p.ptr())) throw py::type_error(what + " holds a " + TypeName(p) + ", not a tensor");
    at::Tensor t = THPVariable_Unpack(p.ptr());
    if (t.requires_grad()) out.push_back(t);
  }
  return out;
}

struct OptimizerPlan {
  nlohmann::json section;  // the config's "optimizer", when the client gave one
  std::vector<ParamGroup> groups;
};

// Groups from a list of dicts ({"params": [...], hparams}) or of tensors (one group).
std::vector<ParamGroup> GroupsFrom(py::handle groups, const std::string& what, std::optional<double>& lr) {
  py::list items = py::list(py::iter(groups));
  std::vector<ParamGroup> out;
  if (items.empty()) return out;
  if (!py::isinstance<py::dict>(items[0])) {
    ParamGroup g;
    g.params = TrainableTensors(items, what);
    if (!g.params.empty()) out.push_back(std::move(g));
    return out;
  }
  for (size_t i = 0; i < items.size(); ++i) {
    const std::string gw = what + "[" + std::to_string(i) + "]";
    auto d = items[i].cast<py::dict>();
    if (!d.contains("params")) throw py::value_error(gw + " has no 'params'");
    GroupHparams h = ReadGroup(d, gw);
    if (h.lr) {
      if (lr && *lr != *h.lr)
        throw py::value_error(gw + ": lr " + std::to_string(*h.lr) + " differs from another group's " +
                              std::to_string(*lr) + "; uckpt's schedule sets one lr for every group");
      lr = h.lr;
    }
    ParamGroup g;
    g.params = TrainableTensors(d["params"], gw + "['params']");
    g.weight_decay = h.weight_decay;
    g.beta1 = h.beta1;
    g.beta2 = h.beta2;
    g.eps = h.eps;
    if (!g.params.empty()) out.push_back(std::move(g));
  }
  return out;
}

// Adam(W) in DeepSpeed's config terms for the client optimizer's class.
nlohmann::json ClientOptimizerSection(py::handle opt) {
  const std::string cls = TypeName(opt);
  py::module_ optim = py::module_::import("torch.optim");
  nlohmann::json params = nlohmann::json::object();
  std::string type;
  if (cls == "DeepSpeedCPUAdam" || cls == "FusedAdam") {  // uckpt's or DeepSpeed's: a mode flag says which
    const char* mode = cls == "FusedAdam" ? "adam_w_mode" : "adamw_mode";
    const bool decoupled = py::hasattr(opt, mode) ? opt.attr(mode).cast<bool>() : true;
    type = decoupled ? "AdamW" : "Adam";
    if (!decoupled) {  // torch.optim.Adam: torch_adam with adam_w_mode false (torch_adam alone is AdamW)
      params["torch_adam"] = true;
      params["adam_w_mode"] = false;
    }
  } else if (py::isinstance(opt, optim.attr("AdamW"))) {
    type = "AdamW";
  } else if (py::isinstance(opt, optim.attr("Adam"))) {
    type = "Adam";
    params["torch_adam"] = true;  // torch.optim.Adam: L2 weight decay (DeepSpeed needs adam_w_mode false too)
    params["adam_w_mode"] = false;
  } else {
    throw py::value_error("uckpt.initialize: optimizer " + cls +
                          " is not supported: uckpt's engine runs Adam and AdamW (torch.optim.Adam, torch.optim.AdamW, "
                          "uckpt.ops.adam.DeepSpeedCPUAdam, uckpt.ops.adam.FusedAdam, or a config 'optimizer' section)");
  }
  return {{"type", type}, {"params", params}};
}

OptimizerPlan PlanOptimizer(py::handle optimizer, py::handle model_parameters, const nlohmann::json& config) {
  OptimizerPlan plan;
  std::optional<double> lr;
  if (!optimizer.is_none()) {
    if (config.contains("optimizer"))
      throw py::value_error(
          "uckpt.initialize: both an optimizer object and a config 'optimizer' section were given; pass one");
    if (!py::hasattr(optimizer, "param_groups"))
      throw py::value_error("uckpt.initialize: optimizer must be an optimizer object with param_groups, got " +
                            TypeName(optimizer) + " (a callable that builds one is not supported)");
    plan.section = ClientOptimizerSection(optimizer);
    plan.groups = GroupsFrom(optimizer.attr("param_groups"), "optimizer.param_groups", lr);
    // The first group's hyper-parameters are the section's; the others override them.
    GroupHparams first = ReadGroup(py::list(optimizer.attr("param_groups"))[0], "optimizer.param_groups[0]");
    auto& p = plan.section["params"];
    if (lr) p["lr"] = *lr;
    if (first.beta1) p["betas"] = {*first.beta1, *first.beta2};
    if (first.eps) p["eps"] = *first.eps;
    if (first.weight_decay) p["weight_decay"] = *first.weight_decay;
    return plan;
  }
  if (!config.contains("optimizer"))
    throw py::value_error(
        "uckpt.initialize: no optimizer: pass optimizer= or give the config an 'optimizer' section (Adam or AdamW)");
  if (!model_parameters.is_none()) plan.groups = GroupsFrom(model_parameters, "model_parameters", lr);
  return plan;
}

// ---- Checks of what uckpt does not do. ----

void RefuseUnsupported(py::handle model, py::handle mpu, py::handle lr_scheduler, const nlohmann::json& config,
                       const std::string& source) {
  if (!mpu.is_none())
    throw py::value_error("uckpt.initialize: model parallelism (mpu=) is not supported by uckpt (data parallel only)");
  if (!lr_scheduler.is_none())
    throw py::value_error(
        "uckpt.initialize: a client lr_scheduler is not supported; use the config's 'scheduler' section (WarmupLR, "
        "WarmupDecayLR)");
  if (std::string what = FindUnsupportedModule(model); !what.empty()) throw py::value_error("uckpt.initialize: " + what);
  for (const char* key : {"pipeline", "moe", "tensor_parallel", "sequence_parallel_size"})
    if (config.contains(key))
      throw py::value_error(source + ": '" + key + "' is not supported by uckpt (data parallel ZeRO only)");
  if (config.contains("zero_optimization") && config["zero_optimization"].is_object()) {
    const auto& z = config["zero_optimization"];
    if (z.contains("stage") && z["stage"].is_number_integer() && !StageSupported(z["stage"].get<int>()))
      throw py::value_error(source + ": zero_optimization.stage " + std::to_string(z["stage"].get<int>()) +
                            " is not supported (0, 1, 2 or 3)");
  }
}

std::string PickDevice() {
  const char* acc = std::getenv("DS_ACCELERATOR");
  if (acc && std::string(acc) == "cpu") return "cpu";
  return py::module_::import("torch").attr("cuda").attr("is_available")().cast<bool>() ? "cuda" : "cpu";
}

// The engine's collectives on torch.distributed's default group: one
// rendezvous, one port, the same ranks.
std::shared_ptr<Comm> CommFromTorchDistributed(const std::string& device) {
  py::module_ dist = py::module_::import("torch.distributed");
  if (!dist.attr("is_initialized")().cast<bool>()) InitDistributed("", 30);
  if (dist.attr("get_world_size")().cast<int>() == 1) return MakeSingleProcessComm();
  py::object pg = dist.attr("distributed_c10d").attr("_get_default_group")();
  c10::intrusive_ptr<c10d::ProcessGroup> ptr;
  try {
    // Through the raw pointer: torch's Python holder type for process groups
    // differs between versions; the object itself is intrusive-refcounted.
    ptr = c10::intrusive_ptr<c10d::ProcessGroup>::reclaim_copy(pg.cast<c10d::ProcessGroup*>());
  } catch (const py::cast_error&) {
    throw std::runtime_error("uckpt: cannot use torch.distributed's process group (" + TypeName(pg) +
                             ") from C++: was uckpt built against the torch that Python imports?");
  }
  // NCCL's tensors live on this process's GPU: LOCAL_RANK's, as the engine places the module.
  const char* lr = std::getenv("LOCAL_RANK");
  const auto index = static_cast<c10::DeviceIndex>(lr && *lr ? std::atoi(lr) : 0);
  const at::Device d = device == "cuda" ? at::Device(at::kCUDA, index) : at::Device(at::kCPU);
  return CommOnProcessGroup(ptr, d);
}

py::object MakeDataLoader(py::handle data, const Engine& e, py::handle collate_fn) {
  py::module_ data_mod = py::module_::import("torch.utils.data");
  py::object sampler = py::module_::import("torch.utils.data.distributed")
                           .attr("DistributedSampler")(data, "num_replicas"_a = e.world_size(), "rank"_a = e.rank());
  py::dict kw("batch_size"_a = e.train_micro_batch_size_per_gpu(), "sampler"_a = sampler);
  if (!collate_fn.is_none()) kw["collate_fn"] = collate_fn;
  return data_mod.attr("DataLoader")(data, **kw);
}

// The first tensor in `values` (a tuple of forward arguments or an output)
// replaced by f(tensor); TypeError naming `what` when there is none.
template <typename F>
py::object WithFirstTensor(py::handle values, const std::string& what, F&& f) {
  if (THPVariable_Check(values.ptr())) return py::reinterpret_steal<py::object>(THPVariable_Wrap(f(THPVariable_Unpack(values.ptr()))));
  if (py::isinstance<py::tuple>(values) || py::isinstance<py::list>(values)) {
    py::list items = py::list(py::reinterpret_borrow<py::object>(values));
    for (size_t k = 0; k < items.size(); ++k)
      if (THPVariable_Check(items[k].ptr())) {
        items[k] = py::reinterpret_steal<py::object>(THPVariable_Wrap(f(THPVariable_Unpack(items[k].ptr()))));
        return py::isinstance<py::tuple>(values) ? py::object(py::tuple(items)) : py::object(items);
      }
  }
  throw py::type_error("uckpt ZeRO stage 3: " + what + " holds no tensor (a gather unit needs its input and output "
                       "hidden states as tensors)");
}

// Stage 3: unit i's parameters are gathered by a forward pre-hook and freed
// by a forward hook, through the engine's autograd identities (EnterUnit /
// ExitUnit), which gather and free them again in backward.
void RegisterUnitHooks(const std::shared_ptr<PyEngine>& engine, const std::vector<GatherUnit>& units) {
  std::weak_ptr<PyEngine> weak = engine;
  for (size_t i = 0; i < units.size(); ++i) {
    const std::string name = "gather unit " + std::to_string(i) + " (" + TypeName(units[i].module) + ")";
    units[i].module.attr("register_forward_pre_hook")(py::cpp_function([weak, i, name](py::object, py::tuple args) {
      auto e = weak.lock();
      if (!e) return py::object(py::none());
      return WithFirstTensor(args, name + "'s positional arguments", [&](const at::Tensor& x) {
        py::gil_scoped_release no_gil;
        return e->engine().EnterUnit(i, x);
      });
    }));
    units[i].module.attr("register_forward_hook")(py::cpp_function([weak, i, name](py::object, py::object, py::object out) {
      auto e = weak.lock();
      if (!e) return py::object(py::none());
      return WithFirstTensor(out, name + "'s output", [&](const at::Tensor& y) {
        py::gil_scoped_release no_gil;
        return e->engine().ExitUnit(i, y);
      });
    }));
  }
}

std::weak_ptr<PyEngine> g_last_engine;  // for uckpt.zero.GatheredParameters

py::object ResolveConfig(py::handle args, py::handle config) {
  if (!config.is_none()) return py::reinterpret_borrow<py::object>(config);
  for (const char* name : {"deepspeed_config", "deepscale_config"})
    if (!args.is_none() && py::hasattr(args, name) && !args.attr(name).is_none()) return args.attr(name);
  throw py::value_error(
      "uckpt.initialize: no config: pass config= (a dict or a JSON path) or args with --deepspeed_config");
}

}  // namespace

// ---- initialize / init_distributed / add_config_arguments ----

void InitDistributed(const std::string& dist_backend, int timeout_minutes) {
  py::module_ dist = py::module_::import("torch.distributed");
  if (dist.attr("is_initialized")().cast<bool>()) return;
  const std::string backend = !dist_backend.empty() ? dist_backend : (PickDevice() == "cuda" ? "nccl" : "gloo");
  py::object timeout = py::module_::import("datetime").attr("timedelta")("minutes"_a = timeout_minutes);
  const char* world = std::getenv("WORLD_SIZE");
  if (!world || std::string(world).empty() || std::string(world) == "1") {
    // One process, no launcher: a group of one on an in-memory store (no port).
    dist.attr("init_process_group")(backend, "store"_a = dist.attr("HashStore")(), "rank"_a = 0, "world_size"_a = 1,
                                    "timeout"_a = timeout);
    return;
  }
  for (const char* v : {"RANK", "MASTER_ADDR", "MASTER_PORT"})
    if (!std::getenv(v))
      throw std::runtime_error(std::string("uckpt.init_distributed: WORLD_SIZE is set but ") + v +
                               " is not; start the script with `uckpt launch`, torchrun or deepspeed's launcher");
  dist.attr("init_process_group")(backend, "init_method"_a = "env://", "timeout"_a = timeout);
}

py::object AddConfigArguments(py::object parser) {
  py::object group = parser.attr("add_argument_group")("DeepSpeed", "DeepSpeed configurations");
  group.attr("add_argument")("--deepspeed", "default"_a = false, "action"_a = "store_true",
                             "help"_a = "Enable DeepSpeed (uckpt)");
  group.attr("add_argument")("--deepspeed_config", "default"_a = py::none(), "type"_a = py::str().get_type(),
                             "help"_a = "DeepSpeed json configuration file.");
  group.attr("add_argument")("--deepscale", "default"_a = false, "action"_a = "store_true",
                             "help"_a = "Deprecated: --deepspeed");
  group.attr("add_argument")("--deepscale_config", "default"_a = py::none(), "type"_a = py::str().get_type(),
                             "help"_a = "Deprecated: --deepspeed_config");
  return parser;
}

py::tuple Initialize(py::object args, py::object model, py::object optimizer, py::object model_parameters,
                     py::object training_data, py::object lr_scheduler, py::object mpu, py::object collate_fn,
                     py::object config) {
  if (model.is_none()) throw py::value_error("uckpt.initialize: model is required");
  std::string source;
  nlohmann::json json = ConfigToJson(ResolveConfig(args, config), source);
  RefuseUnsupported(model, mpu, lr_scheduler, json, source);
  OptimizerPlan plan = PlanOptimizer(optimizer, model_parameters, json);
  if (!plan.section.is_null()) json["optimizer"] = plan.section;

  EngineSettings settings;
  if (json.contains("checkpoint") && json["checkpoint"].is_object() && json["checkpoint"].contains("load_universal"))
    settings.load_universal = json["checkpoint"]["load_universal"].get<bool>();
  settings.has_scheduler = json.contains("scheduler");

  EngineOptions options;
  options.device = PickDevice();
  options.comm = CommFromTorchDistributed(options.device);
  options.param_groups = std::move(plan.groups);
  auto shell = BuildModuleShell(model);
  std::vector<GatherUnit> units;
  if (json.contains("zero_optimization") && json["zero_optimization"].value("stage", 0) == 3) {
    units = FindGatherUnits(model, shell);
    for (const auto& u : units) options.gather_units.push_back(u.shell);
  }
  std::unique_ptr<Engine> engine;
  {
    py::gil_scoped_release no_gil;
    engine = std::make_unique<Engine>(shell, Config::FromJson(json, source), std::move(options));
  }
  settings.zero_stage = engine->zero_stage();
  if (engine->rank() == 0)
    for (const auto& w : engine->warnings()) std::cerr << "uckpt: " << w << "\n";
  const Engine& e = *engine;
  py::object dataloader = training_data.is_none() ? py::none() : MakeDataLoader(training_data, e, collate_fn);
  auto py_engine = std::make_shared<PyEngine>(model, shell, std::move(engine), settings);
  RegisterUnitHooks(py_engine, units);
  g_last_engine = py_engine;
  py::object engine_obj = py::cast(py_engine);
  return py::make_tuple(engine_obj, engine_obj.attr("optimizer"), dataloader, engine_obj.attr("lr_scheduler"));
}

void GatherParameters(bool gather) {
  auto e = g_last_engine.lock();
  if (!e) return;  // no engine: every tensor is whole
  py::gil_scoped_release no_gil;
  if (gather)
    e->engine().GatherParameters();
  else
    e->engine().ReleaseParameters();
}

// ---- The engine's calls. ----

PyEngine::PyEngine(py::object module, std::shared_ptr<torch::nn::Module> shell, std::unique_ptr<Engine> engine,
                   EngineSettings settings)
    : module_(std::move(module)), shell_(std::move(shell)), engine_(std::move(engine)), settings_(settings) {}

py::object PyEngine::Call(py::args args, py::kwargs kwargs) { return module_(*args, **kwargs); }

py::object PyEngine::Backward(py::object loss) {
  if (!THPVariable_Check(loss.ptr())) throw py::type_error("engine.backward: loss must be a tensor, got " + TypeName(loss));
  at::Tensor t = THPVariable_Unpack(loss.ptr());
  py::gil_scoped_release no_gil;  // autograd may run Python functions on its own threads
  engine_->Backward(t);
  return loss;
}

void PyEngine::Step() {
  py::gil_scoped_release no_gil;
  engine_->Step();
}

bool PyEngine::SaveCheckpoint(py::object save_dir, py::object tag, py::object client_state, bool save_latest) {
  if (!save_latest) throw py::value_error("engine.save_checkpoint: save_latest=False is not supported (latest is always written)");
  const std::string dir = FsPath(save_dir, "save_checkpoint: save_dir");
  ClientState cs = client_state.is_none() ? c10::IValue() : ToIValue(client_state, "client_state");
  if (!cs.isNone() && cs.isGenericDict() && cs.toGenericDict().empty()) cs = c10::IValue();
  const std::string t = tag.is_none() ? "" : py::str(tag).cast<std::string>();
  py::gil_scoped_release no_gil;
  engine_->SaveCheckpoint(dir, t, cs);
  return true;
}

py::tuple PyEngine::LoadCheckpoint(py::object load_dir, py::object tag, bool load_optimizer_states,
                                   bool load_lr_scheduler_states, bool load_module_only) {
  const std::string dir = FsPath(load_dir, "load_checkpoint: load_dir");
  LoadCheckpointOptions o;
  o.load_optimizer_states = load_optimizer_states;
  o.load_lr_scheduler_states = load_lr_scheduler_states;
  o.load_module_only = load_module_only;
  o.universal = settings_.load_universal;
  const std::string t = tag.is_none() ? "" : py::str(tag).cast<std::string>();
  LoadResult r;
  {
    py::gil_scoped_release no_gil;
    r = engine_->LoadCheckpoint(dir, t, o);
  }
  if (r.path.empty()) return py::make_tuple(py::none(), py::none());  // DeepSpeed's answer when nothing was found
  py::object cs = r.client_state.isNone() ? py::dict() : FromIValue(r.client_state);
  return py::make_tuple(py::str(r.path), cs);
}

void PyEngine::Train(bool mode) {
  module_.attr("train")(mode);
  engine_->Train(mode);
}

py::list PyEngine::GetLr() const {
  py::list out;
  const size_t groups = engine_->param_groups().size();
  for (size_t g = 0; g < groups; ++g) out.append(engine_->lr());
  return out;
}

py::object PyEngine::GlobalGradNorm() const {
  if (engine_->global_steps() == 0) return py::none();
  return py::float_(engine_->last_step().grad_norm);
}

py::dict PyEngine::SchedulerState() const {
  // DeepSpeed's schedulers count updates from -1 (before the first step).
  return py::dict("last_batch_iteration"_a = engine_->global_steps() - engine_->skipped_steps() - 1);
}

}  // namespace uckpt::python
