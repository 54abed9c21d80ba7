// The sharded runtime: what one rank runs of ZeRO data parallelism, behind
// one interface that stages 0-2 (flat_runtime.h: flat group buffers) and
// stage 3 (zero3_runtime.h: every parameter partitioned on its own) implement.
//
// Its centre is the list of partition slots this rank owns: each an fp32
// master with Adam's moments and step (PartitionState) and the elements of
// the parameters it holds (ckpt::PartitionTarget, the layout the checkpoint
// planners read). Around it: the micro-step (PrepareBackward, backward,
// FinishBackward), the optimizer step with its loss scaler, the groups'
// hyper-parameters, and the weights made from the masters or the masters
// from the weights. Stage 3 also gathers and frees the parameters
// themselves (gather units); at stages 0-2 those calls do nothing.
#pragma once

#include <ATen/ATen.h>

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "ckpt/reshard.h"
#include "engine/config.h"
#include "engine/loss_scaler.h"

namespace uckpt::engine {

// The optimizer state of one partition (DeepSpeed's base_optimizer_state
// entry + its fp32 partition): stages 1/2 one per group, stage 3 one per sub-group.
struct PartitionState {
  at::Tensor master;      // [P] fp32 master weights (padding zeros included)
  at::Tensor exp_avg;     // [P] fp32, undefined before the first step
  at::Tensor exp_avg_sq;  // [P] fp32
  at::Tensor step;        // 0-d fp32 tensor (torch Adam's step), undefined before the first step
};

// One partition this rank owns: a group's flat partition (stages 0-2) or a
// sub-group's (stage 3), the parameters whose elements it holds, and the
// parameter whose saved step is its Adam step.
struct PartitionSlot {
  size_t group = 0;  // the optimizer group it belongs to
  ckpt::PartitionTarget target;
  PartitionState* state = nullptr;
  std::string step_param;
};

struct StepResult {
  double grad_norm = 0;   // pre-clipping global norm of the averaged gradient (-1 on inf/nan)
  bool skipped = false;   // fp16 overflow: nothing was updated
  double loss_scale = 1;  // the scale the step's gradients carried
};

class FlatRuntime;
class Zero3Runtime;

class ShardedRuntime {
 public:
  virtual ~ShardedRuntime() = default;

  // ---- The partitions this rank owns.
  virtual std::vector<PartitionSlot> Slots() = 0;
  // The ranks the partitions are split over (1 at stage 0, where every rank
  // holds everything) and this rank's place among them.
  virtual int partition_dp() const = 0;
  virtual int partition_rank() const = 0;

  // ---- Hyper-parameters and the loss scale.
  virtual size_t num_groups() const = 0;
  virtual const OptimizerConfig& optimizer_config(size_t g) const = 0;
  // Replaces lr-independent Adam hyper-parameters (betas, eps, weight decay)
  // of group g for the following steps: --keep-saved-hparams restores a checkpoint's.
  virtual void set_optimizer_config(size_t g, const OptimizerConfig& o) = 0;
  virtual LossScaler& loss_scaler() = 0;
  virtual const LossScaler& loss_scaler() const = 0;
  // The loss multiplier for backward (the fp16 loss scale; 1 otherwise).
  double loss_scale() const { return loss_scaler().cur_scale; }

  // ---- Training.
  // Before each micro-batch's backward.
  virtual void PrepareBackward() = 0;
  // After it: its gradients reduced into their owners' partitions (or kept
  // for the reduction at the boundary, the last micro-batch of a step).
  virtual void FinishBackward(bool boundary) = 0;
  // The optimizer step with learning rate group_lrs[g] in group g, then the
  // weights from the updated masters.
  virtual StepResult Step(const std::vector<double>& group_lrs) = 0;

  // ---- Weights and masters (after a load wrote one or the other).
  virtual void WeightsFromMasters() = 0;
  virtual void MastersFromWeights() = 0;

  // ---- Parameters gathered and freed (stage 3; elsewhere they are always whole).
  virtual bool partitions_parameters() const { return false; }
  virtual size_t num_gather_units() const { return 0; }
  virtual at::Tensor EnterUnit(size_t unit, const at::Tensor& input) { return input; }
  virtual at::Tensor ExitUnit(size_t unit, const at::Tensor& output) { return output; }
  virtual void GatherAll() {}
  virtual void ReleaseAll() {}
  // GatheredParameters over `params` (any tensors; those that are not the
  // runtime's partitioned parameters are skipped). See Engine::ReleaseParameters.
  virtual void GatherParameters(const std::vector<at::Tensor>& params) {}
  virtual void ReleaseParameters(const std::vector<at::Tensor>& params, int modifier_rank) {}

  // ---- What only one kind has (nullptr otherwise): stages 0-2's flat group
  // buffers (the 16-bit weights the checkpoint's module entries view), stage
  // 3's parameters, sub-groups and gather statistics.
  virtual FlatRuntime* flat() { return nullptr; }
  const FlatRuntime* flat() const { return const_cast<ShardedRuntime*>(this)->flat(); }
  virtual Zero3Runtime* stage3() { return nullptr; }
  const Zero3Runtime* stage3() const { return const_cast<ShardedRuntime*>(this)->stage3(); }
};

// The model's dtype under `c`: fp16, bf16 or fp32.
at::ScalarType ModelDtype(const TrainConfig& c);

}  // namespace uckpt::engine
