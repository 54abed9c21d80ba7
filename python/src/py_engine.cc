// The engine core's calls (see py_engine.h).
#include "py_engine.h"

#include <pybind11/eval.h>
#include <torch/csrc/autograd/python_variable.h>

#include <algorithm>
#include <cstdio>

#include "py_param_groups.h"
#include "py_values.h"
#include "script_api.h"

namespace uckpt::python {

using namespace pybind11::literals;

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

py::object PyEngine::Backward(py::object loss, const BackwardOptions& options) {
  RequireOptimizer("backward");
  if (!THPVariable_Check(loss.ptr()))
    throw py::type_error("engine.backward: loss must be a tensor, got " + TypeName(loss));
  at::Tensor t = THPVariable_Unpack(loss.ptr());
  {
    py::gil_scoped_release no_gil;  // autograd may run Python functions on its own threads
    engine_->Backward(t, options);
  }
  // DeepSpeed returns the loss it scaled by 1/GA (in fp32).
  const int64_t ga = engine_->settings().gradient_accumulation_steps();
  if (ga > 1 && options.scale_wrt_gas)
    return py::reinterpret_steal<py::object>(THPVariable_Wrap(t.to(at::kFloat) / static_cast<double>(ga)));
  return loss;
}

void PyEngine::RequireOptimizer(const char* call) const {
  if (settings_.has_optimizer) return;
  // DeepSpeed asserts the same (an AssertionError).
  PyErr_SetString(PyExc_AssertionError, (std::string("engine.") + call +
                                         ": must provide optimizer during init in order "
                                         "to use " +
                                         call +
                                         " (initialize got no optimizer and the config has no "
                                         "'optimizer' section)")
                                            .c_str());
  throw py::error_already_set();
}

void PyEngine::Step(py::object lr_kwargs) {
  RequireOptimizer("step");
  StepOptions options;
  // DeepSpeed passes lr_kwargs to its lr scheduler's step() and has none to
  // pass them to without one. The config's schedulers take their iteration
  // (last_batch_iteration, or batch_iteration for OneCycle and LRRangeTest); a
  // client scheduler gets them as they are.
  if (!lr_kwargs.is_none() && engine_->optimizer().has_lr_schedule()) {
    const std::string name = settings_.scheduler_type() == "OneCycle" || settings_.scheduler_type() == "LRRangeTest"
                                 ? "batch_iteration"
                                 : "last_batch_iteration";
    for (auto [key, value] : lr_kwargs.cast<py::dict>()) {
      const std::string k = py::str(key);
      if (k != name)
        throw py::value_error("engine.step: lr_kwargs key '" + k + "' is not an argument of the config scheduler " +
                              settings_.scheduler_type() + "'s step() (it takes " + name + ")");
      if (!value.is_none()) options.lr_schedule_iteration = value.cast<int64_t>();
    }
  }
  const bool boundary = engine_->IsGradientAccumulationBoundary();
  if (boundary) PushGroups();
  const int64_t skipped = engine_->stats().skipped_steps();
  {
    py::gil_scoped_release no_gil;
    engine_->Step(options);
  }
  if (!boundary || engine_->stats().skipped_steps() != skipped) return;
  // The config scheduler stepped after the applied update: its lr (and OneCycle's betas) is every group's now.
  if (engine_->optimizer().has_lr_schedule()) {
    PullGroups(settings_.scheduler_sets_betas());
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
    client_scheduler_.attr("step")(engine_->settings().train_batch_size());
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
)PY",
             scope);
    cls = new py::object(scope["EngineBasicOptimizer"]);
  }
  return (*cls)(groups, defaults);
}

void PyEngine::UseClientScheduler(py::object scheduler) {
  basic_optimizer_ = client_optimizer_;
  if (basic_optimizer_.is_none()) {
    const GroupHparams h = engine_->optimizer().group_hparams(0);
    basic_optimizer_ = MakeBasicOptimizer(own_groups_, py::dict("lr"_a = engine_->optimizer().learning_rate(0),
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
  const size_t groups = engine_->optimizer().num_param_groups();
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
      client_optimizer.attr("param_groups")
          .attr("__setitem__")(py::module_::import("builtins").attr("slice")(py::none()), kept);
    client_optimizer_ = std::move(client_optimizer);
    basic_optimizer_ = client_optimizer_;  // DeepSpeed steps it at each update: a torch scheduler on it counts them
    // LRRangeTest's and OneCycle's constructors write their first lr (and betas) into the groups.
    if (settings_.scheduler_type() == "OneCycle" || settings_.scheduler_type() == "LRRangeTest") PullGroups(true);
    return;
  }
  const auto params = engine_->optimizer().param_groups();
  engine_group_of_.clear();
  for (size_t g = 0; g < groups; ++g) {
    py::list ps;
    for (const auto& p : params[g]) ps.append(p.second);
    const GroupHparams h = engine_->optimizer().group_hparams(g);
    own_groups_.append(py::dict("params"_a = ps, "lr"_a = engine_->optimizer().learning_rate(g),
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
    const GroupOptionals h =
        ReadGroup(dicts[i], "optimizer.param_groups[" + std::to_string(i) + "]", !settings_.client_step);
    if (h.lr && *h.lr != engine_->optimizer().learning_rate(g)) engine_->optimizer().SetLearningRate(g, *h.lr);
    const GroupHparams now = engine_->optimizer().group_hparams(g);
    GroupHparams want = now;
    if (h.beta1) {
      want.beta1 = *h.beta1;
      want.beta2 = *h.beta2;
    }
    if (h.eps) want.eps = *h.eps;
    if (h.weight_decay) want.weight_decay = *h.weight_decay;
    if (want.beta1 != now.beta1 || want.beta2 != now.beta2 || want.eps != now.eps ||
        want.weight_decay != now.weight_decay)
      engine_->optimizer().SetGroupHparams(g, want);
  }
}

void PyEngine::PullGroups(bool hparams) {
  py::list dicts = py::list(ParamGroups());
  for (size_t i = 0; i < dicts.size() && i < engine_group_of_.size(); ++i) {
    // A group with nothing trainable takes the schedule's value too, as DeepSpeed's scheduler writes every group.
    const size_t g = engine_group_of_[i] < 0 ? 0 : static_cast<size_t>(engine_group_of_[i]);
    dicts[i]["lr"] = py::float_(engine_->optimizer().learning_rate(g));
    if (!hparams || engine_group_of_[i] < 0) continue;
    const GroupHparams h = engine_->optimizer().group_hparams(g);
    py::dict d = dicts[i];
    if (d.contains("betas")) d["betas"] = py::make_tuple(h.beta1, h.beta2);
    if (d.contains("eps")) d["eps"] = py::float_(h.eps);
    if (d.contains("weight_decay")) d["weight_decay"] = py::float_(h.weight_decay);
  }
}

void PyEngine::OptimizerStep() {
  RequireOptimizer("optimizer.step()");
  const std::string cls = DeepSpeedOptimizerClass(*this);
  if (cls != "torch" || engine_->settings().fp16_enabled() || settings_.config.zero.offload_optimizer_cpu)
    throw py::value_error(
        "engine.optimizer.step() is not supported by uckpt here: DeepSpeed's optimizer is its " +
        (cls == "torch" ? std::string("fp16 wrapper") : cls) +
        ", whose step() belongs to engine.step() (with the gradient-accumulation boundary, the lr schedule and the "
        "step counters); call engine.step(). A script's own optimizer.step() is DeepSpeed's at ZeRO stage 0 in "
        "fp32, where the optimizer is the torch optimizer itself");
  PushGroups();  // the lrs the script set in the dicts
  py::gil_scoped_release no_gil;
  engine_->OptimizerStep();
}

bool PyEngine::SaveCheckpoint(py::object save_dir, py::object tag, py::object client_state,
                              bool exclude_frozen_parameters) {
  const std::string dir = FsPath(save_dir, "save_checkpoint: save_dir");
  ClientState cs = client_state.is_none() ? c10::IValue() : ToIValue(client_state, "client_state");
  if (!cs.isNone() && cs.isGenericDict() && cs.toGenericDict().empty()) cs = c10::IValue();
  const std::string t = tag.is_none() ? "" : py::str(tag).cast<std::string>();
  PushGroups();  // DeepSpeed saves the dicts' values
  SaveCheckpointOptions options;
  options.exclude_frozen_parameters = exclude_frozen_parameters;
  // DeepSpeed saves lr_scheduler.state_dict() under 'lr_scheduler'.
  if (!client_scheduler_.is_none())
    options.lr_scheduler_state = ToIValue(client_scheduler_.attr("state_dict")(), "lr_scheduler.state_dict()");
  py::gil_scoped_release no_gil;
  engine_->SaveCheckpoint(dir, t, cs, options);
  return true;
}

py::tuple PyEngine::LoadCheckpoint(py::object load_dir, py::object tag, bool load_module_strict,
                                   bool load_optimizer_states, bool load_lr_scheduler_states, bool load_module_only) {
  const std::string dir = FsPath(load_dir, "load_checkpoint: load_dir");
  LoadCheckpointOptions o;
  o.load_optimizer_states = load_optimizer_states;
  o.load_lr_scheduler_states = load_lr_scheduler_states;
  o.load_module_only = load_module_only;
  o.load_module_strict = load_module_strict;
  o.universal = settings_.config.load_universal;
  // DeepSpeed's optimizer load_state_dict restores the saved param groups' lr, betas, eps and weight decay.
  o.keep_saved_hparams = load_optimizer_states && !load_module_only;
  // Objects other than numpy's in client_state: read (and then rebuilt by Python's pickle) only on request.
  o.trust_pickled_client_state = py::module_::import("uckpt._client_pickle").attr("trusted")().cast<bool>();
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
    if (engine_->stats().last_load().lr_scheduler_state.isNone())
      throw py::value_error("engine.load_checkpoint: " + r.path +
                            " holds no lr_scheduler state (saved without a "
                            "scheduler) for " +
                            TypeName(client_scheduler_) +
                            ".load_state_dict(); pass load_lr_scheduler_states=False to keep the scheduler as it is");
    client_scheduler_.attr("load_state_dict")(FromIValue(engine_->stats().last_load().lr_scheduler_state));
  }
  py::object cs = r.client_state.isNone() ? py::dict() : FromIValue(r.client_state);
  // DeepSpeed hands back the checkpoint's 'lr_scheduler' with the client state when it does not load it.
  if (!load_lr_scheduler_states && py::isinstance<py::dict>(cs))
    cs["lr_scheduler"] = FromIValue(engine_->stats().last_load().lr_scheduler_state);
  return py::make_tuple(py::str(r.path), cs);
}

void PyEngine::RestoreClientGroups() {
  const c10::IValue& saved = engine_->stats().last_load().optimizer_param_groups;
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
  const int64_t it = engine_->optimizer().lr_schedule_iteration();
  if (it < 0 && settings_.scheduler_type().rfind("Warmup", 0) == 0) return py::cast(std::vector<double>{0.0});
  std::vector<double> lrs;
  for (size_t i = 0; i < engine_group_of_.size(); ++i)
    lrs.push_back(
        engine_->optimizer().ScheduledLr(it, engine_group_of_[i] < 0 ? 0 : static_cast<size_t>(engine_group_of_[i])));
  return py::cast(lrs);
}

py::list PyEngine::SchedulerLastLr() const {
  // DeepSpeed's _last_lr: what its last step wrote into every group (set by a step only, not by a load).
  if (!config_scheduler_stepped_) {  // DeepSpeed's asserts it: the Trainer catches AssertionError here (fp16 loss-scale
                                     // warm-up)
    PyErr_SetString(PyExc_AssertionError,
                    "lr_scheduler.get_last_lr(): need to call step() first (the scheduler has not stepped)");
    throw py::error_already_set();
  }
  return SchedulerLr();
}

void PyEngine::StepScheduler(py::args args, py::kwargs kwargs) {
  const std::string name = settings_.scheduler_type() == "OneCycle" || settings_.scheduler_type() == "LRRangeTest"
                               ? "batch_iteration"
                               : "last_batch_iteration";
  py::object it = args.size() > 0 ? py::object(args[0]) : py::object(py::none());
  for (auto [key, value] : kwargs) {
    if (py::str(key).cast<std::string>() != name || args.size() > 0)
      throw py::type_error("lr_scheduler.step() of " + settings_.scheduler_type() + " takes one argument, " + name);
    it = py::reinterpret_borrow<py::object>(value);
  }
  if (args.size() > 1)
    throw py::type_error("lr_scheduler.step() of " + settings_.scheduler_type() + " takes one argument, " + name);
  std::optional<int64_t> iteration;
  if (!it.is_none()) iteration = it.cast<int64_t>();
  engine_->optimizer().StepLrSchedule(iteration);
  config_scheduler_stepped_ = true;
  PullGroups(settings_.scheduler_sets_betas());
}

py::object PyEngine::GlobalGradNorm() const {
  if (engine_->stats().global_steps() == 0) return py::none();
  return py::float_(engine_->stats().last_step().grad_norm);
}

py::dict PyEngine::SchedulerState() const {
  // DeepSpeed's schedulers count updates from -1 (before the first step).
  return py::dict("last_batch_iteration"_a = engine_->optimizer().lr_schedule_iteration());
}

}  // namespace uckpt::python
