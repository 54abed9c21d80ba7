// BERT masked-language modeling on uckpt's engine, in the shape of
// DeepSpeed's HelloDeepSpeed tutorial: the model, a DeepSpeed config (ZeRO-1,
// optimizer state offloaded to CPU; fp16 with dynamic loss scaling on a GPU,
// fp32 on a CPU), the loop, and checkpoints that carry
// client_state {"checkpoint_step": step}. Run it again with the same
// --checkpoint_dir and it resumes where it stopped — at any number of ranks
// once `uckpt convert` has made a universal checkpoint of it.
//
//   train_bert_mlm --text /usr/share/common-licenses/GPL-3 --steps 40 --checkpoint_dir ckpt
//   uckpt launch -n 2 -- train_bert_mlm --text ... --steps 80 --checkpoint_dir ckpt
#include <torch/cuda.h>
#include <uckpt/engine.h>
#include <uckpt/models/bert.h>

#include <cstdio>
#include <fstream>
#include <iostream>
#include <iterator>
#include <string>
#include <vector>

namespace {

struct Args {
  std::string text, checkpoint_dir = "ckpt";
  int64_t steps = 40, checkpoint_every = 20;
  bool universal = false;  // resume from `latest_universal` (after `uckpt convert`)
};

Args ParseArgs(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    std::string k = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument(k + " needs a value");
      return argv[++i];
    };
    if (k == "--text") a.text = value();
    else if (k == "--checkpoint_dir") a.checkpoint_dir = value();
    else if (k == "--steps") a.steps = std::stoll(value());
    else if (k == "--checkpoint_every") a.checkpoint_every = std::stoll(value());
    else if (k == "--universal") a.universal = true;
    else throw std::invalid_argument("unknown argument " + k + " (see the comment at the top of train_bert_mlm.cc)");
  }
  if (a.text.empty()) throw std::invalid_argument("--text FILE is required (any file: its bytes are the tokens)");
  return a;
}

// The tutorial's configuration, on a GPU or a CPU.
nlohmann::json DeepSpeedConfig(bool gpu) {
  nlohmann::json c = {
      {"train_batch_size", 16},
      {"train_micro_batch_size_per_gpu", 4},
      {"steps_per_print", 10},
      {"gradient_clipping", 1.0},
      {"optimizer",
       {{"type", "Adam"}, {"params", {{"lr", 1e-3}, {"betas", {0.9, 0.999}}, {"eps", 1e-8}, {"weight_decay", 0.01}}}}},
      {"zero_optimization", {{"stage", 1}, {"offload_optimizer", {{"device", "cpu"}}}}}};
  if (gpu) c["fp16"] = {{"enabled", true}, {"loss_scale", 0}, {"initial_scale_power", 12}};
  return c;
}

// Sample n of the data: seq_len bytes of the text, wrapping around.
torch::Tensor Sample(const std::string& bytes, int64_t n, int64_t seq_len) {
  const int64_t rows = static_cast<int64_t>(bytes.size()) / seq_len;
  const int64_t start = (n % rows) * seq_len;
  torch::Tensor ids = torch::empty({seq_len}, torch::kLong);
  for (int64_t t = 0; t < seq_len; ++t) ids[t] = static_cast<uint8_t>(bytes[start + t]);
  return ids;
}

}  // namespace

int main(int argc, char** argv) try {
  const Args args = ParseArgs(argc, argv);
  std::ifstream in(args.text, std::ios::binary);
  if (!in) throw std::runtime_error(args.text + ": cannot read");
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());

  // 1. The model: a small BERT encoder with its masked-LM head tied to the embedding.
  uckpt::models::BertConfig cfg;
  cfg.n_layer = 2;
  cfg.n_head = 4;
  cfg.n_embd = 64;
  cfg.vocab_size = 260;  // 256 bytes + [MASK] (+ spare ids)
  cfg.seq_len = cfg.n_positions = 64;
  if (static_cast<int64_t>(bytes.size()) < cfg.seq_len)
    throw std::runtime_error(args.text + ": shorter than one sequence");
  uckpt::models::BertMlm model(cfg);
  uckpt::models::BertMlmInit(*model, /*seed=*/42);

  // 2. The engine: DeepSpeed's initialize.
  const bool gpu = torch::cuda::is_available();
  uckpt::EngineOptions options;
  options.device = gpu ? "cuda" : "cpu";
  uckpt::Engine engine(model.ptr(), uckpt::Config::FromJson(DeepSpeedConfig(gpu), "the tutorial's config"), options);
  const uckpt::Engine::Settings& settings = engine.settings();  // rank, batch sizes, device

  // 3. Resume if there is a checkpoint: the client state says where we were.
  uckpt::LoadCheckpointOptions load;
  load.universal = args.universal;
  auto [path, client_state] = engine.LoadCheckpoint(args.checkpoint_dir, "", load);
  int64_t step = 0;
  if (!path.empty()) {
    step = client_state.toGenericDict().at(std::string("checkpoint_step")).toInt();
    if (settings.rank() == 0) std::printf("resumed from %s at step %lld\n", path.c_str(), static_cast<long long>(step));
  }

  // 4. The loop: each rank takes its micro-batches of the global batch.
  const int64_t micro = settings.train_micro_batch_size_per_gpu();
  for (; step < args.steps; ++step) {
    double loss_sum = 0;
    for (int64_t m = 0; m < settings.gradient_accumulation_steps(); ++m) {
      const int64_t first = step * settings.train_batch_size() + (m * settings.world_size() + settings.rank()) * micro;
      std::vector<torch::Tensor> rows;
      for (int64_t i = 0; i < micro; ++i) rows.push_back(Sample(bytes, first + i, cfg.seq_len));
      auto batch = uckpt::models::MaskBatch(torch::stack(rows), first, /*seed=*/1234);
      torch::Tensor loss = model->Loss(batch.input_ids.to(settings.device()), batch.labels.to(settings.device()));
      engine.Backward(loss);
      engine.Step();
      loss_sum += loss.item<double>();
    }
    if (settings.rank() == 0 && (step + 1) % 10 == 0)
      std::printf("step %lld  loss %.4f  lr %.3g\n", static_cast<long long>(step + 1),
                  loss_sum / static_cast<double>(settings.gradient_accumulation_steps()), engine.optimizer().lr());
    if ((step + 1) % args.checkpoint_every == 0 || step + 1 == args.steps) {
      c10::impl::GenericDict state(c10::StringType::get(), c10::AnyType::get());
      state.insert(std::string("checkpoint_step"), step + 1);
      engine.SaveCheckpoint(args.checkpoint_dir, "", state);
    }
  }
  return 0;
} catch (const std::exception& e) {
  std::cerr << "train_bert_mlm: " << e.what() << "\n";
  return 1;
}
