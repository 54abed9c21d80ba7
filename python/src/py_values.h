// Python values <-> the engine's: client_state (c10::IValue) and configs (JSON).
#pragma once

#include <torch/csrc/utils/pybind.h>

#include <nlohmann/json.hpp>
#include <string>

#include "uckpt/engine.h"

namespace uckpt::python {

namespace py = pybind11;

// The name of an object's class ("AdamW").
std::string TypeName(py::handle h);

// dicts with str keys, lists, tuples, int, float, bool, str, None, tensors;
// anything else is a TypeError naming its path in `what` ("client_state['x'][2]").
ClientState ToIValue(py::handle v, const std::string& what);
py::object FromIValue(const c10::IValue& v);

// A str or os.PathLike (pathlib.Path) as a path string; TypeError naming `what` otherwise.
std::string FsPath(py::handle path, const std::string& what);

// A config as DeepSpeed takes it: a dict, or the path of a JSON file (its
// path becomes `source`); `caller` names the call in errors.
nlohmann::json ConfigToJson(py::handle config, std::string& source, const std::string& caller = "uckpt.initialize");
py::object JsonToPy(const nlohmann::json& j);

}  // namespace uckpt::python
