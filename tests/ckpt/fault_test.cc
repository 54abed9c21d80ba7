// convert and export under injected I/O faults (format/fault_env.h): every
// fault gives an IoError naming a file, and the previous output (universal
// folder, latest_universal, exported file) stays exactly as it was, with no
// temporary left behind.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <map>
#include <set>
#include <vector>

#include "ckpt/convert.h"
#include "ckpt/export.h"
#include "format/error.h"
#include "format/fault_env.h"
#include "test_util.h"

namespace uckpt::ckpt {
namespace {

namespace fs = std::filesystem;
using testing::DsFixture;
using testing::ReadFile;
using testing::TempDir;

const std::string kInput = DsFixture("z1_ws2_fp32") + "/ckpt/global_step5";

// Setup conversions need not reach the disk (syncfs is slow on a busy machine).
ConvertOptions Scratch() {
  ConvertOptions o;
  o.durable = false;
  return o;
}

// Every file under `root` with its bytes.
std::map<std::string, std::string> Snapshot(const std::string& root) {
  std::map<std::string, std::string> out;
  for (const auto& f : testing::ListFiles(root)) out[f] = ReadFile(root + "/" + f);
  return out;
}

// Names in `dir` other than the expected ones (temporary leftovers).
std::vector<std::string> Extra(const std::string& dir, std::set<std::string> expected) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir))
    if (!expected.count(e.path().filename().string())) out.push_back(e.path().filename().string());
  return out;
}

struct ConvertFault {
  const char* name;
  IoOp op;
  std::string path_contains;  // "<out>" stands for the output folder's path
  int nth;
  int error;
};

void PrintTo(const ConvertFault& c, std::ostream* os) { *os << c.name; }

class ConvertUnderFault : public ::testing::TestWithParam<ConvertFault> {};

TEST_P(ConvertUnderFault, OldOutputAndLatestUniversalIntact) {
  const ConvertFault& c = GetParam();
  TempDir tmp;
  ConvertToUniversal(kInput, tmp / "u", Scratch());
  const auto before = Snapshot(tmp / "u");
  ASSERT_EQ(ReadFile(tmp / "latest_universal"), "u");

  // Both a new output ("v") and a --force replacement of the old one ("u").
  for (const std::string out : {"v", "u"}) {
    SCOPED_TRACE(out);
    FaultEnv env;
    std::string where = c.path_contains == "<out>" ? tmp / out : c.path_contains;
    env.Add({c.op, where, c.nth, c.error});
    ScopedEnv use(env);
    ConvertOptions o;
    o.force = true;
    o.threads = 2;
    try {
      ConvertToUniversal(kInput, tmp / out, o);
      ADD_FAILURE() << "no error";
    } catch (const IoError& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find(where), std::string::npos) << "does not name the file: " << msg;
      EXPECT_NE(msg.find(std::strerror(c.error)), std::string::npos) << msg;
    }
    EXPECT_GE(env.injected(), 1u);
    EXPECT_EQ(Snapshot(tmp / "u"), before);
    EXPECT_EQ(ReadFile(tmp / "latest_universal"), "u");
    EXPECT_FALSE(fs::exists(tmp / "v"));
    EXPECT_EQ(Extra(tmp.path(), {"u", "latest_universal"}), std::vector<std::string>{});
  }
}

INSTANTIATE_TEST_SUITE_P(Faults, ConvertUnderFault,
                         ::testing::Values(ConvertFault{"input_eio", IoOp::kMap, "zero_pp_rank_1", 1, EIO},
                                           ConvertFault{"param_folder", IoOp::kCreateDir, "zero/", 3, EACCES},
                                           ConvertFault{"create", IoOp::kCreate, "fp32.pt", 2, ENOSPC},
                                           ConvertFault{"write_enospc", IoOp::kWrite, "exp_avg", 3, ENOSPC},
                                           ConvertFault{"write_eio", IoOp::kWrite, "optimizer_state.pt", 1, EIO},
                                           ConvertFault{"copy_model_states", IoOp::kCopy, "model_states", 1, ENOSPC},
                                           ConvertFault{"syncfs", IoOp::kSyncDir, "uckpt-tmp", 1, EIO},
                                           ConvertFault{"folder_rename", IoOp::kRename, "<out>", 1, EXDEV}),
                         [](const auto& info) { return std::string(info.param.name); });

TEST(ConvertUnderFault, ShortWritesGiveTheSameOutput) {
  TempDir tmp;
  ConvertToUniversal(kInput, tmp / "plain", Scratch());
  {
    FaultEnv env;
    env.set_short_writes(true);
    ScopedEnv use(env);
    ConvertToUniversal(kInput, tmp / "short", Scratch());
  }
  EXPECT_EQ(Snapshot(tmp / "short"), Snapshot(tmp / "plain"));
}

TEST(ConvertUnderFault, FailedLatestUniversalKeepsTheOldOne) {
  // The new folder is complete and in place; latest_universal could not be
  // replaced, so it still names the old output and the error says why.
  TempDir tmp;
  ConvertToUniversal(kInput, tmp / "u", Scratch());
  FaultEnv env;
  env.Add({IoOp::kRename, "latest_universal", 1, EIO});
  ScopedEnv use(env);
  EXPECT_THROW(ConvertToUniversal(kInput, tmp / "v", Scratch()), IoError);
  EXPECT_EQ(ReadFile(tmp / "latest_universal"), "u");
  EXPECT_EQ(Snapshot(tmp / "v"), Snapshot(tmp / "u"));
}

TEST(ExportUnderFault, OldFileIntact) {
  TempDir tmp;
  const std::string out = tmp / "model.safetensors";
  ExportSafetensors(kInput, out);
  const std::string before = ReadFile(out);
  ASSERT_GT(before.size(), 1000u);
  struct Case {
    IoOp op;
    std::string path;
    int nth, error;
  };
  for (const Case& c :
       {Case{IoOp::kMap, "zero_pp_rank_0", 1, EIO}, Case{IoOp::kCreate, "model.safetensors", 1, ENOSPC},
        Case{IoOp::kWrite, "model.safetensors", 1, ENOSPC}, Case{IoOp::kSync, "model.safetensors", 1, EIO},
        Case{IoOp::kRename, "model.safetensors", 1, EXDEV}}) {
    SCOPED_TRACE(IoOpName(c.op));
    FaultEnv env;
    env.Add({c.op, c.path, c.nth, c.error});
    ScopedEnv use(env);
    try {
      ExportSafetensors(kInput, out, DType::kBFloat16);
      ADD_FAILURE() << "no error";
    } catch (const IoError& e) {
      EXPECT_NE(std::string(e.what()).find(c.path), std::string::npos) << e.what();
    }
    EXPECT_EQ(ReadFile(out), before);
    EXPECT_EQ(Extra(tmp.path(), {"model.safetensors"}), std::vector<std::string>{});
  }
  // Short writes: the same bytes as without.
  FaultEnv env;
  env.set_short_writes(true);
  ScopedEnv use(env);
  ExportSafetensors(kInput, tmp / "short.safetensors");
  EXPECT_EQ(ReadFile(tmp / "short.safetensors"), before);
}

}  // namespace
}  // namespace uckpt::ckpt
