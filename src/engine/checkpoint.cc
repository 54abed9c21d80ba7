// Engine::SaveCheckpoint / LoadCheckpoint: DeepSpeed's files, written from
// and read into the engine's flat ZeRO buffers, frozen parameters and buffers.
#include "engine/checkpoint.h"

#include <c10/core/GradMode.h>
#include <algorithm>
#include <chrono>
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
#include "format/env.h"
#include "format/error.h"
#include "format/file.h"
#include "format/pickle_reader.h"
#include "format/pickle_writer.h"
#include "format/torch_file.h"
#include "engine/async_save.h"
#include "engine/fingerprint.h"
#include "engine/resharded_load.h"
#include "engine/torch_bridge.h"

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
thread_local uint64_t t_copied_bytes = 0;             // a synchronous save's host copies
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

ckpt::AdamState SavedOptimizerState(const PartitionState& st) {
  ckpt::AdamState out;
  // A client optimizer's state as it keeps it, None states included (torch's
  // state_dict, which DeepSpeed's files hold, keeps them), else Adam's.
  for (const auto& [key, t] : st.named.empty() ? OptimizerStates(st) : st.named) out.emplace_back(key, SavedStateValue(t));
  return out;
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
    for (const c10::IValue& x : v.toListRef()) l->items.push_back(FromIValue(x, where + "[" + std::to_string(k++) + "]"));
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
    return ReadPickle(std::span<const uint8_t>(bytes, pickled->pickle.size()), where,
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
      if (v->tensor) return c10::IValue(ToTorch(*v->tensor));
      return c10::IValue();
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
    default: return c10::IValue("<" + (v->s.empty() ? std::string("unsupported value") : v->s) + ">");  // inert, never run
  }
}

// ---- Saving. ----

ckpt::AdamHparams SavedHparams(const CheckpointState& e, size_t g) {
  const OptimizerConfig& o = e.runtime.optimizer_config(g);
  return ckpt::AdamHparams{e.schedule.current_lr(g), o.beta1, o.beta2, o.eps, o.weight_decay};
}

ckpt::ModelStates ModelStatesOf(const CheckpointState& e, std::map<std::string, ValuePtr> params,
                                std::vector<std::pair<std::string, ValuePtr>> client) {
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
  m.ds_config = ckpt::JsonToValue(e.config.raw);
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
    for (const auto& p : e.module.groups[g]) {
      ids[g].push_back(static_cast<int64_t>(states.size()));
      states.push_back(e.client_optimizer ? NamedStateOf(s, flat, p.tensor.sizes().vec(), at)
                                          : AdamStateOf(s, avg, sq, p.tensor.sizes().vec(), at));
      at += p.tensor.numel();
    }
    hparams.push_back(SavedHparams(e, g));
    if (e.client_param_group) entries.push_back(FromIValue(e.client_param_group(g), "optimizer param group"));
  }
  return ckpt::Stage0OptimizerValue(states, hparams, ids, entries);
}

// Stages 0-2's model states: the trainable parameters as views into one
// storage per group's flat buffer (as DeepSpeed's state_dict of flat-buffer
// views saves them), frozen parameters whole, each also as its flattened
// fragment (a view of the module entry's storage).
ValuePtr ModelStatesValue(const CheckpointState& e, std::vector<std::pair<std::string, ValuePtr>> client) {
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
  ckpt::ModelStates m = ModelStatesOf(e, std::move(params), std::move(client));
  for (const auto& [name, whole] : frozen) {
    if (e.save_without_frozen) break;
    m.frozen_shapes.push_back({name, whole->shape});
    m.frozen.emplace_back(name, View(whole->storage, whole->dtype, {whole->numel()}, 0));
  }
  if (m.stage == 0) {
    m.stage0_optimizer = Stage0Optimizer(e);
    // Which parameter each state id is (DeepSpeed's stage-0 file does not say): for convert and resume.
    ValuePtr names = Value::List();
    for (const auto& group : e.module.groups)
      for (const auto& p : group) names->items.push_back(Value::Str(p.name));
    m.extra.front().second->set(ckpt::kStage0ParamNames, names);
  }
  return ckpt::ModelStatesValue(m);
}

ValuePtr OptimStatesValue(const CheckpointState& e) {
  const ShardedRuntime& z = e.runtime;
  ckpt::RankOptimStates r;
  r.stage = e.stage();
  r.dp = z.partition_dp();
  r.scaler = z.loss_scaler();
  r.clip_grad = e.config.gradient_clipping;
  r.ds_config = ckpt::JsonToValue(e.config.raw);
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
    gs.adam = SavedOptimizerState(s);
    gs.hparams = SavedHparams(e, slot.group);
    if (e.client_param_group) gs.group = FromIValue(e.client_param_group(slot.group), "optimizer param group");
    r.groups.push_back(std::move(gs));
  }
  return ckpt::OptimStatesValue(r);
}

}  // namespace

// Crash-safe save (docs/reliability.md): every rank writes into one temporary
// folder beside the tag; only when every rank's files are durable does rank 0
// add the manifest, rename the folder to the tag and then replace `latest`
// (async_save.h). A crash or error at any point leaves the previous
// checkpoint and `latest` as they were. With `async` the files are written in
// the background and published at a later call.
std::string SaveEngineCheckpoint(const CheckpointState& e, const std::string& dir, const std::string& tag,
                                 const ClientState& client_state, bool async) {
  const auto start = std::chrono::steady_clock::now();
  if (auto problem = ckpt::TagProblem(tag)) throw std::invalid_argument("SaveCheckpoint: tag " + *problem);
  if (e.stage() == 0 && ModelDtype(e.config) != at::kFloat)
    throw std::invalid_argument("checkpoints of fp16/bf16 training need ZeRO stage 1 or 2");
  Comm& comm = e.comm;
  Env& env = Env::Current();
  const bool rank0 = comm.rank() == 0;
  const std::string folder = dir + "/" + tag;
  const std::string tmp = dir + "/." + tag + ".uckpt-tmp";  // the same name on every rank
  if (!e.writer) e.writer = std::make_shared<CheckpointWriter>();
  e.writer->Publish(comm);  // the previous save first
  // The client state is checked on every rank before anything is written;
  // only rank 0 copies the weights out for the model-states file.
  auto client = ClientEntries(client_state);
  std::string error;
  // A synchronous save of a new tag is published before its files are
  // durable, as DeepSpeed's returns (async_save.h); over an existing tag it
  // waits for the disk, so that the folder it replaces is never lost first.
  // Rank 0 decides for all.
  std::error_code exists_error;  // (not thrown here, on rank 0 alone: step 1 reports it to all)
  const bool exists = fs::exists(folder, exists_error) || exists_error;
  at::Tensor later = at::full({1}, !async && rank0 && !exists ? 1.0f : 0.0f);
  comm.Broadcast(later, 0);
  const bool sync_after_publish = later.item<float>() > 0;
  const std::string marker = rank0 ? ckpt::UnsyncedMarkerPath(folder) : "";
  auto discard = [&] {  // rank 0, after a failure: the temporary folder and this save's marker
    RemoveQuietly(tmp);
    if (sync_after_publish) RemoveQuietly(marker);
  };
  // 1. Rank 0 makes a fresh temporary folder (one a killed save left is
  // removed) and, for a save published before durable, the durable marker
  // that says so, holding the tag `latest` names now.
  if (rank0) {
    try {
      env.CreateDirs(dir);
      env.RemoveAll(tmp);
      if (sync_after_publish) {
        AtomicFile m(marker);
        m.Write(ckpt::ReadTag(dir + "/" + ckpt::kLatestFile).value_or(""));
        m.Commit();
      }
      env.CreateDirs(tmp);
    } catch (const std::exception& ex) {
      error = ex.what();
      discard();
    }
  }
  AgreeOrThrow(comm, folder, error);
  // 2. The state as values: an async save copies every tensor into reused
  // (pinned) host buffers; a synchronous one views host tensors in place and
  // copies only device tensors (StorageOf).
  std::vector<SnapshotFile> files;
  uint64_t snapshot_bytes = 0;
  try {
    SnapshotScope scope(async ? &e.writer->pool() : nullptr);
    if (e.stage() == 3) {  // DeepSpeed's ZeRO-3 files
      files = Zero3RankFiles(e, std::move(client));
    } else {
      if (e.stage() > 0) files.push_back({ckpt::OptimStatesFileName(comm.rank(), e.config.bf16), OptimStatesValue(e)});
      if (rank0) files.push_back({ckpt::ModelStatesFileName(), ModelStatesValue(e, std::move(client))});
    }
    snapshot_bytes = async ? e.writer->pool().bytes() : t_copied_bytes;
  } catch (const std::exception& ex) {
    error = ex.what();
  }
  try {
    AgreeOrThrow(comm, folder, error);
  } catch (...) {
    if (rank0) discard();
    throw;
  }
  // 3. Every rank writes its files while another thread hashes the state
  // for the manifest's fingerprint (then added up over the ranks); then they
  // are published.
  const auto writing = std::chrono::steady_clock::now();
  try {
    PendingStateFingerprint state(e.fingerprint());
    e.writer->Start(dir, tag, tmp, std::move(files), async, snapshot_bytes, sync_after_publish, marker);
    e.writer->SetStateFingerprint(state.Finish(comm));
    e.last_save.fingerprint_s = state.hash_seconds();
  } catch (...) {
    e.writer->Abandon();
    if (rank0) discard();
    throw;
  }
  const auto written = std::chrono::steady_clock::now();
  if (!async) e.writer->Publish(comm);
  const auto end = std::chrono::steady_clock::now();
  e.last_save.async = async;
  e.last_save.state_s = std::chrono::duration<double>(writing - start).count();
  e.last_save.layout_s = async ? 0 : e.writer->layout_seconds();
  e.last_save.write_s = async ? 0 : e.writer->copy_seconds();
  e.last_save.publish_s = async ? 0 : std::chrono::duration<double>(end - written).count();
  // A synchronous save's device tensors went through the writer's staging buffers.
  e.last_save.snapshot_bytes = snapshot_bytes + (async ? 0 : e.writer->stream_buffer_bytes());
  e.last_save.blocked_s = std::chrono::duration<double>(end - start).count();
  if (const char* t = std::getenv("UCKPT_TIMERS"); t != nullptr && *t != '\0' && *t != '0' && !async) {
    const SaveStats& l = e.last_save;
    std::fprintf(stderr,
                 "uckpt save timers (rank %d): %.2f s: state %.2f, fingerprint %.2f (beside the write), layout %.2f, write %.2f, "
                 "publish %.2f\n",
                 comm.rank(), l.blocked_s, l.state_s, l.fingerprint_s, l.layout_s, l.write_s, l.publish_s);
  }
  return folder;
}

// ---- Loading: one path for every stage and every source. ----

namespace {

// The counters and the lr schedule's position.
void RestoreCounters(const CheckpointState& e, const ckpt::ModelStatesView& m, const LoadCheckpointOptions& o) {
  e.counters.global_steps = m.global_steps;
  e.counters.skipped_steps = m.skipped_steps;
  e.counters.global_samples = m.global_samples ? *m.global_samples : e.counters.global_steps * e.batch.train_batch_size;
  e.counters.micro_steps = e.counters.global_steps * e.batch.gradient_accumulation_steps;
  // DeepSpeed's load_state_dict sets the position only: the lr follows from
  // it now when the saved optimizer groups come with it, else at the next step.
  // Not loading the scheduler's state keeps its position, as DeepSpeed's.
  const bool set_lr = o.load_optimizer_states;
  if (o.load_lr_scheduler_states && m.last_batch_iteration) {
    e.schedule.Restore(*m.last_batch_iteration, set_lr);
  } else if (o.load_lr_scheduler_states && e.counters.global_steps > 0 && !e.config.scheduler.type.empty()) {
    // No saved scheduler: continue the schedule where the step count says.
    e.schedule.Restore(e.counters.global_steps - 1 - e.counters.skipped_steps, set_lr);
  }
}

// The saved param groups' hyper-parameters, kept only on request (as
// DeepSpeed's torch optimizer load_state_dict keeps them): lr for the next
// step (a configured scheduler sets the lr again from its own config and the
// restored position after that step, as DeepSpeed's does), and betas, eps and
// weight_decay for the rest of the run.
void ApplySavedHparams(const CheckpointState& e, const std::string& path, const ValuePtr& groups,
                       const LoadCheckpointOptions& o) {
  if (!o.keep_saved_hparams || !groups || !groups->is_seq()) return;
  const size_t n = e.runtime.num_groups();
  for (size_t g = 0; g < n && g < groups->items.size(); ++g) {
    OptimizerConfig c = e.runtime.optimizer_config(g);
    const ckpt::AdamHparams h =
        ckpt::ReadAdamHparams(groups->items[g], {e.schedule.current_lr(g), c.beta1, c.beta2, c.eps, c.weight_decay},
                              path + ": param_groups[" + std::to_string(g) + "]");
    e.schedule.set_current_lr(g, h.lr);
    c.beta1 = h.beta1;
    c.beta2 = h.beta2;
    c.eps = h.eps;
    c.weight_decay = h.weight_decay;
    e.runtime.set_optimizer_config(g, c);
  }
}

// The tag folder a load reads: `tag`, else the one the tag file (`latest`,
// `latest_universal`) names; empty when there is neither (nothing saved yet).
std::string TagFolderPath(const std::string& dir, const std::string& tag, bool universal) {
  const char* tag_file = ckpt::TagFileName(universal);
  if (tag.empty() && !fs::exists(dir + "/" + tag_file)) return "";
  return dir + "/" + (tag.empty() ? ReadTagFile(dir, tag_file) : ckpt::CheckTag(tag, "checkpoint tag"));
}

// Before the hash check of a folder published before it was durable (its
// save was killed in the sync window, or its sync failed): every rank syncs
// the filesystem holding it, then drops the folder's files from the page
// cache, so that the check reads what the disk holds (pages a failed
// writeback left in the cache would pass it). Returns whether every rank
// did; if not, the check reads what it can and the marker stays.
bool SyncAndDropCached(Comm& comm, const ckpt::TagFolder& folder) {
  std::string error;
  try {
    Env::Current().SyncFilesystem(folder.path);
    for (const ckpt::CheckpointFile& f : folder.files) Env::Current().DropCached(f.path);
  } catch (const std::exception& ex) {
    error = ex.what();
  }
  error = AgreedError(comm, error);
  if (!error.empty() && comm.rank() == 0)
    std::fprintf(stderr, "uckpt: warning: %s (published before its files were on disk) could not be synced: %s; "
                 "it stays marked\n", folder.path.c_str(), error.c_str());
  return error.empty();
}

// After such a folder was synced and every file read back from the disk
// matched its manifest: rank 0 removes the marker, so that later loads need
// not hash it again (if it cannot, the marker stays).
void Unmark(Comm& comm, const std::string& folder) {
  if (comm.rank() != 0) return;
  try {
    ckpt::RemoveUnsyncedMarker(folder);
  } catch (const std::exception& ex) {
    std::fprintf(stderr, "uckpt: warning: %s is whole, but %s stays (%s); later loads check it by hash too\n",
                 folder.c_str(), ckpt::UnsyncedMarkerPath(folder).c_str(), ex.what());
  }
}

// Sizes on every rank (cheap, and every rank reaches the same verdict); with
// verify_hashes the ranks split the hashing (each file is read once, not once
// per rank) and then agree, so that all of them stop if any file is bad.
void CheckManifestOnEveryRank(Comm& comm, ckpt::TagFolder& folder, bool hashes) {
  // A folder published before it was durable is checked by hash
  // (ckpt/manifest.h), on every rank if any sees the marker. Its manifest
  // is read again once the folder's pages are dropped, so that both sides
  // of the check come from the disk (only a marked folder's is read twice).
  at::Tensor unsynced = at::full({1}, folder.unsynced ? 1.0f : 0.0f);
  comm.AllReduceMax(unsynced);
  const bool marked = unsynced.item<float>() > 0;
  const bool synced = marked && SyncAndDropCached(comm, folder);
  if (marked) ckpt::ReadManifestAgain(folder);
  hashes = hashes || marked;
  if (!hashes) {
    ckpt::CheckFolderAgainstManifest(folder, false);
    return;
  }
  std::string error;
  try {
    ckpt::CheckFolderAgainstManifest(folder, true, comm.rank(), comm.world_size());
  } catch (const FormatError& ex) {
    error = ex.what();
  }
  // Every rank reports the finder's error (it names the files).
  if (std::string agreed = AgreedError(comm, error); !agreed.empty()) throw FormatError(agreed);
  if (synced) Unmark(comm, folder.path);
}

// The model-states file a rank reads, read.
struct ModelStatesFile {
  std::string path;
  TorchFile file;
  ckpt::ModelStatesView view;
  bool stage12 = false;  // mp_rank_00_model_states.pt: its module holds the whole weights
};

// A ZeRO folder: the one file of stages 0-2; of a ZeRO-3 folder its own
// rank's, else (saved by fewer ranks) rank 0's. A universal folder: its
// source's mp_rank_00_model_states.pt, or the lowest rank's ZeRO-3 copy.
ModelStatesFile ReadModelStatesFile(const ckpt::TagFolder& folder, int rank, bool universal) {
  ModelStatesFile f;
  if (universal) {
    // Listed by kind (stage 0-2 file first), then rank.
    if (folder.model_states.empty())
      throw FormatError(folder.path + ": no *model_states.pt file (not a universal checkpoint?)");
    f.path = folder.model_states.front().path;
  } else {
    for (const std::string& name :
         {ckpt::ModelStatesFileName(), ckpt::Zero3ModelStatesFileName(rank), ckpt::Zero3ModelStatesFileName(0)})
      if (const ckpt::CheckpointFile* c = folder.Find(name); f.path.empty() && c) f.path = c->path;
    if (f.path.empty())
      throw FormatError(folder.path + ": has no " + ckpt::ModelStatesFileName() + " and no " +
                        ckpt::Zero3ModelStatesFileName(0) + " (not a ZeRO checkpoint folder?)");
  }
  f.stage12 = f.path == folder.path + "/" + ckpt::ModelStatesFileName();
  f.file = LoadTorchFile(f.path);
  f.view = ckpt::ReadModelStates(f.file.root, f.path);
  return f;
}

// param_shapes must name this engine's groups and parameters in order.
void CheckParamShapes(const CheckpointState& e, const std::string& path, const ValuePtr& root) {
  const auto saved = ckpt::ReadParamShapes(root, path);
  if (saved.empty()) return;
  if (saved.size() != e.module.groups.size())
    throw FormatError(path + ": param_shapes has " + std::to_string(saved.size()) +
                      " parameter groups, this engine has " + std::to_string(e.module.groups.size()));
  for (size_t g = 0; g < e.module.groups.size(); ++g) {
    const auto& params = e.module.groups[g];
    if (saved[g].size() != params.size())
      throw FormatError(path + ": param_shapes[" + std::to_string(g) + "] has " + std::to_string(saved[g].size()) +
                        " parameters, this model's group has " + std::to_string(params.size()) +
                        " (a different model or model size?)");
    for (size_t k = 0; k < params.size(); ++k) {
      const ckpt::NamedShape& ns = saved[g][k];
      if (ns.name != params[k].name || ns.shape != params[k].tensor.sizes().vec())
        throw FormatError(path + ": parameter " + std::to_string(k) + " of group " + std::to_string(g) + " is " +
                          ns.name + " " + c10::str(at::IntArrayRef(ns.shape)) + ", this model has " + params[k].name +
                          " " + c10::str(params[k].tensor.sizes()));
    }
  }
}

// Every zero_pp_rank_<r>_mp_rank_00_model_states.pt of `folder`, in rank
// order: `dp` of them (the saving world size), else as many as there are.
std::vector<TorchFile> Zero3ModelStatesFiles(const ckpt::TagFolder& folder, std::optional<int64_t> dp) {
  std::map<int, std::string> by_rank;
  for (const auto& f : folder.model_states)
    if (f.kind == ckpt::FileKind::kZero3ModelStates) by_rank[f.dp] = f.path;
  const int n = static_cast<int>(dp.value_or(static_cast<int64_t>(by_rank.size())));
  std::vector<TorchFile> out;
  for (int r = 0; r < std::max(n, 1); ++r) {
    auto it = by_rank.find(r);
    if (it == by_rank.end())
      throw FormatError(folder.path + "/" + ckpt::Zero3ModelStatesFileName(r) +
                        ": missing; frozen parameters saved partitioned by ZeRO-3 need every rank's fragment");
    out.push_back(LoadTorchFile(it->second));
  }
  return out;
}

// A frozen parameter that ZeRO-3 saved partitioned, whole again.
at::Tensor WholeFrozen(const std::vector<TorchFile>& ranks, const std::string& name, int64_t numel) {
  const int dp = static_cast<int>(ranks.size());
  const std::vector<ValuePtr> frags = ckpt::Stage3FrozenFragments(ranks, name, numel);
  std::vector<at::Tensor> parts;
  for (int r = 0; r < dp; ++r)
    if (const int64_t real = ckpt::Stage3RealNumel(numel, dp, r); real > 0)
      parts.push_back(ToTorch(*frags[r]->tensor).reshape(-1).narrow(0, 0, real));
  return at::cat(parts);
}

// Frozen parameters and buffers from the model states (also from a universal
// checkpoint's copy of them, which DeepSpeed leaves out). One that the file
// holds empty is a frozen parameter DeepSpeed's ZeRO-3 saved partitioned: it
// is put together from every rank's frozen_param_fragments. A missing name
// or another shape is an error naming the file, unless !strict (DeepSpeed's
// load_module_strict=False): a missing one keeps the model's value.
void LoadFixedParams(const CheckpointState& e, const ckpt::TagFolder& folder, const ModelStatesFile& model,
                     bool strict) {
  std::vector<NamedParam> fixed = e.module.frozen;
  fixed.insert(fixed.end(), e.module.buffers.begin(), e.module.buffers.end());
  std::optional<std::vector<TorchFile>> ranks;
  for (const auto& p : fixed) {
    auto it = model.view.module.find(p.name);
    if (it == model.view.module.end() && !strict) continue;
    if (it == model.view.module.end())
      throw FormatError(model.path + ": module has no tensor '" + p.name + "'" +
                        (e.module.frozen.empty() ? ""
                                          : " (saved with exclude_frozen_parameters? load with "
                                            "load_module_strict=False)"));
    if (it->second->numel() == 0 && p.tensor.numel() > 0) {
      if (!ranks) ranks = Zero3ModelStatesFiles(folder, model.view.dp_world_size);
      p.tensor.copy_(WholeFrozen(*ranks, p.name, p.tensor.numel()).view(p.tensor.sizes()));
      continue;
    }
    if (it->second->shape != p.tensor.sizes().vec())
      throw FormatError(model.path + ": '" + p.name + "' has shape " + c10::str(at::IntArrayRef(it->second->shape)) +
                        ", the model needs " + c10::str(p.tensor.sizes()));
    p.tensor.copy_(ToTorch(*it->second).view(p.tensor.sizes()));
  }
}

// Whether the trainable weights come from a stage 0-2 folder's module state
// (16-bit in fp16/bf16 runs, as DeepSpeed's module load) rather than the
// fp32 masters of its rank files: where the weights are whole (stages 0-2)
// for weights-only and no-optimizer loads, and for stage-0 checkpoints (into
// any stage; stage 0 resumes a ZeRO 1/2 folder from its rank files). A
// ZeRO-3 folder's module holds no trainable weights; stage 3 reads its
// partitions' masters.
bool WeightsFromModule(const CheckpointState& e, const ckpt::TagFolder& folder, const ModelStatesFile& model,
                       const LoadCheckpointOptions& o) {
  if (!model.stage12) return false;
  const bool rank_files = !folder.rank_files.empty();
  // A stage-0 folder (torch's optimizer state in the model states, no rank files) into any stage.
  if (model.view.stage0_param_groups && !rank_files) return true;
  if (e.runtime.partitions_parameters()) return false;
  if (o.load_module_only || !o.load_optimizer_states) return true;
  return e.stage() == 0 && (model.view.stage0_param_groups || !rank_files);
}

// The planner's source, chosen by what the folder is.
LoadSource OpenSource(const CheckpointState& e, const ckpt::TagFolder& folder, const ModelStatesFile& model,
                      const std::vector<PartitionSlot>& slots, const LoadCheckpointOptions& o, bool moments) {
  if (o.universal) return OpenUniversalFolder(folder, slots, moments);
  if (WeightsFromModule(e, folder, model, o)) return ModelStatesSource(model.view, model.path, slots, moments);
  return OpenRankFiles(folder);
}

// Every partition this rank owns from the source (resharded_load.h), hashed
// for the resume proof where the folder has no record, then
// the weights from them; with the optimizer state, the loss scaler and the
// saved hyper-parameters. Weights-only loads leave Adam's state, the loss
// scale and the hyper-parameters as they were.
void LoadPartitions(const CheckpointState& e, const ckpt::TagFolder& folder, const ModelStatesFile& model,
                    const LoadCheckpointOptions& o, FingerprintCheck& proof) {
  std::vector<PartitionSlot> slots = e.runtime.Slots();
  const bool moments = o.load_optimizer_states && !o.load_module_only;
  const LoadSource source = OpenSource(e, folder, model, slots, o, moments);
  std::vector<TensorReads> reads =
      PlanSlotLoads(source, slots, moments, static_cast<double>(e.counters.global_steps - e.counters.skipped_steps),
                    e.client_optimizer);
  StagedOptions read_options;
  read_options.reads.read = source.release;
  const uint64_t bytes = FillFromReads(reads, read_options);
  HashLoadedState(e.fingerprint(), proof, source, reads);
  e.runtime.WeightsFromMasters();
  if (o.load_module_only) {
    // Whole weights (stages 0-2) give the masters their 16-bit values, as
    // DeepSpeed refreshes its fp32 copies from the loaded module; stage 3's
    // masters stay the checkpoint's fp32.
    if (!e.runtime.partitions_parameters()) e.runtime.MastersFromWeights();
    return;
  }
  static_cast<ckpt::LossScalerState&>(e.runtime.loss_scaler()) =
      ckpt::ReadLossScaler(source.loss_scaler, e.runtime.loss_scaler());
  ApplySavedHparams(e, source.optimizer_file, source.param_groups, o);
  // For a client optimizer's own keys (SGD's momentum, ...): the caller restores them into its groups.
  if (moments && source.param_groups) e.last_load.optimizer_param_groups = ToIValue(source.param_groups);
  if (source.kind == SourceKind::kRankFiles) e.last_load.optimizer_bytes_read = bytes;
}

// The client's keys: a dict of every top-level key that is not the file's own.
ClientState ClientStateOf(const ckpt::ModelStatesView& m) {
  c10::impl::GenericDict d(c10::StringType::get(), c10::AnyType::get());
  for (const auto& [k, v] : m.client) d.insert(k, ToIValue(v));
  return c10::IValue(d);
}

// The default pickle policy for the scope of one load (LoadCheckpointOptions::trust_pickled_client_state).
class ScopedPicklePolicy {
 public:
  explicit ScopedPicklePolicy(PicklePolicy p) : saved_(DefaultPicklePolicy()) { SetDefaultPicklePolicy(p); }
  ~ScopedPicklePolicy() { SetDefaultPicklePolicy(saved_); }
  ScopedPicklePolicy(const ScopedPicklePolicy&) = delete;
  ScopedPicklePolicy& operator=(const ScopedPicklePolicy&) = delete;

 private:
  PicklePolicy saved_;
};

LoadResult LoadEngineCheckpointFiles(const CheckpointState& e, const std::string& dir, const std::string& tag,
                                     const LoadCheckpointOptions& o);

}  // namespace

// DeepSpeed pickles any object a script puts in client_state (torch.save); uckpt's reader names only its
// allow-list unless the caller trusts the checkpoint: then every file of the load is read naming any class (still
// never running one), and the client keys' objects come back as PickledObject capsules.
LoadResult LoadEngineCheckpoint(const CheckpointState& e, const std::string& dir, const std::string& tag,
                                const LoadCheckpointOptions& o) {
  std::optional<ScopedPicklePolicy> lenient;
  if (o.trust_pickled_client_state) lenient.emplace(PicklePolicy::kLenient);
  try {
    return LoadEngineCheckpointFiles(e, dir, tag, o);
  } catch (const FormatError& err) {
    if (o.trust_pickled_client_state || std::string(err.what()).find("strict mode refuses") == std::string::npos)
      throw;
    throw FormatError(std::string(err.what()) +
                      ". If that is an object the training script saved in client_state and you trust this "
                      "checkpoint, load it with LoadCheckpointOptions::trust_pickled_client_state (from Python: "
                      "UCKPT_TRUST_PICKLED_CLIENT_STATE=1, which has Python's pickle rebuild it, as DeepSpeed's "
                      "torch.load(weights_only=False) does)");
  }
}

namespace {

// Open, check, plan, read, verify: the folder is listed once and its
// manifest read once (ckpt/tag_folder.h); every step works from that.
LoadResult LoadEngineCheckpointFiles(const CheckpointState& e, const std::string& dir, const std::string& tag,
                                     const LoadCheckpointOptions& o) {
  const std::string path = TagFolderPath(dir, tag, o.universal);
  if (path.empty()) return LoadResult{"", c10::IValue()};
  ckpt::TagFolder folder = ckpt::OpenTagFolder(path);
  CheckManifestOnEveryRank(e.comm, folder, o.verify_hashes);
  FingerprintCheck proof = StartStateFingerprintCheck(folder, o);  // the resume proof
  const ModelStatesFile model = ReadModelStatesFile(folder, e.comm.rank(), o.universal);
  if (model.stage12 && !e.runtime.partitions_parameters()) CheckParamShapes(e, model.path, model.file.root);
  c10::NoGradGuard no_grad;
  LoadFixedParams(e, folder, model, o.load_module_strict);
  if (!o.load_module_only) RestoreCounters(e, model.view, o);
  LoadPartitions(e, folder, model, o, proof);
  FinishStateFingerprintCheck(e.fingerprint(), !e.config.fp16.enabled && !e.config.bf16, proof, o,
                              e.last_load);
  if (model.view.lr_scheduler) e.last_load.lr_scheduler_state = ToIValue(model.view.lr_scheduler);
  return LoadResult{path, ClientStateOf(model.view)};
}

}  // namespace

}  // namespace uckpt::engine
