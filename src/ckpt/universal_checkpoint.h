// Reading a universal checkpoint folder (DeepSpeed's ds_to_universal layout):
// the parameter list from the copied model states, each parameter's whole
// tensors from zero/<name>/<state>.pt, and — what a training engine needs to
// resume at any world size — one rank's flat partition of a parameter group.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "ckpt/partition.h"
#include "ckpt/reshard.h"
#include "ckpt/tag_folder.h"
#include "format/torch_file.h"

namespace uckpt::ckpt {

struct UniversalParam {
  std::string name;
  std::vector<int64_t> shape;
  int64_t numel = 0;
};

struct UniversalCheckpoint {
  std::string folder;
  bool zero3 = false;                               // per-parameter files are bare 1-D tensors (from ZeRO-3)
  TorchFile model;                                  // the first copied model-states file
  std::vector<std::vector<UniversalParam>> groups;  // param_shapes: groups (ZeRO-3: sub-groups)
  std::vector<std::string> state_keys;              // per-element files of the first parameter, besides fp32 (sorted)
  bool has_step = false;                            // zero/<first param>/step.pt exists
  std::vector<std::string> scalar_keys;             // the optimizer's other scalar files ("mu_product"; sorted)
  int source_dp = 0;                                // dp_world_size recorded in the model states
  // mp_world_size recorded in the model states: > 1 for a folder converted
  // from tensor-parallel (AutoTP) ranks, whose model states hold rank 0's
  // shard shapes; `groups` then has the whole shapes of zero/<name>/fp32.pt.
  int source_tp = 1;
  int64_t global_steps = -1;
};

// Opens `folder` (holding zero/ and the model-states copies). Throws
// FormatError naming the file if it is not a universal checkpoint. A folder
// with a manifest is first checked against it (sizes; hashes with `verify_hashes`;
// not at all with `check_manifest` false, when the caller just did).
UniversalCheckpoint OpenUniversalCheckpoint(const std::string& folder, bool verify_hashes = false,
                                            bool check_manifest = true);
// The same from the folder as opened (ckpt/tag_folder.h): its listing, no
// manifest check (the caller's, from the same value).
UniversalCheckpoint OpenUniversalCheckpoint(const TagFolder& folder);

// zero/<name>/<key>.pt loaded; `*tensor` is the whole parameter (ZeRO-3 files
// reshaped to `shape` is the caller's business: their tensor is 1-D).
struct LoadedState {
  TorchFile file;
  const Tensor* tensor = nullptr;
};
LoadedState LoadUniversalState(const UniversalCheckpoint& u, const std::string& name, const std::string& key);

// The per-parameter files of `names` (zero/<name>/fp32.pt and <key>.pt of
// each of `keys`), mapped: what PlanStateReads (reshard.h) plans a load from
// this folder with. Each state is its file's whole tensor; a parameter's
// shape is param_shapes' (a ZeRO-3-made folder's files are 1-D). Throws
// naming the file for a missing or unreadable file, a tensor that is not
// contiguous or has another element count than param_shapes says.
struct UniversalStates {
  ReadSource source;
  std::vector<TorchFile> files;  // the maps source's plans point into
};
UniversalStates MapUniversalStates(const UniversalCheckpoint& u, const std::vector<std::string>& names,
                                   const std::vector<std::string>& keys);

// zero/optimizer_state.pt (ckpt/deepspeed_state.h's UniversalOptimizerStateView):
// the loss scaler and param groups a resume needs, the zero_stage as pickled,
// ZeRO-3's step (null when absent). Keeps the file mapped.
struct UniversalOptimizerFile {
  TorchFile file;
  ValuePtr loss_scaler, param_groups, zero_stage, zero3_step;
  std::optional<bool> overflow;
};
UniversalOptimizerFile ReadUniversalOptimizerState(const UniversalCheckpoint& u);

// zero/<name>/step.pt: Adam's step (a 0-d tensor or a number).
double ReadUniversalStep(const UniversalCheckpoint& u, const std::string& name);
// zero/<name>/<key>.pt of a scalar key (step, scalar_keys) as saved: a 0-d
// tensor or a number (`value` points into `file`'s map).
struct LoadedScalar {
  TorchFile file;
  ValuePtr value;
};
LoadedScalar ReadUniversalScalar(const UniversalCheckpoint& u, const std::string& name, const std::string& key);

// Rank `rank`'s flat partition (P elements, padding zero) of state `key`
// ("fp32", "exp_avg", ...) of param group `group`, re-partitioned for
// data-parallel size `dp` with DeepSpeed's stage 1/2 flat layout. The bytes
// are in the state's dtype (`*dtype`).
std::vector<uint8_t> LoadUniversalPartition(const UniversalCheckpoint& u, size_t group, const std::string& key, int dp,
                                            int rank, DType* dtype = nullptr);
// The same for a group given by its parameters: a stage 1/2 run's group from
// a ZeRO-3-made folder, whose param_shapes groups are stage 3's sub-groups.
std::vector<uint8_t> LoadUniversalPartition(const UniversalCheckpoint& u, const std::vector<UniversalParam>& params,
                                            const std::string& key, int dp, int rank, DType* dtype = nullptr);

}  // namespace uckpt::ckpt
