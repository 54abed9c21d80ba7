#include "models/bert.h"

#include <ATen/CPUGeneratorImpl.h>

#include <cmath>
#include <stdexcept>
#include <unordered_set>

#include "uckpt/random.h"

namespace uckpt::models {
namespace {

namespace nn = torch::nn;

std::shared_ptr<nn::Module> Container(nn::Module& parent, const std::string& name) {
  return parent.register_module(name, std::make_shared<nn::Module>());
}

nn::Linear Linear(nn::Module& parent, const std::string& name, int64_t in, int64_t out) {
  return parent.register_module(name, nn::Linear(nn::LinearOptions(in, out)));
}

nn::LayerNorm LayerNorm(nn::Module& parent, const BertConfig& cfg) {
  return parent.register_module("LayerNorm", nn::LayerNorm(nn::LayerNormOptions({cfg.n_embd}).eps(cfg.layer_norm_eps)));
}

bool EndsWith(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// A uniform double in [0, 1) from the top 53 bits (exact in IEEE double, so
// Python computes the same value).
double Unit(uint64_t x) { return static_cast<double>(x >> 11) * 0x1.0p-53; }

}  // namespace

void ValidateBertConfig(const BertConfig& cfg) {
  auto positive = [](int64_t v, const char* name) {
    if (v <= 0)
      throw std::invalid_argument(std::string("BERT: ") + name + " must be positive, got " + std::to_string(v));
  };
  positive(cfg.n_layer, "n_layer");
  positive(cfg.n_head, "n_head");
  positive(cfg.n_embd, "n_embd");
  positive(cfg.n_positions, "n_positions");
  positive(cfg.seq_len, "seq_len");
  const int64_t min_vocab = kBertNumByteTokens + kBertNumSpecialTokens;
  if (cfg.vocab_size < min_vocab)
    throw std::invalid_argument("BERT: vocab_size " + std::to_string(cfg.vocab_size) + " is too small: the " +
                                std::to_string(kBertNumByteTokens) + " byte tokens and " +
                                std::to_string(kBertNumSpecialTokens) + " special token(s) need at least " +
                                std::to_string(min_vocab));
  if (cfg.n_embd % cfg.n_head != 0)
    throw std::invalid_argument("BERT: n_embd (" + std::to_string(cfg.n_embd) + ") must be a multiple of n_head (" +
                                std::to_string(cfg.n_head) + ")");
  if (cfg.seq_len > cfg.n_positions)
    throw std::invalid_argument("BERT: seq_len (" + std::to_string(cfg.seq_len) + ") exceeds n_positions (" +
                                std::to_string(cfg.n_positions) + ")");
  if (!(cfg.dropout >= 0.0 && cfg.dropout < 1.0))
    throw std::invalid_argument("BERT: dropout must be in [0, 1), got " + std::to_string(cfg.dropout));
  if (!(cfg.layer_norm_eps > 0.0) || !(cfg.initializer_range >= 0.0))
    throw std::invalid_argument("BERT: layer_norm_eps must be positive and initializer_range non-negative");
}

BertMlmImpl::BertMlmImpl(const BertConfig& cfg) : cfg_(cfg) {
  ValidateBertConfig(cfg_);
  const int64_t C = cfg_.n_embd;
  // Registration order is named_parameters() order (a module's own
  // parameters first, then its children in order), as in Python.
  auto bert = Container(*this, "bert");
  auto embeddings = Container(*bert, "embeddings");
  word_embeddings =
      embeddings->register_module("word_embeddings", nn::Embedding(nn::EmbeddingOptions(cfg_.vocab_size, C)));
  position_embeddings =
      embeddings->register_module("position_embeddings", nn::Embedding(nn::EmbeddingOptions(cfg_.n_positions, C)));
  embeddings_ln = LayerNorm(*embeddings, cfg_);
  position_ids =
      embeddings->register_buffer("position_ids", torch::arange(cfg_.n_positions, torch::kLong).unsqueeze(0));

  auto encoder = Container(*bert, "encoder");
  auto layer_list = encoder->register_module("layer", nn::ModuleList());
  for (int64_t i = 0; i < cfg_.n_layer; ++i) {
    auto layer = std::make_shared<nn::Module>();
    layer_list->push_back(layer);
    Layer l;
    auto attention = Container(*layer, "attention");
    auto self = Container(*attention, "self");
    l.query = Linear(*self, "query", C, C);
    l.key = Linear(*self, "key", C, C);
    l.value = Linear(*self, "value", C, C);
    auto attn_output = Container(*attention, "output");
    l.attn_out = Linear(*attn_output, "dense", C, C);
    l.attn_ln = LayerNorm(*attn_output, cfg_);
    auto intermediate = Container(*layer, "intermediate");
    l.inter = Linear(*intermediate, "dense", C, cfg_.intermediate_size());
    auto output = Container(*layer, "output");
    l.out = Linear(*output, "dense", cfg_.intermediate_size(), C);
    l.out_ln = LayerNorm(*output, cfg_);
    l.module = layer;
    layers.push_back(l);
  }

  auto cls = Container(*this, "cls");
  auto predictions = Container(*cls, "predictions");
  decoder_bias = predictions->register_parameter("bias", torch::zeros({cfg_.vocab_size}));
  auto transform = Container(*predictions, "transform");
  transform_dense = Linear(*transform, "dense", C, C);
  transform_ln = LayerNorm(*transform, cfg_);
  // The tie: the decoder holds the embedding's tensor itself, not a copy.
  auto decoder = Container(*predictions, "decoder");
  decoder_weight = decoder->register_parameter("weight", word_embeddings->weight);
}

torch::Tensor BertMlmImpl::Dropout(const torch::Tensor& x) {
  if (cfg_.dropout <= 0.0 || !is_training()) return x;
  return torch::dropout(x, cfg_.dropout, /*train=*/true);
}

torch::Tensor BertMlmImpl::Encode(const torch::Tensor& input_ids) {
  if (input_ids.dim() != 2 || input_ids.scalar_type() != torch::kLong)
    throw std::invalid_argument("BERT: input_ids must be int64 [B, T]");
  const int64_t B = input_ids.size(0), T = input_ids.size(1);
  if (T < 1 || T > cfg_.n_positions)
    throw std::invalid_argument("BERT: sequence length " + std::to_string(T) +
                                " is not in [1, n_positions = " + std::to_string(cfg_.n_positions) + "]");
  const int64_t C = cfg_.n_embd, H = cfg_.n_head, D = C / H;
  const double scale = std::sqrt(static_cast<double>(D));

  torch::Tensor x = word_embeddings(input_ids) + position_embeddings(position_ids.narrow(1, 0, T));
  x = Dropout(embeddings_ln(x));
  for (size_t i = 0; i < layers.size(); ++i) {
    Layer& l = layers[i];
    x = units_.Enter(i, x);
    auto heads = [&](const torch::Tensor& t) { return t.view({B, T, H, D}).transpose(1, 2); };
    torch::Tensor q = heads(l.query(x)), k = heads(l.key(x)), v = heads(l.value(x));
    torch::Tensor probs = torch::softmax(torch::matmul(q, k.transpose(-1, -2)) / scale, -1);
    torch::Tensor ctx = torch::matmul(Dropout(probs), v).transpose(1, 2).reshape({B, T, C});
    torch::Tensor a = l.attn_ln(Dropout(l.attn_out(ctx)) + x);
    torch::Tensor f = l.out(torch::gelu(l.inter(a)));
    x = l.out_ln(Dropout(f) + a);
    x = units_.Exit(i, x);
  }
  return x;
}

std::vector<std::shared_ptr<torch::nn::Module>> BertMlmImpl::gather_units() const {
  std::vector<std::shared_ptr<torch::nn::Module>> units;
  for (const Layer& l : layers) units.push_back(l.module);
  return units;
}

torch::Tensor BertMlmImpl::Head(const torch::Tensor& hidden) {
  torch::Tensor h = transform_ln(torch::gelu(transform_dense(hidden)));
  return torch::linear(h, decoder_weight, decoder_bias);
}

torch::Tensor BertMlmImpl::forward(const torch::Tensor& input_ids) { return Head(Encode(input_ids)); }

torch::Tensor BertMlmImpl::Loss(const torch::Tensor& input_ids, const torch::Tensor& labels) {
  if (labels.sizes() != input_ids.sizes() || labels.scalar_type() != torch::kLong)
    throw std::invalid_argument("BERT: labels must be int64 with the shape of input_ids");
  torch::Tensor hidden = Encode(input_ids);
  torch::Tensor flat = labels.reshape({-1});
  torch::Tensor idx = torch::nonzero(flat.ne(kBertIgnoreLabel)).squeeze(1);
  if (idx.numel() == 0) throw std::invalid_argument("BERT: no position has a label; the MLM loss is undefined");
  torch::Tensor logits = Head(hidden.reshape({-1, cfg_.n_embd}).index_select(0, idx));
  return torch::nn::functional::cross_entropy(logits.to(torch::kFloat), flat.index_select(0, idx));
}

std::vector<std::pair<std::string, torch::Tensor>> BertMlmImpl::unique_named_parameters() const {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  std::unordered_set<const void*> seen;
  for (const auto& item : named_parameters(/*recurse=*/true))
    if (seen.insert(item.value().unsafeGetTensorImpl()).second) out.emplace_back(item.key(), item.value());
  return out;
}

std::vector<torch::Tensor> BertMlmImpl::unique_parameters() const {
  std::vector<torch::Tensor> out;
  for (auto& [name, t] : unique_named_parameters()) out.push_back(t);
  return out;
}

void BertMlmImpl::Cast(const std::optional<torch::Device>& device, torch::Dtype dtype, bool non_blocking) {
  auto cast = [&](torch::Tensor& t, torch::Dtype type) {
    t.set_data(device ? t.to(*device, type, non_blocking) : t.to(type, non_blocking));
  };
  for (auto& [name, p] : unique_named_parameters()) cast(p, dtype);
  for (auto& item : named_buffers())
    cast(item.value(), item.value().is_floating_point() ? dtype : item.value().scalar_type());
}

void BertMlmImpl::to(torch::Device device, torch::Dtype dtype, bool non_blocking) { Cast(device, dtype, non_blocking); }

void BertMlmImpl::to(torch::Dtype dtype, bool non_blocking) { Cast(std::nullopt, dtype, non_blocking); }

void BertMlmInit(BertMlmImpl& model, uint64_t seed) {
  torch::NoGradGuard no_grad;
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  const double stddev = model.config().initializer_range;
  for (auto& [name, p] : model.unique_named_parameters()) {
    const auto cpu = p.options().dtype(torch::kFloat).device(torch::kCPU);
    torch::Tensor v;
    if (EndsWith(name, "LayerNorm.weight")) {
      v = torch::ones(p.sizes(), cpu);
    } else if (EndsWith(name, "bias")) {
      v = torch::zeros(p.sizes(), cpu);
    } else {
      v = torch::empty(p.sizes(), cpu).normal_(0.0, stddev, gen);
    }
    p.copy_(v);
  }
}

MaskedBatch MaskBatch(const torch::Tensor& ids, int64_t first_global_sample_index, uint64_t seed,
                      const MaskOptions& options) {
  if (ids.dim() != 2 || ids.scalar_type() != torch::kLong)
    throw std::invalid_argument("MaskBatch: ids must be int64 [B, T]");
  const int64_t B = ids.size(0), T = ids.size(1);
  if (T < 1) throw std::invalid_argument("MaskBatch: sequences must have at least one position");
  auto prob = [](double p) { return p >= 0.0 && p <= 1.0; };
  if (!prob(options.select_prob) || !prob(options.mask_prob) || !prob(options.random_prob) ||
      options.mask_prob + options.random_prob > 1.0)
    throw std::invalid_argument("MaskBatch: probabilities must be in [0, 1] and mask_prob + random_prob <= 1");
  if (options.num_random_tokens < 1) throw std::invalid_argument("MaskBatch: num_random_tokens must be positive");

  torch::Tensor src = ids.to(torch::kCPU).contiguous();
  torch::Tensor input = src.clone();
  torch::Tensor labels = torch::full({B, T}, kBertIgnoreLabel, torch::kLong);
  const int64_t* in = src.data_ptr<int64_t>();
  int64_t* out = input.data_ptr<int64_t>();
  int64_t* lab = labels.data_ptr<int64_t>();
  const uint64_t seed_key = SplitMix64(seed);
  const uint64_t ut = static_cast<uint64_t>(T);
  for (int64_t b = 0; b < B; ++b) {
    const uint64_t key = SplitMix64(seed_key + static_cast<uint64_t>(first_global_sample_index + b));
    auto r = [key](uint64_t k) { return SplitMix64(key + k); };
    auto apply = [&](int64_t t) {
      const int64_t i = b * T + t;
      const uint64_t k = 3 * static_cast<uint64_t>(t);
      lab[i] = in[i];
      const double u = Unit(r(k + 1));
      if (u < options.mask_prob) out[i] = options.mask_token;
      else if (u < options.mask_prob + options.random_prob)
        out[i] = static_cast<int64_t>(r(k + 2) % static_cast<uint64_t>(options.num_random_tokens));
    };
    bool any = false;
    for (int64_t t = 0; t < T; ++t) {
      if (Unit(r(3 * static_cast<uint64_t>(t))) < options.select_prob) {
        apply(t);
        any = true;
      }
    }
    if (!any) apply(static_cast<int64_t>(r(3 * ut) % ut));
  }
  return {input.to(ids.device()), labels.to(ids.device())};
}

}  // namespace uckpt::models
