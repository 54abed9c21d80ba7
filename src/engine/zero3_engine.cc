// Stage 3's part of uckpt::Engine's construction: parameters broadcast from
// rank 0, sorted into gather units, partitioned (engine/zero3.h).
#include <c10/core/GradMode.h>

#include <map>
#include <set>
#include <stdexcept>

#include "engine/engine_impl.h"

namespace uckpt::engine {
namespace {

// The prefix ("transformer.h.0") of every declared unit inside the module.
std::vector<std::string> UnitPrefixes(const Engine::Impl& e, const EngineOptions& options) {
  std::map<const torch::nn::Module*, std::string> prefix_of;
  for (const auto& m : e.model->named_modules("", /*include_self=*/true)) prefix_of.emplace(m.value().get(), m.key());
  std::vector<std::string> prefixes;
  for (size_t u = 0; u < options.gather_units.size(); ++u) {
    const auto& unit = options.gather_units[u];
    auto it = unit ? prefix_of.find(unit.get()) : prefix_of.end();
    if (it == prefix_of.end())
      throw std::invalid_argument("uckpt::Engine: gather_units[" + std::to_string(u) + "] is not a submodule of the model");
    prefixes.push_back(it->second);
  }
  return prefixes;
}

int UnitOfName(const std::vector<std::string>& prefixes, const std::string& name) {
  int found = -1;
  size_t longest = 0;
  for (size_t u = 0; u < prefixes.size(); ++u) {
    const std::string& p = prefixes[u];
    if (p.empty() || (name.size() > p.size() && name.compare(0, p.size(), p) == 0 && name[p.size()] == '.')) {
      if (found < 0 || p.size() > longest) found = static_cast<int>(u), longest = p.size();  // the innermost unit
    }
  }
  return found;
}

}  // namespace

void InitZero3(Engine::Impl& e, const std::vector<GroupSpec>& specs, const EngineOptions& options) {
  const TrainConfig& c = e.config;
  // Every rank starts from rank 0's whole weights, as DeepSpeed's initialize.
  if (e.comm->world_size() > 1) {
    c10::NoGradGuard no_grad;
    for (const auto* list : {&e.frozen, &e.buffers})
      for (const auto& p : *list) {
        at::Tensor t = p.tensor.contiguous();
        e.comm->Broadcast(t, 0);
        if (!t.is_same(p.tensor)) p.tensor.copy_(t);
      }
    for (const auto& g : e.groups)
      for (const auto& p : g) {
        at::Tensor t = p.tensor.detach().contiguous();
        e.comm->Broadcast(t, 0);
        if (!t.is_same(p.tensor)) p.tensor.detach().copy_(t);
      }
  }
  // A parameter's unit: the unit holding all its names (tied aliases
  // included); names in several units or outside any make it the root's.
  const std::vector<std::string> prefixes = UnitPrefixes(e, options);
  std::map<std::string, std::vector<std::string>> names_of;  // owner -> alias names
  for (const auto& [alias, owner] : e.aliases) names_of[owner].push_back(alias);
  std::vector<std::vector<std::pair<std::string, at::Tensor>>> groups;
  std::vector<std::vector<int>> unit_of;
  std::vector<OptimizerConfig> optimizers;
  for (size_t g = 0; g < e.groups.size(); ++g) {
    groups.emplace_back();
    unit_of.emplace_back();
    optimizers.push_back(specs.at(g).optimizer);
    for (const auto& p : e.groups[g]) {
      int unit = UnitOfName(prefixes, p.name);
      for (const auto& alias : names_of[p.name])
        if (UnitOfName(prefixes, alias) != unit) unit = -1;
      groups.back().emplace_back(p.name, p.tensor);
      unit_of.back().push_back(unit);
    }
  }
  Zero3Settings zs;
  zs.base.stage = 3;
  zs.base.gradient_clipping = c.gradient_clipping;
  zs.base.optimizer = c.optimizer;
  zs.base.model_dtype = e.groups[0][0].tensor.scalar_type();
  zs.base.fp16 = c.fp16;
  zs.base.offload_optimizer_cpu = c.zero.offload_optimizer_cpu;
  zs.base.reduce_bucket_size = c.zero.reduce_bucket_size;
  zs.base.overlap_comm = c.zero.overlap_comm;
  zs.persistence_threshold = c.zero.param_persistence_threshold;
  zs.sub_group_size = c.zero.sub_group_size;
  zs.offload_param_cpu = c.zero.offload_param_cpu;
  zs.prefetch_bucket_size = c.zero.prefetch_bucket_size;
  zs.max_live_parameters = c.zero.max_live_parameters;
  e.zero3 = std::make_unique<Zero3Optimizer>(*e.comm, std::move(groups), std::move(optimizers), unit_of,
                                             static_cast<int>(prefixes.size()), zs, e.device);
}

}  // namespace uckpt::engine
