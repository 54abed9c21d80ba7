// The engine's side of DeepSpeed's checkpoint layout: src/ckpt
// (deepspeed_state.h) owns the files' names, keys and classes; checkpoint.cc
// hands it the engine's state and reads it back through one load path
// (engine_impl.h: LoadEngineCheckpoint; resharded_load.h fills the partitions).
#pragma once

#include <ATen/core/ivalue.h>

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "ckpt/deepspeed_state.h"
#include "engine/async_save.h"
#include "engine/engine_impl.h"

namespace uckpt::engine {

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
ckpt::AdamHparams SavedHparams(const Engine::Impl& e, size_t g);

// The model-states fields every stage fills alike: the module's state_dict
// in PyTorch's order (`params`: the parameters' entries by name, as the
// stage saves them; buffers whole, aliases their owner's), its prefixes and
// buffer names, tied names, the partition slots' param_shapes, the schedule's
// position, the counters, the config, uckpt's own entry and then the
// client's keys.
ckpt::ModelStates ModelStatesOf(const Engine::Impl& e, std::map<std::string, ValuePtr> params,
                                std::vector<std::pair<std::string, ValuePtr>> client);

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
// states with the client's keys, and its optimizer states).
std::vector<SnapshotFile> Zero3RankFiles(const Engine::Impl& e, std::vector<std::pair<std::string, ValuePtr>> client);

}  // namespace uckpt::engine
