// The one tag resolver (src/ckpt/folder.h): a tag is a plain folder name
// inside its checkpoint folder, and ReadLatestTag (what the engine's resume
// and every command use) refuses anything else, naming the file.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <vector>

#include "ckpt/folder.h"
#include "format/error.h"
#include "test_util.h"

namespace uckpt::ckpt {
namespace {

using testing::TempDir;

void Write(const std::string& path, const std::string& bytes) { std::ofstream(path, std::ios::binary) << bytes; }

TEST(TagResolver, PlainNamesPass) {
  for (const std::string& tag : std::vector<std::string>{"global_step5", "global_step5_universal", "a", "..a", "a..",
                                                         "x y", std::string(255, 'a')})
    EXPECT_EQ(TagProblem(tag), std::nullopt) << tag;
  EXPECT_EQ(CheckTag("global_step5", "--checkpoint_tag"), "global_step5");
}

TEST(TagResolver, EverythingElseIsRefused) {
  const std::pair<std::string, std::string> bad[] = {
      {"", "empty"},
      {".", "'.'"},
      {"..", "'..'"},
      {"../victim/global_step5", "contains '/'"},
      {"a/b", "contains '/'"},
      {"/etc", "absolute path"},
      {std::string("global_step5\0../x", 17), "NUL"},
      {std::string(256, 'a'), "256 bytes"},
  };
  for (const auto& [tag, why] : bad) {
    auto problem = TagProblem(tag);
    ASSERT_TRUE(problem) << tag;
    EXPECT_NE(problem->find(why), std::string::npos) << *problem;
    try {
      CheckTag(tag, "--checkpoint_tag");
      ADD_FAILURE() << "accepted " << tag;
    } catch (const FormatError& e) {
      EXPECT_EQ(std::string(e.what()).rfind("--checkpoint_tag: names '", 0), 0u) << e.what();
    }
  }
}

TEST(TagResolver, ReadLatestTagNamesTheFile) {
  TempDir d;
  Write(d / "latest", "  global_step7\n");
  EXPECT_EQ(ReadLatestTag(d.path(), "latest"), "global_step7");  // whitespace stripped, as DeepSpeed
  for (const std::string& content : std::vector<std::string>{"../victim/global_step5\n", "", " \n", "/abs",
                                                             std::string("a\0b", 3), std::string(300, 'x')}) {
    Write(d / "latest", content);
    try {
      ReadLatestTag(d.path(), "latest");
      ADD_FAILURE() << "accepted '" << content << "'";
    } catch (const FormatError& e) {
      EXPECT_EQ(std::string(e.what()).rfind(d / "latest" + ": ", 0), 0u) << e.what();
    }
  }
  EXPECT_THROW(ReadLatestTag(d.path(), "latest_universal"), FormatError);  // missing
}

TEST(TagResolver, ResolveTagFolderRefusesAnEscape) {
  TempDir d;
  std::filesystem::create_directories(d / "ckpt");
  std::filesystem::create_directories(d / "victim/global_step5");
  Write(d / "victim/global_step5/mp_rank_00_model_states.pt", "x");
  Write(d / "ckpt/latest", "../victim/global_step5");
  EXPECT_THROW(ResolveTagFolder(d / "ckpt"), FormatError);
  Write(d / "ckpt/latest", "global_step5");  // plain, but absent: no folder
  EXPECT_EQ(ResolveTagFolder(d / "ckpt"), std::nullopt);
}

}  // namespace

// ClassifyFile: DeepSpeed's file names, and names that only look like them.
TEST(FileNames, DeepSpeedKinds) {
  struct Case {
    std::string name;
    FileKind kind;
    int dp, mp;
    std::string prefix;
  };
  const std::vector<Case> cases = {
      {"mp_rank_00_model_states.pt", FileKind::kModelStates, -1, 0, ""},
      {"mp_rank_12_model_states.pt", FileKind::kModelStates, -1, 12, ""},
      {"zero_pp_rank_3_mp_rank_00_model_states.pt", FileKind::kZero3ModelStates, 3, 0, ""},
      {"zero_pp_rank_10_mp_rank_01_optim_states.pt", FileKind::kOptimStates, 10, 1, ""},
      {"bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt", FileKind::kOptimStates, 2, 0, "bf16_"},
      {"fp16_zero_pp_rank_0_mp_rank_00optim_states.pt", FileKind::kOptimStates, 0, 0, "fp16_"},
      {"expert_3_mp_rank_00_model_states.pt", FileKind::kMoeExpert, -1, -1, ""},
      {"layer_2_expert_3_mp_rank_00_model_states.pt", FileKind::kMoeExpert, -1, -1, ""},
      {"expp_rank_1_mp_rank_00_optim_states.pt", FileKind::kMoeExpert, -1, -1, ""},
      {"layer_01-model_00-model_states.pt", FileKind::kPipelineLayer, -1, -1, ""},
      {"layer_.pt", FileKind::kPipelineLayer, -1, -1, ""},
      // Near misses are other files.
      {"mp_rank__model_states.pt", FileKind::kOther, -1, -1, ""},
      {"mp_rank_00_model_states.pt.tmp", FileKind::kOther, -1, -1, ""},
      {"xmp_rank_00_model_states.pt", FileKind::kOther, -1, -1, ""},
      {"zero_pp_rank_3_mp_rank_00_model_states.ptx", FileKind::kOther, -1, -1, ""},
      {"bf32_zero_pp_rank_2_mp_rank_00_optim_states.pt", FileKind::kOther, -1, -1, ""},
      {"zero_pp_rank_a_mp_rank_00_optim_states.pt", FileKind::kOther, -1, -1, ""},
      {"zero_pp_rank_1_mp_rank_00__optim_states.pt", FileKind::kOther, -1, -1, ""},
      {"layer_x_expert_3_mp_rank_00_model_states.pt", FileKind::kPipelineLayer, -1, -1, ""},
      {"layer_pt", FileKind::kOther, -1, -1, ""},
      {"latest", FileKind::kOther, -1, -1, ""},
      {"", FileKind::kOther, -1, -1, ""},
  };
  for (const Case& c : cases) {
    const CheckpointFile f = ClassifyFile("dir", c.name);
    EXPECT_EQ(f.kind, c.kind) << c.name;
    EXPECT_EQ(f.dp, c.dp) << c.name;
    EXPECT_EQ(f.mp, c.mp) << c.name;
    EXPECT_EQ(f.prefix, c.prefix) << c.name;
    EXPECT_EQ(f.path, "dir/" + c.name);
  }
  EXPECT_EQ(ClassifyFile("d", "zero_pp_rank_99999999999_mp_rank_00_optim_states.pt").dp, 1 << 30);
}

}  // namespace uckpt::ckpt
