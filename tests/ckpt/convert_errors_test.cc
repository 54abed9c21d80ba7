// Bad input is refused with a FormatError that names the file, and a failed
// conversion leaves nothing behind.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "ckpt/convert.h"
#include "format/error.h"
#include "format/torch_file.h"
#include "test_util.h"

namespace uckpt::ckpt {
namespace {

namespace fs = std::filesystem;
using testing::DsFixture;
using testing::TempDir;

// A writable copy of a fixture's ZeRO tag folder.
std::string CopyTag(const TempDir& tmp, const std::string& fixture, const std::string& name = "in") {
  const std::string dst = tmp / name;
  fs::copy(DsFixture(fixture) + "/ckpt/global_step5", dst);
  for (const auto& e : fs::directory_iterator(dst))
    fs::permissions(e.path(), fs::perms::owner_write, fs::perm_options::add);
  return dst;
}

// Converting `in` fails with a FormatError whose message holds every piece of
// `expect`, and leaves no output and no temporary folder.
void ExpectRefused(const TempDir& tmp, const std::string& in, std::vector<std::string> expect) {
  const std::string out_dir = tmp / "out";
  fs::create_directories(out_dir);
  ConvertOptions o;
  o.durable = false;
  try {
    ConvertToUniversal(in, out_dir + "/u", o);
    ADD_FAILURE() << "no error for " << in;
  } catch (const FormatError& e) {
    for (const auto& s : expect) EXPECT_NE(std::string(e.what()).find(s), std::string::npos) << e.what();
  }
  EXPECT_TRUE(fs::is_empty(out_dir)) << "left something in " << out_dir;
}

TEST(ConvertErrors, MissingRankFile) {
  TempDir tmp;
  std::string in = CopyTag(tmp, "z2_ws3_fp32");
  fs::remove(in + "/zero_pp_rank_1_mp_rank_00_optim_states.pt");
  ExpectRefused(tmp, in, {"zero_pp_rank_1_mp_rank_00_optim_states.pt", "missing rank file"});
}

TEST(ConvertErrors, MissingLastRankFile) {
  TempDir tmp;
  std::string in = CopyTag(tmp, "z2_ws3_fp32");
  fs::remove(in + "/zero_pp_rank_2_mp_rank_00_optim_states.pt");
  ExpectRefused(tmp, in, {"zero_pp_rank_2_mp_rank_00_optim_states.pt", "missing rank file"});
}

TEST(ConvertErrors, ExtraRankFile) {
  TempDir tmp;
  std::string in = CopyTag(tmp, "z2_ws2_fp32");
  fs::copy_file(in + "/zero_pp_rank_1_mp_rank_00_optim_states.pt", in + "/zero_pp_rank_2_mp_rank_00_optim_states.pt");
  ExpectRefused(tmp, in, {"zero_pp_rank_2_mp_rank_00_optim_states.pt", "extra rank file"});
}

TEST(ConvertErrors, MissingModelStates) {
  TempDir tmp;
  std::string in = CopyTag(tmp, "z1_ws2_fp32");
  fs::remove(in + "/mp_rank_00_model_states.pt");
  ExpectRefused(tmp, in, {"mp_rank_00_model_states.pt", "missing"});
}

TEST(ConvertErrors, MixedWorldSizesInOptimizerFiles) {
  TempDir tmp;
  std::string in = CopyTag(tmp, "z2_ws2_fp32");
  fs::copy_file(DsFixture("z2_ws3_fp32") + "/ckpt/global_step5/zero_pp_rank_1_mp_rank_00_optim_states.pt",
                in + "/zero_pp_rank_1_mp_rank_00_optim_states.pt", fs::copy_options::overwrite_existing);
  ExpectRefused(tmp, in, {"zero_pp_rank_1_mp_rank_00_optim_states.pt", "mixed world sizes"});
}

TEST(ConvertErrors, MixedWorldSizesInModelStates) {
  TempDir tmp;
  std::string in = CopyTag(tmp, "z2_ws2_fp32");
  fs::copy_file(DsFixture("z2_ws3_fp32") + "/ckpt/global_step5/mp_rank_00_model_states.pt",
                in + "/mp_rank_00_model_states.pt", fs::copy_options::overwrite_existing);
  ExpectRefused(tmp, in, {"mp_rank_00_model_states.pt", "mixed world sizes", "dp_world_size is 3"});
}

// Rank 1 of the same run but another save: its optimizer step differs.
TEST(ConvertErrors, MixedSteps) {
  TempDir tmp;
  std::string in = CopyTag(tmp, "z2_ws2_fp32");
  const std::string rank1 = in + "/zero_pp_rank_1_mp_rank_00_optim_states.pt";
  TorchFile f = LoadTorchFile(rank1);
  ValuePtr st = f.root->get("optimizer_state_dict")->get("base_optimizer_state")->get("state")->entries[0].second;
  float four = 4.0f;
  st->set("step",
          Value::FromTensor(Tensor::FromBytes(
              DType::kFloat32, {}, {reinterpret_cast<uint8_t*>(&four), reinterpret_cast<uint8_t*>(&four) + 4})));
  SaveTorchFile(rank1 + ".new", f.root);
  fs::rename(rank1 + ".new", rank1);
  ExpectRefused(tmp, in, {"zero_pp_rank_1_mp_rank_00_optim_states.pt", "mixed steps", "4"});
}

TEST(ConvertErrors, MixedStepsInZero3ModelStates) {
  TempDir tmp;
  std::string in = CopyTag(tmp, "z3_ws2_fp32");
  const std::string m1 = in + "/zero_pp_rank_1_mp_rank_00_model_states.pt";
  TorchFile f = LoadTorchFile(m1);
  f.root->set("global_steps", Value::Int(7));
  SaveTorchFile(m1 + ".new", f.root);
  fs::rename(m1 + ".new", m1);
  ExpectRefused(tmp, in, {"zero_pp_rank_1_mp_rank_00_model_states.pt", "mixed steps"});
}

// Rank 1's `exp_avg` of its first partition rewritten as bf16 (zeros, the
// same element count): files of two runs mixed.
void MakeRankOneExpAvgBf16(const std::string& in, bool zero3) {
  const std::string rank1 = in + "/zero_pp_rank_1_mp_rank_00_optim_states.pt";
  TorchFile f = LoadTorchFile(rank1);
  ValuePtr osd = f.root->get("optimizer_state_dict");
  ValuePtr st =
      (zero3 ? osd->get("optimizer_state_dict") : osd->get("base_optimizer_state"))->get("state")->entries[0].second;
  const Tensor& t = *st->get("exp_avg")->tensor;
  st->set("exp_avg", Value::FromTensor(Tensor::FromBytes(DType::kBFloat16, t.shape,
                                                         std::vector<uint8_t>(static_cast<size_t>(t.numel()) * 2, 0))));
  SaveTorchFile(rank1 + ".new", f.root);
  fs::rename(rank1 + ".new", rank1);
}

// Every stage's rank files must agree on each state's dtype; the message
// names the file that differs and rank 0's.
TEST(ConvertErrors, MixedDtypesZero3) {
  TempDir tmp;
  std::string in = CopyTag(tmp, "z3_ws2_fp32");
  MakeRankOneExpAvgBf16(in, true);
  ExpectRefused(tmp, in,
                {"zero_pp_rank_1_mp_rank_00_optim_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                 "'exp_avg' is bfloat16", "float32"});
}

TEST(ConvertErrors, MixedDtypesZero2) {
  TempDir tmp;
  std::string in = CopyTag(tmp, "z2_ws2_fp32");
  MakeRankOneExpAvgBf16(in, false);
  ExpectRefused(tmp, in,
                {"zero_pp_rank_1_mp_rank_00_optim_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                 "'exp_avg' is bfloat16", "float32"});
}

// param_shapes that disagree with the partitions (one parameter grown by 2).
TEST(ConvertErrors, ShapesThatDoNotAddUp) {
  TempDir tmp;
  std::string in = CopyTag(tmp, "z1_ws2_fp32");
  const std::string model = in + "/mp_rank_00_model_states.pt";
  TorchFile f = LoadTorchFile(model);
  ValuePtr shapes = f.root->get("param_shapes")->items[0];
  shapes->set("wpe.weight", Value::Size({9, 11}));
  SaveTorchFile(model + ".new", f.root);
  fs::rename(model + ".new", model);
  ExpectRefused(tmp, in, {"zero_pp_rank_0_mp_rank_00_optim_states.pt", "shapes do not add up"});
}

TEST(ConvertErrors, ShapesThatDoNotAddUpZero3) {
  TempDir tmp;
  std::string in = CopyTag(tmp, "z3_ws2_fp32");
  for (int r = 0; r < 2; ++r) {
    const std::string model = in + "/zero_pp_rank_" + std::to_string(r) + "_mp_rank_00_model_states.pt";
    TorchFile f = LoadTorchFile(model);
    f.root->get("param_shapes")->items[0]->set("wte.weight", Value::Size({40, 11}));
    SaveTorchFile(model + ".new", f.root);
    fs::rename(model + ".new", model);
  }
  ExpectRefused(tmp, in, {"zero_pp_rank_0_mp_rank_00_optim_states.pt", "shapes do not add up"});
}

TEST(ConvertErrors, TruncatedFile) {
  TempDir tmp;
  std::string in = CopyTag(tmp, "z2_ws2_fp32");
  const std::string rank1 = in + "/zero_pp_rank_1_mp_rank_00_optim_states.pt";
  fs::resize_file(rank1, fs::file_size(rank1) / 2);
  ExpectRefused(tmp, in, {"zero_pp_rank_1_mp_rank_00_optim_states.pt"});
}

TEST(ConvertErrors, CorruptFile) {
  TempDir tmp;
  std::string in = CopyTag(tmp, "z2_ws2_fp32");
  const std::string rank0 = in + "/zero_pp_rank_0_mp_rank_00_optim_states.pt";
  std::string bytes = testing::ReadFile(rank0);
  for (size_t i = 100; i < 400; ++i) bytes[i] = static_cast<char>(0xA5);  // inside data.pkl
  std::ofstream(rank0, std::ios::binary | std::ios::trunc) << bytes;
  ExpectRefused(tmp, in, {"zero_pp_rank_0_mp_rank_00_optim_states.pt"});
}

TEST(ConvertErrors, TensorParallelIsRefused) {
  TempDir tmp;
  std::string in = CopyTag(tmp, "z1_ws2_fp32");
  fs::copy_file(in + "/mp_rank_00_model_states.pt", in + "/mp_rank_01_model_states.pt");
  ExpectRefused(tmp, in, {"mp_rank_01_model_states.pt", "tensor/pipeline-parallel", "not supported"});
}

TEST(ConvertErrors, PipelineParallelIsRefused) {
  TempDir tmp;
  std::string in = CopyTag(tmp, "z1_ws2_fp32");
  fs::copy_file(in + "/mp_rank_00_model_states.pt", in + "/layer_01-model_states.pt");
  ExpectRefused(tmp, in, {"layer_01-model_states.pt", "pipeline-parallel"});
}

TEST(ConvertErrors, PatternRulesAreRefused) {
  TempDir tmp;
  std::string in = CopyTag(tmp, "z1_ws2_fp32");
  const std::string model = in + "/mp_rank_00_model_states.pt";
  TorchFile f = LoadTorchFile(model);
  f.root->get("universal_checkpoint_info")->set("vocabulary_parameter_patterns", Value::List({Value::Str("wte")}));
  SaveTorchFile(model + ".new", f.root);
  fs::rename(model + ".new", model);
  ExpectRefused(tmp, in, {"mp_rank_00_model_states.pt", "vocabulary_parameter_patterns", "not supported"});
}

TEST(ConvertErrors, NotACheckpoint) {
  TempDir tmp;
  fs::create_directories(tmp / "empty");
  ExpectRefused(tmp, tmp / "empty", {"no zero_pp_rank_*_optim_states.pt"});
}

TEST(ConvertErrors, ExistingOutputNeedsForce) {
  TempDir tmp;
  fs::create_directories(tmp / "u");
  std::ofstream(tmp / "u/keep") << "x";
  ConvertOptions o;
  o.durable = false;
  EXPECT_THROW(ConvertToUniversal(DsFixture("z1_ws2_fp32") + "/ckpt/global_step5", tmp / "u", o), IoError);
  EXPECT_TRUE(fs::exists(tmp / "u/keep"));
  o.force = true;
  ConvertToUniversal(DsFixture("z1_ws2_fp32") + "/ckpt/global_step5", tmp / "u", o);
  EXPECT_FALSE(fs::exists(tmp / "u/keep"));
  EXPECT_TRUE(fs::exists(tmp / "u/zero/wte.weight/fp32.pt"));
  EXPECT_EQ(testing::CountEntriesStartingWith(tmp.path(), ".u.uckpt-"), 0);
}

// A conversion killed with SIGKILL leaves its temporary folder; the next
// conversion to the same output removes it (its process is gone) and says so,
// but leaves one whose process still runs, and other outputs' folders.
TEST(ConvertErrors, StaleTemporaryOfAKilledConversionIsRemoved) {
  TempDir tmp;
  const pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  ASSERT_GT(child, 0);
  ASSERT_EQ(::waitpid(child, nullptr, 0), child);  // a pid that is certainly not running
  const std::string dead = tmp / (".u.uckpt-tmp-" + std::to_string(child) + "-17");
  const std::string alive = tmp / (".u.uckpt-tmp-" + std::to_string(::getppid()) + "-3");
  const std::string other = tmp / (".v.uckpt-tmp-" + std::to_string(child) + "-17");
  const std::string odd = tmp / ".u.uckpt-tmp-x-1";
  for (const auto& d : {dead, alive, other, odd}) {
    fs::create_directories(d + "/zero/wte.weight");
    std::ofstream(d + "/zero/wte.weight/fp32.pt") << "partial";
  }
  EXPECT_EQ(StaleConvertTemporaries(tmp / "u"), std::vector<std::string>{dead});
  std::vector<std::string> notices;
  ConvertOptions o;
  o.durable = false;
  o.notice = [&](const std::string& line) { notices.push_back(line); };
  ConvertToUniversal(DsFixture("z1_ws2_fp32") + "/ckpt/global_step5", tmp / "u", o);
  EXPECT_FALSE(fs::exists(dead));
  EXPECT_TRUE(fs::exists(alive));
  EXPECT_TRUE(fs::exists(other));
  EXPECT_TRUE(fs::exists(odd));
  ASSERT_EQ(notices.size(), 1u);
  EXPECT_NE(notices[0].find(dead), std::string::npos) << notices[0];
  EXPECT_TRUE(fs::exists(tmp / "u/zero/wte.weight/fp32.pt"));
}

// A write that fails half-way (here: the file-size limit, EFBIG, standing in
// for a full disk) is reported with the file's name; nothing is left.
TEST(ConvertErrors, WriteFailureLeavesNothing) {
  TempDir tmp;
  fs::create_directories(tmp / "out");
  struct sigaction ignore {
  }, old{};
  ignore.sa_handler = SIG_IGN;
  sigaction(SIGXFSZ, &ignore, &old);
  struct rlimit saved;
  getrlimit(RLIMIT_FSIZE, &saved);
  struct rlimit small = saved;
  small.rlim_cur = 8192;  // the copied model states (20 KB) cannot be written
  setrlimit(RLIMIT_FSIZE, &small);
  std::string message;
  try {
    ConvertOptions o;
    o.durable = false;
    ConvertToUniversal(DsFixture("z2_ws3_fp32") + "/ckpt/global_step5", tmp / "out/u", o);
  } catch (const IoError& e) {
    message = e.what();
  }
  setrlimit(RLIMIT_FSIZE, &saved);
  sigaction(SIGXFSZ, &old, nullptr);
  EXPECT_NE(message.find("mp_rank_00_model_states.pt"), std::string::npos) << message;
  EXPECT_NE(message.find("File too large"), std::string::npos) << message;
  EXPECT_TRUE(fs::is_empty(tmp / "out"));
}

}  // namespace
}  // namespace uckpt::ckpt
