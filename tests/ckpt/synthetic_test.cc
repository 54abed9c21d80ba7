// Checkpoints written by our ZeRO writer: world sizes 1-8, odd sizes, hundreds
// of parameters in several groups, tiny parameters whose padding spans ranks;
// conversion recovers every value exactly, the universal output does not
// depend on the world size it came from, and re-partitioning it for world
// sizes 1-8 gives exactly the partitions of a checkpoint written at that size.
#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <random>

#include "ckpt/convert.h"
#include "ckpt/universal_checkpoint.h"
#include "ckpt/values.h"
#include "ckpt/zero_writer.h"
#include "format/torch_file.h"
#include "test_util.h"

namespace uckpt::ckpt {
namespace {

using testing::ListFiles;
using testing::ReadFile;
using testing::TempDir;

// A model of 255 parameters in three groups, and a distinct float for every
// element of every state.
class Model {
 public:
  explicit Model(std::vector<std::string> keys) : keys_(std::move(keys)) {
    std::mt19937 rng(1234);
    std::vector<std::pair<size_t, size_t>> sizes = {{0, 150}, {1, 100}, {2, 5}};
    for (auto [g, count] : sizes) {
      std::vector<ZeroParam> group;
      for (size_t i = 0; i < count; ++i) {
        ZeroParam p{"g" + std::to_string(g) + ".layer" + std::to_string(i) + ".weight", {}};
        if (g == 2) {
          p.shape = {static_cast<int64_t>(std::vector<int>{1, 2, 3, 1, 5}[i])};  // padding spans ranks
        } else if (i % 3 == 0) {
          p.shape = {static_cast<int64_t>(rng() % 37 + 1), static_cast<int64_t>(rng() % 29 + 1)};
        } else {
          p.shape = {static_cast<int64_t>(rng() % 700 + 1)};
        }
        group.push_back(p);
      }
      groups_.push_back(group);
    }
    size_t index = 0;
    for (const auto& g : groups_)
      for (const auto& p : g) {
        int64_t n = NumelOf(p.shape);
        for (const auto& k : AllKeys()) {
          std::vector<float> v(n);
          for (int64_t e = 0; e < n; ++e) v[e] = static_cast<float>(index * 1000003 + e) * 1e-3f + Offset(k);
          data_[{index, k}] = std::move(v);
        }
        names_.push_back(p.name);
        ++index;
      }
  }

  ZeroWriteSpec Spec(int stage, int dp) const {
    ZeroWriteSpec s;
    s.stage = stage;
    s.dp = dp;
    s.groups = groups_;
    s.state_keys = keys_;
    s.sub_group_size = 700;  // several ZeRO-3 sub-groups
    s.source = [this](size_t p, const std::string& key, int64_t first, int64_t count,
                      std::vector<std::span<const uint8_t>>* pieces) {
      const auto& v = data_.at({p, key});
      pieces->emplace_back(reinterpret_cast<const uint8_t*>(v.data() + first), static_cast<size_t>(count) * 4);
    };
    return s;
  }

  std::vector<std::string> AllKeys() const {
    std::vector<std::string> k = {"fp32"};
    k.insert(k.end(), keys_.begin(), keys_.end());
    return k;
  }
  const std::vector<std::vector<ZeroParam>>& groups() const { return groups_; }
  const std::vector<float>& Data(size_t p, const std::string& key) const { return data_.at({p, key}); }
  const std::vector<std::string>& names() const { return names_; }

 private:
  static float Offset(const std::string& k) { return k == "fp32" ? 0.f : k == "exp_avg" ? 0.25f : 0.5f; }
  std::vector<std::string> keys_;
  std::vector<std::vector<ZeroParam>> groups_;
  std::map<std::pair<size_t, std::string>, std::vector<float>> data_;
  std::vector<std::string> names_;
};

ConvertOptions Quiet() {
  ConvertOptions o;
  o.threads = 2;
  o.durable = false;
  return o;
}

// Every per-parameter file holds exactly the model's values.
void ExpectValues(const Model& m, const std::string& universal, bool stage3, bool step = true) {
  UniversalCheckpoint u = OpenUniversalCheckpoint(universal);
  EXPECT_EQ(u.zero3, stage3);
  size_t p = 0;
  for (const auto& g : m.groups())
    for (const auto& param : g) {
      for (const auto& key : m.AllKeys()) {
        LoadedState s = LoadUniversalState(u, param.name, key);
        EXPECT_EQ(s.tensor->shape, stage3 ? std::vector<int64_t>{NumelOf(param.shape)} : param.shape) << param.name;
        EXPECT_EQ(s.tensor->requires_grad, key == "fp32");
        const auto& want = m.Data(p, key);
        auto got = s.tensor->contiguous_bytes();
        ASSERT_EQ(got.size(), want.size() * 4) << param.name << " " << key;
        EXPECT_EQ(std::memcmp(got.data(), want.data(), got.size()), 0) << param.name << " " << key;
      }
      EXPECT_EQ(std::filesystem::exists(universal + "/zero/" + param.name + "/step.pt"), step && !stage3);
      ++p;
    }
}

// The universal output is independent of the world size it was made from,
// byte for byte (optimizer_state.pt records that size and is left out).
void ExpectSameParamFiles(const std::string& a, const std::string& b) {
  auto files = ListFiles(a + "/zero");
  EXPECT_EQ(files, ListFiles(b + "/zero"));
  for (const auto& f : files) {
    if (f == "optimizer_state.pt") continue;
    EXPECT_EQ(ReadFile(a + "/zero/" + f), ReadFile(b + "/zero/" + f)) << f;
  }
}

TEST(Synthetic, Stage12RoundTripWorldSizes1To8) {
  Model m({"exp_avg", "exp_avg_sq"});
  for (int stage : {1, 2}) {
    SCOPED_TRACE("stage " + std::to_string(stage));
    TempDir tmp;
    for (int dp = 1; dp <= 8; ++dp) {
      const std::string z = tmp / ("z" + std::to_string(dp)), u = tmp / ("u" + std::to_string(dp));
      WriteZeroCheckpoint(z, m.Spec(stage, dp));
      ConvertStats st = ConvertToUniversal(z, u, Quiet());
      EXPECT_EQ(st.params, 255u);
      if (dp == 1 || dp == 7) ExpectValues(m, u, false);
      if (dp > 1) ExpectSameParamFiles(tmp / "u1", u);
    }
    // Re-partition the universal checkpoint for every world size and compare
    // with the checkpoint written directly at that size.
    UniversalCheckpoint u = OpenUniversalCheckpoint(tmp / "u5");
    for (int dp = 1; dp <= 8; ++dp) {
      for (int r = 0; r < dp; ++r) {
        TorchFile f = LoadTorchFile(
            tmp / ("z" + std::to_string(dp) + "/zero_pp_rank_" + std::to_string(r) + "_mp_rank_00_optim_states.pt"));
        ValuePtr osd = f.root->get("optimizer_state_dict");
        for (size_t g = 0; g < 3; ++g) {
          ValuePtr st = GetIntKey(osd->get("base_optimizer_state")->get("state"), static_cast<int64_t>(g));
          for (const char* key : {"exp_avg", "exp_avg_sq"}) {
            auto want = st->get(key)->tensor->contiguous_bytes();
            auto got = LoadUniversalPartition(u, g, key, dp, r);
            EXPECT_EQ(got, want) << "dp " << dp << " rank " << r << " group " << g << " " << key;
          }
          // fp32: the lean partition, then zeros.
          const Tensor& lean = *osd->get("single_partition_of_fp32_groups")->items[g]->tensor;
          auto want = lean.contiguous_bytes();
          auto got = LoadUniversalPartition(u, g, "fp32", dp, r);
          ASSERT_GE(got.size(), want.size());
          EXPECT_TRUE(std::equal(want.begin(), want.end(), got.begin())) << "dp " << dp << " rank " << r;
          EXPECT_TRUE(std::all_of(got.begin() + want.size(), got.end(), [](uint8_t b) { return b == 0; }));
        }
      }
    }
  }
}

TEST(Synthetic, BF16OptimizerFiles) {
  Model m({"exp_avg", "exp_avg_sq"});
  TempDir tmp;
  for (int dp : {1, 3, 8}) {
    ZeroWriteSpec s = m.Spec(1, dp);
    s.bf16_optimizer = true;
    s.optim_prefix = "bf16_";
    const std::string z = tmp / ("z" + std::to_string(dp)), u = tmp / ("u" + std::to_string(dp));
    WriteZeroCheckpoint(z, s);
    ZeroCheckpoint c = OpenZeroCheckpoint(z);
    EXPECT_TRUE(c.bf16_optimizer);
    EXPECT_EQ(c.optim_prefix, "bf16_");
    ConvertToUniversal(c, u, Quiet());
    ExpectValues(m, u, false);
    // BF16_Optimizer's optimizer_state.pt has no loss scaler or zero_stage.
    TorchFile opt = LoadTorchFile(u + "/zero/optimizer_state.pt");
    EXPECT_EQ(opt.root->get("zero_stage"), nullptr);
    EXPECT_NE(opt.root->get("param_groups"), nullptr);
  }
}

// ZeRO-3 at world sizes 1-8 with several sub-groups. Tiny parameters (numel
// 1, 2, 3, 5) at large world sizes are exactly where DeepSpeed's converter
// leaks padding (its abs() bug): ours keeps exactly numel elements.
TEST(Synthetic, Stage3WorldSizes1To8) {
  Model m({"exp_avg", "exp_avg_sq"});
  TempDir tmp;
  for (int dp = 1; dp <= 8; ++dp) {
    const std::string z = tmp / ("z" + std::to_string(dp)), u = tmp / ("u" + std::to_string(dp));
    WriteZeroCheckpoint(z, m.Spec(3, dp));
    ZeroCheckpoint c = OpenZeroCheckpoint(z);
    EXPECT_EQ(c.stage, 3);
    EXPECT_GT(c.model.root->get("param_shapes")->items.size(), 3u);  // sub-groups
    ConvertToUniversal(c, u, Quiet());
    if (dp == 1 || dp >= 6) ExpectValues(m, u, true);
    if (dp > 1) ExpectSameParamFiles(tmp / "u1", u);
  }
}

// Any per-element optimizer state converts, not only Adam's.
TEST(Synthetic, SgdMomentum) {
  Model m({"momentum_buffer"});
  TempDir tmp;
  WriteZeroCheckpoint(tmp / "z", m.Spec(2, 3));
  ZeroCheckpoint c = OpenZeroCheckpoint(tmp / "z");
  EXPECT_EQ(c.state_keys, std::vector<std::string>{"momentum_buffer"});
  ConvertToUniversal(c, tmp / "u", Quiet());
  ExpectValues(m, tmp / "u", false);
  EXPECT_FALSE(std::filesystem::exists(tmp / "u/zero/g0.layer0.weight/exp_avg.pt"));
}

// Saved before the first optimizer step: no optimizer state, only fp32
// masters (DeepSpeed's converter cannot convert this at all).
TEST(Synthetic, NoOptimizerStateYet) {
  Model m({});
  TempDir tmp;
  WriteZeroCheckpoint(tmp / "z", m.Spec(2, 2));
  ConvertToUniversal(tmp / "z", tmp / "u", Quiet());
  ExpectValues(m, tmp / "u", false, /*step=*/false);
}

}  // namespace
}  // namespace uckpt::ckpt
