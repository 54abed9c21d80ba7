#include "ckpt/weights_plan.h"

#include <set>

#include "ckpt/values.h"
#include "format/error.h"

namespace uckpt::ckpt {

namespace {

std::string QuotedList(const std::vector<std::string>& names) {
  std::string s;
  for (const auto& n : names) s += (s.empty() ? "\"" : ", \"") + n + "\"";
  return s;
}

// Source names, each with the file tensor it stands for: the tensors, then
// the aliases safetensors' save_model put in a file's metadata.
std::map<std::string, std::string> SourceNames(const SafetensorsSource& source) {
  std::map<std::string, std::string> out;
  for (const std::string& n : source.names()) out[n] = n;
  for (const std::string& n : source.names()) {
    const SafetensorsFile* file = source.Find(n).file;
    for (const auto& [alias, kept] : file->metadata())
      if (kept == n && !out.count(alias)) out[alias] = kept;
  }
  return out;
}

}  // namespace

WeightNameMap PrefixRule(std::string strip, std::string add) {
  return [strip = std::move(strip), add = std::move(add)](const std::string& name) -> std::optional<std::string> {
    if (!name.starts_with(strip)) return name;
    return add + name.substr(strip.size());
  };
}

WeightsMatch MatchWeights(const SafetensorsSource& source, const std::vector<ModelTensor>& model,
                          const WeightNameMap& map) {
  // Model name -> file tensor.
  std::map<std::string, std::string> mapped, mapped_from;
  for (const auto& [name, tensor] : SourceNames(source)) {
    std::optional<std::string> to = map ? map(name) : std::optional<std::string>(name);
    if (!to) continue;
    if (auto [it, fresh] = mapped_from.emplace(*to, name); !fresh)
      throw FormatError(source.path() + ": tensors '" + it->second + "' and '" + name + "' both map to '" + *to + "'");
    mapped[*to] = tensor;
  }
  WeightsMatch m;
  std::set<std::string> known;
  std::vector<std::string> mismatched;
  for (const ModelTensor& t : model) {
    known.insert(t.name);
    auto it = mapped.find(t.name);
    if (it == mapped.end()) {
      m.missing.push_back(t.name);
      continue;
    }
    const SafetensorsTensor& src = *source.Find(it->second).tensor;
    if (src.shape != t.shape) {
      mismatched.push_back("size mismatch for " + t.name + ": copying a param with shape " + ShapeText(src.shape) +
                           " from checkpoint, the shape in current model is " + ShapeText(t.shape) + ".");
      continue;
    }
    m.source_of[t.owner] = it->second;
  }
  if (!mismatched.empty()) {
    std::string msg = source.path() + ": Error(s) in loading state_dict:";
    for (const auto& s : mismatched) msg += "\n\t" + s;
    throw FormatError(msg);
  }
  for (const auto& [name, tensor] : mapped)
    if (!known.count(name)) m.unexpected.push_back(name);
  return m;
}

std::string MismatchText(const WeightsMatch& m) {
  std::string s;
  if (!m.missing.empty()) s += "Missing key(s) in state_dict: " + QuotedList(m.missing) + ".";
  if (!m.unexpected.empty())
    s += std::string(s.empty() ? "" : " ") + "Unexpected key(s) in state_dict: " + QuotedList(m.unexpected) + ".";
  return s;
}

std::vector<WeightRead> PlanWeightReads(const SafetensorsSource& source, const WeightsMatch& match,
                                        const PartitionTarget& target) {
  std::vector<WeightRead> reads;
  for (const TargetFragment& f : target.fragments) {
    const TargetParam& p = target.params.at(f.param);
    auto it = match.source_of.find(p.name);
    if (it == match.source_of.end()) continue;
    const SafetensorsSource::Found src = source.Find(it->second);
    if (src.tensor->numel != p.numel)
      throw FormatError(source.path() + ": tensor '" + it->second + "' has " + std::to_string(src.tensor->numel) +
                        " elements, parameter " + p.name + " " + std::to_string(p.numel));
    reads.push_back({src.file->Elements(*src.tensor, f.param_offset, f.numel), src.tensor->dtype, f.offset, f.numel});
  }
  return reads;
}

}  // namespace uckpt::ckpt
