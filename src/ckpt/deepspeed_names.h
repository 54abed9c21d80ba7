// The names of DeepSpeed's checkpoint files, in one place: the files of a
// tag folder (each name made and parsed here), the tag files beside the tag
// folders, and the layout of a universal folder
// (shared/spec/deepspeed-zero-checkpoint.md §2; ds_to_universal's output).
// Every writer and reader spells a name through this file; what the files
// hold is ckpt/deepspeed_state.h's.
#pragma once

#include <optional>
#include <string>

namespace uckpt::ckpt {

// ---- The files of a tag folder (ckpt/global_step5) ----

// mp_rank_00_model_states.pt: the model states of ZeRO 0/1/2 (rank 0 writes it).
// `mp_rank`: a tensor-parallel rank's (DeepSpeed AutoTP), mp_rank_01, ...
std::string ModelStatesFileName(int mp_rank = 0);
// zero_pp_rank_<r>_mp_rank_00_model_states.pt: ZeRO 3's model states, one per rank.
std::string Zero3ModelStatesFileName(int dp_rank, int mp_rank = 0);
// <prefix>zero_pp_rank_<r>_mp_rank_00_optim_states.pt, prefix "" (ZeRO 1/2/3),
// "bf16_" (BF16_Optimizer) or "fp16_" (older DeepSpeed).
std::string OptimStatesFileNameWithPrefix(int dp_rank, const std::string& prefix, int mp_rank = 0);
// The name a run writes: prefix "bf16_" for BF16_Optimizer's files, else "".
std::string OptimStatesFileName(int dp_rank, bool bf16);

enum class FileKind {
  kModelStates,       // mp_rank_XX_model_states.pt
  kZero3ModelStates,  // zero_pp_rank_D_mp_rank_XX_model_states.pt
  kOptimStates,       // [bf16_|fp16_]zero_pp_rank_D_mp_rank_XX_optim_states.pt
  kPipelineLayer,     // layer_NN-model_states.pt, layer_NN-model_TT-model_states.pt (any layer_*.pt)
  kMoeExpert,         // [layer_L_]expert_E_mp_rank_XX_model_states.pt, expp_rank_*
  kOther,
};

struct CheckpointFile {
  std::string name;  // file name inside the folder
  std::string path;  // folder + "/" + name
  FileKind kind = FileKind::kOther;
  int dp = -1;         // data-parallel rank (zero_pp_rank_D), -1 if none
  int mp = -1;         // mp_rank_XX, -1 if none
  std::string prefix;  // optimizer files: "", "bf16_" or "fp16_"
};

// Classifies one file name: the parser of the names above (and of the
// pipeline and MoE files that are refused). Numbers are parsed as integers,
// so zero_pp_rank_10 sorts after zero_pp_rank_9.
CheckpointFile ClassifyFile(const std::string& folder, const std::string& name);

// ---- Tag files: beside the tag folders, each holds one tag folder's name ----

inline constexpr const char* kLatestFile = "latest";                     // the last save
inline constexpr const char* kLatestUniversalFile = "latest_universal";  // the last conversion
// kLatestUniversalFile for a universal checkpoint, else kLatestFile.
const char* TagFileName(bool universal);

// ---- A universal folder: zero/<param>/<key>.pt per parameter, the
// optimizer's remaining state, and the model-states files copied. ----

// <folder>/zero
inline constexpr const char* kUniversalZeroDirName = "zero";
std::string UniversalZeroDir(const std::string& folder);
// <folder>/zero/<param>
std::string UniversalParamDir(const std::string& folder, const std::string& param);
// <folder>/zero/<param>/<key>.pt; key "fp32" (the master), "step", or an
// optimizer state ("exp_avg").
std::string UniversalStateFile(const std::string& folder, const std::string& param, const std::string& key);
// <folder>/zero/optimizer_state.pt
std::string UniversalOptimizerStateFile(const std::string& folder);
// The key of a file in a parameter's folder ("exp_avg.pt" -> "exp_avg");
// nullopt for a name that is no <key>.pt.
std::optional<std::string> UniversalStateKey(const std::string& file_name);

}  // namespace uckpt::ckpt
