// Resharding plans (ckpt/reshard.h) on real DeepSpeed checkpoints: the
// partition a new rank reads straight from the old rank files equals, byte
// for byte, the one it reads from the converted universal checkpoint (cut by
// LoadUniversalPartition, and planned by the same planner from the universal
// folder's files), at every world size 1-4; each rank reads exactly its partition's real bytes
// and over all ranks every byte of optimizer state is read once.
#include <gtest/gtest.h>

#include <cstring>

#include "ckpt/convert.h"
#include "ckpt/partition.h"
#include "ckpt/reshard.h"
#include "ckpt/universal_checkpoint.h"
#include "ckpt/values.h"
#include "format/error.h"
#include "test_util.h"

namespace uckpt::ckpt {
namespace {

using testing::DsFixture;
using testing::Shared;
using testing::TempDir;

std::vector<TargetParam> GroupParams(const UniversalCheckpoint& u, size_t g) {
  std::vector<TargetParam> params;
  for (const auto& p : u.groups[g]) params.push_back({p.name, p.numel});
  return params;
}

int64_t Total(const std::vector<TargetParam>& params) {
  int64_t n = 0;
  for (const auto& p : params) n += p.numel;
  return n;
}

// Runs the reads of `key` into a zeroed buffer of target.length elements.
std::vector<uint8_t> Read(const ReadSource& source, const PartitionTarget& target, const std::string& key,
                          uint64_t* bytes, DType* dtype) {
  StateReads reads = PlanStateReads(source, target, key);
  std::vector<uint8_t> out(static_cast<size_t>(target.length) * DTypeSize(reads.dtype), 0);
  std::vector<ReadBatch> batch{{{out.data(), out.size()}, reads.pieces}};
  *bytes = ExecuteReads(batch, ReadOptions{2, 4096});  // small chunks: split over both threads
  *dtype = reads.dtype;
  return out;
}

// `z` converted by `uckpt convert` into `tmp`/universal, opened: the reference.
UniversalCheckpoint ConvertInto(const ZeroCheckpoint& z, const TempDir& tmp) {
  ConvertOptions co;
  co.durable = false;
  ConvertToUniversal(z, tmp / "universal", co);
  return OpenUniversalCheckpoint(tmp / "universal");
}

void ExpectFlatReshardMatchesConvert(const std::string& folder) {
  SCOPED_TRACE(folder);
  const ZeroCheckpoint z = OpenZeroCheckpoint(folder);
  TempDir tmp;
  const UniversalCheckpoint u = ConvertInto(z, tmp);
  std::vector<std::string> keys{"fp32"};
  keys.insert(keys.end(), z.state_keys.begin(), z.state_keys.end());
  // The same planner over the universal folder's files gives the same partitions.
  std::vector<std::string> names;
  for (const auto& g : u.groups)
    for (const auto& p : g) names.push_back(p.name);
  const UniversalStates universal = MapUniversalStates(u, names, keys);
  const ReadSource zero = ZeroReadSource(z);
  for (int dp = 1; dp <= 4; ++dp) {
    uint64_t all_ranks = 0;
    for (int rank = 0; rank < dp; ++rank) {
      uint64_t this_rank = 0, want_rank = 0;
      for (size_t g = 0; g < u.groups.size(); ++g) {
        const auto params = GroupParams(u, g);
        const PartitionTarget target = FlatPartitionTarget(params, dp, rank);
        const FlatLayout layout = MakeFlatLayout(Total(params), dp);
        for (const auto& key : keys) {
          const std::string what =
              key + " group " + std::to_string(g) + " at " + std::to_string(dp) + " rank " + std::to_string(rank);
          uint64_t bytes = 0;
          DType dtype{};
          std::vector<uint8_t> got = Read(zero, target, key, &bytes, &dtype);
          DType want_dtype{};
          std::vector<uint8_t> want = LoadUniversalPartition(u, g, key, dp, rank, &want_dtype);
          EXPECT_EQ(dtype, want_dtype) << what;
          EXPECT_TRUE(got == want) << what << ": differs from the converted checkpoint's partition";
          uint64_t universal_bytes = 0;
          EXPECT_TRUE(Read(universal.source, target, key, &universal_bytes, &want_dtype) == want)
              << what << ": planned from the universal folder";
          EXPECT_EQ(universal_bytes, bytes) << what;
          this_rank += bytes;
          want_rank += static_cast<uint64_t>(layout.real_numel(rank)) * DTypeSize(dtype);
        }
      }
      EXPECT_EQ(this_rank, want_rank) << "rank " << rank << " of " << dp << " reads only its real elements";
      all_ranks += this_rank;
    }
    EXPECT_EQ(all_ranks, z.total_bytes()) << "over " << dp << " ranks every optimizer byte is read once";
  }
}

TEST(Reshard, DeepSpeedFixturesAtEveryWorldSize) {
  for (const char* f : {"z1_ws2_bf16", "z1_ws2_fp16", "z1_ws2_fp32", "z2_ws2_fp32", "z2_ws2_gas2_fp32", "z2_ws3_fp32"})
    ExpectFlatReshardMatchesConvert(DsFixture(f) + "/ckpt/global_step5");
}

// DeepSpeed's own re-sharding of its ZeRO-3 checkpoint at 3 ranks (only rank
// 0's model-states file: DeepSpeed wrote every rank's to that name).
TEST(Reshard, DeepSpeedZero3ReshardedAtThreeRanksAtEveryWorldSize) {
  ExpectFlatReshardMatchesConvert(DsFixture("z3_ws2_fp32") + "/resharded_ws3/global_step5");
}

TEST(Reshard, RefrunGpt2AtEveryWorldSize) {
  ExpectFlatReshardMatchesConvert(Shared() + "/fixtures/refrun-gpt2/ckpt/global_step6");
}

// A stage-3 source (per-parameter partitions) into flat and stage-3 targets.
TEST(Reshard, Stage3SourceIntoFlatAndStage3Targets) {
  const std::string folder = DsFixture("z3_ws2_fp32") + "/ckpt/global_step5";
  ExpectFlatReshardMatchesConvert(folder);
  const ZeroCheckpoint z = OpenZeroCheckpoint(folder);
  TempDir tmp;
  const UniversalCheckpoint u = ConvertInto(z, tmp);
  std::vector<std::string> names;
  for (const auto& g : u.groups)
    for (const auto& p : g) names.push_back(p.name);
  const UniversalStates universal = MapUniversalStates(u, names, {"fp32", "exp_avg", "exp_avg_sq"});
  for (const std::string key : {"fp32", "exp_avg", "exp_avg_sq"})
    for (int dp = 1; dp <= 4; ++dp) {
      uint64_t all_ranks = 0;
      for (int rank = 0; rank < dp; ++rank) {
        for (size_t s = 0; s < u.groups.size(); ++s) {
          const auto params = GroupParams(u, s);
          const PartitionTarget target = Stage3PartitionTarget(params, dp, rank);
          uint64_t bytes = 0;
          DType dtype{};
          std::vector<uint8_t> got = Read(ZeroReadSource(z), target, key, &bytes, &dtype);
          uint64_t universal_bytes = 0;
          DType universal_dtype{};
          EXPECT_TRUE(Read(universal.source, target, key, &universal_bytes, &universal_dtype) == got)
              << key << " sub-group " << s << " at " << dp << " rank " << rank << ": planned from the universal folder";
          EXPECT_EQ(universal_bytes, bytes);
          // Expected: each parameter's slice of its universal tensor, padded to its partition size.
          std::vector<uint8_t> want(got.size(), 0);
          const size_t es = DTypeSize(dtype);
          int64_t at = 0;
          for (const auto& p : params) {
            const int64_t ps = Stage3PartitionSize(p.numel, dp), real = Stage3RealNumel(p.numel, dp, rank);
            if (real > 0) {
              LoadedState st = LoadUniversalState(u, p.name, key);
              auto b = TensorElements(*st.tensor, rank * ps, real, p.name);
              std::memcpy(want.data() + at * es, b.data(), b.size());
            }
            at += ps;
          }
          EXPECT_EQ(at, target.length);
          EXPECT_TRUE(got == want) << key << " sub-group " << s << " at " << dp << " rank " << rank;
          all_ranks += bytes;
        }
      }
      uint64_t key_bytes = 0;
      for (const auto& p : z.params)
        for (const auto& st : p.states)
          if (st.key == key) key_bytes += st.bytes();
      EXPECT_EQ(all_ranks, key_bytes) << key << " over " << dp << " ranks: every byte once";
    }
}

TEST(Reshard, ClearErrorsForAnotherModel) {
  const ZeroCheckpoint z = OpenZeroCheckpoint(DsFixture("z2_ws2_fp32") + "/ckpt/global_step5");
  PartitionTarget missing = FlatPartitionTarget({{"no.such.weight", 10}}, 2, 0);
  try {
    PlanStateReads(z, missing, "fp32");
    FAIL() << "no error";
  } catch (const FormatError& e) {
    EXPECT_NE(std::string(e.what()).find("no.such.weight"), std::string::npos) << e.what();
  }
  PartitionTarget wrong = FlatPartitionTarget({{z.params[0].name, z.params[0].numel + 1}}, 2, 0);
  EXPECT_THROW(PlanStateReads(z, wrong, "fp32"), FormatError);
  // As many elements in another shape: named with the file listing the shapes.
  std::vector<int64_t> shape = z.params[1].shape;
  ASSERT_EQ(shape.size(), 2u);
  std::swap(shape[0], shape[1]);
  PartitionTarget transposed = FlatPartitionTarget({{z.params[1].name, z.params[1].numel, shape}}, 2, 0);
  try {
    PlanStateReads(z, transposed, "fp32");
    FAIL() << "no error for another shape";
  } catch (const FormatError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("mp_rank_00_model_states.pt"), std::string::npos) << m;
    EXPECT_NE(m.find(z.params[1].name), std::string::npos) << m;
  }
  PartitionTarget ok = FlatPartitionTarget({{z.params[0].name, z.params[0].numel}}, 2, 0);
  EXPECT_THROW(PlanStateReads(z, ok, "momentum_buffer"), FormatError);
  EXPECT_FALSE(HasState(z, "momentum_buffer"));
  EXPECT_TRUE(HasState(z, "exp_avg"));
  std::vector<uint8_t> small(4);
  std::vector<ReadBatch> bad{{{small.data(), small.size()}, {ReadPiece{{small.data(), 4}, 2}}}};
  EXPECT_THROW(ExecuteReads(bad), std::invalid_argument);
}

}  // namespace
}  // namespace uckpt::ckpt
