// safetensors files (format/safetensors.h): written by the streaming writer
// and read back, element ranges of one tensor, the sharded index, and
// hand-made broken headers, each refused with the file and tensor named.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>

#include "format/error.h"
#include "format/fault_env.h"
#include "format/safetensors.h"

namespace uckpt {
namespace {

namespace fs = std::filesystem;

class SafetensorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("uckpt_safetensors_" + std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()) + "_" +
            std::to_string(getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string Path(const std::string& name) const { return (dir_ / name).string(); }

  // A file of `header` (JSON text) and `data` bytes, as a hostile writer would make it.
  std::string Raw(const std::string& name, const std::string& header, size_t data, uint64_t len_override = 0) {
    std::string bytes(8, '\0');
    const uint64_t n = len_override ? len_override : header.size();
    for (int i = 0; i < 8; ++i) bytes[static_cast<size_t>(i)] = static_cast<char>(n >> (8 * i));
    bytes += header + std::string(data, '\x01');
    std::ofstream(Path(name), std::ios::binary) << bytes;
    return Path(name);
  }

  // The error Open throws for `path` (fails the test if it does not throw FormatError).
  static std::string OpenError(const std::string& path) {
    try {
      SafetensorsFile::Open(path);
    } catch (const FormatError& e) {
      return e.what();
    }
    ADD_FAILURE() << path << " was accepted";
    return "";
  }

  fs::path dir_;
};

std::span<const uint8_t> Bytes(const std::vector<float>& v) {
  return {reinterpret_cast<const uint8_t*>(v.data()), v.size() * sizeof(float)};
}

TEST_F(SafetensorsTest, WrittenFileReadsBackWithElementRanges) {
  const std::vector<float> a = {1, 2, 3, 4, 5, 6};
  const std::vector<uint16_t> b = {0x3f80, 0x4000, 0x4040};  // bf16 1, 2, 3
  {
    SafetensorsWriter w(
        Path("m.safetensors"),
        {{"a.weight", DType::kFloat32, {2, 3}}, {"b", DType::kBFloat16, {3}}, {"empty", DType::kFloat16, {0, 4}}},
        {{"format", "pt"}});
    w.Write(Bytes(a).subspan(0, 10));  // any pieces
    w.Write(Bytes(a).subspan(10));
    w.Write({reinterpret_cast<const uint8_t*>(b.data()), 6});
    EXPECT_FALSE(fs::exists(Path("m.safetensors")));  // only once committed
    w.Commit();
  }
  SafetensorsFile f = SafetensorsFile::Open(Path("m.safetensors"));
  ASSERT_EQ(f.tensors().size(), 3u);
  EXPECT_EQ(f.metadata().at("format"), "pt");
  const SafetensorsTensor* t = f.Find("a.weight");
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(t->begin % 8, 0u);  // the header is padded
  auto mid = f.Elements(*t, 2, 3);
  ASSERT_EQ(mid.size(), 12u);
  float got[3];
  std::memcpy(got, mid.data(), 12);
  EXPECT_EQ(got[0], 3.0f);
  EXPECT_EQ(got[2], 5.0f);
  const SafetensorsTensor* bt = f.Find("b");
  EXPECT_EQ(bt->dtype, DType::kBFloat16);
  EXPECT_EQ(std::memcmp(f.Elements(*bt, 0, 3).data(), b.data(), 6), 0);
  EXPECT_EQ(f.Find("empty")->numel, 0);
  EXPECT_THROW(f.Elements(*t, 4, 3), std::out_of_range);
  EXPECT_EQ(f.Find("missing"), nullptr);
}

TEST_F(SafetensorsTest, WriterRefusesBadEntriesAndShortData) {
  EXPECT_THROW(SafetensorsWriter(Path("x"), {{"a", DType::kFloat32, {1}}, {"a", DType::kFloat32, {1}}}), FormatError);
  EXPECT_THROW(SafetensorsWriter(Path("x"), {{"__metadata__", DType::kFloat32, {1}}}), FormatError);
  EXPECT_THROW(SafetensorsWriter(Path("x"), {{"a", DType::kFloat32, {-1}}}), FormatError);
  EXPECT_THROW(SafetensorsWriter(Path("x"), {{"a", DType::kComplex128, {1}}}), FormatError);
  {
    SafetensorsWriter w(Path("short.safetensors"), {{"a", DType::kFloat32, {2}}});
    const std::vector<float> one = {1};
    w.Write(Bytes(one));
    EXPECT_THROW(w.Commit(), std::logic_error);
    EXPECT_THROW(w.Write(Bytes({1, 2})), std::logic_error);  // past the announced size
  }
  EXPECT_FALSE(fs::exists(Path("short.safetensors")));
  for (const auto& e : fs::directory_iterator(dir_)) ADD_FAILURE() << "left behind: " << e.path();
}

TEST_F(SafetensorsTest, WriteFailureLeavesNoFile) {
  FaultEnv faults;
  faults.Add({IoOp::kRename, "w.safetensors"});
  ScopedEnv scoped(faults);
  SafetensorsWriter w(Path("w.safetensors"), {{"a", DType::kFloat32, {1}}});
  const std::vector<float> one = {1};
  w.Write(Bytes(one));
  EXPECT_THROW(w.Commit(), IoError);
  EXPECT_FALSE(fs::exists(Path("w.safetensors")));
}

TEST_F(SafetensorsTest, BrokenHeadersNameTheFileAndTensor) {
  struct Case {
    const char* what;
    std::string header;
    size_t data;
    const char* expect;
  } cases[] = {
      {"dtype", R"({"w":{"dtype":"F31","shape":[1],"data_offsets":[0,4]}})", 4, "tensor 'w' has dtype 'F31'"},
      {"size", R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}})", 4, "tensor 'w' spans 4 bytes"},
      {"order", R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[4,0]}})", 4, "end before they begin"},
      {"overlap",
       R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
       8, "overlaps"},
      {"gap", R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", 8,
       "a gap of 4 bytes lies before tensor 'a'"},
      {"past", R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", 8, "tensor 'a' runs past the file's end"},
      {"trailing", R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", 8, "4 bytes follow the last tensor"},
      {"negative", R"({"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,0]}})", 0, "negative dimension"},
      {"shape", R"({"a":{"dtype":"F32","shape":"x","data_offsets":[0,4]}})", 4, "\"shape\" is not a list"},
      {"offsets", R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0]}})", 4, "\"data_offsets\" is not a pair"},
      {"field", R"({"a":{"dtype":"F32","shape":[1]}})", 4, "tensor 'a' has no \"data_offsets\""},
      {"twice",
       R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})",
       4, "names 'a' twice"},
      {"meta", R"({"__metadata__":{"k":1}})", 0, "\"__metadata__\" value of 'k' is not a string"},
      {"json", R"({"a":)", 0, "not JSON"},
      {"array", R"([1])", 0, "not a JSON object"},
  };
  for (const Case& c : cases) {
    const std::string path = Raw(std::string(c.what) + ".safetensors", c.header, c.data);
    const std::string err = OpenError(path);
    EXPECT_NE(err.find(path), std::string::npos) << c.what << ": " << err;
    EXPECT_NE(err.find(c.expect), std::string::npos) << c.what << ": " << err;
  }
  EXPECT_NE(OpenError(Raw("len.safetensors", "{}", 0, 1000)).find("runs past the file's end"), std::string::npos);
  EXPECT_NE(OpenError(Raw("huge.safetensors", "{}", 0, uint64_t{1} << 40)).find("over safetensors' limit"),
            std::string::npos);
  std::ofstream(Path("tiny.safetensors")) << "abc";
  EXPECT_NE(OpenError(Path("tiny.safetensors")).find("8-byte header length"), std::string::npos);
  EXPECT_THROW(SafetensorsFile::Open(Path("absent.safetensors")), IoError);
}

TEST_F(SafetensorsTest, IndexNamesEachTensorsFile) {
  const std::vector<float> one = {1}, two = {2, 3};
  for (auto [name, tensor, values] :
       {std::tuple{"s1.safetensors", "x", &one}, std::tuple{"s2.safetensors", "y", &two}}) {
    SafetensorsWriter w(Path(name), {{tensor, DType::kFloat32, {static_cast<int64_t>(values->size())}}});
    w.Write(Bytes(*values));
    w.Commit();
  }
  std::ofstream(Path("model.safetensors.index.json"))
      << R"({"metadata":{"total_size":12},"weight_map":{"x":"s1.safetensors","y":"s2.safetensors"}})";
  for (const std::string& p : {Path("model.safetensors.index.json"), dir_.string()}) {
    SafetensorsSource s = SafetensorsSource::Open(p);
    EXPECT_EQ(s.names(), (std::vector<std::string>{"x", "y"}));
    auto y = s.Find("y");
    ASSERT_NE(y.tensor, nullptr);
    EXPECT_EQ(y.file->path(), Path("s2.safetensors"));
    EXPECT_EQ(y.tensor->numel, 2);
    EXPECT_EQ(s.Find("z").tensor, nullptr);
  }
  std::ofstream(Path("bad.index.json")) << R"({"weight_map":{"x":"s2.safetensors"}})";
  try {
    SafetensorsSource::Open(Path("bad.index.json"));
    ADD_FAILURE() << "accepted";
  } catch (const FormatError& e) {
    EXPECT_NE(std::string(e.what()).find("lists tensor 'x' in " + Path("s2.safetensors")), std::string::npos)
        << e.what();
  }
  std::ofstream(Path("escape.index.json")) << R"({"weight_map":{"x":"../s1.safetensors"}})";
  EXPECT_THROW(ReadSafetensorsIndex(Path("escape.index.json")), FormatError);
  std::ofstream(Path("noweights.index.json")) << R"({"metadata":{}})";
  EXPECT_THROW(ReadSafetensorsIndex(Path("noweights.index.json")), FormatError);
  EXPECT_THROW(SafetensorsSource::Open(Path("nothing_here")), IoError);
}

}  // namespace
}  // namespace uckpt
