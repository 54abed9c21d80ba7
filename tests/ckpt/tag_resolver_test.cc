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

void Write(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

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
  for (const std::string& content : std::vector<std::string>{"../victim/global_step5\n", "", " \n",
                                                       "/abs", std::string("a\0b", 3), std::string(300, 'x')}) {
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
}  // namespace uckpt::ckpt
