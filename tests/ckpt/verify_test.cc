// `uckpt verify` and the manifest checks on load, over the DeepSpeed fixtures
// (no manifest: structure and CRC-32s) and over our own convert output (with a
// manifest): intact folders pass; a flipped byte, a truncated, missing, extra
// or swapped file, a missing rank file and a tensor of the wrong size are each
// reported naming the file.
#include "ckpt/verify.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "ckpt/convert.h"
#include "ckpt/export.h"
#include "ckpt/universal_checkpoint.h"
#include "ckpt/zero_checkpoint.h"
#include "format/error.h"
#include "test_util.h"

namespace uckpt::ckpt {
namespace {

namespace fs = std::filesystem;
using testing::DsFixture;
using testing::Shared;
using testing::TempDir;

const char* kFixtures[] = {"z1_ws2_bf16",      "z1_ws2_fp16", "z1_ws2_fp32", "z2_ws2_fp32",
                           "z2_ws2_gas2_fp32", "z2_ws3_fp32", "z3_ws2_fp32"};

std::string Describe(const VerifyReport& r) {
  std::string s;
  for (const auto& p : r.problems) s += p.file + ": " + p.what + "\n";
  for (const auto& f : r.folders)
    for (const auto& p : f.problems) s += p.file + ": " + p.what + "\n";
  return s;
}

// The problem reported for `file`, "" if none.
std::string ProblemOf(const VerifyReport& r, const std::string& file) {
  for (const auto& p : r.problems)
    if (p.file == file) return p.what;
  for (const auto& f : r.folders)
    for (const auto& p : f.problems)
      if (p.file == file) return p.what;
  return "";
}

void FlipByte(const std::string& path, uint64_t offset) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(static_cast<std::streamoff>(offset));
  char c = 0;
  f.get(c);
  f.seekp(static_cast<std::streamoff>(offset));
  f.put(static_cast<char>(c ^ 0x10));
}

std::string CopyTree(const std::string& from, const std::string& to) {
  fs::copy(from, to, fs::copy_options::recursive);
  return to;
}

// Our conversion of a fixture: a universal folder with a manifest.
std::string Converted(const TempDir& tmp, const std::string& fixture = "z2_ws2_fp32") {
  const std::string out = tmp / "ckpt/global_step5_universal";
  fs::create_directories(tmp / "ckpt");
  ConvertOptions o;
  o.durable = false;
  ConvertToUniversal(DsFixture(fixture) + "/ckpt/global_step5", out, o);
  return out;
}

const std::string kParamDir = "/zero/h.0.attn.c_attn.weight";

TEST(Verify, DeepSpeedFixturesPass) {
  std::vector<std::string> roots;
  for (const char* f : kFixtures) {
    roots.push_back(DsFixture(f) + "/ckpt");
    if (fs::exists(DsFixture(f) + "/resharded_ws3")) roots.push_back(DsFixture(f) + "/resharded_ws3");
  }
  for (const char* r : {"ckpt", "ckpt_zero1", "resharded_ws4"})
    roots.push_back(Shared() + "/fixtures/refrun-gpt2/" + r);
  for (const auto& root : roots) {
    SCOPED_TRACE(root);
    ASSERT_TRUE(fs::is_directory(root));
    VerifyReport r = VerifyCheckpoint(root);
    EXPECT_TRUE(r.ok()) << Describe(r);
    ASSERT_GE(r.folders.size(), 1u);
    for (const auto& f : r.folders) {
      EXPECT_FALSE(f.manifest);
      EXPECT_NE(f.kind, FolderKind::kUnknown);
      EXPECT_GE(f.files, 2u) << f.folder;
    }
  }
}

TEST(Verify, ConvertOutputHasAManifestAndPasses) {
  TempDir tmp;
  const std::string u = Converted(tmp);
  ASSERT_TRUE(HasManifest(u));
  Manifest m = ReadManifest(u);
  EXPECT_EQ(m.files.size(), testing::ListFiles(u).size() - 1);  // all but the manifest
  VerifyReport r = VerifyCheckpoint(tmp / "ckpt");              // the root: latest_universal names it
  EXPECT_TRUE(r.ok()) << Describe(r);
  ASSERT_EQ(r.folders.size(), 1u);
  EXPECT_TRUE(r.folders[0].manifest);
  EXPECT_EQ(r.folders[0].kind, FolderKind::kUniversal);
  EXPECT_EQ(r.folders[0].files, m.files.size());
  EXPECT_NO_THROW(OpenUniversalCheckpoint(u, /*verify_hashes=*/true));
}

TEST(Verify, FlippedByteWithManifestNamesTheFile) {
  TempDir tmp;
  const std::string u = Converted(tmp);
  const std::string victim = u + kParamDir + "/exp_avg.pt";
  FlipByte(victim, fs::file_size(victim) / 2);
  VerifyReport r = VerifyCheckpoint(u);
  EXPECT_FALSE(r.ok());
  EXPECT_EQ(r.problem_count(), 1u) << Describe(r);
  EXPECT_NE(ProblemOf(r, victim).find("content differs from the manifest"), std::string::npos) << Describe(r);
  // Sizes only: not found (that is what --verify / reading contents is for).
  EXPECT_TRUE(VerifyCheckpoint(u, {.hashes = false}).ok());
  // Loading: sizes pass, hashes name the file.
  EXPECT_NO_THROW(OpenUniversalCheckpoint(u));
  try {
    OpenUniversalCheckpoint(u, /*verify_hashes=*/true);
    FAIL() << "a flipped byte passed a hash-verified open";
  } catch (const FormatError& e) {
    EXPECT_NE(std::string(e.what()).find(victim + ": content differs"), std::string::npos) << e.what();
  }
  EXPECT_THROW(ExportSafetensors(u, tmp / "m.safetensors", DType::kFloat32, /*verify_hashes=*/true), FormatError);
  EXPECT_FALSE(fs::exists(tmp / "m.safetensors"));
}

TEST(Verify, TruncatedFileFailsLoadWithoutVerify) {
  TempDir tmp;
  const std::string u = Converted(tmp);
  const std::string victim = u + kParamDir + "/fp32.pt";
  const uint64_t size = fs::file_size(victim);
  fs::resize_file(victim, size - 100);
  const std::string expected = victim + ": size " + std::to_string(size - 100) + " bytes, the manifest says " +
                               std::to_string(size) + " (truncated)";
  try {
    OpenUniversalCheckpoint(u);
    FAIL() << "a truncated file passed the size check";
  } catch (const FormatError& e) {
    EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << e.what();
  }
  EXPECT_THROW(ExportSafetensors(u, tmp / "m.safetensors"), FormatError);
  VerifyReport r = VerifyCheckpoint(u, {.hashes = false});
  EXPECT_EQ(r.problem_count(), 1u) << Describe(r);
  EXPECT_EQ(victim + ": " + ProblemOf(r, victim), expected);
}

TEST(Verify, MissingExtraAndSwappedFilesWithManifest) {
  TempDir tmp;
  const std::string u = Converted(tmp);
  const std::string gone = u + kParamDir + "/exp_avg_sq.pt";
  fs::remove(gone);
  const std::string extra = u + "/notes.txt";
  std::ofstream(extra) << "hello";
  // Same size, other content: exp_avg and fp32 of one parameter swapped.
  const std::string a = u + "/zero/h.0.attn.c_proj.bias/exp_avg.pt", b = u + "/zero/h.0.attn.c_proj.bias/fp32.pt";
  fs::rename(a, tmp / "t");
  fs::rename(b, a);
  fs::rename(tmp / "t", b);
  VerifyReport r = VerifyCheckpoint(u);
  EXPECT_EQ(ProblemOf(r, gone), "missing");
  EXPECT_EQ(ProblemOf(r, extra), "is not listed in the manifest");
  if (fs::file_size(a) == fs::file_size(b)) {
    EXPECT_NE(ProblemOf(r, a).find("content differs"), std::string::npos) << Describe(r);
    EXPECT_NE(ProblemOf(r, b).find("content differs"), std::string::npos) << Describe(r);
  } else {
    EXPECT_NE(ProblemOf(r, a).find("size"), std::string::npos) << Describe(r);
  }
  EXPECT_EQ(r.problem_count(), 4u) << Describe(r);
  EXPECT_THROW(OpenUniversalCheckpoint(u), FormatError);  // missing/extra files fail even without hashes
}

TEST(Verify, ZeroFolderWithManifestChecksSizesOnOpen) {
  TempDir tmp;
  const std::string z = CopyTree(DsFixture("z2_ws2_fp32") + "/ckpt/global_step5", tmp / "global_step5");
  WriteManifest(z, false);
  EXPECT_NO_THROW(OpenZeroCheckpoint(z, true));
  const std::string victim = z + "/zero_pp_rank_1_mp_rank_00_optim_states.pt";
  fs::resize_file(victim, fs::file_size(victim) + 1);
  try {
    OpenZeroCheckpoint(z);
    FAIL() << "a grown rank file passed the size check";
  } catch (const FormatError& e) {
    EXPECT_NE(std::string(e.what()).find(victim + ": size"), std::string::npos) << e.what();
  }
  ConvertOptions o;
  o.durable = false;
  EXPECT_THROW(ConvertToUniversal(z, tmp / "u", o), FormatError);
  EXPECT_FALSE(fs::exists(tmp / "u"));
}

TEST(Verify, WithoutManifestMissingRankFile) {
  TempDir tmp;
  const std::string z = CopyTree(DsFixture("z2_ws3_fp32") + "/ckpt/global_step5", tmp / "global_step5");
  const std::string gone = z + "/zero_pp_rank_2_mp_rank_00_optim_states.pt";
  fs::remove(gone);
  VerifyReport r = VerifyCheckpoint(z);
  ASSERT_EQ(r.problem_count(), 1u) << Describe(r);
  EXPECT_NE(ProblemOf(r, gone).find("missing rank file"), std::string::npos) << Describe(r);
}

TEST(Verify, WithoutManifestFlippedByteFailsItsCrc) {
  TempDir tmp;
  const std::string z = CopyTree(DsFixture("z2_ws2_fp32") + "/ckpt/global_step5", tmp / "global_step5");
  const std::string victim = z + "/zero_pp_rank_0_mp_rank_00_optim_states.pt";
  FlipByte(victim, fs::file_size(victim) / 2);
  VerifyReport r = VerifyCheckpoint(z);
  ASSERT_EQ(r.problem_count(), 1u) << Describe(r);
  EXPECT_FALSE(ProblemOf(r, victim).empty()) << Describe(r);
}

TEST(Verify, WithoutManifestWrongSizedTensorAndStrayFolder) {
  TempDir tmp;
  const std::string u =
      CopyTree(DsFixture("z2_ws2_fp32") + "/ckpt/global_step5_universal", tmp / "global_step5_universal");
  // A bias's file where a weight's belongs: parses, wrong number of elements.
  const std::string victim = u + kParamDir + "/fp32.pt";
  fs::copy_file(u + "/zero/h.0.attn.c_attn.bias/fp32.pt", victim, fs::copy_options::overwrite_existing);
  fs::create_directories(u + "/zero/no.such.param");
  const std::string gone = u + "/zero/h.0.mlp.c_fc.bias/exp_avg_sq.pt";
  fs::remove(gone);
  VerifyReport r = VerifyCheckpoint(u);
  EXPECT_EQ(r.problem_count(), 3u) << Describe(r);
  EXPECT_NE(ProblemOf(r, victim).find("elements, param_shapes gives h.0.attn.c_attn.weight the shape"),
            std::string::npos)
      << Describe(r);
  EXPECT_EQ(ProblemOf(r, gone), "missing");
  EXPECT_NE(ProblemOf(r, u + "/zero/no.such.param").find("param_shapes does not list"), std::string::npos);
}

TEST(Verify, RootChecksLatestAndSkipsTemporaries) {
  TempDir tmp;
  const std::string root = tmp / "ckpt";
  fs::create_directories(root);
  CopyTree(DsFixture("z2_ws2_fp32") + "/ckpt/global_step5", root + "/global_step5");
  CopyTree(DsFixture("z2_ws2_fp32") + "/ckpt/global_step5", root + "/.global_step6.uckpt-tmp");
  std::ofstream(root + "/latest") << "global_step6";
  VerifyReport r = VerifyCheckpoint(root);
  ASSERT_EQ(r.folders.size(), 1u);
  EXPECT_EQ(r.problem_count(), 1u) << Describe(r);
  EXPECT_NE(ProblemOf(r, root + "/latest").find("names 'global_step6', which is not a checkpoint folder"),
            std::string::npos)
      << Describe(r);
  ASSERT_EQ(r.notes.size(), 1u);
  EXPECT_NE(r.notes[0].find(".global_step6.uckpt-tmp: skipped"), std::string::npos);
  std::ofstream(root + "/latest") << "global_step5\n";
  EXPECT_TRUE(VerifyCheckpoint(root).ok());
  EXPECT_THROW(VerifyCheckpoint(tmp.path()), FormatError);  // nothing checkpoint-like directly inside
}

}  // namespace
}  // namespace uckpt::ckpt
