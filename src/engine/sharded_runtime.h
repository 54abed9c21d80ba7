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
#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "ckpt/reshard.h"
#include "engine/config.h"
#include "engine/loss_scaler.h"
#include "uckpt/engine.h"

namespace uckpt::engine {

// The optimizer state of one partition (DeepSpeed's base_optimizer_state
// entry + its fp32 partition): stages 1/2 one per group, stage 3 one per sub-group.
// The engine's Adam keeps its state in the fixed fields; any other optimizer
// (an element-wise step a client supplies, EngineOptions::optimizer_step) in
// `named`, under that optimizer's own keys.
struct PartitionState {
  at::Tensor master;      // [P] fp32 master weights (padding zeros included)
  at::Tensor exp_avg;     // [P] fp32, undefined before the first step
  at::Tensor exp_avg_sq;  // [P] fp32
  at::Tensor step;        // 0-d fp32 tensor (torch Adam's step), undefined before the first step
  // Another optimizer's state in the order it made it: [P] fp32 tensors
  // ("momentum_buffer", "sum") and 0-d scalars ("step", "mu_product"); an
  // undefined tensor is a state torch keeps as None (SGD's momentum_buffer
  // without momentum: saved so only at stage 0, where the file is torch's
  // own state_dict). Empty before its first step.
  std::vector<std::pair<std::string, at::Tensor>> named;
};

// A partition's optimizer state under its keys, whichever optimizer made it:
// Adam's step, exp_avg, exp_avg_sq (torch's order), else `named` without
// its None states. Empty before the first step.
std::vector<std::pair<std::string, at::Tensor>> OptimizerStates(const PartitionState& st);
// Of them, the per-element ones ([P] tensors), keys sorted (the fingerprint's order).
std::vector<std::pair<std::string, at::Tensor>> ElementStates(const PartitionState& st);
// The optimizer's step as saved ("step"), if it keeps one.
std::optional<double> StepOf(const PartitionState& st);

// ZeRO stage 0 in fp16 with an optimizer: the wrapper DeepSpeed puts it in, whose loss
// scaling, first step and checkpoint entries the runtime keeps (fp16_stage0.cc):
// FP16_Optimizer around DeepSpeed's FusedAdam (the config's Adam/AdamW without
// torch_adam), FP16_UnfusedOptimizer around any other (torch's, a client's).
enum class Stage0Fp16 { kNone, kFused, kUnfused };
Stage0Fp16 Stage0Fp16Of(const TrainConfig& c, bool client_optimizer, bool forward_only);

// Elements per piece of the step's whole-partition element-wise work (Adam's
// update; a 16-bit gradient added into the fp32 sum): the temporaries are a
// piece's, not the partition's. 64 MiB of fp32: few kernel launches.
constexpr int64_t kStepChunkElements = int64_t{1} << 24;

// What either runtime is built with (stage 3 adds its own: Zero3Settings).
struct ZeroSettings {
  int stage = 1;
  double gradient_clipping = 0.0;
  OptimizerConfig optimizer;
  at::ScalarType model_dtype = at::kFloat;  // kFloat, kBFloat16 or kHalf
  // What a stage-3 rank sums its micro-steps' reduced gradients in (DeepSpeed's grad_accum_dtype:
  // the model's unless the config says fp32). Stages 1-2 sum in the model dtype whatever it says,
  // as DeepSpeed 0.14.5 does. The reductions themselves are in the model dtype at stages 1-3.
  at::ScalarType grad_accum_dtype = at::kFloat;
  Fp16Config fp16;                         // used when model_dtype is kHalf
  bool offload_optimizer_cpu = false;      // master + moments in host memory
  int64_t reduce_bucket_size = 500000000;  // elements reduced per collective
  bool overlap_comm = false;               // stage 2: overlap_reducer.h; stage 3: zero3_reduce.cc
  // Stage 0's averaging over the ranks (TrainConfig::prescale_gradients, gradient_predivide_factor).
  bool prescale_gradients = false;
  double gradient_predivide_factor = 1.0;
  // Set: the update of every step instead of Adam (EngineOptions::optimizer_step).
  OptimizerStepFn optimizer_step;
  Stage0Fp16 stage0_fp16 = Stage0Fp16::kNone;
  // Bounds on the step's temporaries (no config key; tests shrink them to
  // measure memory at small sizes): the pieces of kStepChunkElements above,
  // and the elements of a stage 1/2 gradient partition converted to fp64 at
  // once for its fragments' norms (256 MiB; a larger fragment alone).
  int64_t step_chunk_elements = kStepChunkElements;
  int64_t norm_span_elements = int64_t{1} << 25;
};

// Hands every partition with its gradient to settings.optimizer_step:
// `grads[i]` (unscaled and clipped) is partition states[i]'s of group
// groups[i], stepped with group_lrs[group]. The gradients' .grad bindings
// are the callee's business; the states' `named` are updated.
void RunOptimizerStep(const OptimizerStepFn& step, const std::vector<PartitionState*>& states,
                      const std::vector<at::Tensor>& grads, const std::vector<size_t>& groups,
                      const std::vector<double>& group_lrs);

// One optimizer parameter group: its parameters' sizes in flat order and its
// own hyper-parameters (lr comes from the schedule at each step); their names
// and shapes when known (the partition slots name them; else "" and [numel]).
struct GroupSpec {
  std::vector<int64_t> numels;
  OptimizerConfig optimizer;
  std::vector<std::string> names;
  std::vector<std::vector<int64_t>> shapes;
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
  // Before each micro-batch's backward: whether it is the last of its step
  // (a hint for where gradients go during backward; nothing depends on it).
  virtual void BeginMicroStep(bool boundary) {}
  // Before each micro-batch's backward.
  virtual void PrepareBackward() = 0;
  // After it: its gradients reduced into their owners' partitions (or kept
  // for the reduction at the boundary, the last micro-batch of a step).
  virtual void FinishBackward(bool boundary) = 0;
  // The optimizer step with learning rate group_lrs[g] in group g, then the
  // weights from the updated masters.
  virtual StepResult Step(const std::vector<double>& group_lrs) = 0;
  // DeepSpeed's optimizer.step() called by the script where that optimizer is the torch optimizer itself (ZeRO
  // stage 0 in fp32): one update of every parameter from its own .grad (none: zeros), as they are: not averaged
  // over the ranks, not clipped. std::logic_error where the runtime has no such step.
  virtual void StepFromParameterGradients(const std::vector<double>& group_lrs) {
    throw std::logic_error("this optimizer has no step of its own (ZeRO stage 0 in fp32 only)");
  }
  // Returns once the last Step's update is complete where Step returns
  // before it is (EngineOptions::overlap_update_with_forward); rethrows its error.
  virtual void WaitForUpdate() {}
  // Before a load that replaces weights and optimizer state: waits for the
  // update as WaitForUpdate, but a failed one is forgotten, not thrown.
  virtual void ForgetFailedUpdate() {}

  // ---- Weights and masters (after a load wrote one or the other).
  virtual void WeightsFromMasters() = 0;
  virtual void MastersFromWeights() = 0;

  // ---- Parameters gathered and freed (stage 3; elsewhere they are always whole).
  virtual bool partitions_parameters() const { return false; }
  // Whether the model must call EnterUnit/ExitUnit (Engine::unit_calls()).
  virtual bool uses_unit_calls() const { return partitions_parameters(); }
  virtual size_t num_gather_units() const { return 0; }
  virtual at::Tensor EnterUnit(size_t unit, const at::Tensor& input) { return input; }
  virtual at::Tensor ExitUnit(size_t unit, const at::Tensor& output) { return output; }
  virtual void GatherAll() {}
  virtual void ReleaseAll() {}
  // GatheredParameters over `params` (any tensors; those that are not the
  // runtime's partitioned parameters are skipped). See Engine::ReleaseParameters.
  virtual void GatherParameters(const std::vector<at::Tensor>& params) {}
  virtual void ReleaseParameters(const std::vector<at::Tensor>& params, int modifier_rank) {}
  // Each partitioned parameter with this rank's partition of it (empty where
  // parameters are not partitioned one by one).
  virtual std::vector<std::pair<at::Tensor, at::Tensor>> ParameterPartitions() const { return {}; }

  // ---- What the save and the statistics read.
  // Group g's weights as one flat tensor (model dtype) whose views the
  // parameters are: the storage a stage 0-2 checkpoint's module entries view,
  // as DeepSpeed's state_dict of flat-buffer views saves them. Undefined
  // where parameters are partitioned one by one (stage 3).
  virtual at::Tensor group_weights(size_t g) const { return {}; }
  // What gathering and reducing partitioned parameters did (zero at stages 0-2).
  virtual Stage3Stats stats() const { return {}; }  // uckpt/engine.h; all zero where parameters stay whole
  // Times the end of backward, synchronising the device (UCKPT_TIMERS); a
  // no-op where that end has nothing of its own to time.
  virtual void set_timing(bool on) {}
};

// The model's dtype under `c`: fp16, bf16 or fp32.
at::ScalarType ModelDtype(const TrainConfig& c);

}  // namespace uckpt::engine
