// Stage 3's part of the sharded runtime's construction (sharded_runtime.cc):
// parameters sorted into gather units, partitioned (engine/zero3_runtime.h).
#include <map>
#include <set>
#include <stdexcept>

#include "engine/engine_impl.h"
#include "engine/zero3_runtime.h"

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

std::unique_ptr<Zero3Runtime> MakeZero3Runtime(Engine::Impl& e, const std::vector<GroupSpec>& specs,
                                                 const ZeroSettings& base, const EngineOptions& options) {
  const TrainConfig& c = e.config;
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
  zs.base = base;
  zs.persistence_threshold = c.zero.param_persistence_threshold;
  zs.sub_group_size = c.zero.sub_group_size;
  zs.offload_param_cpu = c.zero.offload_param_cpu;
  zs.prefetch_bucket_size = c.zero.prefetch_bucket_size;
  zs.max_live_parameters = c.zero.max_live_parameters;
  return std::make_unique<Zero3Runtime>(*e.comm, std::move(groups), std::move(optimizers), unit_of,
                                          static_cast<int>(prefixes.size()), zs, e.device);
}

}  // namespace uckpt::engine
