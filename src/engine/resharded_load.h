// Loading a ZeRO stage 1/2 checkpoint at any data-parallel world size (the
// saving one included) without converting it: each rank reads, from the rank
// files, exactly the byte ranges of its own partition (ckpt/reshard.h plans
// them, the copy engine reads them on several threads: straight into CPU
// tensors, through pinned chunks onto a GPU, staged_upload.h), bit for bit
// what loading the converted universal checkpoint gives.
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
// every group from `folder`'s rank files. The caller applies the returned loss
// scaler and hyper-parameters and gathers the weights from the masters.
ReshardedLoad LoadReshardedPartitions(Engine::Impl& e, const std::string& folder, bool optimizer_states);

}  // namespace uckpt::engine
