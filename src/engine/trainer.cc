#include "engine/trainer.h"

#include <torch/cuda.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstdio>
#include <filesystem>
#include <iostream>

#include "engine/torch_bridge.h"
#include "engine/weights.h"

namespace uckpt::engine {
namespace {

std::unique_ptr<TokenSource> MakeTokenSource(const TrainOptions& o) {
  if (!o.data_file.empty() && !o.text_file.empty()) throw std::invalid_argument("give --data or --text, not both");
  if (!o.data_file.empty())
    return std::make_unique<TokenFileSource>(o.data_file, TokenFileSource::Encoding::kUInt16, o.seq_len,
                                             o.model.vocab_size);
  if (!o.text_file.empty())
    return std::make_unique<TokenFileSource>(o.text_file, TokenFileSource::Encoding::kBytes, o.seq_len,
                                             o.model.vocab_size);
  return std::make_unique<SyntheticSource>(o.seed, o.model.vocab_size);
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

at::ScalarType ModelDtype(const TrainConfig& c) {
  if (c.fp16.enabled) return at::kHalf;
  if (c.bf16) return at::kBFloat16;
  return at::kFloat;
}

}  // namespace

Trainer::Trainer(Comm& comm, TrainOptions options)
    : comm_(comm), opt_(std::move(options)), schedule_(opt_.config.scheduler, opt_.config.optimizer.lr) {
  const TrainConfig& c = opt_.config;
  batch_ = ResolveBatchSizes(c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps,
                             comm_.world_size());
  if (opt_.seq_len < 2 || opt_.seq_len > opt_.model.n_positions)
    throw std::invalid_argument("--seq_len must be in [2, n_positions = " + std::to_string(opt_.model.n_positions) +
                                "], got " + std::to_string(opt_.seq_len));
  data_ = MakeTokenSource(opt_);
  if (const char* t = std::getenv("UCKPT_TIMERS"); t != nullptr && *t != '\0' && *t != '0') timers_.enabled = true;
  if (opt_.device == "cuda") {
    if (!at::hasCUDA()) throw std::invalid_argument("--device cuda: this libtorch has no CUDA (or no GPU is visible)");
    device_ = at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(opt_.local_rank));
  } else if (opt_.device != "cpu") {
    throw std::invalid_argument("--device must be cpu or cuda, got " + opt_.device);
  }
  if (c.fp16.enabled && device_.is_cpu()) {
    // libtorch 1.13 has no CPU fp16 kernels for LayerNorm and friends.
    try {
      at::layer_norm(at::zeros({1, 2}, at::kHalf), {2});
    } catch (const std::exception&) {
      throw std::invalid_argument("fp16 training needs CUDA or a libtorch with CPU fp16 kernels; on this CPU use bf16");
    }
  }

  // The model's parameters are views into the optimizer's flat buffer.
  std::vector<int64_t> numels;
  for (const auto& [name, shape] : Gpt2ParameterShapes(opt_.model)) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    numels.push_back(n);
  }
  ZeroSettings zs;
  zs.stage = c.zero.stage;
  zs.gradient_clipping = c.gradient_clipping;
  zs.optimizer = c.optimizer;
  zs.model_dtype = ModelDtype(c);
  zs.fp16 = c.fp16;
  zs.offload_optimizer_cpu = c.zero.offload_optimizer_cpu;
  zs.reduce_bucket_size = c.zero.reduce_bucket_size;
  zs.overlap_comm = c.zero.overlap_comm;
  zero_ = std::make_unique<ZeroOptimizer>(comm_, numels, zs, device_);
  params_ = Gpt2ParametersIn(opt_.model, zero_->model_flat());

  // Initial weights, identical on every rank (seeded, or from a file).
  if (!opt_.init_file.empty()) {
    CopyStateDict(LoadStateDictFile(opt_.init_file), params_, opt_.init_file);
  } else {
    Gpt2Init(opt_.model, params_, opt_.init_seed);
  }
  zero_->InitMasterFromModel();
  std::vector<at::Tensor> tensors;
  for (const auto& p : params_) tensors.push_back(p.tensor);
  zero_->BindGradients(tensors);
  model_ = std::make_unique<Gpt2>(opt_.model, params_);
}

StepMetrics Trainer::TrainStep() {
  const auto t0 = std::chrono::steady_clock::now();
  const int64_t step = counters_.global_steps + 1;
  comm_.SetActivity("step " + std::to_string(step));  // named if a rank fails now
  const int64_t ga = batch_.gradient_accumulation_steps, mb = batch_.micro_batch, T = opt_.seq_len;
  const double lr = schedule_.current_lr();

  // Micro-batches: rank r's slice of the global batch, one after the other.
  // The micro losses are summed on the device (in fp64, as before on the
  // host), so the GPU never waits for the host between forward and backward.
  at::Tensor loss_sum = at::zeros({1}, at::TensorOptions().dtype(at::kDouble).device(device_));
  PhaseClock clock(device_, timers_.enabled);
  for (int64_t m = 0; m < ga; ++m) {
    const int64_t first_row = FirstRow(m, comm_.rank(), comm_.world_size(), mb);
    auto rows = GatherRows(*data_, step, counters_.global_samples, first_row, mb, T);
    at::Tensor ids = at::from_blob(rows.data(), {mb, T}, at::kLong).to(device_, /*non_blocking=*/false, /*copy=*/true);
    DropoutKey dk{opt_.seed, step, first_row};
    at::Tensor loss = model_->Loss(ids, &dk);
    loss_sum.add_(loss.detach().to(at::kDouble));
    timers_.forward += clock.Lap();
    // DeepSpeed scales each micro loss by 1/GA (and by the fp16 loss scale).
    at::Tensor scaled = ga > 1 ? loss / ga : loss;
    scaled = scaled * zero_->loss_scale();
    scaled.backward();
    timers_.backward += clock.Lap();
    zero_->ReduceMicroGradients(m == ga - 1);
    timers_.reduce += clock.Lap();
  }
  ZeroOptimizer::StepResult r = zero_->Step(lr);
  timers_.step += clock.Lap();
  ++timers_.steps;
  if (!r.skipped) schedule_.Step();
  counters_.global_steps = step;
  counters_.global_samples += batch_.train_batch_size;
  if (r.skipped) ++counters_.skipped_steps;

  // The step's loss: the mean over all W*GA micro-batches (equal token counts).
  at::Tensor total = loss_sum;
  comm_.AllReduceSum(total);
  StepMetrics s;
  s.step = step;
  s.loss = total.item<double>() / static_cast<double>(ga * comm_.world_size());
  s.lr = lr;
  s.grad_norm = r.grad_norm;
  s.loss_scale = r.loss_scale;
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  s.tokens_per_s = secs > 0 ? static_cast<double>(batch_.train_batch_size * T) / secs : 0;
  return s;
}

int RunTraining(Comm& comm, const TrainOptions& options) {
  Trainer trainer(comm, options);
  const bool rank0 = comm.rank() == 0;
  const TrainOptions& o = trainer.options();
  const bool universal = o.universal_checkpoint || o.config.load_universal;
  const std::string tag_file = o.checkpoint_dir + (universal ? "/latest_universal" : "/latest");
  if (o.resume && o.checkpoint_tag.empty() && !o.checkpoint_dir.empty() && !std::filesystem::exists(tag_file)) {
    // As DeepSpeed's load_checkpoint: nothing to resume is a warning, not an error.
    if (rank0) std::cerr << "uckpt train: warning: " << tag_file << " does not exist; starting from step 1\n";
  } else if (o.resume) {
    if (o.checkpoint_dir.empty()) throw std::invalid_argument("--resume needs --checkpoint_dir");
    comm.SetActivity("loading a checkpoint from " + o.checkpoint_dir);
    const auto t0 = std::chrono::steady_clock::now();
    trainer.LoadCheckpoint(o.checkpoint_dir, o.checkpoint_tag, universal);
    if (rank0)
      std::fprintf(stderr, "uckpt train: loaded %s (step %lld) in %.3f s\n", o.checkpoint_dir.c_str(),
                   static_cast<long long>(trainer.counters().global_steps),
                   std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::unique_ptr<MetricsLog> log;
  if (rank0) {
    log = std::make_unique<MetricsLog>(o.log_dir + "/" + o.run_name);
    const auto& b = trainer.batch();
    std::cerr << "uckpt train: world size " << comm.world_size() << " (" << comm.backend() << "), ZeRO stage "
              << o.config.zero.stage << ", batch " << b.train_batch_size << " = micro " << b.micro_batch << " x GA "
              << b.gradient_accumulation_steps << " x " << comm.world_size() << " ranks, "
              << Gpt2NumParameters(o.model) << " parameters, steps " << trainer.counters().global_steps + 1 << ".."
              << o.steps << "\n";
    for (const auto& w : o.config.warnings) std::cerr << "uckpt train: warning: " << w << "\n";
  }
  const bool tty = rank0 && o.progress && isatty(fileno(stderr));
  auto save = [&] {
    if (o.checkpoint_dir.empty()) return;
    const std::string tag = "global_step" + std::to_string(trainer.counters().global_steps);
    comm.SetActivity("saving checkpoint " + tag);
    const auto t0 = std::chrono::steady_clock::now();
    trainer.SaveCheckpoint(o.checkpoint_dir, tag);
    if (rank0)
      std::fprintf(stderr, "uckpt train: saved %s/%s in %.3f s\n", o.checkpoint_dir.c_str(), tag.c_str(),
                   std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  };
  // After a resume there is nothing new to save yet; a fresh run with --steps 0
  // saves its initial state as global_step0 (`uckpt export` then writes the init).
  int64_t last_saved = o.resume ? trainer.counters().global_steps : -1;
  bool warmed_up = false;
  while (trainer.counters().global_steps < o.steps) {
    StepMetrics m = trainer.TrainStep();
    if (!warmed_up) trainer.timers() = PhaseTimes{trainer.timers().enabled};  // the first step warms up
    warmed_up = true;
    if (log) log->Write(m);
    if (tty) {
      std::fprintf(stderr, "\rstep %lld/%lld  loss %.6f  lr %.3g  grad_norm %.4f  %.0f tok/s   ",
                   static_cast<long long>(m.step), static_cast<long long>(o.steps), m.loss, m.lr, m.grad_norm,
                   m.tokens_per_s);
    } else if (rank0 && o.config.steps_per_print > 0 && m.step % o.config.steps_per_print == 0) {
      std::fprintf(stderr, "step %lld loss %.9g lr %.6g grad_norm %.6g\n", static_cast<long long>(m.step), m.loss, m.lr,
                   m.grad_norm);
    }
    if (o.checkpoint_interval > 0 && m.step % o.checkpoint_interval == 0) {
      save();
      last_saved = m.step;
    }
  }
  if (tty) std::fprintf(stderr, "\n");
  if (auto peak = PeakCudaMemory(trainer.device()); rank0 && peak)
    std::fprintf(stderr, "uckpt train: peak GPU memory of rank 0: allocated %.3f GiB, reserved %.3f GiB\n",
                 static_cast<double>(peak->allocated) / (1 << 30), static_cast<double>(peak->reserved) / (1 << 30));
  if (const PhaseTimes& t = trainer.timers(); rank0 && t.enabled && t.steps > 0) {
    const double k = 1000.0 / static_cast<double>(t.steps);
    std::fprintf(stderr,
                 "uckpt timers (rank 0, mean of %lld steps after the first, ms): forward %.2f, backward %.2f, "
                 "reduce %.2f, optimizer step + all-gather %.2f\n",
                 static_cast<long long>(t.steps), t.forward * k, t.backward * k, t.reduce * k, t.step * k);
  }
  if (last_saved != trainer.counters().global_steps) save();
  return 0;
}

}  // namespace uckpt::engine
