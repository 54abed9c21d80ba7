// `uckpt export` and `uckpt inspect DIR` on the DeepSpeed fixtures.
#include <gtest/gtest.h>

#include <cstring>
#include <nlohmann/json.hpp>

#include "ckpt/export.h"
#include "ckpt/inspect.h"
#include "ckpt/universal_checkpoint.h"
#include "format/dtype.h"
#include "format/error.h"
#include "format/value_json.h"
#include "test_util.h"

namespace uckpt::ckpt {
namespace {

using testing::DsFixture;
using testing::ReadFile;
using testing::TempDir;

struct Safetensors {
  nlohmann::json header;
  std::string data;
  std::string Bytes(const std::string& name) const {
    auto off = header.at(name).at("data_offsets");
    return data.substr(off[0].get<size_t>(), off[1].get<size_t>() - off[0].get<size_t>());
  }
};

// Parses the file by the format's definition and checks its invariants: the
// header length, 8-byte aligned data, offsets that tile the data exactly.
Safetensors ReadSafetensors(const std::string& path) {
  std::string b = ReadFile(path);
  EXPECT_GE(b.size(), 8u);
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= static_cast<uint64_t>(static_cast<uint8_t>(b[i])) << (8 * i);
  EXPECT_EQ((8 + n) % 8, 0u);
  Safetensors s{nlohmann::json::parse(b.substr(8, n)), b.substr(8 + n)};
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  for (const auto& [k, v] : s.header.items())
    if (k != "__metadata__")
      ranges.emplace_back(v["data_offsets"][0].get<uint64_t>(), v["data_offsets"][1].get<uint64_t>());
  std::sort(ranges.begin(), ranges.end());
  uint64_t at = 0;
  for (auto [b0, e0] : ranges) {
    EXPECT_EQ(b0, at);
    at = e0;
  }
  EXPECT_EQ(at, s.data.size());
  return s;
}

const char* kFixtures[] = {"z1_ws2_bf16",      "z1_ws2_fp16", "z1_ws2_fp32", "z2_ws2_fp32",
                           "z2_ws2_gas2_fp32", "z2_ws3_fp32", "z3_ws2_fp32"};

class ExportFixture : public ::testing::TestWithParam<const char*> {};

// The exported fp32 weights are the manifest's full fp32 parameters, from the
// ZeRO checkpoint and from DeepSpeed's universal checkpoint alike.
TEST_P(ExportFixture, Fp32EqualsManifest) {
  const std::string fx = DsFixture(GetParam());
  auto manifest = nlohmann::json::parse(ReadFile(fx + "/manifest.json"));
  TempDir tmp;
  ExportStats a = ExportSafetensors(fx + "/ckpt/global_step5", tmp / "zero.safetensors");
  ExportStats b = ExportSafetensors(fx + "/ckpt/global_step5_universal", tmp / "universal.safetensors");
  EXPECT_EQ(a.tensors, 30u);
  EXPECT_EQ(b.tensors, 30u);
  EXPECT_EQ(ReadFile(tmp / "zero.safetensors"), ReadFile(tmp / "universal.safetensors"));
  Safetensors s = ReadSafetensors(tmp / "zero.safetensors");
  EXPECT_EQ(s.header["__metadata__"]["format"], "pt");
  for (const auto& p : manifest["params"]) {
    const std::string name = p["name"];
    const auto& u = manifest["universal"]["params"][name]["fp32"];
    const auto& expect = u["container"] == "dict" ? u["param"] : u;
    ASSERT_TRUE(s.header.contains(name)) << name;
    EXPECT_EQ(s.header[name]["dtype"], "F32");
    EXPECT_EQ(s.header[name]["shape"], p["shape"]) << name;
    std::string bytes = s.Bytes(name);
    EXPECT_EQ(Sha256Hex({reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()}), expect["sha256"]) << name;
  }
}

INSTANTIATE_TEST_SUITE_P(All, ExportFixture, ::testing::ValuesIn(kFixtures),
                         [](const auto& info) { return std::string(info.param); });

// Tied embeddings: written once, alias in the metadata; bf16 output rounds
// each fp32 value to nearest even.
TEST(Export, TiedParamsAndBf16) {
  const std::string fx = testing::Shared() + "/fixtures/refrun-gpt2";
  TempDir tmp;
  ExportStats st = ExportSafetensors(fx + "/ckpt", tmp / "f.safetensors");  // parent: latest names the tag
  EXPECT_EQ(st.tensors, 28u);
  EXPECT_EQ(st.aliases, 1u);
  ExportSafetensors(fx + "/ckpt/global_step6", tmp / "b.safetensors", DType::kBFloat16);
  Safetensors f = ReadSafetensors(tmp / "f.safetensors"), b = ReadSafetensors(tmp / "b.safetensors");
  EXPECT_EQ(f.header["__metadata__"]["lm_head.weight"], "transformer.wte.weight");
  EXPECT_FALSE(f.header.contains("lm_head.weight"));
  UniversalCheckpoint u = OpenUniversalCheckpoint(fx + "/ckpt/global_step6_universal");
  LoadedState wte = LoadUniversalState(u, "transformer.wte.weight", "fp32");
  auto ref = wte.tensor->contiguous_bytes();
  EXPECT_EQ(f.Bytes("transformer.wte.weight"), std::string(ref.begin(), ref.end()));
  std::string bf = b.Bytes("transformer.wte.weight");
  ASSERT_EQ(bf.size() * 2, ref.size());
  EXPECT_EQ(b.header["transformer.wte.weight"]["dtype"], "BF16");
  for (size_t i = 0; i < bf.size() / 2; ++i) {
    float x;
    std::memcpy(&x, ref.data() + 4 * i, 4);
    uint16_t h;
    std::memcpy(&h, bf.data() + 2 * i, 2);
    ASSERT_EQ(h, FloatToBFloat16(x)) << i;
  }
}

TEST(Inspect, ZeroAndUniversalFolders) {
  CheckpointInfo z = InspectCheckpoint(DsFixture("z1_ws2_fp16") + "/ckpt");  // via `latest`
  EXPECT_EQ(z.kind, "zero");
  EXPECT_EQ(z.zero_stage, 1);
  EXPECT_EQ(z.world_size, 2);
  EXPECT_EQ(z.dtype, "float16");
  EXPECT_EQ(z.master_dtype, "float32");
  EXPECT_EQ(z.optimizer, "AdamW");
  EXPECT_EQ(z.optimizer_states, (std::vector<std::string>{"exp_avg", "exp_avg_sq"}));
  EXPECT_EQ(z.params, 30u);
  EXPECT_EQ(z.numel, 3425);
  EXPECT_EQ(z.state_bytes, 3425u * 12);
  EXPECT_EQ(z.global_steps, 5);
  EXPECT_EQ(z.optimizer_step, "5");
  EXPECT_EQ(z.files, 3u);

  CheckpointInfo u = InspectCheckpoint(DsFixture("z3_ws2_fp32") + "/ckpt/global_step5_universal");
  EXPECT_EQ(u.kind, "universal");
  EXPECT_EQ(u.zero_stage, 3);
  EXPECT_EQ(u.world_size, 2);
  EXPECT_EQ(u.numel, 3425);
  EXPECT_EQ(u.optimizer_step, "5");
  auto j = CheckpointInfoJson(u);
  EXPECT_EQ(j["kind"], "universal");
  EXPECT_EQ(j["params"], 30);

  CheckpointInfo b = InspectCheckpoint(DsFixture("z1_ws2_bf16") + "/ckpt/global_step5");
  EXPECT_EQ(b.dtype, "bfloat16");
  EXPECT_FALSE(b.bf16_optimizer);  // DeepSpeedZeroOptimizer with bf16 file names
}

TEST(Inspect, RejectsAFolderThatIsNoCheckpoint) {
  TempDir tmp;
  EXPECT_THROW(InspectCheckpoint(tmp.path()), FormatError);
}

}  // namespace
}  // namespace uckpt::ckpt
