// The engine's state, shared by engine.cc (training) and checkpoint.cc (save
// and load). Not installed: users see include/uckpt/engine.h only.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "engine/config.h"
#include "engine/lr_schedule.h"
#include "engine/sharded_runtime.h"
#include "uckpt/engine.h"

namespace uckpt {

namespace engine {
class CheckpointWriter;  // async_save.h
class Zero3Runtime;      // zero3_runtime.h
}

struct NamedParam {
  std::string name;
  at::Tensor tensor;
};

struct Engine::Impl {
  std::shared_ptr<Comm> comm;
  bool owns_comm = false;  // made from the environment: the engine ends it (Finish) on a clean destruction
  engine::TrainConfig config;
  std::shared_ptr<torch::nn::Module> model;
  at::Device device = at::kCPU;
  int local_rank = 0;
  engine::BatchSizes batch;

  // Trainable parameters by optimizer group, in flat order: views into the
  // group's flat buffer once the optimizer exists.
  std::vector<std::vector<NamedParam>> groups;
  std::vector<NamedParam> frozen;                           // requires_grad false (or in no group), own storage
  bool save_without_frozen = false;  // the save under way: SaveCheckpointOptions::exclude_frozen_parameters
  std::map<const void*, std::vector<at::Tensor>> gathered_frozen;  // stage 3: frozen values before GatheredParameters
  std::vector<std::pair<std::string, std::string>> aliases;  // tied: alias name -> owner name
  std::vector<NamedParam> buffers;                          // persistent buffers
  // The module's state_dict names in PyTorch's order (params, then buffers,
  // of each module, then its children), aliases included.
  std::vector<std::string> state_names;
  std::vector<std::string> module_prefixes;  // "" and every submodule (state_dict _metadata)

  std::unique_ptr<engine::ShardedRuntime> runtime;  // this rank's partitions and the step (sharded_runtime.h)
  bool client_optimizer = false;  // EngineOptions::optimizer_step steps: PartitionState::named holds the state
  std::function<c10::IValue(size_t)> client_param_group;  // EngineOptions::optimizer_param_group
  engine::Stage0Fp16 stage0_fp16 = engine::Stage0Fp16::kNone;  // DeepSpeed's fp16 wrapper at stage 0, if any
  // Expires with the engine: unit_calls() a model keeps then fail cleanly.
  std::shared_ptr<int> alive = std::make_shared<int>(0);
  engine::LrSchedule schedule;
  int64_t global_steps = 0, global_samples = 0, skipped_steps = 0, micro_steps = 0;
  bool backward_pending = false;  // Backward since the last Step
  std::optional<bool> boundary_override;  // SetGradientAccumulationBoundary
  bool step_applied = false;              // the last Step updated the weights
  StepInfo last;
  std::shared_ptr<engine::CheckpointWriter> writer;  // this rank's files of the last save (async_save.h)
  SaveStats last_save;
  LoadStats last_load;

  explicit Impl(engine::TrainConfig c)
      : config(std::move(c)), schedule(config.scheduler, config.optimizer.lr) {}

  int stage() const { return config.zero.stage; }
  bool boundary() const {
    return boundary_override ? *boundary_override : (micro_steps + 1) % batch.gradient_accumulation_steps == 0;
  }
};

namespace engine {

// engine.cc: the communicator an Engine without EngineOptions::comm makes
// (RANK, WORLD_SIZE, ... or an MPI/Slurm launcher's; one process without).
std::shared_ptr<Comm> CommFromEnvironment(const TrainConfig& c, bool cuda);

// sharded_runtime.cc: the runtime of the configured stage over e.groups
// (specs[g]: group g's sizes, names and hyper-parameters), every rank
// starting from rank 0's weights, frozen parameters and buffers.
std::unique_ptr<ShardedRuntime> MakeShardedRuntime(Engine::Impl& e, std::vector<GroupSpec> specs,
                                                   const EngineOptions& options);
// zero3_setup.cc: stage 3's (the parameters partitioned one by one, gather
// units from the options).
std::unique_ptr<Zero3Runtime> MakeZero3Runtime(Engine::Impl& e, const std::vector<GroupSpec>& specs,
                                                 const ZeroSettings& base, const EngineOptions& options);
// zero3_setup.cc: each trainable parameter's gather unit (EngineOptions::
// gather_units; by group, flat order): the unit holding all its names, -1
// (the root) for one in no unit or tied across units. std::invalid_argument
// for a unit that is not a submodule of the model.
std::vector<std::vector<int>> ParameterUnits(const Engine::Impl& e, const EngineOptions& options);
// zero3_setup.cc: before the module is moved and cast, each parameter of
// options.partitioned (refused unless stage 3) becomes a tensor of its
// shape, the model dtype and the device without storage; a frozen one is
// gathered whole (uckpt keeps frozen parameters whole).
void PreparePartitionedParameters(Engine::Impl& e, const EngineOptions& options);
// zero3_setup.cc: refuses (std::invalid_argument, naming it) a parameter or
// buffer on the meta device, and a parameter without storage that is not in
// options.partitioned (a ZeroInit build whose partitions were not handed over).
void RefuseTensorsWithoutValues(const Engine::Impl& e, const EngineOptions& options);

// checkpoint.cc: DeepSpeed's files from and into the engine's state. Every
// load (any stage, any source: ZeRO 1/2/3 files, a universal folder; uckpt's
// or DeepSpeed's) goes through LoadEngineCheckpoint, the state fingerprint
// check included.
std::string SaveEngineCheckpoint(Engine::Impl& e, const std::string& dir, const std::string& tag,
                                 const ClientState& client_state, bool async);
LoadResult LoadEngineCheckpoint(Engine::Impl& e, const std::string& dir, const std::string& tag,
                                const LoadCheckpointOptions& options);

}  // namespace engine
}  // namespace uckpt
