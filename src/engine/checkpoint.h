// The engine's side of DeepSpeed's checkpoint layout: src/ckpt
// (deepspeed_state.h) owns the files' names, keys and classes; checkpoint.cc
// hands it the engine's state and reads it back (see engine_impl.h).
#pragma once

#include <ATen/core/ivalue.h>

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

// The model-states file rank `rank` reads from a tag folder. A ZeRO folder:
// the one file of stages 0-2; of a ZeRO-3 folder its own rank's, else (saved
// by fewer ranks) rank 0's. A universal folder (`universal`): its source's
// mp_rank_00_model_states.pt, or the lowest rank's ZeRO-3 copy. Throws
// FormatError when there is none.
std::string ModelStatesPath(const std::string& folder, int rank, bool universal);

// Frozen parameters and buffers from the model state `m` (read from
// `path`, in tag or universal folder `folder`). One that the file holds
// empty is a frozen parameter DeepSpeed's ZeRO-3 saved partitioned: it is
// put together from every rank's frozen_param_fragments (the folder's
// zero_pp_rank_*_model_states.pt). Throws FormatError naming the file for a
// missing tensor, a wrong shape or missing fragments.
void LoadFixedParams(const Engine::Impl& e, const std::string& folder, const std::string& path,
                     const ckpt::ModelStatesView& m);

// The saved param groups' hyper-parameters (lr, betas, eps, weight decay)
// into the engine's optimizer groups, with keep_saved_hparams only.
void ApplySavedHparams(Engine::Impl& e, const std::string& path, const ValuePtr& groups, const LoadCheckpointOptions& o);

// Client state: a c10::IValue to a pickled value (throws std::invalid_argument
// naming `where` for what cannot be saved) and back.
ValuePtr FromIValue(const c10::IValue& v, const std::string& where);
c10::IValue ToIValue(const ValuePtr& v);

// client_state's keys, checked: a dict with string keys that are not the
// model-states file's own (throws std::invalid_argument).
std::vector<std::pair<std::string, ValuePtr>> ClientEntries(const ClientState& client_state);

// The model-states fields every stage fills alike: tied names, the schedule's
// position, counters, the config, uckpt's own entry and then the client's keys.
void SetCountersAndExtras(const Engine::Impl& e, std::vector<std::pair<std::string, ValuePtr>> client,
                          ckpt::ModelStates& m);

// A tensor as a value for a file being saved: a copy into the save's snapshot
// pool during an async (or GPU) save, else a view of a host tensor's bytes.
ValuePtr TensorValue(const at::Tensor& t, bool requires_grad = false);

// Copies `n` elements of a tensor stored in a file, from flat element `first`,
// into `dst` (converting the dtype). Touches only those bytes of a mapped
// file; throws FormatError naming `path` when they are out of range.
void CopyElements(const std::string& path, const Tensor& src, int64_t first, int64_t n, at::Tensor dst);

// The counters and the lr schedule's position from a model-states file.
void RestoreCounters(Engine::Impl& e, const ckpt::ModelStatesView& m, const LoadCheckpointOptions& o);

// checkpoint_zero3.cc: this rank's files of a ZeRO-3 checkpoint (its model
// states with the client's keys, and its optimizer states).
std::vector<SnapshotFile> Zero3RankFiles(const Engine::Impl& e, std::vector<std::pair<std::string, ValuePtr>> client);

}  // namespace uckpt::engine
