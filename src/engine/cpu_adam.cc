#include "engine/cpu_adam.h"

#include <ATen/Parallel.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "ckpt/state_keys.h"

namespace uckpt::engine {
namespace {

void CheckHostFloat(const at::Tensor& t, const char* what, int64_t n) {
  if (!t.device().is_cpu() || t.scalar_type() != at::kFloat || !t.is_contiguous() || t.numel() != n)
    throw std::invalid_argument(std::string("CpuAdamStep: ") + what + " must be a contiguous host fp32 tensor of " +
                                std::to_string(n) + " elements");
}

void CheckHostGradient(const at::Tensor& t, int64_t n) {
  const at::ScalarType d = t.scalar_type();
  if (!t.device().is_cpu() || (d != at::kFloat && d != at::kBFloat16 && d != at::kHalf) || !t.is_contiguous() ||
      t.numel() != n)
    throw std::invalid_argument("CpuAdamStep: the gradient must be a contiguous host fp32, bf16 or fp16 tensor of " +
                                std::to_string(n) + " elements");
}

// The kernel's view of a host gradient (fp32 always zeroed behind the update;
// bf16/fp16 only when zero_16bit).
host_adam::Grad KernelGrad(const at::Tensor& grad, bool zero_16bit) {
  switch (grad.scalar_type()) {
    case at::kFloat: return {grad.data_ptr(), host_adam::GradElems::kFloat, true};
    case at::kBFloat16: return {grad.data_ptr(), host_adam::GradElems::kBFloat16, zero_16bit};
    case at::kHalf: return {grad.data_ptr(), host_adam::GradElems::kHalf, zero_16bit};
    default:
      throw std::invalid_argument(std::string("cpu_adam: needs fp32, bf16 or fp16 elements, got ") +
                                  c10::toString(grad.scalar_type()));
  }
}

host_adam::WeightElems KernelWeights(at::ScalarType dtype) {
  return dtype == at::kHalf ? host_adam::WeightElems::kHalf : host_adam::WeightElems::kBFloat16;
}

// RunInto's pieces: host tensors of one 16-bit dtype, in order, inside [0, n).
at::ScalarType CheckWeightOuts(const std::vector<CpuAdamPass::WeightOut>& pieces, int64_t n) {
  const at::ScalarType dtype = pieces.empty() ? at::kBFloat16 : pieces[0].out.scalar_type();
  int64_t done = 0;
  for (const CpuAdamPass::WeightOut& w : pieces) {
    const at::Tensor& t = w.out;
    if (!t.defined() || !t.device().is_cpu() || !t.is_contiguous() || t.scalar_type() != dtype ||
        (dtype != at::kBFloat16 && dtype != at::kHalf))
      throw std::invalid_argument(
          "CpuAdamPass::RunInto: every piece's weights must be a contiguous host tensor, "
          "all bf16 or all fp16");
    if (w.begin < done || w.begin + t.numel() > n)
      throw std::invalid_argument("CpuAdamPass::RunInto: piece [" + std::to_string(w.begin) + ", " +
                                  std::to_string(w.begin + t.numel()) + ") overlaps the one before it or ends past " +
                                  std::to_string(n) + " (pieces must be in order)");
    done = w.begin + t.numel();
  }
  return dtype;
}

}  // namespace

double SumOfSquares(const at::Tensor& t) {
  if (!t.device().is_cpu() || t.scalar_type() != at::kFloat || !t.is_contiguous())
    throw std::invalid_argument("SumOfSquares: needs a contiguous host fp32 tensor");
  return host_adam::SumOfSquares(t.data_ptr<float>(), t.numel(), at::get_num_threads());
}

std::vector<double> PieceSumsOfSquares(const at::Tensor& t, const std::vector<std::pair<int64_t, int64_t>>& pieces) {
  if (!t.device().is_cpu() || !t.is_contiguous())
    throw std::invalid_argument("PieceSumsOfSquares: needs a contiguous host tensor, got one on " + t.device().str());
  const host_adam::Grad g = KernelGrad(t, /*zero_16bit=*/false);
  return host_adam::PieceSumsOfSquares(g.data, g.elems, t.numel(), pieces, at::get_num_threads());
}

void CpuAdamStep(PartitionState& st, const at::Tensor& grad, double grad_scale, const OptimizerConfig& o, double lr) {
  CpuAdamStep(st, grad, grad_scale, o, lr, 0, nullptr, nullptr);
}

void CpuAdamStep(PartitionState& st, const at::Tensor& grad, double grad_scale, const OptimizerConfig& o, double lr,
                 int64_t range, const std::function<void(int64_t begin, int64_t end)>& range_done) {
  CpuAdamStep(st, grad, grad_scale, o, lr, range, nullptr, range_done);
}

void CpuAdamStep(PartitionState& st, const at::Tensor& grad, double grad_scale, const OptimizerConfig& o, double lr,
                 int64_t range, const std::function<at::Tensor(int64_t begin, int64_t end)>& range_out,
                 const std::function<void(int64_t begin, int64_t end)>& range_done) {
  const CpuAdamPass pass(st, grad, grad_scale, o, lr);
  const int64_t n = pass.numel();
  if (range <= 0 || !range_done) return pass.Run(0, n);
  for (int64_t first = 0; first < n; first += range) {
    const int64_t len = std::min(range, n - first);
    pass.Run(first, first + len, range_out ? range_out(first, first + len) : at::Tensor());
    range_done(first, first + len);
  }
}

CpuAdamPass::CpuAdamPass(PartitionState& st, const at::Tensor& grad, double grad_scale, const OptimizerConfig& o,
                         double lr, bool zero_16bit_grad)
    : grad_(grad), n_(st.master.numel()), threads_(at::get_num_threads()), zero_16bit_grad_(zero_16bit_grad) {
  c10::NoGradGuard no_grad;
  CheckHostFloat(st.master, "the master", n_);
  CheckHostGradient(grad, n_);
  if (!st.step.defined()) {
    st.step = at::zeros({}, st.master.options());
    st.exp_avg = at::zeros_like(st.master);
    st.exp_avg_sq = at::zeros_like(st.master);
  }
  CheckHostFloat(st.exp_avg, ckpt::kExpAvg, n_);
  CheckHostFloat(st.exp_avg_sq, ckpt::kExpAvgSq, n_);
  st.step.add_(1);
  const double step = st.step.item<float>();
  // The scalars as torch computes them: in double on the host, then used by
  // the fp32 kernels as floats.
  // bias_correction false (DeepSpeed's Adam): step size lr, denominator sqrt(v) + eps.
  const double bias_correction1 = o.bias_correction ? 1 - std::pow(o.beta1, step) : 1.0;
  const double bias_correction2 = o.bias_correction ? 1 - std::pow(o.beta2, step) : 1.0;
  s_.grad_scale = static_cast<float>(grad_scale);
  s_.decoupled = o.decoupled_weight_decay;
  s_.decay = static_cast<float>(1 - lr * o.weight_decay);
  s_.weight_decay = o.decoupled_weight_decay ? 0.0f : static_cast<float>(o.weight_decay);
  s_.beta1 = static_cast<float>(o.beta1);
  s_.one_minus_beta1 = static_cast<float>(1 - o.beta1);
  s_.beta2 = static_cast<float>(o.beta2);
  s_.one_minus_beta2 = static_cast<float>(1 - o.beta2);
  s_.bias_correction2_sqrt = static_cast<float>(std::sqrt(bias_correction2));
  s_.eps = static_cast<float>(o.eps);
  s_.neg_step_size = static_cast<float>(-(lr / bias_correction1));
  p_ = st.master.data_ptr<float>();
  m_ = st.exp_avg.data_ptr<float>();
  v_ = st.exp_avg_sq.data_ptr<float>();
}

void CpuAdamPass::Run(int64_t begin, int64_t end, const at::Tensor& out, int threads) const {
  if (begin < 0 || end > n_ || begin > end)
    throw std::out_of_range("CpuAdamPass: range [" + std::to_string(begin) + ", " + std::to_string(end) +
                            ") outside the partition of " + std::to_string(n_));
  if (threads <= 0) threads = threads_;
  const int64_t len = end - begin;
  const host_adam::Grad g = KernelGrad(grad_, zero_16bit_grad_);
  if (!out.defined()) return host_adam::Update(s_, p_, m_, v_, g, begin, end, nullptr, {}, threads);
  const at::ScalarType d = out.scalar_type();
  if (!out.device().is_cpu() || !out.is_contiguous() || out.numel() != len || (d != at::kBFloat16 && d != at::kHalf))
    throw std::invalid_argument("CpuAdamStep: a range's copy must be a contiguous host bf16 or fp16 tensor of " +
                                std::to_string(len) + " elements");
  const host_adam::WeightPiece piece{begin, len, static_cast<uint16_t*>(out.data_ptr())};
  host_adam::Update(s_, p_, m_, v_, g, begin, end, &piece, KernelWeights(d), threads);
}

void CpuAdamPass::RunInto(const std::vector<WeightOut>& pieces, int threads) const {
  const at::ScalarType dtype = CheckWeightOuts(pieces, n_);
  if (threads <= 0) threads = threads_;
  std::vector<host_adam::WeightPiece> bits;
  bits.reserve(pieces.size());
  for (const WeightOut& w : pieces) bits.push_back({w.begin, w.out.numel(), static_cast<uint16_t*>(w.out.data_ptr())});
  host_adam::UpdateInto(s_, p_, m_, v_, KernelGrad(grad_, zero_16bit_grad_), n_, bits, KernelWeights(dtype), threads);
}

}  // namespace uckpt::engine
