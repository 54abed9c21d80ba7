// Checkpoint manifests: what WriteManifest lists, and every way CheckManifest
// and CheckFolderAgainstManifest notice a folder that no longer matches.
#include "ckpt/manifest.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "format/error.h"
#include "test_util.h"

namespace uckpt::ckpt {
namespace {

namespace fs = std::filesystem;
using testing::TempDir;

void WriteBytes(const std::string& path, const std::string& bytes) {
  fs::create_directories(fs::path(path).parent_path());
  std::ofstream(path, std::ios::binary) << bytes;
}

// A folder shaped like a universal checkpoint, with a file larger than one
// hashing chunk (16 MiB) so the chunked path is exercised.
void MakeFolder(const std::string& dir) {
  WriteBytes(dir + "/mp_rank_00_model_states.pt", "model states");
  WriteBytes(dir + "/zero/optimizer_state.pt", "optimizer");
  WriteBytes(dir + "/zero/h.0.attn.weight/fp32.pt", std::string(20 << 20, '\x5a') + "tail");
  WriteBytes(dir + "/zero/h.0.attn.weight/exp_avg.pt", "");
}

std::string FindProblem(const ManifestCheck& c, const std::string& file) {
  for (const auto& p : c.problems)
    if (p.file == file) return p.what;
  return "";
}

TEST(Manifest, HashMatchesReferenceVectors) {
  TempDir tmp;
  // Reference values from xxhsum -H1 (Debian package xxhash).
  WriteBytes(tmp / "empty", "");
  WriteBytes(tmp / "a", "a");
  EXPECT_EQ(HashToHex(HashFile(tmp / "empty")), "ef46db3751d8e999");
  EXPECT_EQ(HashToHex(HashFile(tmp / "a")), "d24ec4f1a98c6e5b");
  uint64_t h = 0;
  EXPECT_TRUE(HexToHash("d24ec4f1a98c6e5b", &h));
  EXPECT_EQ(h, 0xd24ec4f1a98c6e5bULL);
  EXPECT_FALSE(HexToHash("D24EC4F1A98C6E5B", &h));
  EXPECT_FALSE(HexToHash("d24ec4f1a98c6e5", &h));
}

TEST(Manifest, ListsEveryFileRecursivelyAndChecksClean) {
  TempDir tmp;
  const std::string dir = tmp / "u";
  MakeFolder(dir);
  EXPECT_FALSE(HasManifest(dir));
  Manifest written = WriteManifest(dir, /*durable=*/false);
  ASSERT_TRUE(HasManifest(dir));
  ASSERT_EQ(written.files.size(), 4u);
  EXPECT_EQ(written.files[0].path, "mp_rank_00_model_states.pt");
  EXPECT_EQ(written.files[1].path, "zero/h.0.attn.weight/exp_avg.pt");
  EXPECT_EQ(written.files[2].path, "zero/h.0.attn.weight/fp32.pt");
  EXPECT_EQ(written.files[2].size, (20u << 20) + 4);
  EXPECT_EQ(written.files[2].xxh64, HashFile(dir + "/zero/h.0.attn.weight/fp32.pt"));
  Manifest read = ReadManifest(dir);
  ASSERT_EQ(read.files.size(), written.files.size());
  for (size_t i = 0; i < read.files.size(); ++i) {
    EXPECT_EQ(read.files[i].path, written.files[i].path);
    EXPECT_EQ(read.files[i].size, written.files[i].size);
    EXPECT_EQ(read.files[i].xxh64, written.files[i].xxh64);
  }
  // No temporary left beside it.
  EXPECT_EQ(testing::CountEntriesStartingWith(dir, std::string(kManifestName) + ".tmp"), 0);

  ManifestCheck c = CheckManifest(dir, {.hashes = true});
  EXPECT_TRUE(c.present);
  EXPECT_TRUE(c.hashed);
  EXPECT_TRUE(c.ok()) << c.problems.front().file << ": " << c.problems.front().what;
  EXPECT_EQ(c.files, 4u);
  EXPECT_NO_THROW(CheckFolderAgainstManifest(dir, true));
}

TEST(Manifest, FlippedByteFoundOnlyByHash) {
  TempDir tmp;
  const std::string dir = tmp / "u";
  MakeFolder(dir);
  WriteManifest(dir, false);
  const std::string victim = dir + "/zero/h.0.attn.weight/fp32.pt";
  {
    std::fstream f(victim, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(18 << 20);
    f.put('\x5b');
  }
  EXPECT_TRUE(CheckManifest(dir, {.hashes = false}).ok());
  EXPECT_NO_THROW(CheckFolderAgainstManifest(dir, false));
  ManifestCheck c = CheckManifest(dir, {.hashes = true});
  ASSERT_EQ(c.problems.size(), 1u);
  EXPECT_EQ(c.problems[0].file, victim);
  EXPECT_NE(c.problems[0].what.find("content differs"), std::string::npos) << c.problems[0].what;
  try {
    CheckFolderAgainstManifest(dir, true);
    FAIL() << "a flipped byte passed --verify";
  } catch (const FormatError& e) {
    EXPECT_NE(std::string(e.what()).find(victim), std::string::npos) << e.what();
  }
}

// Ranks split --verify's hashing: every file is hashed by exactly one of the
// shards, so a flipped file is caught by one shard; sizes stay every shard's.
TEST(Manifest, ShardsSplitTheHashing) {
  TempDir tmp;
  const std::string dir = tmp / "u";
  MakeFolder(dir);
  WriteBytes(dir + "/zero/b/fp32.pt", "bbbb");
  WriteBytes(dir + "/zero/c/fp32.pt", "cc");
  WriteManifest(dir, false);
  for (const char* rel :
       {"mp_rank_00_model_states.pt", "zero/optimizer_state.pt", "zero/b/fp32.pt", "zero/h.0.attn.weight/fp32.pt"}) {
    const std::string victim = dir + "/" + rel;
    std::string bytes;
    {
      std::ifstream in(victim, std::ios::binary);
      bytes.assign(std::istreambuf_iterator<char>(in), {});
    }
    std::string flipped = bytes;
    flipped[0] ^= 1;
    WriteBytes(victim, flipped);
    for (int shards : {1, 2, 3, 7}) {
      int caught = 0;
      for (int shard = 0; shard < shards; ++shard) {
        ManifestCheckOptions o{.hashes = true, .shard = shard, .shards = shards};
        ManifestCheck c = CheckManifest(dir, o);
        caught += static_cast<int>(c.problems.size());
        if (!c.problems.empty()) {
          EXPECT_EQ(c.problems[0].file, victim);
        }
      }
      EXPECT_EQ(caught, 1) << rel << " with " << shards << " shards";
    }
    WriteBytes(victim, bytes);
  }
  // A truncated file is every shard's problem (sizes are always compared).
  WriteBytes(dir + "/zero/c/fp32.pt", "c");
  for (int shard = 0; shard < 3; ++shard)
    EXPECT_THROW(CheckFolderAgainstManifest(dir, true, shard, 3), FormatError) << shard;
  EXPECT_THROW(CheckFolderAgainstManifest(dir, true, 3, 3), std::invalid_argument);
}

TEST(Manifest, TruncatedMissingAndExtraFiles) {
  TempDir tmp;
  const std::string dir = tmp / "u";
  MakeFolder(dir);
  WriteManifest(dir, false);
  fs::resize_file(dir + "/zero/optimizer_state.pt", 3);
  fs::remove(dir + "/mp_rank_00_model_states.pt");
  WriteBytes(dir + "/zero/h.0.attn.weight/exp_avg_sq.pt", "new");
  ManifestCheck c = CheckManifest(dir, {.hashes = false});
  ASSERT_EQ(c.problems.size(), 3u);
  EXPECT_EQ(FindProblem(c, dir + "/mp_rank_00_model_states.pt"), "missing");
  EXPECT_EQ(FindProblem(c, dir + "/zero/optimizer_state.pt"), "size 3 bytes, the manifest says 9 (truncated)");
  EXPECT_EQ(FindProblem(c, dir + "/zero/h.0.attn.weight/exp_avg_sq.pt"), "is not listed in the manifest");
  try {
    CheckFolderAgainstManifest(dir, false);
    FAIL() << "a truncated file passed the size check";
  } catch (const FormatError& e) {
    EXPECT_NE(std::string(e.what()).find("optimizer_state.pt: size 3 bytes"), std::string::npos) << e.what();
  }
}

TEST(Manifest, NoManifestIsNotAProblem) {
  TempDir tmp;
  MakeFolder(tmp / "u");
  ManifestCheck c = CheckManifest(tmp / "u", {.hashes = true});
  EXPECT_FALSE(c.present);
  EXPECT_TRUE(c.ok());
  EXPECT_NO_THROW(CheckFolderAgainstManifest(tmp / "u", true));
}

// A folder published before it was durable (the engine's synchronous save)
// has a marker beside it until it is: every reader then compares hashes,
// even when asked for sizes only, and a folder without a manifest is refused.
TEST(Manifest, UnsyncedMarkerMeansHashesAndAManifest) {
  TempDir tmp;
  EXPECT_EQ(UnsyncedMarkerPath("ckpt/global_step8"), "ckpt/.global_step8.uckpt-unsynced");
  EXPECT_EQ(UnsyncedMarkerPath("ckpt/global_step8/"), "ckpt/.global_step8.uckpt-unsynced");
  EXPECT_EQ(UnsyncedMarkerPath("ckpt/./global_step8/."), "ckpt/.global_step8.uckpt-unsynced");
  EXPECT_EQ(
      UnsyncedMarkerPath("."),
      (fs::current_path().parent_path() / ("." + fs::current_path().filename().string() + ".uckpt-unsynced")).string());
  const std::string dir = tmp / "global_step8";
  MakeFolder(dir);
  WriteManifest(dir, false);
  EXPECT_FALSE(ReadUnsyncedMarker(dir));
  const std::string victim = dir + "/zero/h.0.attn.weight/fp32.pt";
  {
    std::fstream f(victim, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(18 << 20);
    f.put('\x5b');
  }
  EXPECT_NO_THROW(CheckFolderAgainstManifest(dir, false));  // sizes only: the flip is not seen
  WriteBytes(UnsyncedMarkerPath(dir), "global_step6");
  ASSERT_EQ(ReadUnsyncedMarker(dir).value_or("none"), "global_step6");
  try {
    CheckFolderAgainstManifest(dir, false);
    FAIL() << "a changed file of an unsynced folder passed";
  } catch (const FormatError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find(dir + " was published before its files were on disk"), std::string::npos) << what;
    EXPECT_NE(what.find("'global_step6' (load that tag)"), std::string::npos) << what;
    EXPECT_NE(what.find(victim + ": content differs"), std::string::npos) << what;
  }
  const std::string bare = tmp / "global_step9";
  MakeFolder(bare);
  EXPECT_NO_THROW(CheckFolderAgainstManifest(bare, false));  // DeepSpeed's own folders have none
  WriteBytes(UnsyncedMarkerPath(bare), "");
  try {
    CheckFolderAgainstManifest(bare, false);
    FAIL() << "an unsynced folder without a manifest passed";
  } catch (const FormatError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find(bare + "/" + kManifestName + ": is missing"), std::string::npos) << what;
    EXPECT_NE(what.find("No checkpoint was published before it"), std::string::npos) << what;
  }
}

TEST(Manifest, DamagedOrHostileManifestIsRejected) {
  TempDir tmp;
  const std::string dir = tmp / "u";
  MakeFolder(dir);
  const std::string m = dir + "/" + kManifestName;
  const std::string head = R"({"format":"uckpt-manifest","version":1,"hash":"xxh64","files":[)";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"{\"format\":", "not valid JSON"},
      {R"({"format":"other","version":1,"hash":"xxh64","files":[]})", "is not a uckpt manifest"},
      {R"({"format":"uckpt-manifest","version":2,"hash":"xxh64","files":[]})", "has version 2"},
      {head + R"({"path":"../escape","size":1,"xxh64":"0000000000000000"}]})", "not a relative path"},
      {head + R"({"path":"/etc/passwd","size":1,"xxh64":"0000000000000000"}]})", "not a relative path"},
      {head + R"({"path":"a","size":1,"xxh64":"00"}]})", "not 16 lower-case hex digits"},
      {head + R"({"path":"a","size":-1,"xxh64":"0000000000000000"}]})", "unsigned \"size\""},
      {head + R"({"path":"a","size":1,"xxh64":"0000000000000000"},{"path":"a","size":1,"xxh64":"0000000000000000"}]})",
       "twice"},
  };
  for (const auto& [text, expected] : cases) {
    SCOPED_TRACE(text);
    WriteBytes(m, text);
    EXPECT_THROW(ReadManifest(dir), FormatError);
    ManifestCheck c = CheckManifest(dir, {});
    ASSERT_EQ(c.problems.size(), 1u);
    EXPECT_EQ(c.problems[0].file, m);
    EXPECT_NE(c.problems[0].what.find(expected), std::string::npos) << c.problems[0].what;
    EXPECT_THROW(CheckFolderAgainstManifest(dir, false), FormatError);
  }
}

}  // namespace
}  // namespace uckpt::ckpt
