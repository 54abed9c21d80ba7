// Weights alone, in and out of a running engine (docs/safetensors.md), from
// the module's tensors, the runtime's partition slots and the communicator:
// Engine::Weights' calls (include/uckpt/engine.h) without the rest of the
// engine's state.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "engine/module_tensors.h"
#include "engine/sharded_runtime.h"
#include "uckpt/comm.h"
#include "uckpt/engine.h"

namespace uckpt::engine {

// Fills this rank's slots (masters) from a safetensors source, then the
// weights from the masters; frozen parameters and buffers whole.
LoadWeightsResult LoadWeights(const ModuleTensors& module, ShardedRuntime& runtime, Comm& comm, const std::string& path,
                              const LoadWeightsOptions& options);
// DeepSpeed's save_16bit_model at ZeRO `stage` (3: only when
// gather_on_save, stage3_gather_16bit_weights_on_model_save; else false).
bool Save16bitModel(const ModuleTensors& module, ShardedRuntime& runtime, Comm& comm, int stage, bool gather_on_save,
                    const std::string& save_dir, const std::string& save_filename, bool exclude_frozen_parameters);
// DeepSpeed's _zero3_consolidated_16bit_state_dict (the caller checks the stage).
std::vector<std::pair<std::string, at::Tensor>> Consolidated16bitStateDict(const ModuleTensors& module,
                                                                           ShardedRuntime& runtime, Comm& comm,
                                                                           bool exclude_frozen_parameters);

}  // namespace uckpt::engine
