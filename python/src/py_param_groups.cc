// A client optimizer or model_parameters as the engine's param groups, and a
// client's element-wise optimizer as the engine's optimizer step (see py_param_groups.h).
#include "py_param_groups.h"

#include <torch/csrc/autograd/python_variable.h>

#include "py_values.h"

namespace uckpt::python {

namespace {

// A number (a float, an int or a 0-d tensor, as torch schedulers may write).
double Number(py::handle v, const std::string& what) {
  try {
    return py::float_(py::reinterpret_borrow<py::object>(v)).cast<double>();
  } catch (const py::error_already_set&) {
    throw py::type_error(what + " must be a number, got " + TypeName(v));
  }
}

}  // namespace

GroupOptionals ReadGroup(py::handle g, const std::string& what, bool adam) {
  GroupOptionals h;
  auto d = g.cast<py::dict>();
  if (d.contains("lr")) h.lr = Number(d["lr"], what + "['lr']");
  if (d.contains("weight_decay")) h.weight_decay = Number(d["weight_decay"], what + "['weight_decay']");
  if (d.contains("eps")) h.eps = Number(d["eps"], what + "['eps']");
  if (d.contains("betas")) {
    auto b = d["betas"].cast<py::sequence>();
    if (py::len(b) != 2) throw py::value_error(what + ": betas must be two numbers");
    h.beta1 = Number(b[0], what + "['betas'][0]");
    h.beta2 = Number(b[1], what + "['betas'][1]");
  }
  if (adam && d.contains("amsgrad") && d["amsgrad"].cast<bool>())
    throw py::value_error(what + ": amsgrad is not supported by uckpt's Adam");
  return h;
}

namespace {

// The trainable tensors of one group (frozen ones stay out of the optimizer, as DeepSpeed filters them).
std::vector<at::Tensor> TrainableTensors(py::handle params, const std::string& what) {
  std::vector<at::Tensor> out;
  for (auto p : params) {
    if (!THPVariable_Check(p.ptr())) throw py::type_error(what + " holds a " + TypeName(p) + ", not a tensor");
    at::Tensor t = THPVariable_Unpack(p.ptr());
    if (t.requires_grad()) out.push_back(t);
  }
  return out;
}

// Groups from a list of dicts ({"params": [...], hparams}) or of tensors (one
// group); engine_group_of[i]: item i's group in the result (-1: none trainable).
std::vector<ParamGroup> GroupsFrom(py::handle groups, const std::string& what, std::vector<int>& engine_group_of,
                                   bool adam = true) {
  py::list items = py::list(py::iter(groups));
  std::vector<ParamGroup> out;
  engine_group_of.clear();
  if (items.empty()) return out;
  if (!py::isinstance<py::dict>(items[0])) {
    ParamGroup g;
    g.params = TrainableTensors(items, what);
    engine_group_of.push_back(g.params.empty() ? -1 : 0);
    if (!g.params.empty()) out.push_back(std::move(g));
    return out;
  }
  for (size_t i = 0; i < items.size(); ++i) {
    const std::string gw = what + "[" + std::to_string(i) + "]";
    auto d = items[i].cast<py::dict>();
    if (!d.contains("params")) throw py::value_error(gw + " has no 'params'");
    GroupOptionals h = ReadGroup(d, gw, adam);
    ParamGroup g;
    g.params = TrainableTensors(d["params"], gw + "['params']");
    engine_group_of.push_back(g.params.empty() ? -1 : static_cast<int>(out.size()));
    g.lr = h.lr;
    g.weight_decay = h.weight_decay;
    g.beta1 = h.beta1;
    g.beta2 = h.beta2;
    g.eps = h.eps;
    if (!g.params.empty()) out.push_back(std::move(g));
  }
  return out;
}

// Adam(W) in DeepSpeed's config terms for the client optimizer's class.
nlohmann::json ClientOptimizerSection(py::handle opt) {
  const std::string cls = TypeName(opt);
  py::module_ optim = py::module_::import("torch.optim");
  nlohmann::json params = nlohmann::json::object();
  std::string type;
  if (cls == "DeepSpeedCPUAdam" || cls == "FusedAdam") {  // uckpt's or DeepSpeed's: a mode flag says which
    const char* mode = cls == "FusedAdam" ? "adam_w_mode" : "adamw_mode";
    const bool decoupled = py::hasattr(opt, mode) ? opt.attr(mode).cast<bool>() : true;
    type = decoupled ? "AdamW" : "Adam";
    if (!decoupled) {  // torch.optim.Adam: torch_adam with adam_w_mode false (torch_adam alone is AdamW)
      params["torch_adam"] = true;
      params["adam_w_mode"] = false;
    }
  } else if (py::isinstance(opt, optim.attr("AdamW"))) {
    type = "AdamW";
    params["torch_adam"] = true;  // torch's own class: its checkpoints keep torch's param-group keys, and
                                  // stage 0 in fp16 wraps it as DeepSpeed wraps torch's optimizers
  } else if (py::isinstance(opt, optim.attr("Adam"))) {
    type = "Adam";
    params["torch_adam"] = true;  // torch.optim.Adam: L2 weight decay (DeepSpeed needs adam_w_mode false too)
    params["adam_w_mode"] = false;
  } else {
    return nullptr;  // any other optimizer steps the partitions itself
  }
  return {{"type", type}, {"params", params}};
}

// Whether torch's Adam/AdamW `opt` needs its own step: amsgrad, which the engine's Adam does not run.
bool AdamWithAmsgrad(py::handle opt) {
  for (auto g : opt.attr("param_groups"))
    if (g.cast<py::dict>().contains("amsgrad") && g["amsgrad"].cast<bool>()) return true;
  return false;
}

}  // namespace

OptimizerPlan PlanOptimizer(py::handle optimizer, py::handle model_parameters, bool config_has_optimizer) {
  OptimizerPlan plan;
  if (!optimizer.is_none()) {
    if (!py::hasattr(optimizer, "param_groups"))
      throw py::value_error("uckpt.initialize: optimizer must be an optimizer object with param_groups, got " +
                            TypeName(optimizer) + " (a callable that builds one is not supported)");
    if (py::len(optimizer.attr("param_groups")) == 0)
      throw py::value_error("uckpt.initialize: optimizer " + TypeName(optimizer) + " has no param groups");
    if (py::object why = py::module_::import("uckpt._partition_step").attr("refusal")(optimizer); !why.is_none())
      throw py::value_error(why.cast<std::string>());
    plan.section = AdamWithAmsgrad(optimizer) ? nlohmann::json(nullptr) : ClientOptimizerSection(optimizer);
    plan.client_step = plan.section.is_null();
    if (config_has_optimizer)  // DeepSpeed uses the client's and says so in its log
      plan.warning = "the config's 'optimizer' section is not used: the optimizer passed to initialize (" +
                     TypeName(optimizer) + ") is, as DeepSpeed does";
    plan.groups =
        GroupsFrom(optimizer.attr("param_groups"), "optimizer.param_groups", plan.engine_group_of, !plan.client_step);
    if (plan.client_step) return plan;
    // The first group's hyper-parameters are the section's; each group keeps its own.
    GroupOptionals first = ReadGroup(py::list(optimizer.attr("param_groups"))[0], "optimizer.param_groups[0]");
    auto& p = plan.section["params"];
    if (first.lr) p["lr"] = *first.lr;
    if (first.beta1) p["betas"] = {*first.beta1, *first.beta2};
    if (first.eps) p["eps"] = *first.eps;
    if (first.weight_decay) p["weight_decay"] = *first.weight_decay;
    return plan;
  }
  // Neither: DeepSpeed's engine without an optimizer (forward, save/load of the module).
  plan.has_optimizer = config_has_optimizer;
  std::vector<int> unused;
  if (!model_parameters.is_none()) plan.groups = GroupsFrom(model_parameters, "model_parameters", unused);
  return plan;
}

namespace {

// Python objects the engine keeps, released with the GIL held: the engine may
// end on a thread without it.
template <class T>
std::shared_ptr<T> HeldWithGil(T value) {
  return std::shared_ptr<T>(new T(std::move(value)), [](T* p) {
    py::gil_scoped_acquire gil;
    delete p;
  });
}

}  // namespace

OptimizerStepFn ClientOptimizerStep(py::handle optimizer, const std::vector<int>& engine_group_of) {
  auto held =
      HeldWithGil(py::module_::import("uckpt._partition_step").attr("PartitionStepper")(optimizer, engine_group_of));
  return [held](std::vector<OptimizerPartition>& parts) {
    py::gil_scoped_acquire gil;
    py::list items;
    for (const OptimizerPartition& p : parts) {
      py::dict state;
      for (const auto& [key, t] : *p.state) state[py::str(key)] = py::cast(t);
      items.append(py::make_tuple(py::cast(p.master), py::cast(p.grad), p.group, p.lr, state));
    }
    py::list states = held->attr("step")(items);
    for (size_t i = 0; i < parts.size(); ++i) {
      std::vector<std::pair<std::string, at::Tensor>> named;
      for (auto kv : states[i]) {
        auto pair = kv.cast<py::tuple>();
        // None: torch's "no state" (SGD's momentum_buffer without momentum), kept as an undefined tensor.
        named.emplace_back(pair[0].cast<std::string>(),
                           pair[1].is_none() ? at::Tensor() : THPVariable_Unpack(pair[1].ptr()));
      }
      *parts[i].state = std::move(named);
    }
  };
}

std::function<c10::IValue(size_t)> ClientParamGroup(py::handle optimizer, const std::vector<int>& engine_group_of) {
  py::list dicts = optimizer.attr("param_groups");
  auto held = HeldWithGil(std::vector<py::object>());
  for (size_t i = 0; i < dicts.size() && i < engine_group_of.size(); ++i)
    if (engine_group_of[i] >= 0) {
      if (held->size() <= static_cast<size_t>(engine_group_of[i])) held->resize(engine_group_of[i] + 1);
      (*held)[engine_group_of[i]] = dicts[i];
    }
  return [held](size_t g) -> c10::IValue {
    py::gil_scoped_acquire gil;
    py::dict entries;
    for (auto [k, v] : held->at(g).cast<py::dict>())
      if (py::str(k).cast<std::string>() != "params") entries[k] = v;
    return ToIValue(entries, "optimizer.param_groups");
  };
}

}  // namespace uckpt::python
