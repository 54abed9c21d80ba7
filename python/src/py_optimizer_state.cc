// engine.optimizer.state_dict() / load_state_dict() and the client optimizer's
// own param-group entries after load_checkpoint (see py_engine.h).
#include <torch/csrc/autograd/python_variable.h>

#include <algorithm>
#include <map>

#include "py_engine.h"
#include "py_values.h"

namespace uckpt::python {

namespace {

// Where a trainable parameter lies in its group's flat state.
struct FlatPlace {
  size_t group = 0;
  int64_t offset = 0;
};

}  // namespace

bool PyEngine::WrapperStateDict() const {
  const int stage = settings_.config.zero.stage;
  return settings_.has_optimizer && (stage == 1 || stage == 2 || (stage == 0 && engine_->settings().fp16_enabled()));
}

std::string PyEngine::StateDictRefusal(const char* call) const {
  const std::string head = std::string("engine.optimizer.") + call + " is not supported by uckpt ";
  if (!settings_.has_optimizer) return head + "without an optimizer";
  if (settings_.config.zero.stage == 3)
    return head +
           "at ZeRO stage 3 (DeepSpeed's is its DeepSpeedZeroOptimizer_Stage3's, what this rank's "
           "*_optim_states.pt holds): use engine.save_checkpoint() / load_checkpoint()";
  if (settings_.config.zero.stage != 0)
    return head + "at ZeRO stage " + std::to_string(settings_.config.zero.stage) +
           " (DeepSpeed's is its ZeRO optimizer's, "
           "what this rank's *_optim_states.pt holds): use engine.save_checkpoint() / load_checkpoint()";
  if (engine_->settings().fp16_enabled() || engine_->settings().bf16_enabled())
    return head + "at ZeRO stage 0 in " + (engine_->settings().bf16_enabled() ? "bf16" : "fp16") +
           " (DeepSpeed's is its " +
           (engine_->settings().bf16_enabled() ? "BF16_Optimizer" : "FP16 optimizer wrapper") +
           "'s): use engine.save_checkpoint()";
  if (client_optimizer_.is_none())
    return head +
           "for the optimizer the config's 'optimizer' section made (DeepSpeed's is that class's, e.g. "
           "FusedAdam's): pass a torch.optim optimizer to initialize, or use engine.save_checkpoint()";
  const std::string cls = TypeName(client_optimizer_);
  if (cls == "DeepSpeedCPUAdam" || cls == "FusedAdam")
    return head + "for " + cls + " (its own state_dict format): use engine.save_checkpoint()";
  return "";
}

void PyEngine::RequireStateDict(const char* call) const {
  if (std::string why = StateDictRefusal(call); !why.empty()) throw std::runtime_error(why);
}

// Stage 0 in fp32: DeepSpeed's optimizer is the client's torch optimizer
// itself, so its state_dict() is torch's: each parameter's state (views of
// the engine's flat state, scalars copied per parameter) and the groups.
py::object PyEngine::OptimizerStateDict() {
  // DeepSpeed's wrappers' (FP16_Optimizer / FP16_UnfusedOptimizer, the ZeRO optimizer): what the engine's
  // checkpoint writer saves for them.
  if (WrapperStateDict()) return FromIValue(engine_->OptimizerStateDict());
  RequireStateDict("state_dict()");
  PushGroups();  // the dicts as the next step would use them
  const auto groups = engine_->optimizer().param_groups();
  py::list pairs;
  for (size_t g = 0; g < groups.size(); ++g) {
    // A client optimizer's own (its None states included), else Adam's.
    const auto states = engine_->optimizer().stage0_optimizer_state(g);
    int64_t at = 0;
    for (const auto& [name, param] : groups[g]) {
      py::dict st;
      for (const auto& [key, t] : states)
        st[py::str(key)] = !t.defined()   ? py::object(py::none())
                           : t.dim() == 0 ? py::cast(t.cpu().clone())  // torch keeps a step on the CPU
                                          : py::cast(t.narrow(0, at, param.numel()).view(param.sizes()));
      pairs.append(py::make_tuple(py::cast(param), st));
      at += param.numel();
    }
  }
  return py::module_::import("uckpt._partition_step").attr("stage0_state_dict")(client_optimizer_, pairs);
}

void PyEngine::LoadOptimizerStateDict(py::object state_dict) {
  if (WrapperStateDict()) {
    const int stage = settings_.config.zero.stage;
    throw std::runtime_error(
        "engine.optimizer.load_state_dict() is not supported by uckpt " +
        (stage == 0 ? std::string("at ZeRO stage 0 in fp16 (DeepSpeed's restores its FP16 optimizer wrapper's "
                                  "state_dict())")
                    : "at ZeRO stage " + std::to_string(stage) +
                          " (DeepSpeed's restores this rank's partition from the list of every rank's state_dict())") +
        ": engine.optimizer.state_dict() is DeepSpeed's, but only engine.load_checkpoint() loads it back "
        "(save with engine.save_checkpoint())");
  }
  RequireStateDict("load_state_dict()");
  TakeParamStates(
      py::module_::import("uckpt._partition_step").attr("stage0_load_state_dict")(client_optimizer_, state_dict));
  PushGroups();  // the loaded groups' hyper-parameters
}

void PyEngine::TakeClientState() {
  if (!StateDictRefusal("").empty() || py::len(client_optimizer_.attr("state")) == 0) return;
  TakeParamStates(py::module_::import("uckpt._partition_step").attr("take_state")(client_optimizer_));
}

void PyEngine::TakeParamStates(py::list loaded) {
  const auto groups = engine_->optimizer().param_groups();
  std::map<const void*, FlatPlace> place;
  std::vector<int64_t> group_numel(groups.size(), 0);
  for (size_t g = 0; g < groups.size(); ++g)
    for (const auto& [name, param] : groups[g]) {
      place[param.unsafeGetTensorImpl()] = {g, group_numel[g]};
      group_numel[g] += param.numel();
    }
  // Each group's state: every key's flat tensor, and its scalars, which the engine keeps once per group: refused
  // when they differ between its parameters, or when only some of them have state (torch steps a parameter
  // without a gradient not at all, so its step would differ).
  std::vector<std::vector<std::pair<std::string, at::Tensor>>> named(groups.size());
  std::vector<size_t> with_state(groups.size(), 0);
  for (auto item : loaded) {
    auto pair = item.cast<py::tuple>();
    at::Tensor param = THPVariable_Unpack(pair[0].ptr());
    auto it = place.find(param.unsafeGetTensorImpl());
    if (it == place.end()) continue;  // frozen: the engine keeps no state for it
    if (!pair[1].cast<py::dict>().empty()) ++with_state[it->second.group];
    auto& group = named[it->second.group];
    for (auto [k, v] : pair[1].cast<py::dict>()) {
      const std::string key = py::str(k);
      auto found = std::find_if(group.begin(), group.end(), [&](const auto& kv) { return kv.first == key; });
      if (v.is_none()) {  // torch's None state
        if (found == group.end()) group.emplace_back(key, at::Tensor());
        continue;
      }
      at::Tensor t = THPVariable_Unpack(v.ptr()).detach();
      if (t.dim() == 0) {
        if (found == group.end()) {
          group.emplace_back(key, t.clone());
        } else if (!found->second.defined() || !at::equal(found->second.cpu(), t.cpu())) {
          throw py::value_error("optimizer.load_state_dict: state '" + key +
                                "' differs between the parameters of "
                                "param group " +
                                std::to_string(it->second.group) +
                                " (uckpt keeps one value per "
                                "group at ZeRO stage 0, as its flat partitions step every parameter together)");
        }
        continue;
      }
      if (t.numel() != param.numel())
        throw py::value_error("optimizer.load_state_dict: state '" + key + "' has " + std::to_string(t.numel()) +
                              " elements, its parameter " + std::to_string(param.numel()));
      if (found == group.end()) {
        group.emplace_back(key, at::zeros({group_numel[it->second.group]}, t.options().dtype(at::kFloat)));
        found = group.end() - 1;
      }
      found->second.narrow(0, it->second.offset, param.numel()).copy_(t.reshape(-1));
    }
  }
  for (size_t g = 0; g < named.size(); ++g)
    if (with_state[g] != 0 && with_state[g] != groups[g].size())
      throw py::value_error("optimizer.load_state_dict: " + std::to_string(with_state[g]) + " of the " +
                            std::to_string(groups[g].size()) + " parameters of param group " + std::to_string(g) +
                            " have optimizer state (uckpt steps every parameter of a group together, so their states "
                            "must be alike)");
  for (size_t g = 0; g < named.size(); ++g) {
    try {
      engine_->optimizer().SetStage0OptimizerState(g, named[g]);
    } catch (const std::invalid_argument& e) {
      throw py::value_error(std::string("optimizer.load_state_dict: ") + e.what());
    }
  }
}

}  // namespace uckpt::python
