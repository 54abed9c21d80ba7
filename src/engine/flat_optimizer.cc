// FlatRuntime's optimizer arithmetic (flat_runtime.h): a client's step, the
// script's own optimizer.step() at stage 0, torch's Adam on a partition, and
// the 16-bit weights made from the fp32 masters.
#include "engine/flat_runtime.h"

#include <c10/core/Event.h>
#include <c10/core/GradMode.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <stdexcept>

#include "engine/cpu_adam.h"
#include "engine/grad_numerics.h"
#include "engine/host_grad_copy.h"
#include "engine/overlap_reducer.h"
#include "engine/pinned_host.h"
#include "engine/unit_pipeline.h"

namespace uckpt::engine {

void FlatRuntime::ClientStep(const UnscaleAndClip& unscale, const std::vector<double>& group_lrs) {
  c10::NoGradGuard no_grad;
  std::vector<PartitionState*> states;
  std::vector<at::Tensor> grads;
  std::vector<size_t> ids;
  for (Group& g : groups_) {
    // The host copy widened to fp32 (exact) into the reused host buffer: what the fused pass would read.
    if (g.in_host_copy) KeepHostCopyAsSum(g);
    // A model-dtype sum (stages 1-2) widened, as DeepSpeed hands its optimizer an fp32 copy.
    at::Tensor grad = g.grad_partition.to(at::kFloat);
    DropGradient(g);
    // Offloaded, the gradient is a host tensor: the same factor as the fused host pass takes.
    if (s_.offload_optimizer_cpu && !grad.device().is_cpu()) grad = grad.cpu();
    unscale.ApplyForClientStep(grad, s_.offload_optimizer_cpu);
    states.push_back(&g.state);
    grads.push_back(grad);
    ids.push_back(static_cast<size_t>(&g - groups_.data()));
  }
  RunOptimizerStep(s_.optimizer_step, states, grads, ids, group_lrs);
  for (Group& g : groups_)
    if (!g.host_copy) g.grad_partition = at::Tensor();  // else reused for the next step
  WeightsFromMasters();
}

void FlatRuntime::StepFromParameterGradients(const std::vector<double>& group_lrs) {
  if (s_.stage != 0 || s_.model_dtype != at::kFloat || s_.offload_optimizer_cpu)
    throw std::logic_error("optimizer.step(): the optimizer steps itself at ZeRO stage 0 in fp32 without offload only");
  if (group_lrs.size() != groups_.size())
    throw std::logic_error("FlatRuntime::StepFromParameterGradients: one lr per group");
  AwaitUpdate();
  c10::NoGradGuard no_grad;
  MastersFromWeights();  // the module's parameters are where the torch optimizer steps from
  for (Group& g : groups_) {
    at::Tensor grad = at::zeros_like(g.state.master);
    for (size_t k = 0; k < g.params.size(); ++k) {
      const at::Tensor& pg = g.params[k].grad();
      if (pg.defined()) grad.narrow(0, g.offsets[k], g.numels[k]).copy_(pg.reshape({-1}));
    }
    g.grad_partition = grad;
    g.have_grad_partition = true;
  }
  if (s_.optimizer_step) {
    ClientStep(UnscaleAndClip(at::zeros({}, at::kFloat), 1.0, 0.0), group_lrs);
    return;
  }
  for (Group& g : groups_) {
    AdamStep(g, g.grad_partition, group_lrs[static_cast<size_t>(&g - groups_.data())]);
    g.grad_partition = at::Tensor();
    g.have_grad_partition = false;
  }
  WeightsFromMasters();
}

void FlatRuntime::AdamStep(Group& g, const at::Tensor& grad, double lr) {
  TorchAdamStep(g.state, grad, g.optimizer, lr, s_.step_chunk_elements);
}

void TorchAdamStep(PartitionState& st, const at::Tensor& grad_in, const OptimizerConfig& o, double lr,
                   int64_t chunk_elements, const UnscaleAndClip* unscale) {
  // torch.optim.Adam/AdamW, single-tensor path (PyTorch 2.x), on the partition.
  c10::NoGradGuard no_grad;
  at::Tensor& p = st.master;
  if (!st.step.defined()) {
    st.step = at::zeros({}, p.options());
    st.exp_avg = at::zeros_like(p);
    st.exp_avg_sq = at::zeros_like(p);
  }
  st.step.add_(1);
  const double step = st.step.item<float>();
  // bias_correction false (DeepSpeed's Adam): step size lr, denominator sqrt(v) + eps.
  const double bias_correction1 = o.bias_correction ? 1 - std::pow(o.beta1, step) : 1.0;
  const double bias_correction2 = o.bias_correction ? 1 - std::pow(o.beta2, step) : 1.0;
  const double step_size = lr / bias_correction1;
  const double bias_correction2_sqrt = std::sqrt(bias_correction2);
  // Every element goes through torch's operations in torch's order, a chunk at
  // a time: the temporaries (the denominator; Adam's weight-decayed gradient)
  // are a chunk's, not the partition's (8 bytes per element over 1B elements).
  const bool flat = p.is_contiguous() && grad_in.is_contiguous() && grad_in.numel() == p.numel();
  const int64_t n = p.numel(), chunk = flat && chunk_elements > 0 ? chunk_elements : std::max<int64_t>(n, 1);
  const at::Tensor p_all = flat ? p.view({-1}) : p, g_all = flat ? grad_in.view({-1}) : grad_in;
  const at::Tensor m_all = flat ? st.exp_avg.view({-1}) : st.exp_avg;
  const at::Tensor v_all = flat ? st.exp_avg_sq.view({-1}) : st.exp_avg_sq;
  for (int64_t begin = 0; begin < n; begin += chunk) {
    const int64_t len = std::min(chunk, n - begin);
    auto piece = [&](const at::Tensor& t) { return chunk >= n ? t : t.narrow(0, begin, len); };
    at::Tensor param = piece(p_all), grad = piece(g_all), exp_avg = piece(m_all), exp_avg_sq = piece(v_all);
    if (grad.scalar_type() != param.scalar_type()) {
      grad = grad.to(param.scalar_type());
      if (unscale != nullptr) unscale->Apply(grad);
    }
    if (o.decoupled_weight_decay) {
      param.mul_(1 - lr * o.weight_decay);
    } else if (o.weight_decay != 0) {
      grad = grad.add(param, o.weight_decay);
    }
    exp_avg.lerp_(grad, 1 - o.beta1);  // as PyTorch 2.x (1.13 took mul_ + add_, rounding otherwise)
    exp_avg_sq.mul_(o.beta2).addcmul_(grad, grad, 1 - o.beta2);
    // (sqrt(v) / bias_correction2_sqrt) + eps, in place on sqrt's result: the same kernels as torch's expression.
    at::Tensor denom = exp_avg_sq.sqrt();
    denom.div_(bias_correction2_sqrt).add_(o.eps);
    param.addcdiv_(exp_avg, denom, -step_size);
  }
}

void FlatRuntime::MastersFromWeights() {
  AwaitUpdate();
  for (Group& g : groups_) g.state.master.copy_(PartitionOf(g, g.model_flat));
}

void FlatRuntime::WeightsFromMasters() {
  AwaitUpdate();
  for (Group& g : groups_) GatherModel(g, g.state.master);
}

void FlatRuntime::GatherModel(Group& g, const at::Tensor& partition) {
  c10::NoGradGuard no_grad;
  if (g.layout.dp == 1 && partition.device() == g.model_flat.device()) {
    g.model_flat.copy_(partition);  // one pass, converting as .to() does
    return;
  }
  at::Tensor mine = partition.to(g.model_flat.device()).to(s_.model_dtype);
  if (g.layout.dp > 1) {
    comm_.AllGather(mine, g.model_flat);
  } else {
    g.model_flat.copy_(mine);
  }
}

}  // namespace uckpt::engine
