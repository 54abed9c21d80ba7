// The Python engine's C++ core: uckpt::Engine for a Python torch.nn.Module,
// with the state DeepSpeed's engine keeps beside it (param-group dicts, a
// client scheduler). Python's DeepSpeedEngine (python/uckpt/runtime/engine.py)
// wraps it. The module runs in Python; a C++ shell module holds the same
// parameter and buffer tensors (module_shell.h), so the engine's set_data on
// them is what Python sees.
#pragma once

#include <torch/csrc/utils/pybind.h>

#include <memory>
#include <string>

#include "engine/config.h"
#include "uckpt/engine.h"

namespace uckpt::python {

namespace py = pybind11;

// What initialize() learned besides the engine: for the calls DeepSpeed's
// engine answers from its config.
struct EngineSettings {
  // The config's scheduler (its section is dropped with a client lr_scheduler): its type, "" if none.
  const std::string& scheduler_type() const { return config.scheduler.type; }
  bool has_scheduler() const { return !config.scheduler.type.empty(); }
  // OneCycle with cycle_momentum writes betas with the lr.
  bool scheduler_sets_betas() const { return config.scheduler.type == "OneCycle" && config.scheduler.cycle_momentum; }
  bool has_optimizer = true;  // false: initialize got no optimizer and the config has none
  bool client_step = false;   // the client's optimizer (no Adam the engine runs) steps the partitions
  // The config as the engine took it (parsed once, in initialize), and the
  // class name of initialize's optimizer= ("" if none).
  engine::TrainConfig config;
  std::string client_optimizer;
};

class PyEngine {
 public:
  PyEngine(py::object module, std::shared_ptr<torch::nn::Module> shell, std::unique_ptr<Engine> engine,
           EngineSettings settings);
  ~PyEngine();
  PyEngine(const PyEngine&) = delete;
  PyEngine& operator=(const PyEngine&) = delete;
  // At the interpreter's exit: publishes a background save and waits until
  // a published one is durable (Engine::WaitForCheckpoint); an error is
  // printed, not raised.
  void FinishCheckpointAtExit();

  py::object Backward(py::object loss, const BackwardOptions& options);
  void Step(py::object lr_kwargs);
  bool SaveCheckpoint(py::object dir, py::object tag, py::object client_state, bool exclude_frozen_parameters);
  py::tuple LoadCheckpoint(py::object dir, py::object tag, bool load_module_strict, bool load_optimizer_states,
                           bool load_lr_scheduler_states, bool load_module_only);
  void Train(bool mode);
  py::list GetLr() const;
  py::object GlobalGradNorm() const;

  // ---- The optimizer's param groups (DeepSpeed's optimizer.param_groups). ----
  // The dicts are the source of truth, as DeepSpeed's wrapper forwards its
  // wrapped torch optimizer's: a client optimizer's own param_groups list
  // (so a torch scheduler stepping it is read here), else a list the engine
  // made. Each dict's lr (and betas, eps, weight_decay) go to the C++ engine
  // at each optimizer step and before a save; the config scheduler's values
  // and a load's come back into them.
  void UseParamGroups(py::object client_optimizer, std::vector<int> engine_group_of);
  py::object ParamGroups() const;
  // EngineScheduler: the config scheduler's get_lr(), get_last_lr(), step(), state_dict().
  py::list SchedulerLr() const;
  py::list SchedulerLastLr() const;
  // step(n) or step(<its keyword>=n): last_batch_iteration (Warmup*) or batch_iteration (OneCycle, LRRangeTest).
  void StepScheduler(py::args args, py::kwargs kwargs);
  py::dict SchedulerState() const;

  // ---- engine.optimizer.state_dict() / load_state_dict() (py_optimizer_state.cc). ----
  // At ZeRO stage 0 in fp32 with a client torch optimizer, DeepSpeed's
  // optimizer is that optimizer itself: its state_dict() holds the engine's
  // state per parameter in torch's format, and load_state_dict() puts a state
  // dict's state into the engine and its groups' entries into the client's
  // dicts. At stage 0 in fp16 and at ZeRO 1-2 state_dict() is DeepSpeed's
  // wrapper's (WrapperStateDict: Engine::OptimizerStateDict). Every other
  // case raises, naming it (StateDictRefusal: "" when supported).
  // The script's own optimizer.step() where DeepSpeed's optimizer is the torch optimizer (stage 0, fp32).
  void OptimizerStep();
  py::object OptimizerStateDict();
  void LoadOptimizerStateDict(py::object state_dict);
  std::string StateDictRefusal(const char* call) const;
  bool WrapperStateDict() const;
  // At initialize, where state_dict() is the client's: the state the client
  // optimizer already holds (a script's load_state_dict before initialize)
  // goes into the engine, as DeepSpeed's stage 0 steps that optimizer with it.
  void TakeClientState();

  // ---- A client lr_scheduler (DeepSpeed's client_lr_scheduler). ----
  // An object (stepped as DeepSpeed's engine steps it, its state_dict() saved
  // under 'lr_scheduler'), or a callable given the optimizer (the client's, or
  // a torch optimizer over the engine's param groups) that returns one.
  void UseClientScheduler(py::object scheduler);
  // engine.lr_scheduler: the client's scheduler, else the config's (EngineScheduler), else None.
  const py::object& client_scheduler() const { return client_scheduler_; }

  py::object module() const { return module_; }
  Engine& engine() { return *engine_; }
  const Engine& engine() const { return *engine_; }
  const EngineSettings& settings() const { return settings_; }

 private:
  py::object module_;
  std::shared_ptr<torch::nn::Module> shell_;
  void PushGroups();              // the dicts' hyper-parameters into the engine
  void PullGroups(bool hparams);  // the engine's lrs (and betas, eps, weight decay) into the dicts

  std::unique_ptr<Engine> engine_;
  EngineSettings settings_;
  py::object client_optimizer_ = py::none();  // its param_groups are the dicts
  py::object basic_optimizer_ =
      py::none();  // the torch optimizer schedulers step: the client's, or one over own_groups_
  py::object client_scheduler_ = py::none();
  bool config_scheduler_stepped_ = false;  // DeepSpeed's get_last_lr() asserts before a step
  void StepClientScheduler(py::object lr_kwargs);
  void RequireOptimizer(const char* call) const;
  void RequireStateDict(const char* call) const;
  void TakeParamStates(py::list param_states);  // (parameter, {key: tensor or None}) pairs into the engine
  // After a load with optimizer state: the saved param groups' entries (all of
  // a client optimizer's own keys) into its dicts, as torch's load_state_dict.
  void RestoreClientGroups();
  py::list own_groups_;               // the dicts without a client optimizer
  std::vector<int> engine_group_of_;  // dict i's engine group (-1: nothing trainable)
};

// At exit, before uckpt.comm's teardown of the default group (unless this
// rank crashed): every live engine's FinishCheckpointAtExit. Collective, as
// the script's own last calls are.
void FinishCheckpointsAtExit();

// The class EngineCore (what Python's DeepSpeedEngine calls) and _finish_checkpoints.
void BindEngineCore(py::module_& m);

}  // namespace uckpt::python
