// A client optimizer or model_parameters as the engine's param groups, and a
// client's element-wise optimizer as the engine's optimizer step.
#pragma once

#include <torch/csrc/utils/pybind.h>

#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "uckpt/engine.h"

namespace uckpt::python {

namespace py = pybind11;

// The hyper-parameters a param-group dict gives (the others keep the engine's).
struct GroupOptionals {
  std::optional<double> lr, weight_decay, beta1, beta2, eps;
};

// One param-group dict's hyper-parameters; `what` names it in errors.
// `adam`: the group is the engine's Adam's (amsgrad is refused there; a
// client's other optimizer steps with every key of its groups).
GroupOptionals ReadGroup(py::handle g, const std::string& what, bool adam = true);

struct OptimizerPlan {
  // A client Adam(W) in the config's terms: the "optimizer" section used
  // instead of the config's; null otherwise.
  nlohmann::json section;
  // The client's optimizer is no Adam the engine runs natively: it steps
  // the partitions itself (uckpt._partition_step), without a section.
  bool client_step = false;
  std::vector<ParamGroup> groups;
  std::vector<int> engine_group_of;  // per client param group: its engine group, -1 if nothing trainable
  std::string warning;               // for rank 0 to print
  bool has_optimizer = true;         // false: neither a client optimizer nor a config section
};

// initialize's optimizer= (an optimizer object, or None) and
// model_parameters as the engine's groups; `config_has_optimizer`: the config
// has an "optimizer" section (a client's optimizer wins over it, as in DeepSpeed).
OptimizerPlan PlanOptimizer(py::handle optimizer, py::handle model_parameters, bool config_has_optimizer);

// The engine's optimizer step for a client's element-wise optimizer:
// uckpt._partition_step.PartitionStepper over it, given each partition's
// master, gradient, group, lr and state, returning the new state.
OptimizerStepFn ClientOptimizerStep(py::handle optimizer, const std::vector<int>& engine_group_of);

// Engine group g's param-group dict of the client's optimizer, without its
// params (what torch's state_dict saves of it).
std::function<c10::IValue(size_t)> ClientParamGroup(py::handle optimizer, const std::vector<int>& engine_group_of);

}  // namespace uckpt::python
