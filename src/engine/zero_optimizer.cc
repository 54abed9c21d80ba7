#include "engine/zero_optimizer.h"

#include <c10/core/GradMode.h>
#include <algorithm>
#include <cmath>
#include <numeric>
#include <stdexcept>

#include "engine/overlap_reducer.h"

namespace uckpt::engine {

ZeroOptimizer::ZeroOptimizer(Comm& comm, std::vector<int64_t> numels, ZeroSettings settings, at::Device device)
    : comm_(comm), numels_(std::move(numels)), s_(std::move(settings)) {
  if (s_.stage < 0 || s_.stage > 2) throw std::invalid_argument("ZeRO stage must be 0, 1 or 2");
  const int dp = s_.stage == 0 ? 1 : comm_.world_size();
  layout_ = ckpt::MakeFlatLayout(std::accumulate(numels_.begin(), numels_.end(), int64_t{0}), dp);
  offsets_ = ckpt::FlatOffsets(numels_);
  fragments_ = ckpt::RankFragments(numels_, dp, partition_rank());
  fragment_of_.assign(numels_.size(), -1);
  for (size_t i = 0; i < fragments_.size(); ++i) fragment_of_[fragments_[i].param] = static_cast<int>(i);
  auto model_opts = at::TensorOptions().dtype(s_.model_dtype).device(device);
  model_flat_ = at::zeros({layout_.padded_numel}, model_opts);
  grad_flat_ = at::zeros({layout_.padded_numel}, model_opts);
  at::Device opt_device = s_.offload_optimizer_cpu ? at::Device(at::kCPU) : device;
  state_.master = at::zeros({layout_.partition_size}, at::TensorOptions().dtype(at::kFloat).device(opt_device));
  if (s_.model_dtype == at::kHalf) scaler_ = LossScaler::FromConfig(s_.fp16);
}

ZeroOptimizer::~ZeroOptimizer() = default;

at::Tensor ZeroOptimizer::PartitionOf(const at::Tensor& flat) const {
  return flat.narrow(0, layout_.begin(partition_rank()), layout_.partition_size);
}

void ZeroOptimizer::BindGradients(const std::vector<at::Tensor>& params) {
  if (params.size() != numels_.size()) throw std::invalid_argument("BindGradients: wrong parameter count");
  for (size_t k = 0; k < params.size(); ++k)
    params[k].mutable_grad() = grad_flat_.narrow(0, offsets_[k], numels_[k]).view(params[k].sizes());
  if (s_.overlap_comm && s_.stage == 2 && layout_.dp > 1)
    overlap_ = std::make_unique<OverlappedGradReducer>(comm_, params, numels_, grad_flat_, layout_.begin(partition_rank()),
                                                       layout_.partition_size, s_.reduce_bucket_size);
  // On Gloo a reduce-scatter is an all-reduce anyway (1.13 has no
  // reduce-scatter), so all-reduce the buffer DeepSpeed all-reduces: its ring
  // adds an element's dp terms in an order set by the element's position, and
  // the same layout gives DeepSpeed's sums bit for bit at any dp.
  deepspeed_order_ = !overlap_ && layout_.dp > 1 && comm_.backend() == "gloo";
  if (deepspeed_order_ && s_.stage == 2) {
    for (size_t k = 0; k < params.size(); ++k) {
      at::Tensor p = params[k];
      p.register_hook([this, k](const at::Tensor& g) {
        ready_order_.push_back(static_cast<int>(k));
        return g;
      });
    }
  }
}

at::Tensor ZeroOptimizer::AllReduceInDeepSpeedOrder() {
  // DeepSpeed's stage-2 IPG buckets (stage 1: the same, in parameter order):
  // whole parameters in order, a bucket reduced when the next parameter would
  // overflow reduce_bucket_size, each divided by dp and all-reduced; the
  // owner keeps its slice.
  std::vector<int> order;
  if (s_.stage == 2) {
    order = std::move(ready_order_);
    ready_order_.clear();
    // A parameter without a gradient this micro-step: DeepSpeed would not
    // reduce it either; its (zero) gradient goes last.
    std::vector<bool> seen(numels_.size(), false);
    for (int k : order) seen.at(static_cast<size_t>(k)) = true;
    for (size_t k = 0; k < numels_.size(); ++k)
      if (!seen[k]) order.push_back(static_cast<int>(k));
  } else {
    order.resize(numels_.size());
    std::iota(order.begin(), order.end(), 0);
  }
  at::Tensor part = at::zeros({layout_.partition_size}, grad_flat_.options().dtype(at::kFloat));
  size_t first = 0;
  while (first < order.size()) {
    size_t last = first;
    int64_t n = 0;
    while (last < order.size() && (last == first || n + numels_[order[last]] <= s_.reduce_bucket_size))
      n += numels_[order[last++]];
    std::vector<at::Tensor> pieces;
    for (size_t i = first; i < last; ++i) pieces.push_back(grad_flat_.narrow(0, offsets_[order[i]], numels_[order[i]]));
    at::Tensor bucket = at::cat(pieces).to(at::kFloat);  // cat made a new tensor: converting is enough
    bucket.div_(static_cast<double>(layout_.dp));
    comm_.AllReduceSum(bucket);
    int64_t at_bucket = 0;
    for (size_t i = first; i < last; ++i) {
      if (const int j = fragment_of_[order[i]]; j >= 0) {
        const ckpt::Fragment& f = fragments_[j];
        part.narrow(0, f.partition_offset, f.numel).copy_(bucket.narrow(0, at_bucket + f.param_offset, f.numel));
      }
      at_bucket += numels_[order[i]];
    }
    first = last;
  }
  return part;
}

void ZeroOptimizer::ReduceMicroGradients(bool boundary) {
  if (s_.stage == 2 || boundary) ReduceIntoPartition();
}

void ZeroOptimizer::ReduceIntoPartition() {
  // DeepSpeed's average_tensor: divide by dp, then sum over ranks.
  at::Tensor part;
  if (overlap_) {
    part = overlap_->Finish();
  } else if (deepspeed_order_) {
    part = AllReduceInDeepSpeedOrder();
  } else if (layout_.dp > 1) {
    // Bucketed: bucket k holds columns [o, o+b) of every rank's partition, so
    // one reduce-scatter hands each owner its own columns.
    const int64_t dp = layout_.dp, P = layout_.partition_size;
    const int64_t b_max = std::max<int64_t>(1, s_.reduce_bucket_size / dp);
    part = at::empty({P}, grad_flat_.options().dtype(at::kFloat));
    at::Tensor by_rank = grad_flat_.view({dp, P});
    for (int64_t o = 0; o < P; o += b_max) {
      const int64_t b = std::min(b_max, P - o);
      at::Tensor bucket = by_rank.narrow(1, o, b).to(at::kFloat, /*non_blocking=*/false, /*copy=*/true).contiguous();
      bucket.div_(static_cast<double>(dp));
      at::Tensor out = part.narrow(0, o, b);
      comm_.ReduceScatterSum(bucket, out);
    }
  } else if (s_.stage == 0 && comm_.world_size() > 1) {
    at::Tensor g = grad_flat_.to(at::kFloat, /*non_blocking=*/false, /*copy=*/true);
    // Stage 0: every rank steps the whole model on the averaged gradient.
    g.mul_(1.0 / comm_.world_size());
    comm_.AllReduceSum(g);
    part = g;
  } else {
    part = grad_flat_.to(at::kFloat, /*non_blocking=*/false, /*copy=*/true);
  }
  part = part.to(state_.master.device());
  if (have_grad_partition_) {
    grad_partition_.add_(part);
  } else {
    grad_partition_ = part;
    have_grad_partition_ = true;
  }
  grad_flat_.zero_();
}

double ZeroOptimizer::GlobalNorm() {
  // DeepSpeed's get_grad_norm_direct: the fp64 norm of each parameter's
  // fragment, squared and summed, as fp32, summed over ranks, then ** 0.5.
  std::vector<at::Tensor> norms;
  for (const auto& f : fragments_)
    norms.push_back(at::norm(grad_partition_.narrow(0, f.partition_offset, f.numel).to(at::kDouble), 2));
  at::Tensor total = norms.empty() ? at::zeros({}, grad_partition_.options().dtype(at::kFloat))
                                   : at::stack(norms).square().sum().to(at::kFloat);
  if (s_.stage != 0 && comm_.world_size() > 1) {
    at::Tensor t = total.reshape({1});
    comm_.AllReduceSum(t);
    total = t.reshape({});
  }
  total = total.pow(1.0 / 2.0);
  if (!std::isfinite(total.item<float>())) return -1.0;
  // scaled_global_norm: the L2 norm over (here: one) parameter groups.
  return at::norm(at::stack({total}), 2).item<float>();
}

ZeroOptimizer::StepResult ZeroOptimizer::Step(double lr) {
  if (!have_grad_partition_) throw std::logic_error("ZeroOptimizer::Step without reduced gradients");
  StepResult r;
  const double prev_scale = scaler_.cur_scale;
  r.loss_scale = prev_scale;
  bool overflow = false;
  if (s_.model_dtype == at::kHalf) {
    at::Tensor bad = (grad_partition_.isfinite().logical_not().any()).to(at::kFloat).reshape({1});
    comm_.AllReduceMax(bad);
    overflow = bad.item<float>() > 0;
  }
  scaler_.Update(overflow);
  if (overflow) {
    have_grad_partition_ = false;
    r.skipped = true;
    r.grad_norm = -1;
    return r;
  }
  const double scaled_norm = GlobalNorm();
  r.grad_norm = static_cast<float>(static_cast<float>(scaled_norm) / prev_scale);

  // unscale_and_clip_grads, with DeepSpeed's tensor arithmetic in fp32.
  at::Tensor grad = grad_partition_;
  if (s_.gradient_clipping > 0) {
    at::Tensor norm = at::full({}, scaled_norm, grad.options());
    at::Tensor clip = ((norm / prev_scale) + 1e-6) / s_.gradient_clipping;
    clip = at::clamp_min(clip, 1.0);
    at::Tensor combined = clip * prev_scale;
    grad.mul_(at::reciprocal(combined) * 1.0);
  } else {
    grad.mul_(1.0 / prev_scale);
  }
  AdamStep(grad, lr);
  have_grad_partition_ = false;
  grad_partition_ = at::Tensor();
  GatherModelFromMasters();
  return r;
}

void ZeroOptimizer::AdamStep(const at::Tensor& grad_in, double lr) {
  // torch.optim.Adam/AdamW, single-tensor path (torch 1.13), on the partition.
  const auto& o = s_.optimizer;
  c10::NoGradGuard no_grad;
  at::Tensor& p = state_.master;
  if (!state_.step.defined()) {
    state_.step = at::zeros({}, p.options());
    state_.exp_avg = at::zeros_like(p);
    state_.exp_avg_sq = at::zeros_like(p);
  }
  at::Tensor grad = grad_in;
  state_.step.add_(1);
  if (o.decoupled_weight_decay) {
    p.mul_(1 - lr * o.weight_decay);
  } else if (o.weight_decay != 0) {
    grad = grad.add(p, o.weight_decay);
  }
  state_.exp_avg.mul_(o.beta1).add_(grad, 1 - o.beta1);
  state_.exp_avg_sq.mul_(o.beta2).addcmul_(grad, grad, 1 - o.beta2);
  const double step = state_.step.item<float>();
  const double bias_correction1 = 1 - std::pow(o.beta1, step);
  const double bias_correction2 = 1 - std::pow(o.beta2, step);
  const double step_size = lr / bias_correction1;
  const double bias_correction2_sqrt = std::sqrt(bias_correction2);
  at::Tensor denom = (state_.exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(o.eps);
  p.addcdiv_(state_.exp_avg, denom, -step_size);
}

void ZeroOptimizer::InitMasterFromModel() {
  state_.master.copy_(PartitionOf(model_flat_));
}

void ZeroOptimizer::GatherModelFromMasters() {
  c10::NoGradGuard no_grad;
  at::Tensor mine = state_.master.to(model_flat_.device()).to(s_.model_dtype);
  if (layout_.dp > 1) {
    comm_.AllGather(mine, model_flat_);
  } else {
    model_flat_.copy_(mine);
  }
}

}  // namespace uckpt::engine
