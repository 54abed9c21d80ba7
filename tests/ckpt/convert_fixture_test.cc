// uckpt's conversion of real DeepSpeed 0.14.5 checkpoints against DeepSpeed's
// own ds_to_universal output (shared/fixtures/deepspeed, refrun-gpt2).
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "ckpt/convert.h"
#include "ckpt/manifest.h"
#include "ckpt/universal_checkpoint.h"
#include "ckpt/values.h"
#include "format/torch_file.h"
#include "format/value_json.h"
#include "test_util.h"

namespace uckpt::ckpt {
namespace {

using testing::DsFixture;
using testing::ListFiles;
using testing::ReadFile;
using testing::TempDir;

const char* kFixtures[] = {"z1_ws2_bf16",      "z1_ws2_fp16", "z1_ws2_fp32", "z2_ws2_fp32",
                           "z2_ws2_gas2_fp32", "z2_ws3_fp32", "z3_ws2_fp32"};

ConvertOptions Quiet(int threads = 2) {
  ConvertOptions o;
  o.threads = threads;
  o.durable = false;
  return o;
}

nlohmann::json Json(const std::string& path) {
  JsonOptions o;
  o.values_limit = 0;  // tensors by dtype/shape/stride/requires_grad/sha256
  return ValueToJson(*LoadTorchFile(path).root, o);
}

// Every file of `theirs` exists in `ours` with the same value tree (keys,
// types, non-tensor values, tensor dtype/shape/stride/requires_grad and
// SHA-256 of the data), and ours has one more: its manifest. Returns the
// files whose bytes differ.
std::set<std::string> CompareFolders(const std::string& ours, const std::string& theirs) {
  std::set<std::string> differ;
  auto a = ListFiles(ours), b = ListFiles(theirs);
  EXPECT_EQ(a.erase(kManifestName), 1u) << ours << " has no " << kManifestName;
  EXPECT_EQ(a, b) << ours << " vs " << theirs;
  for (const auto& f : b) {
    if (!a.count(f)) continue;
    if (ReadFile(ours + "/" + f) == ReadFile(theirs + "/" + f)) continue;
    differ.insert(f);
    EXPECT_EQ(Json(ours + "/" + f), Json(theirs + "/" + f)) << f;
  }
  return differ;
}

class DeepSpeedFixture : public ::testing::TestWithParam<const char*> {};

// Check A: ZeRO checkpoint -> universal equals DeepSpeed's universal output.
TEST_P(DeepSpeedFixture, ConvertEqualsDeepSpeedUniversal) {
  const std::string fx = DsFixture(GetParam());
  TempDir tmp;
  ConvertStats st = ConvertToUniversal(fx + "/ckpt/global_step5", tmp / "global_step5_universal", Quiet());
  EXPECT_EQ(st.params, 30u);
  auto differ = CompareFolders(tmp / "global_step5_universal", fx + "/ckpt/global_step5_universal");
  // Every file, ZeRO-3's optimizer_state.pt with its several tensors too: the
  // pickle refers back to the persistent ids' 'storage' and 'cpu' (BINGET) as
  // Python's pickler does.
  EXPECT_TRUE(differ.empty()) << "byte-different files: " << differ.size() << ", first "
                              << (differ.empty() ? "" : *differ.begin());
  EXPECT_EQ(ReadFile(tmp / "latest_universal"), "global_step5_universal");
}

// The tensors also match the manifest's SHA-256s, which were computed
// independently of DeepSpeed's files.
TEST_P(DeepSpeedFixture, TensorsMatchManifest) {
  const std::string fx = DsFixture(GetParam());
  TempDir tmp;
  ConvertToUniversal(fx + "/ckpt/global_step5", tmp / "u", Quiet(1));
  auto manifest = nlohmann::json::parse(ReadFile(fx + "/manifest.json"));
  int checked = 0;
  for (const auto& [name, p] : manifest["universal"]["params"].items()) {
    for (const char* state : {"fp32", "exp_avg", "exp_avg_sq", "step"}) {
      if (!p.contains(state)) continue;
      const auto& m = p[state];
      auto root = LoadTorchFile(tmp / ("u/zero/" + name + "/" + state + ".pt")).root;
      ValuePtr t = m["container"] == "dict" ? root->get("param") : root;
      ASSERT_TRUE(t && t->tensor) << name << " " << state;
      const auto& expect = m["container"] == "dict" ? m["param"] : m;
      EXPECT_EQ(Sha256Hex(t->tensor->contiguous_bytes()), expect["sha256"].get<std::string>()) << name << " " << state;
      EXPECT_EQ(t->tensor->shape, expect["shape"].get<std::vector<int64_t>>()) << name << " " << state;
      ++checked;
    }
  }
  EXPECT_GE(checked, 90);
}

// Check C: DeepSpeed's own re-sharded state (saved right after loading the
// universal checkpoint at another world size) converts back to the same
// per-parameter files. DeepSpeed fails this for ZeRO-3 (its bug 3: every rank
// wrote zero_pp_rank_0's model states, so its converter infers dp 1); uckpt
// reads the world size from the optimizer files and converts it correctly.
TEST_P(DeepSpeedFixture, ReshardedConvertsBackToTheSameParams) {
  const std::string fx = DsFixture(GetParam());
  std::string resharded;
  for (const auto& e : std::filesystem::directory_iterator(fx))
    if (e.path().filename().string().rfind("resharded_ws", 0) == 0) resharded = e.path().string() + "/global_step5";
  ASSERT_FALSE(resharded.empty());
  TempDir tmp;
  ConvertToUniversal(resharded, tmp / "u", Quiet());
  const std::string theirs = fx + "/ckpt/global_step5_universal/zero";
  int same = 0;
  for (const auto& f : ListFiles(theirs)) {
    if (f == "optimizer_state.pt") continue;  // records the world size, which differs
    EXPECT_EQ(ReadFile(tmp / ("u/zero/" + f)), ReadFile(theirs + "/" + f)) << f;
    ++same;
  }
  EXPECT_GE(same, 90);
}

// Check B, for uckpt's re-partitioning (what a trainer resuming at another
// world size needs): the partitions cut from DeepSpeed's universal checkpoint
// for the new world size equal what DeepSpeed itself built when it loaded it
// there (resharded_ws<M>): optimizer states with zero padding, fp32 masters.
class Stage12Fixture : public ::testing::TestWithParam<const char*> {};

TEST_P(Stage12Fixture, RepartitionEqualsDeepSpeedResharding) {
  const std::string fx = DsFixture(GetParam());
  std::string resharded;
  for (const auto& e : std::filesystem::directory_iterator(fx))
    if (e.path().filename().string().rfind("resharded_ws", 0) == 0) resharded = e.path().string() + "/global_step5";
  ZeroCheckpoint z = OpenZeroCheckpoint(resharded);
  UniversalCheckpoint u = OpenUniversalCheckpoint(fx + "/ckpt/global_step5_universal");
  for (int r = 0; r < z.dp; ++r) {
    ValuePtr osd = z.optim[r].root->get("optimizer_state_dict");
    ValuePtr st = GetIntKey(osd->get("base_optimizer_state")->get("state"), 0);
    for (const char* key : {"exp_avg", "exp_avg_sq"})
      EXPECT_EQ(LoadUniversalPartition(u, 0, key, z.dp, r), st->get(key)->tensor->contiguous_bytes()) << key << r;
    auto lean = osd->get("single_partition_of_fp32_groups")->items[0]->tensor->contiguous_bytes();
    auto full = LoadUniversalPartition(u, 0, "fp32", z.dp, r);
    ASSERT_GE(full.size(), lean.size());
    EXPECT_TRUE(std::equal(lean.begin(), lean.end(), full.begin())) << "fp32 rank " << r;
  }
}

INSTANTIATE_TEST_SUITE_P(All, DeepSpeedFixture, ::testing::ValuesIn(kFixtures),
                         [](const auto& info) { return std::string(info.param); });
INSTANTIATE_TEST_SUITE_P(All, Stage12Fixture, ::testing::ValuesIn(kFixtures, kFixtures + 6),
                         [](const auto& info) { return std::string(info.param); });

// GPT-2 with tied embeddings (shared_params), ZeRO-2, ws 2, and DeepSpeed's
// re-sharded ws 4 state of it.
TEST(RefrunGpt2, ConvertEqualsDeepSpeedUniversal) {
  const std::string fx = testing::Shared() + "/fixtures/refrun-gpt2";
  TempDir tmp;
  ConvertToUniversal(fx + "/ckpt/global_step6", tmp / "global_step6_universal", Quiet());
  EXPECT_TRUE(CompareFolders(tmp / "global_step6_universal", fx + "/ckpt/global_step6_universal").empty());
  ConvertToUniversal(fx + "/resharded_ws4/global_step6", tmp / "r", Quiet(3));
  for (const auto& f : ListFiles(fx + "/ckpt/global_step6_universal/zero")) {
    if (f == "optimizer_state.pt") continue;  // records the world size
    EXPECT_EQ(ReadFile(tmp / ("r/zero/" + f)), ReadFile(fx + "/ckpt/global_step6_universal/zero/" + f)) << f;
  }
}

}  // namespace
}  // namespace uckpt::ckpt
