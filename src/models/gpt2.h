// GPT-2 with exactly the math of Hugging Face's GPT2LMHeadModel (eager
// attention, gelu_new, tied LM head) and its parameter names and shapes, so
// state dicts move freely between uckpt, DeepSpeed and transformers.
// See shared/fixtures/refrun-gpt2/README.md, "The model".
#pragma once

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <string>
#include <vector>

#include "uckpt/units.h"

namespace uckpt::models {

struct Gpt2Config {
  int64_t n_layer = 4;
  int64_t n_head = 4;
  int64_t n_embd = 128;
  int64_t vocab_size = 50257;
  int64_t n_positions = 128;
  double dropout = 0.0;  // embd, attn and resid dropout alike
  double layer_norm_epsilon = 1e-5;
  double initializer_range = 0.02;
  // Fused attention (scaled_dot_product_attention) and the one-kernel tanh
  // GELU instead of HF's eager attention and gelu_new written out: the same
  // function, other rounding; much less activation memory. Needs dropout 0.
  // Also HF's loss and the LM head as one function, on the positions that
  // predict a token (lm_head.h: less memory, aligned products on CUDA).
  bool fused_kernels = false;
  // The loss a chunk of sequences at a time (next_token_loss.h) instead of
  // HF's fp32 copies of all logits: the same gradient, far less memory, a few
  // percent slower on GPUs (docs/gpu.md).
  bool chunked_loss = false;
};

struct NamedTensor {
  std::string name;
  at::Tensor tensor;
};

// Parameter names and shapes in named_parameters() order (the tied LM head
// appears once, as transformer.wte.weight). This is DeepSpeed's flat order.
std::vector<std::pair<std::string, std::vector<int64_t>>> Gpt2ParameterShapes(const Gpt2Config& cfg);

// The parameters as views into `flat` (1-D, at least the total numel), in
// Gpt2ParameterShapes order, each a leaf that requires grad. Writing `flat`
// changes the parameters; this is how the ZeRO engine keeps its flat buffer.
std::vector<NamedTensor> Gpt2ParametersIn(const Gpt2Config& cfg, const at::Tensor& flat);
int64_t Gpt2NumParameters(const Gpt2Config& cfg);

// Which dropout masks a forward pass draws: masks are seeded per (seed, step,
// global row), so they do not depend on how rows are split over ranks.
struct DropoutKey {
  uint64_t seed = 0;
  int64_t step = 0;
  int64_t first_row = 0;  // global-batch row of the micro-batch's row 0
};

class Gpt2 {
 public:
  // `params` are the model's parameters in Gpt2ParameterShapes order (any
  // float dtype; they may be views into a flat buffer). They must require grad
  // for training.
  Gpt2(Gpt2Config cfg, std::vector<NamedTensor> params);

  const Gpt2Config& config() const { return cfg_; }
  const std::vector<NamedTensor>& parameters() const { return params_; }

  // HF's causal-LM loss with labels = input_ids: mean over B*(T-1) positions
  // of the cross entropy, in fp32. `input_ids` is int64 [B, T]. Dropout is
  // applied only when `dropout` is given and config().dropout > 0.
  at::Tensor Loss(const at::Tensor& input_ids, const DropoutKey* dropout = nullptr) const;
  at::Tensor Logits(const at::Tensor& input_ids, const DropoutKey* dropout = nullptr) const;
  // ZeRO-3: each transformer block i runs between calls.Enter(i, x) and calls.Exit(i, y).
  void set_unit_calls(uckpt::UnitCalls calls) { units_ = std::move(calls); }

 private:
  struct Block {
    at::Tensor ln_1_w, ln_1_b, c_attn_w, c_attn_b, attn_proj_w, attn_proj_b;
    at::Tensor ln_2_w, ln_2_b, c_fc_w, c_fc_b, mlp_proj_w, mlp_proj_b;
  };
  // The last layer norm's output [B, T, C], before the LM head.
  at::Tensor Hidden(const at::Tensor& input_ids, const DropoutKey* dk) const;
  at::Tensor Attention(const Block& blk, const at::Tensor& a, const DropoutKey* dk, int64_t site) const;
  at::Tensor Dropout(const at::Tensor& x, const DropoutKey* dk, int64_t site) const;

  Gpt2Config cfg_;
  std::vector<NamedTensor> params_;
  at::Tensor wte_, wpe_, ln_f_w_, ln_f_b_;
  std::vector<Block> blocks_;
  uckpt::UnitCalls units_;
};

// GPT-2 as a torch::nn::Module with Hugging Face's module tree, so that
// named_parameters() gives HF's names in HF's order (DeepSpeed's flat order)
// and lm_head.weight is the same tensor as transformer.wte.weight (tied).
// Its parameters start at zero: Gpt2Init or a state dict fills them.
class Gpt2Module : public torch::nn::Module {
 public:
  explicit Gpt2Module(Gpt2Config cfg);
  const Gpt2Config& config() const { return net_->config(); }
  // The parameters in Gpt2ParameterShapes order (the tied head once).
  const std::vector<NamedTensor>& ordered_parameters() const { return net_->parameters(); }
  at::Tensor Loss(const at::Tensor& input_ids, const DropoutKey* dropout = nullptr) const {
    return net_->Loss(input_ids, dropout);
  }
  at::Tensor Logits(const at::Tensor& input_ids) const { return net_->Logits(input_ids); }
  // ZeRO-3 gather units: the transformer blocks transformer.h.<i>, in forward
  // order (EngineOptions::gather_units), and the engine's calls around them.
  std::vector<std::shared_ptr<torch::nn::Module>> gather_units() const;
  void set_unit_calls(uckpt::UnitCalls calls) { net_->set_unit_calls(std::move(calls)); }

 private:
  std::unique_ptr<Gpt2> net_;
};

// GPT-2's initialisation, as the fixture's gpt2_ref.hf_init_ does it: a CPU
// generator seeded with `seed`, then for each parameter in order: LayerNorm
// weights 1, biases 0, c_proj weights N(0, (range/sqrt(2*n_layer))^2), other
// weights N(0, range^2). The same seed gives the same tensors on every rank
// (and the fixture's init.pt for seed 1234).
void Gpt2Init(const Gpt2Config& cfg, const std::vector<NamedTensor>& params, uint64_t seed);

}  // namespace uckpt::models
