#include "ckpt/universal_checkpoint.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <map>
#include <optional>

#include "ckpt/deepspeed_state.h"
#include "ckpt/folder.h"
#include "ckpt/manifest.h"
#include "ckpt/values.h"
#include "format/env.h"
#include "format/error.h"

namespace uckpt::ckpt {

namespace fs = std::filesystem;

UniversalCheckpoint OpenUniversalCheckpoint(const std::string& folder, bool verify_hashes, bool check_manifest) {
  const TagFolder opened = OpenTagFolder(folder);
  if (check_manifest) CheckFolderAgainstManifest(opened, verify_hashes);
  return OpenUniversalCheckpoint(opened);
}

UniversalCheckpoint OpenUniversalCheckpoint(const TagFolder& folder) {
  UniversalCheckpoint u;
  u.folder = folder.path;
  if (folder.kind != FolderKind::kUniversal)
    throw FormatError(u.folder + ": no zero/ folder; not a universal checkpoint");
  if (folder.model_states.empty()) throw FormatError(u.folder + ": no copied *_model_states.pt file");
  const std::string model_path = folder.model_states.front().path;
  u.model = LoadTorchFile(model_path);
  for (const auto& shapes : ReadRequiredParamShapes(u.model.root, model_path)) {
    std::vector<UniversalParam> group;
    for (const NamedShape& p : shapes) group.push_back({p.name, p.shape, p.numel()});
    u.groups.push_back(std::move(group));
  }
  const ModelStatesRun run = ReadModelStatesRun(u.model.root);
  if (run.dp_world_size) u.source_dp = static_cast<int>(*run.dp_world_size);
  if (run.global_steps) u.global_steps = *run.global_steps;
  if (run.mp_world_size && *run.mp_world_size > 1) {
    u.source_tp = static_cast<int>(*run.mp_world_size);
    for (auto& g : u.groups)
      for (auto& p : g) {
        const std::string path = UniversalStateFile(u.folder, p.name, kFp32);
        TorchFile f = LoadTorchFile(path);
        ValuePtr v = f.root && f.root->is_dict() ? Need(f.root, kUniversalParam, path) : f.root;
        p.shape = AsTensor(v, path).shape;
        p.numel = NumelOf(p.shape);
      }
  }
  const UniversalParam* first = nullptr;
  for (const auto& g : u.groups)
    if (!g.empty()) {
      first = &g[0];
      break;
    }
  if (!first) return u;
  const std::string dir = UniversalParamDir(u.folder, first->name);
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) throw FormatError(dir + ": missing parameter folder");
  for (const Env::DirEntry& e : Env::Current().ListDir(dir)) {
    const std::optional<std::string> key = UniversalStateKey(e.name);
    if (!key) continue;
    if (*key == kStep) u.has_step = true;
    else if (*key != kFp32) u.state_keys.push_back(*key);
  }
  std::sort(u.state_keys.begin(), u.state_keys.end());
  // A 0-d file is a scalar of the optimizer's, not a per-element state.
  std::erase_if(u.state_keys, [&](const std::string& key) {
    const ValuePtr v = ReadUniversalScalar(u, first->name, key).value;
    const bool scalar = v && (v->kind == Kind::kInt || v->kind == Kind::kFloat ||
                              (v->kind == Kind::kTensor && v->tensor->shape.empty()));
    if (scalar) u.scalar_keys.push_back(key);
    return scalar;
  });
  TorchFile fp32 = LoadTorchFile(UniversalStateFile(u.folder, first->name, kFp32));
  u.zero3 = fp32.root && fp32.root->kind == Kind::kTensor;
  return u;
}

LoadedState LoadUniversalState(const UniversalCheckpoint& u, const std::string& name, const std::string& key) {
  LoadedState s;
  const std::string path = UniversalStateFile(u.folder, name, key);
  s.file = LoadTorchFile(path);
  ValuePtr v = s.file.root;
  if (v && v->is_dict()) v = Need(v, kUniversalParam, path);
  s.tensor = &AsTensor(v, path);
  return s;
}

UniversalStates MapUniversalStates(const UniversalCheckpoint& u, const std::vector<std::string>& names,
                                   const std::vector<std::string>& keys) {
  std::map<std::string, const UniversalParam*> listed;
  for (const auto& g : u.groups)
    for (const auto& p : g) listed.emplace(p.name, &p);
  UniversalStates out;
  out.source.folder = u.folder;
  out.source.listed = u.model.file ? u.model.file->path() : u.folder;
  for (const std::string& name : names) {
    ParamPlan plan{name, {}, 0, 0, {}, nullptr};
    for (const std::string& key : keys) {
      LoadedState s = LoadUniversalState(u, name, key);
      const std::string where = s.file.file->path();
      auto it = listed.find(name);
      if (key == keys.front()) {
        plan.shape = it != listed.end() ? it->second->shape : s.tensor->shape;
        plan.numel = NumelOf(plan.shape);
      }
      if (s.tensor->numel() != plan.numel)
        Fail(where,
             "has " + std::to_string(s.tensor->numel()) + " elements but param_shapes says " + ShapeText(plan.shape));
      plan.states.push_back({key, s.tensor->dtype, {TensorBytes(*s.tensor, where)}});
      out.files.push_back(std::move(s.file));
    }
    out.source.params.push_back(std::move(plan));
  }
  return out;
}

std::vector<uint8_t> LoadUniversalPartition(const UniversalCheckpoint& u, size_t group, const std::string& key, int dp,
                                            int rank, DType* dtype_out) {
  if (group >= u.groups.size()) throw FormatError(u.folder + ": no param group " + std::to_string(group));
  return LoadUniversalPartition(u, u.groups[group], key, dp, rank, dtype_out);
}

std::vector<uint8_t> LoadUniversalPartition(const UniversalCheckpoint& u, const std::vector<UniversalParam>& params,
                                            const std::string& key, int dp, int rank, DType* dtype_out) {
  std::vector<int64_t> numels;
  for (const auto& p : params) numels.push_back(p.numel);
  int64_t total = 0;
  for (int64_t n : numels) total += n;
  FlatLayout l = MakeFlatLayout(total, dp);
  std::vector<uint8_t> out;
  DType dtype = DType::kFloat32;
  bool first = true;
  for (const Fragment& f : RankFragments(numels, dp, rank)) {
    const UniversalParam& p = params[f.param];
    LoadedState s = LoadUniversalState(u, p.name, key);
    const std::string where = s.file.file->path();
    if (s.tensor->numel() != p.numel)
      Fail(where, "has " + std::to_string(s.tensor->numel()) + " elements but param_shapes says " + ShapeText(p.shape));
    if (first) {
      dtype = s.tensor->dtype;
      out.assign(static_cast<size_t>(l.partition_size) * DTypeSize(dtype), 0);
      first = false;
    } else if (s.tensor->dtype != dtype) {
      Fail(where, "dtype differs from the group's other parameters");
    }
    auto bytes = TensorElements(*s.tensor, f.param_offset, f.numel, where);
    std::memcpy(out.data() + static_cast<size_t>(f.partition_offset) * DTypeSize(dtype), bytes.data(), bytes.size());
  }
  if (first) out.assign(static_cast<size_t>(l.partition_size) * DTypeSize(dtype), 0);  // all padding
  if (dtype_out) *dtype_out = dtype;
  return out;
}

UniversalOptimizerFile ReadUniversalOptimizerState(const UniversalCheckpoint& u) {
  UniversalOptimizerFile s;
  const std::string path = UniversalOptimizerStateFile(u.folder);
  s.file = LoadTorchFile(path);
  const UniversalOptimizerStateView v = ReadUniversalOptimizerStateValue(s.file.root, path);
  s.loss_scaler = v.loss_scaler;
  s.param_groups = v.param_groups;
  s.zero_stage = v.zero_stage;
  s.zero3_step = v.zero3_step;
  s.overflow = v.overflow;
  return s;
}

LoadedScalar ReadUniversalScalar(const UniversalCheckpoint& u, const std::string& name, const std::string& key) {
  const std::string path = UniversalStateFile(u.folder, name, key);
  LoadedScalar s;
  s.file = LoadTorchFile(path);
  s.value = s.file.root && s.file.root->is_dict() ? Need(s.file.root, kUniversalParam, path) : s.file.root;
  return s;
}

double ReadUniversalStep(const UniversalCheckpoint& u, const std::string& name) {
  const std::string path = UniversalStateFile(u.folder, name, kStep);
  TorchFile f = LoadTorchFile(path);
  ValuePtr v = f.root && f.root->is_dict() ? Need(f.root, kUniversalParam, path) : f.root;
  return ScalarOf(v, path);
}

}  // namespace uckpt::ckpt
