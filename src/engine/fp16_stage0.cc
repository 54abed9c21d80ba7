// ZeRO stage 0 in fp16 as DeepSpeed 0.14.5 runs it: the engine all-reduces the
// loss-scaled fp16 gradients (communication_data_type fp16), and the optimizer
// is wrapped in FP16_Optimizer (runtime/fp16/fused_optimizer.py, around
// FusedAdam) or FP16_UnfusedOptimizer (unfused_optimizer.py, around any other).
// Both keep fp32 masters (here the group's flat master, PartitionState), take
// one optimizer step on zero gradients when built, and per step: check the
// gradients for inf/nan, update their own loss scale (LossScaler::
// ForFp16Optimizer) and skip the step on overflow, else take the global norm,
// unscale and clip by the updated scale, step the masters and copy them into
// the fp16 weights. The two differ only in how the norm is summed.
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <cmath>
#include <stdexcept>

#include "engine/flat_runtime.h"

namespace uckpt::engine {

void FlatRuntime::Fp16WrapperInitialStep() {
  if (s_.stage0_fp16 == Stage0Fp16::kNone) return;
  std::vector<at::Tensor> zeros;
  std::vector<double> lrs;
  for (Group& g : groups_) {
    zeros.push_back(at::zeros_like(g.state.master));
    lrs.push_back(g.optimizer.lr);  // the optimizer's own: no scheduler has set one yet
  }
  Fp16WrapperUpdate(zeros, lrs);
}

// engine.allreduce_bucket: the fp16 gradients flattened, divided and summed in
// fp16 (postscale by default: over gradient_predivide_factor before the sum,
// by predivide/world after; prescale_gradients: by world before), at one rank too.
at::Tensor FlatRuntime::Fp16WrapperAllReduce(Group& g) {
  c10::NoGradGuard no_grad;
  at::Tensor bucket = g.grad_flat.narrow(0, 0, g.layout.numel).clone();
  const double world = comm_.world_size(), f = s_.gradient_predivide_factor;
  if (s_.prescale_gradients) {
    bucket.mul_(1.0 / world);
    comm_.AllReduceSum(bucket);
  } else {
    if (f != 1.0) bucket.mul_(1.0 / f);
    comm_.AllReduceSum(bucket);
    if (f != world) bucket.mul_(f / world);
  }
  at::Tensor part = at::zeros({g.layout.partition_size}, g.grad_flat.options().dtype(at::kFloat));
  part.narrow(0, 0, g.layout.numel).copy_(bucket);
  return part;
}

// The gradients' global norm before unscaling, as each wrapper sums it:
// FP16_Optimizer (get_flattened_grad_norm) each group's flat fp32 norm squared
// in Python floats, the sum through an fp32 tensor, then ** 0.5;
// FP16_UnfusedOptimizer (get_weight_norm) each parameter's fp32 norm squared
// and summed in fp32 tensors per group, ** 0.5, and the groups in Python floats.
double FlatRuntime::Fp16WrapperScaledNorm() const {
  if (s_.stage0_fp16 == Stage0Fp16::kFused) {
    double sum = 0;
    for (const Group& g : groups_) {
      const double n = at::norm(g.grad_partition.narrow(0, 0, g.layout.numel)).item<float>();
      sum += std::pow(n, 2.0);
    }
    const double all = std::pow(static_cast<double>(static_cast<float>(sum)), 1.0 / 2);
    return std::sqrt(std::pow(all, 2.0));
  }
  double sum = 0;
  for (const Group& g : groups_) {
    float group_sum = 0.0f;
    for (size_t k = 0; k < g.numels.size(); ++k) {
      const float n = at::norm(g.grad_partition.narrow(0, g.offsets[k], g.numels[k])).item<float>();
      group_sum += n * n;
    }
    double group_norm = std::pow(static_cast<double>(group_sum), 1.0 / 2);
    if (std::isinf(group_norm) || std::isnan(group_norm)) group_norm = -1;
    sum += std::pow(group_norm, 2.0);
  }
  return std::sqrt(sum);
}

StepResult FlatRuntime::Fp16WrapperStep(const std::vector<double>& group_lrs) {
  c10::NoGradGuard no_grad;
  StepResult r;
  r.loss_scale = scaler_.cur_scale;
  // The reduced gradients are the same on every rank: each finds the same overflow.
  bool overflow = false;
  for (const Group& g : groups_) overflow = overflow || !at::isfinite(g.grad_partition).all().item<bool>();
  scaler_.Update(overflow);
  if (overflow) {  // the gradients dropped; the norm DeepSpeed reports stays the last step's
    for (Group& g : groups_) DropGradient(g), g.grad_partition = at::Tensor();
    r.skipped = true;
    r.grad_norm = fp16_wrapper_norm_;
    return r;
  }
  const double scaled_norm = Fp16WrapperScaledNorm();
  // Unscaled by the scale the update above left (a step where it grew divides by the new one).
  const double scale = scaler_.cur_scale;
  // The norm DeepSpeed reports: FP16_Optimizer's unscaled, FP16_UnfusedOptimizer's as the gradients carry the scale.
  fp16_wrapper_norm_ = s_.stage0_fp16 == Stage0Fp16::kFused ? scaled_norm / scale : scaled_norm;
  r.grad_norm = fp16_wrapper_norm_;
  double combined = scale;
  if (s_.gradient_clipping > 0) {
    const double clip = ((scaled_norm / scale) + 1e-6) / s_.gradient_clipping;
    if (clip > 1) combined = clip * scale;
  }
  std::vector<at::Tensor> grads;
  for (Group& g : groups_) {
    grads.push_back(g.grad_partition.mul_(1.0 / combined));
    DropGradient(g);
    g.grad_partition = at::Tensor();
  }
  Fp16WrapperUpdate(grads, group_lrs);
  WeightsFromMasters();
  return r;
}

// The wrapped optimizer's step on the masters: the engine's Adam (FusedAdam's,
// torch's) or the client's optimizer.
void FlatRuntime::Fp16WrapperUpdate(const std::vector<at::Tensor>& grads, const std::vector<double>& group_lrs) {
  c10::NoGradGuard no_grad;
  if (!s_.optimizer_step) {
    for (size_t gi = 0; gi < groups_.size(); ++gi) AdamStep(groups_[gi], grads[gi], group_lrs[gi]);
    return;
  }
  std::vector<PartitionState*> states;
  std::vector<size_t> ids;
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    states.push_back(&groups_[gi].state);
    ids.push_back(gi);
  }
  RunOptimizerStep(s_.optimizer_step, states, grads, ids, group_lrs);
}

}  // namespace uckpt::engine
