// DeepSpeed-style JSON training configuration (the subset uckpt implements).
// Unknown keys are reported as warnings; a known key with the wrong type is an
// error naming the file and the key. See ConfigKeys() for what is understood.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace uckpt::engine {

class ConfigError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The batch sizes do not agree or cannot be derived: DeepSpeed 0.14.5 asserts these
// (AssertionError); the Python package raises a class that is both RuntimeError and AssertionError.
class BatchSizeError : public ConfigError {
 public:
  using ConfigError::ConfigError;
};

struct OptimizerConfig {
  std::string type = "AdamW";  // "Adam" or "AdamW" (any case in the JSON)
  double lr = 1e-3;
  double beta1 = 0.9, beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  // AdamW: p *= 1 - lr*wd (decoupled). Adam with torch_adam or adam_w_mode
  // false: g += wd*p (L2), as torch.optim.Adam. DeepSpeed's default "Adam"
  // (FusedAdam, adam_w_mode true) decays decoupled.
  bool decoupled_weight_decay = true;
  // false: DeepSpeed's Adam with bias_correction false (step size lr,
  // denominator sqrt(v) + eps).
  bool bias_correction = true;
  // torch_adam: DeepSpeed builds torch.optim.Adam/AdamW, else its own Adam
  // (whose checkpoints keep other param-group keys: ckpt::AdamClass; ZeRO
  // stage 0 in fp16 wraps it in FP16_Optimizer, torch's in FP16_UnfusedOptimizer).
  bool torch_adam = false;
  // Whether params lists the betas: the optimizer's param groups then keep that list, else its
  // default tuple (a checkpoint pickles which one it is).
  bool betas_given = false;
};

// DeepSpeed 0.14.5's config schedulers (runtime/lr_schedules.py), each with
// its own parameters (engine/lr_schedule.h computes them).
struct SchedulerConfig {
  // "" (constant lr), "WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle" or "LRRangeTest"
  std::string type;
  int64_t last_batch_iteration = -1;  // the position the scheduler starts at (every type)
  // WarmupLR, WarmupDecayLR (and warmup_num_steps, warmup_type, total_num_steps: WarmupCosineLR).
  double warmup_min_lr = 0.0;
  double warmup_max_lr = 0.001;
  int64_t warmup_num_steps = 1000;
  std::string warmup_type = "log";  // "log" or "linear"
  int64_t total_num_steps = 0;      // WarmupDecayLR, WarmupCosineLR
  // WarmupCosineLR: ratios of each group's own lr.
  double warmup_min_ratio = 0.0;
  double cos_min_ratio = 0.0001;
  // OneCycle (the stair counts DeepSpeed takes and never uses are parsed only).
  double cycle_min_lr = 0.0, cycle_max_lr = 0.0, decay_lr_rate = 0.0;
  double cycle_first_step_size = 2000;
  std::optional<double> cycle_second_step_size;  // unset: cycle_first_step_size
  double decay_step_size = 0;                    // 0: no decay after the cycle
  bool cycle_momentum = true;                    // betas = (momentum, 0.99), as DeepSpeed writes them
  double cycle_min_mom = 0.8, cycle_max_mom = 0.9, decay_mom_rate = 0.0;
  // LRRangeTest
  double lr_range_test_min_lr = 1e-3;
  double lr_range_test_step_size = 2000;
  double lr_range_test_step_rate = 1.0;
  bool lr_range_test_staircase = false;
};

struct Fp16Config {
  bool enabled = false;
  double loss_scale = 0.0;  // 0 = dynamic
  int initial_scale_power = 16;
  int loss_scale_window = 1000;
  int hysteresis = 2;
  bool consecutive_hysteresis = false;
  double min_loss_scale = 1.0;
  // fp16.auto_cast: the engine's forward casts the tensors among its positional inputs to fp16 (Python).
  bool auto_cast = false;
  // Whether the config writes any of the dynamic scaler's keys (initial_scale_power,
  // loss_scale_window, min_loss_scale, hysteresis, consecutive_hysteresis). DeepSpeed's
  // ZeRO optimizers read the five above only then; otherwise they keep their
  // DynamicLossScaler's own defaults (LossScaler::FromConfig).
  bool dynamic_keys_given = false;
  // Whether loss_scale and min_loss_scale are JSON integers: FP16_Optimizer keeps its scale as the Python
  // number it came from, and its checkpoint pickles it so (an int until a halving makes it a float).
  bool loss_scale_integral = true, min_loss_scale_integral = true;
};

struct ZeroConfig {
  int stage = 0;
  bool offload_optimizer_cpu = false;
  int64_t reduce_bucket_size = 500000000;
  int64_t allgather_bucket_size = 500000000;
  bool overlap_comm = false;  // stages 2 and 3: reduce gradient buckets while backward runs
  // Stage 3 (engine/zero3_runtime.h). Parameters of at most this many elements stay
  // gathered (DeepSpeed's stage3_param_persistence_threshold).
  int64_t param_persistence_threshold = 100000;
  int64_t sub_group_size = 1000000000;       // elements per optimizer sub-group (stage 3's flat partitions)
  int64_t prefetch_bucket_size = 50000000;   // unit elements all-gathered ahead of use; 0: no prefetch
  int64_t max_live_parameters = 1000000000;  // prefetch only while gathered unit elements stay within this
  bool offload_param_cpu = false;            // stage 3: partitions of the 16-bit parameters in host memory
                                             // (below stage 3 DeepSpeed ignores offload_param; so does uckpt)
  bool offload_param_pin_memory = false;     // offload_param.pin_memory: for Python's zero.Init only
  bool override_module_apply = true;         // Python's zero.Init gathers around Module.apply (DeepSpeed's)
  // DeepSpeed's reduce_scatter (default true): at stages 1-2 its gradient averaging ignores
  // prescale_gradients and gradient_predivide_factor; at stage 3 it refuses them.
  bool reduce_scatter = true;
  // Stage 3: save_16bit_model gathers and writes the weights (else it saves nothing, as DeepSpeed).
  bool gather_16bit_weights_on_model_save = false;
};

struct TrainConfig {
  // Any two of the three batch sizes determine the third (ResolveBatchSizes).
  std::optional<int64_t> train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps;
  double gradient_clipping = 0.0;  // 0 = off
  // Whether it is a JSON integer: DeepSpeed keeps the Python number it came from (FP16_Optimizer's clip_grad).
  bool gradient_clipping_integral = false;
  // How the gradients are averaged over the ranks at ZeRO stage 0 (DeepSpeed's engine.allreduce_bucket):
  // prescale: each rank's gradient times 1/world, then summed; otherwise (post-scale, the default) times
  // 1/predivide, summed, times predivide/world. At stages 1-3 see ZeroConfig::reduce_scatter.
  bool prescale_gradients = false;
  double gradient_predivide_factor = 1.0;
  int64_t steps_per_print = 10;  // 0: never
  // inf or NaN as given (Accelerate sets inf): DeepSpeed only tests `step % it == 0`, never true, and its
  // engine's steps_per_print() returns the number; steps_per_print is 0 then.
  std::optional<double> steps_per_print_nonfinite;
  OptimizerConfig optimizer;
  SchedulerConfig scheduler;
  Fp16Config fp16;
  bool bf16 = false;
  // data_types.grad_accum_dtype: "" (not given), "fp32", "fp16", "bf16" or "int8" (config_rules.cc).
  std::string grad_accum_dtype;
  ZeroConfig zero;
  bool load_universal = false;
  // "checkpoint": {"tag_validation": ...}, upper-cased: WARN (DeepSpeed's
  // default) and IGNORE save with rank 0's tag, FAIL refuses differing tags.
  std::string checkpoint_tag_validation = "WARN";
  bool dataloader_drop_last = false;           // for the dataloader initialize() builds
  bool zero_allow_untested_optimizer = false;  // for initialize()'s check of a client optimizer at ZeRO 1-3
  // "checkpoint": {"async_save": true}: SaveCheckpoint returns once the state
  // is snapshotted; background threads write the files (engine/async_save.h).
  bool async_save = false;
  // "checkpoint": {"snapshot_interval": N} (uckpt's own key, not DeepSpeed's):
  // `uckpt train` keeps a snapshot of the state in host shared memory every N
  // steps for a restart on this host (cli/memory_snapshot.h); 0: none.
  int64_t snapshot_interval = 0;
  // uckpt's own section "heartbeat": {"interval": s, "timeout": s}: failing
  // ranks end the job (engine/dist/rank_monitor.h); timeout 0 turns it off.
  double heartbeat_interval_s = 1.0, heartbeat_timeout_s = 20.0;
  // What Python's engine answers from the config, as DeepSpeed's does.
  bool has_optimizer_section = false;                       // else `optimizer` holds the defaults
  bool zero_force_ds_cpu_optimizer = true;                  // initialize's check of a client optimizer under offload
  bool wall_clock_breakdown = false;                        // wall_clock_breakdown, or an enabled flops_profiler
  nlohmann::json uckpt_section = nlohmann::json::object();  // uckpt's own section, checked

  nlohmann::json raw = nlohmann::json::object();  // the JSON as given (saved as ds_config)
  std::vector<std::string> warnings;              // unknown keys, ignored settings
};

// The config "scheduler" types the engine runs (engine/lr_schedule.h).
const std::vector<std::string>& SchedulerTypes();

// Parses a configuration. `source` names it in messages (a path or "--config").
TrainConfig ParseConfig(const nlohmann::json& j, const std::string& source);
// Reads and parses a JSON file. Throws ConfigError naming the file.
TrainConfig LoadConfigFile(const std::string& path);
// Reads a JSON file, unparsed (for a caller that changes it before ParseConfig).
nlohmann::json ReadConfigJson(const std::string& path);

// The sections a caller supplies in place of the JSON's (Python's initialize:
// DeepSpeed uses initialize's optimizer and lr_scheduler over the config's).
// The config saved (TrainConfig::raw, ds_config) records what was used.
struct SectionOverrides {
  // Set: this "optimizer" section (a client's Adam(W) in DeepSpeed's terms)
  // is read instead of the config's; set to null: none is (the client's
  // optimizer steps itself).
  std::optional<nlohmann::json> optimizer;
  bool drop_scheduler = false;  // the "scheduler" section is not read
};
TrainConfig ParseConfig(const nlohmann::json& j, const std::string& source, const SectionOverrides& overrides);

// prescale_gradients and gradient_predivide_factor against the stage (config_rules.cc).
void CheckGradientScaling(TrainConfig& c, const std::string& source);
// data_types.grad_accum_dtype: DeepSpeed 0.14.5's spellings to "fp32", "fp16", "bf16" or "int8"
// (ConfigError otherwise); checked against the stage and the model's dtype, refused naming why
// where DeepSpeed refuses it or uckpt does not do what DeepSpeed does.
std::string GradAccumDtypeName(const std::string& given);
void CheckGradAccumDtype(const TrainConfig& c, const std::string& source);
// The dtype the micro-steps' gradients are summed in at stages 2-3 (DeepSpeed's get_data_types):
// the key's, else fp32 for bf16 at stage 0 and the model's otherwise.
std::string EffectiveGradAccumDtype(const TrainConfig& c);

// The one check of zero_optimization.stage (0 to 3); ConfigError naming `source` otherwise.
void CheckZeroStage(int stage, const std::string& source);

struct BatchSizes {
  int64_t train_batch_size = 0, micro_batch = 0, gradient_accumulation_steps = 0;
};
// DeepSpeed's batch arithmetic: train = micro * GA * world_size. Fills the
// missing values; a contradiction or a non-divisible split throws ConfigError
// showing the arithmetic.
BatchSizes ResolveBatchSizes(std::optional<int64_t> train, std::optional<int64_t> micro, std::optional<int64_t> ga,
                             int world_size);

}  // namespace uckpt::engine
