#include "engine/grad_numerics.h"

#include <cmath>

#include "engine/cpu_adam.h"

namespace uckpt::engine {

bool AnyRankOverflowed(Comm& comm, const std::vector<at::Tensor>& grads, at::Device device) {
  at::Tensor bad = at::zeros({1}, at::TensorOptions().dtype(at::kFloat).device(device));
  for (const at::Tensor& g : grads)
    bad = at::maximum(bad, g.isfinite().logical_not().any().to(at::kFloat).reshape({1}).to(device));
  comm.AllReduceMax(bad);
  return bad.item<float>() > 0;
}

at::Tensor PieceNorms(const at::Tensor& grad, const std::vector<GradPiece>& pieces, at::Device device,
                      int64_t span_elements) {
  if (pieces.empty()) return at::empty({0}, at::TensorOptions().dtype(at::kDouble).device(device));
  std::vector<at::Tensor> norms;
  if (grad.device().is_cpu() && !device.is_cpu()) {
    std::vector<std::pair<int64_t, int64_t>> ranges;
    for (const GradPiece& p : pieces) ranges.emplace_back(p.offset, p.numel);
    for (double sum : PieceSumsOfSquares(grad, ranges)) norms.push_back(at::scalar_tensor(std::sqrt(sum), at::kDouble));
    return at::stack(norms);
  }
  for (size_t i = 0; i < pieces.size();) {
    const int64_t begin = pieces[i].offset;
    size_t j = i + 1;
    while (j < pieces.size() && pieces[j].offset >= pieces[j - 1].offset + pieces[j - 1].numel &&
           pieces[j].offset + pieces[j].numel - begin <= span_elements)
      ++j;
    const int64_t end = pieces[j - 1].offset + pieces[j - 1].numel;
    const at::Tensor wide = grad.narrow(0, begin, end - begin).to(device).to(at::kDouble);
    for (; i < j; ++i) norms.push_back(at::norm(wide.narrow(0, pieces[i].offset - begin, pieces[i].numel), 2));
  }
  return at::stack(norms);
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

void UnscaleAndClip::ApplyForClientStep(at::Tensor& grad, bool offloaded) const {
  if (!offloaded) return Apply(grad);
  const double f = host_factor();
  if (f != 1.0) grad.mul_(f);
}

}  // namespace uckpt::engine
