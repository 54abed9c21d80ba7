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
  bool has_scheduler = false;   // a config "scheduler" section
  int zero_stage = 0;
};

class PyEngine {
 public:
  PyEngine(py::object module, std::shared_ptr<torch::nn::Module> shell, std::unique_ptr<Engine> engine,
           EngineSettings settings);

  py::object Call(py::args args, py::kwargs kwargs);  // the module's forward
  py::object Backward(py::object loss);
  void Step();
  void ZeroGrad() {}  // gradients are cleared by the engine after each boundary step
  bool SaveCheckpoint(py::object dir, py::object tag, py::object client_state, bool save_latest);
  py::tuple LoadCheckpoint(py::object dir, py::object tag, bool load_optimizer_states,
                           bool load_lr_scheduler_states, bool load_module_only);
  bool LoadUniversal() const { return settings_.load_universal; }
  void Train(bool mode);
  py::list GetLr() const;
  py::object GlobalGradNorm() const;
  py::dict SchedulerState() const;

  py::object module() const { return module_; }
  Engine& engine() { return *engine_; }
  const Engine& engine() const { return *engine_; }
  const EngineSettings& settings() const { return settings_; }

 private:
  py::object module_;
  std::shared_ptr<torch::nn::Module> shell_;
  std::unique_ptr<Engine> engine_;
  EngineSettings settings_;
};

// deepspeed.initialize(...) -> (engine, optimizer, dataloader, lr_scheduler).
py::tuple Initialize(py::object args, py::object model, py::object optimizer, py::object model_parameters,
                     py::object training_data, py::object lr_scheduler, py::object mpu, py::object collate_fn,
                     py::object config);

// deepspeed.init_distributed: torch.distributed's default group from the
// launcher's environment (one process without it).
void InitDistributed(const std::string& dist_backend, int timeout_minutes);

// uckpt.zero.GatheredParameters: the stage-3 parameters among `params` (an
// iterable of tensors), each by the engine holding it, gathered (true) or
// released with modifier_rank (-1: writes discarded); tensors of no engine,
// or of an engine at stages 0-2, are left alone. Returns how many were
// stage 3's.
int GatherParameters(py::object params, bool gather, int modifier_rank);

// deepspeed.add_config_arguments: --deepspeed, --deepspeed_config (and the old --deepscale names).
py::object AddConfigArguments(py::object parser);

}  // namespace uckpt::python
