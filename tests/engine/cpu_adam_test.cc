// engine/cpu_adam: the fused host Adam against torch's formula (TorchAdamStep).
#include "engine/cpu_adam.h"

#include <ATen/Parallel.h>

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <iterator>
#include <limits>
#include <thread>
#include <utility>
#include <vector>

namespace uckpt::engine {
namespace {

// The largest difference against the tensor's scale: a few fp32 ulps of the
// largest element are ~1e-7 of it; elements near zero do not inflate it.
double ScaledDiff(const at::Tensor& a, const at::Tensor& b) {
  return (a - b).abs().max().item<double>() / b.abs().max().item<double>();
}

struct Case {
  bool decoupled;
  double weight_decay;
};

class CpuAdam : public ::testing::TestWithParam<Case> {};

TEST_P(CpuAdam, FollowsTorchAdamWithinRounding) {
  at::manual_seed(7);
  const int64_t n = 300001;  // several parallel chunks and a ragged end
  OptimizerConfig o;
  o.beta1 = 0.9;
  o.beta2 = 0.95;
  o.eps = 1e-8;
  o.weight_decay = GetParam().weight_decay;
  o.decoupled_weight_decay = GetParam().decoupled;
  PartitionState torch_state, fused_state;
  torch_state.master = at::randn({n});
  fused_state.master = torch_state.master.clone();
  for (int step = 1; step <= 6; ++step) {
    at::Tensor grad = at::randn({n}) * 1e-2;
    const double scale = 0.5;  // the unscale-and-clip factor
    const double lr = 1e-3 * step;
    TorchAdamStep(torch_state, grad * static_cast<float>(scale), o, lr);
    at::Tensor g = grad.clone();
    CpuAdamStep(fused_state, g, scale, o, lr);
    EXPECT_EQ(g.abs().max().item<float>(), 0.0f) << "the gradient is zeroed for the next accumulation";
  }
  EXPECT_EQ(fused_state.step.item<float>(), 6.0f);
  // Both are fp32 evaluations of one formula; only FMA contraction inside
  // torch's kernels can separate them (a few ulps after six steps).
  EXPECT_LT(ScaledDiff(fused_state.master, torch_state.master), 1e-6);
  EXPECT_LT(ScaledDiff(fused_state.exp_avg, torch_state.exp_avg), 1e-6);
  EXPECT_LT(ScaledDiff(fused_state.exp_avg_sq, torch_state.exp_avg_sq), 1e-6);
  // And the update did something: the masters moved by far more than that.
  EXPECT_GT((fused_state.master - fused_state.master.clone().zero_()).abs().max().item<double>(), 0.1);
}

INSTANTIATE_TEST_SUITE_P(Kinds, CpuAdam, ::testing::Values(Case{true, 0.01}, Case{false, 0.01}, Case{true, 0.0}),
                         [](const auto& info) {
                           return std::string(info.param.decoupled ? "AdamW" : "Adam") +
                                  (info.param.weight_decay != 0 ? "_decay" : "_nodecay");
                         });

// "bias_correction": false (DeepSpeed's FusedAdam and DeepSpeedCPUAdam):
// step size lr and denominator sqrt(v) + eps from the first step on, in
// both host paths (TorchAdamStep also serves the device and stage 3).
TEST(CpuAdam, WithoutBiasCorrectionStepsByLr) {
  at::manual_seed(11);
  const int64_t n = 1000;
  OptimizerConfig o;
  o.beta1 = 0.8;
  o.beta2 = 0.9;
  o.eps = 1e-3;
  o.weight_decay = 0.1;
  o.bias_correction = false;
  for (bool decoupled : {true, false}) {
    o.decoupled_weight_decay = decoupled;
    PartitionState torch_state, fused_state;
    torch_state.master = at::randn({n});
    fused_state.master = torch_state.master.clone();
    at::Tensor p = torch_state.master.to(at::kDouble), m = at::zeros_like(p), v = at::zeros_like(p);
    const double lr = 0.05;
    for (int step = 1; step <= 3; ++step) {
      at::Tensor grad = at::randn({n});
      TorchAdamStep(torch_state, grad, o, lr);
      at::Tensor g = grad.clone();
      CpuAdamStep(fused_state, g, 1.0, o, lr);
      at::Tensor gd = grad.to(at::kDouble);
      if (decoupled) {
        p = p * (1 - lr * o.weight_decay);
      } else {
        gd = gd + o.weight_decay * p;
      }
      m = o.beta1 * m + (1 - o.beta1) * gd;
      v = o.beta2 * v + (1 - o.beta2) * gd * gd;
      p = p - lr * m / (v.sqrt() + o.eps);
    }
    EXPECT_LT(ScaledDiff(torch_state.master.to(at::kDouble), p), 1e-6) << decoupled;
    EXPECT_LT(ScaledDiff(fused_state.master.to(at::kDouble), p), 1e-6) << decoupled;
  }
}

// Ranges with a copy (the offloaded step's upload staging): the same update as
// without, and each range's copy is its new weights as .to() rounds them.
TEST(CpuAdam, RangesCopyTheUpdatedWeightsAsToRoundsThem) {
  at::manual_seed(5);
  const int64_t n = 300001, range = 70000;  // ranges of several chunks, a ragged last one
  OptimizerConfig o;
  o.weight_decay = 0.01;
  for (at::ScalarType dtype : {at::kBFloat16, at::kHalf}) {
    for (double lr : {0.0, 1e-3}) {
      PartitionState plain, ranged;
      plain.master = at::randn({n}) * 100;
      // Values that round to nearest even, overflow fp16, are fp16 subnormals, inf and NaN.
      auto m = plain.master.accessor<float, 1>();
      const float specials[] = {
          1.00390625f, 1.01171875f,  -1.00048828125f, 70000.f, 1e-6f, -3e-7f, std::numeric_limits<float>::infinity(),
          3.4e38f,     std::nanf("")};
      for (size_t i = 0; i < sizeof specials / sizeof specials[0]; ++i) m[static_cast<int64_t>(i) * 1001] = specials[i];
      ranged.master = plain.master.clone();
      at::Tensor grad = at::randn({n}) * 1e-2, g1 = grad.clone(), g2 = grad.clone();
      CpuAdamStep(plain, g1, 0.5, o, lr);
      at::Tensor copies = at::empty({n}, dtype);
      std::vector<std::pair<int64_t, int64_t>> done;
      CpuAdamStep(
          ranged, g2, 0.5, o, lr, range, [&](int64_t b, int64_t e) { return copies.narrow(0, b, e - b).clone(); },
          [&](int64_t b, int64_t e) { done.emplace_back(b, e); });
      EXPECT_EQ(done.size(), static_cast<size_t>((n + range - 1) / range));
      EXPECT_TRUE(at::equal(ranged.master.nan_to_num(0), plain.master.nan_to_num(0))) << dtype << " lr " << lr;
      EXPECT_TRUE(at::equal(ranged.exp_avg_sq, plain.exp_avg_sq));
      // The copies went into fresh tensors above; now into views of one tensor, to compare bits.
      CpuAdamStep(
          ranged, g2.zero_(), 0.5, o, lr, range, [&](int64_t b, int64_t e) { return copies.narrow(0, b, e - b); },
          [](int64_t, int64_t) {});
      CpuAdamStep(plain, g1.zero_(), 0.5, o, lr);
      const at::Tensor want = plain.master.to(dtype);
      const at::Tensor same = (copies.view(at::kShort) == want.view(at::kShort)) | (copies.isnan() & want.isnan());
      EXPECT_TRUE(same.all().item<bool>())
          << dtype << " lr " << lr << ": " << (~same).sum().item<int64_t>() << " elements differ from .to()";
    }
  }
  PartitionState st;
  st.master = at::zeros({8});
  at::Tensor g = at::zeros({8});
  EXPECT_THROW(CpuAdamStep(
                   st, g, 1.0, o, 1e-3, 4, [](int64_t, int64_t) { return at::zeros({4}); }, [](int64_t, int64_t) {}),
               std::invalid_argument);  // fp32 is not a copy's dtype
}

// The fused step is the formula evaluated element by element in fp32, each
// operation rounded on its own (no fused multiply-add, whichever vector
// width the host runs it at), bit for bit.
TEST(CpuAdam, EqualsTheFormulaElementByElement) {
  at::manual_seed(13);
  const int64_t n = 300001;
  for (bool decoupled : {true, false}) {
    OptimizerConfig o;
    o.beta2 = 0.95;
    o.weight_decay = 0.01;
    o.decoupled_weight_decay = decoupled;
    PartitionState st;
    st.master = at::randn({n});
    at::Tensor p = st.master.clone(), m = at::zeros({n}), v = at::zeros({n});
    for (int step = 1; step <= 3; ++step) {
      const at::Tensor grad = (at::randn({n}) * 1e-2).to(at::kBFloat16);
      const double lr = 1e-3 * step, scale = 0.5;
      CpuAdamStep(st, grad, scale, o, lr);
      const at::Tensor g32 = grad.to(at::kFloat);
      const float* g = g32.data_ptr<float>();
      float *pp = p.data_ptr<float>(), *mm = m.data_ptr<float>(), *vv = v.data_ptr<float>();
      const float decay = static_cast<float>(1 - lr * o.weight_decay), wd = static_cast<float>(o.weight_decay);
      const float b1 = static_cast<float>(o.beta1), c1 = static_cast<float>(1 - o.beta1);
      const float b2 = static_cast<float>(o.beta2), c2 = static_cast<float>(1 - o.beta2);
      const float bc2 = static_cast<float>(std::sqrt(1 - std::pow(o.beta2, step)));
      const float eps = static_cast<float>(o.eps);
      const float neg_step = static_cast<float>(-(lr / (1 - std::pow(o.beta1, step))));
      for (int64_t i = 0; i < n; ++i) {
        volatile float x = g[i] * static_cast<float>(scale);  // volatile: each product rounded alone
        float gi = x, pi = pp[i];
        if (decoupled) {
          pi = pi * decay;
        } else {
          volatile float d = pi * wd;
          gi = gi + d;
        }
        volatile float m1 = mm[i] * b1, m2 = gi * c1;
        const float mi = m1 + m2;
        volatile float v1 = vv[i] * b2, v2 = c2 * gi;
        volatile float v3 = v2 * gi;
        const float vi = v1 + v3;
        volatile float root = std::sqrt(vi) / bc2;
        const float denom = root + eps;
        volatile float num = neg_step * mi;
        pp[i] = pi + num / denom;
        mm[i] = mi;
        vv[i] = vi;
      }
      ASSERT_TRUE(at::equal(st.master, p)) << "decoupled " << decoupled << " step " << step;
      ASSERT_TRUE(at::equal(st.exp_avg, m)) << decoupled;
      ASSERT_TRUE(at::equal(st.exp_avg_sq, v)) << decoupled;
    }
  }
}

// The host threads of a pass stay for the calling thread's next passes (the
// offloaded step runs ~30 ranged passes a step), and end with that thread.
TEST(CpuAdam, PassesReuseTheirThreads) {
  namespace fs = std::filesystem;
  auto threads_now = [] { return std::distance(fs::directory_iterator("/proc/self/task"), fs::directory_iterator{}); };
  OptimizerConfig o;
  PartitionState st;
  st.master = at::randn({1 << 21});  // 8 chunks
  at::Tensor g = at::randn({1 << 21});
  CpuAdamStep(st, g, 1.0, o, 1e-3);  // the moments exist: the passes below allocate nothing
  int64_t start = 0;
  std::thread([&] {
    at::set_num_threads(4);  // (OpenMP may start its own threads here)
    start = threads_now();
    CpuAdamStep(st, g, 1.0, o, 1e-3, 1 << 20, [](int64_t, int64_t) {});  // 2 ranges of 4 chunks
    EXPECT_EQ(threads_now(), start + 3) << "three workers beside this thread";
    for (int step = 0; step < 3; ++step) CpuAdamStep(st, g, 1.0, o, 1e-3, 1 << 20, [](int64_t, int64_t) {});
    EXPECT_EQ(threads_now(), start + 3) << "the same three";
  }).join();
  EXPECT_LE(threads_now(), start - 1) << "the workers joined with their thread";
}

// A child forked while the pool's workers wait for the next pass (as a
// data-loader worker or a launcher's fork would) runs the host Adam on
// threads of its own: the parent's workers do not exist there, and their
// mutex and condition variables are not touched. The child's update equals
// the parent's, bit for bit; it must not hang.
TEST(CpuAdam, AForkedChildRunsItsOwnPool) {
  OptimizerConfig o;
  PartitionState st;
  st.master = at::randn({1 << 21});  // 8 chunks
  const at::Tensor g = at::randn({1 << 21});
  CpuAdamStep(st, g, 1.0, o, 1e-3);  // the moments exist: the child's pass allocates nothing
  PartitionState want{st.master.clone(), st.exp_avg.clone(), st.exp_avg_sq.clone(), st.step.clone(), {}};
  CpuAdamStep(want, g, 1.0, o, 1e-3);
  std::thread([&] {
    at::set_num_threads(4);
    PartitionState warm{st.master.clone(), st.exp_avg.clone(), st.exp_avg_sq.clone(), st.step.clone(), {}};
    CpuAdamStep(warm, g, 1.0, o, 1e-3, 1 << 20, [](int64_t, int64_t) {});  // three workers now wait
    const pid_t child = fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
      // Nothing but the pass: no gtest, no torch kernels that would start threads.
      CpuAdamStep(st, g, 1.0, o, 1e-3, 1 << 20, [](int64_t, int64_t) {});
      const size_t bytes = static_cast<size_t>(st.master.numel()) * sizeof(float);
      const bool same = std::memcmp(st.master.data_ptr<float>(), want.master.data_ptr<float>(), bytes) == 0 &&
                        std::memcmp(st.exp_avg_sq.data_ptr<float>(), want.exp_avg_sq.data_ptr<float>(), bytes) == 0;
      _exit(same ? 0 : 1);
    }
    int status = 0;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    pid_t done = 0;
    while ((done = waitpid(child, &status, WNOHANG)) == 0 && std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    if (done == 0) {
      kill(child, SIGKILL);
      waitpid(child, &status, 0);
      FAIL() << "the forked child's host Adam hung";
    }
    ASSERT_TRUE(WIFEXITED(status)) << "the child died of signal " << WTERMSIG(status);
    EXPECT_EQ(WEXITSTATUS(status), 0) << "the child's update differs from the parent's";
  }).join();
}

// A pass run piece by piece, out of order, on other threads and thread
// counts, with and without the weights' copy, is CpuAdamStep bit for bit.
TEST(CpuAdam, APassOverPiecesIsTheWholeStep) {
  OptimizerConfig o;
  o.weight_decay = 0.1;
  const int64_t n = (1 << 19) + 1000;  // two chunks and a bit
  at::manual_seed(11);
  const at::Tensor g = at::randn({n}).to(at::kBFloat16);
  PartitionState want;
  want.master = at::randn({n});
  PartitionState st{want.master.clone(), {}, {}, {}, {}};
  for (int step = 1; step <= 2; ++step) {
    CpuAdamStep(want, g, 0.5, o, 1e-3 * step);
    const CpuAdamPass pass(st, g, 0.5, o, 1e-3 * step);
    const at::Tensor weights = at::empty({n}, at::kBFloat16);
    std::thread([&] { pass.Run(300000, n, weights.narrow(0, 300000, n - 300000), 2); }).join();
    pass.Run(7, 300000);
    pass.Run(0, 7, weights.narrow(0, 0, 7), 1);
    EXPECT_TRUE(at::equal(st.master, want.master)) << step;
    EXPECT_TRUE(at::equal(st.exp_avg_sq, want.exp_avg_sq)) << step;
    EXPECT_TRUE(at::equal(st.step, want.step)) << step;
    EXPECT_TRUE(
        at::equal(weights.narrow(0, 300000, n - 300000), want.master.narrow(0, 300000, n - 300000).to(at::kBFloat16)));
    EXPECT_TRUE(at::equal(weights.narrow(0, 0, 7), want.master.narrow(0, 0, 7).to(at::kBFloat16)));
  }
  const CpuAdamPass pass(st, g, 0.5, o, 1e-3);
  EXPECT_THROW(pass.Run(0, n + 1), std::out_of_range);
}

// RunInto: one pass whose pieces get what Run's `out` gets over each piece
// (chunks spanning pieces, a gap left unwritten), and the same update.
TEST(CpuAdam, RunIntoWritesEachPieceAsRunDoes) {
  OptimizerConfig o;
  o.weight_decay = 0.01;
  o.decoupled_weight_decay = true;
  const int64_t n = (1 << 20) + 12345;  // several jobs and a ragged end
  // [begin, end) of each piece; 300000 .. 300100 is a gap.
  const std::vector<std::pair<int64_t, int64_t>> ranges{
      {0, 5}, {5, 300000}, {300100, 300101}, {300101, 700000}, {700000, n}};
  for (at::ScalarType dtype : {at::kBFloat16, at::kHalf}) {
    at::manual_seed(5);
    PartitionState want, st;
    want.master = at::randn({n});
    st.master = want.master.clone();
    for (int step = 1; step <= 2; ++step) {
      const at::Tensor g = at::randn({n}) * 1e-2;
      at::Tensor g_want = g.clone(), g_into = g.clone();
      const CpuAdamPass by_range(want, g_want, 0.5, o, 1e-3 * step), into(st, g_into, 0.5, o, 1e-3 * step);
      std::vector<at::Tensor> a, b;
      std::vector<CpuAdamPass::WeightOut> outs;
      by_range.Run(300000, 300100);
      for (const auto& [begin, end] : ranges) {
        a.push_back(at::full({end - begin}, 7, dtype));
        by_range.Run(begin, end, a.back(), 2);
        b.push_back(at::full({end - begin}, 7, dtype));
        outs.push_back({begin, b.back()});
      }
      into.RunInto(outs, 2);
      EXPECT_TRUE(at::equal(st.master.view(at::kInt), want.master.view(at::kInt))) << dtype << step;
      EXPECT_TRUE(at::equal(st.exp_avg.view(at::kInt), want.exp_avg.view(at::kInt))) << dtype << step;
      EXPECT_TRUE(at::equal(st.exp_avg_sq.view(at::kInt), want.exp_avg_sq.view(at::kInt))) << dtype << step;
      EXPECT_EQ(g_into.abs().max().item<float>(), 0.0f) << "the whole fp32 gradient is zeroed, the gap's too";
      for (size_t k = 0; k < ranges.size(); ++k) {
        EXPECT_TRUE(at::equal(a[k].view(at::kShort), b[k].view(at::kShort))) << dtype << " piece " << k;
        const auto [begin, end] = ranges[k];
        EXPECT_TRUE(at::equal(b[k], st.master.narrow(0, begin, end - begin).to(dtype))) << dtype << " piece " << k;
      }
    }
  }
  PartitionState st;
  st.master = at::zeros({100});
  const at::Tensor g = at::zeros({100});
  const CpuAdamPass pass(st, g, 1.0, o, 1e-3);
  const at::Tensor w = at::zeros({60}, at::kBFloat16);
  EXPECT_THROW(pass.RunInto({{0, w}, {50, w}}), std::invalid_argument);                           // overlapping
  EXPECT_THROW(pass.RunInto({{50, w}}), std::invalid_argument);                                   // past the end
  EXPECT_THROW(pass.RunInto({{0, w}, {60, at::zeros({10}, at::kHalf)}}), std::invalid_argument);  // mixed dtypes
  EXPECT_THROW(pass.RunInto({{0, at::zeros({10})}}), std::invalid_argument);                      // fp32
}

TEST(CpuAdam, RefusesTensorsItCannotUpdateInPlace) {
  PartitionState st;
  st.master = at::zeros({8});
  OptimizerConfig o;
  at::Tensor wrong_size = at::zeros({7});
  EXPECT_THROW(CpuAdamStep(st, wrong_size, 1.0, o, 1e-3), std::invalid_argument);
  at::Tensor strided = at::zeros({16}).slice(0, 0, 16, 2);
  EXPECT_THROW(CpuAdamStep(st, strided, 1.0, o, 1e-3), std::invalid_argument);
  at::Tensor wide = at::zeros({8}, at::kDouble);
  EXPECT_THROW(CpuAdamStep(st, wide, 1.0, o, 1e-3), std::invalid_argument);
  at::Tensor strided_half = at::zeros({16}, at::kHalf).slice(0, 0, 16, 2);
  EXPECT_THROW(CpuAdamStep(st, strided_half, 1.0, o, 1e-3), std::invalid_argument);
}

// The gradient in the model dtype (the offloaded step's host copy): the same
// update as from its fp32 copy, bit for bit, every bf16 and fp16 value
// included (subnormals, infinities, NaN); it is only read, not zeroed.
TEST(CpuAdam, ModelDtypeGradientStepsAsItsFp32Copy) {
  OptimizerConfig o;
  o.weight_decay = 0.01;
  const int64_t n = 65536 + 300001;  // every 16-bit pattern, then ordinary gradients over several chunks
  for (at::ScalarType dtype : {at::kBFloat16, at::kHalf}) {
    for (bool ranged : {false, true}) {
      at::manual_seed(9);
      at::Tensor grad =
          at::cat({at::arange(65536, at::kInt).to(at::kShort).view(dtype), (at::randn({n - 65536}) * 1e-2).to(dtype)});
      const at::Tensor before = grad.clone();
      PartitionState narrow, wide;
      narrow.master = at::randn({n});
      wide.master = narrow.master.clone();
      for (int step = 1; step <= 3; ++step) {
        at::Tensor g32 = grad.to(at::kFloat);
        const double lr = 1e-3 * step;
        if (ranged) {
          at::Tensor a = at::empty({n}, dtype), b = at::empty({n}, dtype);
          CpuAdamStep(
              narrow, grad, 0.5, o, lr, 70000, [&](int64_t s, int64_t e) { return a.narrow(0, s, e - s); },
              [](int64_t, int64_t) {});
          CpuAdamStep(
              wide, g32, 0.5, o, lr, 70000, [&](int64_t s, int64_t e) { return b.narrow(0, s, e - s); },
              [](int64_t, int64_t) {});
          EXPECT_TRUE(at::equal(a.view(at::kShort), b.view(at::kShort))) << dtype;
        } else {
          CpuAdamStep(narrow, grad, 0.5, o, lr);
          CpuAdamStep(wide, g32, 0.5, o, lr);
        }
        EXPECT_EQ(g32.abs().max().item<float>(), 0.0f) << "an fp32 gradient is zeroed";
      }
      EXPECT_TRUE(at::equal(grad.view(at::kShort), before.view(at::kShort))) << dtype << ": only read";
      // NaN compares unequal: compare the bits.
      EXPECT_TRUE(at::equal(narrow.master.view(at::kInt), wide.master.view(at::kInt))) << dtype << " " << ranged;
      EXPECT_TRUE(at::equal(narrow.exp_avg.view(at::kInt), wide.exp_avg.view(at::kInt))) << dtype << " " << ranged;
      EXPECT_TRUE(at::equal(narrow.exp_avg_sq.view(at::kInt), wide.exp_avg_sq.view(at::kInt))) << dtype;
    }
  }
}

// ZeRO-3's host gradient under offload_optimizer is a grad_accum_dtype (16-bit)
// accumulation buffer: with zero_16bit_grad the pass zeroes it behind the
// update (Run and RunInto), stepping as from the kept copy.
TEST(CpuAdam, SixteenBitAccumulationBufferIsZeroedBehindTheUpdate) {
  OptimizerConfig o;
  const int64_t n = 200003;
  for (at::ScalarType dtype : {at::kBFloat16, at::kHalf}) {
    for (bool into : {false, true}) {
      at::manual_seed(10);
      at::Tensor grad = (at::randn({n}) * 1e-2).to(dtype);
      at::Tensor kept = grad.clone();
      PartitionState zeroed, reference;
      zeroed.master = at::randn({n});
      reference.master = zeroed.master.clone();
      const CpuAdamPass a(zeroed, grad, 0.5, o, 1e-3, /*zero_16bit_grad=*/true);
      const CpuAdamPass b(reference, kept, 0.5, o, 1e-3);
      if (into) {
        at::Tensor wa = at::empty({n}, dtype), wb = at::empty({n}, dtype);
        a.RunInto({{0, wa}});
        b.RunInto({{0, wb}});
        EXPECT_TRUE(at::equal(wa.view(at::kShort), wb.view(at::kShort))) << dtype;
      } else {
        a.Run(0, n);
        b.Run(0, n);
      }
      EXPECT_EQ(grad.to(at::kFloat).abs().max().item<float>(), 0.0f) << dtype << " " << into << ": zeroed";
      EXPECT_GT(kept.to(at::kFloat).abs().max().item<float>(), 0.0f) << dtype << ": without the flag, only read";
      EXPECT_TRUE(at::equal(zeroed.master.view(at::kInt), reference.master.view(at::kInt))) << dtype << " " << into;
    }
  }
}

}  // namespace
}  // namespace uckpt::engine

namespace uckpt::engine {
namespace {

TEST(SumOfSquares, EqualsTheSquaredNormInDouble) {
  at::manual_seed(3);
  at::Tensor x = at::randn({1000003});  // several chunks and a ragged end
  const double want = at::pow(x.to(at::kDouble).norm(2), 2).item<double>();
  EXPECT_NEAR(SumOfSquares(x), want, want * 1e-12);
  EXPECT_EQ(SumOfSquares(at::zeros({5})), 0.0);
  EXPECT_THROW(SumOfSquares(x.to(at::kDouble)), std::invalid_argument);
}

// PieceSumsOfSquares: each piece's sum as SumOfSquares gives it alone, bit
// for bit (the norms' summation order is kept); values over many decades
// make any other order round differently.
TEST(SumOfSquares, PiecesSumAsEachAlone) {
  at::manual_seed(4);
  const int64_t chunk = 1 << 18;
  const int64_t n = 20 * chunk + 777;
  const at::Tensor x = at::randn({n}) * at::exp(at::randn({n}) * 4);
  const std::vector<std::pair<int64_t, int64_t>> pieces{{0, 3 * chunk + 5},
                                                        {3 * chunk + 5, 0},
                                                        {3 * chunk + 5, 7},
                                                        {100, 8 * chunk},  // overlapping is fine
                                                        {4 * chunk, 9 * chunk + 1},
                                                        {13 * chunk + 1, n - 13 * chunk - 1},
                                                        {n - 1, 1}};
  const std::vector<double> sums = PieceSumsOfSquares(x, pieces);
  ASSERT_EQ(sums.size(), pieces.size());
  for (size_t k = 0; k < pieces.size(); ++k) {
    const double alone = SumOfSquares(x.narrow(0, pieces[k].first, pieces[k].second));
    EXPECT_EQ(std::memcmp(&sums[k], &alone, sizeof alone), 0) << "piece " << k << ": " << sums[k] << " " << alone;
  }
  EXPECT_TRUE(PieceSumsOfSquares(x, {}).empty());
  EXPECT_THROW(PieceSumsOfSquares(x, {{n - 1, 2}}), std::out_of_range);
  EXPECT_THROW(PieceSumsOfSquares(x.to(at::kDouble), {{0, 1}}), std::invalid_argument);
}

// A 16-bit gradient (stage 3's host accumulation buffer under offload_optimizer,
// in grad_accum_dtype) gives the sums of its exact fp32 copy, bit for bit, and
// fp16's subnormals and infinities widen as c10::Half's do.
TEST(SumOfSquares, SixteenBitPiecesSumAsTheirFp32Copy) {
  at::manual_seed(5);
  const int64_t n = 3 * (1 << 18) + 321;
  const at::Tensor x = at::randn({n}) * at::exp(at::randn({n}) * 3);
  const std::vector<std::pair<int64_t, int64_t>> pieces{{0, 1000}, {1000, n - 2000}, {n - 1000, 1000}, {5, 0}};
  for (at::ScalarType dtype : {at::kBFloat16, at::kHalf}) {
    at::Tensor half = x.to(dtype);
    if (dtype == at::kHalf) {  // subnormals and an infinity among the values
      half.narrow(0, 0, 4).copy_(at::tensor({1e-7f, -3e-6f, 6e-8f, INFINITY}).to(dtype));
    }
    const std::vector<double> got = PieceSumsOfSquares(half, pieces);
    const std::vector<double> want = PieceSumsOfSquares(half.to(at::kFloat), pieces);
    ASSERT_EQ(got.size(), want.size());
    for (size_t k = 0; k < pieces.size(); ++k)
      EXPECT_EQ(std::memcmp(&got[k], &want[k], sizeof want[k]), 0)
          << c10::toString(dtype) << " piece " << k << ": " << got[k] << " " << want[k];
  }
}

}  // namespace
}  // namespace uckpt::engine
