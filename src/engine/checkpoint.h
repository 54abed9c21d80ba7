// DeepSpeed's checkpoint layout, written and read by the trainer
// (shared/spec/deepspeed-zero-checkpoint.md, universal-checkpoint.md):
//   <dir>/<tag>/mp_rank_00_model_states.pt                 rank 0
//   <dir>/<tag>/[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt   every rank
//   <dir>/latest                                           the tag
// and the universal layout <dir>/<tag>/zero/<param>/{fp32,exp_avg,exp_avg_sq,step}.pt
// + zero/optimizer_state.pt + the model-states file + <dir>/latest_universal.
#pragma once

#include <string>

#include "format/value.h"
#include "engine/config.h"

namespace uckpt::engine {

// The DeepSpeed version our files claim to come from (the fixture's).
inline constexpr const char* kDeepSpeedVersion = "0.14.5";

// The value of a JSON document (dicts keep key order, ints stay ints).
ValuePtr JsonToValue(const nlohmann::json& j);

// Reads <dir>/<name> (`latest` or `latest_universal`), whitespace stripped.
// Throws FormatError naming the file if it is missing or empty.
std::string ReadTagFile(const std::string& dir, const std::string& name);

// File names inside a tag folder.
std::string ModelStatesName();
std::string OptimStatesName(int dp_rank, bool bf16);

}  // namespace uckpt::engine
