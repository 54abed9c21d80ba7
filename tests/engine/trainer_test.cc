#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <cmath>

#include "cli/init_weights.h"
#include "cli/trainer.h"
#include "fixture.h"
#include "uckpt/comm.h"

namespace uckpt::engine {
namespace {

using cli::LoadStateDictFile;
using cli::StepMetrics;
using cli::Trainer;
using cli::TrainOptions;

using testing::ReadJson;
using testing::RefrunDir;
using testing::RefrunModel;

// The fixture's run `run` as uckpt options, with the DeepSpeed JSON as given
// except for the batch split (`micro`, GA derived for world size 1).
TrainOptions FixtureOptions(const std::string& run, int64_t micro) {
  nlohmann::json ds = testing::RefrunDsConfig(run);
  ds.erase("gradient_accumulation_steps");
  ds["train_micro_batch_size_per_gpu"] = micro;
  return testing::RefrunOptions(ds, run);
}

double MaxAbsDiff(const Trainer& t, const std::string& state_dict_path) {
  double worst = 0;
  auto ref = LoadStateDictFile(state_dict_path);
  for (const auto& p : t.parameters())
    for (const auto& r : ref)
      if (r.name == p.name) worst = std::max(worst, (p.tensor - r.tensor).abs().max().item<double>());
  return worst;
}

// `bitwise`: every loss, grad norm and final weight equal (one intra-op
// thread, as the fixture's runs had).
void ExpectMatchesRun(const std::string& run, int64_t micro, const std::string& losses_of, bool bitwise = false) {
  at::set_num_threads(1);
  auto comm = MakeSingleProcessComm();
  Trainer t(*comm, FixtureOptions(run, micro));
  auto ref = ReadJson(RefrunDir() + "/runs/" + losses_of + "/losses.json")["steps"];
  double worst = 0;
  for (int step = 1; step <= 12; ++step) {
    StepMetrics m = t.TrainStep();
    const auto& r = ref[std::to_string(step)];
    const double want = r["loss"].get<double>();
    EXPECT_NEAR(m.loss, want, 1e-6 * want) << run << " step " << step;
    EXPECT_DOUBLE_EQ(m.lr, r["lr_used"].get<double>()) << step;
    EXPECT_NEAR(m.grad_norm, r["grad_norm"].get<double>(), 1e-6) << step;
    if (bitwise) {
      EXPECT_EQ(m.loss, want) << run << " step " << step;
      // (torch_ref reports clip_grad_norm_'s norm, another formula than DeepSpeed's.)
      if (losses_of != "torch_ref") {
        EXPECT_EQ(static_cast<float>(m.grad_norm), r["grad_norm"].get<float>()) << run << " step " << step;
      }
    }
    worst = std::max(worst, std::fabs(m.loss - want) / want);
    if (getenv("UCKPT_DEBUG"))
      std::printf("step %d loss %.17g want %.17g gn %.17g want %.17g\n", step, m.loss, want, m.grad_norm,
                  r["grad_norm"].get<double>());
  }
  EXPECT_EQ(t.counters().global_steps, 12);
  EXPECT_EQ(t.counters().global_samples, 96);
  double wd = MaxAbsDiff(t, RefrunDir() + "/runs/" + losses_of + "/final_model.pt");
  EXPECT_LT(wd, 1e-5) << run;
  if (bitwise) {
    EXPECT_EQ(wd, 0.0) << run;
  }
  std::cout << "[ measured ] " << run << " (micro " << micro << ") vs " << losses_of << ": max rel loss diff " << worst
            << ", max final weight diff " << wd << "\n";
}

TEST(TrainerSingleProcess, MatchesDeepSpeedZero2BaselineGA4) {
  ExpectMatchesRun("z2_ws2_baseline", 2, "z2_ws2_baseline");
}
TEST(TrainerSingleProcess, MatchesDeepSpeedZero2BaselineFullBatch) {
  ExpectMatchesRun("z2_ws2_baseline", 8, "z2_ws2_baseline");
}
TEST(TrainerSingleProcess, MatchesDeepSpeedZero1Baseline) { ExpectMatchesRun("z1_ws2_baseline", 2, "z1_ws2_baseline"); }
TEST(TrainerSingleProcess, MatchesDeepSpeedWithActiveClipping) {
  ExpectMatchesRun("z2_ws2_baseline_clip0.5", 2, "z2_ws2_baseline_clip0.5");
}
// One rank, micro 2, GA 4 is the fixture's plain-PyTorch loop op for op.
TEST(TrainerSingleProcess, EqualsPlainTorchReferenceBitwise) {
  ExpectMatchesRun("z2_ws2_baseline", 2, "torch_ref", true);
}

}  // namespace
}  // namespace uckpt::engine
