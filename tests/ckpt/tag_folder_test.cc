// A tag folder opened once (ckpt/tag_folder.h): what its names and its
// manifest say, and the readers that work from it list the folder once and
// read its manifest once, counted at the I/O seam (format/env.h).
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>

#include "../format/counting_env.h"
#include "ckpt/convert.h"
#include "ckpt/manifest.h"
#include "ckpt/tag_folder.h"
#include "ckpt/universal_checkpoint.h"
#include "ckpt/zero_checkpoint.h"
#include "format/env.h"
#include "format/error.h"
#include "test_util.h"

namespace uckpt::ckpt {
namespace {

namespace fs = std::filesystem;
using testing::DsFixture;
using testing::TempDir;

using uckpt::testing::CountingEnv;

std::string CopyTag(const TempDir& tmp, const std::string& fixture) {
  const std::string dst = tmp / "in";
  fs::copy(DsFixture(fixture) + "/ckpt/global_step5", dst);
  for (const auto& e : fs::directory_iterator(dst))
    fs::permissions(e.path(), fs::perms::owner_write, fs::perm_options::add);
  return dst;
}

TEST(TagFolder, WhatTheNamesSay) {
  const TagFolder z3 = OpenTagFolder(DsFixture("z3_ws2_fp32") + "/ckpt/global_step5/");
  EXPECT_EQ(z3.path, DsFixture("z3_ws2_fp32") + "/ckpt/global_step5");
  EXPECT_EQ(z3.kind, FolderKind::kZero);
  EXPECT_EQ(z3.stage, FolderStage::kStage3);
  EXPECT_EQ(z3.saved_dp, 2);
  ASSERT_EQ(z3.rank_files.size(), 2u);
  EXPECT_EQ(z3.rank_files[1].dp, 1);
  ASSERT_EQ(z3.model_states.size(), 2u);
  EXPECT_EQ(z3.model_states[0].name, Zero3ModelStatesFileName(0));
  EXPECT_FALSE(z3.has_manifest);
  EXPECT_FALSE(z3.unsynced);
  EXPECT_FALSE(z3.recorded());

  const TagFolder z2 = OpenTagFolder(DsFixture("z2_ws2_fp32") + "/ckpt/global_step5");
  EXPECT_EQ(z2.stage, FolderStage::kStage12);
  EXPECT_EQ(z2.saved_dp, 2);
  ASSERT_EQ(z2.model_states.size(), 1u);
  EXPECT_NE(z2.Find(ModelStatesFileName()), nullptr);
  EXPECT_EQ(z2.Find("no-such-file"), nullptr);
  EXPECT_THROW(OpenTagFolder(DsFixture("z2_ws2_fp32") + "/ckpt/no-such-tag"), IoError);
}

// A converted folder: universal, its manifest parsed with the fingerprint
// the conversion recorded, the tree under zero/ listed for the check.
TEST(TagFolder, UniversalWithManifest) {
  TempDir tmp;
  ConvertOptions o;
  o.durable = false;
  ConvertToUniversal(DsFixture("z2_ws2_fp32") + "/ckpt/global_step5", tmp / "u", o);
  const TagFolder u = OpenTagFolder(tmp / "u");
  EXPECT_EQ(u.kind, FolderKind::kUniversal);
  ASSERT_TRUE(u.manifest) << u.manifest_error;
  EXPECT_TRUE(u.recorded());
  EXPECT_EQ(u.tree.size(), u.manifest->files.size());
  EXPECT_TRUE(std::count(u.tree.begin(), u.tree.end(), "zero/optimizer_state.pt"));
  CheckFolderAgainstManifest(u, true);
}

// One listing of the tag folder and one read of its manifest per open,
// also with the manifest check and the hashes.
TEST(TagFolder, ReadersListOnceAndReadTheManifestOnce) {
  TempDir tmp;
  const std::string in = CopyTag(tmp, "z3_ws2_fp32");
  WriteManifest(in, false);
  ConvertOptions co;
  co.durable = false;
  ConvertToUniversal(in, tmp / "u", co);
  const std::string u = tmp / "u";
  for (bool hashes : {false, true}) {
    CountingEnv env;
    {
      ScopedEnv scoped(env);
      const ZeroCheckpoint z = OpenZeroCheckpoint(in, hashes);
      EXPECT_EQ(z.dp, 2);
      const UniversalCheckpoint uc = OpenUniversalCheckpoint(u, hashes);
      EXPECT_FALSE(uc.groups.empty());
    }
    for (const std::string& folder : {in, u}) {
      EXPECT_EQ(env.lists(folder), 1) << folder << " hashes " << hashes;
      EXPECT_EQ(env.maps(folder + "/" + kManifestName), 1) << folder << " hashes " << hashes;
    }
  }
}

// A damaged manifest is reported by the check, naming it, not by the open.
TEST(TagFolder, DamagedManifestIsTheChecksToReport) {
  TempDir tmp;
  const std::string in = CopyTag(tmp, "z2_ws2_fp32");
  WriteManifest(in, false);
  { std::ofstream(in + "/" + kManifestName) << "{not json"; }
  const TagFolder f = OpenTagFolder(in);
  EXPECT_TRUE(f.has_manifest);
  EXPECT_FALSE(f.manifest);
  try {
    CheckFolderAgainstManifest(f, false);
    ADD_FAILURE() << "a damaged manifest passed";
  } catch (const FormatError& e) {
    EXPECT_NE(std::string(e.what()).find(kManifestName), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace uckpt::ckpt
