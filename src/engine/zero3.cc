#include "engine/zero3.h"

#include <c10/core/DeviceGuard.h>
#include <c10/core/GradMode.h>
#include <c10/core/StorageImpl.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <stdexcept>

#include "ckpt/partition.h"
#include "engine/cpu_adam.h"

namespace uckpt::engine {
namespace {

// A parameter's storage without its bytes (FSDP's resize_(0)): the tensor
// keeps its shape; views that autograd saved see the bytes again once
// AllocateStorage gives them back.
void FreeStorage(const at::Tensor& t) {
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  s->set_data_ptr_noswap(at::DataPtr(nullptr, t.device()));
  s->set_nbytes(0);
}

// Allocates the parameter's bytes and returns a flat tensor over them with
// its own version counter (writing it does not invalidate saved tensors).
at::Tensor AllocateStorage(const at::Tensor& t) {
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  const size_t nbytes = static_cast<size_t>(t.numel()) * t.element_size();
  if (s->nbytes() != nbytes) {
    // The caching allocator serves the thread's current device: make it the tensor's.
    const c10::DeviceGuard on(t.device());
    s->set_data_ptr_noswap(s->allocator()->allocate(nbytes));
    s->set_nbytes(nbytes);
  }
  return at::from_blob(s->data_ptr().get(), {t.numel()}, at::TensorOptions().dtype(t.scalar_type()).device(t.device()));
}

at::Tensor HostOrDevice(at::IntArrayRef sizes, at::ScalarType dtype, at::Device device, bool host) {
  auto o = at::TensorOptions().dtype(dtype);
  if (!host || device.is_cpu()) return at::zeros(sizes, o.device(device));
  return at::zeros(sizes, o.device(at::kCPU).pinned_memory(true));  // pinned: copies to the GPU overlap
}

// Identity whose backward runs once the unit's backward is done.
struct EnterUnitFn : public torch::autograd::Function<EnterUnitFn> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, int64_t z3, int64_t unit) {
    ctx->saved_data["z3"] = z3;
    ctx->saved_data["unit"] = unit;
    return x;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto* z = reinterpret_cast<Zero3Optimizer*>(ctx->saved_data["z3"].toInt());
    z->BackwardDone(static_cast<size_t>(ctx->saved_data["unit"].toInt()));
    return {grads[0], at::Tensor(), at::Tensor()};
  }
};

// Identity whose backward runs before the unit's backward.
struct ExitUnitFn : public torch::autograd::Function<ExitUnitFn> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& y, int64_t z3, int64_t unit) {
    ctx->saved_data["z3"] = z3;
    ctx->saved_data["unit"] = unit;
    return y;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto* z = reinterpret_cast<Zero3Optimizer*>(ctx->saved_data["z3"].toInt());
    z->BackwardGather(static_cast<size_t>(ctx->saved_data["unit"].toInt()));
    return {grads[0], at::Tensor(), at::Tensor()};
  }
};

}  // namespace

Zero3Optimizer::Zero3Optimizer(Comm& comm, std::vector<std::vector<std::pair<std::string, at::Tensor>>> groups,
                               std::vector<OptimizerConfig> group_optimizers,
                               const std::vector<std::vector<int>>& unit_of, int num_units, Zero3Settings settings,
                               at::Device device)
    : comm_(comm), s_(std::move(settings)), device_(device), group_optimizers_(std::move(group_optimizers)) {
  if (groups.empty() || groups.size() != group_optimizers_.size() || unit_of.size() != groups.size())
    throw std::invalid_argument("Zero3Optimizer: parameter groups, optimizers and units do not match");
  const int dp = comm_.world_size();
  const at::ScalarType dtype = s_.base.model_dtype;
  units_.resize(static_cast<size_t>(num_units));
  backward_live_.assign(units_.size(), 0);
  c10::NoGradGuard no_grad;
  for (size_t g = 0; g < groups.size(); ++g) {
    std::vector<int64_t> numels;
    for (const auto& [name, t] : groups[g]) numels.push_back(t.numel());
    size_t k = 0;
    for (size_t count : ckpt::Stage3SubGroups(numels, dp, s_.sub_group_size)) {
      Zero3SubGroup sg;
      sg.group = g;
      int64_t total = 0;
      for (size_t end = k + count; k < end; ++k) {
        Zero3Param p;
        p.name = groups[g][k].first;
        p.tensor = groups[g][k].second;
        p.group = g;
        p.numel = p.tensor.numel();
        p.partition_size = ckpt::Stage3PartitionSize(p.numel, dp);
        p.unit = unit_of[g][k];
        if (p.unit >= num_units) throw std::invalid_argument("Zero3Optimizer: unit index out of range for " + p.name);
        p.persistent = p.numel <= s_.persistence_threshold;
        p.sub_group = subs_.size();
        p.offset = total;
        total += p.partition_size;
        // The module's tensor gets storage of its own, exactly numel long
        // (freed and re-allocated as a whole), holding the whole value now.
        p.tensor.set_data(p.tensor.detach().contiguous().clone());
        at::Tensor whole = at::zeros({p.partition_size * dp}, p.tensor.options());
        whole.narrow(0, 0, p.numel).copy_(p.tensor.reshape(-1));
        p.partition = HostOrDevice({p.partition_size}, dtype, device_, s_.offload_param_cpu);
        p.partition.copy_(whole.narrow(0, p.partition_size * comm_.rank(), p.partition_size));
        p.live = 1;
        sg.params.push_back(params_.size());
        params_.push_back(std::move(p));
      }
      const bool host = s_.base.offload_optimizer_cpu;
      sg.state.master = HostOrDevice({total}, at::kFloat, device_, host);
      for (size_t i : sg.params)
        sg.state.master.narrow(0, params_[i].offset, params_[i].partition_size).copy_(params_[i].partition);
      sg.grad = HostOrDevice({total}, at::kFloat, device_, host);
      subs_.push_back(std::move(sg));
    }
  }
  // Unit parameters stay gathered until the model first enters a unit (a
  // model that never calls EnterUnit still runs, without the savings); the
  // root and persistent ones stay gathered for good.
  for (size_t i = 0; i < params_.size(); ++i) {
    Zero3Param& p = params_[i];
    if (p.unit < 0 || p.persistent) continue;
    units_[static_cast<size_t>(p.unit)].push_back(i);
  }
  if (dtype == at::kHalf) scaler_ = LossScaler::FromConfig(s_.base.fp16);
}

// ---- Gathering ----

void Zero3Optimizer::Fetch(const std::vector<size_t>& list) {
  if (list.empty()) return;
  c10::NoGradGuard no_grad;
  const int dp = this->dp();
  int64_t total = 0;
  for (size_t i : list) total += params_[i].partition_size;
  // Each partition straight into one buffer on the model's device: from pinned
  // host memory (offload_param) the copies are asynchronous, with no host-side
  // concatenation into fresh pages.
  at::Tensor in = at::empty({total}, params_[list[0]].partition.options().device(device_).pinned_memory(false));
  int64_t at_ = 0;
  for (size_t i : list) {
    in.narrow(0, at_, params_[i].partition_size).copy_(params_[i].partition, /*non_blocking=*/true);
    at_ += params_[i].partition_size;
  }
  at::Tensor all = in;
  if (dp > 1) {
    all = at::empty({total * dp}, in.options());
    comm_.AllGather(in, all);
  }
  at::Tensor by_rank = all.view({dp, total});
  int64_t off = 0;
  for (size_t i : list) {
    const Zero3Param& p = params_[i];
    at::Tensor dst = AllocateStorage(p.tensor);
    dst.copy_(by_rank.narrow(1, off, p.partition_size).reshape(-1).narrow(0, 0, p.numel));
    off += p.partition_size;
  }
}

void Zero3Optimizer::Gather(size_t unit) {
  std::vector<size_t> need;
  for (size_t i : units_.at(unit))
    if (params_[i].live++ == 0) need.push_back(i);
  Fetch(need);
}

void Zero3Optimizer::Release(size_t unit) {
  for (size_t i : units_.at(unit)) {
    Zero3Param& p = params_[i];
    if (p.live <= 0) throw std::logic_error("ZeRO-3: unit " + std::to_string(unit) + " released more often than gathered");
    if (--p.live == 0) FreeStorage(p.tensor);
  }
}

void Zero3Optimizer::GatherAll() {
  for (size_t u = 0; u < units_.size(); ++u) Gather(u);
}

void Zero3Optimizer::ReleaseAll() {
  for (size_t u = 0; u < units_.size(); ++u) Release(u);
}

at::Tensor Zero3Optimizer::EnterUnit(size_t unit, const at::Tensor& input) {
  if (unit >= units_.size())
    throw std::out_of_range("uckpt::Engine::EnterUnit: unit " + std::to_string(unit) + ", but " +
                            std::to_string(units_.size()) + " gather units were declared");
  Gather(unit);
  if (initial_hold_) {  // from now on units are gathered only while entered
    initial_hold_ = false;
    ReleaseAll();
  }
  if (!at::GradMode::is_enabled() || !input.requires_grad()) return input;
  return EnterUnitFn::apply(input, reinterpret_cast<int64_t>(this), static_cast<int64_t>(unit));
}

at::Tensor Zero3Optimizer::ExitUnit(size_t unit, const at::Tensor& output) {
  if (unit >= units_.size())
    throw std::out_of_range("uckpt::Engine::ExitUnit: unit " + std::to_string(unit) + ", but " +
                            std::to_string(units_.size()) + " gather units were declared");
  Release(unit);
  if (!at::GradMode::is_enabled() || !output.requires_grad()) return output;
  return ExitUnitFn::apply(output, reinterpret_cast<int64_t>(this), static_cast<int64_t>(unit));
}

void Zero3Optimizer::BackwardGather(size_t unit) {
  Gather(unit);
  ++backward_live_.at(unit);
}

void Zero3Optimizer::BackwardDone(size_t unit) {
  for (size_t i : units_.at(unit))
    if (params_[i].tensor.grad().defined()) Bucket(i);
  if (backward_live_.at(unit) > 0) {
    --backward_live_[unit];
    Release(unit);
  }
}

// ---- Gradients ----

void Zero3Optimizer::Bucket(size_t i) {
  Zero3Param& p = params_[i];
  if (bucket_numel_ > 0 && bucket_numel_ + p.numel > s_.base.reduce_bucket_size) FlushBucket();
  bucket_.push_back(i);
  bucket_grads_.push_back(p.tensor.grad());
  bucket_numel_ += p.numel;
  p.tensor.mutable_grad() = at::Tensor();  // the gradient's memory goes with the bucket
}

void Zero3Optimizer::FinishBackward() {
  for (size_t u = 0; u < units_.size(); ++u)
    while (backward_live_[u] > 0) BackwardDone(u);
  for (size_t i = 0; i < params_.size(); ++i)
    if (params_[i].tensor.grad().defined()) Bucket(i);
  FlushBucket();
}

void Zero3Optimizer::FlushBucket() {
  if (bucket_.empty()) return;
  c10::NoGradGuard no_grad;
  const int dp = this->dp();
  // DeepSpeed sorts the bucket by parameter id, then lays out per rank each
  // parameter's chunk (padded to ps); that layout sets Gloo's summation order.
  std::vector<size_t> order(bucket_.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return bucket_[a] < bucket_[b]; });
  int64_t total = 0;
  for (size_t i : bucket_) total += params_[i].partition_size;
  at::Tensor buffer = at::zeros({dp, total}, bucket_grads_[0].options().dtype(at::kFloat));
  int64_t off = 0;
  for (size_t j : order) {
    const Zero3Param& p = params_[bucket_[j]];
    // Rank r's chunk is [r*ps, (r+1)*ps) of the flat gradient; the last
    // chunks are short or empty (their padding stays zero).
    const at::Tensor flat_grad = bucket_grads_[j].reshape(-1);
    const int64_t ps = p.partition_size, full = ps > 0 ? p.numel / ps : 0;
    if (full > 0) buffer.narrow(1, off, ps).narrow(0, 0, full).copy_(flat_grad.narrow(0, 0, full * ps).view({full, ps}));
    if (full < dp && p.numel > full * ps)
      buffer[full].narrow(0, off, p.numel - full * ps).copy_(flat_grad.narrow(0, full * ps, p.numel - full * ps));
    bucket_grads_[j] = at::Tensor();  // each gradient freed once it is in the buffer
    off += ps;
  }
  at::Tensor flat = buffer.view({-1});
  flat.div_(static_cast<double>(dp));
  at::Tensor mine = flat.narrow(0, 0, total);
  if (dp > 1) {
    mine = at::empty({total}, flat.options());
    comm_.ReduceScatterSum(flat, mine);
  }
  if (s_.base.offload_optimizer_cpu && !mine.device().is_cpu()) mine = ToHostStaging(mine);
  off = 0;
  for (size_t j : order) {
    const Zero3Param& p = params_[bucket_[j]];
    Zero3SubGroup& sg = subs_[p.sub_group];
    sg.grad.narrow(0, p.offset, p.partition_size).add_(mine.narrow(0, off, p.partition_size));
    off += p.partition_size;
  }
  bucket_.clear();
  bucket_grads_.clear();
  bucket_numel_ = 0;
}

// The reduced chunk in host memory through one reused pinned buffer (fresh
// pageable memory for every bucket would cost a page fault per 4 KiB).
at::Tensor Zero3Optimizer::ToHostStaging(const at::Tensor& t) {
  if (!host_staging_.defined() || host_staging_.numel() < t.numel())
    host_staging_ = at::empty({t.numel()}, t.options().device(at::kCPU).pinned_memory(true));
  at::Tensor out = host_staging_.narrow(0, 0, t.numel());
  out.copy_(t);  // synchronous: the host adds read it next
  return out;
}

// DeepSpeed's stage-3 get_grad_norm_direct per sub-group (each parameter
// partition's fp64 norm, squared and summed, summed over ranks in fp64, ** 0.5),
// then the L2 norm over the sub-groups.
at::Tensor Zero3Optimizer::GlobalNorm(bool* finite) {
  std::vector<at::Tensor> group_norms;
  for (const Zero3SubGroup& sg : subs_) {
    std::vector<at::Tensor> norms;
    for (size_t i : sg.params) {
      const Zero3Param& p = params_[i];
      at::Tensor g = sg.grad.narrow(0, p.offset, p.partition_size);
      // Under offload the fp64 norm is taken where the gradient lives, not
      // after copying every partition back to the device.
      norms.push_back(g.device().is_cpu() && !device_.is_cpu()
                          ? at::scalar_tensor(std::sqrt(SumOfSquares(g)), at::kDouble)
                          : g.to(device_).to(at::kDouble).norm(2));
    }
    at::Tensor total = at::sum(at::pow(at::stack(norms), 2)).to(device_);
    if (dp() > 1) {
      at::Tensor t = total.reshape({1});
      comm_.AllReduceSum(t);
      total = t.reshape({});
    }
    group_norms.push_back(at::pow(total, 1.0 / 2.0));
  }
  at::Tensor norm = at::linalg_vector_norm(at::stack(group_norms), 2);
  *finite = std::isfinite(norm.item<double>());
  return norm;
}

Zero3Optimizer::StepResult Zero3Optimizer::Step(double lr) {
  c10::NoGradGuard no_grad;
  StepResult r;
  const double prev_scale = scaler_.cur_scale;
  r.loss_scale = prev_scale;
  bool overflow = false;
  if (s_.base.model_dtype == at::kHalf) {
    at::Tensor bad = at::zeros({1}, at::TensorOptions().dtype(at::kFloat).device(device_));
    for (const Zero3SubGroup& sg : subs_)
      bad = at::maximum(bad, sg.grad.isfinite().logical_not().any().to(at::kFloat).reshape({1}).to(device_));
    comm_.AllReduceMax(bad);
    overflow = bad.item<float>() > 0;
  }
  scaler_.Update(overflow);
  if (overflow) {
    for (Zero3SubGroup& sg : subs_) sg.grad.zero_();
    r.skipped = true;
    r.grad_norm = -1;
    return r;
  }
  bool finite = true;
  at::Tensor norm = GlobalNorm(&finite);  // fp64, of the scaled gradients
  r.grad_norm = finite ? norm.item<double>() / prev_scale : -1;
  if (s_.base.offload_optimizer_cpu) {
    // The same unscale-and-clip factor, applied inside one fused host pass.
    double combined = prev_scale;
    if (s_.base.gradient_clipping > 0) {
      at::Tensor clip = ((norm.cpu() / prev_scale) + 1e-6) / s_.base.gradient_clipping;
      combined = at::clamp_min(clip, 1.0).item<double>() * prev_scale;
    }
    for (Zero3SubGroup& sg : subs_) CpuAdamStep(sg.state, sg.grad, 1.0 / combined, group_optimizers_[sg.group], lr);
    PartitionsFromMasters();
    return r;
  }
  for (Zero3SubGroup& sg : subs_) {
    // unscale_and_clip_grads, with DeepSpeed's fp64 tensors.
    at::Tensor grad = sg.grad;
    if (s_.base.gradient_clipping > 0) {
      at::Tensor n = norm.to(grad.device());
      at::Tensor clip = ((n / prev_scale) + 1e-6) / s_.base.gradient_clipping;
      clip = at::clamp_min(clip, 1.0);
      at::Tensor combined = clip * prev_scale;
      grad.mul_(at::reciprocal(combined) * 1.0);
    } else {
      grad.mul_(1.0 / prev_scale);
    }
    TorchAdamStep(sg.state, grad, group_optimizers_[sg.group], lr);
    sg.grad.zero_();
  }
  PartitionsFromMasters();
  return r;
}

void Zero3Optimizer::PartitionsFromMasters() {
  c10::NoGradGuard no_grad;
  for (const Zero3SubGroup& sg : subs_)
    for (size_t i : sg.params) {
      Zero3Param& p = params_[i];
      p.partition.copy_(sg.state.master.narrow(0, p.offset, p.partition_size));
    }
  std::vector<size_t> live;
  for (size_t i = 0; i < params_.size(); ++i)
    if (params_[i].live > 0) live.push_back(i);
  Fetch(live);
}

at::Tensor Zero3Optimizer::GatherWhole(size_t i) {
  c10::NoGradGuard no_grad;
  const Zero3Param& p = params_.at(i);
  at::Tensor in = p.partition.to(device_);
  at::Tensor all = in;
  if (dp() > 1) {
    all = at::empty({p.partition_size * dp()}, in.options());
    comm_.AllGather(in, all);
  }
  return all.narrow(0, 0, p.numel).view(p.tensor.sizes()).clone();
}

}  // namespace uckpt::engine
