// Corrupt input: every fixture truncated at many offsets and with seeded
// random byte flips. Loading must either throw FormatError / IoError or give a
// value that can be rendered (ValueToJson and PrintValue may only throw
// FormatError). Anything else, a crash or a sanitizer report, fails.
#include <gtest/gtest.h>

#include <algorithm>
#include <iostream>
#include <random>
#include <set>
#include <sstream>

#include "format/error.h"
#include "format/torch_file.h"
#include "format/value_json.h"
#include "format/value_print.h"
#include "format/zip.h"
#include "test_support.h"

namespace uckpt::test {
namespace {

struct Outcomes {
  int loaded = 0, format_error = 0, io_error = 0, render_error = 0, other = 0;
  int total() const { return loaded + format_error + io_error + other; }
  std::string Text() const {
    return std::to_string(total()) + " cases: " + std::to_string(loaded) + " loaded (" + std::to_string(render_error) +
           " of them refused to render), " + std::to_string(format_error) + " FormatError, " +
           std::to_string(io_error) + " IoError, " + std::to_string(other) + " other";
  }
};

// Loads `bytes` and renders the result; counts what happened.
void Try(std::vector<uint8_t> bytes, const std::string& what, bool verify_crc, Outcomes& o) {
  auto file = MappedFile::FromMemory(std::move(bytes), "corrupt.pt");
  try {
    LoadOptions lo;
    lo.verify_crc = verify_crc;
    lo.policy = PicklePolicy::kLenient;  // the longest path through the reader (tests/ckpt covers strict)
    TorchFile f = LoadTorchFile(file, lo);
    ++o.loaded;
    bool refused = false;
    try {
      ValueToJson(*f.root);
    } catch (const FormatError&) {
      refused = true;
    }
    try {
      std::ostringstream out;
      PrintValue(out, *f.root);
    } catch (const FormatError&) {
      refused = true;
    }
    o.render_error += refused;
  } catch (const FormatError& e) {
    ++o.format_error;
    if (std::string(e.what()).find("corrupt.pt") == std::string::npos)
      ADD_FAILURE() << what << ": error does not name the file: " << e.what();
  } catch (const IoError&) {
    ++o.io_error;
  } catch (const std::exception& e) {
    ++o.other;
    ADD_FAILURE() << what << ": unexpected exception " << typeid(e).name() << ": " << e.what();
  }
}

struct Regions {
  std::vector<std::pair<uint64_t, uint64_t>> pickle;     // data.pkl: [begin, end)
  std::vector<std::pair<uint64_t, uint64_t>> structure;  // headers, central directory, end records
  std::vector<uint64_t> record_starts;                   // local headers and data starts
  uint64_t cd_offset = 0;
};

// Where the interesting bytes of an intact zip are.
Regions FindRegions(const std::vector<uint8_t>& bytes) {
  Regions r;
  try {
    ZipReader zip(MappedFile::FromMemory(bytes, "intact.pt"));
    for (const auto& e : zip.entries()) {
      if (e.name.size() >= 8 && e.name.compare(e.name.size() - 8, 8, "data.pkl") == 0)
        r.pickle.push_back({e.data_offset, e.data_offset + e.size});
      r.record_starts.push_back(e.data_offset);
    }
    // Local headers lie just before each record's data; the central directory
    // and end records after the last data byte.
    uint64_t prev_end = 0;
    std::vector<ZipEntry> sorted = zip.entries();
    std::sort(sorted.begin(), sorted.end(), [](auto& a, auto& b) { return a.data_offset < b.data_offset; });
    for (const auto& e : sorted) {
      r.structure.push_back({prev_end, e.data_offset});
      prev_end = e.data_offset + e.size;
    }
    r.structure.push_back({prev_end, bytes.size()});
    r.cd_offset = prev_end;
  } catch (const FormatError&) {
    // Not a zip (legacy): the whole file is "structure".
    r.structure.push_back({0, bytes.size()});
  }
  return r;
}

std::vector<uint64_t> TruncationPoints(const std::vector<uint8_t>& bytes, const Regions& r) {
  const uint64_t n = bytes.size();
  std::set<uint64_t> at;
  for (uint64_t k = 0; k < 24; ++k) at.insert(n * k / 24);        // spread over the file
  for (uint64_t k = 1; k <= 30 && k <= n; ++k) at.insert(n - k);  // the end records
  for (int64_t d : {-2, -1, 0, 1, 4, 12, 30, 46, 60, 100, 200}) at.insert(r.cd_offset + d);
  for (auto [b, e] : r.pickle)
    for (uint64_t k = 0; k <= 8; ++k) at.insert(b + (e - b) * k / 8);
  for (uint64_t s : r.record_starts) {
    at.insert(s - 1);
    at.insert(s - 20);
  }
  std::vector<uint64_t> out;
  for (uint64_t p : at)
    if (p < n) out.push_back(p);
  return out;
}

class CorruptTest : public ::testing::TestWithParam<Fixture> {};

TEST_P(CorruptTest, TruncationsAndByteFlips) {
  const Fixture& fx = GetParam();
  const std::vector<uint8_t> intact = ReadFile(fx.path);
  const Regions regions = FindRegions(intact);

  Outcomes trunc;
  const auto points = TruncationPoints(intact, regions);
  EXPECT_GE(points.size(), std::min<size_t>(50, intact.size()));
  for (uint64_t p : points) {
    std::vector<uint8_t> cut(intact.begin(), intact.begin() + static_cast<ptrdiff_t>(p));
    Try(std::move(cut), "truncated at " + std::to_string(p), p % 2 == 0, trunc);
  }
  // A torch file cut anywhere loses its end records, so nothing may load.
  EXPECT_EQ(trunc.loaded, 0) << "a truncated file loaded";

  Outcomes flips;
  std::mt19937_64 rng(std::hash<std::string>()(fx.version + "/" + fx.name));
  const int kFlipCases = 200;
  for (int k = 0; k < kFlipCases; ++k) {
    std::vector<uint8_t> b = intact;
    // A third anywhere, a third in the pickle, a third in the zip structure.
    const std::vector<std::pair<uint64_t, uint64_t>>* region = nullptr;
    if (k % 3 == 1 && !regions.pickle.empty()) region = &regions.pickle;
    if (k % 3 == 2) region = &regions.structure;
    const int count = 1 + static_cast<int>(rng() % 4);
    std::string what = "flip case " + std::to_string(k) + ":";
    for (int j = 0; j < count; ++j) {
      uint64_t pos = rng() % b.size();
      if (region) {
        const auto& [lo, hi] = (*region)[rng() % region->size()];
        if (hi > lo) pos = lo + rng() % (hi - lo);
      }
      const uint8_t mask = static_cast<uint8_t>(1 + rng() % 255);
      b[pos] ^= mask;
      what += " [" + std::to_string(pos) + "]^=" + std::to_string(mask);
    }
    Try(std::move(b), what, k % 2 == 0, flips);
  }
  EXPECT_EQ(flips.total(), kFlipCases);
  EXPECT_EQ(trunc.other + flips.other, 0);
  std::cout << fx.version << "/" << fx.name << " (" << intact.size() << " bytes)\n"
            << "  truncations: " << trunc.Text() << "\n"
            << "  byte flips:  " << flips.Text() << "\n";
  RecordProperty("truncations", trunc.Text());
  RecordProperty("flips", flips.Text());
}

INSTANTIATE_TEST_SUITE_P(Fixtures, CorruptTest, ::testing::ValuesIn(AllFixtures()),
                         [](const auto& info) { return TestName(info.param); });

}  // namespace
}  // namespace uckpt::test
