// The engine's side of DeepSpeed's checkpoint layout: src/ckpt
// (deepspeed_state.h) owns the files' names, keys and classes; checkpoint.cc
// hands it the engine's state and reads it back through one load path
// (LoadEngineCheckpoint below; resharded_load.h fills the partitions).
#pragma once

#include <ATen/core/ivalue.h>

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "ckpt/deepspeed_state.h"
#include "engine/async_save.h"
#include "engine/config.h"
#include "engine/fingerprint.h"
#include "engine/lr_schedule.h"
#include "engine/module_tensors.h"
#include "engine/sharded_runtime.h"
#include "uckpt/engine.h"

namespace uckpt::engine {

// What saving and loading read and write of the engine (the Engine makes one
// per call): the communicator, the config, the module's tensors, the
// runtime, the counters, the lr schedule, the writer of its saves and the
// stats they report; not the training loop's state.
struct CheckpointState {
  Comm& comm;
  const TrainConfig& config;
  ModuleTensors& module;
  ShardedRuntime& runtime;
  StepCounters& counters;
  LrSchedule& schedule;
  const BatchSizes& batch;
  bool client_optimizer;  // EngineOptions::optimizer_step steps: PartitionState::named holds the state
  const std::function<c10::IValue(size_t)>& client_param_group;  // EngineOptions::optimizer_param_group
  Stage0Fp16 stage0_fp16;                                        // DeepSpeed's fp16 wrapper at stage 0, if any
  bool save_without_frozen;                   // the save under way: SaveCheckpointOptions::exclude_frozen_parameters
  bool memory_snapshot;                       // the save under way: SaveCheckpointOptions::memory_snapshot
  std::shared_ptr<CheckpointWriter>& writer;  // this rank's files of the last save (async_save.h)
  SaveStats& last_save;
  LoadStats& last_load;

  int stage() const { return config.zero.stage; }
  FingerprintInputs fingerprint() const { return {runtime, comm, counters}; }
};

// DeepSpeed's files from and into the engine's state. Every load (any
// stage, any source: ZeRO 1/2/3 files, a universal folder; uckpt's or
// DeepSpeed's) goes through LoadEngineCheckpoint, the state fingerprint
// check included.
std::string SaveEngineCheckpoint(const CheckpointState& e, const std::string& dir, const std::string& tag,
                                 const ClientState& client_state, bool async);
LoadResult LoadEngineCheckpoint(const CheckpointState& e, const std::string& dir, const std::string& tag,
                                const LoadCheckpointOptions& options);

// Engine::OptimizerStateDict: the value a save writes for this run's
// optimizer (stage 0 in fp16: the model states' 'optimizer'; ZeRO 1-2: the
// optim-states file's 'optimizer_state_dict'), its tensors copied to the host.
c10::IValue OptimizerStateDict(const CheckpointState& e);

// Reads <dir>/<name> (`latest` or `latest_universal`): the tag, a folder
// name inside `dir`. Throws FormatError naming the file if it is missing,
// empty or names anything else.
std::string ReadTagFile(const std::string& dir, const std::string& name);

// Client state: a c10::IValue to a pickled value (throws std::invalid_argument
// naming `where` for what cannot be saved) and back.
ValuePtr FromIValue(const c10::IValue& v, const std::string& where);
c10::IValue ToIValue(const ValuePtr& v);

// client_state's keys, checked: a dict with string keys that are not the
// model-states file's own (throws std::invalid_argument).
std::vector<std::pair<std::string, ValuePtr>> ClientEntries(const ClientState& client_state);

// Group g's hyper-parameters as the files save them (the schedule's lr now).
ckpt::AdamHparams SavedHparams(const CheckpointState& e, size_t g);

// The model-states fields every stage fills alike: the module's state_dict
// in PyTorch's order (`params`: the parameters' entries by name, as the
// stage saves them; buffers whole, aliases their owner's), its prefixes and
// buffer names, tied names, the partition slots' param_shapes, the schedule's
// position, the counters, the config (`ds_config`: converted once per save),
// uckpt's own entry and then the client's keys.
ckpt::ModelStates ModelStatesOf(const CheckpointState& e, std::map<std::string, ValuePtr> params,
                                std::vector<std::pair<std::string, ValuePtr>> client, const ValuePtr& ds_config);

// A tensor as a value for a file being saved: a copy into the save's snapshot
// pool during an async save; during a synchronous one a view of a
// contiguous host tensor's bytes, a device tensor streamed (below), a copy
// of a non-contiguous host tensor.
ValuePtr TensorValue(const at::Tensor& t, bool requires_grad = false);
// A storage whose bytes are `t`'s (any device), copied out on request a
// buffer at a time (Storage::fill) as its record is written, never whole.
std::shared_ptr<Storage> StreamedStorageOf(const at::Tensor& t);

// A partition's optimizer state as the files save it: torch's state-dict
// entry of the partition under the optimizer's keys (Adam's step, exp_avg,
// exp_avg_sq, or another optimizer's, its None states included); empty
// before its first step. `cls`: the Adam class DeepSpeed builds (its own
// classes count 'step' in an int).
ckpt::AdamState SavedOptimizerState(const PartitionState& st, ckpt::AdamClass cls = ckpt::AdamClass::kTorch);
// One state value as saved: None for an undefined tensor, a 0-d int64 or
// float64 tensor as the Python number it was, else the tensor.
ValuePtr SavedStateValue(const at::Tensor& t);

// checkpoint_zero3.cc: this rank's files of a ZeRO-3 checkpoint (its model
// states with the client's keys, and its optimizer states), both with `ds_config`.
std::vector<SnapshotFile> Zero3RankFiles(const CheckpointState& e, std::vector<std::pair<std::string, ValuePtr>> client,
                                         const ValuePtr& ds_config);

}  // namespace uckpt::engine
