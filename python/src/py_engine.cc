// initialize() and the engine's calls (see py_engine.h).
#include "py_engine.h"

#include <pybind11/eval.h>
#include <torch/csrc/autograd/python_variable.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <map>
#include <set>

#include "engine/host_threads.h"
#include "module_shell.h"
#include "py_values.h"
#include "script_api.h"
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

struct GroupOptionals {
  std::optional<double> lr, weight_decay, beta1, beta2, eps;
};

// A number (a float, an int or a 0-d tensor, as torch schedulers may write).
double Number(py::handle v, const std::string& what) {
  try {
    return py::float_(py::reinterpret_borrow<py::object>(v)).cast<double>();
  } catch (const py::error_already_set&) {
    throw py::type_error(what + " must be a number, got " + TypeName(v));
  }
}

// `adam`: the group is the engine's Adam's (amsgrad is refused there; a
// client's other optimizer steps with every key of its groups).
GroupOptionals ReadGroup(py::handle g, const std::string& what, bool adam = true) {
  GroupOptionals h;
  auto d = g.cast<py::dict>();
  if (d.contains("lr")) h.lr = Number(d["lr"], what + "['lr']");
  if (d.contains("weight_decay")) h.weight_decay = Number(d["weight_decay"], what + "['weight_decay']");
  if (d.contains("eps")) h.eps = Number(d["eps"], what + "['eps']");
  if (d.contains("betas")) {
    auto b = d["betas"].cast<py::sequence>();
    if (py::len(b) != 2) throw py::value_error(what + ": betas must be two numbers");
    h.beta1 = Number(b[0], what + "['betas'][0]");
    h.beta2 = Number(b[1], what + "['betas'][1]");
  }
  if (adam && d.contains("amsgrad") && d["amsgrad"].cast<bool>())
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
  // The client's optimizer is no Adam the engine runs natively: it steps
  // the partitions itself (uckpt._partition_step), without a section.
  bool client_step = false;
  std::vector<ParamGroup> groups;
  std::vector<int> engine_group_of;  // per client param group: its engine group, -1 if nothing trainable
  std::string warning;               // for rank 0 to print
  bool has_optimizer = true;         // false: neither a client optimizer nor a config section
};

// Groups from a list of dicts ({"params": [...], hparams}) or of tensors (one
// group); engine_group_of[i]: item i's group in the result (-1: none trainable).
std::vector<ParamGroup> GroupsFrom(py::handle groups, const std::string& what, std::vector<int>& engine_group_of,
                                   bool adam = true) {
  py::list items = py::list(py::iter(groups));
  std::vector<ParamGroup> out;
  engine_group_of.clear();
  if (items.empty()) return out;
  if (!py::isinstance<py::dict>(items[0])) {
    ParamGroup g;
    g.params = TrainableTensors(items, what);
    engine_group_of.push_back(g.params.empty() ? -1 : 0);
    if (!g.params.empty()) out.push_back(std::move(g));
    return out;
  }
  for (size_t i = 0; i < items.size(); ++i) {
    const std::string gw = what + "[" + std::to_string(i) + "]";
    auto d = items[i].cast<py::dict>();
    if (!d.contains("params")) throw py::value_error(gw + " has no 'params'");
    GroupOptionals h = ReadGroup(d, gw, adam);
    ParamGroup g;
    g.params = TrainableTensors(d["params"], gw + "['params']");
    engine_group_of.push_back(g.params.empty() ? -1 : static_cast<int>(out.size()));
    g.lr = h.lr;
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
    return nullptr;  // any other optimizer steps the partitions itself
  }
  return {{"type", type}, {"params", params}};
}

// Whether torch's Adam/AdamW `opt` needs its own step: amsgrad, which the engine's Adam does not run.
bool AdamWithAmsgrad(py::handle opt) {
  for (auto g : opt.attr("param_groups"))
    if (g.cast<py::dict>().contains("amsgrad") && g["amsgrad"].cast<bool>()) return true;
  return false;
}

OptimizerPlan PlanOptimizer(py::handle optimizer, py::handle model_parameters, const nlohmann::json& config) {
  OptimizerPlan plan;
  if (!optimizer.is_none()) {
    if (!py::hasattr(optimizer, "param_groups"))
      throw py::value_error("uckpt.initialize: optimizer must be an optimizer object with param_groups, got " +
                            TypeName(optimizer) + " (a callable that builds one is not supported)");
    if (py::len(optimizer.attr("param_groups")) == 0)
      throw py::value_error("uckpt.initialize: optimizer " + TypeName(optimizer) + " has no param groups");
    if (py::object why = py::module_::import("uckpt._partition_step").attr("refusal")(optimizer); !why.is_none())
      throw py::value_error(why.cast<std::string>());
    plan.section = AdamWithAmsgrad(optimizer) ? nlohmann::json(nullptr) : ClientOptimizerSection(optimizer);
    plan.client_step = plan.section.is_null();
    if (config.contains("optimizer"))  // DeepSpeed uses the client's and says so in its log
      plan.warning = "the config's 'optimizer' section is not used: the optimizer passed to initialize (" +
                     TypeName(optimizer) + ") is, as DeepSpeed does";
    plan.groups = GroupsFrom(optimizer.attr("param_groups"), "optimizer.param_groups", plan.engine_group_of,
                             !plan.client_step);
    if (plan.client_step) return plan;
    // The first group's hyper-parameters are the section's; each group keeps its own.
    GroupOptionals first = ReadGroup(py::list(optimizer.attr("param_groups"))[0], "optimizer.param_groups[0]");
    auto& p = plan.section["params"];
    if (first.lr) p["lr"] = *first.lr;
    if (first.beta1) p["betas"] = {*first.beta1, *first.beta2};
    if (first.eps) p["eps"] = *first.eps;
    if (first.weight_decay) p["weight_decay"] = *first.weight_decay;
    return plan;
  }
  // Neither: DeepSpeed's engine without an optimizer (forward, save/load of the module).
  plan.has_optimizer = config.contains("optimizer");
  std::vector<int> unused;
  if (!model_parameters.is_none()) plan.groups = GroupsFrom(model_parameters, "model_parameters", unused);
  return plan;
}

// Python objects the engine keeps, released with the GIL held: the engine may
// end on a thread without it.
template <class T>
std::shared_ptr<T> HeldWithGil(T value) {
  return std::shared_ptr<T>(new T(std::move(value)), [](T* p) {
    py::gil_scoped_acquire gil;
    delete p;
  });
}

// The engine's optimizer step for a client's element-wise optimizer:
// uckpt._partition_step.PartitionStepper over it, given each partition's
// master, gradient, group, lr and state, returning the new state.
OptimizerStepFn ClientOptimizerStep(py::handle optimizer, const std::vector<int>& engine_group_of) {
  auto held = HeldWithGil(py::module_::import("uckpt._partition_step").attr("PartitionStepper")(optimizer, engine_group_of));
  return [held](std::vector<OptimizerPartition>& parts) {
    py::gil_scoped_acquire gil;
    py::list items;
    for (const OptimizerPartition& p : parts) {
      py::dict state;
      for (const auto& [key, t] : *p.state) state[py::str(key)] = py::cast(t);
      items.append(py::make_tuple(py::cast(p.master), py::cast(p.grad), p.group, p.lr, state));
    }
    py::list states = held->attr("step")(items);
    for (size_t i = 0; i < parts.size(); ++i) {
      std::vector<std::pair<std::string, at::Tensor>> named;
      for (auto kv : states[i]) {
        auto pair = kv.cast<py::tuple>();
        // None: torch's "no state" (SGD's momentum_buffer without momentum), kept as an undefined tensor.
        named.emplace_back(pair[0].cast<std::string>(),
                           pair[1].is_none() ? at::Tensor() : THPVariable_Unpack(pair[1].ptr()));
      }
      *parts[i].state = std::move(named);
    }
  };
}

// Engine group g's param-group dict of the client's optimizer, without its
// params (what torch's state_dict saves of it).
std::function<c10::IValue(size_t)> ClientParamGroup(py::handle optimizer, const std::vector<int>& engine_group_of) {
  py::list dicts = optimizer.attr("param_groups");
  auto held = HeldWithGil(std::vector<py::object>());
  for (size_t i = 0; i < dicts.size() && i < engine_group_of.size(); ++i)
    if (engine_group_of[i] >= 0) {
      if (held->size() <= static_cast<size_t>(engine_group_of[i])) held->resize(engine_group_of[i] + 1);
      (*held)[engine_group_of[i]] = dicts[i];
    }
  return [held](size_t g) -> c10::IValue {
    py::gil_scoped_acquire gil;
    py::dict entries;
    for (auto [k, v] : held->at(g).cast<py::dict>())
      if (py::str(k).cast<std::string>() != "params") entries[k] = v;
    return ToIValue(entries, "optimizer.param_groups");
  };
}

// ---- Checks of what uckpt does not do. ----

// Whether the config's `key` section ("fp16", "bf16" or its alias "bfloat16") is enabled.
bool SectionEnabled(const nlohmann::json& config, const char* key) {
  return config.contains(key) && config[key].is_object() && config[key].value("enabled", false) == true;
}

// A client element-wise optimizer at ZeRO stage 0 runs in fp32 only: in
// fp16/bf16 DeepSpeed wraps it in FP16_UnfusedOptimizer / BF16_Optimizer,
// whose steps and checkpoint files uckpt does not reproduce. Nor does uckpt
// number frozen parameters among the optimizer's state ids, as the torch
// optimizer's own state_dict (DeepSpeed's stage-0 file) does.
void RefuseStage0Unsupported(py::handle optimizer, const nlohmann::json& config) {
  const bool stage0 = !(config.contains("zero_optimization") && config["zero_optimization"].is_object() &&
                        config["zero_optimization"].value("stage", 0) > 0);
  if (!stage0) return;
  size_t frozen = 0;
  for (auto g : optimizer.attr("param_groups"))
    for (auto p : g["params"]) frozen += !p.attr("requires_grad").cast<bool>();
  if (frozen > 0)
    throw py::value_error("uckpt.initialize: optimizer " + TypeName(optimizer) + " at ZeRO stage 0 holds " +
                          std::to_string(frozen) + " frozen parameter(s) (requires_grad=False) in its param groups, "
                          "which DeepSpeed's stage-0 checkpoint numbers among the optimizer's state ids and uckpt "
                          "does not; build it on the trainable parameters only (p for p in model.parameters() if "
                          "p.requires_grad), or use ZeRO stage 1-3");
  const bool bf16 = SectionEnabled(config, "bf16") || SectionEnabled(config, "bfloat16");
  if (!bf16 && !SectionEnabled(config, "fp16")) return;
  throw py::value_error("uckpt.initialize: optimizer " + TypeName(optimizer) + " at ZeRO stage 0 in " +
                        (bf16 ? "bf16" : "fp16") + " is not supported by uckpt (DeepSpeed wraps it in its " +
                        (bf16 ? "BF16_Optimizer" : "FP16_UnfusedOptimizer") + "; uckpt runs it at stage 0 in fp32, "
                        "and in fp16/bf16 at stages 1-3)");
}

void RefuseUnsupported(py::handle model, py::handle mpu, const nlohmann::json& config, const std::string& source) {
  if (!mpu.is_none())
    throw py::value_error("uckpt.initialize: model parallelism (mpu=) is not supported by uckpt (data parallel only)");
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

// An engine's comm on torch.distributed's group, which Python owns: the
// engine would keep the group (its threads and its sockets to the other
// ranks) alive past the script's or the exit's destroy_process_group, into
// interpreter finalization (an engine lives to the end: its module's hooks
// hold it). Release() drops the engine's share at exit
// (ReleaseTorchDistributedGroups); a collective after it is a CommError.
class TorchGroupComm : public Comm {
 public:
  explicit TorchGroupComm(std::unique_ptr<Comm> group)
      : group_(std::move(group)), rank_(group_->rank()), world_(group_->world_size()), backend_(group_->backend()) {}
  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  std::string backend() const override { return backend_; }
  void AllReduceSum(at::Tensor& t) override { Group().AllReduceSum(t); }
  void AllReduceMax(at::Tensor& t) override { Group().AllReduceMax(t); }
  void ReduceScatterSum(at::Tensor& in, at::Tensor& out) override { Group().ReduceScatterSum(in, out); }
  void AllGather(const at::Tensor& in, at::Tensor& out) override { Group().AllGather(in, out); }
  void Broadcast(at::Tensor& t, int root) override { Group().Broadcast(t, root); }
  void Barrier() override { Group().Barrier(); }
  std::unique_ptr<Pending> StartAllReduceSum(at::Tensor& t) override { return Group().StartAllReduceSum(t); }
  std::unique_ptr<Pending> StartReduceScatterSum(at::Tensor& in, at::Tensor& out) override {
    return Group().StartReduceScatterSum(in, out);
  }
  std::unique_ptr<Pending> StartAllGather(const at::Tensor& in, at::Tensor& out) override {
    return Group().StartAllGather(in, out);
  }
  void Release() { group_.reset(); }

 private:
  Comm& Group() {
    if (!group_)
      throw CommError("uckpt: rank " + std::to_string(rank_) + ": a collective after the interpreter's exit began "
                      "(uckpt ended its use of torch.distributed's process group then)");
    return *group_;
  }
  std::unique_ptr<Comm> group_;
  int rank_, world_;
  std::string backend_;
};

// The live engines' comms on torch.distributed's group (kept for the process).
std::vector<std::weak_ptr<TorchGroupComm>>& TorchGroupComms() {
  static auto* comms = new std::vector<std::weak_ptr<TorchGroupComm>>();
  return *comms;
}

// The engine's collectives on torch.distributed's default group: one
// rendezvous, one port, the same ranks.
std::shared_ptr<Comm> CommFromTorchDistributed(const std::string& device) {
  py::module_ dist = py::module_::import("torch.distributed");
  if (!dist.attr("is_initialized")().cast<bool>())
    InitDistributed(py::none(), true, 29500, true, py::none(), py::none(), py::none(), py::none(), -1, -1);
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
  auto comm = std::make_shared<TorchGroupComm>(CommOnProcessGroup(ptr, d));
  TorchGroupComms().push_back(comm);
  py::module_::import("uckpt.comm").attr("_release_engines_at_exit")();
  return comm;
}

py::object MakeDataLoader(py::handle data, const Engine& e, py::handle collate_fn, bool drop_last) {
  py::module_ data_mod = py::module_::import("torch.utils.data");
  py::object sampler = py::module_::import("torch.utils.data.distributed")
                           .attr("DistributedSampler")(data, "num_replicas"_a = e.world_size(), "rank"_a = e.rank());
  // The config's dataloader_drop_last, as DeepSpeed's loader passes it on.
  py::dict kw("batch_size"_a = e.train_micro_batch_size_per_gpu(), "sampler"_a = sampler, "drop_last"_a = drop_last);
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
    units[i].module.attr("register_forward_hook")(py::cpp_function([exit, hooked](py::object, py::object, py::object out) {
      --*hooked;
      return exit(out);
    }));
    py::object forward = units[i].module.attr("forward");  // the bound method
    units[i].module.attr("forward") = py::cpp_function([enter, exit, hooked, forward, weak](py::args args, py::kwargs kwargs) {
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
  py::object device = torch.attr("device")(e.device().str());
  py::object dtype = py::none();
  if (e.fp16_enabled()) dtype = torch.attr("float16");
  if (e.bf16_enabled()) dtype = torch.attr("bfloat16");
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
  throw py::value_error("uckpt.initialize: without an optimizer uckpt still needs a module with a parameter that "
                        "requires grad (uckpt's engine does not wrap a fully frozen module; run it as a plain "
                        "torch module)");
}

// zero.Init's (param, ds_shape, ds_tensor) triples (uckpt.zero's
// zero_init_partitions), for the engine to take as partitions; refused unless
// the config's stage is 3, as initialize must not read their freed values.
std::vector<PartitionedParameter> ZeroInitPartitions(py::list partitioned, const nlohmann::json& config) {
  std::vector<PartitionedParameter> out;
  if (partitioned.empty()) return out;
  int stage = 0;
  if (config.contains("zero_optimization") && config["zero_optimization"].is_object())
    stage = config["zero_optimization"].value("stage", 0);
  if (stage != 3)
    throw py::value_error("uckpt.initialize: the model was built under deepspeed.zero.Init (" +
                          std::to_string(partitioned.size()) + " parameters are partitioned across the ranks), which "
                          "needs zero_optimization.stage 3; the config has stage " + std::to_string(stage) +
                          " (build the model without zero.Init for stages 0-2)");
  for (auto item : partitioned) {
    auto t = item.cast<py::tuple>();
    out.push_back({THPVariable_Unpack(t[0].ptr()), t[1].cast<std::vector<int64_t>>(), THPVariable_Unpack(t[2].ptr())});
  }
  return out;
}

}  // namespace

py::object ResolveConfig(py::handle args, py::handle config) {
  auto from = [&](const char* name) -> py::object {
    return !args.is_none() && py::hasattr(args, name) ? py::object(args.attr(name)) : py::object(py::none());
  };
  py::object given = from("deepspeed_config");
  // As DeepSpeed's initialize: the deprecated name moves to the new one, and a config from two places is refused.
  if (py::object deprecated = from("deepscale_config"); !deprecated.is_none()) {
    std::cerr << "uckpt: warning: --deepscale_config is deprecated, please use --deepspeed_config\n";
    if (!given.is_none())
      throw py::value_error("uckpt.initialize: args has both deepscale_config and deepspeed_config; pass one "
                            "(DeepSpeed 0.14.5 refuses both too)");
    args.attr("deepspeed_config") = deprecated;
    args.attr("deepscale_config") = py::none();
    given = deprecated;
  }
  if (!given.is_none() && !config.is_none())
    throw py::value_error("uckpt.initialize: a config was given both as config= and as args.deepspeed_config; pass "
                          "one (DeepSpeed 0.14.5 refuses both too)");
  if (!config.is_none()) return py::reinterpret_borrow<py::object>(config);
  if (!given.is_none()) return given;
  throw py::value_error(
      "uckpt.initialize: no config: pass config= (a dict or a JSON path) or args with --deepspeed_config");
}

// ---- initialize / init_distributed / add_config_arguments ----

namespace {

// DeepSpeed's default_pg_timeout: DEEPSPEED_TIMEOUT minutes, else 30.
py::object DefaultTimeout() {
  const char* v = std::getenv("DEEPSPEED_TIMEOUT");
  const int minutes = v && *v ? std::atoi(v) : 30;
  return py::module_::import("datetime").attr("timedelta")("minutes"_a = minutes);
}

// configure(deepspeed_config=config) reads its comms_config (the comms
// logger); uckpt logs no collectives.
void CheckCommsConfig(py::handle config) {
  if (config.is_none()) return;
  if (!py::hasattr(config, "comms_config"))
    throw py::type_error("uckpt.init_distributed: config must be a DeepSpeedConfig (DeepSpeed 0.14.5 reads its "
                         "comms_config), got " + TypeName(config));
  py::object comms = config.attr("comms_config");
  if (py::hasattr(comms, "enabled") && comms.attr("enabled").cast<bool>())
    std::cerr << "uckpt: warning: init_distributed: the comms logger (comms_config) is not supported; collectives "
                 "are not logged\n";
}

// What deepspeed.init_distributed's MPI discovery exports: the world as
// RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT.
void ExportWorld(py::object environ, const DistEnv& env, bool overwrite) {
  const std::pair<const char*, std::string> vars[] = {
      {"RANK", std::to_string(env.rank)},        {"WORLD_SIZE", std::to_string(env.world_size)},
      {"LOCAL_RANK", std::to_string(env.local_rank)}, {"MASTER_ADDR", env.master_addr},
      {"MASTER_PORT", std::to_string(env.master_port)}};
  for (const auto& [k, v] : vars)
    if (overwrite || !environ.contains(k)) environ[py::str(k)] = v;
}

// deepspeed.init_distributed's discovery, when the launcher's variables are
// not all there: an MPI or Slurm launcher's world (DistEnv), or a world of one.
void DiscoverWorld(int distributed_port, bool verbose) {
  py::object environ = py::module_::import("os").attr("environ");
  bool all = true;
  for (const char* v : {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"}) all &= environ.contains(v);
  if (all) return;
  std::optional<DistEnv> env;
  try {
    env = DistEnv::FromEnvironment(true, distributed_port);
  } catch (const std::invalid_argument& e) {
    throw py::value_error(std::string("uckpt.init_distributed: ") + e.what());
  }
  if (env && !env->discovered()) return;  // torchrun-style variables: torch reads them
  if (!env) {
    // No launcher: a world of one, as mpi4py reports outside mpirun.
    DistEnv one;
    one.master_port = distributed_port;
    ExportWorld(environ, one, /*overwrite=*/false);
    return;
  }
  ExportWorld(environ, *env, /*overwrite=*/true);
  if (verbose)
    std::cerr << "uckpt: init_distributed: discovered " << env->launcher << " settings of world_rank=" << env->rank
              << ", local_rank=" << env->local_rank << ", world_size=" << env->world_size
              << ", master_addr=" << env->master_addr << ", master_port=" << env->master_port << "\n";
}

}  // namespace

void ReleaseTorchDistributedGroups() {
  std::vector<std::shared_ptr<TorchGroupComm>> live;
  for (auto& weak : TorchGroupComms())
    if (auto comm = weak.lock()) live.push_back(std::move(comm));
  TorchGroupComms().clear();
  // The last reference ends the group: its threads are joined, and one may need the GIL to free a tensor.
  py::gil_scoped_release no_gil;
  for (auto& comm : live) comm->Release();
}

void InitDistributed(py::object dist_backend, bool auto_mpi_discovery, int distributed_port, bool verbose,
                     py::object timeout, py::object init_method, py::object dist_init_required, py::object config,
                     int rank, int world_size) {
  py::module_ dist = py::module_::import("torch.distributed");
  CheckCommsConfig(config);
  const bool initialized = dist.attr("is_initialized")().cast<bool>();
  const bool required = dist_init_required.is_none() ? !initialized : dist_init_required.cast<bool>();
  if (!required && !initialized)
    throw py::value_error("uckpt.init_distributed: dist_init_required=False but torch.distributed is not initialized; "
                          "pass dist_init_required=True or initialize it before calling uckpt.initialize()");
  py::module_::import("uckpt.comm").attr("_end_cleanly_at_exit")();
  if (initialized) return;  // the script's own group (or an earlier call's)
  if (timeout.is_none()) timeout = DefaultTimeout();
  if (!py::isinstance(timeout, py::module_::import("datetime").attr("timedelta")))
    throw py::type_error("uckpt.init_distributed: timeout must be a datetime.timedelta, got " + TypeName(timeout));
  if (auto_mpi_discovery) DiscoverWorld(distributed_port, verbose);
  const std::string backend = !dist_backend.is_none() ? dist_backend.cast<std::string>()
                                                       : (PickDevice() == "cuda" ? "nccl" : "gloo");
  py::object environ = py::module_::import("os").attr("environ");
  const int world = world_size != -1 ? world_size
                    : environ.contains("WORLD_SIZE") ? py::int_(environ["WORLD_SIZE"]).cast<int>()
                                                       : -1;
  if (init_method.is_none() && world == 1 && rank <= 0) {
    // One process: a group of one on an in-memory store (no port to collide on).
    dist.attr("init_process_group")(backend, "store"_a = dist.attr("HashStore")(), "rank"_a = 0, "world_size"_a = 1,
                                    "timeout"_a = timeout);
    return;
  }
  // DeepSpeed's TorchBackend: init_method, rank and world_size as given (env:// by default).
  dist.attr("init_process_group")(backend, "timeout"_a = timeout, "init_method"_a = init_method, "rank"_a = rank,
                                  "world_size"_a = world_size);
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

py::tuple Initialize(py::object model, py::object optimizer, py::object model_parameters,
                     py::object training_data, py::object lr_scheduler, py::object mpu, py::object collate_fn,
                     py::object config, py::list partitioned) {
  if (model.is_none()) throw py::value_error("uckpt.initialize: model is required");
  std::string source;
  nlohmann::json json = ConfigToJson(config, source);
  RefuseUnsupported(model, mpu, json, source);
  // As DeepSpeed: model_parameters as a list (a generator is read once), and a
  // client optimizer that is not an optimizer object is a callable building one from them.
  if (!model_parameters.is_none()) model_parameters = py::list(model_parameters);
  if (!optimizer.is_none() && !py::hasattr(optimizer, "param_groups") && PyCallable_Check(optimizer.ptr()))
    optimizer = optimizer(model_parameters.is_none() ? py::object(py::list(model.attr("parameters")())) : model_parameters);
  OptimizerPlan plan = PlanOptimizer(optimizer, model_parameters, json);
  if (!plan.section.is_null()) json["optimizer"] = plan.section;
  if (plan.client_step) json.erase("optimizer");  // the client's optimizer steps; the section is not used
  std::vector<std::string> notes;
  // The scheduler: the client's (an object, or a callable of the optimizer)
  // over the config's, and none without an optimizer (DeepSpeed configures it
  // only with one).
  const bool client_scheduler = plan.has_optimizer && PyObject_IsTrue(lr_scheduler.ptr()) == 1;
  if (json.contains("scheduler") && (client_scheduler || !plan.has_optimizer)) {
    notes.push_back(std::string("the config's 'scheduler' section is not used: ") +
                    (client_scheduler ? "the lr_scheduler passed to initialize is, as DeepSpeed does"
                                      : "there is no optimizer, and DeepSpeed builds no scheduler without one"));
    json.erase("scheduler");
  }
  if (!plan.has_optimizer && !lr_scheduler.is_none())
    notes.push_back("lr_scheduler is not used: there is no optimizer (DeepSpeed ignores it then too)");

  EngineSettings settings;
  if (json.contains("checkpoint") && json["checkpoint"].is_object() && json["checkpoint"].contains("load_universal"))
    settings.load_universal = json["checkpoint"]["load_universal"].get<bool>();
  settings.has_scheduler = json.contains("scheduler");
  settings.config = json;
  if (!optimizer.is_none()) settings.client_optimizer = TypeName(optimizer);
  settings.has_optimizer = plan.has_optimizer;
  if (settings.has_scheduler && json["scheduler"].is_object() && json["scheduler"].contains("type") &&
      json["scheduler"]["type"].is_string()) {
    const auto& sc = json["scheduler"];
    settings.scheduler_type = sc["type"].get<std::string>();
    settings.scheduler_sets_betas = settings.scheduler_type == "OneCycle" &&
                                    !(sc.contains("params") && sc["params"].is_object() &&
                                      sc["params"].contains("cycle_momentum") && sc["params"]["cycle_momentum"] == false);
  }
  if (!plan.has_optimizer) RefuseFrozenWithoutOptimizer(model);

  EngineOptions options;
  options.device = PickDevice();
  options.comm = CommFromTorchDistributed(options.device);
  CheckZeroOptimizer(optimizer, json, options.comm->rank() == 0);
  // The program's torch.set_num_threads, else OMP_NUM_THREADS, else this rank's share of the host.
  engine::ApplyHostThreads(0, "", "set OMP_NUM_THREADS or call torch.set_num_threads before initialize to change",
                           options.comm->rank() == 0);
  options.param_groups = std::move(plan.groups);
  if (plan.client_step) {
    RefuseStage0Unsupported(optimizer, json);
    options.optimizer_step = ClientOptimizerStep(optimizer, plan.engine_group_of);
    options.optimizer_param_group = ClientParamGroup(optimizer, plan.engine_group_of);
  }
  settings.client_step = plan.client_step;
  auto shell = BuildModuleShell(model);
  std::vector<GatherUnit> units;
  if (json.contains("zero_optimization") && json["zero_optimization"].value("stage", 0) == 3) {
    units = FindGatherUnits(model, shell);
    for (const auto& u : units) options.gather_units.push_back(u.shell);
  }
  options.partitioned = ZeroInitPartitions(partitioned, json);
  std::unique_ptr<Engine> engine;
  {
    py::gil_scoped_release no_gil;
    engine = std::make_unique<Engine>(shell, Config::FromJson(json, source), std::move(options));
  }
  settings.zero_stage = engine->zero_stage();
  MoveNonPersistentBuffers(model, *engine);
  if (engine->rank() == 0) {
    for (const auto& w : engine->warnings()) std::cerr << "uckpt: " << w << "\n";
    if (!plan.warning.empty()) std::cerr << "uckpt: " << plan.warning << "\n";
    for (const auto& n : notes) std::cerr << "uckpt: " << n << "\n";
  }
  const Engine& e = *engine;
  py::object dataloader = training_data.is_none() ? py::none() : MakeDataLoader(training_data, e, collate_fn, json.value("dataloader_drop_last", false));
  auto py_engine = std::make_shared<PyEngine>(model, shell, std::move(engine), settings);
  py_engine->UseParamGroups(optimizer, std::move(plan.engine_group_of));
  if (!optimizer.is_none()) py_engine->TakeClientState();
  if (client_scheduler) py_engine->UseClientScheduler(lr_scheduler);
  RegisterUnitHooks(py_engine, units);
  RegisterParameters(py_engine, *shell);
  py::object engine_obj = py::cast(py_engine);
  return py::make_tuple(engine_obj, engine_obj.attr("optimizer"), dataloader, engine_obj.attr("lr_scheduler"));
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
    if (e->settings().zero_stage != 3) continue;  // stages 0-2: parameters are whole, DeepSpeed's context does nothing
    partitioned += static_cast<int>(tensors.size());
    py::gil_scoped_release no_gil;
    if (gather)
      e->engine().GatherParameters(tensors);
    else
      e->engine().ReleaseParameters(tensors, modifier_rank);
  }
  return partitioned;
}

// ---- The engine's calls. ----

namespace {

// The engines alive, for the teardown at exit.
std::vector<PyEngine*>& LiveEngines() {
  static auto* engines = new std::vector<PyEngine*>();
  return *engines;
}

}  // namespace

PyEngine::PyEngine(py::object module, std::shared_ptr<torch::nn::Module> shell, std::unique_ptr<Engine> engine,
                   EngineSettings settings)
    : module_(std::move(module)), shell_(std::move(shell)), engine_(std::move(engine)), settings_(settings) {
  LiveEngines().push_back(this);
  py::module_::import("uckpt.comm").attr("_release_engines_at_exit")();
}

PyEngine::~PyEngine() {
  auto& live = LiveEngines();
  live.erase(std::remove(live.begin(), live.end(), this), live.end());
}

void PyEngine::FinishCheckpointAtExit() {
  py::gil_scoped_release no_gil;
  try {
    engine_->WaitForCheckpoint();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "uckpt: at exit: %s\n", e.what());
  }
}

void FinishCheckpointsAtExit() {
  for (PyEngine* e : std::vector<PyEngine*>(LiveEngines())) e->FinishCheckpointAtExit();
}

py::object PyEngine::Call(py::args args, py::kwargs kwargs) { return module_(*args, **kwargs); }

py::object PyEngine::Backward(py::object loss, const BackwardOptions& options) {
  RequireOptimizer("backward");
  if (!THPVariable_Check(loss.ptr())) throw py::type_error("engine.backward: loss must be a tensor, got " + TypeName(loss));
  at::Tensor t = THPVariable_Unpack(loss.ptr());
  {
    py::gil_scoped_release no_gil;  // autograd may run Python functions on its own threads
    engine_->Backward(t, options);
  }
  // DeepSpeed returns the loss it scaled by 1/GA (in fp32).
  const int64_t ga = engine_->gradient_accumulation_steps();
  if (ga > 1 && options.scale_wrt_gas)
    return py::reinterpret_steal<py::object>(THPVariable_Wrap(t.to(at::kFloat) / static_cast<double>(ga)));
  return loss;
}

void PyEngine::RequireOptimizer(const char* call) const {
  if (settings_.has_optimizer) return;
  // DeepSpeed asserts the same (an AssertionError).
  PyErr_SetString(PyExc_AssertionError, (std::string("engine.") + call + ": must provide optimizer during init in order "
                                         "to use " + call + " (initialize got no optimizer and the config has no "
                                         "'optimizer' section)").c_str());
  throw py::error_already_set();
}

void PyEngine::Step(py::object lr_kwargs) {
  RequireOptimizer("step");
  StepOptions options;
  // DeepSpeed passes lr_kwargs to its lr scheduler's step() and has none to
  // pass them to without one. The config's schedulers take their iteration
  // (last_batch_iteration, or batch_iteration for OneCycle and LRRangeTest); a
  // client scheduler gets them as they are.
  if (!lr_kwargs.is_none() && engine_->has_lr_schedule()) {
    const std::string name = settings_.scheduler_type == "OneCycle" || settings_.scheduler_type == "LRRangeTest"
                                 ? "batch_iteration"
                                 : "last_batch_iteration";
    for (auto [key, value] : lr_kwargs.cast<py::dict>()) {
      const std::string k = py::str(key);
      if (k != name)
        throw py::value_error("engine.step: lr_kwargs key '" + k + "' is not an argument of the config scheduler " +
                              settings_.scheduler_type + "'s step() (it takes " + name + ")");
      if (!value.is_none()) options.lr_schedule_iteration = value.cast<int64_t>();
    }
  }
  const bool boundary = engine_->IsGradientAccumulationBoundary();
  if (boundary) PushGroups();
  const int64_t skipped = engine_->skipped_steps();
  {
    py::gil_scoped_release no_gil;
    engine_->Step(options);
  }
  if (!boundary || engine_->skipped_steps() != skipped) return;
  // The config scheduler stepped after the applied update: its lr (and OneCycle's betas) is every group's now.
  if (engine_->has_lr_schedule()) {
    PullGroups(settings_.scheduler_sets_betas);
    config_scheduler_stepped_ = true;
  }
  // DeepSpeed's update is the basic optimizer's step(); torch schedulers count those (and warn without one).
  // (A client's optimizer that steps the partitions itself counted its own step().)
  // PyTorch before 2.7 counted them on the optimizer (_step_count); later, the step() a scheduler
  // wrapped marks the optimizer as stepped (_opt_called).
  if (!settings_.client_step && !basic_optimizer_.is_none()) {
    if (py::hasattr(basic_optimizer_, "_step_count"))
      basic_optimizer_.attr("_step_count") = py::int_(basic_optimizer_.attr("_step_count").cast<int64_t>() + 1);
    if (py::hasattr(basic_optimizer_.attr("step"), "_wrapped_by_lr_sched"))
      basic_optimizer_.attr("_opt_called") = py::bool_(true);
  }
  if (!client_scheduler_.is_none()) StepClientScheduler(lr_kwargs);
}

// As DeepSpeed's _take_model_step: step(**lr_kwargs), and on a TypeError
// step(train_batch_size) (its fallback for Megatron's schedulers).
void PyEngine::StepClientScheduler(py::object lr_kwargs) {
  py::dict kwargs = lr_kwargs.is_none() ? py::dict() : py::dict(lr_kwargs);
  try {
    client_scheduler_.attr("step")(**kwargs);
  } catch (py::error_already_set& e) {
    if (!e.matches(PyExc_TypeError)) throw;
    client_scheduler_.attr("step")(engine_->train_batch_size());
  }
}

// The torch optimizer a scheduler callable is given when the config's
// optimizer section made the optimizer (DeepSpeed gives its basic optimizer):
// its param_groups are the engine's dicts; its step() does not update.
static py::object MakeBasicOptimizer(py::list groups, py::dict defaults) {
  static py::object* cls = nullptr;  // kept for the process (no destructor after the interpreter ends)
  if (!cls) {
    py::dict scope;
    scope["torch"] = py::module_::import("torch");
    py::exec(R"PY(
class EngineBasicOptimizer(torch.optim.Optimizer):
    """The engine's param groups as a torch optimizer (DeepSpeed's basic optimizer) for an lr_scheduler."""

    def step(self, closure=None):
        raise RuntimeError("uckpt: this optimizer's step() does not update; the update runs in engine.step()")
)PY", scope);
    cls = new py::object(scope["EngineBasicOptimizer"]);
  }
  return (*cls)(groups, defaults);
}

void PyEngine::UseClientScheduler(py::object scheduler) {
  basic_optimizer_ = client_optimizer_;
  if (basic_optimizer_.is_none()) {
    const GroupHparams h = engine_->group_hparams(0);
    basic_optimizer_ = MakeBasicOptimizer(own_groups_, py::dict("lr"_a = engine_->learning_rate(0),
                                                                "betas"_a = py::make_tuple(h.beta1, h.beta2),
                                                                "eps"_a = h.eps, "weight_decay"_a = h.weight_decay));
    own_groups_ = basic_optimizer_.attr("param_groups").cast<py::list>();  // the same dicts
  }
  if (PyCallable_Check(scheduler.ptr())) {
    scheduler = scheduler(basic_optimizer_);
    if (scheduler.is_none()) throw py::value_error("uckpt.initialize: the lr_scheduler callable returned None");
  } else if (py::hasattr(scheduler, "optimizer") && scheduler.attr("optimizer").ptr() != basic_optimizer_.ptr()) {
    // Its writes would go to another optimizer's param_groups, which the engine never reads.
    throw py::value_error("uckpt.initialize: lr_scheduler (" + TypeName(scheduler) + ") steps " +
                          (client_optimizer_.is_none() ? std::string("an optimizer, but initialize got none (the "
                                                                     "config's 'optimizer' section made it)")
                                                       : "another optimizer than the one passed to initialize") +
                          ": build it on the optimizer passed to initialize, or pass a callable that takes the "
                          "optimizer (lr_scheduler=lambda opt: ...)");
  }
  for (const char* method : {"step", "state_dict", "load_state_dict"})
    if (!py::hasattr(scheduler, method))
      throw py::value_error("uckpt.initialize: lr_scheduler (" + TypeName(scheduler) + ") has no " + method +
                            "() (DeepSpeed steps it and saves its state_dict())");
  client_scheduler_ = std::move(scheduler);
}

void PyEngine::UseParamGroups(py::object client_optimizer, std::vector<int> engine_group_of) {
  const size_t groups = engine_->num_param_groups();
  if (!client_optimizer.is_none()) {
    // DeepSpeed drops the client's groups that have no params at all.
    py::list dicts = py::list(client_optimizer.attr("param_groups"));
    py::list kept;
    for (size_t i = 0; i < dicts.size(); ++i) {
      if (py::len(dicts[i]["params"]) == 0) continue;
      kept.append(dicts[i]);
      engine_group_of_.push_back(engine_group_of.at(i));
    }
    if (kept.size() != dicts.size())
      client_optimizer.attr("param_groups").attr("__setitem__")(py::module_::import("builtins").attr("slice")(py::none()), kept);
    client_optimizer_ = std::move(client_optimizer);
    basic_optimizer_ = client_optimizer_;  // DeepSpeed steps it at each update: a torch scheduler on it counts them
    // LRRangeTest's and OneCycle's constructors write their first lr (and betas) into the groups.
    if (settings_.scheduler_type == "OneCycle" || settings_.scheduler_type == "LRRangeTest") PullGroups(true);
    return;
  }
  const auto params = engine_->param_groups();
  engine_group_of_.clear();
  for (size_t g = 0; g < groups; ++g) {
    py::list ps;
    for (const auto& p : params[g]) ps.append(p.second);
    const GroupHparams h = engine_->group_hparams(g);
    own_groups_.append(py::dict("params"_a = ps, "lr"_a = engine_->learning_rate(g),
                                "betas"_a = py::make_tuple(h.beta1, h.beta2), "eps"_a = h.eps,
                                "weight_decay"_a = h.weight_decay));
    engine_group_of_.push_back(static_cast<int>(g));
  }
}

py::object PyEngine::ParamGroups() const {
  return client_optimizer_.is_none() ? py::object(own_groups_) : client_optimizer_.attr("param_groups");
}

void PyEngine::PushGroups() {
  py::list dicts = py::list(ParamGroups());
  if (dicts.size() != engine_group_of_.size())
    throw py::value_error("optimizer.param_groups: " + std::to_string(dicts.size()) + " groups, but the engine was " +
                          "built with " + std::to_string(engine_group_of_.size()) +
                          " (adding or removing param groups after initialize is not supported by uckpt)");
  for (size_t i = 0; i < dicts.size(); ++i) {
    if (engine_group_of_[i] < 0) continue;
    const auto g = static_cast<size_t>(engine_group_of_[i]);
    const GroupOptionals h = ReadGroup(dicts[i], "optimizer.param_groups[" + std::to_string(i) + "]", !settings_.client_step);
    if (h.lr && *h.lr != engine_->learning_rate(g)) engine_->SetLearningRate(g, *h.lr);
    const GroupHparams now = engine_->group_hparams(g);
    GroupHparams want = now;
    if (h.beta1) {
      want.beta1 = *h.beta1;
      want.beta2 = *h.beta2;
    }
    if (h.eps) want.eps = *h.eps;
    if (h.weight_decay) want.weight_decay = *h.weight_decay;
    if (want.beta1 != now.beta1 || want.beta2 != now.beta2 || want.eps != now.eps ||
        want.weight_decay != now.weight_decay)
      engine_->SetGroupHparams(g, want);
  }
}

void PyEngine::PullGroups(bool hparams) {
  py::list dicts = py::list(ParamGroups());
  for (size_t i = 0; i < dicts.size() && i < engine_group_of_.size(); ++i) {
    // A group with nothing trainable takes the schedule's value too, as DeepSpeed's scheduler writes every group.
    const size_t g = engine_group_of_[i] < 0 ? 0 : static_cast<size_t>(engine_group_of_[i]);
    dicts[i]["lr"] = py::float_(engine_->learning_rate(g));
    if (!hparams || engine_group_of_[i] < 0) continue;
    const GroupHparams h = engine_->group_hparams(g);
    py::dict d = dicts[i];
    if (d.contains("betas")) d["betas"] = py::make_tuple(h.beta1, h.beta2);
    if (d.contains("eps")) d["eps"] = py::float_(h.eps);
    if (d.contains("weight_decay")) d["weight_decay"] = py::float_(h.weight_decay);
  }
}

bool PyEngine::SaveCheckpoint(py::object save_dir, py::object tag, py::object client_state, bool save_latest) {
  if (!save_latest) throw py::value_error("engine.save_checkpoint: save_latest=False is not supported (latest is always written)");
  const std::string dir = FsPath(save_dir, "save_checkpoint: save_dir");
  ClientState cs = client_state.is_none() ? c10::IValue() : ToIValue(client_state, "client_state");
  if (!cs.isNone() && cs.isGenericDict() && cs.toGenericDict().empty()) cs = c10::IValue();
  const std::string t = tag.is_none() ? "" : py::str(tag).cast<std::string>();
  PushGroups();  // DeepSpeed saves the dicts' values
  SaveCheckpointOptions options;
  // DeepSpeed saves lr_scheduler.state_dict() under 'lr_scheduler'.
  if (!client_scheduler_.is_none())
    options.lr_scheduler_state = ToIValue(client_scheduler_.attr("state_dict")(), "lr_scheduler.state_dict()");
  py::gil_scoped_release no_gil;
  engine_->SaveCheckpoint(dir, t, cs, options);
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
  // DeepSpeed's optimizer load_state_dict restores the saved param groups' lr, betas, eps and weight decay.
  o.keep_saved_hparams = load_optimizer_states && !load_module_only;
  PushGroups();  // what the dicts hold now is what a load leaves unrestored
  const std::string t = tag.is_none() ? "" : py::str(tag).cast<std::string>();
  LoadResult r;
  {
    py::gil_scoped_release no_gil;
    r = engine_->LoadCheckpoint(dir, t, o);
  }
  if (r.path.empty()) return py::make_tuple(py::none(), py::none());  // DeepSpeed's answer when nothing was found
  if (!load_module_only && load_optimizer_states) RestoreClientGroups();
  if (!load_module_only) PullGroups(load_optimizer_states);  // the restored lrs (and hyper-parameters)
  if (!load_module_only && load_lr_scheduler_states && !client_scheduler_.is_none()) {
    if (engine_->last_load().lr_scheduler_state.isNone())
      throw py::value_error("engine.load_checkpoint: " + r.path + " holds no lr_scheduler state (saved without a "
                            "scheduler) for " + TypeName(client_scheduler_) +
                            ".load_state_dict(); pass load_lr_scheduler_states=False to keep the scheduler as it is");
    client_scheduler_.attr("load_state_dict")(FromIValue(engine_->last_load().lr_scheduler_state));
  }
  py::object cs = r.client_state.isNone() ? py::dict() : FromIValue(r.client_state);
  // DeepSpeed hands back the checkpoint's 'lr_scheduler' with the client state when it does not load it.
  if (!load_lr_scheduler_states && py::isinstance<py::dict>(cs)) cs["lr_scheduler"] = FromIValue(engine_->last_load().lr_scheduler_state);
  return py::make_tuple(py::str(r.path), cs);
}

void PyEngine::RestoreClientGroups() {
  const c10::IValue& saved = engine_->last_load().optimizer_param_groups;
  if (!settings_.client_step || !saved.isList()) return;
  py::list groups = FromIValue(saved);
  py::list dicts = py::list(ParamGroups());
  for (size_t i = 0; i < dicts.size() && i < engine_group_of_.size(); ++i) {
    const int g = engine_group_of_[i];
    if (g < 0 || static_cast<size_t>(g) >= groups.size() || !py::isinstance<py::dict>(groups[g])) continue;
    py::dict d = dicts[i];
    for (auto [k, v] : groups[g].cast<py::dict>())
      if (py::str(k).cast<std::string>() != "params") d[k] = v;
  }
}

void PyEngine::ZeroGrad() {
  for (py::handle p : module_.attr("parameters")()) p.attr("grad") = py::none();
}

void PyEngine::Train(bool mode) {
  module_.attr("train")(mode);
  engine_->Train(mode);
}

py::list PyEngine::GetLr() const {
  // DeepSpeed's engine.get_lr(): each param group's 'lr'.
  py::list out;
  for (auto d : ParamGroups()) out.append(d["lr"]);
  return out;
}

py::list PyEngine::SchedulerLr() const {
  // The config scheduler's get_lr() at its position: WarmupLR, WarmupDecayLR and WarmupCosineLR
  // give [0.0] before their first step; otherwise one value per group.
  const int64_t it = engine_->lr_schedule_iteration();
  if (it < 0 && settings_.scheduler_type.rfind("Warmup", 0) == 0) return py::cast(std::vector<double>{0.0});
  std::vector<double> lrs;
  for (size_t i = 0; i < engine_group_of_.size(); ++i)
    lrs.push_back(engine_->ScheduledLr(it, engine_group_of_[i] < 0 ? 0 : static_cast<size_t>(engine_group_of_[i])));
  return py::cast(lrs);
}

py::list PyEngine::SchedulerLastLr() const {
  // DeepSpeed's _last_lr: what its last step wrote into every group (set by a step only, not by a load).
  if (!config_scheduler_stepped_)
    throw std::runtime_error("lr_scheduler.get_last_lr(): need to call step() first (the scheduler has not stepped)");
  return SchedulerLr();
}

void PyEngine::StepScheduler(py::args args, py::kwargs kwargs) {
  const std::string name = settings_.scheduler_type == "OneCycle" || settings_.scheduler_type == "LRRangeTest"
                               ? "batch_iteration"
                               : "last_batch_iteration";
  py::object it = args.size() > 0 ? py::object(args[0]) : py::object(py::none());
  for (auto [key, value] : kwargs) {
    if (py::str(key).cast<std::string>() != name || args.size() > 0)
      throw py::type_error("lr_scheduler.step() of " + settings_.scheduler_type + " takes one argument, " + name);
    it = py::reinterpret_borrow<py::object>(value);
  }
  if (args.size() > 1)
    throw py::type_error("lr_scheduler.step() of " + settings_.scheduler_type + " takes one argument, " + name);
  std::optional<int64_t> iteration;
  if (!it.is_none()) iteration = it.cast<int64_t>();
  engine_->StepLrSchedule(iteration);
  config_scheduler_stepped_ = true;
  PullGroups(settings_.scheduler_sets_betas);
}

py::object PyEngine::GlobalGradNorm() const {
  if (engine_->global_steps() == 0) return py::none();
  return py::float_(engine_->last_step().grad_norm);
}

py::dict PyEngine::SchedulerState() const {
  // DeepSpeed's schedulers count updates from -1 (before the first step).
  return py::dict("last_batch_iteration"_a = engine_->lr_schedule_iteration());
}

}  // namespace uckpt::python
