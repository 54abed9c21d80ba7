// Engine::SaveCheckpoint / LoadCheckpoint: DeepSpeed's files, written from
// and read into the engine's flat ZeRO buffers, frozen parameters and buffers.
#include "engine/checkpoint.h"

#include <c10/core/GradMode.h>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <set>

#include "ckpt/deepspeed_names.h"
#include "ckpt/folder.h"
#include "ckpt/manifest.h"
#include "ckpt/tag_folder.h"
#include "ckpt/universal_checkpoint.h"
#include "engine/async_save.h"
#include "engine/fingerprint.h"
#include "engine/resharded_load.h"
#include "engine/torch_bridge.h"
#include "format/env.h"
#include "format/error.h"
#include "format/file.h"
#include "format/pickle_reader.h"
#include "format/pickle_writer.h"
#include "format/torch_file.h"

namespace uckpt::engine {
namespace fs = std::filesystem;

// ---- Small value builders and readers. ----
namespace {

// A tensor view into `storage`.
ValuePtr View(const std::shared_ptr<Storage>& storage, DType dtype, std::vector<int64_t> shape, int64_t offset,
              bool requires_grad = false) {
  Tensor t;
  t.dtype = dtype;
  t.stride = Tensor::ContiguousStrides(shape);
  t.shape = std::move(shape);
  t.storage_offset = offset;
  t.storage = storage;
  t.requires_grad = requires_grad;
  return Value::FromTensor(std::move(t));
}

// How StorageOf takes each tensor while a save builds its values, decided
// per tensor by where it lies. An async save copies every tensor into the
// snapshot pool (training goes on while the files are written). A
// synchronous save blocks training until its files are written, so a
// contiguous host tensor (offloaded state included) is viewed in place, a
// device tensor is streamed (copied to the host a buffer at a time while its
// record is written: StreamedStorageOf), and only a non-contiguous host
// tensor is copied whole, into memory freed once the files are written.
thread_local SnapshotPool* t_snapshot_pool = nullptr;  // async saves only
thread_local uint64_t t_copied_bytes = 0;              // a synchronous save's host copies
struct SnapshotScope {
  explicit SnapshotScope(SnapshotPool* pool) : previous(t_snapshot_pool) {
    t_snapshot_pool = pool;
    t_copied_bytes = 0;
  }
  ~SnapshotScope() { t_snapshot_pool = previous; }
  SnapshotPool* previous;
};
std::shared_ptr<Storage> ViewOf(at::Tensor t) {
  auto owner = std::make_shared<at::Tensor>(std::move(t));
  return Storage::View({static_cast<const uint8_t*>(owner->data_ptr()), owner->nbytes()},
                       FromScalarType(owner->scalar_type()), owner);
}
std::shared_ptr<Storage> StorageOf(const at::Tensor& t) {
  if (t_snapshot_pool) return t_snapshot_pool->Copy(t.detach().contiguous());
  if (t.device().is_cpu() && t.is_contiguous()) return ViewOf(t.detach());
  if (!t.device().is_cpu()) return StreamedStorageOf(t);
  at::Tensor c = t.detach().contiguous();
  t_copied_bytes += c.nbytes();
  return ViewOf(std::move(c));
}

}  // namespace

std::shared_ptr<Storage> StreamedStorageOf(const at::Tensor& t) {
  // One byte per element of a flat contiguous copy on the tensor's device
  // (the tensor itself when it is contiguous), kept until the file is written.
  auto flat = std::make_shared<at::Tensor>(t.detach().contiguous().reshape({-1}).view(at::kByte));
  const uint64_t size = flat->numel();
  return Storage::Streamed(size, FromScalarType(t.scalar_type()), [flat](uint64_t offset, std::span<uint8_t> into) {
    if (into.empty()) return;
    at::Tensor dst = at::from_blob(into.data(), {static_cast<int64_t>(into.size())}, at::kByte);
    dst.copy_(flat->narrow(0, static_cast<int64_t>(offset), static_cast<int64_t>(into.size())));
  });
}

ValuePtr TensorValue(const at::Tensor& t, bool requires_grad) {
  auto s = StorageOf(t);
  return View(s, FromScalarType(t.scalar_type()), t.sizes().vec(), 0, requires_grad);
}

ValuePtr SavedStateValue(const at::Tensor& t) {
  if (!t.defined()) return Value::None();  // torch's None state (SGD's momentum_buffer without momentum)
  // A Python number the optimizer keeps (RMSprop's step) is saved as one.
  if (t.dim() == 0 && t.scalar_type() == at::kLong) return Value::Int(t.item<int64_t>());
  if (t.dim() == 0 && t.scalar_type() == at::kDouble) return Value::Float(t.item<double>());
  return TensorValue(t);
}

ckpt::AdamState SavedOptimizerState(const PartitionState& st, ckpt::AdamClass cls) {
  ckpt::AdamState out;
  // A client optimizer's state as it keeps it, None states included (torch's
  // state_dict, which DeepSpeed's files hold, keeps them), else Adam's.
  for (const auto& [key, t] : st.named.empty() ? OptimizerStates(st) : st.named)
    out.emplace_back(key, SavedStateValue(t));
  const int64_t step = st.step.defined() ? std::llround(st.step.item<double>()) : 0;
  return ckpt::AdamStateOfClass(std::move(out), cls, step);
}

std::string ReadTagFile(const std::string& dir, const std::string& name) { return ckpt::ReadLatestTag(dir, name); }

// ---- IValue client state <-> pickled values (checkpoint.h). ----

ValuePtr FromIValue(const c10::IValue& v, const std::string& where) {
  if (v.isNone()) return Value::None();
  if (v.isBool()) return Value::Bool(v.toBool());
  if (v.isInt()) return Value::Int(v.toInt());
  if (v.isDouble()) return Value::Float(v.toDouble());
  if (v.isString()) return Value::Str(v.toStringRef());
  if (v.isTensor()) return TensorValue(v.toTensor());
  if (v.isList()) {
    ValuePtr l = Value::List();
    size_t k = 0;
    for (const c10::IValue& x : v.toListRef())
      l->items.push_back(FromIValue(x, where + "[" + std::to_string(k++) + "]"));
    return l;
  }
  if (v.isTuple()) {
    std::vector<ValuePtr> items;
    size_t k = 0;
    for (const c10::IValue& x : v.toTupleRef().elements())
      items.push_back(FromIValue(x, where + "[" + std::to_string(k++) + "]"));
    return Value::Tuple(std::move(items));
  }
  if (v.isCapsule()) {
    auto pickled = c10::dynamic_intrusive_pointer_cast<PickledObject>(v.toCapsule());
    if (!pickled) throw std::invalid_argument(where + ": a capsule that is not a uckpt::PickledObject cannot be saved");
    const auto* bytes = reinterpret_cast<const uint8_t*>(pickled->pickle.data());
    // Read as any pickle: the classes it names are kept as inert objects and written back, never run.
    return ReadPickle(
        std::span<const uint8_t>(bytes, pickled->pickle.size()), where,
        [&](const ValuePtr&) -> ValuePtr {
          throw std::invalid_argument(where + ": a pickled client_state value holds a tensor");
        },
        PickleLimits{}, PicklePolicy::kLenient);
  }
  if (v.isGenericDict()) {
    ValuePtr d = Value::Dict();
    for (const auto& kv : v.toGenericDict()) {
      const c10::IValue& key = kv.key();
      if (key.isString()) {
        d->set(key.toStringRef(), FromIValue(kv.value(), where + "['" + key.toStringRef() + "']"));
      } else if (key.isInt()) {
        d->set(Value::Int(key.toInt()), FromIValue(kv.value(), where + "[" + std::to_string(key.toInt()) + "]"));
      } else {
        throw std::invalid_argument(where + ": dict keys must be strings or ints, not " + key.tagKind());
      }
    }
    return d;
  }
  throw std::invalid_argument(where + ": a " + v.tagKind() +
                              " cannot be saved (use dicts, lists, tuples, numbers, strings, bools, None and tensors)");
}

c10::IValue ToIValue(const ValuePtr& v) {
  if (!v) return c10::IValue();
  switch (v->kind) {
    case Kind::kNone: return c10::IValue();
    case Kind::kBool: return c10::IValue(v->b);
    case Kind::kInt:
      if (!v->big.empty()) return c10::IValue(static_cast<double>(v->i));  // beyond int64: approximate
      return c10::IValue(v->i);
    case Kind::kFloat: return c10::IValue(v->f);
    case Kind::kStr: return c10::IValue(v->s);
    case Kind::kTensor:
    case Kind::kParameter:
      if (!v->tensor) return c10::IValue();
      // requires_grad as torch.load gives it back (DeepSpeed's fp32 masters have it).
      if (v->tensor->requires_grad) return c10::IValue(ToTorch(*v->tensor).requires_grad_(true));
      return c10::IValue(ToTorch(*v->tensor));
    case Kind::kList:
    case Kind::kTuple: {
      c10::impl::GenericList l(c10::AnyType::get());
      for (const auto& x : v->items) l.push_back(ToIValue(x));
      if (v->kind == Kind::kTuple) return c10::ivalue::Tuple::create(std::vector<c10::IValue>(l.begin(), l.end()));
      return c10::IValue(l);
    }
    case Kind::kTorchSize: {
      std::vector<c10::IValue> dims;
      for (const auto& x : v->items) dims.emplace_back(x->i);
      return c10::ivalue::Tuple::create(std::move(dims));
    }
    case Kind::kDict:
    case Kind::kOrderedDict: {
      c10::impl::GenericDict d(c10::AnyType::get(), c10::AnyType::get());
      for (const auto& [k, x] : v->entries) d.insert(ToIValue(k), ToIValue(x));
      return c10::IValue(d);
    }
    case Kind::kObject:
    case Kind::kGlobal:
    case Kind::kBytes:
    case Kind::kByteArray:
    case Kind::kSet:
    case Kind::kFrozenSet:
    case Kind::kComplex: {
      // Given back as its pickle (Python rebuilds numpy's values and refuses others unless trusted).
      PickledValue p = PickleForTorch(v);
      if (p.storages.empty()) return c10::IValue::make_capsule(c10::make_intrusive<PickledObject>(std::move(p.pickle)));
      [[fallthrough]];  // an object holding tensors: inert, as below
    }
    default:
      return c10::IValue("<" + (v->s.empty() ? std::string("unsupported value") : v->s) + ">");  // inert, never run
  }
}

// ---- Saving. ----

ckpt::AdamHparams SavedHparams(const CheckpointState& e, size_t g) {
  const OptimizerConfig& o = e.runtime.optimizer_config(g);
  ckpt::AdamHparams h{e.schedule.current_lr(g), o.beta1, o.beta2, o.eps, o.weight_decay};
  h.bias_correction = o.bias_correction;
  // The class DeepSpeed 0.14.5 builds for the config's Adam, so that its own load finds its keys. A client
  // optimizer that steps itself keeps its own keys and state; without an optimizer section (uckpt train's
  // default Adam) torch's keys stay.
  if (e.config.has_optimizer_section && !o.torch_adam && !e.client_optimizer)
    h.cls = e.config.zero.offload_optimizer_cpu ? ckpt::AdamClass::kCpuAdam : ckpt::AdamClass::kFusedAdam;
  return h;
}

ckpt::ModelStates ModelStatesOf(const CheckpointState& e, std::map<std::string, ValuePtr> params,
                                std::vector<std::pair<std::string, ValuePtr>> client, const ValuePtr& ds_config) {
  ckpt::ModelStates m;
  m.stage = e.stage();
  for (const auto& b : e.module.buffers) params.emplace(b.name, TensorValue(b.tensor));
  for (const auto& [alias, owner] : e.module.aliases) params[alias] = params.at(owner);
  std::set<std::string> left_out;  // exclude_frozen_parameters: DeepSpeed deletes their names (not their aliases)
  if (e.save_without_frozen)
    for (const auto& p : e.module.frozen) left_out.insert(p.name);
  for (const auto& name : e.module.state_names)
    if (!left_out.count(name)) m.module.emplace_back(name, params.at(name));
  for (const PartitionSlot& slot : e.runtime.Slots()) {  // per group (stage 3: per sub-group)
    m.param_shapes.emplace_back();
    for (const auto& p : slot.target.params) m.param_shapes.back().push_back({p.name, p.shape});
  }
  m.module_prefixes = e.module.module_prefixes;
  m.frozen_excluded = e.save_without_frozen;
  for (const auto& b : e.module.buffers) m.buffer_names.push_back(b.name);
  m.shared_params = e.module.aliases;
  if (!e.config.scheduler.type.empty()) m.last_batch_iteration = e.schedule.last_batch_iteration();
  m.global_steps = e.counters.global_steps;
  m.global_samples = e.counters.global_samples;
  m.skipped_steps = e.counters.skipped_steps;
  m.dp_world_size = e.comm.world_size();
  m.ds_config = ds_config;
  // uckpt's own: the data position and the lr, then the client's keys.
  ValuePtr ours = Value::Dict();
  ours->set("data_samples", Value::Int(e.counters.global_samples));
  ours->set("train_batch_size", Value::Int(e.batch.train_batch_size));
  ours->set("lr", Value::Float(e.schedule.current_lr()));
  m.extra.emplace_back("uckpt", ours);
  for (auto& kv : client) m.extra.push_back(std::move(kv));
  // A client scheduler's state_dict() replaces the config scheduler's under DeepSpeed's key.
  if (!e.schedule.client_state_to_save.isNone())
    m.lr_scheduler = FromIValue(e.schedule.client_state_to_save, "lr_scheduler");
  return m;
}

std::vector<std::pair<std::string, ValuePtr>> ClientEntries(const ClientState& client_state) {
  std::vector<std::pair<std::string, ValuePtr>> out;
  if (client_state.isNone()) return out;
  if (!client_state.isGenericDict())
    throw std::invalid_argument("SaveCheckpoint: client_state must be a dict with string keys, not a " +
                                client_state.tagKind());
  ValuePtr cs = FromIValue(client_state, "client_state");
  for (const auto& [k, v] : cs->entries) {
    if (k->kind != Kind::kStr) throw std::invalid_argument("SaveCheckpoint: client_state keys must be strings");
    if (ckpt::IsModelStatesKey(k->s))
      throw std::invalid_argument("SaveCheckpoint: client_state key '" + k->s +
                                  "' is one of the checkpoint's own keys; choose another name");
    out.emplace_back(k->s, v);
  }
  return out;
}

namespace {

// Adam's state of one parameter: views `shape` at `offset` of the group's
// flat moments.
ckpt::AdamState AdamStateOf(const PartitionState& s, const std::shared_ptr<Storage>& avg,
                            const std::shared_ptr<Storage>& sq, std::vector<int64_t> shape, int64_t offset) {
  if (!s.step.defined()) return {};
  return ckpt::AdamStateValue(TensorValue(s.step), View(avg, DType::kFloat32, shape, offset),
                              View(sq, DType::kFloat32, shape, offset));
}

// A client optimizer's state of one parameter, as torch keeps it per
// parameter: each per-element state viewed `shape` at `offset` of the
// group's flat one (`flat[k]`: state k's storage, null for a scalar), each
// scalar as saved at stages 1-3, None states as None, in the optimizer's order.
ckpt::AdamState NamedStateOf(const PartitionState& s, const std::vector<std::shared_ptr<Storage>>& flat,
                             const std::vector<int64_t>& shape, int64_t offset) {
  ckpt::AdamState out;
  for (size_t k = 0; k < s.named.size(); ++k) {
    const auto& [key, t] = s.named[k];
    out.emplace_back(key, flat[k] ? View(flat[k], FromScalarType(t.scalar_type()), shape, offset) : SavedStateValue(t));
  }
  return out;
}

// Stage 0: the torch optimizer's own state_dict (Adam's, or the client's
// element-wise optimizer's with its own keys and param groups), one state
// per parameter, numbered over all groups.
ValuePtr Stage0Optimizer(const CheckpointState& e) {
  std::vector<ckpt::AdamState> states;
  std::vector<ckpt::AdamHparams> hparams;
  std::vector<ValuePtr> entries;
  std::vector<std::vector<int64_t>> ids(e.module.groups.size());
  const std::vector<PartitionSlot> slots = e.runtime.Slots();  // one per group
  for (size_t g = 0; g < e.module.groups.size(); ++g) {
    const PartitionState& s = *slots.at(g).state;
    std::shared_ptr<Storage> avg, sq;
    if (s.step.defined()) avg = StorageOf(s.exp_avg), sq = StorageOf(s.exp_avg_sq);
    std::vector<std::shared_ptr<Storage>> flat;
    for (const auto& kv : s.named)
      flat.push_back(kv.second.defined() && kv.second.dim() == 1 ? StorageOf(kv.second) : nullptr);
    int64_t at = 0;
    hparams.push_back(SavedHparams(e, g));
    const int64_t step = s.step.defined() ? std::llround(s.step.item<double>()) : 0;
    for (const auto& p : e.module.groups[g]) {
      ids[g].push_back(static_cast<int64_t>(states.size()));
      states.push_back(e.client_optimizer ? NamedStateOf(s, flat, p.tensor.sizes().vec(), at)
                                          : ckpt::AdamStateOfClass(AdamStateOf(s, avg, sq, p.tensor.sizes().vec(), at),
                                                                   hparams.back().cls, step));
      at += p.tensor.numel();
    }
    if (e.client_param_group) entries.push_back(FromIValue(e.client_param_group(g), "optimizer param group"));
  }
  return ckpt::Stage0OptimizerValue(states, hparams, ids, entries);
}

// A Python number as DeepSpeed keeps it: an int where it is one.
ValuePtr PythonNumber(double v, bool integral) {
  return integral ? Value::Int(static_cast<int64_t>(v)) : Value::Float(v);
}

// FP16_Optimizer's wrapped FusedAdam state_dict: one state per param group, over
// its flat master (state step an int), and FusedAdam's group keys.
ValuePtr FusedAdamState(const CheckpointState& e, const std::vector<PartitionSlot>& slots) {
  ValuePtr state = Value::Dict(), groups = Value::List();
  for (size_t g = 0; g < slots.size(); ++g) {
    const PartitionState& s = *slots[g].state;
    int64_t numel = 0;
    for (const auto& p : e.module.groups[g]) numel += p.tensor.numel();
    if (s.step.defined()) {
      ValuePtr st = Value::Dict();
      st->set(ckpt::kStep, Value::Int(static_cast<int64_t>(s.step.item<double>())));
      st->set(ckpt::kExpAvg, View(StorageOf(s.exp_avg), DType::kFloat32, {numel}, 0));
      st->set(ckpt::kExpAvgSq, View(StorageOf(s.exp_avg_sq), DType::kFloat32, {numel}, 0));
      state->set(Value::Int(static_cast<int64_t>(g)), st);
    }
    ckpt::AdamHparams h = SavedHparams(e, g);
    h.cls = ckpt::AdamClass::kFusedAdam;  // what FP16_Optimizer wraps, config section or not
    h.betas_given = e.config.optimizer.betas_given;
    // FP16_Optimizer steps its FusedAdam once when built, so the group always has its 'step'.
    groups->items.push_back(ckpt::ParamGroupValue(h, {static_cast<int64_t>(g)}, /*stepped=*/true));
  }
  ValuePtr d = Value::Dict();
  d->set("state", state);
  d->set("param_groups", groups);
  return d;
}

// Stage 0 in fp16: DeepSpeed's FP16_Optimizer / FP16_UnfusedOptimizer
// state_dict (ckpt/fp16_optimizer_state.h): the loss scale, the wrapped
// optimizer's state_dict and the fp32 masters (flat per group, or per parameter).
ValuePtr Fp16WrapperOptimizer(const CheckpointState& e) {
  const LossScaler& ls = e.runtime.loss_scaler();
  ckpt::Fp16OptimizerState w;
  w.fused = e.stage0_fp16 == Stage0Fp16::kFused;
  w.dynamic = ls.dynamic;
  w.cur_scale = PythonNumber(ls.cur_scale, ls.integral_scale);
  w.scale_factor = PythonNumber(ls.scale_factor, ls.integral_factor);
  w.cur_iter = ls.cur_iter;
  w.last_overflow_iter = ls.last_overflow_iter;
  w.scale_window = ls.scale_window;
  w.clip_grad = PythonNumber(e.config.gradient_clipping, e.config.gradient_clipping_integral);
  const std::vector<PartitionSlot> slots = e.runtime.Slots();  // one per group
  for (size_t g = 0; g < slots.size(); ++g) {
    auto master = StorageOf(slots[g].state->master);
    w.fp32.emplace_back();
    int64_t at = 0;
    for (const auto& p : e.module.groups[g]) {
      if (!w.fused) w.fp32.back().push_back(View(master, DType::kFloat32, p.tensor.sizes().vec(), at, true));
      at += p.tensor.numel();
    }
    if (w.fused) w.fp32.back().push_back(View(master, DType::kFloat32, {at}, 0, true));
  }
  w.optimizer_state_dict = w.fused ? FusedAdamState(e, slots) : Stage0Optimizer(e);
  return ckpt::Fp16OptimizerValue(w);
}

// Stages 0-2's model states: the trainable parameters as views into one
// storage per group's flat buffer (as DeepSpeed's state_dict of flat-buffer
// views saves them), frozen parameters whole, each also as its flattened
// fragment (a view of the module entry's storage).
ValuePtr ModelStatesValue(const CheckpointState& e, std::vector<std::pair<std::string, ValuePtr>> client,
                          const ValuePtr& ds_config) {
  std::map<std::string, ValuePtr> params;
  for (size_t g = 0; g < e.module.groups.size(); ++g) {
    const at::Tensor weights = e.runtime.group_weights(g);
    auto flat = StorageOf(weights);
    int64_t off = 0;
    for (const auto& p : e.module.groups[g]) {
      params[p.name] = View(flat, FromScalarType(weights.scalar_type()), p.tensor.sizes().vec(), off);
      off += p.tensor.numel();
    }
  }
  for (const auto& p : e.module.frozen) params[p.name] = TensorValue(p.tensor);
  std::vector<std::pair<std::string, const Tensor*>> frozen;
  for (const auto& p : e.module.frozen) frozen.emplace_back(p.name, params.at(p.name)->tensor.get());
  ckpt::ModelStates m = ModelStatesOf(e, std::move(params), std::move(client), ds_config);
  for (const auto& [name, whole] : frozen) {
    if (e.save_without_frozen) break;
    m.frozen_shapes.push_back({name, whole->shape});
    m.frozen.emplace_back(name, View(whole->storage, whole->dtype, {whole->numel()}, 0));
  }
  if (m.stage == 0) {
    m.stage0_optimizer = e.stage0_fp16 != Stage0Fp16::kNone ? Fp16WrapperOptimizer(e) : Stage0Optimizer(e);
    // Which parameter each state id is (DeepSpeed's stage-0 file does not say): for convert and resume.
    ValuePtr names = Value::List();
    for (const auto& group : e.module.groups)
      for (const auto& p : group) names->items.push_back(Value::Str(p.name));
    m.extra.front().second->set(ckpt::kStage0ParamNames, names);
  }
  return ckpt::ModelStatesValue(m);
}

ValuePtr OptimStatesValue(const CheckpointState& e, const ValuePtr& ds_config) {
  const ShardedRuntime& z = e.runtime;
  ckpt::RankOptimStates r;
  r.stage = e.stage();
  r.dp = z.partition_dp();
  r.scaler = z.loss_scaler();
  r.overflow = e.counters.last_step_skipped;
  r.clip_grad = e.config.gradient_clipping;
  r.ds_config = ds_config;
  for (const PartitionSlot& slot : e.runtime.Slots()) {
    const PartitionState& s = *slot.state;
    ckpt::OptimGroupState gs;
    int64_t real = 0;  // the partition's elements before its padding
    for (const ckpt::TargetFragment& f : slot.target.fragments) {
      gs.mappings.emplace_back(slot.target.params[f.param].name,
                               ckpt::Fragment{f.param, z.partition_rank(), f.param_offset, f.offset, f.numel});
      real += f.numel;
    }
    gs.padding = slot.target.length - real;
    // The lean fp32 partition: a view of the padded one, padding cut off.
    gs.fp32 = View(StorageOf(s.master), DType::kFloat32, {real}, 0, /*requires_grad=*/true);
    gs.hparams = SavedHparams(e, slot.group);
    gs.adam = SavedOptimizerState(s, gs.hparams.cls);
    if (e.client_param_group) gs.group = FromIValue(e.client_param_group(slot.group), "optimizer param group");
    r.groups.push_back(std::move(gs));
  }
  return ckpt::OptimStatesValue(r);
}

// Where one save writes: the same names on every rank.
struct SaveTarget {
  std::string dir, tag, folder;
  std::string tmp;     // the temporary folder beside the tag
  std::string marker;  // rank 0's: the unsynced marker of a save published before durable
  std::string reuse;   // rank 0's: a folder that becomes `tmp`, its files written over (memory snapshots)
  bool rank0 = false;
  bool sync_after_publish = false;
  // Rank 0, after a failure: the temporary folder and this save's marker.
  void Discard() const {
    if (!rank0) return;
    RemoveQuietly(tmp);
    if (sync_after_publish) RemoveQuietly(marker);
  }
};

void CheckSaveRequest(const CheckpointState& e, const std::string& tag) {
  if (auto problem = ckpt::TagProblem(tag)) throw std::invalid_argument("SaveCheckpoint: tag " + *problem);
  if (e.stage() == 0 && ModelDtype(e.config) != at::kFloat && e.stage0_fp16 == Stage0Fp16::kNone)
    throw std::invalid_argument(
        "checkpoints of fp16/bf16 training need ZeRO stage 1 or 2 (or fp16 at stage 0 with an "
        "optimizer)");
}

// A synchronous save of a new tag is published before its files are
// durable, as DeepSpeed's returns (async_save.h); over an existing tag it
// waits for the disk, so that the folder it replaces is never lost first.
// Rank 0 decides for all.
bool PublishesBeforeDurable(Comm& comm, const std::string& folder, bool async) {
  const bool rank0 = comm.rank() == 0;
  std::error_code exists_error;  // (not thrown here, on rank 0 alone: step 1 reports it to all)
  const bool exists = fs::exists(folder, exists_error) || exists_error;
  at::Tensor later = at::full({1}, !async && rank0 && !exists ? 1.0f : 0.0f);
  comm.Broadcast(later, 0);
  return later.item<float>() > 0;
}

// 1. Rank 0 makes a fresh temporary folder (one a killed save left is
// removed; a memory snapshot's reused folder is renamed to it) and, for a
// save published before durable, the durable marker that says so, holding
// the tag `latest` names now. Returns the error, if any.
std::string MakeTempFolder(const SaveTarget& t) {
  if (!t.rank0) return "";
  Env& env = Env::Current();
  try {
    env.CreateDirs(t.dir);
    env.RemoveAll(t.tmp);
    if (t.sync_after_publish) {
      AtomicFile m(t.marker);
      m.Write(ckpt::ReadTag(t.dir + "/" + ckpt::kLatestFile).value_or(""));
      m.Commit();
    }
    std::error_code ec;
    if (!t.reuse.empty() && fs::is_directory(t.reuse, ec)) {
      env.Rename(t.reuse, t.tmp);
    } else {
      env.CreateDirs(t.tmp);
    }
  } catch (const std::exception& ex) {
    t.Discard();
    return ex.what();
  }
  return "";
}

struct RankSnapshot {
  std::vector<SnapshotFile> files;
  uint64_t bytes = 0;  // what the snapshot copied
};

// 2. The state as values: an async save copies every tensor into reused
// (pinned) host buffers; a synchronous one views host tensors in place and
// copies only device tensors (StorageOf).
RankSnapshot SnapshotRankFiles(const CheckpointState& e, std::vector<std::pair<std::string, ValuePtr>> client,
                               bool async) {
  RankSnapshot out;
  SnapshotScope scope(async ? &e.writer->pool() : nullptr);
  const ValuePtr ds_config = ckpt::JsonToValue(e.config.raw);  // the same in every file
  if (e.stage() == 3) {                                        // DeepSpeed's ZeRO-3 files
    out.files = Zero3RankFiles(e, std::move(client), ds_config);
  } else {
    if (e.stage() > 0)
      out.files.push_back({ckpt::OptimStatesFileName(e.comm.rank(), e.config.bf16), OptimStatesValue(e, ds_config)});
    if (e.comm.rank() == 0)
      out.files.push_back({ckpt::ModelStatesFileName(), ModelStatesValue(e, std::move(client), ds_config)});
  }
  out.bytes = async ? e.writer->pool().bytes() : t_copied_bytes;
  return out;
}

// 3. Every rank writes its files while another thread hashes the state for
// the manifest's fingerprint (then added up over the ranks).
void WriteRankFiles(const CheckpointState& e, const SaveTarget& t, RankSnapshot snapshot, bool async) {
  try {
    PendingStateFingerprint state(e.fingerprint());
    e.writer->Start(t.dir, t.tag, t.tmp, std::move(snapshot.files), async, snapshot.bytes, t.sync_after_publish,
                    t.marker);
    e.writer->SetStateFingerprint(state.Finish(e.comm));
    e.last_save.fingerprint_s = state.hash_seconds();
  } catch (...) {
    e.writer->Abandon();
    t.Discard();
    throw;
  }
}

using SaveClock = std::chrono::steady_clock;

// The save's phases into e.last_save; with UCKPT_TIMERS set, a synchronous
// save also prints them.
void RecordSaveTimes(const CheckpointState& e, bool async, uint64_t snapshot_bytes, SaveClock::time_point start,
                     SaveClock::time_point previous, SaveClock::time_point writing, SaveClock::time_point written,
                     SaveClock::time_point end) {
  e.last_save.async = async;
  e.last_save.previous_s = std::chrono::duration<double>(previous - start).count();
  e.last_save.state_s = std::chrono::duration<double>(writing - previous).count();
  e.last_save.layout_s = async ? 0 : e.writer->layout_seconds();
  e.last_save.write_s = async ? 0 : e.writer->copy_seconds();
  e.last_save.publish_s = async ? 0 : std::chrono::duration<double>(end - written).count();
  // A synchronous save's device tensors went through the writer's staging buffers.
  e.last_save.snapshot_bytes = snapshot_bytes + (async ? 0 : e.writer->stream_buffer_bytes());
  e.last_save.blocked_s = std::chrono::duration<double>(end - start).count();
  if (const char* t = std::getenv("UCKPT_TIMERS"); t != nullptr && *t != '\0' && *t != '0' && !async) {
    const SaveStats& l = e.last_save;
    std::fprintf(stderr,
                 "uckpt save timers (rank %d): %.2f s: previous save %.2f, state %.2f, fingerprint %.2f (beside the "
                 "write), layout %.2f, write %.2f, publish %.2f\n",
                 e.comm.rank(), l.blocked_s, l.previous_s, l.state_s, l.fingerprint_s, l.layout_s, l.write_s,
                 l.publish_s);
  }
}

}  // namespace

c10::IValue OptimizerStateDict(const CheckpointState& e) {
  SnapshotPool pool;  // every tensor copied to the host, as an async save's snapshot
  ValuePtr value;
  {
    SnapshotScope scope(&pool);
    if (e.stage() == 0 && e.stage0_fp16 != Stage0Fp16::kNone) {
      value = Fp16WrapperOptimizer(e);
    } else if (e.stage() == 1 || e.stage() == 2) {
      value = OptimStatesValue(e, Value::Dict())->get("optimizer_state_dict");
    } else {
      throw std::invalid_argument(
          "engine.optimizer.state_dict(): uckpt makes DeepSpeed's only at ZeRO stage 0 in "
          "fp16 and at stages 1-2, not at stage " +
          std::to_string(e.stage()) + (e.stage() == 0 ? " in bf16" : ""));
    }
  }
  return ToIValue(value);
}

// Crash-safe save (docs/reliability.md): every rank writes into one temporary
// folder beside the tag; only when every rank's files are durable does rank 0
// add the manifest, rename the folder to the tag and then replace `latest`
// (async_save.h). A crash or error at any point leaves the previous
// checkpoint and `latest` as they were. With `async` the files are written in
// the background and published at a later call.
std::string SaveEngineCheckpoint(const CheckpointState& e, const std::string& dir, const std::string& tag,
                                 const ClientState& client_state, bool async) {
  const auto start = SaveClock::now();
  CheckSaveRequest(e, tag);
  Comm& comm = e.comm;
  SaveTarget target;
  target.dir = dir;
  target.tag = tag;
  target.folder = dir + "/" + tag;
  target.tmp = dir + "/." + tag + ".uckpt-tmp";  // the same name on every rank
  target.rank0 = comm.rank() == 0;
  if (!e.writer) e.writer = std::make_shared<CheckpointWriter>(/*overwrite_in_place=*/e.memory_snapshot);
  e.writer->Publish(comm);  // the previous save first
  const auto previous = SaveClock::now();
  // The client state is checked on every rank before anything is written;
  // only rank 0 copies the weights out for the model-states file.
  auto client = ClientEntries(client_state);
  target.sync_after_publish = PublishesBeforeDurable(comm, target.folder, async);
  if (target.rank0) target.marker = ckpt::UnsyncedMarkerPath(target.folder);
  if (target.rank0 && e.memory_snapshot) target.reuse = dir + "/" + SaveCheckpointOptions::kReusedSnapshotFolder;
  AgreeOrThrow(comm, target.folder, MakeTempFolder(target));
  RankSnapshot snapshot;
  std::string error;
  try {
    snapshot = SnapshotRankFiles(e, std::move(client), async);
  } catch (const std::exception& ex) {
    error = ex.what();
  }
  try {
    AgreeOrThrow(comm, target.folder, error);
  } catch (...) {
    target.Discard();
    throw;
  }
  const auto writing = SaveClock::now();
  const uint64_t snapshot_bytes = snapshot.bytes;
  WriteRankFiles(e, target, std::move(snapshot), async);
  const auto written = SaveClock::now();
  if (!async) e.writer->Publish(comm);  // (an async save is published at a later call)
  RecordSaveTimes(e, async, snapshot_bytes, start, previous, writing, written, SaveClock::now());
  return target.folder;
}

}  // namespace uckpt::engine
