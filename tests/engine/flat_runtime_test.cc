#include <gtest/gtest.h>

#include "uckpt/comm.h"
#include "engine/cpu_adam.h"
#include "engine/flat_runtime.h"

namespace uckpt::engine {
namespace {

ZeroSettings Fp16Settings() {
  ZeroSettings s;
  s.stage = 2;
  s.model_dtype = at::kHalf;
  s.fp16.enabled = true;
  s.fp16.initial_scale_power = 4;
  s.fp16.hysteresis = 2;
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

}  // namespace
}  // namespace uckpt::engine
