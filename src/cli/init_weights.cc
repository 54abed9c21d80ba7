#include "cli/init_weights.h"

#include <c10/core/GradMode.h>
#include <nlohmann/json.hpp>

#include <map>
#include <set>

#include "ckpt/deepspeed_state.h"
#include "engine/torch_bridge.h"
#include "format/error.h"
#include "format/file.h"
#include "format/safetensors.h"
#include "format/torch_file.h"

namespace uckpt::cli {

using models::NamedTensor;

namespace {

bool IsSafetensors(std::span<const uint8_t> b) {
  // An 8-byte little-endian header length followed by a JSON object.
  return b.size() >= 10 && !(b[0] == 'P' && b[1] == 'K') && b[8] == '{';
}

// Every tensor of the file (format/safetensors.h checks the header), viewing the map.
std::vector<NamedTensor> LoadSafetensors(const std::shared_ptr<const MappedFile>& file) {
  const SafetensorsFile f = SafetensorsFile::Parse(file);
  std::vector<NamedTensor> out;
  for (const SafetensorsTensor& st : f.tensors()) {
    Tensor t;
    t.dtype = st.dtype;
    t.shape = st.shape;
    t.stride = Tensor::ContiguousStrides(t.shape);
    t.storage = Storage::View(f.Elements(st, 0, st.numel), t.dtype, file);
    out.push_back({st.name, engine::ToTorch(t)});
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
  if (IsSafetensors(file->bytes())) return LoadSafetensors(file);
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
