// `uckpt train`: GPT-2 or a BERT masked LM on token or byte data, trained
// through the public uckpt::Engine (include/uckpt/engine.h) like any other
// program; RunTraining is the whole command (resume, loop, logs, saves).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "cli/metrics_log.h"
#include "engine/config.h"
#include "engine/data/data.h"
#include "models/gpt2.h"
#include "uckpt/engine.h"

namespace uckpt::cli {

struct TrainOptions {
  engine::TrainConfig config;       // DeepSpeed JSON with command-line overrides applied
  std::string model_name = "gpt2";  // "gpt2" or "bert" (masked LM); `model` gives the sizes of either
  models::Gpt2Config model;
  int64_t seq_len = 128;
  uint64_t seed = 42;         // data rule and dropout masks
  uint64_t init_seed = 1234;  // GPT-2 initialisation
  std::string init_file;      // state dict (torch or safetensors) instead of the seeded init
  std::string data_file;      // flat uint16 token ids
  std::string text_file;      // byte-level tokens of any file
  int64_t steps = 0;          // train until this global step

  std::string checkpoint_dir;
  int64_t checkpoint_interval = 0;  // save every N steps (and at the end); 0 = only at the end
  std::string run_name = "run";
  std::string log_dir = "logs";  // metrics go to <log_dir>/<run_name>/

  bool resume = false;
  std::string checkpoint_tag;         // default: the `latest` file
  bool universal_checkpoint = false;  // also config.load_universal
  bool load_optimizer_states = true;
  bool verify_checkpoint = false;   // --verify: compare the manifest's hashes too (sizes always)
  bool keep_saved_hparams = false;  // lr/betas/eps/weight decay from the checkpoint
  bool progress = true;             // a progress line on a TTY

  std::string device = "cpu";  // "cpu", or "cuda" (device LOCAL_RANK; NCCL between ranks)
  int local_rank = 0;
  int threads = 0;             // host threads per rank (EngineOptions::host_threads)
  bool overlap_update = true;  // EngineOptions::overlap_update_with_forward
};

// The engine's step counters (saved in every checkpoint).
struct Counters {
  int64_t global_steps = 0;
  int64_t global_samples = 0;  // the data position: samples consumed
  int64_t skipped_steps = 0;
};

// Wall time per phase, summed over steps (UCKPT_TIMERS=1 in the environment;
// the device is synchronised between phases, which costs some throughput).
// At stage 3 `reduce` is the wait after backward's compute for the last
// reduce-scatters (with overlap_comm the others ran during backward).
struct PhaseTimes {
  bool enabled = false;
  double forward = 0, backward = 0, reduce = 0, step = 0;  // seconds
  int64_t steps = 0;
  // Stage 3, summed over the timed steps (Engine::stage3_stats()).
  int64_t unit_gathers = 0, prefetched_gathers = 0, reduce_buckets = 0, overlapped_buckets = 0;
};

// `uckpt train`: GPT-2 or BERT on byte/token data, one client of the public Engine.
class Trainer {
 public:
  Trainer(Comm& comm, TrainOptions options);

  // One optimizer step on global batch global_steps() + 1. The first step of
  // a Trainer warms up: timers() count from the second on.
  StepMetrics TrainStep();

  // DeepSpeed layout: <dir>/<tag>/mp_rank_00_model_states.pt (rank 0),
  // zero_pp_rank_<r>_mp_rank_00_optim_states.pt (every rank), <dir>/latest.
  void SaveCheckpoint(const std::string& dir, const std::string& tag);
  // From a ZeRO checkpoint of any stage and world size (resharded while it
  // loads), or (universal) from a universal checkpoint folder. Empty tag: the `latest`
  // (or `latest_universal`) file, which must exist.
  // `verify_hashes`: every file against its manifest's hash, as --verify.
  void LoadCheckpoint(const std::string& dir, const std::string& tag, bool universal, bool verify_hashes = false);

  Counters counters() const;
  const TrainOptions& options() const { return opt_; }
  Comm& comm() { return comm_; }
  const Comm& comm() const { return comm_; }
  at::Device device() const { return engine_->settings().device(); }
  Engine& engine() { return *engine_; }
  const Engine& engine() const { return *engine_; }
  // name -> the model's parameter, flat order (at stage 3 a gather unit's
  // have storage only while gathered: Engine::GatherParameters).
  const std::vector<models::NamedTensor>& parameters() const { return params_; }
  const PhaseTimes& timers() const { return timers_; }
  int64_t num_parameters() const {
    int64_t n = 0;
    for (const auto& p : params_) n += p.tensor.numel();
    return n;
  }

 private:
  void MakeGpt2();
  void MakeBert();
  void InitWeights(const std::function<void()>& seeded);
  // The micro-batch at row first_row of global batch `step`, on the device.
  at::Tensor MicroBatchIds(int64_t step, int64_t samples_before, int64_t first_row) const;

  Comm& comm_;
  TrainOptions opt_;
  std::unique_ptr<engine::TokenSource> data_;
  std::shared_ptr<torch::nn::Module> module_;
  // The micro-batch loss of rows [first_row, +mb) of global batch `step`.
  std::function<at::Tensor(const at::Tensor& ids, int64_t step, int64_t first_sample, int64_t first_row)> loss_;
  std::vector<models::NamedTensor> params_;
  std::vector<std::shared_ptr<torch::nn::Module>> gather_units_;  // ZeRO-3 units of the model
  std::function<void(uckpt::UnitCalls)> set_unit_calls_;
  std::unique_ptr<Engine> engine_;
  PhaseTimes timers_;
  int64_t steps_run_ = 0;  // TrainStep calls
};

// The whole run: resume if asked, train to options.steps, log every step,
// checkpoint every checkpoint_interval steps and at the end. Returns 0.
int RunTraining(Comm& comm, const TrainOptions& options);

}  // namespace uckpt::cli
