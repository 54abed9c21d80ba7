// The step's gradient numerics, shared by every stage, each as DeepSpeed
// computes it: the fp16 overflow check, the global gradient norm and
// unscale_and_clip_grads. The stages differ only in the dtype DeepSpeed sums
// the norm in (fp32 at stages 1/2, fp64 at stage 3), which they pass in.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

#include "uckpt/comm.h"

namespace uckpt::engine {

// Whether any rank's `grads` hold an inf or a nan: one all-reduce (max) of a
// flag on `device` (NCCL reduces device tensors only).
bool AnyRankOverflowed(Comm& comm, const std::vector<at::Tensor>& grads, at::Device device);

// One parameter's elements in a gradient partition (stages 1/2: its fragment
// on this rank; stage 3: its partition).
struct GradPiece {
  int64_t offset = 0, numel = 0;
};

// DeepSpeed's per-piece gradient norms, every stage's: each piece of `grad`
// in fp64, its 2-norm, stacked in one 1-D fp64 tensor (empty when there are
// none). A host `grad` of a model on a device (offload) is measured where it
// lives, accumulated in fp64 without a copy; otherwise the norms are taken
// on `device`, converting consecutive pieces to fp64 together up to
// `span_elements` at a time (fewer conversions, bounded temporary memory; a
// larger piece alone; 0: each piece alone).
at::Tensor PieceNorms(const at::Tensor& grad, const std::vector<GradPiece>& pieces, at::Device device,
                      int64_t span_elements);

// DeepSpeed's get_grad_norm_direct for one group: `piece_norms` (PieceNorms:
// 1-D fp64, the L2 norm of each parameter's piece of the partition) squared
// and summed, in `dtype` on `device`, summed over the ranks when
// `all_reduce`, ** 0.5.
at::Tensor GroupGradNormStacked(Comm& comm, const at::Tensor& piece_norms, at::ScalarType dtype, at::Device device,
                                bool all_reduce);

// The global norm: the L2 norm over the groups' norms (0-d, their dtype);
// `finite` false when a group's norm is inf or nan.
at::Tensor GlobalGradNorm(const std::vector<at::Tensor>& group_norms, bool* finite);

// unscale_and_clip_grads for gradients that carry `loss_scale` and whose
// global norm (before unscaling) is `scaled_norm`: with clipping > 0 the
// factor 1 / (loss_scale * max(1, (norm / loss_scale + 1e-6) / clipping)),
// computed with DeepSpeed's tensor arithmetic in scaled_norm's dtype; without
// clipping 1 / loss_scale.
class UnscaleAndClip {
 public:
  UnscaleAndClip(const at::Tensor& scaled_norm, double loss_scale, double clipping);
  // grad *= the factor, in place on grad's device.
  void Apply(at::Tensor& grad) const;
  // The same factor for a fused host pass (cpu_adam.h's grad_scale), rounded
  // to scaled_norm's dtype as the tensor arithmetic rounds it.
  double host_factor() const;
  // A client optimizer's gradient: in host memory under offload_optimizer,
  // scaled by host_factor() (the product the fused host pass takes), else Apply.
  void ApplyForClientStep(at::Tensor& grad, bool offloaded) const;

 private:
  at::Tensor factor_;  // 0-d, scaled_norm's dtype; undefined without clipping
  double loss_scale_;
  at::ScalarType dtype_;
};

}  // namespace uckpt::engine
