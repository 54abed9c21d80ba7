// Loading a checkpoint at any world size without converting it: which byte
// ranges of the checkpoint's files make up one rank's partition.
//
// The source is a ReadSource: where every parameter's per-element states
// live (byte ranges of memory-mapped files, concatenating into the whole
// parameter). Three kinds of checkpoint give one: a ZeRO folder's rank files
// (ZeroReadSource over an opened ZeroCheckpoint, zero_checkpoint.h: stage
// 1/2 flat partitions or stage-3 per-parameter partitions alike), a universal
// folder's per-parameter files (MapUniversalStates, universal_checkpoint.h)
// and a model-states file's module and torch optimizer state (ModuleReadSource:
// stage 0's, or a stage 1/2 folder's weights).
// The target is a list of fragments: which elements of which parameter go
// where in the new rank's flat partition. Two target layouts are provided:
// the stage 1/2 flat buffer of a parameter group, and a stage-3 sub-group
// (every parameter partitioned on its own). The planner intersects the two
// and returns (source bytes -> destination offset) pieces, so over all new
// ranks each source byte of real data is read exactly once; padding is not
// read (the destination is zero-filled). No I/O here: ExecuteReads
// (copy_plan.h) runs the pieces.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "ckpt/copy_plan.h"
#include "ckpt/deepspeed_state.h"
#include "ckpt/zero_checkpoint.h"

namespace uckpt::ckpt {

// A target parameter: its name (looked up in the source), element count and,
// when not empty, its shape (checked against the source's param_shapes).
struct TargetParam {
  std::string name;
  int64_t numel = 0;
  std::vector<int64_t> shape;
};

// Elements [param_offset, param_offset + numel) of parameter `param` (index
// into the target's parameter list) go to element `offset` of the partition.
struct TargetFragment {
  size_t param = 0;
  int64_t param_offset = 0;
  int64_t numel = 0;
  int64_t offset = 0;
};

struct PartitionTarget {
  std::vector<TargetParam> params;
  std::vector<TargetFragment> fragments;
  int64_t length = 0;  // elements of the partition, padding included
};

// Rank `rank`'s partition of a stage 1/2 flat buffer over `dp` ranks
// (DeepSpeed's layout, partition.h).
PartitionTarget FlatPartitionTarget(std::vector<TargetParam> params, int dp, int rank);

// Rank `rank`'s partition of a stage-3 sub-group: each parameter's
// Stage3PartitionSize slots, one after another, its real elements first.
PartitionTarget Stage3PartitionTarget(std::vector<TargetParam> params, int dp, int rank);

// Every parameter's states, and what to name in messages.
struct ReadSource {
  std::string folder;  // the checkpoint folder
  std::string listed;  // the file that lists the parameters
  std::vector<ParamPlan> params;
};

// A ZeRO folder's parameters; the plans point into `z`'s maps: keep it alive.
ReadSource ZeroReadSource(const ZeroCheckpoint& z);

// A model-states file's (`path`) trainable parameters `names`, in torch's
// parameter order (stage 0's optimizer state is numbered so): "fp32" is the
// module's tensor (the 16-bit weights of an fp16/bf16 run), then stage 0's
// optimizer state when saved: its per-element states under their keys
// (Adam's exp_avg, exp_avg_sq; SGD's momentum_buffer, ...), `step` and other
// scalars. Throws FormatError naming `path` for a missing or non-contiguous
// tensor, or a state of another size than its parameter.
ReadSource ModuleReadSource(const ModelStatesView& m, const std::string& path, const std::vector<std::string>& names);

// The reads that fill state `key` ("fp32", "exp_avg", ...) of `target` from
// `source`, destination offsets in bytes of a buffer of target.length
// elements of *dtype (the source state's dtype, which every target parameter
// must share). Throws FormatError naming the checkpoint folder (and the
// model-states file that lists the parameters) when a target parameter is
// missing from the source, has another size or shape, or lacks the state.
struct StateReads {
  DType dtype = DType::kFloat32;
  std::vector<ReadPiece> pieces;
  uint64_t bytes() const;
};
StateReads PlanStateReads(const ReadSource& source, const PartitionTarget& target, const std::string& key);
StateReads PlanStateReads(const ZeroCheckpoint& source, const PartitionTarget& target, const std::string& key);

// Whether every parameter of `source` has state `key`.
bool HasState(const ReadSource& source, const std::string& key);
bool HasState(const ZeroCheckpoint& source, const std::string& key);

}  // namespace uckpt::ckpt
