// Stage 3's part of the sharded runtime's construction (sharded_runtime.cc):
// parameters sorted into gather units, partitioned (engine/zero3_runtime.h).
#include <map>
#include <set>
#include <stdexcept>

#include "ckpt/partition.h"
#include "engine/runtime_setup.h"
#include "engine/zero3_runtime.h"

namespace uckpt::engine {
namespace {

// The prefix ("transformer.h.0") of every declared unit inside the module.
std::vector<std::string> UnitPrefixes(const torch::nn::Module& model, const EngineOptions& options) {
  std::map<const torch::nn::Module*, std::string> prefix_of;
  for (const auto& m : model.named_modules("", /*include_self=*/true)) prefix_of.emplace(m.value().get(), m.key());
  std::vector<std::string> prefixes;
  for (size_t u = 0; u < options.gather_units.size(); ++u) {
    const auto& unit = options.gather_units[u];
    auto it = unit ? prefix_of.find(unit.get()) : prefix_of.end();
    if (it == prefix_of.end())
      throw std::invalid_argument("uckpt::Engine: gather_units[" + std::to_string(u) +
                                  "] is not a submodule of the model");
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

std::vector<std::vector<int>> ParameterUnits(const ModuleTensors& e, const EngineOptions& options) {
  // A parameter's unit: the unit holding all its names (tied aliases
  // included); names in several units or outside any make it the root's.
  const std::vector<std::string> prefixes = UnitPrefixes(*e.model, options);
  std::map<std::string, std::vector<std::string>> names_of;  // owner -> alias names
  for (const auto& [alias, owner] : e.aliases) names_of[owner].push_back(alias);
  std::vector<std::vector<int>> unit_of;
  for (const auto& group : e.groups) {
    unit_of.emplace_back();
    for (const auto& p : group) {
      int unit = UnitOfName(prefixes, p.name);
      for (const auto& alias : names_of[p.name])
        if (UnitOfName(prefixes, alias) != unit) unit = -1;
      unit_of.back().push_back(unit);
    }
  }
  return unit_of;
}

std::unique_ptr<Zero3Runtime> MakeZero3Runtime(const RuntimeInputs& in, const std::vector<GroupSpec>& specs,
                                               const ZeroSettings& base, const EngineOptions& options) {
  const TrainConfig& c = in.config;
  const ModuleTensors& e = in.module;
  std::vector<std::vector<int>> unit_of = ParameterUnits(e, options);
  std::vector<std::vector<std::pair<std::string, at::Tensor>>> groups;
  std::vector<OptimizerConfig> optimizers;
  for (size_t g = 0; g < e.groups.size(); ++g) {
    groups.emplace_back();
    optimizers.push_back(specs.at(g).optimizer);
    for (const auto& p : e.groups[g]) groups.back().emplace_back(p.name, p.tensor);
  }
  Zero3Settings zs;
  zs.base = base;
  zs.persistence_threshold = c.zero.param_persistence_threshold;
  zs.sub_group_size = c.zero.sub_group_size;
  zs.offload_param_cpu = c.zero.offload_param_cpu;
  zs.prefetch_bucket_size = c.zero.prefetch_bucket_size;
  zs.max_live_parameters = c.zero.max_live_parameters;
  std::map<const void*, at::Tensor> given;
  for (const auto& p : options.partitioned) given[p.param.unsafeGetTensorImpl()] = p.partition;
  return std::make_unique<Zero3Runtime>(in.comm, std::move(groups), std::move(optimizers), unit_of,
                                        static_cast<int>(options.gather_units.size()), zs, in.device, given);
}

void RefuseTensorsWithoutValues(const torch::nn::Module& model, const EngineOptions& options) {
  std::set<const void*> given;
  for (const auto& p : options.partitioned) given.insert(p.param.unsafeGetTensorImpl());
  const std::string build_instead =
      "build the model on the CPU, or, at ZeRO stage 3, unit by unit inside a uckpt::ZeroInit scope (Python: "
      "deepspeed.zero.Init), which partitions each unit as it is built (docs/engine.md, \"Building a model "
      "partitioned\")";
  for (const auto& p : model.named_parameters(/*recurse=*/true)) {
    const at::Tensor& t = p.value();
    if (t.is_meta())
      throw std::invalid_argument("uckpt::Engine: parameter " + p.key() +
                                  " is on the meta device: it has a shape but no values, and libtorch can neither "
                                  "copy it out nor turn it into a tensor of another device in place; " +
                                  build_instead);
    if (!given.count(t.unsafeGetTensorImpl()) && t.numel() > 0 && (!t.has_storage() || t.storage().nbytes() == 0))
      throw std::invalid_argument(
          "uckpt::Engine: parameter " + p.key() +
          " has no storage (partitioned by a uckpt::ZeroInit scope or by another stage-3 "
          "engine) and is not in EngineOptions::partitioned: hand the scope's partitions to the "
          "engine with ZeroInit::AddTo(options)");
  }
  for (const auto& b : model.named_buffers(/*recurse=*/true))
    if (b.value().is_meta())
      throw std::invalid_argument("uckpt::Engine: buffer " + b.key() + " is on the meta device (no values); " +
                                  build_instead);
}

void PreparePartitionedParameters(const RuntimeInputs& in, const EngineOptions& options) {
  if (options.partitioned.empty()) return;
  std::map<const void*, std::string> name_of;
  for (const auto& p : in.module.model->named_parameters(/*recurse=*/true))
    name_of.emplace(p.value().unsafeGetTensorImpl(), p.key());
  const int stage = in.config.zero.stage;
  if (stage != 3)
    throw std::invalid_argument("uckpt::Engine: " + std::to_string(options.partitioned.size()) +
                                " parameters arrive partitioned (EngineOptions::partitioned: built under "
                                "uckpt::ZeroInit or zero.Init), which needs ZeRO stage 3; the config has stage " +
                                std::to_string(stage) +
                                ": set zero_optimization.stage 3, or build the model whole (without ZeroInit) for "
                                "stages 0-2");
  const int dp = in.comm.world_size();
  const at::ScalarType model_dtype = ModelDtype(in.config);
  c10::NoGradGuard no_grad;
  for (const auto& p : options.partitioned) {
    auto it = name_of.find(p.param.unsafeGetTensorImpl());
    if (it == name_of.end())
      throw std::invalid_argument("uckpt::Engine: a partitioned parameter is not a parameter of the module");
    int64_t numel = 1;
    for (int64_t d : p.shape) numel *= d;
    const int64_t ps = ckpt::Stage3PartitionSize(numel, dp);
    if (p.partition.numel() != ps)
      throw std::invalid_argument("uckpt::Engine: " + it->second + " arrived partitioned with " +
                                  std::to_string(p.partition.numel()) + " elements per rank; at " + std::to_string(dp) +
                                  " ranks its partition has " + std::to_string(ps) +
                                  " (was it partitioned at another world size?)");
    const at::ScalarType dtype = p.partition.is_floating_point() ? model_dtype : p.partition.scalar_type();
    const auto options_of = at::TensorOptions().dtype(dtype).device(in.device);
    if (p.param.requires_grad()) {
      p.param.set_data(StoragelessTensor(p.shape, options_of));
      continue;
    }
    at::Tensor mine = p.partition.reshape({-1}).to(options_of).contiguous();
    at::Tensor all = at::empty({ps * dp}, options_of);
    if (dp > 1) in.comm.AllGather(mine, all);
    else all.copy_(mine);
    p.param.set_data(all.narrow(0, 0, numel).view(p.shape).clone());
  }
}

}  // namespace uckpt::engine
