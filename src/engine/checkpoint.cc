// Trainer::SaveCheckpoint / LoadCheckpoint: DeepSpeed's files, written from
// and read into the flat ZeRO buffers.
#include "engine/checkpoint.h"

#include <c10/core/GradMode.h>
#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>

#include "ckpt/manifest.h"
#include "format/env.h"
#include "format/error.h"
#include "format/file.h"
#include "format/torch_file.h"
#include "engine/torch_bridge.h"
#include "engine/trainer.h"
#include "engine/weights.h"

namespace uckpt::engine {
namespace fs = std::filesystem;

// ---- Small value builders and readers. ----
namespace {

ValuePtr Set() {
  auto v = std::make_shared<Value>();
  v->kind = Kind::kSet;
  return v;
}

ValuePtr Dict(std::initializer_list<std::pair<const char*, ValuePtr>> items, bool ordered = false) {
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

std::shared_ptr<Storage> StorageOf(const at::Tensor& t) {
  at::Tensor c = t.detach().to(at::kCPU).contiguous();
  std::vector<uint8_t> bytes(c.nbytes());
  if (!bytes.empty()) std::memcpy(bytes.data(), c.data_ptr(), bytes.size());
  return Storage::Owned(std::move(bytes), FromScalarType(c.scalar_type()));
}

ValuePtr TensorValue(const at::Tensor& t, bool requires_grad = false) {
  auto s = StorageOf(t);
  return View(s, FromScalarType(t.scalar_type()), t.sizes().vec(), 0, requires_grad);
}

// Readers that name the file in their errors.
class Reader {
 public:
  explicit Reader(std::string path) : path_(std::move(path)) {}
  ValuePtr Get(const ValuePtr& dict, const std::string& key, bool required = true) const {
    ValuePtr v = dict && dict->is_dict() ? dict->get(key) : nullptr;
    if (!v && required) throw FormatError(path_ + ": missing key '" + key + "'");
    return v;
  }
  int64_t Int(const ValuePtr& dict, const std::string& key) const {
    ValuePtr v = Get(dict, key);
    if (v->kind != Kind::kInt || !v->big.empty()) throw FormatError(path_ + ": '" + key + "' is not an int");
    return v->i;
  }
  double Number(const ValuePtr& v, const std::string& what) const {
    if (v && v->kind == Kind::kFloat) return v->f;
    if (v && v->kind == Kind::kInt && v->big.empty()) return static_cast<double>(v->i);
    throw FormatError(path_ + ": " + what + " is not a number");
  }
  const Tensor& TensorAt(const ValuePtr& v, const std::string& what) const {
    if (!v || !v->tensor || (v->kind != Kind::kTensor && v->kind != Kind::kParameter))
      throw FormatError(path_ + ": " + what + " is not a tensor");
    return *v->tensor;
  }
  ValuePtr Item(const ValuePtr& seq, size_t k, const std::string& what) const {
    if (!seq || (!seq->is_seq()) || seq->items.size() <= k)
      throw FormatError(path_ + ": " + what + " is not a list with an item " + std::to_string(k));
    return seq->items[k];
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// Module prefixes of GPT2LMHeadModel in traversal order (state_dict _metadata).
std::vector<std::string> ModulePrefixes(const Gpt2Config& cfg) {
  std::vector<std::string> m = {"", "transformer", "transformer.wte", "transformer.wpe", "transformer.h"};
  for (int64_t i = 0; i < cfg.n_layer; ++i) {
    std::string h = "transformer.h." + std::to_string(i);
    for (const char* s : {"", ".ln_1", ".attn", ".attn.c_attn", ".attn.c_proj", ".ln_2", ".mlp", ".mlp.c_fc",
                          ".mlp.c_proj"})
      m.push_back(h + s);
  }
  m.push_back("transformer.ln_f");
  m.push_back("lm_head");
  return m;
}

ValuePtr ParamGroupValue(const OptimizerConfig& o, double lr) {
  ValuePtr g = Value::Dict();
  g->set("lr", Value::Float(lr));
  g->set("betas", Value::List({Value::Float(o.beta1), Value::Float(o.beta2)}));
  g->set("eps", Value::Float(o.eps));
  g->set("weight_decay", Value::Float(o.weight_decay));
  g->set("amsgrad", Value::Bool(false));
  g->set("foreach", Value::None());
  g->set("maximize", Value::Bool(false));
  g->set("capturable", Value::Bool(false));
  g->set("params", Value::List({Value::Int(0)}));
  return g;
}

ValuePtr LossScalerValue(const LossScaler& s) {
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

void ReadLossScaler(const Reader& r, const ValuePtr& v, LossScaler& s) {
  if (!v || v->kind != Kind::kObject || !v->state || !v->state->is_dict()) return;
  const ValuePtr& st = v->state;
  if (auto x = st->get("cur_scale")) s.cur_scale = r.Number(x, "loss_scaler.cur_scale");
  if (auto x = st->get("dynamic"); x && x->kind == Kind::kBool) s.dynamic = x->b;
  auto geti = [&](const char* k, int64_t& out) {
    if (auto x = st->get(k); x && x->kind == Kind::kInt) out = x->i;
  };
  auto getb = [&](const char* k, bool& out) {
    if (auto x = st->get(k); x && x->kind == Kind::kBool) out = x->b;
  };
  geti("cur_iter", s.cur_iter);
  geti("last_overflow_iter", s.last_overflow_iter);
  geti("scale_window", s.scale_window);
  geti("delayed_shift", s.delayed_shift);
  geti("cur_hysteresis", s.cur_hysteresis);
  getb("consecutive_hysteresis", s.consecutive_hysteresis);
  getb("raise_error_at_min_scale", s.raise_error_at_min_scale);
  if (auto x = st->get("scale_factor")) s.scale_factor = r.Number(x, "loss_scaler.scale_factor");
  if (auto x = st->get("min_scale")) s.min_scale = r.Number(x, "loss_scaler.min_scale");
}

// Copies `n` elements of a tensor stored in a file, starting at flat element
// `first`, into `dst` (fp32). Touches only those bytes of a mapped file.
void CopyElements(const Reader& r, const Tensor& src, int64_t first, int64_t n, at::Tensor dst) {
  if (first < 0 || first + n > src.numel())
    throw FormatError(r.path() + ": tensor has " + std::to_string(src.numel()) + " elements, need [" +
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

}  // namespace

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

std::string ReadTagFile(const std::string& dir, const std::string& name) {
  const std::string path = dir + "/" + name;
  std::ifstream in(path);
  if (!in) throw FormatError(path + ": cannot read the tag file (give the tag explicitly, or check the folder)");
  std::string tag((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  auto strip = [](char c) { return c == ' ' || c == '\n' || c == '\r' || c == '\t'; };
  while (!tag.empty() && strip(tag.back())) tag.pop_back();
  while (!tag.empty() && strip(tag.front())) tag.erase(tag.begin());
  if (tag.empty() || tag.find('/') != std::string::npos || tag == "." || tag == "..")
    throw FormatError(path + ": does not hold a valid tag");
  return tag;
}

std::string ModelStatesName() { return "mp_rank_00_model_states.pt"; }

std::string OptimStatesName(int dp_rank, bool bf16) {
  return std::string(bf16 ? "bf16_" : "") + "zero_pp_rank_" + std::to_string(dp_rank) + "_mp_rank_00_optim_states.pt";
}

// ---- Saving. ----

namespace {

ValuePtr ModelStatesValue(const Trainer& t) {
  const TrainOptions& o = t.options();
  const ZeroOptimizer& z = t.optimizer();
  const int stage = z.settings().stage;
  const DType dt = FromScalarType(z.model_flat().scalar_type());
  // One storage for the whole flat buffer; every parameter is a view into it,
  // as DeepSpeed's state_dict of flat-buffer views saves it.
  auto flat = StorageOf(z.model_flat());
  ValuePtr module = Value::Dict(/*ordered=*/true);
  ValuePtr shapes = Value::Dict(/*ordered=*/true);
  int64_t off = 0;
  for (const auto& [name, p] : t.parameters()) {
    module->set(name, View(flat, dt, p.sizes().vec(), off));
    shapes->set(name, Value::Size(p.sizes().vec()));
    off += p.numel();
  }
  module->set("lm_head.weight", View(flat, dt, t.parameters().front().tensor.sizes().vec(), 0));
  ValuePtr metadata = Value::Dict(/*ordered=*/true);
  for (const auto& m : ModulePrefixes(o.model)) metadata->set(m, Dict({{"version", Value::Int(1)}}));
  module->state = Dict({{"_metadata", metadata}});

  const Counters& c = t.counters();
  ValuePtr d = Value::Dict();
  d->set("module", module);
  d->set("buffer_names", Value::List());
  ValuePtr optimizer = Value::None();
  if (stage == 0) {
    // Plain torch AdamW state_dict: one state per parameter (views of the flat state).
    const PartitionState& s = z.state();
    ValuePtr state = Value::Dict();
    ValuePtr ids = Value::List();
    if (s.step.defined()) {
      auto avg = StorageOf(s.exp_avg), sq = StorageOf(s.exp_avg_sq);
      int64_t k = 0, at = 0;
      for (const auto& [name, p] : t.parameters()) {
        state->set(Value::Int(k), Dict({{"step", TensorValue(s.step)},
                                        {"exp_avg", View(avg, DType::kFloat32, p.sizes().vec(), at)},
                                        {"exp_avg_sq", View(sq, DType::kFloat32, p.sizes().vec(), at)}}));
        at += p.numel();
        ++k;
      }
    }
    ValuePtr group = ParamGroupValue(t.optimizer().settings().optimizer, t.schedule().current_lr());
    for (size_t k = 0; k < t.parameters().size(); ++k) ids->items.push_back(Value::Int(static_cast<int64_t>(k)));
    group->set("params", ids);
    optimizer = Dict({{"state", state}, {"param_groups", Value::List({group})}});
  }
  d->set("optimizer", optimizer);
  d->set("param_shapes", stage == 0 ? Value::None() : Value::List({shapes}));
  d->set("frozen_param_shapes", stage == 2 ? Value::Dict(true) : Value::None());
  d->set("shared_params",
         stage == 0 ? Value::None() : Dict({{"lm_head.weight", Value::Str("transformer.wte.weight")}}));
  d->set("frozen_param_fragments", stage == 2 ? Value::Dict(true) : Value::None());
  const LrSchedule& sched = t.schedule();
  d->set("lr_scheduler", o.config.scheduler.type.empty()
                             ? Value::None()
                             : Dict({{"last_batch_iteration", Value::Int(sched.last_batch_iteration())}}));
  d->set("data_sampler", Value::None());
  d->set("random_ltd", Value::None());
  d->set("sparse_tensor_module_names", Set());
  d->set("skipped_steps", Value::Int(c.skipped_steps));
  d->set("global_steps", Value::Int(c.global_steps));
  d->set("global_samples", Value::Int(c.global_samples));
  d->set("dp_world_size", Value::Int(t.comm().world_size()));
  d->set("mp_world_size", Value::Int(1));
  d->set("ds_config", JsonToValue(o.config.raw));
  d->set("ds_version", Value::Str(kDeepSpeedVersion));
  // Client state: what DeepSpeed's converter needs, the iteration, and ours.
  d->set("universal_checkpoint_info", Dict({{"universal_checkpoint_version", Value::Float(0.2)}}));
  d->set("iteration", Value::Int(c.global_steps));
  d->set("uckpt", Dict({{"data_samples", Value::Int(c.global_samples)},
                        {"data_seed", Value::Int(static_cast<int64_t>(o.seed))},
                        {"train_batch_size", Value::Int(t.batch().train_batch_size)},
                        {"lr", Value::Float(sched.current_lr())}}));
  return d;
}

ValuePtr OptimStatesValue(const Trainer& t) {
  const TrainOptions& o = t.options();
  const ZeroOptimizer& z = t.optimizer();
  const int stage = z.settings().stage;
  const int rank = z.partition_rank();
  const auto& layout = z.layout();
  const PartitionState& s = z.state();

  ValuePtr state = Value::Dict();
  if (s.step.defined())
    state->set(Value::Int(0), Dict({{"step", TensorValue(s.step)},
                                    {"exp_avg", TensorValue(s.exp_avg)},
                                    {"exp_avg_sq", TensorValue(s.exp_avg_sq)}}));
  const double lr = t.schedule().current_lr();
  ValuePtr base = Dict({{"state", state}, {"param_groups", Value::List({ParamGroupValue(z.settings().optimizer, lr)})}});

  // The lean fp32 partition: a view of the padded one, padding cut off.
  const int64_t pad = layout.padding(rank);
  auto master = StorageOf(s.master);
  ValuePtr lean = View(master, DType::kFloat32, {layout.partition_size - pad}, 0, /*requires_grad=*/true);

  ValuePtr mappings = Value::Dict(/*ordered=*/true);
  for (const auto& f : ckpt::RankFragments(z.numels(), layout.dp, rank))
    mappings->set(t.parameters()[f.param].name,
                  NewObject("deepspeed.utils.tensor_fragment.fragment_address",
                            Dict({{"numel", Value::Int(f.numel)}, {"start", Value::Int(f.partition_offset)}})));

  ValuePtr zero_stage = Value::Object(
      "builtins.getattr",
      Value::Tuple({Value::Global("deepspeed.runtime.zero.config", "ZeroStageEnum"),
                    Value::Str(stage == 1 ? "optimizer_states" : "gradients")}),
      /*newobj=*/false);
  ValuePtr osd = Value::Dict();
  osd->set("loss_scaler", LossScalerValue(z.loss_scaler()));
  osd->set("dynamic_loss_scale", Value::Bool(z.loss_scaler().dynamic));
  osd->set("overflow", Value::Bool(false));
  osd->set("clip_grad", Value::Float(o.config.gradient_clipping));
  osd->set("base_optimizer_state", base);
  osd->set("single_partition_of_fp32_groups", Value::List({lean}));
  osd->set("zero_stage", zero_stage);
  osd->set("group_paddings", Value::List({Value::Int(pad)}));
  osd->set("partition_count", Value::List({Value::Int(layout.dp)}));
  osd->set("ds_version", Value::Str(kDeepSpeedVersion));
  osd->set("param_slice_mappings", Value::List({mappings}));
  return Dict({{"optimizer_state_dict", osd},
               {"ds_config", JsonToValue(o.config.raw)},
               {"ds_version", Value::Str(kDeepSpeedVersion)}});
}

}  // namespace

namespace {

// The highest rank whose `error` is not empty, or -1 when every rank
// succeeded: one all-reduce, called by every rank.
int FailingRank(Comm& comm, const std::string& error) {
  at::Tensor failed = at::full({1}, error.empty() ? -1.0f : static_cast<float>(comm.rank()), at::kFloat);
  comm.AllReduceMax(failed);
  return static_cast<int>(failed.item<float>());
}

// Every rank's verdict on a phase of the save: throws on every rank if any
// failed (the failing rank with its own error), so no rank goes on to publish
// a checkpoint that another rank could not write.
void AgreeOrThrow(Comm& comm, const std::string& folder, const std::string& error) {
  const int bad = FailingRank(comm, error);
  if (bad < 0) return;
  if (!error.empty()) throw IoError("checkpoint " + folder + " not saved: " + error);
  throw IoError("checkpoint " + folder + " not saved: rank " + std::to_string(bad) + " could not write its part");
}

}  // namespace

// Crash-safe save (docs/reliability.md): every rank writes into one temporary
// folder beside the tag, each file fsynced; only when every rank succeeded
// does rank 0 add the manifest, fsync the folder, rename it to the tag and
// then replace `latest` atomically. A crash or error at any point leaves the
// previous checkpoint and `latest` as they were.
void Trainer::SaveCheckpoint(const std::string& dir, const std::string& tag) {
  if (tag.empty() || tag.find('/') != std::string::npos || tag == "." || tag == "..")
    throw std::invalid_argument("bad checkpoint tag '" + tag + "'");
  if (zero_->settings().stage == 0 && zero_->settings().model_dtype != at::kFloat)
    throw std::invalid_argument("checkpoints of fp16/bf16 training need ZeRO stage 1 or 2");
  Env& env = Env::Current();
  const bool rank0 = comm_.rank() == 0;
  const std::string folder = dir + "/" + tag;
  const std::string tmp = dir + "/." + tag + ".uckpt-tmp";  // the same name on every rank
  auto cleanup = [&] {
    try {
      env.RemoveAll(tmp);
    } catch (const std::exception&) {
      // The first error is the one to report.
    }
  };
  std::string error;
  // 1. Rank 0 makes a fresh temporary folder (one a killed save left is removed).
  if (rank0) {
    try {
      env.CreateDirs(dir);
      env.RemoveAll(tmp);
      env.CreateDirs(tmp);
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  AgreeOrThrow(comm_, folder, error);
  // 2. Every rank writes its files into it (each fsynced before its rename).
  try {
    if (zero_->settings().stage > 0)
      SaveTorchFile(tmp + "/" + OptimStatesName(comm_.rank(), opt_.config.bf16), OptimStatesValue(*this));
    if (rank0) SaveTorchFile(tmp + "/" + ModelStatesName(), ModelStatesValue(*this));
  } catch (const std::exception& e) {
    error = e.what();
  }
  try {
    AgreeOrThrow(comm_, folder, error);
  } catch (...) {
    if (rank0) cleanup();
    throw;
  }
  // 3. Rank 0 publishes: manifest, folder durable, renamed to the tag (an old
  // folder of that tag swapped out atomically where the filesystem can), then
  // `latest`.
  if (rank0) {
    try {
      ckpt::WriteManifest(tmp);  // durable: its commit fsyncs `tmp` too
      ReplaceFolder(env, tmp, folder);  // an old folder of that tag swapped out
      env.SyncDir(dir);
      AtomicFile latest(dir + "/latest");
      latest.Write(tag);
      latest.Commit();
    } catch (const std::exception& e) {
      error = e.what();
      cleanup();
    }
  }
  AgreeOrThrow(comm_, folder, error);
}

// ---- Loading. ----

namespace {

// The model-states keys both load paths restore.
void RestoreCounters(Trainer& t, const Reader& r, const ValuePtr& root) {
  Counters& c = t.counters();
  c.global_steps = r.Int(root, "global_steps");
  c.skipped_steps = r.Get(root, "skipped_steps", false) ? r.Int(root, "skipped_steps") : 0;
  c.global_samples = r.Get(root, "global_samples", false) ? r.Int(root, "global_samples")
                                                          : c.global_steps * t.batch().train_batch_size;
  if (auto u = r.Get(root, "uckpt", false); u && u->is_dict() && u->get("data_samples"))
    c.global_samples = r.Int(u, "data_samples");
  if (c.global_steps < 0 || c.global_samples < 0) throw FormatError(r.path() + ": negative step counters");
  ValuePtr sched = r.Get(root, "lr_scheduler", false);
  if (sched && sched->is_dict() && sched->get("last_batch_iteration")) {
    t.schedule().Restore(r.Int(sched, "last_batch_iteration"));
  } else if (c.global_steps > 0 && !t.options().config.scheduler.type.empty()) {
    // No saved scheduler: continue the schedule where the step count says.
    t.schedule().Restore(c.global_steps - 1 - c.skipped_steps);
  }
}

// The saved param group's hyper-parameters, kept only on request (as
// DeepSpeed's torch optimizer load_state_dict keeps them): lr for the next
// step (a configured scheduler sets the lr again from its own config and the
// restored position after that step, as DeepSpeed's does), and betas, eps and
// weight_decay for the rest of the run.
void ApplySavedHparams(Trainer& t, const Reader& r, const ValuePtr& group) {
  if (!t.options().keep_saved_hparams || !group || !group->is_dict()) return;
  if (auto lr = group->get("lr")) t.schedule().set_current_lr(r.Number(lr, "param_groups[0].lr"));
  OptimizerConfig o = t.optimizer().settings().optimizer;
  if (auto betas = group->get("betas")) {
    if (!betas->is_seq() || betas->items.size() != 2)
      throw FormatError(r.path() + ": param_groups[0].betas is not a pair");
    o.beta1 = r.Number(betas->items[0], "param_groups[0].betas[0]");
    o.beta2 = r.Number(betas->items[1], "param_groups[0].betas[1]");
  }
  if (auto eps = group->get("eps")) o.eps = r.Number(eps, "param_groups[0].eps");
  if (auto wd = group->get("weight_decay")) o.weight_decay = r.Number(wd, "param_groups[0].weight_decay");
  t.optimizer().set_optimizer_config(o);
}

void CheckParamShapes(const Trainer& t, const Reader& r, const ValuePtr& root) {
  ValuePtr shapes = r.Get(root, "param_shapes", false);
  if (!shapes || shapes->kind == Kind::kNone) return;
  ValuePtr g = r.Item(shapes, 0, "param_shapes");
  if (!g->is_dict() || shapes->items.size() != 1)
    throw FormatError(r.path() + ": param_shapes must hold one parameter group (uckpt trains one)");
  const auto& params = t.parameters();
  if (g->entries.size() != params.size())
    throw FormatError(r.path() + ": has " + std::to_string(g->entries.size()) + " parameters, this model has " +
                      std::to_string(params.size()) + " (different --n_layer/--n_embd/...?)");
  for (size_t k = 0; k < params.size(); ++k) {
    const auto& [key, val] = g->entries[k];
    std::vector<int64_t> shape;
    if (val && (val->kind == Kind::kTorchSize || val->is_seq()))
      for (const auto& d : val->items) shape.push_back(d->i);
    if (key->kind != Kind::kStr || key->s != params[k].name || shape != params[k].tensor.sizes().vec())
      throw FormatError(r.path() + ": parameter " + std::to_string(k) + " is " +
                        (key->kind == Kind::kStr ? key->s : "?") + " " + c10::str(at::IntArrayRef(shape)) +
                        ", this model has " + params[k].name + " " + c10::str(params[k].tensor.sizes()));
  }
}

std::vector<NamedTensor> ModuleStateDict(const Reader& r, const ValuePtr& root) {
  ValuePtr module = r.Get(root, "module");
  if (!module->is_dict()) throw FormatError(r.path() + ": 'module' is not a state dict");
  std::vector<NamedTensor> sd;
  for (const auto& [k, v] : module->entries)
    if (k->kind == Kind::kStr && v && v->tensor) sd.push_back({k->s, ToTorch(*v->tensor)});
  return sd;
}

// Stage 0: torch AdamW's own state_dict (one state per parameter) in 'optimizer'.
void LoadStage0Optimizer(Trainer& t, const Reader& r, const ValuePtr& root) {
  ValuePtr opt = r.Get(root, "optimizer", false);
  if (!opt || !opt->is_dict()) return;
  ValuePtr states = r.Get(opt, "state");
  PartitionState& st = t.optimizer().state();
  const auto& params = t.parameters();
  if (states->entries.empty()) return;
  if (states->entries.size() != params.size())
    throw FormatError(r.path() + ": optimizer state has " + std::to_string(states->entries.size()) +
                      " parameters, the model " + std::to_string(params.size()));
  st.exp_avg = at::zeros_like(st.master);
  st.exp_avg_sq = at::zeros_like(st.master);
  int64_t off = 0;
  for (size_t k = 0; k < params.size(); ++k) {
    const ValuePtr& s = states->entries[k].second;
    const int64_t n = params[k].tensor.numel();
    for (auto [key, dst] : {std::pair<const char*, at::Tensor*>{"exp_avg", &st.exp_avg}, {"exp_avg_sq", &st.exp_avg_sq}}) {
      const Tensor& src = r.TensorAt(r.Get(s, key), std::string("optimizer state ") + key);
      if (src.numel() != n) throw FormatError(r.path() + ": optimizer state of " + params[k].name + " has the wrong size");
      CopyElements(r, src, 0, n, dst->narrow(0, off, n));
    }
    if (k == 0) {
      ValuePtr step = r.Get(s, "step");
      st.step = at::full({}, step->tensor ? ToTorch(*step->tensor).item<double>() : r.Number(step, "step"),
                         st.master.options());
    }
    off += n;
  }
  ApplySavedHparams(t, r, r.Item(r.Get(opt, "param_groups"), 0, "param_groups"));
}

// Sizes on every rank (cheap, and every rank reaches the same verdict); with
// --verify the ranks split the hashing (each file is read once, not once per
// rank) and then agree, so that all of them stop if any file is bad.
void CheckManifestOnEveryRank(Comm& comm, const std::string& folder, bool hashes) {
  if (!hashes) {
    ckpt::CheckFolderAgainstManifest(folder, false);
    return;
  }
  std::string error;
  try {
    ckpt::CheckFolderAgainstManifest(folder, true, comm.rank(), comm.world_size());
  } catch (const FormatError& e) {
    error = e.what();
  }
  const int bad = FailingRank(comm, error);
  if (bad < 0) return;
  // Every rank reports the finder's error (it names the files), cut at 4 KiB.
  at::Tensor text = at::zeros({4096}, at::kByte);
  if (comm.rank() == bad) std::memcpy(text.data_ptr(), error.data(), std::min<size_t>(error.size(), 4095));
  comm.Broadcast(text, bad);
  throw FormatError(std::string(static_cast<const char*>(text.data_ptr())));
}

}  // namespace

void Trainer::LoadCheckpoint(const std::string& dir, const std::string& tag_in, bool universal) {
  const std::string tag = tag_in.empty() ? ReadTagFile(dir, universal ? "latest_universal" : "latest") : tag_in;
  const std::string folder = dir + "/" + tag;
  CheckManifestOnEveryRank(comm_, folder, opt_.verify_checkpoint);
  const std::string model_path = folder + "/" + ModelStatesName();
  Reader mr(model_path);
  TorchFile model_file = LoadTorchFile(model_path);
  const ValuePtr& root = model_file.root;
  if (!root || !root->is_dict()) throw FormatError(model_path + ": is not a DeepSpeed model-states dict");
  CheckParamShapes(*this, mr, root);
  const int stage = zero_->settings().stage;
  PartitionState& st = zero_->state();
  const int rank = zero_->partition_rank();
  const auto& layout = zero_->layout();
  c10::NoGradGuard no_grad;

  if (!universal) {
    const int64_t saved_dp = mr.Int(root, "dp_world_size");
    if (stage > 0 && saved_dp != comm_.world_size())
      throw FormatError(folder + ": saved at data-parallel world size " + std::to_string(saved_dp) + ", this run has " +
                        std::to_string(comm_.world_size()) +
                        ". ZeRO partitions only load at the same size; convert it with `uckpt convert " + folder +
                        " " + folder + "_universal` and resume with --universal_checkpoint");
    RestoreCounters(*this, mr, root);
    bool from_module = !opt_.load_optimizer_states || stage == 0;
    if (stage > 0 && opt_.load_optimizer_states) {
      const std::string path = folder + "/" + OptimStatesName(comm_.rank(), opt_.config.bf16);
      Reader r(path);
      TorchFile f = LoadTorchFile(path);
      ValuePtr osd = r.Get(f.root, "optimizer_state_dict");
      if (auto pc = r.Get(osd, "partition_count", false)) {
        ValuePtr n = r.Item(pc, 0, "partition_count");
        if (n->kind != Kind::kInt || n->i != layout.dp)
          throw FormatError(path + ": partition_count is not " + std::to_string(layout.dp));
      }
      ReadLossScaler(r, r.Get(osd, "loss_scaler", false), zero_->loss_scaler());
      ValuePtr base = r.Get(osd, "base_optimizer_state");
      ValuePtr state0 = r.Get(r.Get(base, "state"), "0", false);
      if (!state0) {
        ValuePtr states = r.Get(base, "state");
        for (const auto& [k, v] : states->entries)
          if (k->kind == Kind::kInt && k->i == 0) state0 = v;
      }
      if (state0) {
        auto load = [&](const char* key, at::Tensor& dst) {
          const Tensor& src = r.TensorAt(r.Get(state0, key), std::string("state[0].") + key);
          if (src.numel() != layout.partition_size)
            throw FormatError(path + ": state[0]." + key + " has " + std::to_string(src.numel()) +
                              " elements, the partition has " + std::to_string(layout.partition_size));
          dst = at::zeros({layout.partition_size}, st.master.options());
          CopyElements(r, src, 0, src.numel(), dst);
        };
        load("exp_avg", st.exp_avg);
        load("exp_avg_sq", st.exp_avg_sq);
        ValuePtr step = r.Get(state0, "step");
        st.step = at::full({}, step->tensor ? ToTorch(*step->tensor).item<double>() : r.Number(step, "step"),
                           st.master.options());
      }
      ApplySavedHparams(*this, r, r.Item(r.Get(base, "param_groups"), 0, "param_groups"));
      const Tensor& fp32 = r.TensorAt(r.Item(r.Get(osd, "single_partition_of_fp32_groups"), 0,
                                             "single_partition_of_fp32_groups"),
                                      "single_partition_of_fp32_groups[0]");
      if (fp32.numel() > layout.partition_size)
        throw FormatError(path + ": fp32 partition larger than this run's partition");
      st.master.zero_();
      CopyElements(r, fp32, 0, fp32.numel(), st.master.narrow(0, 0, fp32.numel()));
      zero_->GatherModelFromMasters();
    }
    if (from_module) {
      CopyStateDict(ModuleStateDict(mr, root), params_, model_path);
      zero_->InitMasterFromModel();
      if (stage == 0 && opt_.load_optimizer_states) LoadStage0Optimizer(*this, mr, root);
    }
    return;
  }

  // Universal: each rank reads, from every parameter's files, only the
  // elements its own partition holds (memory-mapped).
  RestoreCounters(*this, mr, root);
  const std::string zero_dir = folder + "/zero";
  {
    const std::string path = zero_dir + "/optimizer_state.pt";
    Reader r(path);
    TorchFile f = LoadTorchFile(path);
    ReadLossScaler(r, r.Get(f.root, "loss_scaler", false), zero_->loss_scaler());
    if (auto groups = r.Get(f.root, "param_groups", false)) ApplySavedHparams(*this, r, r.Item(groups, 0, "param_groups"));
  }
  const bool with_state = opt_.load_optimizer_states;
  st.master.zero_();
  if (with_state) {
    st.exp_avg = at::zeros_like(st.master);
    st.exp_avg_sq = at::zeros_like(st.master);
  }
  std::optional<double> step;
  for (const auto& f : ckpt::RankFragments(zero_->numels(), layout.dp, rank)) {
    const std::string& name = params_[f.param].name;
    const std::string pdir = zero_dir + "/" + name;
    auto copy = [&](const char* key, const at::Tensor& dst) {
      const std::string path = pdir + "/" + key + ".pt";
      Reader r(path);
      TorchFile tf = LoadTorchFile(path);
      ValuePtr v = tf.root && tf.root->is_dict() ? r.Get(tf.root, "param") : tf.root;
      const Tensor& src = r.TensorAt(v, "'param'");
      if (src.numel() != zero_->numels()[f.param])
        throw FormatError(path + ": has " + std::to_string(src.numel()) + " elements, " + name + " has " +
                          std::to_string(zero_->numels()[f.param]));
      CopyElements(r, src, f.param_offset, f.numel, dst.narrow(0, f.partition_offset, f.numel));
    };
    copy("fp32", st.master);
    if (!with_state) continue;
    // Saved before any applied step (fp16 can skip the first steps): no moments, no step yet.
    const std::string step_path = pdir + "/step.pt";
    const bool has_step = fs::exists(step_path);
    if (!has_step && !fs::exists(pdir + "/exp_avg.pt")) continue;
    copy("exp_avg", st.exp_avg);
    copy("exp_avg_sq", st.exp_avg_sq);
    if (has_step) {
      Reader r(step_path);
      TorchFile tf = LoadTorchFile(step_path);
      double s = tf.root && tf.root->tensor ? ToTorch(*tf.root->tensor).item<double>() : r.Number(tf.root, "step");
      if (step && *step != s) throw FormatError(step_path + ": step " + std::to_string(s) + " differs from other parameters'");
      step = s;
    }
  }
  if (with_state) {
    // Every rank needs the step even if its partition is all padding.
    at::Tensor s = at::full({1}, step ? *step : -1.0, at::kDouble);
    comm_.AllReduceMax(s);
    if (s.item<double>() >= 0) {
      st.step = at::full({}, s.item<double>(), st.master.options());
    } else {
      st.step = at::Tensor();
      st.exp_avg = st.exp_avg_sq = at::Tensor();
    }
  }
  zero_->GatherModelFromMasters();
}

}  // namespace uckpt::engine
