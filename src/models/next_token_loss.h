// GPT-2's causal-LM loss without materialising fp32 logits: the mean over
// B*(T-1) positions of -log softmax(logits[b, t])[ids[b, t+1]], computed in fp32
// a chunk of rows at a time. HF's way (logits.float() then cross_entropy)
// keeps three fp32 copies of the [B, T, V] logits alive around backward
// (3.3 GB each for GPT-2 124M at 16 x 1024); this keeps only the logits, in
// their own dtype, and one fp32 chunk of log-probabilities at a time, which
// backward recomputes. The gradient is cross_entropy's (log_softmax's and
// nll_loss's backward, per chunk); the loss is the mean of per-position losses,
// so its last bit may differ from nll_loss's sum: `--chunked_loss` only; the
// default path stays HF's, bit for bit.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace uckpt::models {

// logits [B, T, V] (any float dtype, requires grad or not), input_ids int64
// [B, T]. A chunk holds whole sequences, about `chunk_elements` fp32 values
// (at least one sequence). Differentiable in `logits`.
at::Tensor NextTokenLoss(const at::Tensor& logits, const at::Tensor& input_ids,
                         int64_t chunk_elements = int64_t{1} << 26);

}  // namespace uckpt::models
