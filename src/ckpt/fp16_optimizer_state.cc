#include "ckpt/fp16_optimizer_state.h"

#include <map>

#include "ckpt/deepspeed_state.h"
#include "ckpt/reshard.h"
#include "ckpt/state_keys.h"
#include "ckpt/values.h"
#include "format/error.h"

namespace uckpt::ckpt {

namespace {

constexpr const char* kInner = "optimizer_state_dict";  // deepspeed.checkpoint.constants.OPTIMIZER_STATE_DICT
constexpr const char* kFlatMasters = "fp32_groups_flat";
constexpr const char* kMasters = "fp32_groups";

double NumberOf(const ValuePtr& v, const std::string& where) {
  if (v && v->kind == Kind::kFloat) return v->f;
  if (v && v->kind == Kind::kInt && v->big.empty()) return static_cast<double>(v->i);
  Fail(where, "is not a number");
}

}  // namespace

ValuePtr Fp16OptimizerValue(const Fp16OptimizerState& s) {
  ValuePtr d = Value::Dict();
  d->set("dynamic_loss_scale", Value::Bool(s.dynamic));
  d->set("cur_scale", s.cur_scale);
  d->set("cur_iter", Value::Int(s.cur_iter));
  if (s.dynamic) {
    d->set("last_overflow_iter", Value::Int(s.last_overflow_iter));
    d->set("scale_factor", s.scale_factor);
    d->set("scale_window", Value::Int(s.scale_window));
  }
  d->set(kInner, s.optimizer_state_dict);
  ValuePtr masters = Value::List();
  for (const auto& group : s.fp32) {
    if (s.fused) {
      masters->items.push_back(group.at(0));
      continue;
    }
    ValuePtr list = Value::List();
    for (const auto& t : group) list->items.push_back(t);
    masters->items.push_back(list);
  }
  d->set(s.fused ? kFlatMasters : kMasters, masters);
  if (s.fused) d->set("clip_grad", s.clip_grad);
  return d;
}

bool IsFp16OptimizerState(const ValuePtr& optimizer) {
  return optimizer && optimizer->is_dict() && optimizer->get(kInner) &&
         (optimizer->get(kFlatMasters) || optimizer->get(kMasters));
}

Fp16OptimizerView ReadFp16Optimizer(const ValuePtr& opt, const std::string& path) {
  const std::string where = path + ": optimizer";
  Fp16OptimizerView v;
  v.fused = opt->get(kFlatMasters) != nullptr;
  const ValuePtr dynamic = Need(opt, "dynamic_loss_scale", where);
  if (dynamic->kind != Kind::kBool) Fail(where + "['dynamic_loss_scale']", "is not a bool");
  v.dynamic = dynamic->b;
  const ValuePtr scale = Need(opt, "cur_scale", where);
  v.cur_scale = NumberOf(scale, where + "['cur_scale']");
  v.cur_scale_integral = scale->kind == Kind::kInt;
  v.cur_iter = AsInt(Need(opt, "cur_iter", where), where + "['cur_iter']");
  if (v.dynamic) {
    v.last_overflow_iter = AsInt(Need(opt, "last_overflow_iter", where), where + "['last_overflow_iter']");
    v.scale_factor = NumberOf(Need(opt, "scale_factor", where), where + "['scale_factor']");
    v.scale_window = AsInt(Need(opt, "scale_window", where), where + "['scale_window']");
  }
  v.optimizer_state_dict = Need(opt, kInner, where);
  const std::string key = v.fused ? kFlatMasters : kMasters;
  const auto& groups = AsList(Need(opt, key, where), where + "['" + key + "']");
  for (size_t g = 0; g < groups.size(); ++g) {
    const std::string gw = where + "['" + key + "'][" + std::to_string(g) + "]";
    v.fp32.emplace_back();
    if (v.fused) {
      v.fp32.back().push_back(&AsTensor(groups[g], gw));
      continue;
    }
    const auto& params = AsList(groups[g], gw);
    for (size_t k = 0; k < params.size(); ++k)
      v.fp32.back().push_back(&AsTensor(params[k], gw + "[" + std::to_string(k) + "]"));
  }
  for (const auto& group : v.fp32)
    for (const Tensor* t : group)
      if (t->dtype != DType::kFloat32) Fail(where + "['" + key + "']", "holds a tensor that is not fp32");
  return v;
}

namespace {

// A state of one parameter: elements [first, first + numel) of `t`.
StatePlan Slice(const std::string& key, const Tensor& t, int64_t first, int64_t numel, const std::string& where) {
  return {key, t.dtype, {TensorElements(t, first, numel, where)}};
}

// Where each parameter lies in the wrapper's masters: its group's tensor
// (fused: the flat one) at an offset, or its own (unfused).
struct MasterPlace {
  size_t group = 0, index = 0;  // unfused: the parameter's index within its group
  int64_t offset = 0;
  int64_t id = 0;  // its state id in the wrapped optimizer's state_dict
};

std::map<std::string, MasterPlace> PlaceMasters(const ModelStatesView& m, const Fp16OptimizerView& w,
                                                const std::vector<std::string>& order, const std::string& path) {
  const std::string where = path + ": optimizer['" + std::string(w.fused ? kFlatMasters : kMasters) + "']";
  std::map<std::string, MasterPlace> out;
  size_t group = 0, index = 0;
  int64_t offset = 0, id = 0;
  for (const std::string& name : order) {
    auto it = m.module.find(name);
    if (it == m.module.end()) throw FormatError(path + ": module has no tensor '" + name + "'");
    const int64_t numel = it->second->numel();
    // The next group once this one is used up.
    while (group < w.fp32.size() && (w.fused ? offset == w.fp32[group][0]->numel() : index == w.fp32[group].size())) {
      ++group;
      offset = 0;
      index = 0;
    }
    if (group == w.fp32.size())
      Fail(where, "holds fewer parameters than the module's trainable ones (no master for '" + name + "')");
    const Tensor& t = *w.fp32[group][w.fused ? 0 : index];
    const int64_t room = w.fused ? t.numel() - offset : t.numel();
    if ((w.fused && numel > room) || (!w.fused && numel != room))
      Fail(where + "[" + std::to_string(group) + "]", "does not line up with the module's parameter '" + name +
                                                          "' of " + std::to_string(numel) +
                                                          " elements (another model, or other param groups?)");
    out[name] = {group, index, offset, w.fused ? static_cast<int64_t>(group) : id};
    offset += numel;
    ++index;
    ++id;
  }
  return out;
}

}  // namespace

ReadSource Fp16OptimizerReadSource(const ModelStatesView& m, const std::string& path,
                                   const std::vector<std::string>& names) {
  const Fp16OptimizerView& w = *m.fp16_optimizer;
  const std::map<std::string, MasterPlace> places =
      PlaceMasters(m, w, m.stage0_param_names.empty() ? names : m.stage0_param_names, path);
  ReadSource s{path, path, {}};
  for (const std::string& name : names) {
    auto pl = places.find(name);
    if (pl == places.end()) throw FormatError(path + ": the fp16 optimizer's masters do not hold '" + name + "'");
    const MasterPlace& at = pl->second;
    const Tensor& weight = *m.module.at(name);
    const Tensor& master = *w.fp32[at.group][w.fused ? 0 : at.index];
    const int64_t numel = weight.numel();
    const int64_t first = w.fused ? at.offset : 0;
    ParamPlan p{name, weight.shape, numel, at.group, {}, nullptr, {}, {}};
    p.states.push_back(Slice(kFp32, master, first, numel, path + ": the fp32 master of '" + name + "'"));
    if (auto st = m.stage0_state.find(at.id); st != m.stage0_state.end()) {
      const std::string where = path + ": optimizer['" + std::string(kInner) + "'] state of " + name;
      for (const auto& [key, t] : st->second.tensors) {
        if (t->numel() != master.numel())
          Fail(where, "'" + key + "' has " + std::to_string(t->numel()) + " elements, its master " +
                          std::to_string(master.numel()) + " (not an element-wise optimizer's state?)");
        p.states.push_back(Slice(key, *t, first, numel, where + "['" + key + "']"));
      }
      p.step = st->second.step;
      p.scalars = st->second.scalars;
      p.none_states = st->second.none_states;
    }
    s.params.push_back(std::move(p));
  }
  return s;
}

}  // namespace uckpt::ckpt
