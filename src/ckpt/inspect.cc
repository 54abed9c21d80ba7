#include "ckpt/inspect.h"

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <optional>

#include "ckpt/deepspeed_state.h"
#include "ckpt/folder.h"
#include "ckpt/universal_checkpoint.h"
#include "ckpt/values.h"
#include "ckpt/zero_checkpoint.h"
#include "format/error.h"
#include "format/value_print.h"

namespace uckpt::ckpt {

namespace fs = std::filesystem;

namespace {

std::string ModuleDtype(const TorchFile& model) {
  ValuePtr module = ModuleStateDictOf(model.root);
  if (!module) return "";
  for (const auto& [k, v] : module->entries)
    if (v && v->tensor) return std::string(DTypeName(v->tensor->dtype));
  return "";
}

std::string ConfigOptimizer(const TorchFile& model) {
  ValuePtr cfg = ReadSavedConfig(model.root);
  ValuePtr opt = cfg && cfg->is_dict() ? cfg->get("optimizer") : nullptr;
  ValuePtr type = opt && opt->is_dict() ? opt->get("type") : nullptr;
  return type && type->kind == Kind::kStr ? type->s : "";
}

// The torch optimizers (1.13) whose state has exactly these per-element keys
// (sorted) and scalars besides `step`: what the keys say, and no more.
std::string OptimizersWithStates(std::vector<std::string> keys, std::vector<std::string> scalars) {
  std::sort(keys.begin(), keys.end());
  std::sort(scalars.begin(), scalars.end());
  using Keys = std::vector<std::string>;
  struct Known {
    Keys keys, scalars;
    const char* names;
  };
  static const Known kKnown[] = {
      {{kExpAvg, kExpAvgSq}, {}, "Adam, AdamW or RAdam"},
      {{kExpAvg, kExpAvgSq}, {"mu_product"}, "NAdam"},
      {{kExpAvg, kExpAvgSq, "max_exp_avg_sq"}, {}, "Adam or AdamW with amsgrad"},
      {{kExpAvg, "exp_inf"}, {}, "Adamax"},
      {{"momentum_buffer"}, {}, "SGD with momentum"},
      {{"sum"}, {}, "Adagrad"},
      {{"square_avg"}, {}, "RMSprop"},
      {{"momentum_buffer", "square_avg"}, {}, "RMSprop with momentum"},
      {{"grad_avg", "square_avg"}, {}, "RMSprop (centered)"},
      {{"grad_avg", "momentum_buffer", "square_avg"}, {}, "RMSprop (centered, with momentum)"},
      {{"acc_delta", "square_avg"}, {}, "Adadelta"},
      {{"prev", "step_size"}, {}, "Rprop"},
      {{"ax"}, {"eta", "mu"}, "ASGD"},
  };
  if (keys.empty() && scalars.empty())
    return "none (no optimizer state: before the first step, or SGD without momentum)";
  for (const Known& k : kKnown)
    if (k.keys == keys && k.scalars == scalars) return k.names;
  return "unknown";
}

// The config's optimizer type when the state agrees with it (DeepSpeed uses a
// client optimizer over the config's section), else what the state keys say.
std::string OptimizerLabel(const std::string& config_type, const std::vector<std::string>& keys,
                           const std::vector<std::string>& scalars) {
  const std::string by_state = OptimizersWithStates(keys, scalars);
  if (config_type.empty()) return by_state;
  std::string lower = config_type;
  for (char& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  const bool adam_keys = keys.size() >= 2 && IsAdamStateKeys({keys[0], keys[1]});
  const bool adam_type = lower.find("adam") != std::string::npos || lower.find("lamb") != std::string::npos;
  if (keys.empty() || (adam_type && adam_keys && scalars.empty())) return config_type;
  std::string by_state_lower = by_state;  // the config names what the state says ("Adagrad")
  for (char& c : by_state_lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (by_state_lower.find(lower) != std::string::npos) return config_type;
  // DeepSpeed's Muon: momentum_buffer in its Muon group, Adam's moments in the
  // group of the parameters it leaves to Adam (either may be absent).
  const bool muon_keys = std::all_of(keys.begin(), keys.end(), [](const std::string& k) {
    return k == "momentum_buffer" || k == "exp_avg" || k == "exp_avg_sq";
  });
  if (lower == "muon" && muon_keys) return config_type;
  return by_state + " by its state keys (the config's optimizer section says " + config_type +
         ": a client optimizer was used instead)";
}

std::string ValueText(const ValuePtr& v) {
  if (!v) return "";
  if (v->kind == Kind::kTensor && v->tensor && v->tensor->numel() == 1) {
    auto b = v->tensor->contiguous_bytes();
    double d = ElementToDouble(v->tensor->dtype, b.data());
    if (d == static_cast<double>(static_cast<int64_t>(d))) return std::to_string(static_cast<int64_t>(d));
    return std::to_string(d);
  }
  if (v->kind == Kind::kInt) return std::to_string(v->i);
  if (v->kind == Kind::kFloat) return std::to_string(v->f);
  return KindName(*v);
}

void CountFiles(const std::string& folder, CheckpointInfo* info) {
  for (const auto& e : fs::recursive_directory_iterator(folder)) {
    std::error_code ec;
    if (!e.is_regular_file(ec)) continue;
    info->files += 1;
    info->file_bytes += e.file_size(ec);
  }
}

void InspectZero(const std::string& folder, CheckpointInfo* info) {
  ZeroCheckpoint z = OpenZeroCheckpoint(folder);
  info->kind = "zero";
  info->zero_stage = z.stage;
  info->bf16_optimizer = z.bf16_optimizer;
  info->world_size = z.dp;
  info->tensor_parallel = z.tp;
  info->dtype = ModuleDtype(z.model);
  info->master_dtype = z.params.empty() ? "" : std::string(DTypeName(z.params[0].states[0].dtype));
  info->optimizer_states = z.state_keys;
  std::vector<std::string> scalars;
  if (!z.params.empty())
    for (const auto& [key, v] : z.params[0].scalars) scalars.push_back(key);
  info->optimizer = OptimizerLabel(ConfigOptimizer(z.model), z.state_keys, scalars);
  if (!z.params.empty())
    if (ValuePtr step = z.steps.at(z.params[0].group)) info->optimizer_step = ValueText(step);
  size_t groups = 0;
  for (const auto& p : z.params) {
    groups = std::max(groups, p.group + 1);
    info->numel += p.numel;
    info->state_bytes += p.bytes();
  }
  info->param_groups = groups;
  info->params = z.params.size();
  info->global_steps = z.global_steps;
  info->warnings = z.warnings;
}

void InspectUniversal(const std::string& folder, CheckpointInfo* info) {
  UniversalCheckpoint u = OpenUniversalCheckpoint(folder);
  info->kind = "universal";
  info->world_size = u.source_dp;
  info->tensor_parallel = u.source_tp;
  info->dtype = ModuleDtype(u.model);
  info->optimizer_states = u.state_keys;
  info->optimizer = OptimizerLabel(ConfigOptimizer(u.model), u.state_keys, u.scalar_keys);
  info->global_steps = u.global_steps;
  info->param_groups = u.groups.size();
  const std::string opt_path = UniversalOptimizerStateFile(u.folder);
  std::error_code ec;
  std::optional<UniversalOptimizerFile> opt;
  if (fs::exists(opt_path, ec)) {
    opt = ReadUniversalOptimizerState(u);
    int stage = ParseZeroStage(opt->zero_stage, opt_path + ": zero_stage");
    info->zero_stage = stage == 0 ? 1 : stage;
    info->bf16_optimizer = stage == 0;
  } else {
    info->zero_stage = u.zero3 ? 3 : 0;
    info->warnings.push_back(opt_path + " is missing");
  }
  bool first = true;
  uint64_t state_element_bytes = 0;
  for (const auto& g : u.groups)
    for (const auto& p : g) {
      info->params += 1;
      info->numel += p.numel;
      const std::string dir = UniversalParamDir(u.folder, p.name);
      if (!fs::is_directory(dir, ec)) {
        info->warnings.push_back(dir + ": missing parameter folder");
        continue;
      }
      if (first) {
        first = false;
        for (const auto& key : u.state_keys)
          state_element_bytes += DTypeSize(LoadUniversalState(u, p.name, key).tensor->dtype);
        DType master = LoadUniversalState(u, p.name, kFp32).tensor->dtype;
        state_element_bytes += DTypeSize(master);
        info->master_dtype = std::string(DTypeName(master));
        if (u.has_step)
          info->optimizer_step = ValueText(LoadTorchFile(UniversalStateFile(u.folder, p.name, kStep)).root);
      }
    }
  info->state_bytes = static_cast<uint64_t>(info->numel) * state_element_bytes;
  if (info->optimizer_step.empty() && opt && opt->zero3_step)  // ZeRO-3: the step travels in optimizer_state.pt
    info->optimizer_step = ValueText(opt->zero3_step);
}

}  // namespace

CheckpointInfo InspectCheckpoint(const std::string& path) {
  auto tag = ResolveTagFolder(path);
  std::error_code ec;
  if (!tag) {
    if (!fs::is_directory(path, ec)) throw IoError(path + " is not a folder");
    throw FormatError(path +
                      ": not a checkpoint folder (no *_model_states.pt, *_optim_states.pt or zero/, and no "
                      "latest or latest_universal naming one)");
  }
  CheckpointInfo info;
  info.path = *tag;
  if (fs::is_directory(UniversalZeroDir(*tag), ec)) InspectUniversal(*tag, &info);
  else InspectZero(*tag, &info);
  CountFiles(*tag, &info);
  return info;
}

nlohmann::json CheckpointInfoJson(const CheckpointInfo& i) {
  nlohmann::json j = {{"path", i.path},
                      {"kind", i.kind},
                      {"zero_stage", i.zero_stage},
                      {"bf16_optimizer", i.bf16_optimizer},
                      {"world_size", i.world_size},
                      {"tensor_parallel", i.tensor_parallel},
                      {"dtype", i.dtype},
                      {"master_dtype", i.master_dtype},
                      {"optimizer", i.optimizer},
                      {"optimizer_states", i.optimizer_states},
                      {"optimizer_step", i.optimizer_step},
                      {"param_groups", i.param_groups},
                      {"params", i.params},
                      {"numel", i.numel},
                      {"state_bytes", i.state_bytes},
                      {"global_steps", i.global_steps},
                      {"files", i.files},
                      {"file_bytes", i.file_bytes},
                      {"warnings", i.warnings}};
  return j;
}

void PrintCheckpointInfo(std::ostream& os, const CheckpointInfo& i) {
  std::string kind = i.kind == "zero" ? "ZeRO-" + std::to_string(i.zero_stage) : "universal";
  if (i.kind == "universal" && i.zero_stage) kind += " (from ZeRO-" + std::to_string(i.zero_stage) + ")";
  if (i.bf16_optimizer) kind += ", BF16_Optimizer";
  os << i.path << "\n";
  os << "  kind:          " << kind << "\n";
  os << "  world size:    " << i.world_size << (i.kind == "universal" ? " (saved at; loads at any)" : "") << "\n";
  if (i.tensor_parallel > 1)
    os << "  tensor-parallel: " << i.tensor_parallel << " (AutoTP; parameters counted whole)\n";
  os << "  dtype:         " << (i.dtype.empty() ? "?" : i.dtype) << " weights, "
     << (i.master_dtype.empty() ? "?" : i.master_dtype) << " master\n";
  std::string states;
  for (const auto& s : i.optimizer_states) states += (states.empty() ? "" : ", ") + s;
  os << "  optimizer:     " << i.optimizer << (states.empty() ? "" : " (" + states + ")") << "\n";
  os << "  params:        " << i.params << " tensors in " << i.param_groups << " group(s), " << i.numel << " elements, "
     << HumanBytes(i.state_bytes) << " of master + optimizer state\n";
  os << "  global step:   " << i.global_steps;
  if (!i.optimizer_step.empty()) os << " (optimizer step " << i.optimizer_step << ")";
  os << "\n";
  os << "  files:         " << i.files << ", " << HumanBytes(i.file_bytes) << "\n";
  for (const auto& w : i.warnings) os << "  warning: " << w << "\n";
}

}  // namespace uckpt::ckpt
