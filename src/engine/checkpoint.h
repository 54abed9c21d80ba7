// The engine's side of DeepSpeed's checkpoint layout: src/ckpt
// (deepspeed_state.h) owns the files' names, keys and classes; checkpoint.cc
// hands it the engine's state and reads it back (see engine_impl.h).
#pragma once

#include <string>

#include "ckpt/deepspeed_state.h"

namespace uckpt::engine {

// Reads <dir>/<name> (`latest` or `latest_universal`): the tag, a folder
// name inside `dir`. Throws FormatError naming the file if it is missing,
// empty or names anything else.
std::string ReadTagFile(const std::string& dir, const std::string& name);

}  // namespace uckpt::engine
