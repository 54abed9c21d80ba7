// A BERT-style masked-language-model encoder over byte-level text, as a
// torch::nn::Module: token + position embeddings, an embedding LayerNorm,
// post-LayerNorm encoder layers with bidirectional self-attention and an erf
// GELU feed-forward, and an MLM head whose decoder weight is the token
// embedding itself. Parameter names follow Hugging Face's BertForMaskedLM
// (without token types, pooler or the decoder's bias alias). Independent of the
// engine; tests/models/bert_reference.py is the same model in plain PyTorch.
#pragma once

#include <torch/nn.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "uckpt/units.h"

namespace uckpt::models {

// Token ids. 0-255 are the bytes of the text; the special tokens follow.
inline constexpr int64_t kBertNumByteTokens = 256;
inline constexpr int64_t kBertMaskToken = 256;  // [MASK]
inline constexpr int64_t kBertNumSpecialTokens = 1;
// The label of a position that is not predicted (cross entropy ignores it).
inline constexpr int64_t kBertIgnoreLabel = -100;

struct BertConfig {
  int64_t n_layer = 2;
  int64_t n_head = 2;
  int64_t n_embd = 64;        // the feed-forward is 4 * n_embd wide
  int64_t vocab_size = 260;   // >= kBertNumByteTokens + kBertNumSpecialTokens
  int64_t n_positions = 128;  // longest sequence the position table covers
  int64_t seq_len = 128;      // training sequence length, <= n_positions
  double layer_norm_eps = 1e-12;
  double initializer_range = 0.02;
  // Embedding, attention-probability and residual dropout alike. Drawn from
  // libtorch's default generator, so not reproducible across world sizes;
  // 0 (the default) makes the forward pass deterministic.
  double dropout = 0.0;

  int64_t intermediate_size() const { return 4 * n_embd; }
};

// Throws std::invalid_argument with a message naming the offending field
// (vocab_size too small for bytes + specials, n_embd not a multiple of
// n_head, seq_len > n_positions, non-positive sizes, dropout outside [0, 1)).
void ValidateBertConfig(const BertConfig& cfg);

// The model. Submodules and parameters are registered in Hugging Face's
// order, so named_parameters() (and named_buffers()) are deterministic:
//   bert.embeddings.{word_embeddings,position_embeddings}.weight,
//   bert.embeddings.LayerNorm.{weight,bias},
//   bert.encoder.layer.<i>.attention.self.{query,key,value}.{weight,bias},
//   bert.encoder.layer.<i>.attention.output.dense.{weight,bias},
//   bert.encoder.layer.<i>.attention.output.LayerNorm.{weight,bias},
//   bert.encoder.layer.<i>.intermediate.dense.{weight,bias},
//   bert.encoder.layer.<i>.output.dense.{weight,bias},
//   bert.encoder.layer.<i>.output.LayerNorm.{weight,bias},
//   cls.predictions.bias,
//   cls.predictions.transform.dense.{weight,bias},
//   cls.predictions.transform.LayerNorm.{weight,bias},
//   cls.predictions.decoder.weight   (the same tensor as word_embeddings.weight)
// Buffer: bert.embeddings.position_ids, int64 [1, n_positions] = 0..n-1.
//
// libtorch's named_parameters()/parameters() list the tied tensor under both
// names (Python's deduplicate); give optimizers and gradient clipping
// unique_named_parameters() instead, or the tied weight is stepped twice.
// clone() is not implemented (libtorch's default throws).
class BertMlmImpl : public torch::nn::Module {
 public:
  // Throws as ValidateBertConfig. The weights are libtorch's default
  // initialisation until BertMlmInit is called.
  explicit BertMlmImpl(const BertConfig& cfg);

  const BertConfig& config() const { return cfg_; }

  // The last encoder layer's hidden states, [B, T, n_embd], for int64
  // `input_ids` [B, T] with 1 <= T <= n_positions and ids < vocab_size.
  // Every position attends to every position (no padding mask).
  torch::Tensor Encode(const torch::Tensor& input_ids);

  // MLM logits for every position, [B, T, vocab_size], in the model's dtype.
  torch::Tensor forward(const torch::Tensor& input_ids);

  // The masked-LM loss: cross entropy, in fp32, averaged over the positions
  // whose label is not kBertIgnoreLabel (the head runs on those positions
  // only). `labels` is int64 [B, T] as MaskBatch makes it. Throws
  // std::invalid_argument if no position has a label. The mean is over this
  // call's labelled positions, so averaging it over micro-batches or ranks
  // weights each micro-batch alike, not each labelled position.
  torch::Tensor Loss(const torch::Tensor& input_ids, const torch::Tensor& labels);

  // named_parameters() with each tensor once, under its first name (the tied
  // decoder weight appears only as bert.embeddings.word_embeddings.weight):
  // Python's named_parameters() order, the order of DeepSpeed's flat buffer.
  std::vector<std::pair<std::string, torch::Tensor>> unique_named_parameters() const;
  // Just the tensors of unique_named_parameters(), for torch::optim.
  std::vector<torch::Tensor> unique_parameters() const;

  // As Python's Module.to: parameters and floating-point buffers take
  // `dtype`; the int64 position_ids buffer keeps its type (libtorch's
  // Module::to would cast it too). Everything moves to `device`; the tie
  // survives (tensors change in place). to(device) alone is libtorch's.
  using torch::nn::Module::to;
  void to(torch::Device device, torch::Dtype dtype, bool non_blocking = false) override;
  void to(torch::Dtype dtype, bool non_blocking = false) override;

  // The submodules, for code that wants to reach inside.
  struct Layer {
    torch::nn::Linear query{nullptr}, key{nullptr}, value{nullptr};
    torch::nn::Linear attn_out{nullptr};
    torch::nn::LayerNorm attn_ln{nullptr};
    torch::nn::Linear inter{nullptr}, out{nullptr};
    torch::nn::LayerNorm out_ln{nullptr};
    std::shared_ptr<torch::nn::Module> module;  // bert.encoder.layer.<i>
  };
  torch::nn::Embedding word_embeddings{nullptr}, position_embeddings{nullptr};
  torch::nn::LayerNorm embeddings_ln{nullptr};
  std::vector<Layer> layers;
  torch::nn::Linear transform_dense{nullptr};
  torch::nn::LayerNorm transform_ln{nullptr};
  torch::Tensor decoder_weight;  // == word_embeddings->weight
  torch::Tensor decoder_bias;    // cls.predictions.bias
  torch::Tensor position_ids;    // buffer

  // ZeRO-3 gather units: the encoder layers, in forward order
  // (EngineOptions::gather_units), and the engine's calls around them.
  std::vector<std::shared_ptr<torch::nn::Module>> gather_units() const;
  void set_unit_calls(uckpt::UnitCalls calls) { units_ = std::move(calls); }

 private:
  torch::Tensor Head(const torch::Tensor& hidden);
  torch::Tensor Dropout(const torch::Tensor& x);
  void Cast(const std::optional<torch::Device>& device, torch::Dtype dtype, bool non_blocking);

  BertConfig cfg_;
  uckpt::UnitCalls units_;
};
TORCH_MODULE(BertMlm);

// Seeded initialisation, identical on every rank for the same seed: an
// explicitly seeded CPU at::Generator draws, for each tensor of
// unique_named_parameters() in order, N(0, initializer_range^2) for Linear and
// Embedding weights (fp32 on the CPU, then copied to the parameter's dtype and
// device); LayerNorm weights are 1 and every bias (cls.predictions.bias
// included) 0. Buffers are left alone. The draws come from libtorch's CPU
// normal_, so other libtorch versions may give other numbers: to share
// weights with another program, save them (the reference reads a file).
void BertMlmInit(BertMlmImpl& model, uint64_t seed);

struct MaskOptions {
  double select_prob = 0.15;  // chance that a position is predicted
  double mask_prob = 0.8;     // of the selected: replaced by [MASK]
  double random_prob = 0.1;   // of the selected: replaced by a random byte
                              // (the rest stay unchanged)
  int64_t mask_token = kBertMaskToken;
  int64_t num_random_tokens = kBertNumByteTokens;  // random ids are 0..this-1
};

struct MaskedBatch {
  torch::Tensor input_ids;  // int64 [B, T], the masked input
  torch::Tensor labels;     // int64 [B, T], the original id where selected, else kBertIgnoreLabel
};

// BERT's masking of the int64 [B, T] `ids` (any device; the result is on the
// same device). Row b is global sample n = first_global_sample_index + b, and
// everything about it is drawn from (seed, n) alone, so sample n gets the same
// masks whatever the batch, world size or split. The rule, with
// SplitMix64 of engine/data/data.h and u(x) = (x >> 11) * 2^-53 in [0, 1):
//   key     = SplitMix64(SplitMix64(seed) + n)        (all mod 2^64)
//   r(k)    = SplitMix64(key + k)
//   position t is selected iff u(r(3t)) < select_prob;
//   if no position of the row is selected, position r(3T) mod T is;
//   a selected position becomes mask_token if u(r(3t+1)) < mask_prob, else
//   the random id r(3t+2) mod num_random_tokens if u(r(3t+1)) < mask_prob +
//   random_prob, else stays as it was; its label is the original id.
// So every row has at least one label and the loss is always defined.
// Throws std::invalid_argument for a non-2-D or non-int64 `ids`, T = 0, or
// probabilities outside [0, 1].
MaskedBatch MaskBatch(const torch::Tensor& ids, int64_t first_global_sample_index, uint64_t seed,
                      const MaskOptions& options = {});

}  // namespace uckpt::models
