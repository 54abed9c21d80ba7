// Our own ZeRO checkpoint of the fixture's baseline converts (uckpt convert)
// to the universal checkpoint DeepSpeed's ds_to_universal made from its own:
// our 6 steps at world size 2 are DeepSpeed's bit for bit, so every file under
// zero/ is byte-identical, and the model-states file (ours, copied) holds
// DeepSpeed's keys with equal values plus our own 'uckpt' key.
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "ckpt/convert.h"
#include "cli/trainer.h"
#include "engine/torch_bridge.h"
#include "fixture.h"
#include "format/torch_file.h"
#include "ranks.h"

namespace uckpt::engine {
namespace {

using cli::Trainer;
using cli::TrainOptions;

namespace fs = std::filesystem;
using testing::ReadJson;
using testing::RefrunDir;
using testing::RefrunModel;
using testing::RunRanks;

// Compares two value trees; `skip` names dict keys whose values are not compared.
void ExpectSameTree(const Value& a, const Value& b, const std::string& where, double atol,
                    const std::set<std::string>& skip = {}) {
  ASSERT_EQ(KindName(a), KindName(b)) << where;
  if (a.tensor) {
    const Tensor &x = *a.tensor, &y = *b.tensor;
    EXPECT_EQ(x.dtype, y.dtype) << where;
    EXPECT_EQ(x.shape, y.shape) << where;
    EXPECT_EQ(x.requires_grad, y.requires_grad) << where;
    if (x.shape == y.shape && x.dtype == y.dtype) {
      double d = (ToTorch(x).to(at::kDouble) - ToTorch(y).to(at::kDouble)).abs().max().item<double>();
      EXPECT_LE(d, atol) << where;
    }
    return;
  }
  switch (a.kind) {
    case Kind::kDict:
    case Kind::kOrderedDict: {
      ASSERT_EQ(a.entries.size(), b.entries.size()) << where;
      for (size_t k = 0; k < a.entries.size(); ++k) {
        std::string key = HashKey(*a.entries[k].first);
        EXPECT_EQ(key, HashKey(*b.entries[k].first)) << where;
        if (a.entries[k].first->kind == Kind::kStr && skip.count(a.entries[k].first->s)) continue;
        ExpectSameTree(*a.entries[k].second, *b.entries[k].second, where + "/" + key, atol, skip);
      }
      if (a.state || b.state) {
        ASSERT_TRUE(a.state && b.state) << where;
        ExpectSameTree(*a.state, *b.state, where + "(state)", atol, skip);
      }
      return;
    }
    case Kind::kList:
    case Kind::kTuple:
    case Kind::kSet:
    case Kind::kTorchSize:
    case Kind::kObject:
      ASSERT_EQ(a.items.size(), b.items.size()) << where;
      for (size_t k = 0; k < a.items.size(); ++k)
        ExpectSameTree(*a.items[k], *b.items[k], where + "[" + std::to_string(k) + "]", atol, skip);
      EXPECT_EQ(a.s, b.s) << where;
      if (a.state || b.state) {
        ASSERT_TRUE(a.state && b.state) << where;
        ExpectSameTree(*a.state, *b.state, where + "(state)", atol, skip);
      }
      return;
    default: EXPECT_EQ(HashKey(a), HashKey(b)) << where; EXPECT_EQ(a.s, b.s) << where;
  }
}

std::string ReadBytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

TEST(Convert, OurStep6CheckpointConvertsLikeDeepSpeeds) {
  const auto dir = fs::temp_directory_path() / ("uckpt_engine_convert_" + std::to_string(getpid()));
  fs::remove_all(dir);
  auto spec = ReadJson(RefrunDir() + "/runs/z2_ws2_baseline/config.json");
  RunRanks(2, [&](Comm& comm) {
    TrainOptions o;
    o.config = ParseConfig(spec["ds_config_as_passed"], "baseline");
    o.model = RefrunModel();
    o.seq_len = 16;
    o.init_file = RefrunDir() + "/init.pt";
    at::set_num_threads(1);  // as DeepSpeed ran (see dist_test.cc)
    Trainer t(comm, o);
    for (int k = 0; k < 6; ++k) t.TrainStep();
    t.SaveCheckpoint(dir.string(), "global_step6");
  });
  ckpt::ConvertOptions co;
  co.durable = false;
  ckpt::ConvertToUniversal((dir / "global_step6").string(), (dir / "global_step6_universal").string(), co);

  const fs::path want = fs::path(RefrunDir()) / "ckpt" / "global_step6_universal";
  const bool written_by_torch_1 =
      ReadJson(RefrunDir() + "/init_sha256.json")["torch_version"].get<std::string>().rfind("1.", 0) == 0;
  const fs::path got = dir / "global_step6_universal";
  size_t files = 0;
  for (const auto& e : fs::recursive_directory_iterator(want)) {
    if (!e.is_regular_file()) continue;
    const fs::path rel = fs::relative(e.path(), want);
    ASSERT_TRUE(fs::exists(got / rel)) << rel;
    TorchFile a = LoadTorchFile(e.path().string()), b = LoadTorchFile((got / rel).string());
    const double atol = 0;
    if (rel.string() == "mp_rank_00_model_states.pt") {
      // The model file carries our own client key 'uckpt' and the ds_config as
      // given; everything DeepSpeed wrote is there, in its order.
      ASSERT_TRUE(b.root->is_dict());
      EXPECT_TRUE(b.root->get("uckpt") != nullptr);
      auto trimmed = std::make_shared<Value>(*b.root);
      trimmed->entries.erase(std::remove_if(trimmed->entries.begin(), trimmed->entries.end(),
                                            [](const auto& kv) { return kv.first->s == "uckpt"; }),
                             trimmed->entries.end());
      ExpectSameTree(*a.root, *trimmed, rel.string(), atol, {"ds_config"});
    } else if (!written_by_torch_1 && rel.string() == "zero/optimizer_state.pt") {
      // DeepSpeed on PyTorch 2.11 (Python 3.11.7) writes its torch AdamW's param_groups, which
      // have more keys than 1.13's (uckpt's engine saves those of 1.13) and betas as a tuple, and pickles
      // ZeroStageEnum through getattr: the rest must be the same, and every key uckpt writes
      // in a param group must hold DeepSpeed's value (issue 41 makes the files the same).
      ExpectSameTree(*a.root, *b.root, rel.string(), atol, {"param_groups", "zero_stage"});
      const Value& pa = *a.root->get("param_groups");
      const Value& pb = *b.root->get("param_groups");
      ASSERT_EQ(pa.items.size(), pb.items.size());
      for (size_t g = 0; g < pb.items.size(); ++g)
        for (const auto& [k, v] : pb.items[g]->entries) {
          const ValuePtr theirs = pa.items[g]->get(k->s);
          ASSERT_NE(theirs, nullptr) << "param_groups[" << g << "]: DeepSpeed has no " << k->s;
          if (theirs->is_seq() && v->is_seq()) {  // PyTorch 2.x's Adam keeps betas as a tuple
            ASSERT_EQ(theirs->items.size(), v->items.size()) << k->s;
            for (size_t i = 0; i < v->items.size(); ++i)
              ExpectSameTree(*theirs->items[i], *v->items[i], "param_groups/" + k->s, atol);
          } else {
            ExpectSameTree(*theirs, *v, "param_groups/" + k->s, atol);
          }
        }
    } else {
      ExpectSameTree(*a.root, *b.root, rel.string(), atol);
      // Byte for byte where DeepSpeed ran on PyTorch 1.x, whose record layout uckpt writes
      // (PyTorch 2.x's torch.save writes the same values with other records and alignment).
      if (written_by_torch_1) {
        EXPECT_TRUE(ReadBytes(e.path()) == ReadBytes(got / rel)) << rel << " is not byte-identical to DeepSpeed's";
      }
    }
    ++files;
  }
  EXPECT_EQ(files, 2u + 28u * 4u);
  size_t ours = 0;
  for (const auto& e : fs::recursive_directory_iterator(got)) ours += e.is_regular_file();
  EXPECT_TRUE(fs::is_regular_file(got / "uckpt-manifest.json"));  // ours has a manifest; DeepSpeed's has none
  EXPECT_EQ(ours, files + 1);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace uckpt::engine
