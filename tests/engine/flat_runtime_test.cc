#include <gtest/gtest.h>

#include <limits>
#include <string>

#include <torch/autograd.h>

#include "engine/cpu_adam.h"
#include "engine/flat_runtime.h"
#include "engine/grad_numerics.h"
#include "engine/host_grad_copy.h"
#include "uckpt/comm.h"

namespace uckpt::engine {
namespace {

ZeroSettings Fp16Settings() {
  ZeroSettings s;
  s.stage = 2;
  s.model_dtype = at::kHalf;
  s.fp16.enabled = true;
  s.fp16.initial_scale_power = 4;
  s.fp16.hysteresis = 2;
  s.fp16.dynamic_keys_given = true;
  s.fp16.loss_scale_window = 2;
  s.optimizer.lr = 0.1;
  return s;
}

// fp16 dynamic loss scaling as DeepSpeed does it: an overflowing step is
// skipped (weights and optimizer state untouched); the first overflow only
// uses up the hysteresis, the next halves the scale; `window` clean steps
// double it again.
TEST(FlatRuntime, Fp16OverflowSkipsTheStepAndAdjustsTheScale) {
  auto comm = MakeSingleProcessComm();
  FlatRuntime z(*comm, std::vector<int64_t>{3, 5}, Fp16Settings());
  z.model_flat().fill_(1.0);
  z.MastersFromWeights();
  auto step = [&](float g) {
    z.grad_flat().fill_(g);
    z.FinishBackward(true);
    return z.Step(0.1);
  };
  EXPECT_EQ(z.loss_scale(), 16.0);
  auto r = step(std::numeric_limits<float>::infinity());
  EXPECT_TRUE(r.skipped);
  EXPECT_EQ(z.loss_scale(), 16.0);  // hysteresis 2 -> 1
  EXPECT_FALSE(z.state().step.defined());
  EXPECT_TRUE(at::equal(z.state().master, at::ones({8})));
  r = step(std::numeric_limits<float>::quiet_NaN());
  EXPECT_TRUE(r.skipped);
  EXPECT_EQ(z.loss_scale(), 8.0);
  r = step(8.0f);  // a clean step: gradient 8 at scale 8 is 1
  EXPECT_FALSE(r.skipped);
  EXPECT_EQ(r.loss_scale, 8.0);
  EXPECT_NEAR(r.grad_norm, std::sqrt(8.0), 1e-6);  // unscaled norm of eight ones
  EXPECT_EQ(z.state().step.item<float>(), 1.0f);
  EXPECT_LT(z.state().master.max().item<float>(), 1.0f);  // Adam moved every weight down
  EXPECT_TRUE(at::equal(z.model_flat(), z.state().master.to(at::kHalf)));
  EXPECT_EQ(z.loss_scale(), 8.0);  // (iter 2 - last overflow 1) % window 2 != 0
  r = step(8.0f);
  EXPECT_FALSE(r.skipped);
  EXPECT_EQ(z.loss_scale(), 16.0);  // (3 - 1) % 2 == 0: doubled
}

TEST(FlatRuntime, StaticLossScaleNeverChanges) {
  auto comm = MakeSingleProcessComm();
  ZeroSettings s = Fp16Settings();
  s.fp16.loss_scale = 128;
  FlatRuntime z(*comm, std::vector<int64_t>{4}, s);
  EXPECT_EQ(z.loss_scale(), 128.0);
  z.grad_flat().fill_(128.0);
  z.FinishBackward(true);
  auto r = z.Step(0.01);
  EXPECT_FALSE(r.skipped);
  EXPECT_NEAR(r.grad_norm, 2.0, 1e-6);
  EXPECT_EQ(z.loss_scale(), 128.0);
}

// Stage 2 reduces every micro-step into the partition, stage 1 once: the
// accumulated gradient is the same.
TEST(FlatRuntime, GradientAccumulationIsTheSumOfMicroSteps) {
  auto comm = MakeSingleProcessComm();
  for (int stage : {0, 1, 2}) {
    ZeroSettings s;
    s.stage = stage;
    s.optimizer.lr = 0.5;
    s.optimizer.weight_decay = 0;
    FlatRuntime z(*comm, std::vector<int64_t>{6}, s);
    for (float g : {1.0f, 2.0f, 3.0f}) {
      z.grad_flat().add_(g);  // autograd accumulates into .grad like this
      z.FinishBackward(g == 3.0f);
    }
    auto r = z.Step(0.5);
    EXPECT_NEAR(r.grad_norm, 6.0 * std::sqrt(6.0), 1e-5) << stage;
    EXPECT_TRUE(at::allclose(z.state().exp_avg, at::full({6}, 0.6f))) << stage;  // (1 - 0.9) * 6
    EXPECT_EQ(z.grad_flat().abs().sum().item<float>(), 0.f) << stage;            // ready for the next step
  }
}

// Stages 1 and 2 under offload_optimizer step with the fused host Adam
// (cpu_adam.h) on the host partition: the masters are exactly what
// CpuAdamStep gives for the clipped gradient, step after step, with
// gradient accumulation and clipping.
TEST(FlatRuntime, OffloadedStagesOneAndTwoStepWithTheFusedHostAdam) {
  auto comm = MakeSingleProcessComm();
  for (int stage : {1, 2}) {
    ZeroSettings s;
    s.stage = stage;
    s.offload_optimizer_cpu = true;
    s.gradient_clipping = 0.5;
    s.optimizer.weight_decay = 0.01;
    s.optimizer.beta2 = 0.95;
    FlatRuntime z(*comm, std::vector<int64_t>{70001, 30000}, s);
    at::manual_seed(5);
    z.model_flat().copy_(at::randn({z.model_flat().numel()}));
    z.MastersFromWeights();
    PartitionState want;
    want.master = z.state().master.clone();
    for (int step = 1; step <= 4; ++step) {
      at::Tensor sum = at::zeros_like(z.grad_flat());
      for (int micro = 0; micro < 2; ++micro) {
        at::Tensor g = at::randn({z.grad_flat().numel()}) * 0.1;
        z.grad_flat().add_(g);
        sum.add_(g);
        z.FinishBackward(micro == 1);
      }
      auto r = z.Step(1e-3 * step);
      // DeepSpeed's clip factor, in fp32 as the engine computes it.
      at::Tensor combined = at::clamp_min((at::full({}, r.grad_norm, at::kFloat) + 1e-6) / 0.5, 1.0);
      const float factor = (at::reciprocal(combined) * 1.0).item<float>();
      CpuAdamStep(want, sum, factor, s.optimizer, 1e-3 * step);
      ASSERT_TRUE(at::equal(z.state().master, want.master)) << "stage " << stage << " step " << step;
      EXPECT_TRUE(at::equal(z.model_flat(), want.master)) << "stage " << stage << " step " << step;
    }
    EXPECT_TRUE(at::equal(z.state().exp_avg_sq, want.exp_avg_sq)) << stage;
  }
}

// sum(p * x) whose backward accumulates p's gradient by a backward of its own
// (reentrant, as activation checkpointing's recomputation does): a parameter
// also used outside it has its gradient accumulated twice in one backward.
// `anchor` (a 0-d leaf) puts the node in the graph.
struct ReentrantProduct : torch::autograd::Function<ReentrantProduct> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& anchor, const at::Tensor& p,
                            const at::Tensor& x) {
    ctx->saved_data["p"] = p;
    ctx->saved_data["x"] = x;
    return (p.detach() * x).sum() + anchor;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad) {
    const at::Tensor p = ctx->saved_data["p"].toTensor(), x = ctx->saved_data["x"].toTensor();
    {
      at::AutoGradMode on(true);
      torch::autograd::backward({(p * x).sum()}, {grad[0].to(p.scalar_type())});
    }
    return {grad[0], at::Tensor(), at::Tensor()};
  }
};

// Offloaded at one rank, each bucket of gradients goes to the host during
// backward in the model dtype and the host Adam widens it as it reads it. The
// training is bit for bit the one from the whole fp32 gradient copied after
// backward: each step's reference below takes the device gradients backward
// left, in fp32 (summed over micro-steps at stage 2, accumulated on the device
// at stage 1), their fragment norms, DeepSpeed's clip factor and CpuAdamStep.
// Parameter 1's gradient is accumulated twice in each backward (one use of
// it backpropagates reentrantly), parameter 4 not at all (its bucket is copied
// after backward); fp16's overflow still skips the step. With CUDA, on the GPU
// too (the copies on a side stream; the reference's norms on the device that
// takes them: the GPU for one micro-step's gradient, the host for a sum).
TEST(FlatRuntime, OffloadAtOneRankCopiesGradientsDuringBackwardAndStepsAsFromFp32) {
  auto comm = MakeSingleProcessComm();
  const std::vector<int64_t> numels{3000, 7, 70001, 11, 5000};  // buckets {4}, {3, 2}, {1, 0}
  std::vector<at::Device> devices{at::kCPU};
  if (at::hasCUDA()) devices.emplace_back(at::kCUDA, 0);
  for (const at::Device device : devices)
    for (int stage : {1, 2})
      for (int ga : {1, 2})
        for (at::ScalarType dtype : {at::kBFloat16, at::kHalf}) {
          const std::string where = device.str() + " stage " + std::to_string(stage) + " ga " + std::to_string(ga) +
                                    " " + c10::toString(dtype);
          ZeroSettings s;
          s.stage = stage;
          s.offload_optimizer_cpu = true;
          s.gradient_clipping = 1.0;
          s.model_dtype = dtype;
          s.fp16.enabled = dtype == at::kHalf;
          s.fp16.initial_scale_power = 8;
          s.fp16.dynamic_keys_given = true;
          s.reduce_bucket_size = 4000;  // several buckets
          s.optimizer.weight_decay = 0.01;
          s.optimizer.beta2 = 0.95;
          FlatRuntime z(*comm, numels, s, device);
          at::manual_seed(3);
          z.model_flat().copy_(at::randn({z.model_flat().numel()}) * 0.5);
          z.MastersFromWeights();
          std::vector<at::Tensor> params;
          std::vector<GradPiece> pieces;
          for (int64_t k = 0, off = 0; k < static_cast<int64_t>(numels.size()); off += numels[k++]) {
            params.push_back(z.model_flat().narrow(0, off, numels[k]).detach().requires_grad_(true));
            pieces.push_back({off, numels[k]});
          }
          z.BindGradients(params);
          int accumulations = 0;  // of parameter 1's gradient
          params[1].register_hook([&](const at::Tensor&) { ++accumulations; });
          const at::Tensor anchor = at::zeros({}, at::TensorOptions().device(device).dtype(dtype)).requires_grad_(true);
          ASSERT_NE(z.host_copy(), nullptr) << where;
          ASSERT_EQ(z.host_copy()->num_buckets(), 3) << where;
          PartitionState want;
          want.master = z.state().master.clone();
          int64_t copying_backwards = 0;
          for (int step = 1; step <= 4; ++step) {
            // fp16: step 2's last micro-batch overflows.
            const bool overflow = dtype == at::kHalf && step == 2;
            at::Tensor sum;  // what the whole-gradient path stepped on: fp32
            for (int micro = 0; micro < ga; ++micro) {
              const bool boundary = micro == ga - 1;
              z.BeginMicroStep(boundary);
              z.PrepareBackward();
              std::vector<at::Tensor> x;
              for (int64_t n : numels) x.push_back(at::randn({n}).to(device, dtype));
              at::Tensor loss = ((params[0] * x[0]).pow(2)).sum() + params[1].sum() * (params[1] * x[1]).sum() +
                                ReentrantProduct::apply(anchor, params[1], x[1]) + (params[2] * x[2]).abs().mean() +
                                (params[3] * x[3]).sum();
              loss = loss.to(at::kFloat) * (overflow && boundary ? std::numeric_limits<float>::infinity() : 1.0f);
              accumulations = 0;
              (loss * z.loss_scale()).backward();
              ASSERT_EQ(accumulations, 2) << where << ": parameter 1's gradient accumulated twice";
              if (stage == 2 || boundary) ++copying_backwards;
              const at::Tensor device_grad = z.grad_flat().to(at::kFloat);
              if (stage == 1) {
                sum = device_grad;  // accumulated on the device
              } else {
                sum = sum.defined() ? sum + device_grad : device_grad;
              }
              z.FinishBackward(boundary);
            }
            const double lr = 1e-3 * step;
            const StepResult r = z.Step(lr);
            ASSERT_EQ(r.skipped, overflow) << where << " step " << step;
            if (overflow) {
              ASSERT_TRUE(at::equal(z.state().master, want.master)) << where;
              continue;
            }
            const at::Device measured = stage == 1 || ga == 1 ? device : at::Device(at::kCPU);
            const at::Tensor norms = PieceNorms(sum.to(measured), pieces, measured, int64_t{1} << 25);
            bool finite = false;
            const at::Tensor norm =
                GlobalGradNorm({GroupGradNormStacked(*comm, norms, at::kFloat, measured, false)}, &finite);
            ASSERT_TRUE(finite);
            EXPECT_EQ(r.grad_norm, static_cast<float>(norm.item<float>() / r.loss_scale)) << where << " step " << step;
            const UnscaleAndClip unscale(norm, r.loss_scale, s.gradient_clipping);
            EXPECT_LT(unscale.host_factor() * r.loss_scale, 0.5) << where << ": the clipping is on";
            CpuAdamStep(want, sum.cpu(), unscale.host_factor(), s.optimizer, lr);
            ASSERT_TRUE(at::equal(z.state().master, want.master)) << where << " step " << step;
            ASSERT_TRUE(at::equal(z.state().exp_avg_sq, want.exp_avg_sq)) << where << " step " << step;
            ASSERT_TRUE(at::equal(z.model_flat().cpu(), want.master.to(dtype))) << where << " step " << step;
            EXPECT_EQ(z.grad_flat().abs().sum().item<float>(), 0.f) << where;
          }
          // Every bucket but the unused parameter's (the first, with the padding)
          // was copied by the hooks, in each backward whose gradient was reduced after it.
          EXPECT_EQ(z.host_copy()->copied_during_backward(), (z.host_copy()->num_buckets() - 1) * copying_backwards)
              << where;
        }
}

// Stage 2, offload_optimizer, bf16: the one-rank offload's host copy.
ZeroSettings OffloadedBf16Settings() {
  ZeroSettings s;
  s.stage = 2;
  s.offload_optimizer_cpu = true;
  s.model_dtype = at::kBFloat16;
  return s;
}

// A backward the engine did not start (a script's own loss.backward() between
// engine.backward and engine.step) copies nothing over the gradient waiting
// for the step: the step uses the engine's backward's gradient.
TEST(FlatRuntime, OffloadAtOneRankIgnoresABackwardItDidNotStart) {
  auto comm = MakeSingleProcessComm();
  ZeroSettings s = OffloadedBf16Settings();
  s.reduce_bucket_size = 64;  // a bucket per parameter
  int calls = 0;
  at::Tensor stepped;
  s.optimizer_step = [&](std::vector<OptimizerPartition>& parts) {
    ++calls;
    stepped = parts.at(0).grad.clone();
  };
  const std::vector<int64_t> numels{100, 300};
  FlatRuntime z(*comm, numels, s);
  z.model_flat().copy_(at::ones({z.model_flat().numel()}));
  z.MastersFromWeights();
  std::vector<at::Tensor> params;
  for (int64_t k = 0, off = 0; k < 2; off += numels[k++])
    params.push_back(z.model_flat().narrow(0, off, numels[k]).detach().requires_grad_(true));
  z.BindGradients(params);
  z.BeginMicroStep(true);
  z.PrepareBackward();
  (params[0].sum() * 2 + params[1].sum() * 3).to(at::kFloat).backward();  // the engine's backward
  const at::Tensor want = z.grad_flat().to(at::kFloat).clone();
  z.FinishBackward(true);
  (params[0].sum() * 5 + params[1].sum() * 7).to(at::kFloat).backward();  // the script's own
  z.Step(0.1);
  ASSERT_EQ(calls, 1);
  EXPECT_TRUE(at::equal(stepped, want)) << "the step's gradient was overwritten by a backward the engine did not start";
}

// A client optimizer under offload at one rank: its gradient is the host copy
// widened to fp32.
TEST(FlatRuntime, OffloadAtOneRankHandsAClientOptimizerTheFp32Gradient) {
  auto comm = MakeSingleProcessComm();
  ZeroSettings s = OffloadedBf16Settings();
  int calls = 0;
  s.optimizer_step = [&](std::vector<OptimizerPartition>& parts) {
    for (OptimizerPartition& p : parts) {
      ASSERT_EQ(p.grad.scalar_type(), at::kFloat);
      ++calls;
      p.master.add_(p.grad, -p.lr);
    }
  };
  FlatRuntime z(*comm, std::vector<int64_t>{300, 5000}, s);
  at::manual_seed(4);
  z.model_flat().copy_(at::randn({z.model_flat().numel()}));
  z.MastersFromWeights();
  for (int step = 0; step < 2; ++step) {
    const at::Tensor want = z.state().master.clone();
    z.grad_flat().copy_(at::randn({z.grad_flat().numel()}));
    want.add_(z.grad_flat().to(at::kFloat), -0.5);
    z.BeginMicroStep(true);
    z.FinishBackward(true);
    z.Step(0.5);
    EXPECT_TRUE(at::equal(z.state().master, want)) << step;
    EXPECT_TRUE(at::equal(z.model_flat(), want.to(at::kBFloat16))) << step;
  }
  EXPECT_EQ(calls, 2);
}

}  // namespace
}  // namespace uckpt::engine
