#include "models/gpt2.h"

#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/GradMode.h>
#include <torch/version.h>

#include <cmath>
#include <limits>
#include <stdexcept>

#include "models/lm_head.h"
#include "models/next_token_loss.h"
#include "uckpt/random.h"

namespace uckpt::models {
namespace {

// softmax(q k^T / sqrt(D) + causal mask) v for [B, H, T, D] inputs through
// libtorch's fused scaled-dot-product attention (flash / memory-efficient
// kernels on CUDA with PyTorch 2.x; the math kernel on libtorch 1.13).
at::Tensor CausalSdpa(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
#if TORCH_VERSION_MAJOR >= 2
  return at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{}, /*dropout_p=*/0.0, /*is_causal=*/true);
#else
  return std::get<0>(at::_scaled_dot_product_attention(q, k, v, /*attn_mask=*/{}, /*dropout_p=*/0.0,
                                                       /*need_attn_weights=*/false, /*is_causal=*/true));
#endif
}

}  // namespace

std::vector<std::pair<std::string, std::vector<int64_t>>> Gpt2ParameterShapes(const Gpt2Config& cfg) {
  const int64_t C = cfg.n_embd;
  std::vector<std::pair<std::string, std::vector<int64_t>>> s;
  s.push_back({"transformer.wte.weight", {cfg.vocab_size, C}});
  s.push_back({"transformer.wpe.weight", {cfg.n_positions, C}});
  for (int64_t i = 0; i < cfg.n_layer; ++i) {
    std::string h = "transformer.h." + std::to_string(i) + ".";
    s.push_back({h + "ln_1.weight", {C}});
    s.push_back({h + "ln_1.bias", {C}});
    s.push_back({h + "attn.c_attn.weight", {C, 3 * C}});
    s.push_back({h + "attn.c_attn.bias", {3 * C}});
    s.push_back({h + "attn.c_proj.weight", {C, C}});
    s.push_back({h + "attn.c_proj.bias", {C}});
    s.push_back({h + "ln_2.weight", {C}});
    s.push_back({h + "ln_2.bias", {C}});
    s.push_back({h + "mlp.c_fc.weight", {C, 4 * C}});
    s.push_back({h + "mlp.c_fc.bias", {4 * C}});
    s.push_back({h + "mlp.c_proj.weight", {4 * C, C}});
    s.push_back({h + "mlp.c_proj.bias", {C}});
  }
  s.push_back({"transformer.ln_f.weight", {C}});
  s.push_back({"transformer.ln_f.bias", {C}});
  return s;
}

int64_t Gpt2NumParameters(const Gpt2Config& cfg) {
  int64_t n = 0;
  for (const auto& [name, shape] : Gpt2ParameterShapes(cfg)) {
    int64_t k = 1;
    for (int64_t d : shape) k *= d;
    n += k;
  }
  return n;
}

std::vector<NamedTensor> Gpt2ParametersIn(const Gpt2Config& cfg, const at::Tensor& flat) {
  if (flat.dim() != 1 || flat.numel() < Gpt2NumParameters(cfg))
    throw std::invalid_argument("flat parameter buffer too small");
  std::vector<NamedTensor> out;
  int64_t off = 0;
  for (const auto& [name, shape] : Gpt2ParameterShapes(cfg)) {
    int64_t k = 1;
    for (int64_t d : shape) k *= d;
    at::Tensor view = flat.narrow(0, off, k).view(shape).detach();
    view.requires_grad_(true);
    out.push_back({name, view});
    off += k;
  }
  return out;
}

namespace {

// The submodule at dotted `path` under `root`, made (empty) where missing.
torch::nn::Module& SubmoduleAt(torch::nn::Module& root, const std::string& path) {
  torch::nn::Module* m = &root;
  size_t start = 0;
  while (start < path.size()) {
    size_t dot = path.find('.', start);
    if (dot == std::string::npos) dot = path.size();
    const std::string part = path.substr(start, dot - start);
    std::shared_ptr<torch::nn::Module> child;
    for (const auto& c : m->named_children())
      if (c.key() == part) child = c.value();
    if (!child) child = m->register_module(part, std::make_shared<torch::nn::Module>());
    m = child.get();
    start = dot + 1;
  }
  return *m;
}

}  // namespace

Gpt2Module::Gpt2Module(Gpt2Config cfg) {
  std::vector<NamedTensor> params;
  for (const auto& [name, shape] : Gpt2ParameterShapes(cfg)) {
    const size_t dot = name.rfind('.');
    at::Tensor t = at::zeros(shape);
    SubmoduleAt(*this, name.substr(0, dot)).register_parameter(name.substr(dot + 1), t);
    params.push_back({name, t});
  }
  // The LM head is the token embedding (HF ties them): one tensor, two names.
  SubmoduleAt(*this, "lm_head").register_parameter("weight", params.front().tensor);
  net_ = std::make_unique<Gpt2>(cfg, std::move(params));
}

std::vector<std::shared_ptr<torch::nn::Module>> Gpt2Module::gather_units() const {
  std::vector<std::shared_ptr<torch::nn::Module>> units;
  for (const auto& m : named_modules("", /*include_self=*/false)) {
    const std::string& name = m.key();
    if (name.rfind("transformer.h.", 0) == 0 && name.find('.', 14) == std::string::npos) units.push_back(m.value());
  }
  return units;
}

Gpt2::Gpt2(Gpt2Config cfg, std::vector<NamedTensor> params) : cfg_(cfg), params_(std::move(params)) {
  if (cfg_.n_head <= 0 || cfg_.n_embd % cfg_.n_head != 0)
    throw std::invalid_argument("n_embd (" + std::to_string(cfg_.n_embd) + ") must be a multiple of n_head (" +
                                std::to_string(cfg_.n_head) + ")");
  auto shapes = Gpt2ParameterShapes(cfg_);
  if (params_.size() != shapes.size())
    throw std::invalid_argument("GPT-2 needs " + std::to_string(shapes.size()) + " parameters, got " +
                                std::to_string(params_.size()));
  for (size_t k = 0; k < shapes.size(); ++k) {
    if (params_[k].name != shapes[k].first || params_[k].tensor.sizes().vec() != shapes[k].second)
      throw std::invalid_argument("GPT-2 parameter " + std::to_string(k) + " should be " + shapes[k].first + ", got " +
                                  params_[k].name);
  }
  if (cfg_.fused_kernels && cfg_.dropout > 0)
    throw std::invalid_argument(
        "--fused_kernels needs --dropout 0 (dropout masks are drawn per sample outside the kernels)");
  size_t k = 0;
  auto next = [&] { return params_[k++].tensor; };
  wte_ = next();
  wpe_ = next();
  for (int64_t i = 0; i < cfg_.n_layer; ++i) {
    Block b;
    b.ln_1_w = next(), b.ln_1_b = next(), b.c_attn_w = next(), b.c_attn_b = next();
    b.attn_proj_w = next(), b.attn_proj_b = next(), b.ln_2_w = next(), b.ln_2_b = next();
    b.c_fc_w = next(), b.c_fc_b = next(), b.mlp_proj_w = next(), b.mlp_proj_b = next();
    blocks_.push_back(std::move(b));
  }
  ln_f_w_ = next();
  ln_f_b_ = next();
}

namespace {

// HF's Conv1D: torch.addmm(bias, x.view(-1, in), W) with W stored [in, out].
at::Tensor Conv1D(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
  auto out_shape = x.sizes().vec();
  out_shape.back() = w.size(1);
  return at::addmm(b, x.view({-1, x.size(-1)}), w).view(out_shape);
}

// HF's NewGELUActivation, written out term by term as HF does.
at::Tensor GeluNew(const at::Tensor& x) {
  const double k = std::sqrt(2.0 / M_PI);
  // One statement per op, in Python's left-to-right order: x feeds three ops,
  // and the order in which their nodes were created is the order autograd
  // sums x's three gradient contributions in (C++ leaves operand evaluation
  // order unspecified; GCC builds the right operand first).
  at::Tensor half_x = 0.5 * x;
  at::Tensor cube = at::pow(x, 3.0);
  at::Tensor inner = x + 0.044715 * cube;
  at::Tensor t = at::tanh(k * inner);
  return half_x * (1.0 + t);
}

// torch.finfo(dtype).min, the causal mask's fill value.
double LowestOf(at::ScalarType t) {
  switch (t) {
    case at::kBFloat16: return -3.3895313892515355e38;
    case at::kHalf: return -65504.0;
    case at::kDouble: return std::numeric_limits<double>::lowest();
    default: return std::numeric_limits<float>::lowest();
  }
}

}  // namespace

at::Tensor Gpt2::Dropout(const at::Tensor& x, const DropoutKey* dk, int64_t site) const {
  const double p = cfg_.dropout;
  if (dk == nullptr || p <= 0) return x;
  // One generator per row, so a row's mask is the same whichever rank runs it.
  std::vector<at::Tensor> rows;
  for (int64_t b = 0; b < x.size(0); ++b) {
    uint64_t s = SplitMix64(
        dk->seed ^ SplitMix64(static_cast<uint64_t>(dk->step) * 1000003u + static_cast<uint64_t>(dk->first_row + b)));
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(SplitMix64(s + static_cast<uint64_t>(site)));
    rows.push_back(
        at::empty(x.sizes().slice(1), x.options().dtype(at::kFloat).device(at::kCPU)).bernoulli_(1 - p, gen));
  }
  at::Tensor noise = at::stack(rows).div_(1 - p).to(x.options());
  return x * noise;
}

at::Tensor Gpt2::Attention(const Block& blk, const at::Tensor& a, const DropoutKey* dk, int64_t site) const {
  const int64_t B = a.size(0), T = a.size(1), C = cfg_.n_embd, H = cfg_.n_head, D = C / H;
  auto qkv = Conv1D(a, blk.c_attn_w, blk.c_attn_b).split(C, 2);
  at::Tensor q = qkv[0].view({B, T, H, D}).transpose(1, 2);
  at::Tensor k = qkv[1].view({B, T, H, D}).transpose(1, 2);
  at::Tensor v = qkv[2].view({B, T, H, D}).transpose(1, 2);
  if (cfg_.fused_kernels) {
    at::Tensor y = CausalSdpa(q, k, v).transpose(1, 2).contiguous().view({B, T, C});
    return Conv1D(y, blk.attn_proj_w, blk.attn_proj_b);
  }
  at::Tensor att = at::matmul(q, k.transpose(-1, -2));
  // Divide by a 0-d tensor holding sqrt(D), as HF's eager attention does.
  att = att / at::full({}, std::pow(static_cast<double>(D), 0.5), att.options());
  at::Tensor causal = at::ones({T, T}, a.options().dtype(at::kBool)).tril();
  att = at::where(causal, att, at::full({}, LowestOf(att.scalar_type()), att.options()));
  att = at::softmax(att, -1);
  att = Dropout(att, dk, site);
  at::Tensor y = at::matmul(att, v).transpose(1, 2).contiguous().view({B, T, C});
  return Dropout(Conv1D(y, blk.attn_proj_w, blk.attn_proj_b), dk, site + 1);
}

at::Tensor Gpt2::Hidden(const at::Tensor& input_ids, const DropoutKey* dk) const {
  const int64_t T = input_ids.size(1);
  if (T > cfg_.n_positions)
    throw std::invalid_argument("sequence length " + std::to_string(T) + " exceeds n_positions " +
                                std::to_string(cfg_.n_positions));
  at::Tensor pos = at::arange(T, input_ids.options().dtype(at::kLong)).unsqueeze(0);
  at::Tensor x = at::embedding(wte_, input_ids) + at::embedding(wpe_, pos);
  x = Dropout(x, dk, 0);
  const auto eps = cfg_.layer_norm_epsilon;
  const int64_t C = cfg_.n_embd;
  int64_t site = 1;
  for (size_t i = 0; i < blocks_.size(); ++i) {
    const Block& blk = blocks_[i];
    x = units_.Enter(i, x);
    x = x + Attention(blk, at::layer_norm(x, {C}, blk.ln_1_w, blk.ln_1_b, eps), dk, site);
    at::Tensor a = at::layer_norm(x, {C}, blk.ln_2_w, blk.ln_2_b, eps);
    at::Tensor h = Conv1D(a, blk.c_fc_w, blk.c_fc_b);
    h = cfg_.fused_kernels ? at::gelu(h, "tanh") : GeluNew(h);
    at::Tensor f = Conv1D(h, blk.mlp_proj_w, blk.mlp_proj_b);
    x = x + Dropout(f, dk, site + 2);
    x = units_.Exit(i, x);
    site += 3;
  }
  return at::layer_norm(x, {C}, ln_f_w_, ln_f_b_, eps);
}

at::Tensor Gpt2::Logits(const at::Tensor& input_ids, const DropoutKey* dk) const {
  return at::linear(Hidden(input_ids, dk), wte_);  // the tied LM head, no bias
}

at::Tensor Gpt2::Loss(const at::Tensor& input_ids, const DropoutKey* dk) const {
  if (cfg_.chunked_loss) return NextTokenLoss(Logits(input_ids, dk), input_ids);
  using namespace at::indexing;
  at::Tensor labels = input_ids.index({Slice(), Slice(1, None)}).reshape({-1});
  if (cfg_.fused_kernels) {
    // HF's loss on the positions that predict a token (0..T-2), in one
    // function with the head (lm_head.h: less memory, aligned products).
    at::Tensor h = Hidden(input_ids, dk);
    h = h.narrow(1, 0, h.size(1) - 1).reshape({-1, cfg_.n_embd});
    return LmHeadCrossEntropy(h, wte_, labels);
  }
  at::Tensor logits = Logits(input_ids, dk);
  const int64_t V = logits.size(-1);
  at::Tensor shifted = logits.index({Slice(), Slice(None, -1), Slice()}).to(at::kFloat).reshape({-1, V});
  return at::cross_entropy_loss(shifted, labels);
}

void Gpt2Init(const Gpt2Config& cfg, const std::vector<NamedTensor>& params, uint64_t seed) {
  c10::NoGradGuard no_grad;
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  const double proj_std = cfg.initializer_range / std::sqrt(2.0 * static_cast<double>(cfg.n_layer));
  auto ends_with = [](const std::string& s, const std::string& suffix) {
    return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
  };
  for (const auto& [name, p] : params) {
    bool layer_norm = name.find(".ln_") != std::string::npos || name.rfind("transformer.ln_f", 0) == 0;
    // Draw in fp32 on the CPU generator (as the reference does), then copy
    // into the parameter (any dtype, any device).
    const auto cpu = p.options().dtype(at::kFloat).device(at::kCPU);
    at::Tensor v;
    if (layer_norm && ends_with(name, ".weight")) {
      v = at::ones(p.sizes(), cpu);
    } else if (ends_with(name, ".bias")) {
      v = at::zeros(p.sizes(), cpu);
    } else {
      double std = ends_with(name, "c_proj.weight") ? proj_std : cfg.initializer_range;
      v = at::empty(p.sizes(), cpu).normal_(0.0, std, gen);
    }
    p.copy_(v);
  }
}

}  // namespace uckpt::models
