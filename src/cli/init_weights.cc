#include "cli/init_weights.h"

#include <c10/core/GradMode.h>
#include <nlohmann/json.hpp>

#include <map>
#include <set>

#include "ckpt/deepspeed_state.h"
#include "format/error.h"
#include "format/file.h"
#include "format/torch_file.h"
#include "engine/torch_bridge.h"

namespace uckpt::cli {

using models::NamedTensor;

namespace {

bool IsSafetensors(std::span<const uint8_t> b) {
  // An 8-byte little-endian header length followed by a JSON object.
  return b.size() >= 10 && !(b[0] == 'P' && b[1] == 'K') && b[8] == '{';
}

std::vector<NamedTensor> LoadSafetensors(const std::string& path, std::span<const uint8_t> b) {
  uint64_t n = 0;
  for (int k = 7; k >= 0; --k) n = (n << 8) | b[static_cast<size_t>(k)];
  if (n > b.size() - 8) throw FormatError(path + ": safetensors header length " + std::to_string(n) + " exceeds the file");
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(b.begin() + 8, b.begin() + 8 + static_cast<std::ptrdiff_t>(n));
  } catch (const nlohmann::json::exception& e) {
    throw FormatError(path + ": safetensors header is not JSON: " + e.what());
  }
  static const std::map<std::string, DType> kTypes = {
      {"F32", DType::kFloat32}, {"F64", DType::kFloat64}, {"F16", DType::kFloat16}, {"BF16", DType::kBFloat16},
      {"I64", DType::kInt64},   {"I32", DType::kInt32},   {"I16", DType::kInt16},   {"I8", DType::kInt8},
      {"U8", DType::kUInt8},    {"BOOL", DType::kBool}};
  const auto data = b.subspan(8 + n);
  std::vector<NamedTensor> out;
  for (auto& [name, info] : header.items()) {
    if (name == "__metadata__") continue;
    try {
      auto dt = kTypes.find(info.at("dtype").get<std::string>());
      if (dt == kTypes.end()) throw FormatError(path + ": tensor '" + name + "' has an unsupported dtype");
      Tensor t;
      t.dtype = dt->second;
      t.shape = info.at("shape").get<std::vector<int64_t>>();
      t.stride = Tensor::ContiguousStrides(t.shape);
      auto off = info.at("data_offsets").get<std::vector<uint64_t>>();
      if (off.size() != 2 || off[0] > off[1] || off[1] > data.size() || off[1] - off[0] != t.nbytes())
        throw FormatError(path + ": tensor '" + name + "' has bad data_offsets");
      t.storage = Storage::View(data.subspan(off[0], off[1] - off[0]), t.dtype, nullptr);
      out.push_back({name, engine::ToTorch(t)});
    } catch (const nlohmann::json::exception& e) {
      throw FormatError(path + ": tensor '" + name + "': " + e.what());
    }
  }
  return out;
}

// A DeepSpeed model-states file's module, a {"state_dict"|"model": ...}
// wrapper's dict (PyTorch Lightning, common training scripts), or the root.
ValuePtr FindStateDict(const ValuePtr& root) {
  if (ValuePtr module = ckpt::ModuleStateDictOf(root)) return module;
  if (!root || !root->is_dict()) return nullptr;
  for (const char* key : {"state_dict", "model"}) {
    auto v = root->get(key);
    if (v && v->is_dict()) return v;
  }
  return root;
}

}  // namespace

std::vector<NamedTensor> LoadStateDictFile(const std::string& path) {
  auto file = MappedFile::Open(path);
  if (IsSafetensors(file->bytes())) return LoadSafetensors(path, file->bytes());
  TorchFile tf = LoadTorchFile(file);
  ValuePtr sd = FindStateDict(tf.root);
  if (!sd) throw FormatError(path + ": holds a " + KindName(*tf.root) + ", not a state dict");
  std::vector<NamedTensor> out;
  for (const auto& [k, v] : sd->entries) {
    if (k->kind != Kind::kStr || !v || !v->tensor || (v->kind != Kind::kTensor && v->kind != Kind::kParameter))
      continue;
    out.push_back({k->s, engine::ToTorch(*v->tensor)});
  }
  if (out.empty()) throw FormatError(path + ": holds no tensors named by strings (not a state dict)");
  return out;
}

void CopyStateDict(const std::vector<NamedTensor>& state, const std::vector<NamedTensor>& params,
                   const std::string& source) {
  std::map<std::string, const at::Tensor*> by_name;
  for (const auto& [name, t] : state) by_name[name] = &t;
  std::set<std::string> used;
  c10::NoGradGuard no_grad;
  for (const auto& [name, p] : params) {
    auto it = by_name.find(name);
    if (it == by_name.end()) throw FormatError(source + ": has no tensor '" + name + "'");
    const at::Tensor& t = *it->second;
    if (t.sizes() != p.sizes())
      throw FormatError(source + ": '" + name + "' has shape " + c10::str(t.sizes()) + ", the model needs " +
                        c10::str(p.sizes()));
    p.copy_(t);
    used.insert(name);
  }
  std::string unknown;
  for (const auto& [name, t] : state) {
    if (used.count(name)) continue;
    bool alias = name == "lm_head.weight";
    bool hf_buffer = name.ends_with(".attn.bias") || name.ends_with(".attn.masked_bias");
    if (!alias && !hf_buffer) unknown += (unknown.empty() ? "" : ", ") + name;
  }
  if (!unknown.empty()) throw FormatError(source + ": tensors the model does not have: " + unknown);
}

}  // namespace uckpt::cli
