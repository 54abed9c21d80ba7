// GPT-2 on uckpt's engine, read top to bottom: a model, a DeepSpeed config,
// the loop (Backward, Step), checkpoints with client_state, resume.
//
//   train_gpt2 --text /usr/share/common-licenses/GPL-3 --steps 40 --checkpoint_dir ckpt
//   uckpt launch -n 4 -- train_gpt2 --text ... --steps 80 --checkpoint_dir ckpt    # resumes at step 40
//   uckpt convert ckpt/global_step80 ckpt/global_step80_universal
//   uckpt launch -n 2 -- train_gpt2 --text ... --steps 120 --checkpoint_dir ckpt --universal
#include <torch/cuda.h>
#include <uckpt/engine.h>
#include <uckpt/models/gpt2.h>

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
  bool universal = false;
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
    else throw std::invalid_argument("unknown argument " + k + " (see the comment at the top of train_gpt2.cc)");
  }
  if (a.text.empty()) throw std::invalid_argument("--text FILE is required (any file: its bytes are the tokens)");
  return a;
}

}  // namespace

int main(int argc, char** argv) try {
  const Args args = ParseArgs(argc, argv);
  std::ifstream in(args.text, std::ios::binary);
  if (!in) throw std::runtime_error(args.text + ": cannot read");
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());

  // 1. The model: Hugging Face's GPT-2 (names, math, tied head), byte vocabulary.
  uckpt::models::Gpt2Config cfg;
  cfg.n_layer = 2;
  cfg.n_head = 4;
  cfg.n_embd = 64;
  cfg.vocab_size = 256;
  cfg.n_positions = 64;
  const int64_t seq_len = 64;
  if (static_cast<int64_t>(bytes.size()) < seq_len) throw std::runtime_error(args.text + ": shorter than one sequence");
  auto model = std::make_shared<uckpt::models::Gpt2Module>(cfg);
  uckpt::models::Gpt2Init(cfg, model->ordered_parameters(), /*seed=*/1234);

  // 2. The engine, from a DeepSpeed config: ZeRO-2, AdamW with warm-up, bf16 on a GPU.
  const bool gpu = torch::cuda::is_available();
  nlohmann::json config = {
      {"train_batch_size", 32},
      {"train_micro_batch_size_per_gpu", 8},
      {"gradient_clipping", 1.0},
      {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 2e-3}, {"betas", {0.9, 0.95}}, {"weight_decay", 0.01}}}}},
      {"scheduler",
       {{"type", "WarmupLR"}, {"params", {{"warmup_min_lr", 0}, {"warmup_max_lr", 2e-3}, {"warmup_num_steps", 10}}}}},
      {"zero_optimization", {{"stage", 2}}},
      {"bf16", {{"enabled", gpu}}}};
  uckpt::EngineOptions options;
  options.device = gpu ? "cuda" : "cpu";
  uckpt::Engine engine(model, uckpt::Config::FromJson(config, "train_gpt2's config"), options);
  const uckpt::Engine::Settings& settings = engine.settings();  // rank, batch sizes, device

  // 3. Resume if there is a checkpoint (none yet: path is empty).
  uckpt::LoadCheckpointOptions load;
  load.universal = args.universal;
  auto [path, client_state] = engine.LoadCheckpoint(args.checkpoint_dir, "", load);
  int64_t step = path.empty() ? 0 : client_state.toGenericDict().at(std::string("checkpoint_step")).toInt();
  if (!path.empty() && settings.rank() == 0)
    std::printf("resumed from %s at step %lld\n", path.c_str(), static_cast<long long>(step));

  // 4. The loop. Sample n is seq_len bytes of the text; step s trains on
  // samples [s*B, (s+1)*B), each rank on its own micro-batches of them.
  const int64_t micro = settings.train_micro_batch_size_per_gpu();
  const int64_t rows = static_cast<int64_t>(bytes.size()) / seq_len;
  for (; step < args.steps; ++step) {
    double loss_sum = 0;
    for (int64_t m = 0; m < settings.gradient_accumulation_steps(); ++m) {
      const int64_t first = step * settings.train_batch_size() + (m * settings.world_size() + settings.rank()) * micro;
      torch::Tensor ids = torch::empty({micro, seq_len}, torch::kLong);
      for (int64_t i = 0; i < micro; ++i)
        for (int64_t t = 0; t < seq_len; ++t)
          ids[i][t] = static_cast<uint8_t>(bytes[((first + i) % rows) * seq_len + t]);
      torch::Tensor loss = model->Loss(ids.to(settings.device()));
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
  std::cerr << "train_gpt2: " << e.what() << "\n";
  return 1;
}
