// The engine's side of DeepSpeed's checkpoint layout: src/ckpt
// (deepspeed_state.h) owns the files' names, keys and classes; checkpoint.cc
// hands it the engine's state and reads it back (see engine_impl.h).
#pragma once

#include <ATen/core/ivalue.h>

#include <string>

#include "ckpt/deepspeed_state.h"

namespace uckpt::engine {

// Reads <dir>/<name> (`latest` or `latest_universal`): the tag, a folder
// name inside `dir`. Throws FormatError naming the file if it is missing,
// empty or names anything else.
std::string ReadTagFile(const std::string& dir, const std::string& name);

// The model-states file a universal folder holds (its source's
// mp_rank_00_model_states.pt, or rank 0's ZeRO-3 copy). Throws FormatError.
std::string UniversalModelStatesPath(const std::string& folder);

// Client state: a c10::IValue to a pickled value (throws std::invalid_argument
// naming `where` for what cannot be saved) and back.
ValuePtr FromIValue(const c10::IValue& v, const std::string& where);
c10::IValue ToIValue(const ValuePtr& v);

}  // namespace uckpt::engine
