#include <gtest/gtest.h>
#include <torch/csrc/autograd/function.h>

#include <cmath>

#include "cli/init_weights.h"
#include "engine/data/data.h"
#include "fixture.h"
#include "format/error.h"
#include "models/gpt2.h"
#include "models/next_token_loss.h"

namespace uckpt::models {
namespace {

using cli::CopyStateDict;
using cli::LoadStateDictFile;
using engine::testing::ReadJson;
using engine::testing::RefrunDir;
using engine::testing::RefrunModel;

struct Model {
  at::Tensor flat;
  std::vector<NamedTensor> params;
  explicit Model(const Gpt2Config& cfg)
      : flat(at::zeros({Gpt2NumParameters(cfg)})), params(Gpt2ParametersIn(cfg, flat)) {}
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

// HF's loss: logits[:, :-1] in fp32, cross entropy against ids[:, 1:].
at::Tensor HfLoss(const at::Tensor& logits, const at::Tensor& ids) {
  const int64_t V = logits.size(2), T = logits.size(1);
  return at::cross_entropy_loss(logits.narrow(1, 0, T - 1).to(at::kFloat).reshape({-1, V}),
                                ids.narrow(1, 1, T - 1).reshape({-1}));
}

TEST(NextTokenLoss, EqualsHfLossAndGradientForEveryChunking) {
  at::manual_seed(11);
  const int64_t B = 5, T = 7, V = 11;
  at::Tensor ids = at::randint(0, V, {B, T}, at::kLong);
  at::Tensor base = at::randn({B, T, V}) * 3;
  at::Tensor ref_in = base.clone().requires_grad_(true);
  at::Tensor ref = HfLoss(ref_in, ids);
  ref.backward();
  // 1 value per chunk -> one sequence per chunk; 2 and 3 sequences (the last chunk short); one chunk.
  for (int64_t chunk : {int64_t{1}, 2 * (T - 1) * V, 3 * (T - 1) * V, int64_t{1} << 26}) {
    at::Tensor in = base.clone().requires_grad_(true);
    at::Tensor loss = NextTokenLoss(in, ids, chunk);
    EXPECT_EQ(loss.dim(), 0);
    EXPECT_NEAR(loss.item<double>(), ref.item<double>(), 1e-6 * ref.item<double>()) << "chunk " << chunk;
    (loss * 2).backward();  // the incoming gradient scales the result
    // cross_entropy's own backward, chunk by chunk: the same bits.
    EXPECT_TRUE(at::equal(in.grad(), ref_in.grad() * 2))
        << "chunk " << chunk << ": max diff " << (in.grad() - ref_in.grad() * 2).abs().max().item<double>();
    EXPECT_EQ(in.grad().narrow(1, T - 1, 1).abs().max().item<double>(), 0.0);
  }
  // bf16 logits: the loss is still computed in fp32, the gradient comes back in bf16.
  at::Tensor half = base.to(at::kBFloat16).requires_grad_(true);
  at::Tensor want_in = base.to(at::kBFloat16).requires_grad_(true);
  at::Tensor want = HfLoss(want_in, ids);
  want.backward();
  at::Tensor got = NextTokenLoss(half, ids, 1);
  got.backward();
  EXPECT_EQ(got.scalar_type(), at::kFloat);
  EXPECT_NEAR(got.item<double>(), want.item<double>(), 1e-6 * want.item<double>());
  EXPECT_EQ(half.grad().scalar_type(), at::kBFloat16);
  EXPECT_TRUE(at::equal(half.grad(), want_in.grad()))
      << "max diff " << (half.grad().to(at::kFloat) - want_in.grad().to(at::kFloat)).abs().max().item<double>();
  EXPECT_THROW(NextTokenLoss(base, ids.narrow(1, 0, T - 1)), std::invalid_argument);
}

// One forward and backward of the fixture-sized GPT-2 under `cfg`, from the
// seeded init, on a random batch of 3 x 16 tokens.
struct LossAndGrads {
  double loss = 0;
  std::string loss_node;  // the autograd node that made the loss
  std::vector<NamedTensor> grads;
};
LossAndGrads ForwardBackward(const Gpt2Config& cfg, uint64_t init_seed, uint64_t data_seed) {
  Model m(cfg);
  Gpt2Init(cfg, m.params, init_seed);
  Gpt2 model(cfg, m.params);
  at::manual_seed(data_seed);
  at::Tensor loss = model.Loss(at::randint(0, cfg.vocab_size, {3, 16}, at::kLong));
  loss.backward();
  LossAndGrads r{loss.item<double>(), loss.grad_fn()->name(), {}};
  for (const auto& [name, p] : m.params) r.grads.push_back({name, p.grad()});
  return r;
}

TEST(Gpt2, FusedKernelsComputeTheSameFunction) {
  Gpt2Config fused_cfg = RefrunModel();
  fused_cfg.fused_kernels = true;
  const LossAndGrads eager = ForwardBackward(RefrunModel(), 5, 3), fused = ForwardBackward(fused_cfg, 5, 3);
  EXPECT_NEAR(fused.loss, eager.loss, 1e-5 * eager.loss);
  for (size_t k = 0; k < eager.grads.size(); ++k) {
    const at::Tensor &ge = eager.grads[k].tensor, &gf = fused.grads[k].tensor;
    const double rel = (gf - ge).norm().item<double>() / std::max(1e-12, ge.norm().item<double>());
    EXPECT_LT(rel, 1e-3) << eager.grads[k].name;  // tanh GELU approximates gelu_new's rounding, not its value
  }
  Gpt2Config bad = fused_cfg;
  bad.dropout = 0.1;
  Model m(bad);
  EXPECT_THROW(Gpt2(bad, m.params), std::invalid_argument);
}

TEST(Gpt2, ChunkedLossGivesHfGradientsBitForBit) {
  Gpt2Config chunked_cfg = RefrunModel();
  chunked_cfg.chunked_loss = true;
  const LossAndGrads hf = ForwardBackward(RefrunModel(), 9, 4), chunked = ForwardBackward(chunked_cfg, 9, 4);
  EXPECT_NEAR(chunked.loss, hf.loss, 1e-6 * hf.loss);
  EXPECT_NE(chunked.loss_node.find("NextTokenLoss"), std::string::npos) << chunked.loss_node;  // the chunked path ran
  EXPECT_EQ(hf.loss_node.find("NextTokenLoss"), std::string::npos) << hf.loss_node;
  for (size_t k = 0; k < hf.grads.size(); ++k)
    EXPECT_TRUE(at::equal(hf.grads[k].tensor, chunked.grads[k].tensor)) << hf.grads[k].name;
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
}  // namespace uckpt::models
