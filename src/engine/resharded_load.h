// How every load fills this rank's partitions, whatever the checkpoint and
// the stage: the partition slots the runtime owns (sharded_runtime.h: a
// group's flat partition at stages 0-2, a sub-group's at stage 3), a source
// opened by what the folder is (a ZeRO folder's rank files of stage 1, 2 or
// 3, uckpt's or DeepSpeed's, at any world size; a universal folder; a
// model-states file's module and stage-0 Adam state), the reads of each slot
// planned from it (ckpt/reshard.h) and run by the staged reader
// (staged_upload.h: straight into CPU tensors, through pinned chunks onto a
// GPU), bit for bit what loading the converted universal checkpoint gives.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "ckpt/deepspeed_state.h"
#include "ckpt/fingerprint.h"
#include "ckpt/reshard.h"
#include "ckpt/tag_folder.h"
#include "engine/engine_impl.h"
#include "engine/staged_upload.h"
#include "format/value.h"

namespace uckpt::engine {

// Which files a load reads the partitions from.
enum class SourceKind {
  kRankFiles,    // a ZeRO folder's *_optim_states.pt (stage 1, 2 or 3)
  kUniversal,    // a universal folder's zero/<param>/<state>.pt
  kModelStates,  // mp_rank_00_model_states.pt: the module's weights, stage 0's Adam state
};

// A source opened: where each parameter's states lie (with its saved Adam
// step where it keeps one), and what comes with the optimizer state.
struct LoadSource {
  SourceKind kind = SourceKind::kRankFiles;
  ckpt::ReadSource states;
  bool has_moments = false;  // Adam's moments are there (none before the first applied step)
  // The optimizer's per-element states the files hold besides fp32, in file
  // order (Adam's exp_avg, exp_avg_sq; another optimizer's own keys).
  std::vector<std::string> state_keys;
  bool steps_applied = false;          // no saved step: Adam's step is the applied steps (ZeRO-3's files)
  ValuePtr loss_scaler, param_groups;  // null when the source has none
  std::optional<bool> overflow;        // the ZeRO optimizer's `overflow`, where saved
  std::string optimizer_file;          // the file they come from, for messages
  // What the files cover for the resume proof (ckpt::FingerprintLayout);
  // empty for a model-states source.
  std::function<ckpt::StateFingerprint()> files_layout;
  std::shared_ptr<const void> maps;  // what `states` points into
  // Drops from this process the pages of the memory-mapped files that a read
  // has copied (ckpt::ReadOptions::read): a load's resident memory is its
  // partitions, not the files too. Null for a source of other memory.
  std::function<void(std::span<const uint8_t>)> release;
};

// The ZeRO folder `folder`'s rank files (the folder as the load opened it).
LoadSource OpenRankFiles(const ckpt::TagFolder& folder);

// The universal folder `folder`'s files of the parameters `slots` hold: the
// fp32 masters, and with `moments` the optimizer's state (when the folder has it).
LoadSource OpenUniversalFolder(const ckpt::TagFolder& folder, const std::vector<PartitionSlot>& slots, bool moments);

// The model states `m` read from `path` (which the caller keeps): the
// module's weights of the parameters `slots` hold, stage 0's Adam state and
// param groups with `moments`.
LoadSource ModelStatesSource(const ckpt::ModelStatesView& m, const std::string& path,
                             const std::vector<PartitionSlot>& slots, bool moments);

// The reads that fill every slot's fp32 master from `source`; with
// `moments` also Adam's moments, whose tensors it allocates, and sets Adam's
// step (none when the source has none; `applied_steps` is the step of a
// source that keeps none), else leaves them as they are. FillFromReads
// (staged_upload.h) runs them. Throws FormatError naming the file for a
// parameter the source lacks or holds in another shape.
// With `named` (the run's optimizer is a client's, PartitionState::named),
// the optimizer state is every state the source holds under its own keys:
// its per-element tensors, its step and other scalars (none before its
// first step). An Adam run refuses a source with another optimizer's state.
std::vector<TensorReads> PlanSlotLoads(const LoadSource& source, std::vector<PartitionSlot>& slots, bool moments,
                                       double applied_steps, bool named = false);

}  // namespace uckpt::engine
