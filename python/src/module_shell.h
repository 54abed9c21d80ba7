// A torch::nn::Module tree that mirrors a Python nn.Module: each Python
// module's direct parameters and persistent buffers registered under the same
// names (the same tensors: one TensorImpl), children in the same order. The
// engine sees Python's state_dict names and order; whatever it does to the
// tensors (set_data, .grad) Python sees.
#pragma once

#include <torch/csrc/utils/pybind.h>
#include <torch/nn/module.h>

#include <memory>
#include <string>

namespace uckpt::python {

namespace py = pybind11;

std::shared_ptr<torch::nn::Module> BuildModuleShell(py::handle module);

// ZeRO stage 3's gather units of a Python model: the elements of its
// nn.ModuleLists (transformer blocks and the like), in named_modules order,
// each with its shell module (found by name in `shell`).
struct GatherUnit {
  py::object module;
  std::shared_ptr<torch::nn::Module> shell;
};
std::vector<GatherUnit> FindGatherUnits(py::handle module, const std::shared_ptr<torch::nn::Module>& shell);

// The first submodule (the module itself included) that is one of DeepSpeed's
// own classes (by module path: uckpt.moe, deepspeed.moe, ...) for features
// uckpt does not implement (pipeline, MoE): its description, or "" if none.
// A user's class of the same name is not one.
std::string FindUnsupportedModule(py::handle module);

}  // namespace uckpt::python
