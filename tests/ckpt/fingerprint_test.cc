// The state fingerprint (ckpt/fingerprint.h): its definition, and that a
// DeepSpeed ZeRO folder, DeepSpeed's own universal conversion of it, its
// re-sharded state at another world size and uckpt's conversion all give the
// same value, which `uckpt convert` records.
#include "ckpt/fingerprint.h"

#include <gtest/gtest.h>
#include <xxhash.h>

#include <cstring>
#include <filesystem>
#include <functional>

#include "ckpt/convert.h"
#include "ckpt/manifest.h"
#include "ckpt/reshard.h"
#include "ckpt/zero_checkpoint.h"
#include "ckpt/zero_writer.h"
#include "format/dtype.h"
#include "format/error.h"
#include "test_util.h"

namespace uckpt::ckpt {
namespace {

using testing::DsFixture;
using testing::TempDir;

uint32_t Bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

// The documented formula, written out element by element.
uint64_t Reference(const std::string& name, const std::string& key, int64_t start, const std::vector<float>& xs) {
  const std::string s = name + "/" + key;
  const uint64_t seed = XXH64(s.data(), s.size(), 0);
  uint64_t sum = 0;
  for (size_t j = 0; j < xs.size(); ++j) {
    uint64_t z = (seed + static_cast<uint64_t>(start + static_cast<int64_t>(j)) * 0x9E3779B97F4A7C15ull) ^
                 (static_cast<uint64_t>(Bits(xs[j])) << 32);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    sum += z ^ (z >> 31);
  }
  return sum;
}

std::vector<float> Values(size_t n) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<float>(i) * 0.37f - 5.0f;
  return v;
}

uint64_t OfFloats(uint64_t seed, int64_t start, const std::vector<float>& xs, size_t from, size_t n) {
  std::vector<uint32_t> bits(n);
  for (size_t j = 0; j < n; ++j) bits[j] = Bits(xs[from + j]);
  return FingerprintBits(seed, start, bits);
}

TEST(Fingerprint, IsTheDocumentedSumAndCombinesOverPieces) {
  const std::vector<float> xs = Values(1000);
  const uint64_t seed = FingerprintSeed("h.0.mlp.c_fc.weight", "exp_avg");
  const uint64_t whole = OfFloats(seed, 0, xs, 0, xs.size());
  EXPECT_EQ(whole, Reference("h.0.mlp.c_fc.weight", "exp_avg", 0, xs));
  // Pieces hashed with their global element indices add up to the whole.
  EXPECT_EQ(OfFloats(seed, 0, xs, 0, 333) + OfFloats(seed, 333, xs, 333, 600) + OfFloats(seed, 933, xs, 933, 67),
            whole);
  // One element changed, two swapped, another name or key: another value.
  std::vector<float> changed = xs;
  changed[500] = std::nextafter(changed[500], 1e9f);
  EXPECT_NE(OfFloats(seed, 0, changed, 0, xs.size()), whole);
  std::vector<float> swapped = xs;
  std::swap(swapped[1], swapped[2]);
  EXPECT_NE(OfFloats(seed, 0, swapped, 0, xs.size()), whole);
  EXPECT_NE(OfFloats(FingerprintSeed("h.0.mlp.c_fc.weight", "exp_avg_sq"), 0, xs, 0, xs.size()), whole);
  EXPECT_NE(OfFloats(FingerprintSeed("h.0.mlp.c_fc.bias", "exp_avg"), 0, xs, 0, xs.size()), whole);
}

TEST(Fingerprint, DependsOnValuesNotOnTheStorageDtype) {
  // Values exact in bf16 give the same sum from bf16, fp16 and fp32 bytes.
  std::vector<float> xs = {1.0f, -2.5f, 0.0f, 3.0f, 0.125f, -96.0f};
  const uint64_t seed = FingerprintSeed("w", "fp32");
  std::vector<uint8_t> f32(xs.size() * 4), b16(xs.size() * 2), h16(xs.size() * 2);
  for (size_t i = 0; i < xs.size(); ++i) {
    std::memcpy(&f32[i * 4], &xs[i], 4);
    uint16_t b = FloatToBFloat16(xs[i]), h = FloatToHalf(xs[i]);
    std::memcpy(&b16[i * 2], &b, 2);
    std::memcpy(&h16[i * 2], &h, 2);
  }
  const uint64_t want = FingerprintElements(seed, 7, DType::kFloat32, f32);
  EXPECT_EQ(want, Reference("w", "fp32", 7, xs));
  EXPECT_EQ(FingerprintElements(seed, 7, DType::kBFloat16, b16), want);
  EXPECT_EQ(FingerprintElements(seed, 7, DType::kFloat16, h16), want);
}

TEST(Fingerprint, JsonRoundTripsAndRefusesABadTotal) {
  StateFingerprint f;
  f.params.push_back({"a", 3, {{"fp32", 1}, {"exp_avg", 2}, {"exp_avg_sq", 3}}});
  f.params.push_back({"b", 4, {{"fp32", ~uint64_t{0}}, {"exp_avg", 5}, {"exp_avg_sq", 6}}});
  f.counters.global_steps = 10;
  f.counters.loss_scale = 65536;
  f.counters.optimizer_step = 9;
  const nlohmann::json j = FingerprintToJson(f);
  const StateFingerprint g = FingerprintFromJson(j, "m.json");
  EXPECT_EQ(g.total(), f.total());
  EXPECT_EQ(g.sums(), f.sums());
  EXPECT_FALSE(FirstFingerprintDifference(f, g));
  nlohmann::json bad = j;
  bad["total"] = HashToHex(f.total() + 1);
  EXPECT_THROW(FingerprintFromJson(bad, "m.json"), FormatError);
  // The first difference names the parameter and the key.
  StateFingerprint h = g;
  h.params[1].states[1].second ^= 1;
  auto d = FirstFingerprintDifference(f, h);
  ASSERT_TRUE(d);
  EXPECT_NE(d->find("parameter b 'exp_avg'"), std::string::npos) << *d;
  FingerprintScope masters_only;
  masters_only.optimizer = false;
  EXPECT_FALSE(FirstFingerprintDifference(f, h, masters_only));
  h = g;
  h.counters.global_steps = 11;
  d = FirstFingerprintDifference(f, h);
  ASSERT_TRUE(d);
  EXPECT_NE(d->find("global_steps"), std::string::npos) << *d;
}

class FixtureFingerprint : public ::testing::TestWithParam<const char*> {};

// DeepSpeed's ZeRO files, DeepSpeed's universal folder and uckpt's
// conversion: one state, one fingerprint; the conversion records it.
TEST_P(FixtureFingerprint, ZeroFolderAndUniversalConversionsAgree) {
  const std::string ckpt = DsFixture(GetParam()) + "/ckpt";
  const StateFingerprint zero = FingerprintFolder(ckpt + "/global_step5");
  ASSERT_GT(zero.params.size(), 0u);
  EXPECT_GT(zero.tensors(), zero.params.size());  // Adam's moments too
  EXPECT_TRUE(zero.counters.optimizer_step);
  const StateFingerprint ds_universal = FingerprintFolder(ckpt + "/global_step5_universal");
  EXPECT_EQ(ds_universal.total(), zero.total());
  EXPECT_FALSE(FirstFingerprintDifference(zero, ds_universal)) << *FirstFingerprintDifference(zero, ds_universal);

  TempDir tmp;
  ConvertOptions o;
  o.durable = false;
  ConvertToUniversal(ckpt + "/global_step5", tmp / "u", o);
  const StateFingerprint ours = FingerprintFolder(tmp / "u");
  EXPECT_EQ(ours.total(), zero.total());
  EXPECT_FALSE(FirstFingerprintDifference(zero, ours));
  const Manifest m = ReadManifest(tmp / "u");
  ASSERT_TRUE(m.state);
  EXPECT_EQ(m.state->total(), zero.total());
  EXPECT_FALSE(FirstFingerprintDifference(*m.state, zero));

  // Split over 3 "ranks" by parameter, the shares add up.
  const ZeroCheckpoint z = OpenZeroCheckpoint(ckpt + "/global_step5");
  std::vector<uint64_t> sum(zero.tensors(), 0);
  for (int r = 0; r < 3; ++r) {
    auto part = FingerprintZeroCheckpoint(z, r, 3).sums();
    for (size_t k = 0; k < sum.size(); ++k) sum[k] += part[k];
  }
  EXPECT_EQ(sum, zero.sums());
}

// DeepSpeed's own re-sharded state at another world size holds the same tensors.
TEST_P(FixtureFingerprint, DeepSpeedReshardedStateHasTheSameTensors) {
  const std::string resharded = DsFixture(GetParam()) + "/resharded_ws3/global_step5";
  if (!std::filesystem::exists(resharded)) GTEST_SKIP() << "no resharded_ws3 in this fixture";
  const StateFingerprint zero = FingerprintFolder(DsFixture(GetParam()) + "/ckpt/global_step5");
  const StateFingerprint again = FingerprintFolder(resharded);
  EXPECT_EQ(again.sums(), zero.sums());
}

// A load's reads hashed where they land, each piece placed by the files' own
// layout (SourceFingerprintIndex): over the ranks of any world size the
// shares add up to the folder's fingerprint, and they agree with the same
// memory hashed by where the load meant each element to go (what the engine
// then holds) unless a piece went to the wrong place, came from the wrong
// bytes or was left out.
TEST(Fingerprint, ReadsHashedByTheFilesLayoutAgreeOnlyWithACorrectLoad) {
  TempDir tmp;
  ZeroWriteSpec spec;
  spec.stage = 2;
  spec.dp = 2;
  spec.groups = {{{"wte", {30, 20}}, {"b", {7}}, {"c", {5, 3}}}};
  spec.source = PatternSource();
  WriteZeroCheckpoint(tmp / "z", spec);
  const ZeroCheckpoint z = OpenZeroCheckpoint(tmp / "z");
  const StateFingerprint whole = FingerprintZeroCheckpoint(z);
  const ReadSource source = ZeroReadSource(z);
  const SourceFingerprintIndex index(source);
  std::vector<TargetParam> params;
  for (const ParamPlan& p : z.params) params.push_back({p.name, p.numel, p.shape});
  auto sum_at = [&](const std::string& param, const std::string& key) -> size_t {
    size_t k = 0;
    for (const ParamFingerprint& p : whole.params)
      for (const auto& kv : p.states) {
        if (p.name == param && kv.first == key) return k;
        ++k;
      }
    ADD_FAILURE() << param << "/" << key;
    return 0;
  };
  // The files' shares and the held state's, over `dp` ranks; `bug` edits rank 0's fp32 reads.
  using Pieces = std::vector<ReadPiece>;
  auto load = [&](int dp, const std::function<void(Pieces&)>& bug) {
    std::pair<std::vector<uint64_t>, std::vector<uint64_t>> sums{std::vector<uint64_t>(whole.tensors(), 0),
                                                                 std::vector<uint64_t>(whole.tensors(), 0)};
    for (int r = 0; r < dp; ++r) {
      const PartitionTarget target = FlatPartitionTarget(params, dp, r);
      for (const std::string key : {"fp32", "exp_avg", "exp_avg_sq"}) {
        StateReads reads = PlanStateReads(source, target, key);
        if (r == 0 && key == "fp32") bug(reads.pieces);
        std::vector<uint8_t> buffer(static_cast<size_t>(target.length) * 4, 0);
        const ReadBatch batch{buffer, reads.pieces};
        ExecuteReads({&batch, 1});
        for (const ReadPiece& piece : reads.pieces)
          for (const auto& part : index.Locate(piece.from)) {
            const auto& st = index.states()[part.state];
            sums.first[sum_at(st.param, st.key)] += FingerprintElements(
                st.seed, part.start, st.dtype, {buffer.data() + piece.to + part.offset, part.bytes});
          }
        for (const TargetFragment& f : target.fragments) {
          const std::string& name = target.params[f.param].name;
          sums.second[sum_at(name, key)] +=
              FingerprintElements(FingerprintSeed(name, key), f.param_offset, DType::kFloat32,
                                  {buffer.data() + f.offset * 4, static_cast<size_t>(f.numel) * 4});
        }
      }
    }
    return sums;
  };
  for (int dp : {1, 2, 3, 5}) {
    const auto [files, held] = load(dp, [](Pieces&) {});
    EXPECT_EQ(files, whole.sums()) << dp << " ranks";
    EXPECT_EQ(held, whole.sums()) << dp << " ranks";
  }
  const std::vector<std::pair<const char*, std::function<void(Pieces&)>>> bugs = {
      {"one element later",
       [](Pieces& p) {
         p[0].from = p[0].from.subspan(0, p[0].from.size() - 4);
         p[0].to += 4;
       }},
      {"from the wrong bytes",
       [](Pieces& p) {
         p[0].from = {p[0].from.data() + 4, p[0].from.size() - 4};
       }},
      {"left out", [](Pieces& p) { p.erase(p.begin()); }},
  };
  for (const auto& [what, bug] : bugs) {
    const auto [files, held] = load(3, bug);
    EXPECT_NE(files, held) << what;
  }
}

INSTANTIATE_TEST_SUITE_P(DeepSpeed, FixtureFingerprint,
                         ::testing::Values("z1_ws2_fp32", "z1_ws2_bf16", "z1_ws2_fp16", "z2_ws2_fp32", "z2_ws3_fp32",
                                           "z2_ws2_gas2_fp32", "z3_ws2_fp32"));

TEST(Fingerprint, OldManifestsWithoutARecordStillRead) {
  TempDir tmp;
  std::filesystem::create_directories(tmp / "f");
  { std::ofstream(tmp / "f/a.bin") << "x"; }
  WriteManifest(tmp / "f", false);
  EXPECT_FALSE(ReadManifest(tmp / "f").state);
  EXPECT_TRUE(CheckManifest(tmp / "f").ok());
}

// A parameter far larger than one job (4 MiB of a state): its pieces are
// spread over the shares (ranks) and threads, and every way of splitting
// gives the documented sum of its values.
TEST(Fingerprint, ALargeParameterIsSplitOverShares) {
  TempDir tmp;
  ZeroWriteSpec spec;
  spec.stage = 2;
  spec.dp = 2;
  spec.groups = {{{"wte", {1500, 2000}}, {"b", {7}}}};  // 3 M elements: 12 MiB per state
  spec.source = PatternSource();
  const std::string folder = tmp / "z";
  WriteZeroCheckpoint(folder, spec);
  const ZeroCheckpoint z = OpenZeroCheckpoint(folder);

  const StateFingerprint whole = FingerprintZeroCheckpoint(z, 0, 1, 1);
  for (const std::string key : {"fp32", "exp_avg_sq"}) {
    std::vector<float> xs(3000000);
    for (size_t e = 0; e < xs.size(); ++e) xs[e] = PatternValue(0, key, static_cast<int64_t>(e));
    EXPECT_EQ(*whole.params[0].find(key), Reference("wte", key, 0, xs)) << key;
  }
  for (int threads : {1, 3}) {
    std::vector<uint64_t> sum(whole.tensors(), 0);
    for (int r = 0; r < 2; ++r) {
      const StateFingerprint part = FingerprintZeroCheckpoint(z, r, 2, threads);
      EXPECT_NE(*part.params[0].find("fp32"), 0u) << "share " << r << " has none of wte's fp32 to hash";
      const std::vector<uint64_t> sums = part.sums();
      for (size_t k = 0; k < sum.size(); ++k) sum[k] += sums[k];
    }
    EXPECT_EQ(sum, whole.sums()) << threads << " threads";
  }
}

}  // namespace
}  // namespace uckpt::ckpt
