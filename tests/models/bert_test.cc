// The BERT masked-LM (src/models/bert.h): masking statistics and split
// invariance, the tied decoder weight and the position-id buffer, seeded
// initialisation, and 20 AdamW steps against the plain-PyTorch reference
// (tests/models/bert_reference.py) loss for loss.
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>
#include <vector>

#include "../engine/ranks.h"
#include "ckpt/convert.h"
#include "engine/data/data.h"
#include "engine/torch_bridge.h"
#include "format/torch_file.h"
#include "models/bert.h"
#include "uckpt/engine.h"

namespace uckpt::models {
namespace {

namespace fs = std::filesystem;

BertConfig Tiny() {
  BertConfig c;
  c.n_layer = 2;
  c.n_head = 4;
  c.n_embd = 64;
  c.vocab_size = 260;
  c.n_positions = 64;
  c.seq_len = 32;
  return c;
}

torch::Tensor RandomBytes(int64_t rows, int64_t cols, uint64_t seed) {
  torch::Tensor t = torch::empty({rows, cols}, torch::kLong);
  auto* p = t.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows * cols; ++i) p[i] = static_cast<int64_t>(engine::SplitMix64(seed + i) % 256);
  return t;
}

TEST(BertConfig, RejectsBadSizesWithClearErrors) {
  auto expect_error = [](BertConfig c, const std::string& needle) {
    try {
      BertMlm m(c);
      ADD_FAILURE() << "no error for " << needle;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  BertConfig c = Tiny();
  c.vocab_size = 256;
  expect_error(c, "vocab_size 256 is too small");
  c = Tiny();
  c.n_head = 5;
  expect_error(c, "multiple of n_head");
  c = Tiny();
  c.seq_len = 65;
  expect_error(c, "exceeds n_positions");
  c = Tiny();
  c.vocab_size = kBertNumByteTokens + kBertNumSpecialTokens;
  EXPECT_NO_THROW(BertMlm{c});
}

TEST(BertMlm, HuggingFaceNamesInDeterministicOrder) {
  BertMlm m(Tiny());
  std::vector<std::string> want = {"bert.embeddings.word_embeddings.weight",
                                   "bert.embeddings.position_embeddings.weight", "bert.embeddings.LayerNorm.weight",
                                   "bert.embeddings.LayerNorm.bias"};
  for (int i = 0; i < 2; ++i) {
    const std::string p = "bert.encoder.layer." + std::to_string(i) + ".";
    for (const char* s :
         {"attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense",
          "attention.output.LayerNorm", "intermediate.dense", "output.dense", "output.LayerNorm"}) {
      want.push_back(p + s + ".weight");
      want.push_back(p + s + ".bias");
    }
  }
  for (const char* s :
       {"cls.predictions.bias", "cls.predictions.transform.dense.weight", "cls.predictions.transform.dense.bias",
        "cls.predictions.transform.LayerNorm.weight", "cls.predictions.transform.LayerNorm.bias"})
    want.push_back(s);
  std::vector<std::string> unique;
  for (auto& [name, t] : m->unique_named_parameters()) unique.push_back(name);
  EXPECT_EQ(unique, want);
  // libtorch's own listing also has the tied alias, last.
  auto all = m->named_parameters();
  ASSERT_EQ(all.size(), want.size() + 1);
  EXPECT_EQ(all.keys().back(), "cls.predictions.decoder.weight");
  // Shapes.
  EXPECT_EQ(all["bert.embeddings.word_embeddings.weight"].sizes(), torch::IntArrayRef({260, 64}));
  EXPECT_EQ(all["bert.encoder.layer.1.intermediate.dense.weight"].sizes(), torch::IntArrayRef({256, 64}));
  EXPECT_EQ(all["bert.encoder.layer.1.output.dense.weight"].sizes(), torch::IntArrayRef({64, 256}));
  EXPECT_EQ(all["cls.predictions.bias"].sizes(), torch::IntArrayRef({260}));
}

TEST(BertMlm, DecoderWeightIsTheEmbeddingTensor) {
  BertMlm m(Tiny());
  auto all = m->named_parameters();
  torch::Tensor emb = all["bert.embeddings.word_embeddings.weight"];
  torch::Tensor dec = all["cls.predictions.decoder.weight"];
  EXPECT_TRUE(emb.is_same(dec));
  EXPECT_EQ(emb.unsafeGetTensorImpl(), dec.unsafeGetTensorImpl());
  EXPECT_TRUE(m->decoder_weight.is_same(m->word_embeddings->weight));
  EXPECT_EQ(m->unique_parameters().size(), all.size() - 1);
  // A write through one name is seen through the other, and the gradient
  // collects both uses (embedding lookup and decoder).
  {
    torch::NoGradGuard g;
    emb.fill_(0.5);
  }
  EXPECT_TRUE(torch::equal(dec, torch::full_like(dec, 0.5)));
  BertMlmInit(*m, 7);
  torch::Tensor ids = RandomBytes(2, 8, 1);
  auto mb = MaskBatch(ids, 0, 3);
  m->Loss(mb.input_ids, mb.labels).backward();
  ASSERT_TRUE(emb.grad().defined());
  // Rows of the embedding that no input used still get a gradient from the
  // decoder (every vocabulary row appears in the softmax).
  EXPECT_GT(emb.grad()[259].abs().sum().item<double>(), 0.0);
}

TEST(BertMlm, PositionIdsAreABufferNotAParameter) {
  BertMlm m(Tiny());
  auto buffers = m->named_buffers();
  ASSERT_EQ(buffers.size(), 1u);
  EXPECT_EQ(buffers.keys()[0], "bert.embeddings.position_ids");
  torch::Tensor pid = buffers["bert.embeddings.position_ids"];
  EXPECT_FALSE(pid.requires_grad());
  EXPECT_EQ(pid.scalar_type(), torch::kLong);
  EXPECT_TRUE(torch::equal(pid, torch::arange(64, torch::kLong).unsqueeze(0)));
  for (const auto& item : m->named_parameters()) EXPECT_NE(item.key(), "bert.embeddings.position_ids");
  EXPECT_TRUE(pid.is_same(m->position_ids));
}

TEST(BertMlm, ToDtypeCastsFloatingTensorsOnly) {
  BertMlm m(Tiny());
  BertMlmInit(*m, 3);
  torch::Tensor ids = RandomBytes(2, 16, 8);
  auto mb = MaskBatch(ids, 0, 9);
  const double loss32 = m->Loss(mb.input_ids, mb.labels).item<double>();
  m->to(torch::kDouble);
  for (const auto& item : m->named_parameters()) EXPECT_EQ(item.value().scalar_type(), torch::kDouble) << item.key();
  EXPECT_EQ(m->named_buffers()["bert.embeddings.position_ids"].scalar_type(), torch::kLong);
  EXPECT_TRUE(m->decoder_weight.is_same(m->word_embeddings->weight));
  EXPECT_EQ(m->decoder_weight.scalar_type(), torch::kDouble);
  torch::Tensor loss = m->Loss(mb.input_ids, mb.labels);
  EXPECT_EQ(loss.scalar_type(), torch::kFloat);  // the loss is fp32 whatever the model's dtype
  EXPECT_NEAR(loss.item<double>(), loss32, 1e-5 * loss32);
  m->to(torch::kCPU, torch::kFloat);
  EXPECT_EQ(m->word_embeddings->weight.scalar_type(), torch::kFloat);
  EXPECT_EQ(m->position_ids.scalar_type(), torch::kLong);
}

TEST(BertMlm, SeededInitIsReproducible) {
  BertMlm a(Tiny()), b(Tiny()), c(Tiny());
  BertMlmInit(*a, 42);
  BertMlmInit(*b, 42);
  BertMlmInit(*c, 43);
  auto pa = a->unique_named_parameters(), pb = b->unique_named_parameters(), pc = c->unique_named_parameters();
  bool any_differs = false;
  for (size_t k = 0; k < pa.size(); ++k) {
    const auto& [name, t] = pa[k];
    EXPECT_TRUE(torch::equal(t, pb[k].second)) << name;
    any_differs |= !torch::equal(t, pc[k].second);
    const bool ln = name.find("LayerNorm") != std::string::npos;
    if (ln && name.ends_with(".weight")) {
      EXPECT_TRUE(torch::equal(t, torch::ones_like(t))) << name;
    } else if (name.ends_with("bias")) {
      EXPECT_TRUE(torch::equal(t, torch::zeros_like(t))) << name;
    } else {
      EXPECT_NEAR(t.std().item<double>(), 0.02, 0.002) << name;
      EXPECT_NEAR(t.mean().item<double>(), 0.0, 0.002) << name;
    }
  }
  EXPECT_TRUE(any_differs);
  EXPECT_TRUE(a->decoder_weight.is_same(a->word_embeddings->weight));
}

TEST(BertMlm, ForwardShapesAndBidirectionalAttention) {
  BertMlm m(Tiny());
  BertMlmInit(*m, 1);
  m->eval();
  torch::NoGradGuard g;
  torch::Tensor ids = RandomBytes(3, 16, 5);
  torch::Tensor logits = m->forward(ids);
  EXPECT_EQ(logits.sizes(), torch::IntArrayRef({3, 16, 260}));
  // Changing the last token changes the first position's output (no causal mask).
  torch::Tensor ids2 = ids.clone();
  ids2[0][15] = (ids2[0][15].item<int64_t>() + 1) % 256;
  EXPECT_FALSE(torch::allclose(m->forward(ids2)[0][0], logits[0][0]));
  EXPECT_THROW(m->forward(RandomBytes(1, 65, 0)), std::invalid_argument);
  torch::Tensor no_labels = torch::full({3, 16}, kBertIgnoreLabel, torch::kLong);
  EXPECT_THROW(m->Loss(ids, no_labels), std::invalid_argument);
}

TEST(MaskBatch, Statistics) {
  const int64_t B = 2048, T = 128;
  torch::Tensor ids = RandomBytes(B, T, 99);
  auto mb = MaskBatch(ids, 0, 2024);
  torch::Tensor selected = mb.labels.ne(kBertIgnoreLabel);
  const double n_sel = selected.sum().item<double>();
  EXPECT_NEAR(n_sel / static_cast<double>(B * T), 0.15, 0.004);
  // Every row has a label; labels are the original ids; unselected positions are unchanged.
  EXPECT_TRUE(selected.any(1).all().item<bool>());
  EXPECT_TRUE(torch::equal(mb.labels.masked_select(selected), ids.masked_select(selected)));
  EXPECT_TRUE(
      torch::equal(mb.input_ids.masked_select(selected.logical_not()), ids.masked_select(selected.logical_not())));
  torch::Tensor in_sel = mb.input_ids.masked_select(selected), orig_sel = ids.masked_select(selected);
  const double masked = in_sel.eq(kBertMaskToken).sum().item<double>() / n_sel;
  const double changed = (in_sel.ne(kBertMaskToken) & in_sel.ne(orig_sel)).sum().item<double>() / n_sel;
  const double same = in_sel.eq(orig_sel).sum().item<double>() / n_sel;
  EXPECT_NEAR(masked, 0.8, 0.01);
  EXPECT_NEAR(changed, 0.1 * 255.0 / 256.0, 0.006);  // a random byte may equal the original
  EXPECT_NEAR(same, 0.1 + 0.1 / 256.0, 0.006);
  EXPECT_LT(mb.input_ids.max().item<int64_t>(), kBertNumByteTokens + kBertNumSpecialTokens);
  EXPECT_GE(mb.input_ids.min().item<int64_t>(), 0);

  // The at-least-one rule: with one position per row every row is selected,
  // and with a tiny select_prob each row gets exactly one label.
  auto one = MaskBatch(RandomBytes(64, 1, 3), 0, 1);
  EXPECT_TRUE(one.labels.ne(kBertIgnoreLabel).all().item<bool>());
  MaskOptions rare;
  rare.select_prob = 0.0;
  auto r = MaskBatch(RandomBytes(64, 32, 4), 0, 1, rare);
  EXPECT_TRUE(torch::equal(r.labels.ne(kBertIgnoreLabel).sum(1), torch::ones({64}, torch::kLong)));
}

TEST(MaskBatch, SampleMasksDoNotDependOnTheSplit) {
  const int64_t global_batch = 24, first = 1000, seed = 77;
  torch::Tensor ids = RandomBytes(global_batch, 32, 11);
  auto whole = MaskBatch(ids, first, seed);
  for (int64_t world : {2, 3, 4, 6, 8}) {
    const int64_t per_rank = global_batch / world;
    // Ranks take contiguous shares, and each rank splits its share into micro-batches of 1 or 2.
    for (int64_t micro : {1, 2}) {
      if (per_rank % micro != 0) continue;
      std::vector<torch::Tensor> ins, labs;
      for (int64_t r = 0; r < world; ++r)
        for (int64_t m = 0; m < per_rank / micro; ++m) {
          const int64_t row = r * per_rank + m * micro;
          auto part = MaskBatch(ids.narrow(0, row, micro), first + row, seed);
          ins.push_back(part.input_ids);
          labs.push_back(part.labels);
        }
      EXPECT_TRUE(torch::equal(torch::cat(ins), whole.input_ids)) << "world " << world << " micro " << micro;
      EXPECT_TRUE(torch::equal(torch::cat(labs), whole.labels)) << "world " << world << " micro " << micro;
    }
  }
  // Other seeds and other sample indices give other masks.
  EXPECT_FALSE(torch::equal(MaskBatch(ids, first, seed + 1).labels, whole.labels));
  EXPECT_FALSE(torch::equal(MaskBatch(ids, first + 1, seed).labels, whole.labels));
  // Deterministic.
  EXPECT_TRUE(torch::equal(MaskBatch(ids, first, seed).input_ids, whole.input_ids));
}

// ---------------------------------------------------------------------------
// Against the plain-PyTorch reference.

std::string Python() {
  if (const char* p = std::getenv("UCKPT_PYTHON")) return p;
  return fs::exists("/usr/bin/python3") ? "/usr/bin/python3" : "python3";
}

// Runs `cmd`, returning its stdout+stderr and exit status.
std::string RunCommand(const std::string& cmd, int* status) {
  std::string out;
  FILE* f = popen((cmd + " 2>&1").c_str(), "r");
  if (!f) {
    *status = -1;
    return out;
  }
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, f)) > 0) out.append(buf, n);
  *status = pclose(f);
  return out;
}

// Byte-level text: the files of /usr/share/common-licenses in name order,
// concatenated, cut to `n` bytes; deterministic pseudo-text where there is
// not enough.
std::string TextBytes(size_t n) {
  std::string text;
  std::vector<fs::path> files;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator("/usr/share/common-licenses", ec))
    if (e.is_regular_file()) files.push_back(e.path());
  std::sort(files.begin(), files.end());
  for (const auto& p : files) {
    if (text.size() >= n) break;
    std::ifstream in(p, std::ios::binary);
    text.append(std::istreambuf_iterator<char>(in), {});
  }
  for (uint64_t i = 0; text.size() < n; ++i) text.push_back(static_cast<char>('a' + engine::SplitMix64(i) % 26));
  text.resize(n);
  return text;
}

// The model's state dict (every parameter name, the tied alias included, then
// the buffers) as a torch.save file.
void SaveStateDict(BertMlmImpl& m, const std::string& path) {
  ValuePtr d = Value::Dict(/*ordered=*/true);
  for (const auto& item : m.named_parameters())
    d->set(item.key(), Value::FromTensor(engine::FromTorch(item.value().detach())));
  for (const auto& item : m.named_buffers()) d->set(item.key(), Value::FromTensor(engine::FromTorch(item.value())));
  SaveTorchFile(path, d);
}

TEST(BertMlm, TwentyStepsMatchThePyTorchReference) {
  const std::string py = Python();
  int status = 0;
  std::string probe = RunCommand("'" + py + "' -c 'import torch, numpy'", &status);
  if (status != 0) GTEST_SKIP() << "python3 with torch and numpy not available (" << py << "): " << probe;

  at::set_num_threads(1);
  const BertConfig cfg = Tiny();
  const int64_t steps = 20, batch = 8, T = cfg.seq_len;
  const uint64_t mask_seed = 1234;
  const double lr = 2e-3, beta1 = 0.9, beta2 = 0.98, eps = 1e-6, weight_decay = 0.01, clip = 1.0;

  const fs::path dir = fs::temp_directory_path() / ("uckpt_bert_test_" + std::to_string(getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  const std::string init = (dir / "init.pt").string(), data = (dir / "data.bin").string(),
                    masks = (dir / "masks.bin").string();
  {
    std::ofstream out(data, std::ios::binary);
    const std::string bytes = TextBytes(static_cast<size_t>(steps * batch * T));
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  }
  BertMlm model(cfg);
  BertMlmInit(*model, 20240601);
  SaveStateDict(*model, init);

  std::ostringstream cmd;
  cmd.precision(17);
  cmd << "'" << py << "' '" << UCKPT_BERT_REFERENCE << "' --init '" << init << "' --data '" << data << "' --masks-out '"
      << masks << "' --steps " << steps << " --batch " << batch << " --seq-len " << T << " --n-layer " << cfg.n_layer
      << " --n-head " << cfg.n_head << " --n-embd " << cfg.n_embd << " --vocab-size " << cfg.vocab_size
      << " --n-positions " << cfg.n_positions << " --layer-norm-eps " << cfg.layer_norm_eps << " --lr " << lr
      << " --beta1 " << beta1 << " --beta2 " << beta2 << " --eps " << eps << " --weight-decay " << weight_decay
      << " --clip " << clip << " --mask-seed " << mask_seed << " --threads 1 --print-params";
  std::string out = RunCommand(cmd.str(), &status);
  ASSERT_EQ(status, 0) << cmd.str() << "\n" << out;
  std::vector<double> ref;
  std::vector<std::string> py_params;
  {
    std::istringstream lines(out);
    for (std::string line; std::getline(lines, line);) {
      std::istringstream ls(line);
      std::string word, name, shape, loss_word;
      int64_t k;
      double v;
      if (line.rfind("param ", 0) == 0 && ls >> word >> name >> shape) py_params.push_back(name + " " + shape);
      else if (ls >> word >> k >> loss_word >> v && word == "step" && loss_word == "loss") ref.push_back(v);
    }
  }
  ASSERT_EQ(ref.size(), static_cast<size_t>(steps)) << out;
  // Python's named_parameters() (each tensor once) is our unique_named_parameters(), in order.
  std::vector<std::string> ours_params;
  for (auto& [name, t] : model->unique_named_parameters()) {
    std::string shape;
    for (int64_t d : t.sizes()) shape += (shape.empty() ? "" : "x") + std::to_string(d);
    ours_params.push_back(name + " " + shape);
  }
  EXPECT_EQ(ours_params, py_params);

  // The C++ loop: the same rows (engine's byte-file source), masks, optimizer.
  engine::TokenFileSource source(data, engine::TokenFileSource::Encoding::kBytes, T, cfg.vocab_size);
  std::ifstream mask_file(masks, std::ios::binary);
  auto params = model->unique_parameters();
  torch::optim::AdamW opt(params,
                          torch::optim::AdamWOptions(lr).betas({beta1, beta2}).eps(eps).weight_decay(weight_decay));
  model->train();
  double max_rel = 0;
  for (int64_t s = 0; s < steps; ++s) {
    auto rows = engine::GatherRows(source, s + 1, s * batch, 0, batch, T);
    torch::Tensor ids = torch::tensor(rows, torch::kLong).view({batch, T});
    auto mb = MaskBatch(ids, s * batch, mask_seed);
    // Python's masks, bit for bit.
    torch::Tensor py_in = torch::empty({batch, T}, torch::kLong), py_lab = torch::empty({batch, T}, torch::kLong);
    mask_file.read(reinterpret_cast<char*>(py_in.data_ptr<int64_t>()), batch * T * 8);
    mask_file.read(reinterpret_cast<char*>(py_lab.data_ptr<int64_t>()), batch * T * 8);
    ASSERT_TRUE(mask_file) << "short masks file";
    ASSERT_TRUE(torch::equal(py_in, mb.input_ids)) << "step " << s + 1;
    ASSERT_TRUE(torch::equal(py_lab, mb.labels)) << "step " << s + 1;

    opt.zero_grad();
    torch::Tensor loss = model->Loss(mb.input_ids, mb.labels);
    loss.backward();
    torch::nn::utils::clip_grad_norm_(params, clip);
    opt.step();
    const double ours = loss.item<double>();
    const double rel = std::abs(ours - ref[s]) / std::abs(ref[s]);
    max_rel = std::max(max_rel, rel);
    EXPECT_LE(rel, 1e-5) << "step " << s + 1 << ": C++ " << ours << " vs PyTorch " << ref[s];
  }
  // The same 20 steps through uckpt::Engine (ZeRO-1, one rank): DeepSpeed's
  // programming model over the same model, data and masks.
  {
    BertMlm m(cfg);
    BertMlmInit(*m, 20240601);
    const nlohmann::json ds = {
        {"train_batch_size", batch},
        {"gradient_clipping", clip},
        {"optimizer",
         {{"type", "AdamW"},
          {"params", {{"lr", lr}, {"betas", {beta1, beta2}}, {"eps", eps}, {"weight_decay", weight_decay}}}}},
        {"zero_optimization", {{"stage", 1}}}};
    EngineOptions eo;
    eo.comm = MakeSingleProcessComm();
    Engine e(m.ptr(), Config::FromJson(ds, "bert test"), eo);
    double engine_max_rel = 0;
    for (int64_t s = 0; s < steps; ++s) {
      auto rows = engine::GatherRows(source, s + 1, s * batch, 0, batch, T);
      torch::Tensor ids = torch::tensor(rows, torch::kLong).view({batch, T});
      auto mb = MaskBatch(ids, s * batch, mask_seed);
      torch::Tensor loss = m->Loss(mb.input_ids, mb.labels);
      e.Backward(loss);
      e.Step();
      const double rel = std::abs(loss.item<double>() - ref[s]) / std::abs(ref[s]);
      engine_max_rel = std::max(engine_max_rel, rel);
      EXPECT_LE(rel, 1e-5) << "engine, step " << s + 1 << ": " << loss.item<double>() << " vs PyTorch " << ref[s];
    }
    EXPECT_EQ(e.stats().global_steps(), steps);
    std::printf("20 steps on uckpt::Engine: max relative difference %.3g\n", engine_max_rel);
  }

  // The tie survives training, and the model learned something.
  EXPECT_TRUE(model->decoder_weight.is_same(model->word_embeddings->weight));
  EXPECT_LT(ref.back(), ref.front());
  std::printf("20 steps: first loss %.9g, last %.9g, max relative difference %.3g\n", ref.front(), ref.back(), max_rel);
  RecordProperty("max_relative_difference", std::to_string(max_rel));
  fs::remove_all(dir);
}

}  // namespace
}  // namespace uckpt::models

namespace uckpt::models {
namespace {

// BERT MLM as the tutorial trains it (ZeRO-1, optimizer offloaded to CPU,
// client_state {"checkpoint_step": k}), on 2 ranks; saved at step 3, converted
// to universal and resumed on 3 ranks, where the losses continue within 1e-5
// relative of the uninterrupted run.
struct BertRun {
  BertMlm model{nullptr};
  std::unique_ptr<Engine> engine;
};

BertRun MakeBertRun(Comm& comm) {
  BertConfig cfg = Tiny();
  BertRun r;
  r.model = BertMlm(cfg);
  BertMlmInit(*r.model, 7);
  const nlohmann::json ds = {{"train_batch_size", 12},
                             {"train_micro_batch_size_per_gpu", 2},
                             {"gradient_clipping", 1.0},
                             {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 2e-3}, {"weight_decay", 0.01}}}}},
                             {"zero_optimization", {{"stage", 1}, {"offload_optimizer", {{"device", "cpu"}}}}}};
  EngineOptions eo;
  eo.comm = std::shared_ptr<Comm>(&comm, [](Comm*) {});
  r.engine = std::make_unique<Engine>(r.model.ptr(), Config::FromJson(ds, "bert ranks test"), eo);
  return r;
}

std::vector<double> TrainBert(BertRun& r, const engine::TokenSource& source, int64_t steps) {
  Engine& e = *r.engine;
  const int64_t mb = e.settings().train_micro_batch_size_per_gpu(), T = r.model->config().seq_len;
  std::vector<double> losses;
  while (e.stats().global_steps() < steps) {
    const int64_t step = e.stats().global_steps() + 1, before = e.stats().global_samples();
    double sum = 0;
    for (int64_t m = 0; m < e.settings().gradient_accumulation_steps(); ++m) {
      const int64_t first = engine::FirstRow(m, e.settings().rank(), e.settings().world_size(), mb);
      auto rows = engine::GatherRows(source, step, before, first, mb, T);
      torch::Tensor ids = torch::tensor(rows, torch::kLong).view({mb, T});
      MaskedBatch b = MaskBatch(ids, before + first, 99);
      torch::Tensor loss = r.model->Loss(b.input_ids, b.labels);
      sum += loss.item<double>();
      e.Backward(loss);
      e.Step();
    }
    torch::Tensor total = torch::full({1}, sum, torch::kDouble);
    e.comm().AllReduceSum(total);
    losses.push_back(total.item<double>() /
                     static_cast<double>(e.settings().gradient_accumulation_steps() * e.settings().world_size()));
  }
  return losses;
}

TEST(BertMlm, TwoRanksZero1OffloadResumeOnThreeThroughUniversal) {
  at::set_num_threads(1);
  const fs::path dir = fs::path(::testing::TempDir()) / "bert_ranks";
  fs::remove_all(dir);
  fs::create_directories(dir);
  const std::string data = (dir / "data.bin").string();
  {
    std::ofstream out(data, std::ios::binary);
    const std::string bytes = TextBytes(64 * 1024);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  }
  engine::TokenFileSource source(data, engine::TokenFileSource::Encoding::kBytes, Tiny().seq_len, 256);
  std::vector<double> uninterrupted;
  engine::testing::RunRanks(2, [&](Comm& comm) {
    BertRun r = MakeBertRun(comm);
    std::vector<double> l = TrainBert(r, source, 3);
    c10::impl::GenericDict cs(c10::StringType::get(), c10::AnyType::get());
    cs.insert(std::string("checkpoint_step"), int64_t{3});
    r.engine->SaveCheckpoint((dir / "ckpt").string(), "", cs);
    std::vector<double> rest = TrainBert(r, source, 6);
    l.insert(l.end(), rest.begin(), rest.end());
    if (comm.rank() == 0) uninterrupted = l;
  });
  ckpt::ConvertToUniversal((dir / "ckpt" / "global_step3").string(),
                           (dir / "ckpt" / "global_step3_universal").string());
  std::vector<double> resumed;
  engine::testing::RunRanks(3, [&](Comm& comm) {
    BertRun r = MakeBertRun(comm);
    LoadCheckpointOptions o;
    o.universal = true;
    LoadResult lr = r.engine->LoadCheckpoint((dir / "ckpt").string(), "", o);
    EXPECT_EQ(lr.client_state.toGenericDict().at(std::string("checkpoint_step")).toInt(), 3);
    EXPECT_EQ(r.engine->settings().gradient_accumulation_steps(), 2);  // was 3 on 2 ranks
    std::vector<double> l = TrainBert(r, source, 6);
    if (comm.rank() == 0) resumed = l;
  });
  ASSERT_EQ(uninterrupted.size(), 6u);
  ASSERT_EQ(resumed.size(), 3u);
  for (size_t k = 0; k < 3; ++k)
    EXPECT_NEAR(resumed[k], uninterrupted[3 + k], 1e-5 * std::abs(uninterrupted[3 + k])) << "step " << k + 4;
  fs::remove_all(dir);
}

}  // namespace
}  // namespace uckpt::models
