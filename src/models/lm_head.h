// HF's causal-LM loss through a tied LM head: cross_entropy(linear(h, w).float(),
// labels), with its gradient computed in one pass and its product on aligned rows.
//
// Why, on CUDA (GPT-2 124M, 16 x 1024 tokens, bf16, one H100):
// - With a vocabulary whose size is not a multiple of 8 (GPT-2's 50,257) every
//   row of the [N, V] logits and of their gradient starts at an odd element,
//   and cuBLAS falls back to its unaligned GEMM kernels for all three of the
//   head's products: 30 ms of an 88 ms ZeRO-3 step. Here the logits and their
//   gradient live in rows of V rounded up to 8 (zeros in the extra columns,
//   which never reach the result), so the aligned kernels run.
// - Autograd's cross_entropy backward holds three fp32 [N, V] tensors at once
//   (the saved log-probabilities, nll_loss's gradient, log_softmax's), 3.3 GB
//   each, at the step's peak of memory. Here the gradient is written from the
//   saved log-probabilities straight into the 16-bit rows the products read.
#pragma once

#include <ATen/ATen.h>

namespace uckpt::models {

// h [N, C] and w [V, C] of one floating dtype, labels int64 [N] (-100: ignored,
// as cross_entropy's default). Returns the mean loss (fp32, 0-d), differentiable
// in h and w. The loss is cross_entropy's, from the product rounded to h's dtype
// and widened to fp32. The gradient is log_softmax's and nll_loss's backward,
// rounded to h's dtype as `.float()`'s backward rounds it; at the N label
// entries alone the fp32 value may differ from autograd's in its last bit (one
// rounding more or less), before that rounding.
at::Tensor LmHeadCrossEntropy(const at::Tensor& h, const at::Tensor& w, const at::Tensor& labels);

}  // namespace uckpt::models
