#include "ckpt/deepspeed_state.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <set>

#include "ckpt/deepspeed_state_build.h"
#include "ckpt/values.h"
#include "format/error.h"

namespace uckpt::ckpt {

ValuePtr JsonToValue(const nlohmann::json& j) {
  switch (j.type()) {
    case nlohmann::json::value_t::object: {
      ValuePtr d = Value::Dict();
      for (auto it = j.begin(); it != j.end(); ++it) d->set(it.key(), JsonToValue(it.value()));
      return d;
    }
    case nlohmann::json::value_t::array: {
      ValuePtr l = Value::List();
      for (const auto& x : j) l->items.push_back(JsonToValue(x));
      return l;
    }
    case nlohmann::json::value_t::string: return Value::Str(j.get<std::string>());
    case nlohmann::json::value_t::boolean: return Value::Bool(j.get<bool>());
    case nlohmann::json::value_t::number_integer: return Value::Int(j.get<int64_t>());
    case nlohmann::json::value_t::number_unsigned: return Value::Int(static_cast<int64_t>(j.get<uint64_t>()));
    case nlohmann::json::value_t::number_float: return Value::Float(j.get<double>());
    default: return Value::None();
  }
}

namespace {

ValuePtr Set() {
  auto v = std::make_shared<Value>();
  v->kind = Kind::kSet;
  return v;
}

double Number(const ValuePtr& v, const std::string& where) {
  if (v && v->kind == Kind::kFloat) return v->f;
  if (v && v->kind == Kind::kInt && v->big.empty()) return static_cast<double>(v->i);
  throw FormatError(where + " is not a number");
}

ValuePtr Key(const ValuePtr& dict, const std::string& key, const std::string& where, bool required = true) {
  ValuePtr v = dict && dict->is_dict() ? dict->get(key) : nullptr;
  if (!v && required) throw FormatError(where + ": missing key '" + key + "'");
  return v;
}

int64_t IntKey(const ValuePtr& dict, const std::string& key, const std::string& where) {
  ValuePtr v = Key(dict, key, where);
  if (v->kind != Kind::kInt || !v->big.empty()) throw FormatError(where + ": '" + key + "' is not an int");
  return v->i;
}

// One parameter's entry of stage 0's torch optimizer state: 'step', other
// scalars (numbers, 0-d tensors) and per-element tensors; None is torch's
// "no state" (SGD's momentum_buffer without momentum).
Stage0ParamState ReadStage0State(const ValuePtr& state, const std::string& where) {
  Stage0ParamState a;
  for (const auto& [key, v] : NamedEntries(state, where)) {
    if (!v) continue;
    if (IsNone(v)) {
      a.none_states.push_back(key);
      continue;
    }
    const std::string kw = where + "['" + key + "']";
    const bool number = v->kind == Kind::kInt || v->kind == Kind::kFloat;
    if (key == kStep) {
      ScalarOf(v, kw);  // a number or a one-element tensor
      a.step = v;
    } else if (number || (v->kind == Kind::kTensor && v->tensor->shape.empty())) {
      a.scalars.emplace_back(key, v);
    } else if (v->kind == Kind::kTensor) {
      a.tensors.emplace_back(key, v->tensor.get());
    } else {
      Fail(kw, "is not a tensor or a number (" + KindName(*v) + "); only element-wise optimizer states can be loaded");
    }
  }
  return a;
}

// state[id] of a torch optimizer state_dict, keyed by int (or its string).
std::map<int64_t, ValuePtr> StatesById(const ValuePtr& states, const std::string& where) {
  std::map<int64_t, ValuePtr> out;
  if (!states || !states->is_dict()) throw FormatError(where + " is not a dict");
  for (const auto& [k, v] : states->entries) {
    if (k->kind == Kind::kInt && k->big.empty()) {
      out[k->i] = v;
    } else if (k->kind == Kind::kStr && !k->s.empty() && k->s.find_first_not_of("0123456789") == std::string::npos) {
      out[std::stoll(k->s)] = v;
    }
  }
  return out;
}

}  // namespace

// ---- Value builders the encoders share (deepspeed_state_build.h) ----

ValuePtr Dict(std::initializer_list<std::pair<const char*, ValuePtr>> items, bool ordered) {
  ValuePtr d = Value::Dict(ordered);
  for (const auto& [k, v] : items) d->set(k, v);
  return d;
}

// A DeepSpeed class instance pickled as NEWOBJ + BUILD(state).
ValuePtr NewObject(const std::string& cls, ValuePtr state) {
  ValuePtr o = Value::Object(cls, Value::Tuple(), /*newobj=*/true);
  o->state = std::move(state);
  return o;
}

ValuePtr IntList(const std::vector<int64_t>& v) {
  ValuePtr l = Value::List();
  for (int64_t x : v) l->items.push_back(Value::Int(x));
  return l;
}

ValuePtr StateDict(const AdamState& s) {
  ValuePtr d = Value::Dict();
  for (const auto& [k, v] : s) d->set(k, v);
  return d;
}

bool IsAdamStateKeys(const std::vector<std::string>& keys) {
  return keys.size() == 2 &&
         ((keys[0] == kExpAvg && keys[1] == kExpAvgSq) || (keys[0] == kExpAvgSq && keys[1] == kExpAvg));
}

AdamState AdamStateValue(ValuePtr step, ValuePtr exp_avg, ValuePtr exp_avg_sq) {
  return {{kStep, std::move(step)}, {kExpAvg, std::move(exp_avg)}, {kExpAvgSq, std::move(exp_avg_sq)}};
}

AdamState AdamStateOfClass(AdamState s, AdamClass cls, int64_t step) {
  if (cls == AdamClass::kTorch) return s;
  for (auto& [key, v] : s)
    if (key == kStep) v = Value::Int(step);
  return s;
}

double ScalarOf(const ValuePtr& v, const std::string& where) {
  if (v && (v->kind == Kind::kFloat || (v->kind == Kind::kInt && v->big.empty()))) return Number(v, where);
  if (!v || !v->tensor || v->tensor->numel() != 1)
    throw FormatError(where + " is not a number or a one-element tensor");
  const Tensor& t = *v->tensor;
  auto bytes = t.contiguous_view();
  if (bytes.size() < DTypeSize(t.dtype)) throw FormatError(where + ": the tensor's bytes are not in the file");
  const uint8_t* p = bytes.data();
  switch (t.dtype) {
    case DType::kFloat32: {
      float f;
      std::memcpy(&f, p, 4);
      return f;
    }
    case DType::kFloat64: {
      double d;
      std::memcpy(&d, p, 8);
      return d;
    }
    case DType::kInt64: {
      int64_t i;
      std::memcpy(&i, p, 8);
      return static_cast<double>(i);
    }
    case DType::kInt32: {
      int32_t i;
      std::memcpy(&i, p, 4);
      return i;
    }
    default:
      throw FormatError(where + " has dtype " + std::string(DTypeName(t.dtype)) +
                        "; expected float32, float64 or an int");
  }
}

// ---- Fields ----

int64_t NamedShape::numel() const { return NumelOf(shape); }

ValuePtr ParamShapesValue(const ParamShapes& groups) {
  ValuePtr list = Value::List();
  for (const auto& g : groups) {
    ValuePtr group = Value::Dict(/*ordered=*/true);
    for (const auto& p : g) group->set(p.name, Value::Size(p.shape));
    list->items.push_back(group);
  }
  return list;
}

namespace {
ParamShapes ParseParamShapes(const ValuePtr& shapes, const std::string& path) {
  const std::string where = path + ": param_shapes";
  ParamShapes out;
  const auto& groups = AsList(shapes, where);
  for (size_t g = 0; g < groups.size(); ++g) {
    const std::string gw = where + "[" + std::to_string(g) + "]";
    out.emplace_back();
    for (const auto& [name, shape] : NamedEntries(groups[g], gw))
      out.back().push_back({name, AsShape(shape, gw + "['" + name + "']")});
  }
  return out;
}
}  // namespace

ParamShapes ReadParamShapes(const ValuePtr& root, const std::string& path) {
  ValuePtr shapes = root && root->is_dict() ? root->get("param_shapes") : nullptr;
  if (IsNone(shapes)) return {};
  return ParseParamShapes(shapes, path);
}

ParamShapes ReadRequiredParamShapes(const ValuePtr& root, const std::string& path) {
  ValuePtr shapes = Need(root, "param_shapes", path);
  if (IsNone(shapes)) Fail(path + ": param_shapes", "is None (not a ZeRO checkpoint?)");
  return ParseParamShapes(shapes, path);
}

ValuePtr ParamGroupValue(const AdamHparams& h, const std::vector<int64_t>& ids, bool stepped) {
  ValuePtr g = Value::Dict();
  std::vector<ValuePtr> pair{Value::Float(h.beta1), Value::Float(h.beta2)};
  ValuePtr betas = h.betas_given ? Value::List(pair) : Value::Tuple(pair);
  switch (h.cls) {
    case AdamClass::kFusedAdam:  // its defaults' order; its step() adds 'step' (0: the count is per parameter)
      g->set("lr", Value::Float(h.lr));
      g->set("bias_correction", Value::Bool(h.bias_correction));
      g->set("betas", betas);
      g->set("eps", Value::Float(h.eps));
      g->set("weight_decay", Value::Float(h.weight_decay));
      if (stepped) g->set("step", Value::Int(0));
      break;
    case AdamClass::kCpuAdam:
      g->set("lr", Value::Float(h.lr));
      g->set("betas", betas);
      g->set("eps", Value::Float(h.eps));
      g->set("weight_decay", Value::Float(h.weight_decay));
      g->set("bias_correction", Value::Bool(h.bias_correction));
      g->set("amsgrad", Value::Bool(false));
      break;
    case AdamClass::kTorch:
      g->set("lr", Value::Float(h.lr));
      g->set("betas", betas);
      g->set("eps", Value::Float(h.eps));
      g->set("weight_decay", Value::Float(h.weight_decay));
      g->set("amsgrad", Value::Bool(false));
      g->set("foreach", Value::None());
      g->set("maximize", Value::Bool(false));
      g->set("capturable", Value::Bool(false));
      break;
  }
  g->set("params", IntList(ids));
  return g;
}

ValuePtr ParamGroupValue(const ValuePtr& entries, const std::vector<int64_t>& ids) {
  ValuePtr g = Value::Dict();
  if (entries && entries->is_dict())
    for (const auto& [k, v] : entries->entries)
      if (!(k && k->kind == Kind::kStr && k->s == "params")) g->entries.emplace_back(k, v);
  g->set("params", IntList(ids));
  return g;
}

AdamHparams ReadAdamHparams(const ValuePtr& group, const AdamHparams& base, const std::string& where) {
  AdamHparams h = base;
  if (!group || !group->is_dict()) return h;
  if (auto lr = group->get("lr")) h.lr = Number(lr, where + ".lr");
  if (auto betas = group->get("betas")) {
    if (!betas->is_seq() || betas->items.size() != 2) throw FormatError(where + ".betas is not a pair");
    h.beta1 = Number(betas->items[0], where + ".betas[0]");
    h.beta2 = Number(betas->items[1], where + ".betas[1]");
  }
  if (auto eps = group->get("eps")) h.eps = Number(eps, where + ".eps");
  if (auto wd = group->get("weight_decay")) h.weight_decay = Number(wd, where + ".weight_decay");
  return h;
}

ValuePtr LossScalerValue(const LossScalerState& s) {
  if (!s.dynamic)
    return NewObject("deepspeed.runtime.fp16.loss_scaler.LossScaler",
                     Dict({{"cur_scale", Value::Float(s.cur_scale)}, {"dynamic", Value::Bool(false)}}));
  return NewObject("deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
                   Dict({{"cur_scale", Value::Float(s.cur_scale)},
                         {"dynamic", Value::Bool(true)},
                         {"cur_iter", Value::Int(s.cur_iter)},
                         {"last_overflow_iter", Value::Int(s.last_overflow_iter)},
                         {"scale_factor", Value::Float(s.scale_factor)},
                         {"scale_window", Value::Int(s.scale_window)},
                         {"min_scale", Value::Float(s.min_scale)},
                         {"delayed_shift", Value::Int(s.delayed_shift)},
                         {"cur_hysteresis", Value::Int(s.cur_hysteresis)},
                         {"consecutive_hysteresis", Value::Bool(s.consecutive_hysteresis)},
                         {"raise_error_at_min_scale", Value::Bool(s.raise_error_at_min_scale)},
                         {"dtype", Value::Global("torch", "float16")}}));
}

LossScalerState ReadLossScaler(const ValuePtr& v, const LossScalerState& base) {
  LossScalerState s = base;
  if (!v || v->kind != Kind::kObject || !v->state || !v->state->is_dict()) return s;
  const ValuePtr& st = v->state;
  auto num = [&](const char* k, double& out) {
    if (auto x = st->get(k); x && (x->kind == Kind::kFloat || x->kind == Kind::kInt)) out = Number(x, k);
  };
  auto geti = [&](const char* k, int64_t& out) {
    if (auto x = st->get(k); x && x->kind == Kind::kInt) out = x->i;
  };
  auto getb = [&](const char* k, bool& out) {
    if (auto x = st->get(k); x && x->kind == Kind::kBool) out = x->b;
  };
  num("cur_scale", s.cur_scale);
  getb("dynamic", s.dynamic);
  geti("cur_iter", s.cur_iter);
  geti("last_overflow_iter", s.last_overflow_iter);
  geti("scale_window", s.scale_window);
  geti("delayed_shift", s.delayed_shift);
  geti("cur_hysteresis", s.cur_hysteresis);
  getb("consecutive_hysteresis", s.consecutive_hysteresis);
  getb("raise_error_at_min_scale", s.raise_error_at_min_scale);
  num("scale_factor", s.scale_factor);
  num("min_scale", s.min_scale);
  return s;
}

LossScalerState ReadLossScaler(const Fp16OptimizerView& w, const LossScalerState& base) {
  LossScalerState s = base;
  s.dynamic = w.dynamic;
  s.cur_scale = w.cur_scale;
  s.cur_iter = w.cur_iter;
  if (w.dynamic) {
    s.last_overflow_iter = w.last_overflow_iter;
    s.scale_factor = w.scale_factor;
    s.scale_window = w.scale_window;
  }
  return s;
}

ValuePtr ZeroStageValue(int stage) {
  static const char* names[] = {"disabled", "optimizer_states", "gradients", "weights"};
  return Value::Object(
      "builtins.getattr",
      Value::Tuple({Value::Global("deepspeed.runtime.zero.config", "ZeroStageEnum"), Value::Str(names[stage])}),
      /*newobj=*/false);
}

int ParseZeroStage(const ValuePtr& v, const std::string& where) {
  if (!v) return 0;
  if (v->kind == Kind::kInt) return static_cast<int>(v->i);
  if (v->kind == Kind::kObject && !v->items.empty() && v->items[0] && v->items[0]->is_seq()) {
    const auto& args = v->items[0]->items;
    if (v->name() == "getattr" && args.size() == 2 && args[1] && args[1]->kind == Kind::kStr) {
      static const std::map<std::string, int> names = {
          {"disabled", 0}, {"optimizer_states", 1}, {"gradients", 2}, {"weights", 3}, {"max_stage", 3}};
      auto it = names.find(args[1]->s);
      if (it != names.end()) return it->second;
    }
    if (v->name() == "ZeroStageEnum" && args.size() == 1 && args[0] && args[0]->kind == Kind::kInt)
      return static_cast<int>(args[0]->i);
  }
  Fail(where, "cannot read zero_stage (" + KindName(*v) + ")");
}

ValuePtr FragmentAddressValue(int64_t numel, int64_t start) {
  return NewObject("deepspeed.utils.tensor_fragment.fragment_address",
                   Dict({{"numel", Value::Int(numel)}, {"start", Value::Int(start)}}));
}

FragmentAddress ReadFragmentAddress(const ValuePtr& v, const std::string& where) {
  ValuePtr fields = v && v->kind == Kind::kObject ? v->state : v;  // NEWOBJ + BUILD {'numel', 'start'}
  return {AsInt(Need(fields, "numel", where), where + ".numel"), AsInt(Need(fields, "start", where), where + ".start")};
}

// ---- Model states ----

bool IsModelStatesKey(const std::string& k) {
  static const std::set<std::string> keys = {"module",
                                             "buffer_names",
                                             "optimizer",
                                             "param_shapes",
                                             "frozen_param_shapes",
                                             "shared_params",
                                             "frozen_param_fragments",
                                             "lr_scheduler",
                                             "data_sampler",
                                             "random_ltd",
                                             "sparse_tensor_module_names",
                                             "skipped_steps",
                                             "global_steps",
                                             "global_samples",
                                             "dp_world_size",
                                             "mp_world_size",
                                             "ds_config",
                                             "ds_version",
                                             "uckpt"};
  return keys.count(k) > 0;
}

namespace {
// Keys DeepSpeed's own writer leaves to the client (Megatron-style scripts and
// DeepSpeed's converter put them in client_state); uckpt writes defaults that
// a client's value replaces, and records which stayed defaults (they are then
// not the client's on load).
const char* const kClientConventionKeys[] = {"universal_checkpoint_info", "iteration"};
constexpr const char* kDefaultedKeys = "defaulted_keys";

bool IsUckptDefault(const ValuePtr& root, const std::string& k) {
  if (std::find(std::begin(kClientConventionKeys), std::end(kClientConventionKeys), k) ==
      std::end(kClientConventionKeys))
    return false;
  ValuePtr u = root->get("uckpt");
  if (!u || !u->is_dict()) return false;  // DeepSpeed's file: the client wrote it
  ValuePtr listed = u->get(kDefaultedKeys);
  if (!listed || !listed->is_seq()) return true;  // older uckpt files: always uckpt's
  for (const auto& item : listed->items)
    if (item && item->kind == Kind::kStr && item->s == k) return true;
  return false;
}
}  // namespace

ValuePtr ModelStatesValue(const ModelStates& s) {
  ValuePtr module = Value::Dict(/*ordered=*/true);
  for (const auto& [name, t] : s.module) module->set(name, t);
  if (!s.module_prefixes.empty()) {
    ValuePtr metadata = Value::Dict(/*ordered=*/true);
    for (const auto& m : s.module_prefixes) metadata->set(m, Dict({{"version", Value::Int(1)}}));
    module->state = Dict({{"_metadata", metadata}});
  }
  ValuePtr buffer_names = Value::List();
  for (const auto& b : s.buffer_names) buffer_names->items.push_back(Value::Str(b));
  // Stage 2 records frozen parameters: their shapes, and each whole, flattened.
  ValuePtr frozen_shapes = Value::Dict(true), frozen_fragments = Value::Dict(true);
  for (const auto& p : s.frozen_shapes) frozen_shapes->set(p.name, Value::Size(p.shape));
  for (const auto& [name, t] : s.frozen) frozen_fragments->set(name, t);
  ValuePtr shared = Value::Dict();
  for (const auto& [alias, owner] : s.shared_params) shared->set(alias, Value::Str(owner));

  ValuePtr d = Value::Dict();
  d->set("module", module);
  d->set("buffer_names", buffer_names);
  d->set("optimizer", s.stage == 0 && s.stage0_optimizer ? s.stage0_optimizer : Value::None());
  d->set("param_shapes", s.stage == 0 ? Value::None() : ParamShapesValue(s.param_shapes));
  const bool record_frozen = s.stage >= 2 && !s.frozen_excluded;
  d->set("frozen_param_shapes", record_frozen ? frozen_shapes : Value::None());
  d->set("shared_params", s.stage == 0 ? Value::None() : shared);
  d->set("frozen_param_fragments", record_frozen ? frozen_fragments : Value::None());
  d->set("lr_scheduler", s.lr_scheduler ? s.lr_scheduler
                         : s.last_batch_iteration
                             ? Dict({{"last_batch_iteration", Value::Int(*s.last_batch_iteration)}})
                             : Value::None());
  d->set("data_sampler", Value::None());
  d->set("random_ltd", Value::None());
  d->set("sparse_tensor_module_names", Set());
  d->set("skipped_steps", Value::Int(s.skipped_steps));
  d->set("global_steps", Value::Int(s.global_steps));
  d->set("global_samples", Value::Int(s.global_samples));
  d->set("dp_world_size", Value::Int(s.dp_world_size));
  d->set("mp_world_size", Value::Int(1));
  d->set("ds_config", s.ds_config ? s.ds_config : Value::Dict());
  d->set("ds_version", Value::Str(kDeepSpeedVersion));
  // Client state DeepSpeed's converter needs, and the iteration.
  d->set("universal_checkpoint_info", Dict({{"universal_checkpoint_version", Value::Float(0.2)}}));
  d->set("iteration", Value::Int(s.global_steps));
  for (const auto& [k, v] : s.extra) d->set(k, v);
  if (ValuePtr u = d->get("uckpt"); u && u->is_dict()) {
    ValuePtr defaulted = Value::List();
    for (const char* k : kClientConventionKeys) {
      bool given = false;
      for (const auto& e : s.extra) given |= e.first == k;
      if (!given) defaulted->items.push_back(Value::Str(k));
    }
    u->set(kDefaultedKeys, defaulted);
  }
  return d;
}

ModelStatesView ReadModelStates(const ValuePtr& root, const std::string& path) {
  if (!root || !root->is_dict()) throw FormatError(path + ": is not a DeepSpeed model-states dict");
  ModelStatesView m;
  ValuePtr module = Key(root, "module", path);
  if (!module->is_dict()) throw FormatError(path + ": 'module' is not a state dict");
  for (const auto& [k, v] : module->entries)
    if (k->kind == Kind::kStr && v && v->tensor) m.module[k->s] = v->tensor.get();
  m.global_steps = IntKey(root, "global_steps", path);
  if (Key(root, "skipped_steps", path, false)) m.skipped_steps = IntKey(root, "skipped_steps", path);
  if (ValuePtr g = Key(root, "global_samples", path, false); g && g->kind == Kind::kInt) m.global_samples = g->i;
  if (ValuePtr u = Key(root, "uckpt", path, false); u && u->is_dict() && u->get("data_samples"))
    m.global_samples = IntKey(u, "data_samples", path + ": uckpt");
  if (ValuePtr u = Key(root, "uckpt", path, false); u && u->is_dict() && u->get(kStage0ParamNames))
    for (const auto& n : AsList(u->get(kStage0ParamNames), path + ": uckpt['" + kStage0ParamNames + "']"))
      m.stage0_param_names.push_back(AsStr(n, path + ": uckpt['" + kStage0ParamNames + "']"));
  if (m.global_steps < 0 || m.skipped_steps < 0 || (m.global_samples && *m.global_samples < 0))
    throw FormatError(path + ": negative step counters");
  if (ValuePtr s = Key(root, "lr_scheduler", path, false); s && s->kind != Kind::kNone) m.lr_scheduler = s;
  if (ValuePtr s = m.lr_scheduler; s && s->is_dict() && s->get("last_batch_iteration"))
    m.last_batch_iteration = IntKey(s, "last_batch_iteration", path + ": lr_scheduler");
  if (ValuePtr d = Key(root, "dp_world_size", path, false); d && d->kind == Kind::kInt) m.dp_world_size = d->i;
  if (ValuePtr opt = Key(root, "optimizer", path, false); opt && opt->is_dict()) {
    if (IsFp16OptimizerState(opt)) {
      m.fp16_optimizer = ReadFp16Optimizer(opt, path);
      opt = m.fp16_optimizer->optimizer_state_dict;
      if (!opt->is_dict()) throw FormatError(path + ": optimizer['optimizer_state_dict'] is not a dict");
    }
    for (const auto& [id, state] : StatesById(Key(opt, "state", path + ": optimizer"), path + ": optimizer.state"))
      m.stage0_state[id] = ReadStage0State(state, path + ": optimizer.state[" + std::to_string(id) + "]");
    m.stage0_param_groups = Key(opt, "param_groups", path + ": optimizer", false);
  }
  for (const auto& [k, v] : root->entries)
    if (k->kind == Kind::kStr && !IsModelStatesKey(k->s) && !IsUckptDefault(root, k->s)) m.client.emplace_back(k->s, v);
  return m;
}

ValuePtr ModuleStateDictOf(const ValuePtr& root) {
  if (!root || !root->is_dict()) return nullptr;
  ValuePtr module = root->get("module");
  return module && module->is_dict() ? module : nullptr;
}

ModuleEntriesView ReadModuleEntries(const ValuePtr& root, const std::string& path) {
  ModuleEntriesView v;
  if (ValuePtr bn = root->get("buffer_names"); bn && bn->is_seq())
    for (const auto& b : bn->items)
      if (b && b->kind == Kind::kStr) v.buffer_names.insert(b->s);
  if (ValuePtr sp = root->get("shared_params"); sp && sp->is_dict())
    for (const auto& [alias, owner] : NamedEntries(sp, path + ": shared_params"))
      v.shared_params.emplace_back(alias, AsStr(owner, path + ": shared_params['" + alias + "']"));
  ValuePtr module = root->get("module");
  if (IsNone(module)) return v;
  v.module = module;
  ValuePtr frozen_shapes = root->get("frozen_param_shapes");
  if (IsNone(frozen_shapes)) return v;
  v.frozen_shapes.emplace();
  for (const auto& [name, shape] : NamedEntries(frozen_shapes, path + ": frozen_param_shapes"))
    v.frozen_shapes->push_back({name, AsShape(shape, path + ": frozen_param_shapes['" + name + "']")});
  return v;
}

ValuePtr ReadFrozenFragment(const ValuePtr& root, const std::string& name, const std::string& path) {
  return Need(Need(root, "frozen_param_fragments", path), name, path + ": frozen_param_fragments");
}

ModelStatesRun ReadModelStatesRun(const ValuePtr& root) {
  ModelStatesRun r;
  if (!root || !root->is_dict()) return r;
  auto int_of = [&](const char* key, std::optional<int64_t>& out) {
    if (ValuePtr v = root->get(key); v && v->kind == Kind::kInt) out = v->i;
  };
  int_of("dp_world_size", r.dp_world_size);
  int_of("mp_world_size", r.mp_world_size);
  int_of("global_steps", r.global_steps);
  return r;
}

ValuePtr ReadSavedConfig(const ValuePtr& root) { return root ? root->get("ds_config") : nullptr; }

ValuePtr RequiredModule(const ValuePtr& root, const std::string& path) { return Need(root, "module", path); }

std::optional<std::vector<Stage0OptimizerEntry>> ReadStage0OptimizerEntries(const ValuePtr& root,
                                                                            const std::string& path) {
  ValuePtr opt = root->get("optimizer");
  if (!opt || !opt->is_dict()) return std::nullopt;
  // Stage 0 in fp16: the wrapped optimizer's state_dict inside DeepSpeed's fp16 wrapper's.
  if (IsFp16OptimizerState(opt)) opt = Need(opt, "optimizer_state_dict", path + ": optimizer");
  ValuePtr state = Need(opt, "state", path + ": optimizer");
  if (!state->is_dict()) Fail(path + ": optimizer.state", "is not a dict");
  AsList(Need(opt, "param_groups", path + ": optimizer"), path + ": optimizer.param_groups");
  std::vector<Stage0OptimizerEntry> out;
  for (const auto& [key, st] : state->entries) {
    Stage0OptimizerEntry e{path + ": optimizer.state[" + std::to_string(out.size()) + "]", {}};
    if (!st || !st->is_dict()) Fail(e.where, "is not a dict");
    for (const auto& [skey, sv] : st->entries)
      if (sv && sv->tensor) e.tensors.emplace_back(skey && skey->kind == Kind::kStr ? skey->s : "?", sv->tensor.get());
    out.push_back(std::move(e));
  }
  return out;
}

ValuePtr Stage0OptimizerValue(const std::vector<AdamState>& states, const std::vector<AdamHparams>& groups,
                              const std::vector<std::vector<int64_t>>& group_params,
                              const std::vector<ValuePtr>& group_entries) {
  ValuePtr state = Value::Dict();
  bool stepped = false;
  for (size_t i = 0; i < states.size(); ++i)
    if (!states[i].empty()) {
      state->set(Value::Int(static_cast<int64_t>(i)), StateDict(states[i]));
      stepped = true;
    }
  ValuePtr param_groups = Value::List();
  for (size_t g = 0; g < groups.size(); ++g)
    param_groups->items.push_back(g < group_entries.size() && group_entries[g]
                                      ? ParamGroupValue(group_entries[g], group_params.at(g))
                                      : ParamGroupValue(groups[g], group_params.at(g), stepped));
  return Dict({{"state", state}, {"param_groups", param_groups}});
}

std::vector<ValuePtr> Stage3FrozenFragments(const std::vector<TorchFile>& ranks, const std::string& name,
                                            int64_t numel) {
  const int dp = static_cast<int>(ranks.size());
  std::vector<ValuePtr> out;
  for (const TorchFile& m : ranks) {
    const std::string path = m.file->path();
    const std::string where = path + ": frozen_param_fragments['" + name + "']";
    out.push_back(Need(Need(m.root, "frozen_param_fragments", path), name, path + ": frozen_param_fragments"));
    const Tensor& t = AsTensor(out.back(), where);
    if (t.numel() != Stage3PartitionSize(numel, dp))
      throw FormatError(where + ": has " + std::to_string(t.numel()) + " elements, not ceil(" + std::to_string(numel) +
                        "/" + std::to_string(dp) + ") (one rank's slot of the ZeRO-3 partition)");
  }
  return out;
}

}  // namespace uckpt::ckpt
