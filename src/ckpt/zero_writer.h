// Writes DeepSpeed ZeRO checkpoints (stage 1/2 with DeepSpeedZeroOptimizer or
// BF16_Optimizer files, stage 3) with the keys and layout of DeepSpeed 0.14
// (shared/spec/deepspeed-zero-checkpoint.md §3-6). Used by tests and
// benchmarks to make checkpoints of any size and world size, and usable by a
// trainer that saves ZeRO checkpoints. Tensor data is streamed from a source
// callback, so checkpoints far larger than memory can be written.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "ckpt/state_keys.h"

namespace uckpt::ckpt {

struct ZeroParam {
  std::string name;
  std::vector<int64_t> shape;
};

// Appends to `pieces` the float32 bytes of elements [first, first + count) of
// the flattened state `key` ("fp32" or an optimizer state) of parameter
// `param` (its index over all groups, in order). The bytes must stay valid
// until WriteZeroCheckpoint returns.
using StateSource = std::function<void(size_t param, const std::string& key, int64_t first, int64_t count,
                                       std::vector<std::span<const uint8_t>>* pieces)>;

struct ZeroWriteSpec {
  int stage = 2;                // 1, 2 or 3
  bool bf16_optimizer = false;  // stage 1 only: BF16_Optimizer files (padded fp32 partitions, no zero_stage)
  std::string optim_prefix;     // "" or "bf16_"
  int dp = 2;
  std::vector<std::vector<ZeroParam>> groups;  // optimizer param groups, flat order
  std::vector<std::string> state_keys = {kExpAvg, kExpAvgSq};
  float step = 5;  // optimizer step (a 0-dim float32 tensor, as torch Adam keeps it)
  int64_t global_steps = 5;
  int64_t sub_group_size = 1000000000;  // stage 3
  bool legacy_group_paddings = true;    // DeepSpeed <= 0.16.3: padding recorded on the last rank only
  bool write_module = true;             // fp32 weights in `module` (off: an empty OrderedDict)
  StateSource source;
};

// Cheap data for tests and benchmarks of any size: element e of state `key`
// of parameter `param` is PatternValue(param, key, e), served from one table
// of a prime period (1,000,003 floats), so misplaced bytes do not go unseen.
StateSource PatternSource();
float PatternValue(size_t param, const std::string& key, int64_t element);

// Creates `folder` (must not exist) with the model-states and optimizer files
// of every rank. Throws IoError on write errors.
void WriteZeroCheckpoint(const std::string& folder, const ZeroWriteSpec& spec);

}  // namespace uckpt::ckpt
