// A DeepSpeed ZeRO checkpoint tag folder, opened and validated, with the plan
// of where every parameter's fp32 master and per-element optimizer states
// live: byte ranges of the memory-mapped rank files, in the order that
// concatenates them into the whole parameter.
//
// Supported: ZeRO 1/2 (DeepSpeedZeroOptimizer, fp32/fp16/bf16 file names),
// BF16_Optimizer, ZeRO 3; any data-parallel size; several parameter groups
// (stage-3 sub-groups); any optimizer whose per-parameter state is stored per
// element; AutoTP tensor parallelism at ZeRO 1/2 (ckpt/tp_checkpoint.h: each
// parameter's plan is then the whole parameter, merged across TP ranks).
// Refused with a message saying what is unsupported: pipeline
// parallel (layer_* files), MoE, elastic checkpoints, NVMe-offloaded
// stage-3 partitions, mappings that do not match the flat layout
// (round_robin_gradients).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "ckpt/deepspeed_state.h"
#include "ckpt/folder.h"
#include "ckpt/partition.h"
#include "ckpt/tag_folder.h"
#include "format/torch_file.h"

namespace uckpt::ckpt {

// One per-element tensor of one parameter ("fp32", "exp_avg", "momentum_buffer"):
// the concatenation of `pieces` is its flattened data.
struct StatePlan {
  std::string key;
  DType dtype = DType::kFloat32;
  std::vector<std::span<const uint8_t>> pieces;
  uint64_t bytes() const;
};

struct ParamPlan {
  std::string name;
  std::vector<int64_t> shape;
  int64_t numel = 0;
  size_t group = 0;               // optimizer param group (stage 3: sub-group)
  std::vector<StatePlan> states;  // "fp32" first, then the optimizer's keys in file order
  // The group's `step` (tensor or int), written as step.pt; null if none.
  // Stage 3: only for optimizers other than Adam (DeepSpeed's converter
  // writes none for ZeRO-3's Adam).
  ValuePtr step;
  // The optimizer's other scalar states ("mu_product"), each written as <key>.pt.
  std::vector<std::pair<std::string, ValuePtr>> scalars;
  // The states it keeps as None (SGD's momentum_buffer without momentum): no
  // file of their own, given back to the optimizer as None on a load.
  std::vector<std::string> none_states;
  uint64_t bytes() const;
};

// A parameter merged across tensor-parallel ranks (ZeroCheckpoint::tp > 1):
// what its universal files hold beyond its plan, as DeepSpeed's converter
// writes them for its TP rule (ckpt/tp_merge.h).
struct TpUniversalFile {
  // The keys of each file's dict before 'param': {'cat_dim': 1},
  // {'vocab_tensor': True}, or none.
  std::vector<std::pair<std::string, ValuePtr>> keys;
  // Per state (as ParamPlan::states): bytes the file's storage holds after
  // the tensor's (the rows a vocabulary parameter is cut by: DeepSpeed saves
  // the cut view with its whole storage); empty otherwise.
  std::vector<std::vector<std::span<const uint8_t>>> storage_tails;
};

struct ZeroCheckpoint {
  std::string folder;
  int stage = 0;                            // 0, 1, 2 or 3 (0: the module's weights and torch's optimizer state in the
                                            // model states, no rank files; dp 1)
  bool bf16_optimizer = false;              // BF16_Optimizer (no zero_stage key; counts as stage 1)
  int dp = 0;                               // data-parallel size
  int tp = 1;                               // tensor-parallel size (AutoTP; params are then merged over it)
  std::string optim_prefix;                 // "", "bf16_" or "fp16_"
  std::vector<CheckpointFile> model_files;  // copied verbatim into a universal output
  std::vector<CheckpointFile> optim_files;  // index = dp rank (tp > 1: tp * dp + dp rank)
  TorchFile model;                          // the first model-states file
  std::vector<TorchFile> optim;             // index = dp rank (as optim_files); the plan points into these maps
  std::vector<FlatLayout> layouts;          // stage 1/2: per param group
  std::vector<ParamPlan> params;            // trainable parameters, param_shapes order
  std::vector<std::string> state_keys;      // per-element optimizer states, e.g. exp_avg, exp_avg_sq
  std::vector<ValuePtr> steps;              // per group (stage 3: sub-group): the optimizer's step as
                                            // saved (rank 0's, a tensor or an int); null before the first
  // Stage 1/2 written by DeepSpeed >= 0.19.8: the module's entries that have
  // no optimizer state (frozen parameters, buffers), in module order. That
  // release's converter writes each as zero/<name>/fp32.pt = {'param': t.float()}.
  std::vector<std::pair<std::string, ValuePtr>> module_only;
  int64_t global_steps = -1;  // from the model states, -1 if absent
  // tp > 1: universal_checkpoint_info's category patterns no parameter
  // matched (DeepSpeed's converter refuses them unless --no_strict).
  std::vector<std::string> unused_tp_patterns;
  std::vector<TpUniversalFile> tp_files;  // tp > 1: per parameter, as `params`
  std::vector<std::string> warnings;      // accepted oddities worth telling the user

  uint64_t total_bytes() const;  // all per-parameter state bytes of the plan
};

// Opens `folder` (a tag folder such as ckpt/global_step5; a ZeRO 1-3 folder,
// or a stage-0 one: torch's optimizer state_dict in the model states),
// validates it and computes the plan. Throws FormatError naming the file for: missing or extra
// rank files, mixed world sizes or steps, shapes that do not add up, corrupt
// or truncated files, and unsupported layouts; IoError if files cannot be read.
// A folder with a manifest (ckpt/manifest.h) is first checked against it:
// sizes always, XXH64 hashes too with `verify_hashes`; not at all with
// `check_manifest` false (the caller just did, as `uckpt verify`).
ZeroCheckpoint OpenZeroCheckpoint(const std::string& folder, bool verify_hashes = false, bool check_manifest = true);
// The same from the folder as opened (ckpt/tag_folder.h): its listing, no
// manifest check (the caller's, from the same value). A folder with
// tensor-parallel ranks (mp_rank_01, ...) is opened by
// OpenTensorParallelCheckpoint (ckpt/tp_checkpoint.h).
ZeroCheckpoint OpenZeroCheckpoint(const TagFolder& folder);
// The files of one tensor-parallel rank of `folder` (mp_rank_<tp_rank>) as a
// checkpoint of its own: its shards, unmerged; model states recording
// mp_world_size `tp_degree`; universal_checkpoint_info's patterns not refused
// (the caller applies them).
ZeroCheckpoint OpenTensorParallelRank(const TagFolder& folder, int tp_rank, int tp_degree);

// The `zero/optimizer_state.pt` value DeepSpeed's converter writes
// (universal spec §3.3): stage 1/2 — rank 0's optimizer_state_dict without the
// sharded entries, group_paddings all 0, partition_count [dp]*G, plus
// param_groups; stage 3 — rank 0's whole optimizer_state_dict plus param_groups.
// Stage 0: the torch optimizer's param_groups alone.
ValuePtr UniversalOptimizerState(const ZeroCheckpoint& ckpt);

// Stage 0's model states as a universal folder holds them: the file's dict
// with param_shapes (per param group, as stage 1/2 record them) and without
// the optimizer state (in zero/ now). DeepSpeed converts no stage-0 folder.
ValuePtr Stage0UniversalModelStates(const ZeroCheckpoint& ckpt);

}  // namespace uckpt::ckpt
