// The writer: every fixture read, written with SaveTorchFile and read again
// must give the manifest's value tree again, in torch's record layout.
#include <gtest/gtest.h>
#include <sys/mman.h>

#include <memory>

#include "format/error.h"
#include "format/torch_file.h"
#include "format/value_json.h"
#include "format/zip.h"
#include "test_support.h"

namespace uckpt::test {
namespace {

std::string RecordText(const ZipReader& zip, const std::string& name) {
  const ZipEntry* e = zip.Find(name);
  if (!e) return "<missing>";
  auto d = zip.Data(*e);
  return std::string(reinterpret_cast<const char*>(d.data()), d.size());
}

// The records SaveTorchFile must write, in order, for `storages` storages.
std::vector<std::string> ExpectedRecords(const std::string& archive, size_t storages) {
  std::vector<std::string> names = {"data.pkl", ".format_version", ".storage_alignment", "byteorder"};
  for (size_t k = 0; k < storages; ++k) names.push_back("data/" + std::to_string(k));
  names.push_back("version");
  names.push_back(".data/serialization_id");
  for (auto& n : names) n = archive + "/" + n;
  return names;
}

size_t DistinctStorages(const Value& root) {
  std::set<const Storage*> seen;
  for (const Tensor* t : Tensors(root)) seen.insert(t->storage.get());
  return seen.size();
}

void ExpectTorchLayout(const std::string& path, const std::string& archive, size_t storages, uint32_t alignment) {
  ZipReader zip(MappedFile::Open(path));
  std::vector<std::string> names;
  for (const auto& e : zip.entries()) {
    names.push_back(e.name);
    EXPECT_EQ(e.data_offset % alignment, 0u) << e.name << " starts at " << e.data_offset;
    EXPECT_TRUE(zip.CrcMatches(e)) << e.name;
    if (e.size > 0) {
      EXPECT_NE(e.crc32, 0u) << e.name << ": the writer must compute CRCs";
    }
  }
  EXPECT_EQ(names, ExpectedRecords(archive, storages));
  EXPECT_EQ(RecordText(zip, archive + "/.format_version"), "1");
  EXPECT_EQ(RecordText(zip, archive + "/.storage_alignment"), std::to_string(alignment));
  EXPECT_EQ(RecordText(zip, archive + "/byteorder"), "little");
  EXPECT_EQ(RecordText(zip, archive + "/version"), "3\n");
  std::string id = RecordText(zip, archive + "/.data/serialization_id");
  EXPECT_EQ(id.size(), 40u);
  EXPECT_EQ(id.find_first_not_of("0123456789"), std::string::npos) << id;
}

// True when the manifest's storage keys are "0".."N-1" in first-reference
// order: then the writer must keep them exactly.
bool KeysAreCanonical(const json& entry) {
  size_t k = 0;
  const json storages = entry.value("storages", json::object());
  for (auto it = storages.begin(); it != storages.end(); ++it, ++k)
    if (it.key() != std::to_string(k)) return false;
  return true;
}

class RoundTripTest : public ::testing::TestWithParam<Fixture> {};

TEST_P(RoundTripTest, ReadWriteReadMatchesManifest) {
  const Fixture& fx = GetParam();
  const json& entry = fx.entry();
  const json& want = fx.malicious ? entry["opaque_view"] : entry["expected"];
  TempDir dir;
  TorchFile original = LoadTorchFile(fx.path, {.policy = PicklePolicy::kLenient});
  const std::string out = dir.File(fx.name + ".pt");
  SaveOptions so;
  so.durable = false;
  SaveTorchFile(out, original.root, so);

  TorchFile again = LoadTorchFile(out, {.policy = PicklePolicy::kLenient});
  EXPECT_EQ(again.archive, fx.name);
  CompareOptions co;
  co.map_storage_keys = !KeysAreCanonical(entry);
  auto diffs = JsonDiff(want, ValueToJson(*again.root), co);
  EXPECT_TRUE(diffs.empty()) << "round trip of " << fx.path << " differs from its manifest:\n" << DiffText(diffs);

  // Whole storages survive byte for byte (JSON only hashes the views), and
  // the sharing pattern is the same.
  auto before = Tensors(*original.root), after = Tensors(*again.root);
  ASSERT_EQ(before.size(), after.size());
  std::map<const Storage*, const Storage*> map;
  for (size_t k = 0; k < before.size(); ++k) {
    EXPECT_EQ(Sha256Hex(before[k]->storage->bytes), Sha256Hex(after[k]->storage->bytes)) << "tensor " << k;
    auto [it, fresh] = map.emplace(before[k]->storage.get(), after[k]->storage.get());
    EXPECT_EQ(it->second, after[k]->storage.get()) << "tensor " << k << " lost its storage sharing";
  }
  const size_t storages = DistinctStorages(*original.root);
  EXPECT_EQ(DistinctStorages(*again.root), storages);
  ExpectTorchLayout(out, fx.name, storages, 64);

  // Writing what was read back gives the same bytes (the writer is deterministic).
  const std::string out2 = dir.File("second/" + fx.name + ".pt");
  std::filesystem::create_directories(dir.File("second"));
  SaveTorchFile(out2, again.root, so);
  EXPECT_EQ(ReadFile(out), ReadFile(out2)) << "second write differs from the first";
}

INSTANTIATE_TEST_SUITE_P(Fixtures, RoundTripTest, ::testing::ValuesIn(ZipFixtures()),
                         [](const auto& info) { return TestName(info.param); });

// The CRC-32 and size of everything written to it.
class CrcSink : public ByteSink {
 public:
  void Write(std::span<const uint8_t> data) override {
    crc = Crc32(data, crc);
    size += data.size();
  }
  uint64_t offset() const override { return size; }
  uint32_t crc = 0;
  uint64_t size = 0;
};

// What LayOutTorchFile's pieces hold, in order; they must tile the file.
CrcSink LaidOut(const TorchFileLayout& layout) {
  CrcSink out;
  for (const FilePiece& p : layout.pieces) {
    EXPECT_EQ(p.offset, out.size) << "the pieces do not tile the file";
    out.Write(p.data);
  }
  EXPECT_EQ(out.size, layout.size);
  return out;
}

std::vector<uint32_t> SerialCrcs(const std::vector<std::span<const uint8_t>>& storages) {
  std::vector<uint32_t> out;
  for (auto s : storages) out.push_back(Crc32(s));
  return out;
}

ValuePtr ByteTensor(std::span<const uint8_t> bytes, std::shared_ptr<const void> owner) {
  Tensor t;
  t.dtype = DType::kUInt8;
  t.shape = {static_cast<int64_t>(bytes.size())};
  t.stride = {1};
  t.storage = Storage::View(bytes, DType::kUInt8, std::move(owner));
  return Value::FromTensor(std::move(t));
}

// A file laid out as pieces (for writing by several threads) holds the bytes
// SaveTorchFile writes: small and empty storages, and (zip64) a storage of
// more than 4 GiB followed by records whose offsets pass 4 GiB. The big
// storage is untouched anonymous memory (zero pages, nothing allocated).
TEST(RoundTrip, LayOutEqualsSaveTorchFile) {
  constexpr size_t big = (4ull << 30) + 4096;
  void* p = ::mmap(nullptr, big, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  ASSERT_NE(p, MAP_FAILED);
  std::shared_ptr<const void> zeros(p, [](const void* q) { ::munmap(const_cast<void*>(q), big); });
  std::vector<uint8_t> small(1000);
  for (size_t k = 0; k < small.size(); ++k) small[k] = static_cast<uint8_t>(k * 7);
  for (bool with_big : {false, true}) {
    SCOPED_TRACE(with_big ? "zip64" : "small");
    ValuePtr root = Value::Dict();
    root->set("a", ByteTensor(small, nullptr));
    root->set("empty", ByteTensor({}, nullptr));
    if (with_big) root->set("big", ByteTensor({static_cast<const uint8_t*>(p), big}, zeros));
    root->set("b", ByteTensor(std::span<const uint8_t>(small).first(3), nullptr));
    root->set("n", Value::Int(3));
    CrcSink saved;
    SaveTorchFile(saved, "/x/zero_pp_rank_0_mp_rank_00_optim_states.pt", root);
    const TorchFileLayout layout = LayOutTorchFile("/x/zero_pp_rank_0_mp_rank_00_optim_states.pt", root, SerialCrcs);
    const CrcSink laid = LaidOut(layout);
    EXPECT_EQ(laid.size, saved.size);
    EXPECT_EQ(laid.crc, saved.crc) << "the laid-out file's bytes differ from SaveTorchFile's";
    if (with_big) {
      EXPECT_GT(saved.size, big);
    }
  }
}

// CRCs of pieces joined with Crc32Combine equal the CRC of the whole.
TEST(RoundTrip, Crc32CombineJoinsPieces) {
  std::vector<uint8_t> b(100000);
  for (size_t k = 0; k < b.size(); ++k) b[k] = static_cast<uint8_t>(k * 31 + 5);
  const std::span<const uint8_t> all(b);
  for (size_t cut : {0u, 1u, 63u, 64u, 4097u, 99999u, 100000u})
    EXPECT_EQ(Crc32Combine(Crc32(all.first(cut)), Crc32(all.subspan(cut)), b.size() - cut), Crc32(all)) << cut;
}

TEST(RoundTrip, OtherAlignment) {
  auto all = ZipFixtures();
  auto it = std::find_if(all.begin(), all.end(), [](const Fixture& f) { return f.name == "large_multi_tensor"; });
  ASSERT_NE(it, all.end());
  TorchFile f = LoadTorchFile(it->path);
  TempDir dir;
  SaveOptions so;
  so.durable = false;
  so.alignment = 4096;
  SaveTorchFile(dir.File("large_multi_tensor.pt"), f.root, so);
  ExpectTorchLayout(dir.File("large_multi_tensor.pt"), "large_multi_tensor", DistinctStorages(*f.root), 4096);
  auto diffs = JsonDiff(it->entry()["expected"], ValueToJson(*LoadTorchFile(dir.File("large_multi_tensor.pt")).root));
  EXPECT_TRUE(diffs.empty()) << DiffText(diffs);
}

// The archive folder is the file name without its extension, like torch.save.
TEST(RoundTrip, ArchiveNameFollowsFileName) {
  TempDir dir;
  auto root = Value::Dict();
  root->set("x", Value::Int(1));
  SaveOptions so;
  so.durable = false;
  SaveTorchFile(dir.File("my.model.pt"), root, so);
  EXPECT_EQ(LoadTorchFile(dir.File("my.model.pt")).archive, "my.model");
  SaveTorchFile(dir.File("noext"), root, so);
  EXPECT_EQ(LoadTorchFile(dir.File("noext")).archive, "noext");
}

// One storage viewed with two dtypes cannot be written as torch storages.
TEST(RoundTrip, StorageWithTwoDtypesIsRefused) {
  Tensor a = Tensor::FromBytes(DType::kFloat32, {2}, std::vector<uint8_t>(8, 0));
  Tensor b = a;
  b.dtype = DType::kInt32;
  auto root = Value::List({Value::FromTensor(a), Value::FromTensor(b)});
  TempDir dir;
  SaveOptions so;
  so.durable = false;
  EXPECT_THROW(SaveTorchFile(dir.File("x.pt"), root, so), FormatError);
  EXPECT_FALSE(FileExists(dir.File("x.pt"))) << "a failed save must not leave the file behind";
}

// GLOBAL ends a name at a newline, so a class read from STACK_GLOBAL whose name
// holds one must be refused, not written as a file that cannot be read back.
TEST(RoundTrip, ClassNameWithNewlineIsRefused) {
  auto root = Value::List({Value::Global("mod", "na\nme")});
  TempDir dir;
  SaveOptions so;
  so.durable = false;
  EXPECT_THROW(SaveTorchFile(dir.File("x.pt"), root, so), FormatError);
  EXPECT_FALSE(FileExists(dir.File("x.pt")));
}

}  // namespace
}  // namespace uckpt::test
