// The sharded runtime's interface (engine/sharded_runtime.h) as both stages
// implement it, and the step's shared gradient numerics (engine/grad_numerics.h).
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "engine/flat_runtime.h"
#include "engine/grad_numerics.h"
#include "engine/zero3_runtime.h"
#include "uckpt/comm.h"

namespace uckpt::engine {
namespace {

TEST(ShardedRuntime, FlatSlotsAreTheGroupsPartitions) {
  auto comm = MakeSingleProcessComm();
  ZeroSettings s;
  s.stage = 2;
  std::vector<GroupSpec> specs = {{{3, 5}, s.optimizer, {"a.w", "a.b"}, {{3}, {5}}},
                                  {{4}, s.optimizer, {"b"}, {{2, 2}}}};
  FlatRuntime z(*comm, specs, s);
  ShardedRuntime& r = z;
  const std::vector<PartitionSlot> slots = r.Slots();
  ASSERT_EQ(slots.size(), 2u);
  for (size_t g = 0; g < 2; ++g) {
    EXPECT_EQ(slots[g].group, g);
    EXPECT_EQ(slots[g].state, &z.state(g));
    EXPECT_EQ(slots[g].target.length, z.state(g).master.numel());
  }
  EXPECT_EQ(slots[0].target.params[1].name, "a.b");
  EXPECT_EQ(slots[0].target.params[1].numel, 5);
  EXPECT_EQ(slots[1].target.params[0].shape, (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(slots[1].step_param, "b");
  EXPECT_TRUE(r.group_weights(1).is_same(z.model_flat(1)));  // what the module entries view
  EXPECT_EQ(r.stats().unit_gathers, 0);
  EXPECT_FALSE(r.partitions_parameters());
  at::Tensor x = at::ones({2});
  EXPECT_TRUE(r.EnterUnit(0, x).is_same(x));  // nothing to gather
}

TEST(ShardedRuntime, Stage3SlotsAreTheSubGroupsAndMastersComeFromThePartitions) {
  auto comm = MakeSingleProcessComm();
  Zero3Settings s;
  s.sub_group_size = 4;  // one sub-group per parameter
  std::vector<std::vector<std::pair<std::string, at::Tensor>>> groups = {
      {{"x", at::arange(6, at::kFloat).view({2, 3})}, {"y", at::arange(5, at::kFloat)}}};
  Zero3Runtime z(*comm, groups, {s.base.optimizer}, {{-1, -1}}, 0, s, at::kCPU);
  ShardedRuntime& r = z;
  const std::vector<PartitionSlot> slots = r.Slots();
  ASSERT_EQ(slots.size(), z.sub_groups().size());
  ASSERT_EQ(slots.size(), 2u);
  for (size_t i = 0; i < slots.size(); ++i) {
    EXPECT_EQ(slots[i].state, &z.sub_groups()[i].state);
    EXPECT_EQ(slots[i].step_param, "x");  // the model's first parameter's, as the universal load takes it
  }
  EXPECT_EQ(slots[0].target.params[0].shape, (std::vector<int64_t>{2, 3}));
  EXPECT_FALSE(r.group_weights(0).defined());  // no flat buffer: parameters partitioned one by one
  EXPECT_TRUE(r.partitions_parameters());
  for (auto& sg : z.sub_groups()) sg.state.master.zero_();
  r.MastersFromWeights();
  EXPECT_TRUE(at::equal(z.sub_groups()[1].state.master, at::arange(5, at::kFloat)));
}

// Stage 3's fp32 gradient partitions are held from a step's first reduce to
// its update only (the forward's activation peak does not carry them), except
// in host memory under offload_optimizer, where they stay allocated.
TEST(ShardedRuntime, Stage3GradientPartitionsAreNotHeldBetweenSteps) {
  for (bool offload : {false, true}) {
    auto comm = MakeSingleProcessComm();
    Zero3Settings s;
    s.base.offload_optimizer_cpu = offload;
    at::Tensor w = at::arange(6, at::kFloat).requires_grad_(true);
    Zero3Runtime z(*comm, {{{"w", w}}}, {s.base.optimizer}, {{-1}}, 0, s, at::kCPU);
    EXPECT_EQ(z.sub_groups()[0].grad.defined(), offload) << "offload " << offload;
    for (int step = 0; step < 2; ++step) {
      w.mutable_grad() = at::full({6}, 0.5f);
      z.FinishBackward(true);
      ASSERT_TRUE(z.sub_groups()[0].grad.defined());
      EXPECT_TRUE(at::equal(z.sub_groups()[0].grad, at::full({6}, 0.5f))) << "step " << step << ": accumulated once";
      z.Step({1e-3});
      EXPECT_EQ(z.sub_groups()[0].grad.defined(), offload) << "offload " << offload << " step " << step;
      if (offload) {
        EXPECT_EQ(z.sub_groups()[0].grad.abs().sum().item<float>(), 0.f);
      }
    }
  }
}

// A reduced bucket reaches the host gradient partitions in pieces
// (host_staging_elements) that straddle parameters and sub-groups: every
// element lands where one whole piece would put it.
TEST(ShardedRuntime, Stage3ReducedGradientsArriveInPiecesAtTheirPlaces) {
  const std::vector<int64_t> numels = {6, 5, 7, 1, 9};
  auto grads_after_backward = [&](int64_t piece) {
    auto comm = MakeSingleProcessComm();
    Zero3Settings s;
    s.base.offload_optimizer_cpu = true;
    s.sub_group_size = 12;  // several sub-groups
    s.host_staging_elements = piece;
    std::vector<std::pair<std::string, at::Tensor>> group;
    std::vector<int> units;
    for (size_t i = 0; i < numels.size(); ++i) {
      group.push_back({"p" + std::to_string(i), at::zeros({numels[i]}).requires_grad_(true)});
      units.push_back(-1);
    }
    Zero3Runtime z(*comm, {group}, {s.base.optimizer}, {units}, 0, s, at::kCPU);
    for (size_t i = 0; i < group.size(); ++i)
      group[i].second.mutable_grad() = at::arange(numels[i], at::kFloat) + 100.f * static_cast<float>(i);
    z.FinishBackward(true);
    std::vector<at::Tensor> out;
    for (const auto& sg : z.sub_groups()) out.push_back(sg.grad.clone());
    return out;
  };
  const std::vector<at::Tensor> whole = grads_after_backward(int64_t{1} << 30);
  ASSERT_GT(whole.size(), 1u);
  EXPECT_GT(whole[0].abs().sum().item<float>(), 0.f);
  for (int64_t piece : {1, 3, 4, 7}) {
    const std::vector<at::Tensor> pieces = grads_after_backward(piece);
    ASSERT_EQ(pieces.size(), whole.size());
    for (size_t g = 0; g < whole.size(); ++g)
      EXPECT_TRUE(at::equal(pieces[g], whole[g])) << "piece " << piece << " sub-group " << g;
  }
}

TEST(GradNumerics, OverflowIsAnInfOrNanInAnyGradient) {
  auto comm = MakeSingleProcessComm();
  const at::Tensor fine = at::ones({3});
  at::Tensor inf = at::ones({2}), nan = at::ones({2});
  inf[1] = std::numeric_limits<float>::infinity();
  nan[0] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_FALSE(AnyRankOverflowed(*comm, {fine, fine}, at::kCPU));
  EXPECT_TRUE(AnyRankOverflowed(*comm, {fine, inf}, at::kCPU));
  EXPECT_TRUE(AnyRankOverflowed(*comm, {nan, fine}, at::kCPU));
}

TEST(GradNumerics, GlobalNormIsTheNormOfTheGroupsNorms) {
  auto comm = MakeSingleProcessComm();
  const auto fp64 = [](std::vector<double> v) { return at::tensor(v, at::kDouble); };
  const at::Tensor a = GroupGradNormStacked(*comm, fp64({3, 4}), at::kFloat, at::kCPU, false);
  EXPECT_EQ(a.scalar_type(), at::kFloat);
  EXPECT_EQ(a.item<float>(), 5.0f);
  const at::Tensor b = GroupGradNormStacked(*comm, fp64({12}), at::kFloat, at::kCPU, true);
  bool finite = false;
  EXPECT_EQ(GlobalGradNorm({a, b}, &finite).item<float>(), 13.0f);
  EXPECT_TRUE(finite);
  GlobalGradNorm({a, at::scalar_tensor(std::numeric_limits<float>::infinity())}, &finite);
  EXPECT_FALSE(finite);
  EXPECT_EQ(GroupGradNormStacked(*comm, fp64({}), at::kDouble, at::kCPU, false).item<double>(), 0.0);
}

// Both stages' per-piece norms: each piece's fp64 2-norm, the same whether
// pieces are converted to fp64 together (stages 1/2) or one by one (stage 3).
TEST(GradNumerics, PieceNormsAreEachPiecesFp64NormForAnySpan) {
  const at::Tensor grad = at::randn({40}, at::kFloat);
  const std::vector<GradPiece> pieces = {{0, 7}, {7, 3}, {12, 20}, {35, 5}};
  const at::Tensor one_by_one = PieceNorms(grad, pieces, at::kCPU, 0);
  ASSERT_EQ(one_by_one.numel(), 4);
  EXPECT_EQ(one_by_one.scalar_type(), at::kDouble);
  for (size_t i = 0; i < pieces.size(); ++i)
    EXPECT_EQ(one_by_one[i].item<double>(),
              at::norm(grad.narrow(0, pieces[i].offset, pieces[i].numel).to(at::kDouble), 2).item<double>());
  EXPECT_TRUE(at::equal(PieceNorms(grad, pieces, at::kCPU, 40), one_by_one));
  EXPECT_TRUE(at::equal(PieceNorms(grad, pieces, at::kCPU, 12), one_by_one));
  EXPECT_EQ(PieceNorms(grad, {}, at::kCPU, 40).numel(), 0);
}

// DeepSpeed's unscale_and_clip_grads: 1 / (scale * max(1, (norm/scale + 1e-6) / clip)).
TEST(GradNumerics, UnscaleAndClipIsDeepSpeedsFactorInTheNormsDtype) {
  const double scale = 3, clip = 0.5, norm = 7.25;
  const double expected = 1.0 / (std::max(1.0, (norm / scale + 1e-6) / clip) * scale);
  const UnscaleAndClip fp64(at::scalar_tensor(norm, at::kDouble), scale, clip);
  EXPECT_EQ(fp64.host_factor(), expected);
  const UnscaleAndClip fp32(at::scalar_tensor(norm, at::kFloat), scale, clip);
  EXPECT_EQ(fp32.host_factor(), static_cast<double>(static_cast<float>(fp32.host_factor())));
  EXPECT_NEAR(fp32.host_factor(), expected, 1e-7);
  // Without clipping: 1 / scale, rounded to fp32 only for an fp32 norm.
  EXPECT_EQ(UnscaleAndClip(at::scalar_tensor(norm, at::kDouble), scale, 0).host_factor(), 1.0 / scale);
  EXPECT_EQ(UnscaleAndClip(at::scalar_tensor(norm, at::kFloat), scale, 0).host_factor(),
            static_cast<double>(static_cast<float>(1.0 / scale)));
  // Applied on a device tensor, the factor is the host one.
  for (const UnscaleAndClip* u : {&fp64, &fp32}) {
    at::Tensor g = at::linspace(-2, 2, 9);
    const at::Tensor want = g * static_cast<float>(u->host_factor());
    u->Apply(g);
    EXPECT_TRUE(at::equal(g, want));
  }
}

}  // namespace
}  // namespace uckpt::engine
