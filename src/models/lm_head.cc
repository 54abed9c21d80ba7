#include "models/lm_head.h"

#include <ATen/Functions.h>
#include <torch/csrc/autograd/custom_function.h>

namespace uckpt::models {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr int64_t kIgnoreIndex = -100;  // cross_entropy's default

// The row length of the logits' buffers: V rounded up to 8 elements (16 bytes
// of bf16/fp16) on CUDA, where cuBLAS needs it for its aligned kernels.
int64_t RowLength(const at::Tensor& w) {
  const int64_t v = w.size(0);
  return w.is_cuda() ? (v + 7) / 8 * 8 : v;
}

// w with zero rows appended up to `rows`.
at::Tensor PadRows(const at::Tensor& w, int64_t rows) {
  if (rows == w.size(0)) return w;
  at::Tensor out = at::empty({rows, w.size(1)}, w.options());
  out.narrow(0, 0, w.size(0)).copy_(w);
  out.narrow(0, w.size(0), rows - w.size(0)).zero_();
  return out;
}

struct LmHeadCrossEntropyFn : public torch::autograd::Function<LmHeadCrossEntropyFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& h, const at::Tensor& w, const at::Tensor& labels) {
    const int64_t V = w.size(0);
    at::Tensor logits = at::mm(h, PadRows(w, RowLength(w)).t());  // [N, row length]
    at::Tensor wide = logits.narrow(1, 0, V).to(at::kFloat);
    logits.reset();  // one [N, V] buffer fewer at a time
    at::Tensor logp = at::_log_softmax(wide, 1, /*half_to_float=*/false);
    wide.reset();
    auto [loss, total_weight] = at::nll_loss_forward(logp, labels, {}, at::Reduction::Mean, kIgnoreIndex);
    ctx->save_for_backward({h, w, labels, logp, total_weight});
    return loss;
  }

  // log_softmax's backward of nll_loss's: with s = -g/total_weight on rows
  // whose label counts (else 0), entry (i, j) is [j == label_i] s - exp(logp_ij) s.
  static variable_list backward(AutogradContext* ctx, variable_list grad_out) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &h = saved[0], &w = saved[1], &labels = saved[2], &total_weight = saved[4];
    at::Tensor p = saved[3];  // the log-probabilities, made probabilities in place: not needed after this
    const int64_t V = w.size(0), row = RowLength(w);
    at::Tensor counted = labels.ne(kIgnoreIndex).unsqueeze(1);
    at::Tensor s = at::where(counted, -(grad_out[0].to(at::kFloat) / total_weight), at::zeros({}, p.options()));
    at::Tensor at_label = labels.masked_fill(labels.eq(kIgnoreIndex), 0).unsqueeze(1);
    p.exp_();
    at::Tensor label_grad = s - p.gather(1, at_label) * s;
    at::Tensor g = at::empty({h.size(0), row}, h.options());
    at::Tensor g_v = g.narrow(1, 0, V);
    at::mul_out(g_v, p, -s);  // -(p s) in fp32, rounded to h's dtype as it is written
    g_v.scatter_(1, at_label, label_grad.to(h.scalar_type()));
    if (row > V) g.narrow(1, V, row - V).zero_();
    at::Tensor grad_h = at::mm(g, PadRows(w, row));
    at::Tensor grad_w = at::mm(g.t(), h).narrow(0, 0, V);
    return {grad_h, grad_w, at::Tensor()};
  }
};

}  // namespace

at::Tensor LmHeadCrossEntropy(const at::Tensor& h, const at::Tensor& w, const at::Tensor& labels) {
  return LmHeadCrossEntropyFn::apply(h, w, labels);
}

}  // namespace uckpt::models
