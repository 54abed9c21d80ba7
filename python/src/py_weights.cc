// Weights alone on the Python engine (docs/python.md, "Weights"): DeepSpeed's
// save_16bit_model, save_fp16_model, zero_gather_16bit_weights_on_model_save
// and _zero3_consolidated_16bit_state_dict, and uckpt's load_weights (a
// safetensors file or index into the running engine, partitioned).
#include "py_weights.h"

#include "py_values.h"

namespace uckpt::python {

using namespace pybind11::literals;

// Engine::LoadWeights; returns torch's _IncompatibleKeys(missing_keys, unexpected_keys).
py::object LoadWeights(PyEngine& e, py::object path, py::object name_map, bool strict, const std::string& strip_prefix,
                       const std::string& add_prefix) {
  LoadWeightsOptions o;
  o.strict = strict;
  o.strip_prefix = strip_prefix;
  o.add_prefix = add_prefix;
  if (!name_map.is_none()) {
    if (!PyCallable_Check(name_map.ptr()))
      throw py::type_error("load_weights: name_map must be a callable (file name -> model name or None)");
    if (!strip_prefix.empty() || !add_prefix.empty())
      throw py::value_error("load_weights: give name_map or strip_prefix/add_prefix, not both");
    o.name_map = [name_map](const std::string& name) -> std::optional<std::string> {
      py::object to = name_map(name);
      if (to.is_none()) return std::nullopt;
      if (!py::isinstance<py::str>(to))
        throw std::invalid_argument("load_weights: name_map('" + name + "') returned a " +
                                    std::string(py::str(py::type::handle_of(to).attr("__name__"))) +
                                    ", not a str or None");
      return to.cast<std::string>();
    };
  }
  const std::string p = FsPath(path, "load_weights: path");
  LoadWeightsResult r;
  if (o.name_map) {
    r = e.engine().weights().LoadWeights(p, o);  // the map is Python: keep the GIL
  } else {
    py::gil_scoped_release no_gil;
    r = e.engine().weights().LoadWeights(p, o);
  }
  py::object keys = py::module_::import("torch.nn.modules.module").attr("_IncompatibleKeys");
  return keys("missing_keys"_a = py::cast(r.missing_keys), "unexpected_keys"_a = py::cast(r.unexpected_keys));
}

bool Save16bitModel(PyEngine& e, py::object save_dir, py::object save_filename, bool exclude_frozen) {
  const std::string dir = FsPath(save_dir, "save_16bit_model: save_dir");
  const std::string name = FsPath(save_filename, "save_16bit_model: save_filename");
  py::gil_scoped_release no_gil;
  return e.engine().weights().Save16bitModel(dir, name, exclude_frozen);
}

py::object Consolidated(PyEngine& e, bool exclude_frozen) {
  std::vector<std::pair<std::string, at::Tensor>> sd;
  {
    py::gil_scoped_release no_gil;
    sd = e.engine().weights().Zero3Consolidated16bitStateDict(exclude_frozen);
  }
  if (e.engine().settings().rank() != 0) return py::none();
  py::object dict = py::module_::import("collections").attr("OrderedDict")();
  for (const auto& [name, t] : sd) dict[py::str(name)] = py::cast(t);  // tied names: one tensor object
  return dict;
}

}  // namespace uckpt::python
