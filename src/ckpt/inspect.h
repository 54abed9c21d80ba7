// What `uckpt inspect DIR` shows for a checkpoint folder: a ZeRO tag folder,
// a universal folder, or their parent with `latest` / `latest_universal`.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <ostream>
#include <string>
#include <vector>

namespace uckpt::ckpt {

struct CheckpointInfo {
  std::string path;             // the tag folder described
  std::string kind;             // "zero" or "universal"
  int zero_stage = 0;           // 1..3 (universal: of the checkpoint it came from); 0 unknown
  bool bf16_optimizer = false;  // BF16_Optimizer files (no zero_stage)
  int world_size = 0;           // data-parallel size it was saved at
  int tensor_parallel = 1;      // tensor-parallel (AutoTP) size it was saved at
  std::string dtype;            // model weights (module) dtype, "" if unknown
  std::string master_dtype;     // fp32 master weights dtype
  std::string
      optimizer;  // ds_config optimizer type when the state agrees, else the torch optimizers its state keys fit
  std::vector<std::string> optimizer_states;  // per-element states (exp_avg, ...)
  std::string optimizer_step;                 // the optimizer's step, as text ("" if none)
  size_t param_groups = 0;
  size_t params = 0;         // trainable parameter tensors
  int64_t numel = 0;         // their elements
  uint64_t state_bytes = 0;  // fp32 master + optimizer states of those parameters
  int64_t global_steps = -1;
  size_t files = 0;  // files in the folder (recursively)
  uint64_t file_bytes = 0;
  std::vector<std::string> warnings;
};

// Throws FormatError / IoError naming the file if `path` is not a readable
// checkpoint folder.
CheckpointInfo InspectCheckpoint(const std::string& path);

nlohmann::json CheckpointInfoJson(const CheckpointInfo& info);
void PrintCheckpointInfo(std::ostream& os, const CheckpointInfo& info);

}  // namespace uckpt::ckpt
