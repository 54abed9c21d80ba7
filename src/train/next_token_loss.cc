#include "train/next_token_loss.h"

#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <stdexcept>

namespace uckpt::train {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Sequences [first, first + n) of the logits for positions 0..T-2, in fp32.
at::Tensor Fp32Rows(const at::Tensor& logits, int64_t first, int64_t n) {
  return logits.narrow(0, first, n).narrow(1, 0, logits.size(1) - 1).to(at::kFloat, /*non_blocking=*/false, /*copy=*/true);
}

int64_t SequencesPerChunk(const at::Tensor& logits, int64_t chunk_elements) {
  const int64_t per_sequence = (logits.size(1) - 1) * logits.size(2);
  return std::max<int64_t>(1, chunk_elements / std::max<int64_t>(1, per_sequence));
}

struct NextTokenLossFn : public torch::autograd::Function<NextTokenLossFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& logits, const at::Tensor& labels,
                            int64_t chunk_elements) {
    const int64_t B = logits.size(0), T1 = labels.size(1);
    const auto f32 = logits.options().dtype(at::kFloat);
    at::Tensor lse = at::empty({B, T1}, f32), row_loss = at::empty({B, T1}, f32);
    const int64_t k = SequencesPerChunk(logits, chunk_elements);
    for (int64_t b = 0; b < B; b += k) {
      const int64_t n = std::min(k, B - b);
      at::Tensor x = Fp32Rows(logits, b, n);
      at::Tensor l = at::logsumexp(x, {-1});
      at::Tensor target = x.gather(2, labels.narrow(0, b, n).unsqueeze(2)).squeeze(2);
      lse.narrow(0, b, n).copy_(l);
      row_loss.narrow(0, b, n).copy_(l - target);
    }
    ctx->save_for_backward({logits, labels, lse});
    ctx->saved_data["chunk_elements"] = chunk_elements;
    return row_loss.mean();
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_out) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &logits = saved[0], &labels = saved[1], &lse = saved[2];
    const int64_t B = logits.size(0), T1 = labels.size(1);
    // d mean / d logits = (softmax - onehot(label)) / (B * (T-1)), times the incoming gradient.
    at::Tensor scale = grad_out[0].to(at::kFloat) / static_cast<double>(B * T1);
    at::Tensor grad = at::empty_like(logits, at::MemoryFormat::Contiguous);
    grad.narrow(1, T1, 1).zero_();  // the last position predicts nothing
    const int64_t k = SequencesPerChunk(logits, ctx->saved_data["chunk_elements"].toInt());
    for (int64_t b = 0; b < B; b += k) {
      const int64_t n = std::min(k, B - b);
      at::Tensor p = Fp32Rows(logits, b, n);
      p.sub_(lse.narrow(0, b, n).unsqueeze(2)).exp_();
      at::Tensor idx = labels.narrow(0, b, n).unsqueeze(2);
      p.scatter_add_(2, idx, at::full(idx.sizes(), -1.0, p.options()));
      p.mul_(scale);
      grad.narrow(0, b, n).narrow(1, 0, T1).copy_(p);
    }
    return {grad, at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor NextTokenLoss(const at::Tensor& logits, const at::Tensor& input_ids, int64_t chunk_elements) {
  if (logits.dim() != 3 || input_ids.dim() != 2 || logits.size(0) != input_ids.size(0) ||
      logits.size(1) != input_ids.size(1) || logits.size(1) < 2)
    throw std::invalid_argument("NextTokenLoss: need logits [B, T, V] and input_ids [B, T] with T >= 2");
  at::Tensor labels = input_ids.narrow(1, 1, input_ids.size(1) - 1).contiguous();
  return NextTokenLossFn::apply(logits, labels, chunk_elements);
}

}  // namespace uckpt::train
