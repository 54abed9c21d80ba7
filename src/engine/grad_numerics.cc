#include "engine/grad_numerics.h"

namespace uckpt::engine {

bool AnyRankOverflowed(Comm& comm, const std::vector<at::Tensor>& grads, at::Device device) {
  at::Tensor bad = at::zeros({1}, at::TensorOptions().dtype(at::kFloat).device(device));
  for (const at::Tensor& g : grads)
    bad = at::maximum(bad, g.isfinite().logical_not().any().to(at::kFloat).reshape({1}).to(device));
  comm.AllReduceMax(bad);
  return bad.item<float>() > 0;
}

at::Tensor GroupGradNormStacked(Comm& comm, const at::Tensor& piece_norms, at::ScalarType dtype, at::Device device,
                         bool all_reduce) {
  at::Tensor total = piece_norms.numel() == 0 ? at::zeros({}, at::TensorOptions().dtype(dtype).device(device))
                                              : piece_norms.square().sum().to(device, dtype);
  if (all_reduce) {
    at::Tensor t = total.reshape({1});
    comm.AllReduceSum(t);
    total = t.reshape({});
  }
  return total.pow(1.0 / 2.0);
}

at::Tensor GroupGradNorm(Comm& comm, const std::vector<at::Tensor>& piece_norms, at::ScalarType dtype,
                         at::Device device, bool all_reduce) {
  const at::Tensor stacked = piece_norms.empty() ? at::empty({0}, at::TensorOptions().dtype(at::kDouble).device(device))
                                                 : at::stack(piece_norms);
  return GroupGradNormStacked(comm, stacked, dtype, device, all_reduce);
}

at::Tensor GlobalGradNorm(const std::vector<at::Tensor>& group_norms, bool* finite) {
  at::Tensor norms = at::stack(group_norms);
  *finite = norms.isfinite().all().item<bool>();
  return at::linalg_vector_norm(norms, 2);
}

UnscaleAndClip::UnscaleAndClip(const at::Tensor& scaled_norm, double loss_scale, double clipping)
    : loss_scale_(loss_scale), dtype_(scaled_norm.scalar_type()) {
  if (clipping <= 0) return;
  at::Tensor clip = ((scaled_norm / loss_scale) + 1e-6) / clipping;
  clip = at::clamp_min(clip, 1.0);
  at::Tensor combined = clip * loss_scale;
  factor_ = at::reciprocal(combined) * 1.0;
}

void UnscaleAndClip::Apply(at::Tensor& grad) const {
  if (factor_.defined()) {
    grad.mul_(factor_.to(grad.device()));
  } else {
    grad.mul_(1.0 / loss_scale_);
  }
}

double UnscaleAndClip::host_factor() const {
  if (factor_.defined()) return factor_.item<double>();
  const double f = 1.0 / loss_scale_;
  return dtype_ == at::kFloat ? static_cast<double>(static_cast<float>(f)) : f;
}

}  // namespace uckpt::engine
