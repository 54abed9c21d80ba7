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

// The first submodule (the module itself included) whose class DeepSpeed
// implements with features uckpt does not (pipeline, MoE): its description,
// or "" if none.
std::string FindUnsupportedModule(py::handle module);

}  // namespace uckpt::python
