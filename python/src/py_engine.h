// The Python package's engine: DeepSpeed's DeepSpeedEngine API over
// uckpt::Engine, for a Python torch.nn.Module. The module runs in Python; a
// C++ shell module holds the same parameter and buffer tensors (module_shell.h),
// so the engine's set_data on them is what Python sees.
#pragma once

#include <torch/csrc/utils/pybind.h>

#include <memory>
#include <string>

#include "uckpt/engine.h"

namespace uckpt::python {

namespace py = pybind11;

// What initialize() learned besides the engine: for the calls DeepSpeed's
// engine answers from its config.
struct EngineSettings {
  bool load_universal = false;  // config checkpoint.load_universal
  bool has_scheduler = false;   // a config "scheduler" section (used: no client lr_scheduler)
  std::string scheduler_type;   // its type
  bool scheduler_sets_betas = false;  // OneCycle with cycle_momentum: it writes betas with the lr
  bool has_optimizer = true;    // false: initialize got no optimizer and the config has none
  bool client_step = false;     // the client's optimizer (no Adam the engine runs) steps the partitions
  int zero_stage = 0;
  // For the engine's smaller attributes (script_api.h): the config as the
  // engine took it, and the class name of initialize's optimizer= ("" if none).
  nlohmann::json config;
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

  py::object Call(py::args args, py::kwargs kwargs);  // the module's forward
  py::object Backward(py::object loss, const BackwardOptions& options);
  void Step(py::object lr_kwargs);
  // DeepSpeed's engine.zero_grad(): every module parameter's .grad set to None
  // (the engine re-attaches its gradient views at the next backward, keeping or
  // dropping what was accumulated as DeepSpeed's stage does).
  void ZeroGrad();
  bool SaveCheckpoint(py::object dir, py::object tag, py::object client_state, bool save_latest);
  py::tuple LoadCheckpoint(py::object dir, py::object tag, bool load_optimizer_states,
                           bool load_lr_scheduler_states, bool load_module_only);
  bool LoadUniversal() const { return settings_.load_universal; }
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
  // dicts. Every other case raises, naming it (StateDictRefusal: "" when supported).
  py::object OptimizerStateDict();
  void LoadOptimizerStateDict(py::object state_dict);
  std::string StateDictRefusal(const char* call) const;
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
  void PushGroups();  // the dicts' hyper-parameters into the engine
  void PullGroups(bool hparams);  // the engine's lrs (and betas, eps, weight decay) into the dicts

  std::unique_ptr<Engine> engine_;
  EngineSettings settings_;
  py::object client_optimizer_ = py::none();  // its param_groups are the dicts
  py::object basic_optimizer_ = py::none();   // the torch optimizer schedulers step: the client's, or one over own_groups_
  py::object client_scheduler_ = py::none();
  bool config_scheduler_stepped_ = false;     // DeepSpeed's get_last_lr() asserts before a step
  void StepClientScheduler(py::object lr_kwargs);
  void RequireOptimizer(const char* call) const;
  void RequireStateDict(const char* call) const;
  void TakeParamStates(py::list param_states);  // (parameter, {key: tensor or None}) pairs into the engine
  // After a load with optimizer state: the saved param groups' entries (all of
  // a client optimizer's own keys) into its dicts, as torch's load_state_dict.
  void RestoreClientGroups();
  py::list own_groups_;                       // the dicts without a client optimizer
  std::vector<int> engine_group_of_;          // dict i's engine group (-1: nothing trainable)
};

// deepspeed.initialize's config: config= (a dict or a JSON path) or
// args.deepspeed_config (args.deepscale_config, deprecated, is moved there);
// both, or neither, is a ValueError, as DeepSpeed asserts.
py::object ResolveConfig(py::handle args, py::handle config);

// deepspeed.initialize(...) -> (engine, optimizer, dataloader, lr_scheduler),
// with the config ResolveConfig gave.
py::tuple Initialize(py::object model, py::object optimizer, py::object model_parameters,
                     py::object training_data, py::object lr_scheduler, py::object mpu, py::object collate_fn,
                     py::object config, py::list partitioned);

// deepspeed.init_distributed: torch.distributed's default group, from the
// arguments, the launcher's environment, or an MPI or Slurm launcher's world
// (DistEnv::FromEnvironment); a group of one with no launcher.
void InitDistributed(py::object dist_backend, bool auto_mpi_discovery, int distributed_port, bool verbose,
                     py::object timeout, py::object init_method, py::object dist_init_required, py::object config,
                     int rank, int world_size);

// At interpreter exit (uckpt.comm, before its teardown of the default group):
// the live engines stop using torch.distributed's process group, so that
// destroy_process_group ends it while the interpreter is whole (an engine
// would keep it into finalization). Later collectives of theirs throw CommError.
void ReleaseTorchDistributedGroups();
// At exit, before that (uckpt.comm's teardown, unless this rank crashed):
// every live engine's FinishCheckpointAtExit. Collective, as the script's
// own last calls are.
void FinishCheckpointsAtExit();

// uckpt.zero.GatheredParameters: the stage-3 parameters among `params` (an
// iterable of tensors), each by the engine holding it, gathered (true) or
// released with modifier_rank (-1: writes discarded); tensors of no engine,
// or of an engine at stages 0-2, are left alone. Returns how many were
// stage 3's.
int GatherParameters(py::object params, bool gather, int modifier_rank);

// deepspeed.add_config_arguments: --deepspeed, --deepspeed_config (and the old --deepscale names).
py::object AddConfigArguments(py::object parser);

}  // namespace uckpt::python
