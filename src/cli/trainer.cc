#include "cli/trainer.h"

#include <sys/resource.h>
#include <torch/cuda.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <set>

#include "ckpt/deepspeed_names.h"
#include "cli/init_weights.h"
#include "cli/memory_snapshot.h"
#include "engine/engine_access.h"
#include "engine/torch_bridge.h"
#include "format/error.h"
#include "models/bert.h"

#if __has_include(<torch/csrc/autograd/profiler_kineto.h>)
#include <torch/csrc/autograd/profiler_kineto.h>
#define UCKPT_HAVE_KINETO 1
#endif

namespace uckpt::cli {

using engine::SyntheticSource;
using engine::TokenFileSource;
using engine::TokenSource;

namespace {

std::unique_ptr<TokenSource> MakeTokenSource(const TrainOptions& o) {
  if (!o.data_file.empty() && !o.text_file.empty()) throw std::invalid_argument("give --data or --text, not both");
  // BERT's data is bytes: the ids above 255 are its special tokens.
  const int64_t vocab = o.model_name == "bert" ? std::min<int64_t>(o.model.vocab_size, 256) : o.model.vocab_size;
  if (!o.data_file.empty())
    return std::make_unique<TokenFileSource>(o.data_file, TokenFileSource::Encoding::kUInt16, o.seq_len, vocab);
  if (!o.text_file.empty())
    return std::make_unique<TokenFileSource>(o.text_file, TokenFileSource::Encoding::kBytes, o.seq_len, vocab);
  return std::make_unique<SyntheticSource>(o.seed, vocab);
}

// Wall time between laps, the device synchronised first (UCKPT_TIMERS=1 only:
// synchronising costs throughput).
class PhaseClock {
 public:
  PhaseClock(at::Device device, bool enabled) : device_(device), enabled_(enabled) { Lap(); }
  double Lap() {
    if (!enabled_) return 0;
    if (device_.is_cuda()) torch::cuda::synchronize(device_.index());
    const auto now = std::chrono::steady_clock::now();
    const double s = std::chrono::duration<double>(now - last_).count();
    last_ = now;
    return s;
  }

 private:
  at::Device device_;
  bool enabled_;
  std::chrono::steady_clock::time_point last_ = std::chrono::steady_clock::now();
};

}  // namespace

Trainer::Trainer(Comm& comm, TrainOptions options) : comm_(comm), opt_(std::move(options)) {
  if (opt_.seq_len < 2 || opt_.seq_len > opt_.model.n_positions)
    throw std::invalid_argument("--seq_len must be in [2, n_positions = " + std::to_string(opt_.model.n_positions) +
                                "], got " + std::to_string(opt_.seq_len));
  data_ = MakeTokenSource(opt_);
  if (const char* t = std::getenv("UCKPT_TIMERS"); t != nullptr && *t != '\0' && *t != '0') timers_.enabled = true;
  if (opt_.model_name == "gpt2") {
    MakeGpt2();
  } else if (opt_.model_name == "bert") {
    MakeBert();
  } else {
    throw std::invalid_argument("--model must be gpt2 or bert, got " + opt_.model_name);
  }
  EngineOptions eo;
  eo.comm = std::shared_ptr<Comm>(&comm_, [](Comm*) {});  // the caller owns it
  eo.device = opt_.device;
  eo.local_rank = opt_.local_rank;
  eo.gather_units = gather_units_;
  eo.host_threads = opt_.threads;
  // The loop touches weights only through the engine and the model's units:
  // under offload at one rank the host update runs alongside the next forward
  // on the GPU (on the CPU both would share the same cores).
  eo.overlap_update_with_forward = opt_.overlap_update && opt_.device == "cuda";
  engine_ = engine::MakeEngine(module_, opt_.config, std::move(eo));
  engine_->stats().SetTiming(timers_.enabled);
  if (set_unit_calls_) set_unit_calls_(engine_->unit_calls());
}

// Initial weights, identical on every rank: seeded, or from --init.
void Trainer::InitWeights(const std::function<void()>& seeded) {
  if (!opt_.init_file.empty()) {
    CopyStateDict(LoadStateDictFile(opt_.init_file), params_, opt_.init_file);
  } else {
    seeded();
  }
}

void Trainer::MakeGpt2() {
  auto m = std::make_shared<models::Gpt2Module>(opt_.model);
  params_ = m->ordered_parameters();
  InitWeights([&] { models::Gpt2Init(opt_.model, params_, opt_.init_seed); });
  loss_ = [m, seed = opt_.seed](const at::Tensor& ids, int64_t step, int64_t, int64_t first_row) {
    models::DropoutKey dk{seed, step, first_row};
    return m->Loss(ids, &dk);
  };
  module_ = m;
  gather_units_ = m->gather_units();
  set_unit_calls_ = [m](uckpt::UnitCalls calls) { m->set_unit_calls(std::move(calls)); };
}

void Trainer::MakeBert() {
  models::BertConfig c;
  c.n_layer = opt_.model.n_layer;
  c.n_head = opt_.model.n_head;
  c.n_embd = opt_.model.n_embd;
  c.vocab_size = opt_.model.vocab_size;
  c.n_positions = opt_.model.n_positions;
  c.seq_len = opt_.seq_len;
  c.dropout = opt_.model.dropout;
  models::BertMlm m(c);
  for (auto& [name, t] : m->unique_named_parameters()) params_.push_back({name, t});
  InitWeights([&] { models::BertMlmInit(*m, opt_.init_seed); });
  // Masks follow the global sample index, so they do not depend on the split.
  loss_ = [impl = m.ptr(), seed = opt_.seed](const at::Tensor& ids, int64_t, int64_t first_sample, int64_t) {
    models::MaskedBatch b = models::MaskBatch(ids.cpu(), first_sample, seed);
    return impl->Loss(b.input_ids.to(ids.device()), b.labels.to(ids.device()));
  };
  module_ = m.ptr();
  gather_units_ = m->gather_units();
  set_unit_calls_ = [impl = m.ptr()](uckpt::UnitCalls calls) { impl->set_unit_calls(std::move(calls)); };
}

Counters Trainer::counters() const {
  return Counters{engine_->stats().global_steps(), engine_->stats().global_samples(), engine_->stats().skipped_steps()};
}

void Trainer::SaveCheckpoint(const std::string& dir, const std::string& tag) { engine_->SaveCheckpoint(dir, tag); }

void Trainer::LoadCheckpoint(const std::string& dir, const std::string& tag, bool universal, bool verify_hashes) {
  LoadCheckpointOptions lo;
  lo.universal = universal;
  lo.load_optimizer_states = opt_.load_optimizer_states;
  lo.verify_hashes = opt_.verify_checkpoint || verify_hashes;
  lo.keep_saved_hparams = opt_.keep_saved_hparams;
  // Unlike the API (nothing to load is no error), --resume with a tag file that is missing is one.
  if (engine_->LoadCheckpoint(dir, tag, lo).path.empty())
    throw FormatError(dir + "/" + ckpt::TagFileName(universal) +
                      ": cannot be read (give the tag explicitly, or check the folder)");
}

at::Tensor Trainer::MicroBatchIds(int64_t step, int64_t samples_before, int64_t first_row) const {
  const int64_t mb = engine_->settings().train_micro_batch_size_per_gpu(), T = opt_.seq_len;
  auto rows = GatherRows(*data_, step, samples_before, first_row, mb, T);
  return at::from_blob(rows.data(), {mb, T}, at::kLong)
      .to(engine_->settings().device(), /*non_blocking=*/false, /*copy=*/true);
}

namespace {

// Stage 3's gathers and reduce-scatters between two readings of the engine's counters.
void AddStage3Counts(PhaseTimes& t, const Stage3Stats& before, const Stage3Stats& after) {
  t.unit_gathers += after.unit_gathers - before.unit_gathers;
  t.prefetched_gathers += after.prefetched_gathers - before.prefetched_gathers;
  t.reduce_buckets += after.reduce_buckets - before.reduce_buckets;
  t.overlapped_buckets += after.overlapped_buckets - before.overlapped_buckets;
}

}  // namespace

StepMetrics Trainer::TrainStep() {
  const auto t0 = std::chrono::steady_clock::now();
  const int64_t step = engine_->stats().global_steps() + 1;
  comm_.SetActivity("step " + std::to_string(step));  // named if a rank fails now
  const int64_t ga = engine_->settings().gradient_accumulation_steps();
  const double lr = engine_->optimizer().lr();

  // Micro-batches: rank r's slice of the global batch, one after the other.
  // The micro losses are summed on the device (in fp64, as before on the
  // host), so the GPU never waits for the host between forward and backward.
  at::Tensor loss_sum = at::zeros({1}, at::TensorOptions().dtype(at::kDouble).device(engine_->settings().device()));
  PhaseClock clock(engine_->settings().device(), timers_.enabled);
  const Stage3Stats stage3_before = engine_->stats().stage3_stats();
  const int64_t samples_before = engine_->stats().global_samples();
  for (int64_t m = 0; m < ga; ++m) {
    const int64_t first_row =
        engine::FirstRow(m, comm_.rank(), comm_.world_size(), engine_->settings().train_micro_batch_size_per_gpu());
    at::Tensor loss =
        loss_(MicroBatchIds(step, samples_before, first_row), step, samples_before + first_row, first_row);
    loss_sum.add_(loss.detach().to(at::kDouble));
    timers_.forward += clock.Lap();
    const double wait_before = engine_->stats().stage3_stats().reduce_wait_s;
    engine_->Backward(loss);
    const double wait = engine_->stats().stage3_stats().reduce_wait_s - wait_before;  // stage 3: reduce-scatters waited
    timers_.backward += clock.Lap() - wait;
    timers_.reduce += wait;
    if (m < ga - 1) engine_->Step();  // not a boundary: nothing but the micro-step count
  }
  timers_.reduce += clock.Lap();
  engine_->Step();
  timers_.step += clock.Lap();
  ++timers_.steps;
  AddStage3Counts(timers_, stage3_before, engine_->stats().stage3_stats());
  if (++steps_run_ == 1) timers_ = PhaseTimes{timers_.enabled};  // the first step warms up

  // The step's loss: the mean over all W*GA micro-batches (equal token counts).
  at::Tensor total = loss_sum;
  comm_.AllReduceSum(total);
  const StepInfo& r = engine_->stats().last_step();
  StepMetrics s;
  s.step = step;
  s.loss = total.item<double>() / static_cast<double>(ga * comm_.world_size());
  s.lr = lr;
  s.grad_norm = r.grad_norm;
  s.loss_scale = r.loss_scale;
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  s.tokens_per_s = secs > 0 ? static_cast<double>(engine_->settings().train_batch_size() * opt_.seq_len) / secs : 0;
  return s;
}

namespace {

using Clock = std::chrono::steady_clock;
double SecondsSince(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// Rank 0: what the load just done read and how its state was checked.
void PrintLoaded(Trainer& trainer, const std::string& path, const char* from, double seconds) {
  if (trainer.comm().rank() != 0) return;
  std::fprintf(stderr, "uckpt train: loaded %s (step %lld)%s in %.3f s\n", path.c_str(),
               static_cast<long long>(trainer.counters().global_steps), from, seconds);
  if (const LoadStats& l = trainer.engine().stats().last_load(); !l.fingerprint.empty())
    std::fprintf(
        stderr, "uckpt train: state fingerprint %s in %.3f s (%.3f s of it for the files' value)\n",
        l.fingerprint.rfind("unchecked", 0) == 0 ? l.fingerprint.c_str() : ("checked (" + l.fingerprint + ")").c_str(),
        l.fingerprint_s, l.fingerprint_files_s);
}

// With snapshots, a resume of `latest` first tries this job's snapshot in
// host memory when it is newer than the durable checkpoint (its files
// checked by hash: memory speed). Returns whether it loaded one; if its
// load fails, says so and returns false: the durable checkpoint is loaded
// over whatever the failed load left.
bool ResumeFromSnapshot(Trainer& trainer, MemorySnapshots& snapshots) {
  const std::string tag = snapshots.NewerThanDurable();
  if (tag.empty()) return false;
  trainer.comm().SetActivity("loading the snapshot " + snapshots.folder() + "/" + tag);
  const auto t0 = Clock::now();
  try {
    trainer.LoadCheckpoint(snapshots.folder(), tag, /*universal=*/false, /*verify_hashes=*/true);
  } catch (const std::exception& ex) {
    const std::string what =
        "the snapshot " + snapshots.folder() + "/" + tag + " could not be loaded (" + ex.what() + ")";
    // The failed load may have changed some of the state: only a whole load may follow.
    if (!std::filesystem::exists(trainer.options().checkpoint_dir + "/" + ckpt::kLatestFile))
      throw std::runtime_error(what + ", and " + trainer.options().checkpoint_dir +
                               " holds no durable checkpoint to fall back to");
    if (trainer.comm().rank() == 0)
      std::fprintf(stderr, "uckpt train: %s; loading the durable checkpoint\n", what.c_str());
    return false;
  }
  PrintLoaded(trainer, snapshots.folder() + "/" + tag, " from the snapshot in host memory", SecondsSince(t0));
  return true;
}

// --resume: loads the checkpoint the options name (or a newer snapshot).
// Nothing to resume (no tag file and no tag given) is a warning, as in
// DeepSpeed's load_checkpoint.
void ResumeIfAsked(Trainer& trainer, MemorySnapshots* snapshots) {
  const TrainOptions& o = trainer.options();
  if (!o.resume) return;
  const bool rank0 = trainer.comm().rank() == 0;
  const bool universal = o.universal_checkpoint || o.config.load_universal;
  if (snapshots && o.checkpoint_tag.empty() && !universal && ResumeFromSnapshot(trainer, *snapshots)) return;
  const std::string tag_file = o.checkpoint_dir + "/" + ckpt::TagFileName(universal);
  if (o.checkpoint_tag.empty() && !o.checkpoint_dir.empty() && !std::filesystem::exists(tag_file)) {
    if (rank0) std::cerr << "uckpt train: warning: " << tag_file << " does not exist; starting from step 1\n";
    return;
  }
  if (o.checkpoint_dir.empty()) throw std::invalid_argument("--resume needs --checkpoint_dir");
  trainer.comm().SetActivity("loading a checkpoint from " + o.checkpoint_dir);
  const auto t0 = Clock::now();
  trainer.LoadCheckpoint(o.checkpoint_dir, o.checkpoint_tag, universal);
  PrintLoaded(trainer, o.checkpoint_dir, "", SecondsSince(t0));
}

// Rank 0: world, model, batch split, the steps to run, the config's warnings.
void PrintRunHeader(const Trainer& trainer) {
  const TrainOptions& o = trainer.options();
  const Engine& e = trainer.engine();
  const Comm& comm = trainer.comm();
  std::cerr << "uckpt train: world size " << comm.world_size() << " (" << comm.backend() << "), " << o.model_name
            << ", ZeRO stage " << o.config.zero.stage << ", batch " << e.settings().train_batch_size() << " = micro "
            << e.settings().train_micro_batch_size_per_gpu() << " x GA " << e.settings().gradient_accumulation_steps()
            << " x " << comm.world_size() << " ranks, " << trainer.num_parameters() << " parameters, steps "
            << trainer.counters().global_steps + 1 << ".." << o.steps << "\n";
  for (const auto& w : o.config.warnings) std::cerr << "uckpt train: warning: " << w << "\n";
  // DeepSpeed applies it to the dataloader initialize() builds; this data has no last batch.
  if (o.config.dataloader_drop_last)
    std::cerr << "uckpt train: warning: dataloader_drop_last has no effect here: uckpt train's data is indexed by "
                 "step and row, with no epochs and no last batch\n";
}

// Rank 0: a progress line on a terminal, else a line every steps_per_print steps.
void PrintStep(const TrainOptions& o, bool tty, const StepMetrics& m) {
  if (tty) {
    std::fprintf(stderr, "\rstep %lld/%lld  loss %.6f  lr %.3g  grad_norm %.4f  %.0f tok/s   ",
                 static_cast<long long>(m.step), static_cast<long long>(o.steps), m.loss, m.lr, m.grad_norm,
                 m.tokens_per_s);
  } else if (o.config.steps_per_print > 0 && m.step % o.config.steps_per_print == 0) {
    std::fprintf(stderr, "step %lld loss %.9g lr %.6g grad_norm %.6g\n", static_cast<long long>(m.step), m.loss, m.lr,
                 m.grad_norm);
  }
}

// Saves global_step<N> into --checkpoint_dir (none: nothing) and says what it cost.
void SaveStep(Trainer& trainer) {
  const TrainOptions& o = trainer.options();
  if (o.checkpoint_dir.empty()) return;
  const bool rank0 = trainer.comm().rank() == 0;
  const std::string tag = "global_step" + std::to_string(trainer.counters().global_steps);
  trainer.comm().SetActivity("saving checkpoint " + tag);
  const auto t0 = Clock::now();
  trainer.SaveCheckpoint(o.checkpoint_dir, tag);
  const SaveStats& s = trainer.engine().stats().last_save();
  if (!rank0) return;
  if (s.async)
    std::fprintf(stderr,
                 "uckpt train: snapshot of %s/%s in %.3f s (%.1f MiB of host memory), writing in the background\n",
                 o.checkpoint_dir.c_str(), tag.c_str(), s.blocked_s, static_cast<double>(s.snapshot_bytes) / (1 << 20));
  else
    std::fprintf(stderr, "uckpt train: saved %s/%s in %.3f s\n", o.checkpoint_dir.c_str(), tag.c_str(),
                 SecondsSince(t0));
  std::fprintf(stderr, "uckpt train: state fingerprint of the save in %.3f s\n", s.fingerprint_s);
}

// UCKPT_TIMERS=1, rank 0: the mean time of each phase, and stage 3's overlap.
void PrintPhaseTimes(const Trainer& trainer) {
  const PhaseTimes& t = trainer.timers();
  if (!t.enabled || t.steps == 0) return;
  const double k = 1000.0 / static_cast<double>(t.steps);
  std::fprintf(stderr,
               "uckpt timers (rank 0, mean of %lld steps after the first, ms): forward %.2f, backward %.2f, "
               "reduce %.2f, optimizer step + all-gather %.2f\n",
               static_cast<long long>(t.steps), t.forward * k, t.backward * k, t.reduce * k, t.step * k);
  if (trainer.engine().settings().zero_stage() == 3)
    std::fprintf(stderr,
                 "uckpt timers, stage 3: reduce = waiting after backward for the reduce-scatters; per step "
                 "%.1f of %.1f buckets reduced during backward (overlap_comm), %.1f of %.1f unit all-gathers "
                 "prefetched\n",
                 t.overlapped_buckets * k / 1000, t.reduce_buckets * k / 1000, t.prefetched_gathers * k / 1000,
                 t.unit_gathers * k / 1000);
}

// After the loop: rank 0's peak GPU memory and phase times; with timers,
// every rank's peak RSS (bench/zero3_memory.sh compares them).
void PrintRunSummary(const Trainer& trainer) {
  const bool rank0 = trainer.comm().rank() == 0;
  if (auto peak = engine::PeakCudaMemory(trainer.device()); rank0 && peak)
    std::fprintf(stderr, "uckpt train: peak GPU memory of rank 0: allocated %.3f GiB, reserved %.3f GiB\n",
                 static_cast<double>(peak->allocated) / (1 << 30), static_cast<double>(peak->reserved) / (1 << 30));
  if (rank0) PrintPhaseTimes(trainer);
  if (trainer.timers().enabled) {
    rusage ru{};
    getrusage(RUSAGE_SELF, &ru);
    std::fprintf(stderr, "uckpt train: rank %d peak RSS %.1f MiB\n", trainer.comm().rank(),
                 static_cast<double>(ru.ru_maxrss) / 1024);
  }
}

// The last background save must be durable (or its error reported) before the run ends.
void FinishBackgroundSave(Trainer& trainer) {
  trainer.comm().SetActivity("finishing a background checkpoint save");
  const auto t0 = Clock::now();
  trainer.engine().WaitForCheckpoint();
  if (trainer.comm().rank() == 0 && trainer.engine().stats().last_save().async)
    std::fprintf(stderr, "uckpt train: background save published after %.3f s more\n", SecondsSince(t0));
  // A synchronous save of a new tag returned before it was durable (docs/reliability.md).
  else if (trainer.comm().rank() == 0 && !trainer.options().checkpoint_dir.empty())
    std::fprintf(stderr, "uckpt train: last save durable after %.3f s more\n", SecondsSince(t0));
}

// UCKPT_TRACE=PREFIX: torch's profiler (CPU ops and device kernels) over
// steps UCKPT_TRACE_STEPS ("FIRST-LAST", default 6-8), written as a Chrome
// trace to PREFIX.rank<r>.json: where a step's device time goes, for tuning.
class StepTrace {
 public:
  StepTrace(int rank, int64_t final_step) {
    const char* prefix = std::getenv("UCKPT_TRACE");
    if (prefix == nullptr || *prefix == '\0') return;
    path_ = std::string(prefix) + ".rank" + std::to_string(rank) + ".json";
    if (const char* r = std::getenv("UCKPT_TRACE_STEPS"); r != nullptr && *r != '\0') {
      long long a = 0, b = 0;
      if (std::sscanf(r, "%lld-%lld", &a, &b) != 2 || a < 1 || b < a)
        throw std::invalid_argument(std::string("UCKPT_TRACE_STEPS must be FIRST-LAST (1 <= FIRST <= LAST), got ") + r);
      first_ = a, last_ = b;
    }
    last_ = std::min(last_, final_step);  // a run that ends first still writes its trace
    // libtorch may come without Kineto (Debian's does): then saving fails, so find out now.
    try {
      Start();
      Save(path_ + ".probe");
      std::remove((path_ + ".probe").c_str());
    } catch (const std::exception& e) {
      throw std::invalid_argument("UCKPT_TRACE is set, but this libtorch's profiler cannot write a trace: " +
                                  std::string(e.what()).substr(0, std::string(e.what()).find('\n')));
    }
  }
  // Around step `step` (nothing without UCKPT_TRACE).
  void Before(int64_t step) {
    if (path_.empty() || on_ || done_ || step < first_ || step > last_) return;
    first_ = step;  // a resumed run may start inside the range
    Start();
    on_ = true;
  }
  void After(int64_t step) {
    if (!on_ || step < last_) return;
    on_ = false;
    done_ = true;
    Save(path_);
    std::fprintf(stderr, "uckpt train: trace of steps %lld-%lld in %s\n", static_cast<long long>(first_),
                 static_cast<long long>(last_), path_.c_str());
  }

 private:
#ifdef UCKPT_HAVE_KINETO
  static void Start() {
    namespace tp = torch::autograd::profiler;
    const torch::profiler::impl::ProfilerConfig config(torch::profiler::impl::ProfilerState::KINETO);
    std::set<torch::profiler::impl::ActivityType> what{torch::profiler::impl::ActivityType::CPU};
    if (torch::cuda::is_available()) what.insert(torch::profiler::impl::ActivityType::CUDA);
    tp::prepareProfiler(config, what);
    tp::enableProfiler(config, what);
  }
  static void Save(const std::string& path) { torch::autograd::profiler::disableProfiler()->save(path); }
#else
  static void Start() { throw std::runtime_error("this build of uckpt has no torch profiler (Kineto) headers"); }
  static void Save(const std::string&) {}
#endif
  std::string path_;
  int64_t first_ = 6, last_ = 8;
  bool on_ = false, done_ = false;
};

}  // namespace

int RunTraining(Comm& comm, const TrainOptions& options) {
  Trainer trainer(comm, options);
  const TrainOptions& o = trainer.options();
  const bool rank0 = comm.rank() == 0;
  StepTrace trace(comm.rank(), o.steps);  // refused before a resume, not after
  std::unique_ptr<MemorySnapshots> snapshots;
  if (o.config.snapshot_interval > 0)
    snapshots = std::make_unique<MemorySnapshots>(trainer.engine(), comm, o.config.snapshot_interval, o.checkpoint_dir);
  ResumeIfAsked(trainer, snapshots.get());
  std::unique_ptr<MetricsLog> log = rank0 ? std::make_unique<MetricsLog>(o.log_dir + "/" + o.run_name) : nullptr;
  if (rank0) PrintRunHeader(trainer);
  const bool tty = rank0 && o.progress && isatty(fileno(stderr));

  // After a resume there is nothing new to save yet; a fresh run with --steps 0
  // saves its initial state as global_step0 (`uckpt export` then writes the init).
  int64_t last_saved = o.resume ? trainer.counters().global_steps : -1;
  while (trainer.counters().global_steps < o.steps) {
    trace.Before(trainer.counters().global_steps + 1);
    const StepMetrics m = trainer.TrainStep();
    trace.After(m.step);
    if (log) log->Write(m);
    if (rank0) PrintStep(o, tty, m);
    const bool save = o.checkpoint_interval > 0 && m.step % o.checkpoint_interval == 0;
    if (save) {
      SaveStep(trainer);
      last_saved = m.step;
    }
    if (snapshots) snapshots->AfterStep(m.step, save);
  }
  if (tty) std::fprintf(stderr, "\n");
  PrintRunSummary(trainer);
  if (last_saved != trainer.counters().global_steps) SaveStep(trainer);
  FinishBackgroundSave(trainer);
  if (snapshots) snapshots->Finish();
  return 0;
}

}  // namespace uckpt::cli
