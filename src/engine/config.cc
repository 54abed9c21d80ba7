#include "engine/config.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <fstream>
#include <set>
#include <sstream>

namespace uckpt::engine {
namespace {

// One JSON object of the config: typed getters, and a list of the keys that
// were not understood (for the warnings).
class Section {
 public:
  Section(const nlohmann::json& j, std::string where, const std::string& source, std::vector<std::string>* warnings,
          bool drop_auto = false)
      : j_(j), where_(std::move(where)), source_(source), warnings_(warnings), drop_auto_(drop_auto) {
    if (!j_.is_object()) Fail("", "an object", j_);
  }
  ~Section() {
    for (auto& [k, v] : j_.items())
      if (!seen_.count(k)) warnings_->push_back(source_ + ": unknown key '" + Path(k) + "' ignored");
  }

  // Whether the key is there at all, null included (Has() takes a null for absent).
  bool Contains(const std::string& k) {
    seen_.insert(k);
    return j_.contains(k);
  }
  bool Has(const std::string& k) {
    seen_.insert(k);
    if (drop_auto_ && j_.contains(k) && j_[k] == "auto") return false;
    return j_.contains(k) && !j_[k].is_null();
  }
  // DeepSpeed 0.14.5's pydantic sections (DeepSpeedConfigModel: zero_optimization and its offload sections)
  // drop "auto" values and take the default: configs Hugging Face leaves unresolved (TRL's reference model).
  void DropAuto() { drop_auto_ = true; }
  // Keys DeepSpeed knows that change nothing here.
  void Ignore(std::initializer_list<const char*> keys) {
    for (const char* k : keys) seen_.insert(k);
  }
  void Int(const std::string& k, int64_t& out) {
    if (!Has(k)) return;
    const auto& v = j_[k];
    if (v.is_number_integer()) {
      out = v.get<int64_t>();
    } else if (v.is_number_float() && std::isfinite(v.get<double>()) &&
               v.get<double>() == std::floor(v.get<double>()) && std::fabs(v.get<double>()) < 9e18) {
      out = static_cast<int64_t>(v.get<double>());  // 5e8 written as a float
    } else {
      Fail(k, "an integer", v);
    }
  }
  void Int(const std::string& k, std::optional<int64_t>& out) {
    if (!Has(k)) return;
    int64_t x = 0;
    Int(k, x);
    out = x;
  }
  void Int(const std::string& k, int& out) {
    int64_t x = out;
    Int(k, x);
    out = static_cast<int>(x);
  }
  // NaN or inf (possible in a Python dict) is refused: no such key takes one in a meaningful way.
  void Double(const std::string& k, double& out) {
    if (!Has(k)) return;
    if (!j_[k].is_number() || !std::isfinite(j_[k].get<double>())) Fail(k, "a finite number", j_[k]);
    out = j_[k].get<double>();
  }
  // The raw value, for the keys that read a non-finite number themselves.
  const nlohmann::json& Raw(const std::string& k) { return j_[k]; }
  void Bool(const std::string& k, bool& out) {
    if (!Has(k)) return;
    if (!j_[k].is_boolean()) Fail(k, "true or false", j_[k]);
    out = j_[k].get<bool>();
  }
  void String(const std::string& k, std::string& out) {
    if (!Has(k)) return;
    if (!j_[k].is_string()) Fail(k, "a string", j_[k]);
    out = j_[k].get<std::string>();
  }
  std::optional<Section> Sub(const std::string& k) {
    if (!Has(k)) return std::nullopt;
    // Built in place: a copy's destructor would warn about every key as unseen.
    return std::optional<Section>(std::in_place, j_[k], Path(k), source_, warnings_, drop_auto_);
  }
  const nlohmann::json& json(const std::string& k) { return j_[k]; }
  [[noreturn]] void Fail(const std::string& k, const std::string& want, const nlohmann::json& got) const {
    std::string shown = got.dump();  // NaN and inf dump as null: say which
    if (got.is_number_float() && !std::isfinite(got.get<double>()))
      shown = std::isnan(got.get<double>()) ? "NaN" : (got.get<double>() > 0 ? "Infinity" : "-Infinity");
    if (shown.size() > 60) shown = shown.substr(0, 57) + "...";
    std::string hint = got.is_string() && got.get<std::string>() == "auto"
                           ? " (\"auto\" is resolved by the Hugging Face Trainer; give a value)"
                           : "";
    throw ConfigError(source_ + ": '" + Path(k) + "' must be " + want + ", got " + std::string(got.type_name()) + " " +
                      shown + hint);
  }
  void Warn(const std::string& msg) { warnings_->push_back(source_ + ": " + msg); }
  // A section {"enabled": true, ...} or a plain true.
  bool IsEnabled(const std::string& k) { return Enabled(k, false); }
  // A DeepSpeed key uckpt does not implement: accepted at DeepSpeed's
  // default (`off`), refused naming the key at any other value.
  void RefuseUnless(const std::string& k, const nlohmann::json& off) {
    if (Has(k) && j_[k] != off)
      throw ConfigError("'" + Path(k) + "' = " + j_[k].dump() + " is not supported by uckpt (only " + off.dump() +
                        ", DeepSpeed's default)");
  }
  // A DeepSpeed feature section: absent or "enabled": false is accepted,
  // enabled is refused naming it. `bare`: whether a section without
  // "enabled" is on (DeepSpeed's default for that section).
  void RefuseEnabled(const std::string& k, bool bare = false) {
    if (Enabled(k, bare)) throw ConfigError("'" + Path(k) + "' is enabled; uckpt does not support it");
  }
  // A key that only makes DeepSpeed log or profile (training is the same):
  // one warning when it is switched on.
  void Monitor(const std::string& k, const std::string& what) {
    if (Enabled(k, false))
      Warn("'" + Path(k) + "' is on but ignored: uckpt does not write " + what + " (training is unchanged)");
  }
  // DeepSpeed's pydantic sections (zero_optimization, offload_*) refuse keys
  // they do not define: so does uckpt, naming the first.
  // The same, for a section whose keys are a class's keyword arguments.
  void RefuseUnknownKeys(const std::string& must_be) {
    for (auto& [k, v] : j_.items())
      if (!seen_.count(k))
        throw ConfigError("'" + Path(k) + "' is not " + must_be + " (DeepSpeed 0.14.5 refuses it too)");
  }
  void RefuseUnknownKeys() {
    for (auto& [k, v] : j_.items())
      if (!seen_.count(k) && !(drop_auto_ && v == "auto"))
        throw ConfigError("'" + Path(k) + "' is not a key of '" + where_ + "' (DeepSpeed 0.14.5 refuses it too)");
  }
  // uckpt's own sections: a key uckpt does not define is refused, naming the ones it does.
  void RefuseUnknownOwnKeys(const std::string& keys) {
    for (auto& [k, v] : j_.items())
      if (!seen_.count(k))
        throw ConfigError("'" + Path(k) + "' is not a key of uckpt's section '" + where_ + "' (its keys: " + keys +
                          ")");
  }
  std::string Path(const std::string& k) const { return where_.empty() ? k : (k.empty() ? where_ : where_ + "." + k); }

 private:
  // A section {"enabled": true, ...} or a plain true.
  bool Enabled(const std::string& k, bool bare) {
    if (!Has(k)) return false;
    const auto& v = j_[k];
    if (v.is_boolean()) return v.get<bool>();
    if (v.is_object()) {
      if (!v.contains("enabled") || v["enabled"].is_null()) return bare && !v.empty();
      if (!v["enabled"].is_boolean()) Fail(k + ".enabled", "true or false", v["enabled"]);
      return v["enabled"].get<bool>();
    }
    Fail(k, "an object or true/false", v);
  }

  const nlohmann::json& j_;
  std::string where_;
  const std::string& source_;
  std::vector<std::string>* warnings_;
  std::set<std::string> seen_;
  bool drop_auto_ = false;
};

// Adam's keyword arguments, as DeepSpeed 0.14.5's _configure_basic_optimizer
// passes them on: the type is matched lower-cased; adam_w_mode (default true)
// or type AdamW decays decoupled; torch_adam picks torch.optim.Adam/AdamW
// (whose keywords differ from FusedAdam's and DeepSpeedCPUAdam's, and whose
// AdamW defaults weight_decay to 0.01), else DeepSpeed's own Adam.
void ParseOptimizer(Section& s, OptimizerConfig& o) {
  s.String("type", o.type);
  std::string lower = o.type;
  for (char& ch : lower) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  if (lower != "adam" && lower != "adamw")
    throw ConfigError("optimizer.type '" + o.type + "' is not supported by uckpt (its config optimizers: Adam, AdamW)");
  o.type = lower == "adam" ? "Adam" : "AdamW";
  bool legacy_fusion = false;
  s.Bool("legacy_fusion", legacy_fusion);
  if (legacy_fusion) throw ConfigError("optimizer.legacy_fusion = true is not supported by uckpt");
  bool torch_adam = false, adam_w_mode = true;
  bool weight_decay_given = false;
  if (auto p = s.Sub("params")) {
    p->Bool("torch_adam", torch_adam);
    p->Bool("adam_w_mode", adam_w_mode);
    p->Double("lr", o.lr);
    o.betas_given = p->Has("betas");
    if (o.betas_given) {
      const auto& b = p->json("betas");
      if (!b.is_array() || b.size() != 2 || !b[0].is_number() || !b[1].is_number())
        p->Fail("betas", "a list of two numbers", b);
      o.beta1 = b[0].get<double>();
      o.beta2 = b[1].get<double>();
    }
    p->Double("eps", o.eps);
    weight_decay_given = p->Has("weight_decay");
    p->Double("weight_decay", o.weight_decay);
    if (p->Has("max_grad_norm"))
      throw ConfigError(
          "optimizer.params.max_grad_norm is not an optimizer parameter (DeepSpeed refuses it too); "
          "use gradient_clipping");
    bool amsgrad = false;
    p->Bool("amsgrad", amsgrad);
    if (amsgrad) throw ConfigError("optimizer.params.amsgrad = true is not supported");
    // Keywords of one implementation only: the other raises a TypeError in DeepSpeed.
    const char* impl = torch_adam ? "torch.optim.Adam/AdamW (torch_adam true)"
                                  : "DeepSpeed's FusedAdam/DeepSpeedCPUAdam (torch_adam false)";
    auto not_taken = [&](const char* key) {
      if (p->Has(key))
        throw ConfigError(std::string("optimizer.params.") + key + " is not a keyword of " + impl +
                          "; DeepSpeed 0.14.5 refuses it too");
    };
    if (torch_adam) {
      not_taken("bias_correction");
      not_taken("set_grad_none");
      not_taken("fp32_optimizer_states");
      // torch's implementation choices: the formula is the same.
      for (const char* key : {"foreach", "fused"})
        if (p->Has(key) && !p->json(key).is_boolean()) p->Fail(key, "true, false or null", p->json(key));
      for (const char* key : {"maximize", "capturable", "differentiable"}) {
        bool on = false;
        p->Bool(key, on);
        if (on) throw ConfigError(std::string("optimizer.params.") + key + " = true is not supported");
      }
    } else {
      for (const char* key : {"foreach", "fused", "maximize", "capturable", "differentiable"}) not_taken(key);
      p->Bool("bias_correction", o.bias_correction);
      bool set_grad_none = true;  // FusedAdam's zero_grad: uckpt's engine owns the gradients
      p->Bool("set_grad_none", set_grad_none);
      bool fp32_states = true;
      p->Bool("fp32_optimizer_states", fp32_states);
      if (!fp32_states) throw ConfigError("optimizer.params.fp32_optimizer_states = false is not supported");
    }
  }
  o.torch_adam = torch_adam;
  o.decoupled_weight_decay = o.type == "AdamW" || adam_w_mode;
  o.torch_adam = torch_adam;
  if (torch_adam && o.decoupled_weight_decay && !weight_decay_given) o.weight_decay = 0.01;  // torch.optim.AdamW's
  if (o.lr < 0 || o.eps < 0 || o.beta1 < 0 || o.beta1 >= 1 || o.beta2 < 0 || o.beta2 >= 1)
    throw ConfigError("optimizer.params: lr and eps must be >= 0 and betas in [0, 1)");
}

}  // namespace

const std::vector<std::string>& SchedulerTypes() {
  static const std::vector<std::string> types{"WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest"};
  return types;
}

namespace {

// DeepSpeed 0.14.5 builds the scheduler as lr_schedules.<type>(optimizer,
// **params): the type is matched as written, a parameter the class does not
// take is a TypeError there and refused here, naming it.
// OneCycle's params; returns whether both cycle_min_lr and cycle_max_lr were given.
bool ParseOneCycleParams(Section& p, SchedulerConfig& c) {
  const bool bounds = p.Has("cycle_min_lr") && p.Has("cycle_max_lr");
  p.Double("cycle_min_lr", c.cycle_min_lr);
  p.Double("cycle_max_lr", c.cycle_max_lr);
  p.Double("decay_lr_rate", c.decay_lr_rate);
  p.Double("cycle_first_step_size", c.cycle_first_step_size);
  if (p.Has("cycle_second_step_size")) {
    double second = 0;
    p.Double("cycle_second_step_size", second);
    c.cycle_second_step_size = second;
  }
  int64_t stairs = 0;  // DeepSpeed keeps them and never reads them
  p.Int("cycle_first_stair_count", stairs);
  p.Int("cycle_second_stair_count", stairs);
  p.Double("decay_step_size", c.decay_step_size);
  p.Bool("cycle_momentum", c.cycle_momentum);
  p.Double("cycle_min_mom", c.cycle_min_mom);
  p.Double("cycle_max_mom", c.cycle_max_mom);
  p.Double("decay_mom_rate", c.decay_mom_rate);
  return bounds;
}

// The rules DeepSpeed's schedulers need (it divides by several of these).
void CheckScheduler(const SchedulerConfig& c, bool total_given, bool cycle_bounds) {
  const bool warmup = c.type == "WarmupLR" || c.type == "WarmupDecayLR";
  const bool cosine = c.type == "WarmupCosineLR";
  if (c.type == "OneCycle" && !cycle_bounds)
    throw ConfigError("scheduler OneCycle needs params.cycle_min_lr and params.cycle_max_lr");
  if (c.last_batch_iteration < -1)
    throw ConfigError("scheduler.params.last_batch_iteration must be >= -1 (-1: from the start)");
  if ((warmup || cosine) && c.warmup_type != "log" && c.warmup_type != "linear")
    throw ConfigError("scheduler.params.warmup_type must be \"log\" or \"linear\", got \"" + c.warmup_type + "\"");
  if (c.type == "WarmupDecayLR" && c.total_num_steps <= 0)
    throw ConfigError("scheduler WarmupDecayLR needs params.total_num_steps > 0");
  if (cosine && !total_given) throw ConfigError("scheduler WarmupCosineLR needs params.total_num_steps");
  // DeepSpeed divides by total_num_steps - max(2, warmup_num_steps) after the warmup.
  if (cosine && c.total_num_steps == std::max<int64_t>(2, c.warmup_num_steps))
    throw ConfigError(
        "scheduler WarmupCosineLR: params.total_num_steps must differ from warmup_num_steps "
        "(DeepSpeed 0.14.5 divides by their difference after the warmup)");
  if (c.warmup_num_steps < 0) throw ConfigError("scheduler.params.warmup_num_steps must be >= 0");
  if (c.type == "OneCycle") {
    const double second = c.cycle_second_step_size.value_or(c.cycle_first_step_size);
    if (!(c.cycle_first_step_size > 0) || !(second >= 0))
      throw ConfigError(
          "scheduler OneCycle: params.cycle_first_step_size must be > 0 and cycle_second_step_size "
          ">= 0 (DeepSpeed divides by them)");
  }
  if (c.type == "LRRangeTest" && c.lr_range_test_step_size == 0)
    throw ConfigError("scheduler LRRangeTest: params.lr_range_test_step_size must not be 0 (DeepSpeed divides by it)");
}

void ParseScheduler(Section& s, SchedulerConfig& c) {
  s.String("type", c.type);
  if (std::find(SchedulerTypes().begin(), SchedulerTypes().end(), c.type) == SchedulerTypes().end())
    throw ConfigError("scheduler.type '" + c.type +
                      "' is not supported (DeepSpeed's WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle or "
                      "LRRangeTest; a torch.optim.lr_scheduler class can be passed to initialize as lr_scheduler=)");
  const bool warmup = c.type == "WarmupLR" || c.type == "WarmupDecayLR";
  const bool cosine = c.type == "WarmupCosineLR";
  bool total_given = false, cycle_bounds = false;
  if (auto p = s.Sub("params")) {
    p->Int("last_batch_iteration", c.last_batch_iteration);
    if (warmup) {
      p->Double("warmup_min_lr", c.warmup_min_lr);
      p->Double("warmup_max_lr", c.warmup_max_lr);
    }
    if (warmup || cosine) {
      p->Int("warmup_num_steps", c.warmup_num_steps);
      p->String("warmup_type", c.warmup_type);
    }
    if (c.type == "WarmupDecayLR" || cosine) {
      total_given = p->Has("total_num_steps");
      p->Int("total_num_steps", c.total_num_steps);
    }
    if (cosine) {
      p->Double("warmup_min_ratio", c.warmup_min_ratio);
      p->Double("cos_min_ratio", c.cos_min_ratio);
    }
    if (c.type == "OneCycle") cycle_bounds = ParseOneCycleParams(*p, c);
    if (c.type == "LRRangeTest") {
      p->Double("lr_range_test_min_lr", c.lr_range_test_min_lr);
      p->Double("lr_range_test_step_size", c.lr_range_test_step_size);
      p->Double("lr_range_test_step_rate", c.lr_range_test_step_rate);
      p->Bool("lr_range_test_staircase", c.lr_range_test_staircase);
    }
    p->RefuseUnknownKeys("a parameter of DeepSpeed's " + c.type);
  }
  CheckScheduler(c, total_given, cycle_bounds);
}

// DeepSpeed's stage-3 knobs: honoured where uckpt's stage 3 has the
// mechanism, otherwise parsed with a warning saying what uckpt does instead.
void ParseStage3Knobs(Section& s, TrainConfig& c) {
  ZeroConfig& z = c.zero;
  const bool stage3 = z.stage == 3;
  auto note = [&](const std::string& key, const std::string& what) {
    c.warnings.push_back("zero_optimization." + key + ": " + what);
  };
  for (const char* key : {"stage3_param_persistence_threshold", "param_persistence_threshold"})
    if (s.Has(key)) s.Int(key, z.param_persistence_threshold);
  for (const char* key : {"sub_group_size"})
    if (s.Has(key)) s.Int(key, z.sub_group_size);
  for (const char* key : {"stage3_prefetch_bucket_size", "prefetch_bucket_size"})
    if (s.Has(key)) s.Int(key, z.prefetch_bucket_size);
  for (const char* key : {"stage3_max_live_parameters", "max_live_parameters"})
    if (s.Has(key)) s.Int(key, z.max_live_parameters);
  for (const char* key : {"stage3_max_reuse_distance", "max_reuse_distance"})
    if (s.Has(key)) {
      int64_t ignored = 0;
      s.Int(key, ignored);
      note(key, "parsed; uckpt frees a unit's parameters as soon as its forward or backward is done");
    }
  for (const char* key : {"stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save",
                          "stage3_gather_fp16_weights_on_model_save"})
    if (s.Has(key)) s.Bool(key, z.gather_16bit_weights_on_model_save);
  if (!stage3)
    for (const char* key : {"stage3_param_persistence_threshold", "sub_group_size", "stage3_prefetch_bucket_size",
                            "stage3_max_live_parameters"})
      if (s.Has(key)) note(key, "applies to stage 3 only; ignored at stage " + std::to_string(z.stage));
  if (z.sub_group_size <= 0) throw ConfigError("zero_optimization.sub_group_size must be positive");
  if (z.param_persistence_threshold < 0)
    throw ConfigError("zero_optimization.stage3_param_persistence_threshold must be >= 0");
  if (z.prefetch_bucket_size < 0)
    throw ConfigError("zero_optimization.stage3_prefetch_bucket_size must be >= 0 (0 turns prefetching off)");
  if (z.max_live_parameters < 0) throw ConfigError("zero_optimization.stage3_max_live_parameters must be >= 0");
}

// zero_optimization's deprecated booleans, which DeepSpeed 0.14.5 still
// maps onto their sections: cpu_offload -> offload_optimizer {device: cpu},
// cpu_offload_param -> offload_param {device: cpu}; given together with the
// section they replace, DeepSpeed refuses.
void ParseLegacyOffload(Section& s, ZeroConfig& z) {
  const std::pair<const char*, const char*> aliases[] = {{"cpu_offload", "offload_optimizer"},
                                                         {"cpu_offload_param", "offload_param"}};
  for (const auto& [old_key, section] : aliases) {
    if (!s.Has(old_key)) continue;
    if (s.Has(section))
      throw ConfigError(std::string("zero_optimization.") + old_key + " (deprecated) and zero_optimization." + section +
                        " cannot be given together");
    bool on = false;
    s.Bool(old_key, on);
    (std::string(section) == "offload_optimizer" ? z.offload_optimizer_cpu : z.offload_param_cpu) = on;
  }
  bool pin = false;
  s.Bool("cpu_offload_use_pin_memory", pin);  // uckpt pins its offload buffers anyway
}

// sparse_attention: DeepSpeed's engine only parses it, checking its mode, for
// the scripts that build its sparse attention modules from
// DeepSpeedConfig.sparse_attention; uckpt refuses those modules by name.
void ParseSparseAttention(Section& s) {
  static const std::set<std::string> kModes = {"dense", "fixed", "variable", "bigbird", "bslongformer"};
  if (s.Contains("mode") && !(s.Raw("mode").is_string() && kModes.count(s.Raw("mode").get<std::string>())))
    throw ConfigError("'sparse_attention.mode' = " + s.Raw("mode").dump() +
                      " is not a sparsity mode of DeepSpeed 0.14.5 (dense, fixed, variable, bigbird, bslongformer)");
  // What each mode reads (DeepSpeed's get_sparse_*_config); the others a mode ignores, as DeepSpeed does.
  s.Ignore({"block", "different_layout_per_head", "num_local_blocks", "num_global_blocks", "attention",
            "horizontal_global_attention", "num_different_global_patterns", "num_random_blocks", "local_window_blocks",
            "global_block_indices", "global_block_end_indices", "num_sliding_window_blocks"});
}

// The top-level keys of DeepSpeed 0.14.5's config that uckpt does not
// implement: those that change training are refused at any value but
// DeepSpeed's default; those that only log or profile warn once.
void ParseTopLevelAudit(Section& top) {
  // zero_force_ds_cpu_optimizer: uckpt's offload always runs its own host Adam;
  // aio: the settings of NVMe offload, which uckpt refuses (DeepSpeed reads them for NVMe only).
  top.Ignore({"zero_force_ds_cpu_optimizer", "aio"});
  top.RefuseUnless("sparse_gradients", false);
  top.RefuseUnless("disable_allgather", false);
  top.RefuseUnless("communication_data_type", nullptr);
  top.RefuseUnless("seq_parallel_comm_data_type", "fp32");
  top.RefuseUnless("graph_harvesting", false);
  top.RefuseUnless("use_data_before_expert_parallelism", false);
  for (const char* key : {"amp", "elasticity", "eigenvalue", "progressive_layer_drop", "curriculum_learning",
                          "data_efficiency", "hybrid_engine", "nebula", "autotuning"})
    top.RefuseEnabled(key);
  for (const char* key : {"compression_training", "weight_quantization"}) top.RefuseEnabled(key, /*bare=*/true);
  if (auto s = top.Sub("sparse_attention")) ParseSparseAttention(*s);
  // MoQ's quantize training (DeepSpeed's quantize_training.enabled, default false).
  top.RefuseEnabled("quantize_training");
  top.Monitor("tensorboard", "TensorBoard logs");
  top.Monitor("wandb", "Weights & Biases logs");
  top.Monitor("csv_monitor", "CSV monitor logs");
  top.Monitor("comet", "Comet logs");
  top.Monitor("flops_profiler", "a FLOPs profile");
  top.Monitor("comms_logger", "a communication log");
  top.Monitor("wall_clock_breakdown", "a wall-clock breakdown");
  top.Monitor("memory_breakdown", "a memory breakdown");
  top.Monitor("dump_state", "a state dump");
  // deepspeed.utils.timers' throughput timer: logging only.
  if (auto t = top.Sub("timers")) t->Monitor("throughput", "throughput timings");
  // Read by deepspeed.checkpointing.configure(deepspeed_config=...) only, not by the engine.
  if (auto a = top.Sub("activation_checkpointing"))
    a->Ignore({"partition_activations", "contiguous_memory_optimization", "number_checkpoints", "cpu_checkpointing",
               "synchronize_checkpoint_boundary", "profile"});
}

// "uckpt": uckpt's own settings for the Python package, which DeepSpeed
// ignores (as any unknown top-level key); checked here strictly, read by the
// package from the JSON (python/uckpt/data.py):
//   "resumable_data": {"seed": N, "shuffle": b}: initialize's loader keeps the data position.
void CheckUckptSection(Section& u) {
  if (auto r = u.Sub("resumable_data")) {
    int64_t seed = 0;
    bool shuffle = true;
    r->Int("seed", seed);
    r->Bool("shuffle", shuffle);
    r->RefuseUnknownOwnKeys("seed, shuffle");
  }
  u.RefuseUnknownOwnKeys("resumable_data");
}

}  // namespace

// Any number, as DeepSpeed (which only compares steps against it); a non-finite one never prints.
static void ParseStepsPerPrint(Section& top, TrainConfig& c) {
  if (!top.Has("steps_per_print")) return;
  const nlohmann::json& v = top.Raw("steps_per_print");
  if (v.is_number_float() && !std::isfinite(v.get<double>())) {
    c.steps_per_print = 0;
    c.steps_per_print_nonfinite = v.get<double>();
    return;
  }
  top.Int("steps_per_print", c.steps_per_print);
}

namespace {

// The top level's own numbers and switches: the batch sizes, clipping, the gradients' averaging,
// printing, the loader's last batch and the checks of a client optimizer.
void ParseTopLevelScalars(Section& top, TrainConfig& c) {
  top.Int("train_batch_size", c.train_batch_size);
  top.Int("train_micro_batch_size_per_gpu", c.train_micro_batch_size_per_gpu);
  top.Int("gradient_accumulation_steps", c.gradient_accumulation_steps);
  top.Double("gradient_clipping", c.gradient_clipping);
  c.gradient_clipping_integral = top.Has("gradient_clipping") && top.json("gradient_clipping").is_number_integer();
  top.Bool("prescale_gradients", c.prescale_gradients);
  top.Double("gradient_predivide_factor", c.gradient_predivide_factor);
  ParseStepsPerPrint(top, c);
  top.Bool("dataloader_drop_last", c.dataloader_drop_last);
  top.Bool("zero_allow_untested_optimizer", c.zero_allow_untested_optimizer);
  top.Bool("zero_force_ds_cpu_optimizer", c.zero_force_ds_cpu_optimizer);
}

void ParseFp16(Section& s, Fp16Config& f) {
  for (const char* k :
       {"initial_scale_power", "loss_scale_window", "min_loss_scale", "hysteresis", "consecutive_hysteresis"})
    if (s.Has(k)) f.dynamic_keys_given = true;
  s.Bool("enabled", f.enabled);
  s.Double("loss_scale", f.loss_scale);
  s.Int("initial_scale_power", f.initial_scale_power);
  s.Int("loss_scale_window", f.loss_scale_window);
  s.Int("hysteresis", f.hysteresis);
  s.Bool("consecutive_hysteresis", f.consecutive_hysteresis);
  s.Double("min_loss_scale", f.min_loss_scale);
  s.Bool("auto_cast", f.auto_cast);
  if (s.Has("loss_scale")) f.loss_scale_integral = s.json("loss_scale").is_number_integer();
  if (s.Has("min_loss_scale")) f.min_loss_scale_integral = s.json("min_loss_scale").is_number_integer();
  s.RefuseUnless("fp16_master_weights_and_grads", false);
}

// "bf16", or its older name "bfloat16".
void ParseBf16(Section& top, TrainConfig& c) {
  for (const char* key : {"bf16", "bfloat16"}) {
    if (auto s = top.Sub(key)) {
      s->Bool("enabled", c.bf16);
      s->RefuseUnless("immediate_grad_update", false);
    }
  }
}

void ParseOffloadOptimizer(Section& o, ZeroConfig& z) {
  std::string device = "none";
  o.String("device", device);
  if (device != "none" && device != "cpu")
    throw ConfigError("zero_optimization.offload_optimizer.device must be \"cpu\" or \"none\", got \"" + device + "\"");
  z.offload_optimizer_cpu = device == "cpu";
  // How DeepSpeed stages the host copies: uckpt pins and reuses its own buffers.
  o.Ignore({"pin_memory", "buffer_count", "fast_init", "nvme_path", "pipeline_read", "pipeline_write"});
  o.RefuseUnless("ratio", 1.0);
  o.RefuseUnknownKeys();
}

// `device` as given: checked once the stage is known (CheckParsedConfig).
void ParseOffloadParam(Section& o, ZeroConfig& z, std::string& device) {
  o.String("device", device);
  z.offload_param_cpu = device == "cpu";
  o.Bool("pin_memory", z.offload_param_pin_memory);
  o.Ignore({"buffer_count", "buffer_size", "max_in_cpu", "nvme_path"});
  o.RefuseUnknownKeys();
}

void ParseZeroOptimization(Section& s, TrainConfig& c, std::string& offload_param_device) {
  s.DropAuto();
  s.Int("stage", c.zero.stage);
  s.Int("reduce_bucket_size", c.zero.reduce_bucket_size);
  s.Int("allgather_bucket_size", c.zero.allgather_bucket_size);
  if (auto o = s.Sub("offload_optimizer")) ParseOffloadOptimizer(*o, c.zero);
  if (auto o = s.Sub("offload_param")) ParseOffloadParam(*o, c.zero, offload_param_device);
  ParseLegacyOffload(s, c.zero);
  ParseStage3Knobs(s, c);
  bool round_robin = false;
  s.Bool("round_robin_gradients", round_robin);
  if (round_robin) throw ConfigError("zero_optimization.round_robin_gradients = true is not supported");
  s.Bool("overlap_comm", c.zero.overlap_comm);
  s.Bool("override_module_apply", c.zero.override_module_apply);
  // How DeepSpeed lays out and schedules its buffers: uckpt's own layout gives the same values.
  s.Bool("reduce_scatter", c.zero.reduce_scatter);
  s.Ignore({"contiguous_gradients", "allgather_partitions", "use_multi_rank_bucket_allreduce", "elastic_checkpoint",
            "ignore_unused_parameters", "memory_efficient_linear", "pipeline_loading_checkpoint",
            "model_persistence_threshold", "stage3_model_persistence_threshold", "use_all_reduce_for_fetch_params",
            "stage3_use_all_reduce_for_fetch_params"});
  s.RefuseUnless("load_from_fp32_weights", true);
  s.RefuseUnless("legacy_stage1", false);
  s.RefuseUnless("zero_hpz_partition_size", 1);
  s.RefuseUnless("zero_quantized_weights", false);
  s.RefuseUnless("zero_quantized_nontrainable_weights", false);
  s.RefuseUnless("zero_quantized_gradients", false);
  s.RefuseUnless("mics_shard_size", -1);
  s.RefuseUnless("mics_hierarchical_params_gather", false);
  s.RefuseUnknownKeys();
}

// uckpt's own sections: "uckpt" (checked, kept for the Python package) and "heartbeat".
void ParseOwnSections(Section& top, TrainConfig& c) {
  if (auto s = top.Sub("uckpt")) {
    CheckUckptSection(*s);
    c.uckpt_section = top.json("uckpt");
  }
  if (auto s = top.Sub("heartbeat")) {
    s->Double("interval", c.heartbeat_interval_s);
    s->Double("timeout", c.heartbeat_timeout_s);
  }
}

void ParseCheckpointSection(Section& s, TrainConfig& c) {
  s.Bool("load_universal", c.load_universal);
  s.Bool("async_save", c.async_save);
  s.Int("snapshot_interval", c.snapshot_interval);
  if (c.snapshot_interval < 0)
    throw ConfigError("checkpoint.snapshot_interval must be a number of steps >= 0 (0: no snapshots), got " +
                      std::to_string(c.snapshot_interval));
  s.String("tag_validation", c.checkpoint_tag_validation);
  for (auto& ch : c.checkpoint_tag_validation) ch = static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
  if (c.checkpoint_tag_validation != "WARN" && c.checkpoint_tag_validation != "IGNORE" &&
      c.checkpoint_tag_validation != "FAIL")
    throw ConfigError("checkpoint.tag_validation must be \"Warn\", \"Ignore\" or \"Fail\", got \"" +
                      c.checkpoint_tag_validation + "\"");
  s.Ignore({"parallel_write"});
  s.RefuseUnless("use_node_local_storage", false);  // DeepSpeed would then save per node
}

// "data_types": {"grad_accum_dtype": ...} (CheckGradAccumDtype decides what it does).
void ParseDataTypes(Section& s, TrainConfig& c) {
  std::string v;
  s.String("grad_accum_dtype", v);
  if (s.Has("grad_accum_dtype")) c.grad_accum_dtype = GradAccumDtypeName(v);
}

// The rules across sections, once every section is read.
void CheckParsedConfig(TrainConfig& c, const std::string& source, const std::string& offload_param_device) {
  CheckZeroStage(c.zero.stage, source);
  // DeepSpeed reads offload_param at stage 3 only (DeepSpeed-Chat's --offload sets it at every stage).
  if (c.zero.stage != 3 && (offload_param_device != "none" || c.zero.offload_param_cpu)) {
    c.warnings.push_back(source + ": zero_optimization.offload_param applies to stage 3 only; ignored at stage " +
                         std::to_string(c.zero.stage) + ", as DeepSpeed 0.14.5 ignores it");
    c.zero.offload_param_cpu = false;
  } else if (offload_param_device != "none" && offload_param_device != "cpu") {
    throw ConfigError(source + ": zero_optimization.offload_param.device must be \"cpu\" or \"none\", got \"" +
                      offload_param_device + "\"");
  }
  CheckGradientScaling(c, source);
  if (c.fp16.enabled && c.bf16) throw ConfigError(source + ": fp16 and bf16 cannot both be enabled");
  CheckGradAccumDtype(c, source);
  if (c.gradient_clipping < 0) throw ConfigError(source + ": gradient_clipping must be >= 0");
}

}  // namespace

TrainConfig ParseConfig(const nlohmann::json& j, const std::string& source) {
  TrainConfig c;
  c.raw = j;
  std::string offload_param_device = "none";
  try {
    Section top(j, "", source, &c.warnings);
    ParseTopLevelScalars(top, c);
    ParseTopLevelAudit(top);
    c.wall_clock_breakdown = top.IsEnabled("wall_clock_breakdown") || top.IsEnabled("flops_profiler");
    c.has_optimizer_section = top.Has("optimizer");
    if (auto s = top.Sub("optimizer")) ParseOptimizer(*s, c.optimizer);
    if (auto s = top.Sub("scheduler")) ParseScheduler(*s, c.scheduler);
    if (auto s = top.Sub("fp16")) ParseFp16(*s, c.fp16);
    ParseBf16(top, c);
    if (auto s = top.Sub("zero_optimization")) ParseZeroOptimization(*s, c, offload_param_device);
    ParseOwnSections(top, c);
    if (auto s = top.Sub("checkpoint")) ParseCheckpointSection(*s, c);
    if (auto s = top.Sub("data_types")) ParseDataTypes(*s, c);
  } catch (const nlohmann::json::exception& e) {
    throw ConfigError(source + ": " + e.what());
  } catch (const ConfigError& e) {
    std::string m = e.what();
    if (m.rfind(source + ": ", 0) == 0) throw;
    throw ConfigError(source + ": " + m);
  }
  CheckParsedConfig(c, source, offload_param_device);
  return c;
}

void CheckZeroStage(int stage, const std::string& source) {
  if (stage < 0 || stage > 3)
    throw ConfigError(source + ": zero_optimization.stage " + std::to_string(stage) +
                      " is not supported (0, 1, 2 or 3)");
}

TrainConfig ParseConfig(const nlohmann::json& j, const std::string& source, const SectionOverrides& overrides) {
  if (!overrides.optimizer && !overrides.drop_scheduler) return ParseConfig(j, source);
  nlohmann::json used = j;
  if (used.is_object() && overrides.optimizer) {
    if (overrides.optimizer->is_null()) used.erase("optimizer");
    else used["optimizer"] = *overrides.optimizer;
  }
  if (used.is_object() && overrides.drop_scheduler) used.erase("scheduler");
  return ParseConfig(used, source);
}

nlohmann::json ReadConfigJson(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw ConfigError(path + ": cannot open the config file");
  try {
    return nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    throw ConfigError(path + ": not valid JSON: " + e.what());
  }
}

TrainConfig LoadConfigFile(const std::string& path) { return ParseConfig(ReadConfigJson(path), path); }

}  // namespace uckpt::engine
