// Engine::SaveCheckpoint / LoadCheckpoint: DeepSpeed's files, written from
// and read into the engine's flat ZeRO buffers, frozen parameters and buffers.
#include "engine/checkpoint.h"

#include <c10/core/GradMode.h>
#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <set>

#include "ckpt/folder.h"
#include "ckpt/manifest.h"
#include "ckpt/universal_checkpoint.h"
#include "format/env.h"
#include "format/error.h"
#include "format/file.h"
#include "format/torch_file.h"
#include "engine/async_save.h"
#include "engine/fingerprint.h"
#include "engine/resharded_load.h"
#include "engine/torch_bridge.h"
#include "engine/engine_impl.h"

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

// Where StorageOf puts tensors while a save builds its values: a pool for
// snapshots (async saves), or none: a CPU tensor is viewed in place (a
// synchronous save writes it before the training can change it).
thread_local SnapshotPool* t_snapshot_pool = nullptr;
struct SnapshotScope {
  explicit SnapshotScope(SnapshotPool* pool) : previous(t_snapshot_pool) { t_snapshot_pool = pool; }
  ~SnapshotScope() { t_snapshot_pool = previous; }
  SnapshotPool* previous;
};
std::shared_ptr<Storage> StorageOf(const at::Tensor& t) {
  if (t_snapshot_pool) return t_snapshot_pool->Copy(t.detach().contiguous());
  if (t.device().is_cpu() && t.is_contiguous()) {
    auto owner = std::make_shared<at::Tensor>(t.detach());
    return Storage::View({static_cast<const uint8_t*>(owner->data_ptr()), owner->nbytes()},
                         FromScalarType(t.scalar_type()), owner);
  }
  at::Tensor c = t.detach().to(at::kCPU).contiguous();
  std::vector<uint8_t> bytes(c.nbytes());
  if (!bytes.empty()) std::memcpy(bytes.data(), c.data_ptr(), bytes.size());
  return Storage::Owned(std::move(bytes), FromScalarType(c.scalar_type()));
}

}  // namespace

ValuePtr TensorValue(const at::Tensor& t, bool requires_grad) {
  auto s = StorageOf(t);
  return View(s, FromScalarType(t.scalar_type()), t.sizes().vec(), 0, requires_grad);
}

// Copies `n` elements of a tensor stored in a file, starting at flat element
// `first`, into `dst` (fp32). Touches only those bytes of a mapped file.
void CopyElements(const std::string& path, const Tensor& src, int64_t first, int64_t n, at::Tensor dst) {
  if (first < 0 || first + n > src.numel())
    throw FormatError(path + ": tensor has " + std::to_string(src.numel()) + " elements, need [" +
                      std::to_string(first) + ", " + std::to_string(first + n) + ")");
  at::ScalarType st = ToScalarType(src.dtype);
  if (src.is_contiguous() && src.storage) {
    auto bytes = src.contiguous_view();
    const size_t es = DTypeSize(src.dtype);
    const uint8_t* p = bytes.data() + static_cast<size_t>(first) * es;
    at::Tensor view = at::from_blob(const_cast<uint8_t*>(p), {n}, at::TensorOptions().dtype(st));
    dst.copy_(view);
  } else {
    dst.copy_(ToTorch(src).view(-1).narrow(0, first, n));
  }
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
    default: return c10::IValue("<" + (v->s.empty() ? std::string("unsupported value") : v->s) + ">");  // inert, never run
  }
}

// ---- Saving. ----

namespace {

// The module's state_dict: trainable parameters as views into one storage
// per group's flat buffer (as DeepSpeed's state_dict of flat-buffer views
// saves them), frozen parameters and buffers with their own, aliases shared.
std::vector<std::pair<std::string, ValuePtr>> ModuleEntries(const Engine::Impl& e) {
  std::map<std::string, ValuePtr> by_name;
  for (size_t g = 0; g < e.groups.size(); ++g) {
    auto flat = StorageOf(e.zero->model_flat(g));
    const DType dt = FromScalarType(e.zero->model_flat(g).scalar_type());
    int64_t off = 0;
    for (const auto& p : e.groups[g]) {
      by_name[p.name] = View(flat, dt, p.tensor.sizes().vec(), off);
      off += p.tensor.numel();
    }
  }
  for (const auto* list : {&e.frozen, &e.buffers})
    for (const auto& p : *list) by_name[p.name] = TensorValue(p.tensor);
  for (const auto& [alias, owner] : e.aliases) by_name[alias] = by_name.at(owner);
  std::vector<std::pair<std::string, ValuePtr>> module;
  for (const auto& name : e.state_names) module.emplace_back(name, by_name.at(name));
  return module;
}

const ValuePtr& FindEntry(const std::vector<std::pair<std::string, ValuePtr>>& entries, const std::string& name) {
  for (const auto& [k, v] : entries)
    if (k == name) return v;
  throw std::logic_error("no module entry " + name);
}

ckpt::AdamHparams Hparams(const Engine::Impl& e, size_t g) {
  const OptimizerConfig& o = e.zero->optimizer_config(g);
  return ckpt::AdamHparams{e.schedule.current_lr(g), o.beta1, o.beta2, o.eps, o.weight_decay};
}

// Adam's state of group g, each tensor a view `count` elements at `offset` of
// the group's flat moments (the whole partition when count < 0).
ckpt::AdamState AdamStateOf(const PartitionState& s, const std::shared_ptr<Storage>& avg,
                            const std::shared_ptr<Storage>& sq, std::vector<int64_t> shape, int64_t offset) {
  if (!s.step.defined()) return {};
  return {{"step", TensorValue(s.step)},
          {"exp_avg", View(avg, DType::kFloat32, shape, offset)},
          {"exp_avg_sq", View(sq, DType::kFloat32, shape, offset)}};
}

// Stage 0: torch Adam's own state_dict, one state per parameter, numbered
// over all groups.
ValuePtr Stage0Optimizer(const Engine::Impl& e) {
  std::vector<ckpt::AdamState> states;
  std::vector<ckpt::AdamHparams> hparams;
  std::vector<std::vector<int64_t>> ids(e.groups.size());
  for (size_t g = 0; g < e.groups.size(); ++g) {
    const PartitionState& s = e.zero->state(g);
    std::shared_ptr<Storage> avg, sq;
    if (s.step.defined()) avg = StorageOf(s.exp_avg), sq = StorageOf(s.exp_avg_sq);
    int64_t at = 0;
    for (const auto& p : e.groups[g]) {
      ids[g].push_back(static_cast<int64_t>(states.size()));
      states.push_back(AdamStateOf(s, avg, sq, p.tensor.sizes().vec(), at));
      at += p.tensor.numel();
    }
    hparams.push_back(Hparams(e, g));
  }
  return ckpt::Stage0OptimizerValue(states, hparams, ids);
}

}  // namespace

void SetCountersAndExtras(const Engine::Impl& e, std::vector<std::pair<std::string, ValuePtr>> client,
                          ckpt::ModelStates& m) {
  m.shared_params = e.aliases;
  if (!e.config.scheduler.type.empty()) m.last_batch_iteration = e.schedule.last_batch_iteration();
  m.global_steps = e.global_steps;
  m.global_samples = e.global_samples;
  m.skipped_steps = e.skipped_steps;
  m.dp_world_size = e.comm->world_size();
  m.ds_config = ckpt::JsonToValue(e.config.raw);
  // uckpt's own: the data position and the lr, then the client's keys.
  ValuePtr ours = Value::Dict();
  ours->set("data_samples", Value::Int(e.global_samples));
  ours->set("train_batch_size", Value::Int(e.batch.train_batch_size));
  ours->set("lr", Value::Float(e.schedule.current_lr()));
  m.extra.emplace_back("uckpt", ours);
  for (auto& kv : client) m.extra.push_back(std::move(kv));
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

ValuePtr ModelStatesValue(const Engine::Impl& e, std::vector<std::pair<std::string, ValuePtr>> client) {
  ckpt::ModelStates m;
  m.stage = e.stage();
  m.module = ModuleEntries(e);
  m.module_prefixes = e.module_prefixes;
  for (const auto& b : e.buffers) m.buffer_names.push_back(b.name);
  for (const auto& g : e.groups) {
    m.param_shapes.emplace_back();
    for (const auto& p : g) m.param_shapes.back().push_back({p.name, p.tensor.sizes().vec()});
  }
  for (const auto& p : e.frozen) {
    m.frozen_shapes.push_back({p.name, p.tensor.sizes().vec()});
    // The flattened fragment is a view of the module entry's storage.
    const ValuePtr& whole = FindEntry(m.module, p.name);
    m.frozen.emplace_back(p.name, View(whole->tensor->storage, whole->tensor->dtype, {p.tensor.numel()}, 0));
  }
  if (m.stage == 0) m.stage0_optimizer = Stage0Optimizer(e);
  SetCountersAndExtras(e, std::move(client), m);
  return ckpt::ModelStatesValue(m);
}

ValuePtr OptimStatesValue(const Engine::Impl& e) {
  const int rank = e.zero->partition_rank();
  ckpt::RankOptimStates r;
  r.stage = e.stage();
  r.dp = e.zero->layout(0).dp;
  r.scaler = e.zero->loss_scaler();
  r.clip_grad = e.config.gradient_clipping;
  r.ds_config = ckpt::JsonToValue(e.config.raw);
  for (size_t g = 0; g < e.groups.size(); ++g) {
    const PartitionState& s = e.zero->state(g);
    const auto& layout = e.zero->layout(g);
    ckpt::OptimGroupState gs;
    gs.padding = layout.padding(rank);
    // The lean fp32 partition: a view of the padded one, padding cut off.
    gs.fp32 = View(StorageOf(s.master), DType::kFloat32, {layout.partition_size - gs.padding}, 0, /*requires_grad=*/true);
    if (s.step.defined())
      gs.adam = {{"step", TensorValue(s.step)}, {"exp_avg", TensorValue(s.exp_avg)}, {"exp_avg_sq", TensorValue(s.exp_avg_sq)}};
    gs.hparams = Hparams(e, g);
    for (const auto& f : ckpt::RankFragments(e.zero->numels(g), layout.dp, rank))
      gs.mappings.emplace_back(e.groups[g][f.param].name, f);
    r.groups.push_back(std::move(gs));
  }
  return ckpt::OptimStatesValue(r);
}

// The highest rank whose `error` is not empty, or -1 when every rank
// succeeded: one all-reduce, called by every rank.
int FailingRank(Comm& comm, const std::string& error) {
  at::Tensor failed = at::full({1}, error.empty() ? -1.0f : static_cast<float>(comm.rank()), at::kFloat);
  comm.AllReduceMax(failed);
  return static_cast<int>(failed.item<float>());
}

}  // namespace

// Crash-safe save (docs/reliability.md): every rank writes into one temporary
// folder beside the tag; only when every rank's files are durable does rank 0
// add the manifest, rename the folder to the tag and then replace `latest`
// (async_save.h). A crash or error at any point leaves the previous
// checkpoint and `latest` as they were. With `async` the files are written in
// the background and published at a later call.
std::string SaveEngineCheckpoint(Engine::Impl& e, const std::string& dir, const std::string& tag,
                                 const ClientState& client_state, bool async) {
  const auto start = std::chrono::steady_clock::now();
  if (auto problem = ckpt::TagProblem(tag)) throw std::invalid_argument("SaveCheckpoint: tag " + *problem);
  if (e.stage() == 0 && e.zero->settings().model_dtype != at::kFloat)
    throw std::invalid_argument("checkpoints of fp16/bf16 training need ZeRO stage 1 or 2");
  Comm& comm = *e.comm;
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
  // 1. Rank 0 makes a fresh temporary folder (one a killed save left is removed).
  if (rank0) {
    try {
      env.CreateDirs(dir);
      env.RemoveAll(tmp);
      env.CreateDirs(tmp);
    } catch (const std::exception& ex) {
      error = ex.what();
    }
  }
  AgreeOrThrow(comm, folder, error);
  // 2. The state as values: a copy into reused (pinned) host buffers when
  // the files are written in the background or the state is on a GPU, else
  // views of the tensors themselves.
  const bool snapshot = async || !e.device.is_cpu();
  std::vector<SnapshotFile> files;
  try {
    SnapshotScope scope(snapshot ? &e.writer->pool() : nullptr);
    if (e.zero3) {
      files = Zero3RankFiles(e, std::move(client));
    } else {
      if (e.stage() > 0) files.push_back({ckpt::OptimStatesFileName(comm.rank(), e.config.bf16), OptimStatesValue(e)});
      if (rank0) files.push_back({ckpt::ModelStatesFileName(), ModelStatesValue(e, std::move(client))});
    }
  } catch (const std::exception& ex) {
    error = ex.what();
  }
  try {
    AgreeOrThrow(comm, folder, error);
  } catch (...) {
    if (rank0) {
      try {
        env.RemoveAll(tmp);
      } catch (const std::exception&) {
        // The first error is the one to report.
      }
    }
    throw;
  }
  // 3. The state fingerprint for the manifest (collective), then every rank
  // writes its files; then they are published.
  const auto hashing = std::chrono::steady_clock::now();
  ckpt::StateFingerprint state = EngineStateFingerprint(e);
  e.last_save.fingerprint_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - hashing).count();
  e.writer->Start(dir, tag, tmp, std::move(files), async, snapshot ? e.writer->pool().bytes() : 0, std::move(state));
  if (!async) e.writer->Publish(comm);
  e.last_save.async = async;
  e.last_save.snapshot_bytes = snapshot ? e.writer->pool().bytes() : 0;
  e.last_save.blocked_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return folder;
}

void RestoreCounters(Engine::Impl& e, const ckpt::ModelStatesView& m, const LoadCheckpointOptions& o) {
  e.global_steps = m.global_steps;
  e.skipped_steps = m.skipped_steps;
  e.global_samples = m.global_samples ? *m.global_samples : e.global_steps * e.batch.train_batch_size;
  e.micro_steps = e.global_steps * e.batch.gradient_accumulation_steps;
  if (o.load_lr_scheduler_states && m.last_batch_iteration) {
    e.schedule.Restore(*m.last_batch_iteration);
  } else if (e.global_steps > 0 && !e.config.scheduler.type.empty()) {
    // No saved scheduler: continue the schedule where the step count says.
    e.schedule.Restore(e.global_steps - 1 - e.skipped_steps);
  }
}

// ---- Loading. ----

// The saved param groups' hyper-parameters, kept only on request (as
// DeepSpeed's torch optimizer load_state_dict keeps them): lr for the next
// step (a configured scheduler sets the lr again from its own config and the
// restored position after that step, as DeepSpeed's does), and betas, eps and
// weight_decay for the rest of the run.
void ApplySavedHparams(Engine::Impl& e, const std::string& path, const ValuePtr& groups, const LoadCheckpointOptions& o) {
  if (!o.keep_saved_hparams || !groups || !groups->is_seq()) return;
  const size_t n = e.zero3 ? e.zero3->num_groups() : e.groups.size();
  for (size_t g = 0; g < n && g < groups->items.size(); ++g) {
    OptimizerConfig c = e.optimizer_config(g);
    const ckpt::AdamHparams h =
        ckpt::ReadAdamHparams(groups->items[g], {e.schedule.current_lr(g), c.beta1, c.beta2, c.eps, c.weight_decay},
                              path + ": param_groups[" + std::to_string(g) + "]");
    e.schedule.set_current_lr(g, h.lr);
    c.beta1 = h.beta1;
    c.beta2 = h.beta2;
    c.eps = h.eps;
    c.weight_decay = h.weight_decay;
    e.set_optimizer_config(g, c);
  }
}

std::string ModelStatesPath(const std::string& folder, int rank, bool universal) {
  if (universal) {
    // Listed by kind (stage 0-2 file first), then rank.
    for (const auto& f : ckpt::ListCheckpointFolder(folder))
      if (f.kind == ckpt::FileKind::kModelStates || f.kind == ckpt::FileKind::kZero3ModelStates) return f.path;
    throw FormatError(folder + ": no *model_states.pt file (not a universal checkpoint?)");
  }
  for (const std::string& name :
       {ckpt::ModelStatesFileName(), ckpt::Zero3ModelStatesFileName(rank), ckpt::Zero3ModelStatesFileName(0)})
    if (fs::exists(folder + "/" + name)) return folder + "/" + name;
  throw FormatError(folder + ": has no " + ckpt::ModelStatesFileName() + " and no " +
                    ckpt::Zero3ModelStatesFileName(0) + " (not a ZeRO checkpoint folder?)");
}

namespace {

// param_shapes must name this engine's groups and parameters in order.
void CheckParamShapes(const Engine::Impl& e, const std::string& path, const ValuePtr& root) {
  const auto saved = ckpt::ReadParamShapes(root, path);
  if (saved.empty()) return;
  if (saved.size() != e.groups.size())
    throw FormatError(path + ": param_shapes has " + std::to_string(saved.size()) +
                      " parameter groups, this engine has " + std::to_string(e.groups.size()));
  for (size_t g = 0; g < e.groups.size(); ++g) {
    const auto& params = e.groups[g];
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

// Copies the module state dict's tensors into `targets` by name; a missing
// name or another shape is an error naming the file.
// Every zero_pp_rank_<r>_mp_rank_00_model_states.pt of `folder`, in rank
// order: `dp` of them (the saving world size), else as many as there are.
std::vector<TorchFile> Zero3ModelStatesFiles(const std::string& folder, std::optional<int64_t> dp) {
  std::map<int, std::string> by_rank;
  for (const auto& f : ckpt::ListCheckpointFolder(folder))
    if (f.kind == ckpt::FileKind::kZero3ModelStates) by_rank[f.dp] = f.path;
  const int n = static_cast<int>(dp.value_or(static_cast<int64_t>(by_rank.size())));
  std::vector<TorchFile> out;
  for (int r = 0; r < std::max(n, 1); ++r) {
    auto it = by_rank.find(r);
    if (it == by_rank.end())
      throw FormatError(folder + "/" + ckpt::Zero3ModelStatesFileName(r) +
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

void LoadModule(const std::string& path, const ckpt::ModelStatesView& m, const std::vector<NamedParam>& targets,
                const std::string& zero3_folder = "") {
  c10::NoGradGuard no_grad;
  std::optional<std::vector<TorchFile>> ranks;
  for (const auto& p : targets) {
    auto it = m.module.find(p.name);
    if (it == m.module.end()) throw FormatError(path + ": module has no tensor '" + p.name + "'");
    if (it->second->numel() == 0 && p.tensor.numel() > 0) {
      if (zero3_folder.empty())
        throw FormatError(path + ": '" + p.name + "' is saved partitioned (DeepSpeed's ZeRO-3 module state)");
      if (!ranks) ranks = Zero3ModelStatesFiles(zero3_folder, m.dp_world_size);
      p.tensor.copy_(WholeFrozen(*ranks, p.name, p.tensor.numel()).view(p.tensor.sizes()));
      continue;
    }
    if (it->second->shape != p.tensor.sizes().vec())
      throw FormatError(path + ": '" + p.name + "' has shape " + c10::str(at::IntArrayRef(it->second->shape)) +
                        ", the model needs " + c10::str(p.tensor.sizes()));
    p.tensor.copy_(ToTorch(*it->second).view(p.tensor.sizes()));
  }
}

std::vector<NamedParam> Trainable(const Engine::Impl& e) {
  std::vector<NamedParam> all;
  for (const auto& g : e.groups) all.insert(all.end(), g.begin(), g.end());
  return all;
}

// Stage 0: torch Adam's own state_dict (one state per parameter).
void LoadStage0Optimizer(Engine::Impl& e, const std::string& path, const ckpt::ModelStatesView& m,
                         const LoadCheckpointOptions& o) {
  if (!m.stage0_param_groups) return;
  ApplySavedHparams(e, path, m.stage0_param_groups, o);
  if (m.stage0_state.empty()) return;  // saved before the first step
  int64_t id = 0;
  for (size_t g = 0; g < e.groups.size(); ++g) {
    PartitionState& st = e.zero->state(g);
    st.exp_avg = at::zeros_like(st.master);
    st.exp_avg_sq = at::zeros_like(st.master);
    int64_t off = 0;
    for (const auto& p : e.groups[g]) {
      auto it = m.stage0_state.find(id);
      if (it == m.stage0_state.end())
        throw FormatError(path + ": optimizer state has no entry " + std::to_string(id) + " (" + p.name + ")");
      const int64_t n = p.tensor.numel();
      for (auto [src, dst] : {std::pair{it->second.exp_avg, &st.exp_avg}, {it->second.exp_avg_sq, &st.exp_avg_sq}}) {
        if (src->numel() != n) throw FormatError(path + ": optimizer state of " + p.name + " has the wrong size");
        CopyElements(path, *src, 0, n, dst->narrow(0, off, n));
      }
      st.step = at::full({}, it->second.step, st.master.options());
      off += n;
      ++id;
    }
  }
}

// Sizes on every rank (cheap, and every rank reaches the same verdict); with
// verify_hashes the ranks split the hashing (each file is read once, not once
// per rank) and then agree, so that all of them stop if any file is bad.
void CheckManifestOnEveryRank(Comm& comm, const std::string& folder, bool hashes) {
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
  const int bad = FailingRank(comm, error);
  if (bad < 0) return;
  // Every rank reports the finder's error (it names the files), cut at 4 KiB.
  at::Tensor text = at::zeros({4096}, at::kByte);
  if (comm.rank() == bad) std::memcpy(text.data_ptr(), error.data(), std::min<size_t>(error.size(), 4095));
  comm.Broadcast(text, bad);
  throw FormatError(std::string(static_cast<const char*>(text.data_ptr())));
}

// Universal: each rank reads, from every parameter's files, only the
// elements its own partition holds (memory-mapped), through the reader
// `uckpt convert` and `verify` use.
// This rank's partitions of the fp32 masters, and with `with_state` of
// Adam's moments and step, from a universal folder; then the model from the masters.
void LoadUniversalMasters(Engine::Impl& e, const ckpt::UniversalCheckpoint& u, const std::string& folder,
                          bool with_state) {
  for (size_t g = 0; g < e.groups.size(); ++g) {
    PartitionState& st = e.zero->state(g);
    const int dp = e.zero->layout(g).dp, rank = e.zero->partition_rank();
    // This run's group (a ZeRO-3-made folder's param_shapes hold sub-groups).
    std::vector<ckpt::UniversalParam> params;
    for (const auto& p : e.groups[g]) params.push_back({p.name, p.tensor.sizes().vec(), p.tensor.numel()});
    auto load = [&](const std::string& key) {
      DType dtype = DType::kFloat32;
      std::vector<uint8_t> bytes = ckpt::LoadUniversalPartition(u, params, key, dp, rank, &dtype);
      at::Tensor part = at::from_blob(bytes.data(), {static_cast<int64_t>(bytes.size() / DTypeSize(dtype))},
                                      at::TensorOptions().dtype(ToScalarType(dtype)));
      if (part.numel() != st.master.numel())
        throw FormatError(folder + ": the partition of " + key + " has " + std::to_string(part.numel()) +
                          " elements, this run's has " + std::to_string(st.master.numel()));
      return part.to(st.master.options(), /*non_blocking=*/false, /*copy=*/true);
    };
    st.master.copy_(load("fp32"));
    if (!with_state) {
      st.step = st.exp_avg = st.exp_avg_sq = at::Tensor();
      continue;
    }
    st.exp_avg = load("exp_avg");
    st.exp_avg_sq = load("exp_avg_sq");
    const double step = u.has_step ? ckpt::ReadUniversalStep(u, e.groups[g].front().name)
                                   : static_cast<double>(e.global_steps - e.skipped_steps);
    st.step = at::full({}, step, st.master.options());
  }
  e.zero->GatherModelFromMasters();
}

void LoadUniversalPartitions(Engine::Impl& e, const std::string& folder, const LoadCheckpointOptions& o) {
  const ckpt::UniversalCheckpoint u = ckpt::OpenUniversalCheckpoint(folder, false, /*check_manifest=*/false);
  const ckpt::UniversalOptimizerFile saved = ckpt::ReadUniversalOptimizerState(u);
  static_cast<ckpt::LossScalerState&>(e.zero->loss_scaler()) = ckpt::ReadLossScaler(saved.loss_scaler, e.zero->loss_scaler());
  ApplySavedHparams(e, ckpt::UniversalOptimizerStateFile(folder), saved.param_groups, o);
  // Saved before any applied step (fp16 can skip the first steps): no moments, no step yet.
  // A ZeRO-3-made folder has no step.pt: Adam's step is the applied steps.
  LoadUniversalMasters(e, u, folder, o.load_optimizer_states && (u.has_step || u.zero3));
}

bool HasOptimFiles(const std::string& folder) {
  for (const auto& f : ckpt::ListCheckpointFolder(folder))
    if (f.kind == ckpt::FileKind::kOptimStates) return true;
  return false;
}

// The client's keys: a dict of every top-level key that is not the file's own.
ClientState ClientStateOf(const ckpt::ModelStatesView& m) {
  c10::impl::GenericDict d(c10::StringType::get(), c10::AnyType::get());
  for (const auto& [k, v] : m.client) d.insert(k, ToIValue(v));
  return c10::IValue(d);
}

}  // namespace

void LoadFixedParams(const Engine::Impl& e, const std::string& folder, const std::string& path,
                     const ckpt::ModelStatesView& m) {
  std::vector<NamedParam> fixed = e.frozen;
  fixed.insert(fixed.end(), e.buffers.begin(), e.buffers.end());
  LoadModule(path, m, fixed, folder);
}

LoadResult LoadEngineCheckpoint(Engine::Impl& e, const std::string& dir, const std::string& tag_in,
                                const LoadCheckpointOptions& o) {
  const char* tag_file = ckpt::TagFileName(o.universal);
  if (tag_in.empty() && !fs::exists(dir + "/" + tag_file)) return LoadResult{"", c10::IValue()};
  const std::string tag = tag_in.empty() ? ReadTagFile(dir, tag_file) : ckpt::CheckTag(tag_in, "checkpoint tag");
  const std::string folder = dir + "/" + tag;
  CheckManifestOnEveryRank(*e.comm, folder, o.verify_hashes);
  // A universal folder made from ZeRO-3 holds per-rank model-states copies;
  // so does a ZeRO-3 folder, whose trainable weights then come from the masters.
  const std::string model_path = ModelStatesPath(folder, e.comm->rank(), o.universal);
  const bool stage12_file = model_path == folder + "/" + ckpt::ModelStatesFileName();
  const bool zero3_source = !o.universal && !stage12_file;
  TorchFile model_file = LoadTorchFile(model_path);
  const ckpt::ModelStatesView m = ckpt::ReadModelStates(model_file.root, model_path);
  if (stage12_file) CheckParamShapes(e, model_path, model_file.root);
  c10::NoGradGuard no_grad;
  const int stage = e.stage();
  LoadResult result{folder, ClientStateOf(m)};
  // Frozen parameters and buffers always come from the module state (also
  // from a universal checkpoint's copy of it, which DeepSpeed leaves out).
  LoadFixedParams(e, folder, model_path, m);
  if (o.load_module_only) {
    // A ZeRO-3 module state (of a ZeRO-3 folder or its universal conversion)
    // holds no trainable weights: they come from the masters.
    if (stage12_file) {
      LoadModule(model_path, m, Trainable(e));
    } else if (o.universal) {
      LoadUniversalMasters(e, ckpt::OpenUniversalCheckpoint(folder, false, /*check_manifest=*/false), folder,
                           /*with_state=*/false);
    } else {
      LoadReshardedPartitions(e, folder, /*optimizer_states=*/false);
      e.zero->GatherModelFromMasters();
    }
    e.zero->InitMasterFromModel();
    return result;
  }
  RestoreCounters(e, m, o);
  if (o.universal) {
    LoadUniversalPartitions(e, folder, o);
    return result;
  }
  // A stage-0 run resumes a ZeRO 1/2 folder (rank files, no torch optimizer
  // state in the model states) from the rank files too.
  const bool stage12_source = stage12_file && !m.stage0_param_groups && HasOptimFiles(folder);
  if ((stage > 0 && o.load_optimizer_states) || zero3_source || (o.load_optimizer_states && stage12_source)) {
    // Each rank reads its partition from the rank files, at any world size
    // (resharded_load.h): at the saving world size, its own file's ranges.
    ReshardedLoad r = LoadReshardedPartitions(e, folder, o.load_optimizer_states);
    static_cast<ckpt::LossScalerState&>(e.zero->loss_scaler()) = ckpt::ReadLossScaler(r.loss_scaler, e.zero->loss_scaler());
    ApplySavedHparams(e, r.where, r.param_groups, o);
    e.zero->GatherModelFromMasters();
    e.last_load.optimizer_bytes_read = r.bytes_read;
    return result;
  }
  LoadModule(model_path, m, Trainable(e));
  e.zero->InitMasterFromModel();
  if (stage == 0 && o.load_optimizer_states) LoadStage0Optimizer(e, model_path, m, o);
  return result;
}

}  // namespace uckpt::engine
