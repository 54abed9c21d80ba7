// The sharded runtime's construction (sharded_runtime.cc, zero3_setup.cc):
// one place for every stage, from what it needs of the engine (the
// communicator, the parsed config, the device, the module's tensors), not
// the engine's whole state.
#pragma once

#include <ATen/ATen.h>

#include <memory>
#include <vector>

#include "engine/config.h"
#include "engine/module_tensors.h"
#include "engine/sharded_runtime.h"
#include "uckpt/comm.h"
#include "uckpt/engine.h"

namespace uckpt::engine {

class Zero3Runtime;  // zero3_runtime.h

struct RuntimeInputs {
  Comm& comm;
  const TrainConfig& config;
  at::Device device;
  ModuleTensors& module;  // groups sorted; stages 0-2 make the parameters views into the flat buffers
};

// sharded_runtime.cc: the runtime of the configured stage over
// in.module.groups (specs[g]: group g's sizes, names and hyper-parameters),
// every rank starting from rank 0's weights, frozen parameters and buffers.
std::unique_ptr<ShardedRuntime> MakeShardedRuntime(const RuntimeInputs& in, std::vector<GroupSpec> specs,
                                                   const EngineOptions& options);
// zero3_setup.cc: stage 3's (the parameters partitioned one by one, gather
// units from the options).
std::unique_ptr<Zero3Runtime> MakeZero3Runtime(const RuntimeInputs& in, const std::vector<GroupSpec>& specs,
                                               const ZeroSettings& base, const EngineOptions& options);
// zero3_setup.cc: each trainable parameter's gather unit (EngineOptions::
// gather_units; by group, flat order): the unit holding all its names, -1
// (the root) for one in no unit or tied across units. std::invalid_argument
// for a unit that is not a submodule of the model.
std::vector<std::vector<int>> ParameterUnits(const ModuleTensors& module, const EngineOptions& options);
// zero3_setup.cc: before the module is moved and cast, each parameter of
// options.partitioned (refused unless stage 3) becomes a tensor of its
// shape, the model dtype and the device without storage; a frozen one is
// gathered whole (uckpt keeps frozen parameters whole).
void PreparePartitionedParameters(const RuntimeInputs& in, const EngineOptions& options);
// zero3_setup.cc: refuses (std::invalid_argument, naming it) a parameter or
// buffer on the meta device, and a parameter without storage that is not in
// options.partitioned (a ZeroInit build whose partitions were not handed over).
void RefuseTensorsWithoutValues(const torch::nn::Module& model, const EngineOptions& options);

}  // namespace uckpt::engine
