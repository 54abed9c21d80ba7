// engine.optimizer.state_dict() / load_state_dict() and the client optimizer's
// own param-group entries after load_checkpoint (see py_engine.h).
#include <torch/csrc/autograd/python_variable.h>

#include <algorithm>
#include <map>

#include "engine/engine_impl.h"
#include "py_engine.h"
#include "py_values.h"

namespace uckpt::python {

namespace {

std::string TypeName(py::handle h) { return py::str(h.get_type().attr("__name__")).cast<std::string>(); }

// Where a trainable parameter lies in its group's flat state.
struct FlatPlace {
  size_t group = 0;
  int64_t offset = 0;
};

}  // namespace

std::string PyEngine::StateDictRefusal(const char* call) const {
  const std::string head = std::string("engine.optimizer.") + call + " is not supported by uckpt ";
  if (!settings_.has_optimizer) return head + "without an optimizer";
  if (settings_.zero_stage != 0)
    return head + "at ZeRO stage " + std::to_string(settings_.zero_stage) + " (DeepSpeed's is its ZeRO optimizer's, "
           "what this rank's *_optim_states.pt holds): use engine.save_checkpoint() / load_checkpoint()";
  if (engine_->fp16_enabled() || engine_->bf16_enabled())
    return head + "at ZeRO stage 0 in " + (engine_->bf16_enabled() ? "bf16" : "fp16") + " (DeepSpeed's is its " +
           (engine_->bf16_enabled() ? "BF16_Optimizer" : "FP16 optimizer wrapper") + "'s): use engine.save_checkpoint()";
  if (client_optimizer_.is_none())
    return head + "for the optimizer the config's 'optimizer' section made (DeepSpeed's is that class's, e.g. "
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
  RequireStateDict("state_dict()");
  PushGroups();  // the dicts as the next step would use them
  Engine::Impl& e = engine_->impl();
  const std::vector<engine::PartitionSlot> slots = e.runtime->Slots();  // one per group at stage 0
  py::list pairs;
  for (size_t g = 0; g < e.groups.size(); ++g) {
    const engine::PartitionState& state = *slots.at(g).state;
    // A client optimizer's own (its None states included), else Adam's.
    const auto states = e.client_optimizer ? state.named : engine::OptimizerStates(state);
    int64_t at = 0;
    for (const NamedParam& p : e.groups[g]) {
      py::dict st;
      for (const auto& [key, t] : states)
        st[py::str(key)] = !t.defined() ? py::object(py::none())
                           : t.dim() == 0 ? py::cast(t.cpu().clone())  // torch keeps a step on the CPU
                                          : py::cast(t.narrow(0, at, p.tensor.numel()).view(p.tensor.sizes()));
      pairs.append(py::make_tuple(py::cast(p.tensor), st));
      at += p.tensor.numel();
    }
  }
  return py::module_::import("uckpt._partition_step").attr("stage0_state_dict")(client_optimizer_, pairs);
}

void PyEngine::LoadOptimizerStateDict(py::object state_dict) {
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
  Engine::Impl& e = engine_->impl();
  std::map<const void*, FlatPlace> place;
  for (size_t g = 0; g < e.groups.size(); ++g) {
    int64_t at = 0;
    for (const NamedParam& p : e.groups[g]) {
      place[p.tensor.unsafeGetTensorImpl()] = {g, at};
      at += p.tensor.numel();
    }
  }
  // Each group's state: every key's flat tensor (padding zero), and its scalars, which the engine keeps once
  // per group: refused when they differ between its parameters, or when only some of them have state (torch
  // steps a parameter without a gradient not at all, so its step would differ).
  std::vector<engine::PartitionSlot> slots = e.runtime->Slots();
  std::vector<std::vector<std::pair<std::string, at::Tensor>>> named(e.groups.size());
  std::vector<size_t> with_state(e.groups.size(), 0);
  for (auto item : loaded) {
    auto pair = item.cast<py::tuple>();
    at::Tensor param = THPVariable_Unpack(pair[0].ptr());
    auto it = place.find(param.unsafeGetTensorImpl());
    if (it == place.end()) continue;  // frozen: the engine keeps no state for it
    if (!pair[1].cast<py::dict>().empty()) ++with_state[it->second.group];
    auto& group = named[it->second.group];
    const at::Tensor& master = slots.at(it->second.group).state->master;
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
          group.emplace_back(key, t.to(master.device()).clone());
        } else if (!found->second.defined() || !at::equal(found->second.cpu(), t.cpu())) {
          throw py::value_error("optimizer.load_state_dict: state '" + key + "' differs between the parameters of "
                                "param group " + std::to_string(it->second.group) + " (uckpt keeps one value per "
                                "group at ZeRO stage 0, as its flat partitions step every parameter together)");
        }
        continue;
      }
      if (t.numel() != param.numel())
        throw py::value_error("optimizer.load_state_dict: state '" + key + "' has " + std::to_string(t.numel()) +
                              " elements, its parameter " + std::to_string(param.numel()));
      if (found == group.end()) {
        group.emplace_back(key, at::zeros_like(master));
        found = group.end() - 1;
      }
      found->second.narrow(0, it->second.offset, param.numel()).copy_(t.reshape(-1));
    }
  }
  for (size_t g = 0; g < named.size(); ++g)
    if (with_state[g] != 0 && with_state[g] != e.groups[g].size())
      throw py::value_error("optimizer.load_state_dict: " + std::to_string(with_state[g]) + " of the " +
                            std::to_string(e.groups[g].size()) + " parameters of param group " + std::to_string(g) +
                            " have optimizer state (uckpt steps every parameter of a group together, so their states "
                            "must be alike)");
  for (size_t g = 0; g < named.size(); ++g) {
    engine::PartitionState& st = *slots.at(g).state;
    if (e.client_optimizer) {
      st.named = std::move(named[g]);
      continue;
    }
    // The engine's own Adam: torch Adam's keys, or no state at all.
    std::map<std::string, at::Tensor> by_key(named[g].begin(), named[g].end());
    if (by_key.empty()) {
      st.step = st.exp_avg = st.exp_avg_sq = at::Tensor();
      continue;
    }
    if (by_key.size() != 3 || !by_key.count("step") || !by_key.count("exp_avg") || !by_key.count("exp_avg_sq"))
      throw py::value_error("optimizer.load_state_dict: the state of parameter group " + std::to_string(g) +
                            " is not torch Adam's (step, exp_avg, exp_avg_sq)");
    st.step = by_key["step"].to(st.master.options()).reshape({});
    st.exp_avg = by_key["exp_avg"];
    st.exp_avg_sq = by_key["exp_avg_sq"];
  }
}

}  // namespace uckpt::python
