// The engine's state: Engine's own (engine.cc, engine_roles.cc), with the
// parts its helpers take on their own (ModuleTensors, StepCounters). Not
// installed: users see include/uckpt/engine.h only.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "engine/config.h"
#include "engine/lr_schedule.h"
#include "engine/module_tensors.h"
#include "engine/sharded_runtime.h"
#include "uckpt/engine.h"

namespace uckpt {

namespace engine {
class CheckpointWriter;  // async_save.h
}

// The engine's state: the module's tensors and the counters (the parts the
// engine's helpers take on their own), and the rest, which only the Engine's
// files touch.
struct Engine::Impl : engine::ModuleTensors, engine::StepCounters {
  std::shared_ptr<Comm> comm;
  bool owns_comm = false;  // made from the environment: the engine ends it (Finish) on a clean destruction
  engine::TrainConfig config;
  at::Device device = at::kCPU;
  int local_rank = 0;
  engine::BatchSizes batch;

  std::map<const void*, std::vector<at::Tensor>> gathered_frozen;  // stage 3: frozen values before GatheredParameters

  std::unique_ptr<engine::ShardedRuntime> runtime;  // this rank's partitions and the step (sharded_runtime.h)
  bool client_optimizer = false;  // EngineOptions::optimizer_step steps: PartitionState::named holds the state
  std::function<c10::IValue(size_t)> client_param_group;       // EngineOptions::optimizer_param_group
  engine::Stage0Fp16 stage0_fp16 = engine::Stage0Fp16::kNone;  // DeepSpeed's fp16 wrapper at stage 0, if any
  // Expires with the engine: unit_calls() a model keeps then fail cleanly.
  std::shared_ptr<int> alive = std::make_shared<int>(0);
  engine::LrSchedule schedule;
  bool backward_pending = false;          // Backward since the last Step
  std::optional<bool> boundary_override;  // SetGradientAccumulationBoundary
  bool step_applied = false;              // the last Step updated the weights
  StepInfo last;
  std::shared_ptr<engine::CheckpointWriter> writer;  // this rank's files of the last save (async_save.h)
  // SaveCheckpointOptions::memory_snapshot's saves: a writer of their own, so
  // that a snapshot neither waits for a save to disk nor delays one.
  std::shared_ptr<engine::CheckpointWriter> snapshot_writer;
  SaveStats last_save;
  LoadStats last_load;

  explicit Impl(engine::TrainConfig c) : config(std::move(c)), schedule(config.scheduler, config.optimizer.lr) {}

  int stage() const { return config.zero.stage; }
  // OneCycle's betas (lr_schedule.h), written into every group with its lr.
  void ApplyScheduledBetas() {
    const auto& b = schedule.current_betas();
    if (!b) return;
    for (size_t g = 0; g < runtime->num_groups(); ++g) {
      engine::OptimizerConfig o = runtime->optimizer_config(g);
      o.beta1 = b->first;
      o.beta2 = b->second;
      runtime->set_optimizer_config(g, o);
    }
  }
  bool boundary() const {
    return boundary_override ? *boundary_override : (micro_steps + 1) % batch.gradient_accumulation_steps == 0;
  }
};

namespace engine {

// engine.cc: the communicator an Engine without EngineOptions::comm makes
// (RANK, WORLD_SIZE, ... or an MPI/Slurm launcher's; one process without).
std::shared_ptr<Comm> CommFromEnvironment(const TrainConfig& c, bool cuda);

}  // namespace engine
}  // namespace uckpt
