#include <ATen/Parallel.h>

#include <cstdlib>
#include <iostream>
#include <memory>
#include <optional>
#include <string>

#include "cli/commands.h"
#include "cli/strict_flags.h"
#include "cli/trainer.h"
#include "engine/config.h"
#include "engine/host_threads.h"
#include "uckpt/comm.h"

namespace uckpt::cli {

namespace {

// What `uckpt train` parses: the run's options plus the flags that become
// config keys (applied in TrainConfigFromFlags) or connection settings.
struct TrainArgs {
  std::string config;
  std::optional<int64_t> train_batch_size, micro, ga;
  std::optional<int> zero_stage;
  std::optional<double> lr, clip, heartbeat_interval, heartbeat_timeout;
  bool bf16 = false, fp16 = false, async_save = false;
  std::optional<int64_t> snapshot_every;
  TrainOptions o;
  bool no_load_optimizer_states = false;
  double timeout_s = 300;
};

// --config and the flags that override its keys.
void AddConfigFlags(CLI::App* cmd, TrainArgs& a) {
  cmd->add_option("--config", a.config, "DeepSpeed-style JSON configuration");
  cmd->add_option("--train_batch_size", a.train_batch_size, "Global batch (sequences per optimizer step)");
  cmd->add_option("--train_micro_batch_size_per_gpu", a.micro, "Sequences per rank per micro-step");
  cmd->add_option("--gradient_accumulation_steps", a.ga, "Micro-steps per optimizer step");
  cmd->add_option("--zero_stage", a.zero_stage, "ZeRO stage 0, 1, 2 or 3 (overrides the config)");
  cmd->add_option("--lr", a.lr, "Optimizer learning rate (overrides the config)");
  cmd->add_option("--gradient_clipping", a.clip, "Global-norm clipping, 0 = off (overrides the config)");
  cmd->add_flag(
      "--async_save", a.async_save,
      "Write checkpoints in the background; training blocks only for the snapshot (config: checkpoint.async_save)");
  cmd->add_option("--snapshot-every,--snapshot_every", a.snapshot_every,
                  "Every N steps, a snapshot of the training state in this host's shared memory (/dev/shm), read by "
                  "a restart of the job (uckpt launch --max_restarts) when newer than the durable checkpoint; "
                  "0: none (config: checkpoint.snapshot_interval; docs/reliability.md)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_flag("--bf16", a.bf16, "bf16 model weights (fp32 masters)");
  cmd->add_flag("--fp16", a.fp16, "fp16 model weights with dynamic loss scaling");
}

// How long to train, where checkpoints go and how a run resumes.
void AddRunFlags(CLI::App* cmd, TrainArgs& a) {
  auto& o = a.o;
  cmd->add_option("--steps", o.steps, "Train until this global step")->required();
  cmd->add_option("--checkpoint_dir", o.checkpoint_dir, "Where checkpoints go (and come from with --resume)");
  cmd->add_option("--checkpoint_interval", o.checkpoint_interval, "Save every N steps (and at the end)");
  cmd->add_option("--run_name", o.run_name, "Metrics go to <log_dir>/<run_name>/")->capture_default_str();
  cmd->add_option("--log_dir", o.log_dir, "Folder of the per-run metric folders")->capture_default_str();
  AddStrictFlags(cmd, true);  // for the checkpoint and --init files it loads
  cmd->add_flag("--resume", o.resume,
                "Resume from --checkpoint_dir (tag from `latest` unless --checkpoint_tag): a ZeRO 1/2/3 checkpoint "
                "of any world size and stage loads without converting");
  cmd->add_option("--checkpoint_tag", o.checkpoint_tag, "Tag folder to resume from, e.g. global_step100");
  cmd->add_flag("--universal_checkpoint", o.universal_checkpoint,
                "Resume from a universal checkpoint (any world size; tag from `latest_universal`)");
  cmd->add_flag("--verify", o.verify_checkpoint,
                "On --resume, compare every file of the checkpoint with its manifest's XXH64 hash (sizes are "
                "always compared)");
  cmd->add_flag("--no_load_optimizer_states", a.no_load_optimizer_states,
                "Resume weights, step and schedule only; fresh optimizer moments");
  cmd->add_flag(
      "--keep-saved-hparams,--keep_saved_hparams", o.keep_saved_hparams,
      "Use the checkpoint's lr (for the next step), betas, eps and weight_decay instead of this run's config");
}

// The model's shape, seeds and training data.
void AddModelFlags(CLI::App* cmd, TrainOptions& o) {
  cmd->add_option("--model", o.model_name,
                  "gpt2 (causal LM, Hugging Face's GPT-2) or bert (masked LM: 15% of positions, 80/10/10); the\n"
                  "size flags below apply to both; bert needs --vocab_size >= 257 (bytes + [MASK])")
      ->check(CLI::IsMember({"gpt2", "bert"}))
      ->capture_default_str();
  cmd->add_option("--n_layer", o.model.n_layer)->capture_default_str();
  cmd->add_option("--n_head", o.model.n_head)->capture_default_str();
  cmd->add_option("--n_embd", o.model.n_embd)->capture_default_str();
  cmd->add_option("--vocab_size", o.model.vocab_size)->capture_default_str();
  cmd->add_option("--n_positions", o.model.n_positions)->capture_default_str();
  cmd->add_option("--seq_len", o.seq_len, "Tokens per sequence")->capture_default_str();
  cmd->add_option("--dropout", o.model.dropout, "Dropout (masks seeded per sample and step)")->capture_default_str();
  cmd->add_flag("--fused_kernels", o.model.fused_kernels,
                "Fused attention (scaled_dot_product_attention) and tanh GELU kernels: faster, less memory, "
                "not HF's exact rounding (needs --dropout 0)");
  cmd->add_flag("--chunked_loss", o.model.chunked_loss,
                "Compute the loss one chunk of sequences at a time, never holding fp32 logits for the whole "
                "micro-batch: same gradient as HF's loss, far less GPU memory, a few percent slower");
  cmd->add_option("--seed", o.seed, "Seed of the synthetic data rule, dropout and BERT's masks")->capture_default_str();
  cmd->add_option("--init_seed", o.init_seed, "Seed of the model's initialisation")->capture_default_str();
  cmd->add_option("--init", o.init_file, "Initial weights: a torch state dict or safetensors file");
  cmd->add_option("--data", o.data_file, "Flat uint16 token file (llm.c / nanoGPT .bin)");
  cmd->add_option("--text", o.text_file, "Train on the bytes of any file (vocab >= 256)");
}

// Device, threads, timeouts and how the run reports.
void AddRuntimeFlags(CLI::App* cmd, TrainArgs& a) {
  auto& o = a.o;
  cmd->add_option("--device", o.device, "cpu, or cuda (GPU LOCAL_RANK, NCCL between ranks)")->capture_default_str();
  cmd->add_option("--threads", o.threads,
                  "Host threads per rank: libtorch's intra-op pool and uckpt's own (0: OMP_NUM_THREADS if set,\n"
                  "else this rank's share of the host: CPUs it may run on / LOCAL_WORLD_SIZE)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--timeout", a.timeout_s, "Seconds a rendezvous or collective may take before the job fails")
      ->capture_default_str();
  cmd->add_option("--heartbeat_interval", a.heartbeat_interval,
                  "Seconds between a rank's heartbeats (default 1; config: heartbeat.interval)");
  cmd->add_option("--heartbeat_timeout", a.heartbeat_timeout,
                  "A rank silent this long is dead and every other rank exits naming it (default 20;\n"
                  "config: heartbeat.timeout; 0 = off, then only --timeout ends a stuck job)");
  cmd->add_flag("!--no_overlap_update", o.overlap_update,
                "ZeRO-1/2 with offload_optimizer on one GPU: update on the host after backward, not alongside "
                "the next forward (the results are the same, bit for bit; see docs/engine.md). On the CPU the "
                "update always follows backward");
  cmd->add_flag("!--no_progress", o.progress, "No progress line on a terminal");
}

// The config file with the command-line overrides applied, parsed once.
engine::TrainConfig TrainConfigFromFlags(const TrainArgs& a) {
  nlohmann::json raw = nlohmann::json::object();
  if (!a.config.empty()) raw = engine::ReadConfigJson(a.config);  // parsed once, below
  if (!raw.is_object()) engine::ParseConfig(raw, a.config);       // refused, naming the file
  // Command-line overrides become part of the config (and of the saved ds_config).
  if (a.train_batch_size) raw["train_batch_size"] = *a.train_batch_size;
  if (a.micro) raw["train_micro_batch_size_per_gpu"] = *a.micro;
  if (a.ga) raw["gradient_accumulation_steps"] = *a.ga;
  if (a.zero_stage) raw["zero_optimization"]["stage"] = *a.zero_stage;
  if (a.lr) raw["optimizer"]["params"]["lr"] = *a.lr;
  if (a.clip) raw["gradient_clipping"] = *a.clip;
  if (a.bf16) raw["bf16"]["enabled"] = true;
  if (a.fp16) raw["fp16"]["enabled"] = true;
  if (a.async_save) raw["checkpoint"]["async_save"] = true;
  if (a.snapshot_every) raw["checkpoint"]["snapshot_interval"] = *a.snapshot_every;
  engine::TrainConfig config = engine::ParseConfig(raw, a.config.empty() ? "command line" : a.config);
  // Not training state: kept out of the saved ds_config.
  if (a.heartbeat_interval) config.heartbeat_interval_s = *a.heartbeat_interval;
  if (a.heartbeat_timeout) config.heartbeat_timeout_s = *a.heartbeat_timeout;
  return config;
}

// One process alone, or a rank of the job torchrun, mpirun or `uckpt launch`
// started; sets the host threads (and o.local_rank) on the way.
std::unique_ptr<Comm> ConnectRank(const TrainArgs& a, TrainOptions& o) {
  auto timeout = std::chrono::milliseconds(static_cast<int64_t>(a.timeout_s * 1000));
  // Under mpirun or srun: MASTER_PORT where set, else DeepSpeed's 29500.
  const char* port = std::getenv("MASTER_PORT");
  auto env = DistEnv::FromEnvironment(true, port && *port ? std::atoi(port) : 29500);
  // Before the model is built: its initialisation runs on these threads.
  engine::ApplyHostThreads(o.threads, "--threads", "set OMP_NUM_THREADS or --threads to change",
                           !env || env->rank == 0);
  const HeartbeatSettings heartbeat{o.config.heartbeat_interval_s, o.config.heartbeat_timeout_s};
  heartbeat.Validate();
  if (env) o.local_rank = env->local_rank;
  if (env && env->world_size > 1) return ConnectC10d(*env, timeout, /*cuda=*/o.device == "cuda", heartbeat);
  return MakeSingleProcessComm();
}

// Trains on `comm`; a failure ends the other ranks too and names this one.
int TrainOnComm(Comm& c, const TrainOptions& o) {
  try {
    int code = RunTraining(c, o);
    c.Finish();
    return code;
  } catch (const std::exception& e) {
    c.Abandon(e.what());  // the other ranks exit at once, naming this one
    // Name the rank: with several, every message would otherwise look alike.
    if (c.world_size() > 1) throw std::runtime_error("rank " + std::to_string(c.rank()) + ": " + e.what());
    throw;
  }
}

}  // namespace

Runner AddTrain(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "train",
      "Train GPT-2 (--model gpt2) or a BERT masked LM (--model bert) with ZeRO-0/1/2/3 data parallelism;\ncheckpoints "
      "in DeepSpeed's layout.\n\n"
      "One process trains alone; several are started by `uckpt launch` or torchrun, which set\n"
      "RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT (Gloo on CPU).\n\n"
      "Examples:\n"
      "  uckpt train --config ds.json --steps 100 --checkpoint_dir ckpt --checkpoint_interval 50\n"
      "  uckpt launch -n 4 -- uckpt train --config ds.json --steps 200 --checkpoint_dir ckpt \\\n"
      "      --resume                             # resume ckpt/latest at 4 ranks, saved at any size\n"
      "  torchrun --no-python --nproc-per-node 2 uckpt train --config ds.json --steps 100");
  auto a = std::make_shared<TrainArgs>();
  AddConfigFlags(cmd, *a);
  AddRunFlags(cmd, *a);
  AddModelFlags(cmd, a->o);
  AddRuntimeFlags(cmd, *a);
  return [a] {
    TrainOptions o = a->o;
    o.config = TrainConfigFromFlags(*a);
    o.load_optimizer_states = !a->no_load_optimizer_states;
    std::unique_ptr<Comm> comm = ConnectRank(*a, o);
    return TrainOnComm(*comm, o);
  };
}

}  // namespace uckpt::cli
