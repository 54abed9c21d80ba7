#include "ckpt/deepspeed_names.h"

#include <string_view>

namespace uckpt::ckpt {

namespace {
// "mp_rank_07": DeepSpeed's two-digit model-parallel rank.
std::string MpRank(int mp_rank) {
  std::string digits = std::to_string(mp_rank);
  return "mp_rank_" + std::string(digits.size() < 2 ? 2 - digits.size() : 0, '0') + digits;
}
}  // namespace

std::string ModelStatesFileName(int mp_rank) { return MpRank(mp_rank) + "_model_states.pt"; }

std::string Zero3ModelStatesFileName(int dp_rank, int mp_rank) {
  return "zero_pp_rank_" + std::to_string(dp_rank) + "_" + MpRank(mp_rank) + "_model_states.pt";
}

std::string OptimStatesFileNameWithPrefix(int dp_rank, const std::string& prefix, int mp_rank) {
  return prefix + "zero_pp_rank_" + std::to_string(dp_rank) + "_" + MpRank(mp_rank) + "_optim_states.pt";
}

std::string OptimStatesFileName(int dp_rank, bool bf16) {
  return OptimStatesFileNameWithPrefix(dp_rank, bf16 ? "bf16_" : "");
}

namespace {

int ToInt(const std::string& digits) {
  // Names come from the file system; cap absurd numbers instead of overflowing.
  if (digits.size() > 9) return 1 << 30;
  return std::stoi(digits);
}

// Matches a file name against one of DeepSpeed's few fixed name patterns, left
// to right. Hand-written rather than std::regex: inside PyTorch's Python,
// whose wheel brings its own C++ runtime, std::regex's locale machinery
// crashed (docs/gpu.md).
class NameScanner {
 public:
  explicit NameScanner(std::string_view s) : s_(s) {}
  bool Lit(std::string_view lit) {
    if (s_.substr(pos_, lit.size()) != lit) return false;
    pos_ += lit.size();
    return true;
  }
  bool Digits(int* value = nullptr) {
    const size_t begin = pos_;
    while (pos_ < s_.size() && s_[pos_] >= '0' && s_[pos_] <= '9') ++pos_;
    if (pos_ == begin) return false;
    if (value) *value = ToInt(std::string(s_.substr(begin, pos_ - begin)));
    return true;
  }
  bool End() const { return pos_ == s_.size(); }

 private:
  std::string_view s_;
  size_t pos_ = 0;
};

// [bf16_|fp16_]zero_pp_rank_D_mp_rank_XX[_]optim_states.pt
bool IsOptimStates(const std::string& name, CheckpointFile* f) {
  NameScanner n(name);
  std::string prefix;
  for (const char* p : {"bf16_", "fp16_"})
    if (n.Lit(p)) prefix = p;
  if (!(n.Lit("zero_pp_rank_") && n.Digits(&f->dp) && n.Lit("_mp_rank_") && n.Digits(&f->mp))) return false;
  n.Lit("_");
  if (!(n.Lit("optim_states.pt") && n.End())) return false;
  f->prefix = prefix;
  return true;
}

// [layer_N_]expert_E_mp_rank_XX_model_states.pt or expp_rank_E_mp_rank_XX_optim_states.pt
bool IsMoeExpert(const std::string& name) {
  NameScanner a(name);
  if ((!a.Lit("layer_") || (a.Digits() && a.Lit("_"))) && a.Lit("expert_") && a.Digits() && a.Lit("_mp_rank_") &&
      a.Digits() && a.Lit("_model_states.pt") && a.End())
    return true;
  NameScanner b(name);
  return b.Lit("expp_rank_") && b.Digits() && b.Lit("_mp_rank_") && b.Digits() && b.Lit("_optim_states.pt") && b.End();
}

}  // namespace

CheckpointFile ClassifyFile(const std::string& folder, const std::string& name) {
  CheckpointFile f;
  f.name = name;
  f.path = folder.empty() ? name : folder + "/" + name;
  if (NameScanner n(name); n.Lit("mp_rank_") && n.Digits(&f.mp) && n.Lit("_model_states.pt") && n.End()) {
    f.kind = FileKind::kModelStates;
  } else if (NameScanner n(name); n.Lit("zero_pp_rank_") && n.Digits(&f.dp) && n.Lit("_mp_rank_") && n.Digits(&f.mp) &&
                                  n.Lit("_model_states.pt") && n.End()) {
    f.kind = FileKind::kZero3ModelStates;
  } else if (IsOptimStates(name, &f)) {
    f.kind = FileKind::kOptimStates;
  } else if (IsMoeExpert(name)) {
    f.kind = FileKind::kMoeExpert;
  } else if (name.size() >= 9 && name.starts_with("layer_") && name.ends_with(".pt")) {
    // DeepSpeed's converter treats every file starting with layer_ as a pipeline layer.
    f.kind = FileKind::kPipelineLayer;
  }
  if (f.kind != FileKind::kOptimStates && f.kind != FileKind::kZero3ModelStates) f.dp = -1;
  if (f.kind == FileKind::kOther || f.kind == FileKind::kMoeExpert || f.kind == FileKind::kPipelineLayer) f.mp = -1;
  return f;
}

const char* TagFileName(bool universal) { return universal ? kLatestUniversalFile : kLatestFile; }

std::string UniversalZeroDir(const std::string& folder) { return folder + "/" + kUniversalZeroDirName; }

std::string UniversalParamDir(const std::string& folder, const std::string& param) {
  return UniversalZeroDir(folder) + "/" + param;
}

std::string UniversalStateFile(const std::string& folder, const std::string& param, const std::string& key) {
  return UniversalParamDir(folder, param) + "/" + key + ".pt";
}

std::string UniversalOptimizerStateFile(const std::string& folder) {
  return UniversalZeroDir(folder) + "/optimizer_state.pt";
}

std::optional<std::string> UniversalStateKey(const std::string& file_name) {
  if (file_name.size() < 4 || !file_name.ends_with(".pt")) return std::nullopt;
  return file_name.substr(0, file_name.size() - 3);
}

}  // namespace uckpt::ckpt
