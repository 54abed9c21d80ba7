#include "models/next_token_loss.h"

#include <ATen/Functions.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <stdexcept>

namespace uckpt::models {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Whether log_softmax's kernels read `t` and write fp32 in one pass: only
// CUDA's, and only for fp16 (bf16 and the CPU convert first).
bool HalfToFloat(const at::Tensor& t) { return t.is_cuda() && t.scalar_type() == at::kHalf; }

// log_softmax over the vocabulary, in fp32, of sequences [first, first + n)
// at positions 0..T-2.
at::Tensor Fp32LogSoftmax(const at::Tensor& logits, int64_t first, int64_t n) {
  at::Tensor x = logits.narrow(0, first, n).narrow(1, 0, logits.size(1) - 1);
  if (x.scalar_type() == at::kFloat) return at::_log_softmax(x, 2, /*half_to_float=*/false);
  if (HalfToFloat(x)) return at::_log_softmax(x, 2, /*half_to_float=*/true);
  return at::_log_softmax(x.to(at::kFloat), 2, /*half_to_float=*/false);
}

int64_t SequencesPerChunk(const at::Tensor& logits, int64_t chunk_elements) {
  const int64_t per_sequence = (logits.size(1) - 1) * logits.size(2);
  return std::max<int64_t>(1, chunk_elements / std::max<int64_t>(1, per_sequence));
}

// Forward keeps nothing but the logits; backward recomputes each chunk's
// log-probabilities (one fused kernel) rather than storing them.
struct NextTokenLossFn : public torch::autograd::Function<NextTokenLossFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& logits, const at::Tensor& labels,
                            int64_t chunk_elements) {
    const int64_t B = logits.size(0), T1 = labels.size(1);
    at::Tensor row_loss = at::empty({B, T1}, logits.options().dtype(at::kFloat));
    const int64_t k = SequencesPerChunk(logits, chunk_elements);
    for (int64_t b = 0; b < B; b += k) {
      const int64_t n = std::min(k, B - b);
      at::Tensor logp = Fp32LogSoftmax(logits, b, n);
      row_loss.narrow(0, b, n).copy_(logp.gather(2, labels.narrow(0, b, n).unsqueeze(2)).squeeze(2).neg());
    }
    ctx->save_for_backward({logits, labels});
    ctx->saved_data["chunk_elements"] = chunk_elements;
    return row_loss.mean();
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_out) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &logits = saved[0], &labels = saved[1];
    const int64_t B = logits.size(0), T1 = labels.size(1);
    // nll_loss's backward (-g/N at each label) through log_softmax's backward,
    // as cross_entropy does, a chunk at a time.
    at::Tensor minus_g_over_n = -(grad_out[0].to(at::kFloat) / static_cast<double>(B * T1));
    at::Tensor grad = at::empty_like(logits, at::MemoryFormat::Contiguous);
    grad.narrow(1, T1, 1).zero_();  // the last position predicts nothing
    const at::ScalarType out_dtype = HalfToFloat(logits) ? at::kHalf : at::kFloat;  // copy_ converts the rest
    const int64_t k = SequencesPerChunk(logits, ctx->saved_data["chunk_elements"].toInt());
    for (int64_t b = 0; b < B; b += k) {
      const int64_t n = std::min(k, B - b);
      at::Tensor logp = Fp32LogSoftmax(logits, b, n);
      at::Tensor idx = labels.narrow(0, b, n).unsqueeze(2);
      at::Tensor nll_grad = at::zeros_like(logp).scatter_(2, idx, minus_g_over_n.expand(idx.sizes()));
      grad.narrow(0, b, n).narrow(1, 0, T1).copy_(at::_log_softmax_backward_data(nll_grad, logp, 2, out_dtype));
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

}  // namespace uckpt::models
