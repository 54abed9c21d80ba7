// The reader against the golden torch.save fixtures: every file's value tree,
// zip records and storage sharing must match what its manifest says.
#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <set>

#include "format/error.h"
#include "format/torch_file.h"
#include "format/value_json.h"
#include "format/zip.h"
#include "test_support.h"

namespace uckpt::test {
namespace {

TEST(Fixtures, PresentAndEveryFileListed) {
  for (const auto& version : FixtureVersions()) {
    SCOPED_TRACE(version);
    const std::string dir = FixtureDir(version);
    ASSERT_TRUE(std::filesystem::is_directory(dir)) << dir << " is missing (UCKPT_SHARED=" << SharedDir() << ")";
    const json& m = Manifest(version);
    EXPECT_EQ(m["schema"], "uckpt-torch-fixtures/1");
    std::set<std::string> listed;
    for (const auto& f : m["files"]) {
      const std::string file = f["file"];
      EXPECT_TRUE(listed.insert(file).second) << file << " listed twice";
      EXPECT_TRUE(FileExists(dir + "/" + file)) << file << " is listed but missing";
    }
    size_t on_disk = 0;
    for (const auto& e : std::filesystem::directory_iterator(dir)) {
      const std::string file = e.path().filename().string();
      if (file == "manifest.json") continue;
      ++on_disk;
      EXPECT_TRUE(listed.count(file)) << file << " is in " << dir << " but not in its manifest";
    }
    EXPECT_EQ(on_disk, listed.size());
    EXPECT_GE(listed.size(), 38u);
  }
}

class ManifestTest : public ::testing::TestWithParam<Fixture> {};

// Tensors that share a storage key share one Storage object, and tensors with
// different keys do not.
void ExpectSharingByKey(const Value& root) {
  std::map<std::string, const Storage*> by_key;
  std::map<const Storage*, std::string> by_storage;
  for (const Tensor* t : Tensors(root)) {
    ASSERT_TRUE(t->storage);
    auto [k, fresh_k] = by_key.emplace(t->storage->key, t->storage.get());
    EXPECT_EQ(k->second, t->storage.get()) << "storage key '" << t->storage->key << "' maps to two Storage objects";
    auto [s, fresh_s] = by_storage.emplace(t->storage.get(), t->storage->key);
    EXPECT_EQ(s->second, t->storage->key);
  }
}

TEST_P(ManifestTest, LoadMatchesManifest) {
  const Fixture& fx = GetParam();
  const json& entry = fx.entry();
  const auto bytes = ReadFile(fx.path);
  ASSERT_EQ(bytes.size(), entry["size_bytes"].get<size_t>());
  ASSERT_EQ(Sha256Hex(bytes), entry["sha256"]) << "fixture file changed on disk";

  if (fx.legacy) {
    try {
      LoadTorchFile(fx.path);
      FAIL() << "a legacy (pre-1.6) file was accepted";
    } catch (const FormatError& e) {
      EXPECT_NE(std::string(e.what()).find("legacy"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(fx.path), std::string::npos)
          << "message does not name the file: " << e.what();
    }
    return;
  }

  // Lenient: the malicious fixtures load as inert objects (strict_test.cc refuses them).
  TorchFile f = LoadTorchFile(fx.path, {.policy = PicklePolicy::kLenient});
  EXPECT_EQ(f.archive, entry["archive_prefix"]);
  const json got = ValueToJson(*f.root);
  const json& want = fx.malicious ? entry["opaque_view"] : entry["expected"];
  ASSERT_FALSE(want.is_null()) << "manifest entry has no expected value";
  auto diffs = JsonDiff(want, got);
  EXPECT_TRUE(diffs.empty()) << fx.path << " differs from its manifest:\n" << DiffText(diffs);

  // The zip records, in central-directory order.
  ZipReader zip(f.file);
  const json& records = entry["zip_records"];
  ASSERT_EQ(zip.entries().size(), records.size());
  for (size_t k = 0; k < records.size(); ++k) {
    const ZipEntry& e = zip.entries()[k];
    SCOPED_TRACE(e.name);
    EXPECT_EQ(e.name, records[k]["name"]);
    EXPECT_EQ(e.data_offset, records[k]["data_offset"].get<uint64_t>());
    EXPECT_EQ(e.size, records[k]["size"].get<uint64_t>());
    EXPECT_EQ(e.crc32, records[k]["crc32"].get<uint32_t>());
    EXPECT_TRUE(zip.CrcMatches(e));
  }
  // Every storage the manifest lists is backed by its record's bytes.
  std::map<std::string, const Storage*> storages;
  for (const Tensor* t : Tensors(*f.root)) storages[t->storage->key] = t->storage.get();
  const json storages_listed = entry.value("storages", json::object());
  for (auto it = storages_listed.begin(); it != storages_listed.end(); ++it) {
    if (!storages.count(it.key())) continue;  // only reachable through a bare storage
    const Storage* s = storages[it.key()];
    EXPECT_EQ(Sha256Hex(s->bytes), it.value()["sha256"]) << "storage " << it.key();
    EXPECT_EQ(s->storage_class, it.value()["storage_class"]);
    EXPECT_EQ(s->numel, it.value()["numel"].get<int64_t>());
  }
  ExpectSharingByKey(*f.root);

  if (fx.malicious) {
    // The dangerous callables are inert object nodes.
    auto classes = ObjectClasses(*f.root);
    for (const auto& c : entry["dangerous_callables"]) {
      std::string want_cls = c;
      if (want_cls.rfind("__builtin__.", 0) == 0) want_cls = "builtins." + want_cls.substr(12);
      EXPECT_NE(std::find(classes.begin(), classes.end(), want_cls), classes.end()) << want_cls;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, ManifestTest, ::testing::ValuesIn(AllFixtures()),
                         [](const auto& info) { return TestName(info.param); });

class ZipFixtureTest : public ::testing::TestWithParam<Fixture> {};

// With CRC checking on: every fixture's CRCs are right (or 0).
TEST_P(ZipFixtureTest, CrcVerificationAccepts) {
  const Fixture& fx = GetParam();
  LoadOptions o;
  o.verify_crc = true;
  o.policy = PicklePolicy::kLenient;
  EXPECT_NO_THROW(LoadTorchFile(fx.path, o));
}

INSTANTIATE_TEST_SUITE_P(Fixtures, ZipFixtureTest, ::testing::ValuesIn(ZipFixtures()),
                         [](const auto& info) { return TestName(info.param); });

}  // namespace
}  // namespace uckpt::test
