#include <gtest/gtest.h>

#include <cmath>

#include "fixture.h"
#include "format/error.h"
#include "train/data.h"
#include "train/gpt2.h"
#include "train/weights.h"

namespace uckpt::train {
namespace {

using testing::ReadJson;
using testing::RefrunDir;
using testing::RefrunModel;

struct Model {
  at::Tensor flat;
  std::vector<NamedTensor> params;
  explicit Model(const Gpt2Config& cfg) : flat(at::zeros({Gpt2NumParameters(cfg)})), params(Gpt2ParametersIn(cfg, flat)) {}
};

at::Tensor GlobalBatch(const nlohmann::json& rows) {
  std::vector<int64_t> ids;
  for (const auto& r : rows)
    for (const auto& t : r) ids.push_back(t.get<int64_t>());
  int64_t n = static_cast<int64_t>(rows.size());
  return at::tensor(ids, at::kLong).view({n, -1});
}

TEST(Gpt2, ParameterShapesMatchTheFixture) {
  auto shapes = Gpt2ParameterShapes(RefrunModel());
  ASSERT_EQ(shapes.size(), 28u);
  EXPECT_EQ(Gpt2NumParameters(RefrunModel()), 8400);
  auto order = ReadJson(RefrunDir() + "/init_sha256.json");
  ASSERT_TRUE(order.contains("named_parameters_order"));
  const auto& names = order["named_parameters_order"];
  ASSERT_EQ(names.size(), shapes.size());
  for (size_t k = 0; k < shapes.size(); ++k) EXPECT_EQ(shapes[k].first, names[k].get<std::string>());
}

TEST(Gpt2, SeededInitReproducesInitPt) {
  // The fixture's init.pt is gpt2_ref.hf_init_ with seed 1234 on torch's CPU
  // generator; ours draws the same numbers in the same order.
  Model ours(RefrunModel());
  Gpt2Init(RefrunModel(), ours.params, 1234);
  Model ref(RefrunModel());
  CopyStateDict(LoadStateDictFile(RefrunDir() + "/init.pt"), ref.params, "init.pt");
  EXPECT_TRUE(at::equal(ours.flat, ref.flat)) << "max diff " << (ours.flat - ref.flat).abs().max().item<float>();
  // And the same seed gives the same weights again (every rank agrees).
  Model again(RefrunModel());
  Gpt2Init(RefrunModel(), again.params, 1234);
  EXPECT_TRUE(at::equal(ours.flat, again.flat));
  Model other(RefrunModel());
  Gpt2Init(RefrunModel(), other.params, 1235);
  EXPECT_FALSE(at::equal(ours.flat, other.flat));
}

TEST(Gpt2, Step1LossEqualsDeepSpeed) {
  Model m(RefrunModel());
  CopyStateDict(LoadStateDictFile(RefrunDir() + "/init.pt"), m.params, "init.pt");
  Gpt2 model(RefrunModel(), m.params);
  auto vectors = ReadJson(RefrunDir() + "/data_test_vectors.json");
  at::Tensor batch = GlobalBatch(vectors["global_batch_step1"]);
  auto losses = ReadJson(RefrunDir() + "/runs/z2_ws2_baseline/losses.json");
  const double want = losses["steps"]["1"]["loss"].get<double>();
  // The reported loss is the mean of the micro-batch losses (2 rows each).
  double sum = 0;
  const auto& micro = losses["steps"]["1"]["micro_losses_m_by_r"];
  for (int64_t j = 0; j < 4; ++j) {
    double l = model.Loss(batch.narrow(0, 2 * j, 2)).item<float>();
    double ref = micro[j / 2][j % 2].get<double>();
    EXPECT_NEAR(l, ref, 1e-6 * std::fabs(ref)) << "micro-batch " << j;
    sum += l;
  }
  EXPECT_NEAR(sum / 4, want, 1e-6 * want);
  // The whole global batch at once gives the same mean.
  double full = model.Loss(batch).item<float>();
  EXPECT_NEAR(full, want, 1e-6 * want);
}

TEST(Gpt2, BackwardReachesEveryParameterAndTiesTheHead) {
  Model m(RefrunModel());
  Gpt2Init(RefrunModel(), m.params, 7);
  Gpt2 model(RefrunModel(), m.params);
  at::Tensor ids = at::randint(0, 97, {2, 16}, at::kLong);
  model.Loss(ids).backward();
  for (const auto& [name, p] : m.params) {
    ASSERT_TRUE(p.grad().defined()) << name;
    EXPECT_GT(p.grad().abs().sum().item<float>(), 0.f) << name;
  }
}

TEST(Gpt2, DropoutMasksDependOnRowsNotOnTheSplit) {
  Gpt2Config cfg = RefrunModel();
  cfg.dropout = 0.1;
  Model m(cfg);
  Gpt2Init(cfg, m.params, 3);
  Gpt2 model(cfg, m.params);
  at::Tensor ids = at::randint(0, 97, {4, 16}, at::kLong);
  DropoutKey all{99, 5, 0}, first{99, 5, 0}, second{99, 5, 2};
  at::Tensor whole = model.Logits(ids, &all);
  at::Tensor a = model.Logits(ids.narrow(0, 0, 2), &first);
  at::Tensor b = model.Logits(ids.narrow(0, 2, 2), &second);
  EXPECT_TRUE(at::allclose(whole, at::cat({a, b}), 1e-6, 1e-6));
  EXPECT_FALSE(at::allclose(whole, model.Logits(ids), 1e-3, 1e-3));  // dropout did something
  DropoutKey next_step{99, 6, 0};
  EXPECT_FALSE(at::allclose(whole, model.Logits(ids, &next_step), 1e-3, 1e-3));
}

TEST(Weights, BadFilesAreClearErrors) {
  Model m(RefrunModel());
  EXPECT_THROW(LoadStateDictFile(RefrunDir() + "/variant.json"), FormatError);
  auto sd = LoadStateDictFile(RefrunDir() + "/init.pt");
  sd.pop_back();  // lm_head alias: still fine
  sd.erase(sd.begin() + 1);
  try {
    CopyStateDict(sd, m.params, "x.pt");
    FAIL();
  } catch (const FormatError& e) {
    EXPECT_NE(std::string(e.what()).find("transformer.wpe.weight"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace uckpt::train
