// The sharded runtime's construction: one place for every stage.
#include "engine/sharded_runtime.h"

#include <c10/core/GradMode.h>

#include <algorithm>
#include <set>
#include <stdexcept>

#include "ckpt/deepspeed_state.h"

#include "engine/flat_runtime.h"
#include "engine/runtime_setup.h"
#include "engine/zero3_runtime.h"

namespace uckpt::engine {

at::ScalarType ModelDtype(const TrainConfig& c) {
  if (c.fp16.enabled) return at::kHalf;
  if (c.bf16) return at::kBFloat16;
  return at::kFloat;
}

std::vector<std::pair<std::string, at::Tensor>> OptimizerStates(const PartitionState& st) {
  if (!st.named.empty()) {
    std::vector<std::pair<std::string, at::Tensor>> out;
    for (const auto& kv : st.named)
      if (kv.second.defined()) out.push_back(kv);  // (an undefined tensor is torch's None state)
    return out;
  }
  if (!st.step.defined()) return {};
  return {{ckpt::kStep, st.step}, {ckpt::kExpAvg, st.exp_avg}, {ckpt::kExpAvgSq, st.exp_avg_sq}};
}

std::vector<std::pair<std::string, at::Tensor>> ElementStates(const PartitionState& st) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (auto& [key, t] : OptimizerStates(st))
    if (t.dim() == 1) out.emplace_back(key, t);
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  return out;
}

std::optional<double> StepOf(const PartitionState& st) {
  for (const auto& [key, t] : OptimizerStates(st))
    if (key == ckpt::kStep && t.dim() == 0) return t.item<double>();
  return std::nullopt;
}

void RunOptimizerStep(const OptimizerStepFn& step, const std::vector<PartitionState*>& states,
                      const std::vector<at::Tensor>& grads, const std::vector<size_t>& groups,
                      const std::vector<double>& group_lrs) {
  std::vector<OptimizerPartition> parts;
  for (size_t i = 0; i < states.size(); ++i)
    parts.push_back({states[i]->master, grads[i], groups[i], group_lrs.at(groups[i]), &states[i]->named});
  step(parts);
}

Stage0Fp16 Stage0Fp16Of(const TrainConfig& c, bool client_optimizer, bool forward_only) {
  if (c.zero.stage != 0 || !c.fp16.enabled || forward_only) return Stage0Fp16::kNone;
  return client_optimizer || c.optimizer.torch_adam ? Stage0Fp16::kUnfused : Stage0Fp16::kFused;
}

namespace {

ZeroSettings SettingsOf(const TrainConfig& c, const EngineOptions& options) {
  ZeroSettings s;
  s.stage = c.zero.stage;
  s.gradient_clipping = c.gradient_clipping;
  s.optimizer = c.optimizer;
  s.model_dtype = ModelDtype(c);
  const std::string accum = EffectiveGradAccumDtype(c);
  s.grad_accum_dtype = accum == "bf16" ? at::kBFloat16 : accum == "fp16" ? at::kHalf : at::kFloat;
  s.fp16 = c.fp16;
  s.offload_optimizer_cpu = c.zero.offload_optimizer_cpu;
  s.reduce_bucket_size = c.zero.reduce_bucket_size;
  s.overlap_comm = c.zero.overlap_comm;
  s.prescale_gradients = c.prescale_gradients;
  s.gradient_predivide_factor = c.gradient_predivide_factor;
  s.optimizer_step = options.optimizer_step;
  s.stage0_fp16 = Stage0Fp16Of(c, static_cast<bool>(options.optimizer_step), options.forward_only);
  return s;
}

// Rank 0's values of `t` on every rank, as DeepSpeed's initialize broadcasts them.
void BroadcastFromRank0(Comm& comm, const at::Tensor& t) {
  at::Tensor c = t.detach().contiguous();
  comm.Broadcast(c, 0);
  if (!c.is_alias_of(t)) t.detach().copy_(c);
}

// Stages 0-2: the parameters become views into their group's flat buffer
// (their values copied in), then the masters come from them.
std::unique_ptr<FlatRuntime> MakeFlatRuntime(const RuntimeInputs& in, std::vector<GroupSpec> specs,
                                             const EngineOptions& options) {
  ModuleTensors& e = in.module;
  auto z = std::make_unique<FlatRuntime>(in.comm, std::move(specs), SettingsOf(in.config, options), in.device);
  std::vector<std::vector<at::Tensor>> bound(e.groups.size());
  {
    c10::NoGradGuard no_grad;
    for (size_t g = 0; g < e.groups.size(); ++g) {
      at::Tensor flat = z->model_flat(g);
      int64_t off = 0;
      for (auto& p : e.groups[g]) {
        const int64_t n = p.tensor.numel();
        at::Tensor view = flat.narrow(0, off, n).view(p.tensor.sizes());
        view.copy_(p.tensor);
        p.tensor.set_data(view);
        bound[g].push_back(p.tensor);
        off += n;
      }
      if (in.comm.world_size() > 1) BroadcastFromRank0(in.comm, flat);
    }
  }
  z->MastersFromWeights();
  z->BindGradients(bound);
  z->Fp16WrapperInitialStep();  // (stage 0 in fp16 only)
  if (options.overlap_update_with_forward && !options.gather_units.empty())
    z->OverlapUpdateWithForward(ParameterUnits(e, options), options.gather_units.size());
  return z;
}

}  // namespace

std::unique_ptr<ShardedRuntime> MakeShardedRuntime(const RuntimeInputs& in, std::vector<GroupSpec> specs,
                                                   const EngineOptions& options) {
  const ModuleTensors& e = in.module;
  const int stage = in.config.zero.stage;
  if (in.comm.world_size() > 1) {
    c10::NoGradGuard no_grad;
    for (const auto* list : {&e.frozen, &e.buffers})
      for (const auto& p : *list) BroadcastFromRank0(in.comm, p.tensor);
    // Stages 0-2 broadcast their flat buffers once the parameters are views
    // into them; parameters that arrived partitioned have no whole value to send.
    std::set<const void*> partitioned;
    for (const auto& p : options.partitioned) partitioned.insert(p.param.unsafeGetTensorImpl());
    if (stage == 3)
      for (const auto& g : e.groups)
        for (const auto& p : g)
          if (!partitioned.count(p.tensor.unsafeGetTensorImpl())) BroadcastFromRank0(in.comm, p.tensor);
  }
  if (stage == 3) return MakeZero3Runtime(in, specs, SettingsOf(in.config, options), options);
  return MakeFlatRuntime(in, std::move(specs), options);
}

}  // namespace uckpt::engine
