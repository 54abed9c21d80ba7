// Loading a ZeRO checkpoint of any stage (1, 2 or 3; uckpt's or DeepSpeed's)
// at any data-parallel world size (the saving one included) into a stage 1/2
// or stage 3 engine without converting it: each rank reads, from the rank
// files, exactly the byte ranges of its own partitions (ckpt/reshard.h plans
// them: a group's flat partition at stages 1/2, each sub-group's
// per-parameter partitions at stage 3; the copy engine reads them on several
// threads: straight into CPU tensors, through pinned chunks onto a GPU,
// staged_upload.h), bit for bit what loading the converted universal
// checkpoint gives.
#pragma once

#include <cstdint>
#include <string>

#include "engine/engine_impl.h"
#include "format/value.h"

namespace uckpt::engine {

struct ReshardedLoad {
  ValuePtr loss_scaler, param_groups;  // rank 0's, as the universal zero/optimizer_state.pt holds them
  std::string where;                   // the file they come from, for messages
  uint64_t bytes_read = 0;             // optimizer-state bytes this rank read
};

// Fills the masters (and the moments and step, with `optimizer_states`) of
// every group (stage 3: sub-group) from `folder`'s rank files. Adam's step of
// a stage-3 source is the applied steps: call after RestoreCounters. The
// caller applies the returned loss scaler and hyper-parameters and makes the
// weights from the masters.
ReshardedLoad LoadReshardedPartitions(Engine::Impl& e, const std::string& folder, bool optimizer_states);

}  // namespace uckpt::engine
