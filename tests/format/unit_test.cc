// Unit tests of the format layer's pieces: float and int rendering, zip
// parsing errors, the zip64 reader path, and the pickle VM's limits.
#include <gtest/gtest.h>

#include <cmath>
#include <initializer_list>
#include <limits>
#include <string>
#include <vector>

#include "format/error.h"
#include "format/pickle_reader.h"
#include "format/torch_file.h"
#include "format/value_json.h"
#include "format/zip.h"
#include "test_support.h"

namespace uckpt::test {
namespace {

// ---- The test's own JSON comparison ------------------------------------------

TEST(JsonDiff, IsStrictWhereTheSchemaIsAndLooseWhereItIsNot) {
  auto f = [](double d) { return json(d); };
  EXPECT_TRUE(JsonDiff(f(0.0), f(0.0)).empty());
  EXPECT_FALSE(JsonDiff(f(0.0), f(-0.0)).empty()) << "-0.0 must differ from 0.0";
  EXPECT_TRUE(JsonDiff(f(std::nan("")), f(std::nan(""))).empty());
  EXPECT_FALSE(JsonDiff(json(1), f(1.0)).empty()) << "int vs float";
  EXPECT_TRUE(JsonDiff(json(uint64_t{5}), json(int64_t{5})).empty());
  EXPECT_FALSE(JsonDiff(json::parse(R"({"a":1})"), json::parse(R"({"a":1,"b":2})")).empty());
  // Sets compare as multisets; lists do not.
  json set1 = json::parse(R"({"type":"set","items":[{"type":"int","value":"1"},{"type":"int","value":"2"}]})");
  json set2 = json::parse(R"({"type":"set","items":[{"type":"int","value":"2"},{"type":"int","value":"1"}]})");
  EXPECT_TRUE(JsonDiff(set1, set2).empty());
  set1["type"] = set2["type"] = "list";
  EXPECT_FALSE(JsonDiff(set1, set2).empty());
  json set3 = json::parse(R"({"type":"frozenset","items":[{"type":"int","value":"1"},{"type":"int","value":"1"}]})");
  json set4 = json::parse(R"({"type":"frozenset","items":[{"type":"int","value":"1"},{"type":"int","value":"2"}]})");
  EXPECT_FALSE(JsonDiff(set3, set4).empty());
  // Storage keys: exact, or mapped one-to-one.
  json two = json::parse(R"([{"storage_key":"0"},{"storage_key":"1"},{"storage_key":"0"}])");
  json renamed = json::parse(R"([{"storage_key":"5"},{"storage_key":"7"},{"storage_key":"5"}])");
  json merged = json::parse(R"([{"storage_key":"5"},{"storage_key":"5"},{"storage_key":"5"}])");
  json split = json::parse(R"([{"storage_key":"5"},{"storage_key":"7"},{"storage_key":"8"}])");
  EXPECT_FALSE(JsonDiff(two, renamed).empty());
  EXPECT_TRUE(JsonDiff(two, renamed, {.map_storage_keys = true}).empty());
  EXPECT_FALSE(JsonDiff(two, merged, {.map_storage_keys = true}).empty());
  EXPECT_FALSE(JsonDiff(two, split, {.map_storage_keys = true}).empty());
}

// ---- PythonFloatRepr -------------------------------------------------------

TEST(PythonFloatRepr, MatchesPythonRepr) {
  const std::pair<double, const char*> cases[] = {
      {0.1, "0.1"},
      {1e-05, "1e-05"},
      {0.0001, "0.0001"},
      {1e16, "1e+16"},
      {1e15, "1000000000000000.0"},
      {5e-324, "5e-324"},
      {-0.0, "-0.0"},
      {0.0, "0.0"},
      {65536.0, "65536.0"},
      {1.5e300, "1.5e+300"},
      {std::numeric_limits<double>::quiet_NaN(), "nan"},
      {std::numeric_limits<double>::infinity(), "inf"},
      {-std::numeric_limits<double>::infinity(), "-inf"},
      {1.0 / 3.0, "0.3333333333333333"},
      {9223372036854775808.0, "9.223372036854776e+18"},
      {123456789012345678.0, "1.2345678901234568e+17"},
      {1e-4 * 0.99, "9.900000000000001e-05"},
      {9999999999999998.0, "9999999999999998.0"},
      {1e22, "1e+22"},
      {-1.5e-7, "-1.5e-07"},
      {2.2250738585072014e-308, "2.2250738585072014e-308"},
      {1.7976931348623157e308, "1.7976931348623157e+308"},
      {0.001, "0.001"},
      {12345.678, "12345.678"},
      {-2.5, "-2.5"},
  };
  for (const auto& [d, want] : cases) EXPECT_EQ(PythonFloatRepr(d), want) << "for " << want;
}

// ---- IntToDecimal ----------------------------------------------------------

// Decimal digits of 2^n, by repeated doubling of a digit string (an
// implementation independent of the one under test).
std::string PowerOfTwo(int n) {
  std::string digits = "1";  // least significant first
  for (int k = 0; k < n; ++k) {
    int carry = 0;
    for (char& c : digits) {
      int v = (c - '0') * 2 + carry;
      c = static_cast<char>('0' + v % 10);
      carry = v / 10;
    }
    if (carry) digits.push_back(static_cast<char>('0' + carry));
  }
  return std::string(digits.rbegin(), digits.rend());
}

// An int value from little-endian two's complement bytes, as LONG1 gives it.
ValuePtr BigInt(std::vector<uint8_t> le) {
  auto v = Value::Int(0);
  v->big = std::move(le);
  return v;
}

TEST(IntToDecimal, SmallAndBig) {
  EXPECT_EQ(IntToDecimal(*Value::Int(0)), "0");
  EXPECT_EQ(IntToDecimal(*Value::Int(-1)), "-1");
  EXPECT_EQ(IntToDecimal(*Value::Int(INT64_MIN)), "-9223372036854775808");
  EXPECT_EQ(IntToDecimal(*Value::Int(INT64_MAX)), "9223372036854775807");
  EXPECT_EQ(IntToDecimal(*Value::Bool(true)), "1");
  // 2^63 needs a ninth byte for the sign.
  EXPECT_EQ(IntToDecimal(*BigInt({0, 0, 0, 0, 0, 0, 0, 0x80, 0})), "9223372036854775808");
  EXPECT_EQ(IntToDecimal(*BigInt({0, 0, 0, 0, 0, 0, 0, 0, 1})), "18446744073709551616");
  EXPECT_EQ(IntToDecimal(*BigInt({0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0})), "18446744073709551615");
  EXPECT_EQ(IntToDecimal(*BigInt({0, 0, 0, 0, 0, 0, 0, 0, 0xff})), "-18446744073709551616");
  EXPECT_EQ(IntToDecimal(*BigInt({0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f, 0xff})), "-9223372036854775809");
  // Redundant sign-extension bytes do not change the value.
  EXPECT_EQ(IntToDecimal(*BigInt({5, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0})), "5");
  EXPECT_EQ(IntToDecimal(*BigInt({0xfb, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff})), "-5");
  // Chunk boundaries of the base-10^9 conversion: 10^18 and 10^27 have inner zero chunks.
  EXPECT_EQ(IntToDecimal(*BigInt({0x00, 0x00, 0x00, 0xe8, 0x3c, 0x80, 0xd0, 0x9f, 0x3c, 0x2e, 0x3b, 0x03})),
            "1000000000000000000000000000");
}

TEST(IntToDecimal, PowersOfTwo) {
  for (int n : {64, 65, 100, 127, 128, 255, 256, 1000, 2100}) {
    std::vector<uint8_t> le(static_cast<size_t>(n / 8 + 1), 0);
    le[static_cast<size_t>(n / 8)] = static_cast<uint8_t>(1u << (n % 8));
    le.push_back(0);  // sign byte
    EXPECT_EQ(IntToDecimal(*BigInt(le)), PowerOfTwo(n)) << "2^" << n;
    // -2^n: two's complement of the magnitude.
    for (auto& b : le) b = static_cast<uint8_t>(~b);
    for (auto& b : le)
      if (++b != 0) break;
    EXPECT_EQ(IntToDecimal(*BigInt(le)), "-" + PowerOfTwo(n)) << "-2^" << n;
  }
}

// Text LONG opcodes parse decimals of any size; IntToDecimal gives them back.
TEST(IntToDecimal, RoundTripsThroughPickleLongText) {
  for (const std::string& dec :
       {std::string("123456789012345678901234567890"), std::string("-1"),
        std::string("-98765432109876543210987654321098765432109876543210"), PowerOfTwo(2100), "-" + PowerOfTwo(640)}) {
    std::string p = "L" + dec + "L\n.";
    auto v = ReadPickle({reinterpret_cast<const uint8_t*>(p.data()), p.size()}, "long.pkl", {});
    ASSERT_EQ(v->kind, Kind::kInt);
    EXPECT_EQ(IntToDecimal(*v), dec);
  }
}

// ---- ZipReader errors ------------------------------------------------------

uint16_t Get16(const std::vector<uint8_t>& b, size_t at) { return static_cast<uint16_t>(b[at] | (b[at + 1] << 8)); }
uint32_t Get32(const std::vector<uint8_t>& b, size_t at) { return Get16(b, at) | (uint32_t{Get16(b, at + 2)} << 16); }
void Set16(std::vector<uint8_t>& b, size_t at, uint16_t v) {
  b[at] = static_cast<uint8_t>(v);
  b[at + 1] = static_cast<uint8_t>(v >> 8);
}
void Set32(std::vector<uint8_t>& b, size_t at, uint32_t v) {
  Set16(b, at, static_cast<uint16_t>(v));
  Set16(b, at + 2, static_cast<uint16_t>(v >> 16));
}

// A small valid torch file written by ZipWriter, and where its central
// directory records are.
struct SampleZip {
  std::vector<uint8_t> bytes;
  std::vector<size_t> central;  // offset of each central directory record
  std::vector<std::string> names;
  size_t cd_offset = 0;
};

SampleZip MakeSampleZip() {
  TempDir dir;
  std::string pkl = PickleBuilder().Proto(2).Tensor("FloatStorage", "0", 4, 0, {4}, {1}).Stop().bytes();
  std::vector<uint8_t> data(16, 0x3f);
  WriteTorchZip(dir.File("sample.pt"), "sample", pkl, {{"0", data}});
  SampleZip z;
  z.bytes = ReadFile(dir.File("sample.pt"));
  // ZipWriter always writes the zip64 end record; its cd offset is at +48.
  const size_t eocd = z.bytes.size() - 22;
  const size_t z64 = static_cast<size_t>(Get32(z.bytes, eocd - 20 + 8));
  z.cd_offset = static_cast<size_t>(Get32(z.bytes, z64 + 48));
  size_t pos = z.cd_offset;
  while (Get32(z.bytes, pos) == 0x02014b50) {
    z.central.push_back(pos);
    uint16_t n = Get16(z.bytes, pos + 28);
    z.names.emplace_back(reinterpret_cast<const char*>(&z.bytes[pos + 46]), n);
    pos += 46 + n + Get16(z.bytes, pos + 30) + Get16(z.bytes, pos + 32);
  }
  return z;
}

// Parses `bytes` as "broken.pt" and returns the FormatError message.
std::string ZipError(std::vector<uint8_t> bytes) {
  try {
    ZipReader zip(MappedFile::FromMemory(std::move(bytes), "broken.pt"));
  } catch (const FormatError& e) {
    return e.what();
  }
  return "<no error>";
}

// The zip is refused with a message naming the file and each of `parts`.
void ExpectZipError(std::vector<uint8_t> bytes, std::initializer_list<std::string> parts) {
  const std::string msg = ZipError(std::move(bytes));
  EXPECT_NE(msg.find("broken.pt"), std::string::npos) << msg;
  for (const std::string& part : parts) EXPECT_NE(msg.find(part), std::string::npos) << part << " in: " << msg;
}

TEST(ZipReader, SampleIsValid) {
  SampleZip z = MakeSampleZip();
  ASSERT_EQ(z.names, (std::vector<std::string>{"sample/data.pkl", "sample/data/0", "sample/version"}));
  ZipReader zip(MappedFile::FromMemory(z.bytes, "sample.pt"));
  ASSERT_EQ(zip.entries().size(), 3u);
  EXPECT_EQ(zip.Find("sample/data/0")->size, 16u);
  EXPECT_EQ(zip.Find("sample/nope"), nullptr);
}

TEST(ZipReader, DeflatedRecordIsRefused) {
  SampleZip z = MakeSampleZip();
  Set16(z.bytes, z.central[1] + 10, 8);
  ExpectZipError(z.bytes, {"sample/data/0", "compressed (method 8)"});
}

TEST(ZipReader, EncryptedRecordIsRefused) {
  SampleZip z = MakeSampleZip();
  Set16(z.bytes, z.central[0] + 8, Get16(z.bytes, z.central[0] + 8) | 1);
  ExpectZipError(z.bytes, {"sample/data.pkl", "encrypted"});
}

TEST(ZipReader, BadCentralSignature) {
  SampleZip z = MakeSampleZip();
  Set32(z.bytes, z.central[2], 0x12345678);
  ExpectZipError(z.bytes, {"central directory record 2", "bad signature"});
}

TEST(ZipReader, LocalHeaderOffsetOutOfRange) {
  SampleZip z = MakeSampleZip();
  Set32(z.bytes, z.central[1] + 42, static_cast<uint32_t>(z.bytes.size() + 100));
  ExpectZipError(z.bytes, {"sample/data/0", "outside the file"});
  // Just inside the file but not at a local header.
  z = MakeSampleZip();
  Set32(z.bytes, z.central[1] + 42, static_cast<uint32_t>(z.cd_offset - 40));
  ExpectZipError(z.bytes, {"sample/data/0", "bad local header signature"});
}

TEST(ZipReader, OverlappingRecords) {
  SampleZip z = MakeSampleZip();
  // Grow data.pkl so that its data runs into the local header of data/0.
  ZipReader ok(MappedFile::FromMemory(z.bytes, "ok.pt"));
  const uint64_t next_header = Get32(z.bytes, z.central[1] + 42);
  const uint64_t grown = next_header - ok.entries()[0].data_offset + 8;
  Set32(z.bytes, z.central[0] + 20, static_cast<uint32_t>(grown));
  Set32(z.bytes, z.central[0] + 24, static_cast<uint32_t>(grown));
  ExpectZipError(z.bytes, {"records 'sample/data.pkl' and 'sample/data/0' overlap"});
}

TEST(ZipReader, LocalNameDiffersFromCentral) {
  SampleZip z = MakeSampleZip();
  // Point the last record at the second one's local header.
  Set32(z.bytes, z.central[2] + 42, Get32(z.bytes, z.central[1] + 42));
  std::vector<uint8_t> b = z.bytes;
  ExpectZipError(b, {"record 'sample/version': local header name differs"});
}

TEST(ZipReader, TruncatedFile) {
  SampleZip z = MakeSampleZip();
  for (size_t keep :
       {z.bytes.size() - 1, z.bytes.size() - 22, z.cd_offset + 10, z.cd_offset, size_t{100}, size_t{21}}) {
    std::vector<uint8_t> b(z.bytes.begin(), z.bytes.begin() + static_cast<ptrdiff_t>(keep));
    std::string msg = ZipError(b);
    EXPECT_NE(msg.find("broken.pt"), std::string::npos) << keep << ": " << msg;
    EXPECT_TRUE(msg.find("truncated") != std::string::npos || msg.find("too short") != std::string::npos)
        << keep << ": " << msg;
  }
}

TEST(ZipReader, NotAZipFile) {
  std::string text = "this is a text file, not a zip archive, and it is long enough to have 22 bytes\n";
  std::vector<uint8_t> b(text.begin(), text.end());
  ExpectZipError(b, {"no zip end-of-central-directory record"});
  try {
    LoadTorchFile(MappedFile::FromMemory(b, "notes.txt"));
    FAIL() << "a text file was accepted";
  } catch (const FormatError& e) {
    EXPECT_NE(std::string(e.what()).find("notes.txt: not a torch.save file"), std::string::npos) << e.what();
  }
  EXPECT_THROW(LoadTorchFile(MappedFile::FromMemory({}, "empty.pt")), FormatError);
  EXPECT_THROW(LoadTorchFile("/nonexistent/dir/file.pt"), IoError);
}

// ---- zip64 -----------------------------------------------------------------

void Put16(std::vector<uint8_t>& b, uint16_t v) {
  b.push_back(static_cast<uint8_t>(v));
  b.push_back(static_cast<uint8_t>(v >> 8));
}
void Put32(std::vector<uint8_t>& b, uint32_t v) {
  Put16(b, static_cast<uint16_t>(v));
  Put16(b, static_cast<uint16_t>(v >> 16));
}
void Put64(std::vector<uint8_t>& b, uint64_t v) {
  Put32(b, static_cast<uint32_t>(v));
  Put32(b, static_cast<uint32_t>(v >> 32));
}

struct RawRecord {
  std::string name;
  std::string data;
};

// A stored zip written by hand, the way a zip64 writer would for huge files:
// every central record puts 0xFFFFFFFF in its sizes and offset and the real
// values in a zip64 extra field; a zip64 end record and locator precede an end
// record whose counts and offsets are all 0xFFFF / 0xFFFFFFFF.
std::vector<uint8_t> Zip64Archive(const std::vector<RawRecord>& records, bool short_extra = false) {
  std::vector<uint8_t> b;
  std::vector<uint64_t> offsets;
  for (const auto& r : records) {
    offsets.push_back(b.size());
    std::vector<uint8_t> d(r.data.begin(), r.data.end());
    Put32(b, 0x04034b50);
    Put16(b, 45);
    Put16(b, 0);
    Put16(b, 0);
    Put32(b, 0);
    Put32(b, Crc32(d));
    Put32(b, 0xFFFFFFFF);
    Put32(b, 0xFFFFFFFF);
    Put16(b, static_cast<uint16_t>(r.name.size()));
    Put16(b, 20);
    b.insert(b.end(), r.name.begin(), r.name.end());
    Put16(b, 0x0001);
    Put16(b, 16);
    Put64(b, d.size());
    Put64(b, d.size());
    b.insert(b.end(), d.begin(), d.end());
  }
  const uint64_t cd_offset = b.size();
  for (size_t k = 0; k < records.size(); ++k) {
    const auto& r = records[k];
    std::vector<uint8_t> d(r.data.begin(), r.data.end());
    Put32(b, 0x02014b50);
    Put16(b, 45);
    Put16(b, 45);
    Put16(b, 0);
    Put16(b, 0);
    Put32(b, 0);
    Put32(b, Crc32(d));
    Put32(b, 0xFFFFFFFF);
    Put32(b, 0xFFFFFFFF);
    Put16(b, static_cast<uint16_t>(r.name.size()));
    Put16(b, short_extra ? 20 : 28);
    Put16(b, 0);
    Put16(b, 0);
    Put16(b, 0);
    Put32(b, 0);
    Put32(b, 0xFFFFFFFF);
    b.insert(b.end(), r.name.begin(), r.name.end());
    Put16(b, 0x0001);
    Put16(b, short_extra ? 16 : 24);
    Put64(b, d.size());  // original size
    Put64(b, d.size());  // compressed size
    if (!short_extra) Put64(b, offsets[k]);
  }
  const uint64_t cd_size = b.size() - cd_offset;
  const uint64_t z64 = b.size();
  Put32(b, 0x06064b50);
  Put64(b, 44);
  Put16(b, 45);
  Put16(b, 45);
  Put32(b, 0);
  Put32(b, 0);
  Put64(b, records.size());
  Put64(b, records.size());
  Put64(b, cd_size);
  Put64(b, cd_offset);
  Put32(b, 0x07064b50);
  Put32(b, 0);
  Put64(b, z64);
  Put32(b, 1);
  Put32(b, 0x06054b50);
  Put16(b, 0xFFFF);
  Put16(b, 0xFFFF);
  Put16(b, 0xFFFF);
  Put16(b, 0xFFFF);
  Put32(b, 0xFFFFFFFF);
  Put32(b, 0xFFFFFFFF);
  Put16(b, 0);
  return b;
}

TEST(Zip64, HandcraftedArchiveReads) {
  std::string pkl = PickleBuilder().Proto(2).Tensor("IntStorage", "0", 3, 1, {2}, {1}).Stop().bytes();
  std::string ints("\x01\x00\x00\x00\x02\x00\x00\x00\x03\x00\x00\x00", 12);
  auto bytes = Zip64Archive({{"z/data.pkl", pkl}, {"z/data/0", ints}, {"z/version", "3\n"}});
  auto file = MappedFile::FromMemory(bytes, "zip64.pt");
  ZipReader zip(file);
  ASSERT_EQ(zip.entries().size(), 3u);
  const ZipEntry* d = zip.Find("z/data/0");
  ASSERT_NE(d, nullptr);
  EXPECT_EQ(d->size, 12u);
  auto span = zip.Data(*d);
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(span.data()), span.size()), ints);
  EXPECT_TRUE(zip.CrcMatches(*d));

  LoadOptions o;
  o.verify_crc = true;
  TorchFile f = LoadTorchFile(file, o);
  EXPECT_EQ(f.archive, "z");
  json j = ValueToJson(*f.root);
  EXPECT_EQ(j["type"], "tensor");
  EXPECT_EQ(j["dtype"], "int32");
  EXPECT_EQ(j["values"], json::array({2, 3}));
}

TEST(Zip64, ShortExtraFieldIsRefused) {
  auto bytes = Zip64Archive({{"z/data.pkl", "N."}}, /*short_extra=*/true);
  ExpectZipError(bytes, {"record 'z/data.pkl' has a short zip64 extra field"});
}

TEST(Zip64, BadLocatorIsRefused) {
  auto bytes = Zip64Archive({{"z/data.pkl", "N."}});
  // The locator's pointer to the zip64 end record (8 bytes after its signature).
  const size_t locator = bytes.size() - 22 - 20;
  Set32(bytes, locator + 8, 3);
  ExpectZipError(bytes, {"zip64 end-of-central-directory"});
}

// ---- Pickle VM limits ------------------------------------------------------

ValuePtr Read(const std::string& p, const PickleLimits& limits = {}) {
  return ReadPickle({reinterpret_cast<const uint8_t*>(p.data()), p.size()}, "t.pkl", {}, limits);
}
ValuePtr Read(const PickleBuilder& p, const PickleLimits& limits = {}) { return Read(p.bytes(), limits); }

std::string PickleError(const std::string& p, const PickleLimits& limits = {}) {
  try {
    Read(p, limits);
  } catch (const FormatError& e) {
    std::string msg = e.what();
    EXPECT_EQ(msg.rfind("t.pkl: pickle offset ", 0), 0u) << "message does not name the record and offset: " << msg;
    return msg;
  }
  return "<no error>";
}
std::string PickleError(const PickleBuilder& p, const PickleLimits& limits = {}) {
  return PickleError(p.bytes(), limits);
}

PickleBuilder P2() { return PickleBuilder().Proto(2); }

// n lists nested inside each other: [[[...]]].
std::string NestedLists(size_t n) {
  PickleBuilder p = P2();
  for (size_t k = 0; k < n; ++k) p.Op(pickle::kEmptyList);
  for (size_t k = 1; k < n; ++k) p.Op(pickle::kAppend);
  return p.Stop().bytes();
}

TEST(PickleLimits, Nesting) {
  PickleLimits l;
  l.max_depth = 10;
  EXPECT_NO_THROW(Read(NestedLists(10), l));
  EXPECT_NE(PickleError(NestedLists(11), l).find("nesting deeper than 10"), std::string::npos);
  // The default limit, with dicts and tuples in the chain too.
  PickleBuilder p = P2();
  for (size_t k = 0; k < 1200; ++k) p.Op(pickle::kEmptyDict).Str("k");
  p.Op(pickle::kNone);
  for (size_t k = 0; k < 1200; ++k) p.Op(pickle::kTuple1).Op(pickle::kSetItem);
  EXPECT_NE(PickleError(p.Stop()).find("nesting deeper than 1000"), std::string::npos);
}

TEST(PickleLimits, CycleIsRefused) {
  using namespace pickle;
  // l = []; l.append(l)
  EXPECT_NE(PickleError(P2().Op(kEmptyList).Put(0).Get(0).Op(kAppend).Stop()).find("cycle"), std::string::npos);
  // d = {}; d['k'] = [d]
  EXPECT_NE(PickleError(P2().Op(kEmptyDict).Put(0).Str("k").Op(kEmptyList).Get(0).Op(kAppend).Op(kSetItem).Stop())
                .find("cycle"),
            std::string::npos);
  // Sharing without a cycle is fine: [x, x].
  auto v = Read(P2().Op(kEmptyList).Mark().Op(kEmptyList).Put(1).Get(1).Op(kAppends).Stop());
  ASSERT_EQ(v->items.size(), 2u);
  EXPECT_EQ(v->items[0], v->items[1]);
}

TEST(PickleLimits, UnknownOpcode) {
  EXPECT_NE(PickleError(P2().U8(0xff).Stop()).find("unknown opcode 0xff"), std::string::npos);
  EXPECT_NE(PickleError(P2().Op(pickle::kExt1).U8(1).Stop()).find("extension-registry"), std::string::npos);
  EXPECT_NE(PickleError(PickleBuilder().Proto(9).Op(pickle::kNone).Stop()).find("unsupported pickle protocol"),
            std::string::npos);
}

TEST(PickleLimits, StackUnderflow) {
  using namespace pickle;
  EXPECT_NE(PickleError(P2().Op(kAppend).Stop()).find("stack underflow"), std::string::npos);
  EXPECT_NE(PickleError(P2().Stop()).find("stack underflow"), std::string::npos);
  // REDUCE across a MARK
  EXPECT_NE(PickleError(P2().Op(kNone).Mark().Op(kReduce).Stop()).find("stack underflow"), std::string::npos);
  EXPECT_NE(PickleError(P2().Op(kNone).Op(kPopMark).Stop()).find("no MARK"), std::string::npos);
  PickleLimits l;
  l.max_stack = 100;
  PickleBuilder many = P2();
  for (int k = 0; k < 101; ++k) many.Op(kNone);
  EXPECT_NE(PickleError(many.Stop(), l).find("stack limit"), std::string::npos);
}

TEST(PickleLimits, Long4OverLimit) {
  PickleLimits l;
  l.max_int_bytes = 64;
  auto long4 = [](uint32_t n) { return P2().Op(pickle::kLong4).U32(n).Raw(std::string(n, '\x01')).Stop(); };
  EXPECT_NO_THROW(Read(long4(64), l));
  EXPECT_NE(PickleError(long4(65), l).find("integer of 65 bytes exceeds the limit"), std::string::npos);
  // Default limit 16 KiB; a length far beyond the data is refused before reading.
  EXPECT_NE(PickleError(long4(1u << 20)).find("exceeds the limit"), std::string::npos);
  EXPECT_NE(PickleError(P2().Op(pickle::kLong4).U32(0xffffffff).Stop()).find("negative LONG4 length"),
            std::string::npos);
  // Text LONG obeys the same limit.
  auto text = [](pickle::Opcode op, const std::string& digits) { return PickleBuilder().Op(op).Line(digits).Stop(); };
  EXPECT_NE(PickleError(text(pickle::kLong, std::string(200, '9') + "L"), l).find("bad or over-long LONG"),
            std::string::npos);
  // Decimal text is capped at Python's 4300 digits whatever the byte limit.
  EXPECT_NO_THROW(Read(text(pickle::kInt, std::string(4300, '7'))));
  EXPECT_NE(PickleError(text(pickle::kInt, std::string(4301, '7'))).find("over-long INT"), std::string::npos);
}

TEST(PickleLimits, MemoGetOfUndefinedKey) {
  EXPECT_NE(PickleError(P2().Get(5).Stop()).find("memo key 5 is not defined"), std::string::npos);
  EXPECT_NE(PickleError(P2().Op(pickle::kLongBinGet).U32(256).Stop()).find("memo key 256 is not defined"),
            std::string::npos);
  EXPECT_NE(PickleError(PickleBuilder().Op(pickle::kGet).Line("7").Stop()).find("memo key 7 is not defined"),
            std::string::npos);
  PickleLimits l;
  l.max_memo = 2;
  EXPECT_NE(PickleError(P2().Op(pickle::kNone).Put(0).Put(1).Put(2).Stop(), l).find("memo limit"), std::string::npos);
}

TEST(PickleLimits, TruncatedInput) {
  EXPECT_NE(PickleError(P2().Op(pickle::kNone)).find("unexpected end of data"), std::string::npos);
  EXPECT_NE(PickleError(P2().Op(pickle::kBinUnicode).U32(255).Raw("ab")).find("runs past the end"), std::string::npos);
  EXPECT_NE(PickleError(P2().Op(pickle::kGlobal).Line("os").Raw("sys")).find("unterminated"), std::string::npos);
  EXPECT_NE(PickleError("").find("unexpected end of data"), std::string::npos);
}

TEST(PickleLimits, PersistentIdWithoutLoader) {
  EXPECT_NE(PickleError(P2().Op(pickle::kNone).Op(pickle::kBinPersId).Stop()).find("no loader"), std::string::npos);
}

}  // namespace
}  // namespace uckpt::test
