#include "module_shell.h"

#include <torch/csrc/autograd/python_variable.h>

#include <map>
#include <set>

namespace uckpt::python {
namespace {

bool IsTensor(py::handle h) { return THPVariable_Check(h.ptr()); }

std::shared_ptr<torch::nn::Module> Shell(py::handle m, const std::string& path) {
  auto shell =
      std::make_shared<torch::nn::Module>(py::str(py::type::handle_of(m).attr("__name__")).cast<std::string>());
  for (auto item : m.attr("_parameters").cast<py::dict>()) {
    if (item.second.is_none()) continue;  // bias=None and the like: not in state_dict
    at::Tensor t = THPVariable_Unpack(item.second.ptr());
    shell->register_parameter(item.first.cast<std::string>(), t, t.requires_grad());
  }
  std::set<std::string> non_persistent;
  if (py::hasattr(m, "_non_persistent_buffers_set"))
    for (auto n : m.attr("_non_persistent_buffers_set")) non_persistent.insert(n.cast<std::string>());
  for (auto item : m.attr("_buffers").cast<py::dict>()) {
    const std::string name = item.first.cast<std::string>();
    if (item.second.is_none() || non_persistent.count(name) || !IsTensor(item.second)) continue;
    shell->register_buffer(name, THPVariable_Unpack(item.second.ptr()));
  }
  for (auto item : m.attr("_modules").cast<py::dict>()) {
    if (item.second.is_none()) continue;
    const std::string name = item.first.cast<std::string>();
    shell->register_module(name, Shell(item.second, path.empty() ? name : path + "." + name));
  }
  return shell;
}

}  // namespace

std::shared_ptr<torch::nn::Module> BuildModuleShell(py::handle module) {
  py::module_ nn = py::module_::import("torch.nn");
  if (!py::isinstance(module, nn.attr("Module")))
    throw py::type_error("uckpt.initialize: model must be a torch.nn.Module, got " +
                         py::str(py::type::handle_of(module)).cast<std::string>());
  return Shell(module, "");
}

std::vector<GatherUnit> FindGatherUnits(py::handle module, const std::shared_ptr<torch::nn::Module>& shell) {
  py::object module_list = py::module_::import("torch.nn").attr("ModuleList");
  std::map<std::string, std::shared_ptr<torch::nn::Module>> shells;
  for (const auto& item : shell->named_modules("", /*include_self=*/false)) shells[item.key()] = item.value();
  std::vector<GatherUnit> units;
  for (auto item : module.attr("named_modules")()) {
    auto pair = item.cast<py::tuple>();
    if (!py::isinstance(pair[1], module_list)) continue;
    const std::string prefix = pair[0].cast<std::string>();
    for (auto child : pair[1].attr("_modules").cast<py::dict>()) {
      if (child.second.is_none()) continue;
      const std::string name = (prefix.empty() ? "" : prefix + ".") + child.first.cast<std::string>();
      auto it = shells.find(name);
      if (it == shells.end()) throw std::logic_error("uckpt: no shell module for " + name);
      units.push_back({py::reinterpret_borrow<py::object>(child.second), it->second});
    }
  }
  return units;
}

namespace {

// DeepSpeed's own class (uckpt's stand-in, or DeepSpeed's if a script
// imports both) by its module path: a user's class of the same name is not.
bool IsDeepSpeedClass(py::handle obj, const std::set<std::string>& names, const std::vector<std::string>& packages) {
  py::handle type = py::type::handle_of(obj);
  if (!names.count(py::str(type.attr("__name__")).cast<std::string>())) return false;
  const std::string where = py::str(type.attr("__module__")).cast<std::string>();
  for (const auto& p : packages)
    if (where == p || where.rfind(p + ".", 0) == 0) return true;
  return false;
}

}  // namespace

std::string FindUnsupportedModule(py::handle module) {
  static const std::set<std::string> kPipeline = {"PipelineModule"};
  static const std::set<std::string> kMoE = {"MoE", "MOELayer", "TopKGate", "Experts"};
  for (auto item : module.attr("named_modules")()) {
    auto pair = item.cast<py::tuple>();
    const std::string cls = py::str(py::type::handle_of(pair[1]).attr("__name__")).cast<std::string>();
    const std::string where =
        pair[0].cast<std::string>().empty() ? "the model" : "submodule " + pair[0].cast<std::string>();
    if (IsDeepSpeedClass(pair[1], kPipeline, {"uckpt.pipe", "deepspeed.pipe", "deepspeed.runtime.pipe"}))
      return where + " is a " + cls + ": pipeline parallelism is not supported by uckpt";
    if (IsDeepSpeedClass(pair[1], kMoE, {"uckpt.moe", "deepspeed.moe"}))
      return where + " is a " + cls + ": mixture of experts (MoE) is not supported by uckpt";
  }
  return "";
}

}  // namespace uckpt::python
