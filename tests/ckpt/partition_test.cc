#include "ckpt/partition.h"

#include <gtest/gtest.h>

#include <numeric>

namespace uckpt::ckpt {
namespace {

// The worked example of the ZeRO spec §6: dp 4, params a:[3,4], b:[6], c:[7].
TEST(Partition, SpecWorkedExample) {
  std::vector<int64_t> numels = {12, 6, 7};
  FlatLayout l = MakeFlatLayout(25, 4);
  EXPECT_EQ(l.alignment(), 8);
  EXPECT_EQ(l.padded_numel, 32);
  EXPECT_EQ(l.partition_size, 8);
  EXPECT_EQ(l.padding(0), 0);
  EXPECT_EQ(l.padding(3), 7);
  EXPECT_EQ(l.legacy_padding(3), 7);

  auto r1 = RankFragments(numels, 4, 1);
  ASSERT_EQ(r1.size(), 2u);
  EXPECT_EQ(r1[0].param, 0u);
  EXPECT_EQ(r1[0].partition_offset, 0);
  EXPECT_EQ(r1[0].param_offset, 8);
  EXPECT_EQ(r1[0].numel, 4);
  EXPECT_EQ(r1[1].param, 1u);
  EXPECT_EQ(r1[1].partition_offset, 4);
  EXPECT_EQ(r1[1].param_offset, 0);
  EXPECT_EQ(r1[1].numel, 4);

  auto r2 = RankFragments(numels, 4, 2);
  ASSERT_EQ(r2.size(), 2u);
  EXPECT_EQ(r2[0].param, 1u);
  EXPECT_EQ(r2[0].numel, 2);
  EXPECT_EQ(r2[1].param, 2u);
  EXPECT_EQ(r2[1].partition_offset, 2);
  EXPECT_EQ(r2[1].numel, 6);

  auto r3 = RankFragments(numels, 4, 3);
  ASSERT_EQ(r3.size(), 1u);
  EXPECT_EQ(r3[0].param_offset, 6);
  EXPECT_EQ(r3[0].numel, 1);

  auto c = ParamFragments(numels, 4, 2);
  ASSERT_EQ(c.size(), 2u);
  EXPECT_EQ(c[0].rank, 2);
  EXPECT_EQ(c[1].rank, 3);
}

// One 1-element parameter on 4 ranks: padding spans several ranks.
TEST(Partition, PaddingOverSeveralRanks) {
  FlatLayout l = MakeFlatLayout(1, 4);
  EXPECT_EQ(l.padded_numel, 8);
  EXPECT_EQ(l.partition_size, 2);
  EXPECT_EQ(l.padding(0), 1);
  EXPECT_EQ(l.padding(1), 2);
  EXPECT_EQ(l.padding(3), 2);
  EXPECT_EQ(l.legacy_padding(0), 0);
  EXPECT_EQ(l.legacy_padding(3), 7);
  std::vector<int64_t> numels = {1};
  EXPECT_EQ(RankFragments(numels, 4, 0).size(), 1u);
  EXPECT_TRUE(RankFragments(numels, 4, 1).empty());
}

// The fixtures' model (3425 elements): the paddings the README lists.
TEST(Partition, FixturePaddings) {
  EXPECT_EQ(MakeFlatLayout(3425, 2).padded_numel, 3428);
  EXPECT_EQ(MakeFlatLayout(3425, 3).padded_numel, 3426);
  EXPECT_EQ(MakeFlatLayout(3425, 4).padded_numel, 3432);
  EXPECT_EQ(MakeFlatLayout(3425, 2).padding(1), 3);
  EXPECT_EQ(MakeFlatLayout(3425, 3).padding(2), 1);
  EXPECT_EQ(MakeFlatLayout(3425, 4).padding(3), 7);
}

// Every element of every parameter is covered exactly once, in order, and the
// rank view and the parameter view agree.
TEST(Partition, FragmentsTileTheFlatBuffer) {
  std::vector<int64_t> numels = {1, 0, 407, 88, 11, 3, 0, 5, 1, 2};
  int64_t total = std::accumulate(numels.begin(), numels.end(), int64_t{0});
  auto offsets = FlatOffsets(numels);
  for (int dp = 1; dp <= 9; ++dp) {
    FlatLayout l = MakeFlatLayout(total, dp);
    int64_t covered = 0;
    std::vector<Fragment> by_rank;
    for (int r = 0; r < dp; ++r) {
      int64_t used = 0;
      for (const Fragment& f : RankFragments(numels, dp, r)) {
        EXPECT_EQ(f.partition_offset, used) << "dp " << dp << " rank " << r;
        EXPECT_EQ(offsets[f.param] + f.param_offset, l.begin(r) + f.partition_offset);
        used += f.numel;
        by_rank.push_back(f);
      }
      EXPECT_EQ(used, l.real_numel(r)) << "dp " << dp << " rank " << r;
      covered += used;
    }
    EXPECT_EQ(covered, total);
    std::vector<Fragment> by_param;
    for (size_t p = 0; p < numels.size(); ++p) {
      int64_t at = 0;
      for (const Fragment& f : ParamFragments(numels, dp, p)) {
        EXPECT_EQ(f.param_offset, at);
        at += f.numel;
        by_param.push_back(f);
      }
      EXPECT_EQ(at, numels[p]);
    }
    ASSERT_EQ(by_rank.size(), by_param.size());
    for (size_t i = 0; i < by_rank.size(); ++i) {
      EXPECT_EQ(by_rank[i].rank, by_param[i].rank);
      EXPECT_EQ(by_rank[i].partition_offset, by_param[i].partition_offset);
    }
  }
}

// Backward's buckets: whole parameters from the last one backwards, a bucket
// closed once it reaches the size; together they tile the flat buffer.
TEST(Partition, ReverseBucketsTileTheBufferBackwards) {
  const std::vector<int64_t> numels{3000, 7, 70001, 11, 5000, 0};
  const ReverseBuckets plan = PlanReverseBuckets(numels, 4000);
  ASSERT_EQ(plan.buckets.size(), 3u);
  EXPECT_EQ(plan.bucket_of, (std::vector<size_t>{2, 2, 1, 1, 0, 0}));
  EXPECT_EQ(plan.buckets[0].begin, 73019);  // {5, 4}: 5000 elements reach 4000
  EXPECT_EQ(plan.buckets[0].numel, 5000);
  EXPECT_EQ(plan.buckets[0].params, 2);
  EXPECT_EQ(plan.buckets[1].begin, 3007);  // {3, 2}
  EXPECT_EQ(plan.buckets[1].numel, 70012);
  EXPECT_EQ(plan.buckets[2].begin, 0);  // {1, 0}
  EXPECT_EQ(plan.buckets[2].numel, 3007);
  // A bucket size of one element: a bucket per parameter.
  EXPECT_EQ(PlanReverseBuckets(numels, 1).buckets.size(), 5u);  // the empty one joins its predecessor's
  EXPECT_TRUE(PlanReverseBuckets({}, 10).buckets.empty());
}

TEST(Partition, Stage3) {
  EXPECT_EQ(Stage3PartitionSize(407, 2), 204);
  EXPECT_EQ(Stage3RealNumel(407, 2, 1), 203);
  // numel 5 on 4 ranks: ps 2; ranks own 2, 2, 1, 0 (DeepSpeed's abs() says 2, 2, 1, 1).
  EXPECT_EQ(Stage3RealNumel(5, 4, 2), 1);
  EXPECT_EQ(Stage3RealNumel(5, 4, 3), 0);
  EXPECT_EQ(Stage3RealNumel(1, 4, 3), 0);
  EXPECT_EQ(Stage3PartitionSize(0, 4), 0);
  std::vector<int64_t> numels = {10, 10, 10, 10};
  EXPECT_EQ(Stage3SubGroups(numels, 2, 1000000000), std::vector<size_t>{4});
  EXPECT_EQ(Stage3SubGroups(numels, 2, 10), (std::vector<size_t>{2, 2}));
  EXPECT_EQ(Stage3SubGroups(numels, 2, 11), (std::vector<size_t>{3, 1}));
}

TEST(Partition, RejectsBadSizes) {
  EXPECT_THROW(MakeFlatLayout(10, 0), std::invalid_argument);
  EXPECT_THROW(MakeFlatLayout(-1, 2), std::invalid_argument);
}

}  // namespace
}  // namespace uckpt::ckpt
