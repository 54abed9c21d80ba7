// The copy engine (ckpt/copy_plan.h): random piece layouts (zero-length
// pieces, pieces meeting at file and chunk boundaries, any order), split and
// unsplit files, generated files, whole-file copies; hashes against XXH64 of
// the files read back; errors that name the file. Reads staged through
// windows (SortReads, ClipReads, UncoveredRanges) fill a buffer exactly as
// one direct read into a zeroed buffer does.
#include "ckpt/copy_plan.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <stdexcept>

#include "ckpt/manifest.h"
#include "format/error.h"
#include "format/fault_env.h"
#include "format/torch_file.h"
#include "format/value.h"
#include "test_util.h"

namespace uckpt::ckpt {
namespace {

CopyOptions Threads(int n, uint64_t split_bytes = 64ull << 20) {
  CopyOptions o;
  o.threads = n;
  o.split_bytes = split_bytes;
  return o;
}

using testing::ReadFile;
using testing::TempDir;

uint64_t Xxh(const std::string& s) { return XXH64(s.data(), s.size(), 0); }

std::vector<uint8_t> RandomBytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> v(n);
  for (auto& b : v) b = static_cast<uint8_t>(rng());
  return v;
}

// A random plan over `source`: `files` files, each cut into random pieces
// (some empty, some over 1 MiB) taken from random places of the source and
// listed in shuffled order. `expected` gets each file's contents.
CopyPlan RandomPlan(const std::vector<uint8_t>& source, const std::string& dir, int files, bool hash, uint32_t seed,
                    std::vector<std::string>* expected) {
  std::mt19937 rng(seed);
  CopyPlan plan;
  for (int f = 0; f < files; ++f) {
    PlannedFile file;
    file.path = dir + "/f" + std::to_string(f);
    file.hash = hash;
    std::string want;
    const int pieces = static_cast<int>(rng() % 12);  // 0: an empty file
    for (int p = 0; p < pieces; ++p) {
      size_t len;
      switch (rng() % 4) {
        case 0: len = 0; break;
        case 1: len = 1 + rng() % 100; break;
        case 2: len = (1 << 20) - 7 + rng() % 15; break;  // around the 1 MiB write size
        default: len = rng() % (3 << 20); break;
      }
      len = std::min(len, source.size());
      const size_t at = rng() % (source.size() - len + 1);
      file.pieces.push_back({{source.data() + at, len}, want.size()});
      want.append(reinterpret_cast<const char*>(source.data() + at), len);
    }
    std::shuffle(file.pieces.begin(), file.pieces.end(), rng);
    file.size = want.size();
    plan.files.push_back(std::move(file));
    expected->push_back(std::move(want));
  }
  return plan;
}

void CheckPlan(int threads, bool hash, uint64_t split_bytes, uint32_t seed, int writers_per_file = 0) {
  TempDir tmp;
  const auto source = RandomBytes(8 << 20, seed);
  std::vector<std::string> expected;
  CopyPlan plan = RandomPlan(source, tmp.path(), 9, hash, seed, &expected);
  CopyOptions options;
  options.threads = threads;
  options.split_bytes = split_bytes;
  options.writers_per_file = writers_per_file;
  std::atomic<uint64_t> reported{0};
  options.written = [&](std::span<const uint8_t> piece) {
    EXPECT_LE(piece.size(), 1u << 20);
    reported += piece.size();
  };
  std::vector<int> done(plan.files.size(), 0);
  options.done = [&](size_t i, const CopyResult& r) {
    ++done[i];
    EXPECT_EQ(r.size, expected[i].size());
  };
  auto results = ExecuteCopyPlan(plan, options);
  ASSERT_EQ(results.size(), plan.files.size());
  uint64_t total = 0;
  for (size_t i = 0; i < plan.files.size(); ++i) {
    SCOPED_TRACE(plan.files[i].path);
    EXPECT_EQ(done[i], 1);
    EXPECT_TRUE(ReadFile(plan.files[i].path) == expected[i]) << "contents differ";
    EXPECT_EQ(results[i].size, expected[i].size());
    if (hash) {
      EXPECT_EQ(results[i].xxh64, Xxh(expected[i]));
    }
    total += expected[i].size();
  }
  EXPECT_EQ(reported.load(), total);
}

TEST(CopyPlan, RandomLayoutsHashedOneThread) {
  for (uint32_t seed = 1; seed <= 4; ++seed) CheckPlan(1, true, 64 << 20, seed);
}

TEST(CopyPlan, RandomLayoutsHashedThreads) {
  for (uint32_t seed = 5; seed <= 8; ++seed) CheckPlan(3, true, 1 << 20, seed);
}

// Unhashed files over split_bytes are written in byte ranges by several
// threads at once; ranges start and end inside pieces.
TEST(CopyPlan, RandomLayoutsSplitOverThreads) {
  for (uint32_t seed = 9; seed <= 14; ++seed) CheckPlan(4, false, 1 << 20, seed);
}

// Hashed files over split_bytes too: ranges written by several threads
// while one more job hashes the pieces in order; the same bytes and hash.
TEST(CopyPlan, RandomLayoutsHashedSplitOverThreads) {
  // A split file is preallocated (its ranges are written in any order): seen here.
  struct CountAllocations : EnvWrapper {
    struct File : WritableFile {
      File(std::unique_ptr<WritableFile> f, std::atomic<int>& n) : f(std::move(f)), n(n) {}
      size_t Write(std::span<const uint8_t> d) override { return f->Write(d); }
      size_t WriteAt(uint64_t o, std::span<const uint8_t> d) override { return f->WriteAt(o, d); }
      void Allocate(uint64_t size) override {
        ++n;
        f->Allocate(size);
      }
      void Sync() override { f->Sync(); }
      void Close() override { f->Close(); }
      const std::string& path() const override { return f->path(); }
      std::unique_ptr<WritableFile> f;
      std::atomic<int>& n;
    };
    CountAllocations() : EnvWrapper(Env::Posix()) {}
    std::unique_ptr<WritableFile> NewWritableFile(const std::string& path, unsigned mode) override {
      return std::make_unique<File>(EnvWrapper::NewWritableFile(path, mode), allocations);
    }
    std::atomic<int> allocations{0};
  } env;
  ScopedEnv use(env);
  for (uint32_t seed = 15; seed <= 20; ++seed) CheckPlan(4, true, 1 << 20, seed);
  CheckPlan(3, true, 4096, 21);  // many small ranges
  EXPECT_GT(env.allocations.load(), 6) << "hashed files were not split over threads";
  // One writer per file (appending: no preallocation), another thread hashing it.
  const int before = env.allocations.load();
  for (uint32_t seed = 22; seed <= 25; ++seed) CheckPlan(3, true, 1 << 20, seed, /*writers_per_file=*/1);
  EXPECT_EQ(env.allocations.load(), before) << "a file with one writer was preallocated";
}

// A write failing in one of the threads writing a split, hashed file fails
// the plan with an IoError naming the file.
TEST(CopyPlan, WriteFailureInOneRangeThreadFailsThePlan) {
  TempDir tmp;
  const auto source = RandomBytes(6 << 20, 3);
  CopyPlan plan;
  PlannedFile f;
  f.path = tmp / "big.bin";
  f.size = source.size();
  f.pieces.push_back({{source.data(), source.size()}, 0});
  plan.files.push_back(f);
  FaultEnv env;
  env.Add({IoOp::kWrite, "big.bin", 4, ENOSPC, /*once=*/true});
  ScopedEnv use(env);
  CopyOptions options = Threads(3);
  options.split_bytes = 1 << 20;
  bool done = false;
  options.done = [&](size_t, const CopyResult&) { done = true; };
  try {
    ExecuteCopyPlan(plan, options);
    ADD_FAILURE() << "the plan did not fail";
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find("big.bin"), std::string::npos) << e.what();
  }
  EXPECT_EQ(env.injected(), 1u);
  EXPECT_FALSE(done) << "a file with a failed range was reported finished";
}

// A torch file laid out as pieces (TorchFilePlan) and written by several
// threads is SaveTorchFile's file byte for byte, its XXH64 the file's.
TEST(CopyPlan, TorchFilePlanEqualsSaveTorchFile) {
  TempDir tmp;
  std::vector<std::vector<uint8_t>> data;
  for (size_t n : {0u, 4u, 1000u, 3u << 20, 64u, (1u << 20) + 12})
    data.push_back(RandomBytes(n, static_cast<uint32_t>(n)));
  ValuePtr root = Value::Dict();
  ValuePtr list = Value::List();
  for (auto& d : data)
    list->items.push_back(Value::FromTensor(Tensor::FromBytes(DType::kUInt8, {static_cast<int64_t>(d.size())}, d)));
  root->set("tensors", list);
  root->set("step", Value::Int(7));
  SaveOptions plain;
  plain.durable = false;
  SaveTorchFile(tmp / "one.pt", root, plain);
  for (int threads : {1, 2, 4}) {
    CopyPlan plan;
    plan.files.push_back(TorchFilePlan(tmp / "one.pt", root, threads));
    plan.files.back().path = tmp / "many.pt";
    CopyOptions options = Threads(threads);
    options.split_bytes = 100000;
    const auto results = ExecuteCopyPlan(plan, options);
    const std::string want = ReadFile(tmp / "one.pt");
    EXPECT_TRUE(ReadFile(tmp / "many.pt") == want) << threads << " threads";
    EXPECT_EQ(results[0].size, want.size());
    EXPECT_EQ(results[0].xxh64, Xxh(want));
  }
}

TEST(CopyPlan, GeneratedAndWholeFileCopies) {
  TempDir tmp;
  const auto bytes = RandomBytes(20 << 20, 42);
  const std::string src = tmp / "src.bin";
  {
    std::ofstream out(src, std::ios::binary);
    out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  }
  ::chmod(src.c_str(), 0600);
  const std::string empty = tmp / "empty.bin";
  std::ofstream(empty).close();
  CopyPlan plan;
  PlannedFile gen;
  gen.path = tmp / "gen.bin";
  std::string want;
  gen.generate = [&](OrderedSink& out) {
    EXPECT_EQ(out.path(), tmp / "gen.bin");
    for (size_t n : {0u, 1u, 1000u, 1u << 20, (1u << 20) + 3, 5u, 3u << 20}) {
      std::string s(n, static_cast<char>('a' + n % 26));
      out.Write(s);
    }
  };
  for (size_t n : {0u, 1u, 1000u, 1u << 20, (1u << 20) + 3, 5u, 3u << 20})
    want.append(n, static_cast<char>('a' + n % 26));
  plan.files.push_back(gen);
  PlannedFile copy;
  copy.path = tmp / "copy.bin";
  copy.copy_from = src;
  plan.files.push_back(copy);
  copy.path = tmp / "copy_empty.bin";
  copy.copy_from = empty;
  plan.files.push_back(copy);
  auto results = ExecuteCopyPlan(plan, Threads(2));
  EXPECT_TRUE(ReadFile(tmp / "gen.bin") == want);
  EXPECT_EQ(results[0].size, want.size());
  EXPECT_EQ(results[0].xxh64, Xxh(want));
  EXPECT_TRUE(ReadFile(tmp / "copy.bin") == ReadFile(src));
  EXPECT_EQ(results[1].size, bytes.size());
  EXPECT_EQ(results[1].xxh64, XXH64(bytes.data(), bytes.size(), 0));
  EXPECT_EQ(results[2].size, 0u);
  EXPECT_EQ(results[2].xxh64, XXH64(nullptr, 0, 0));
  struct stat st;
  ASSERT_EQ(::stat((tmp / "copy.bin").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);  // as cp -p
  // The manifest takes these hashes without reading the files again; they
  // agree with hashing the files.
  std::vector<ManifestEntry> known;
  for (size_t i = 0; i < plan.files.size(); ++i)
    known.push_back({std::filesystem::path(plan.files[i].path).filename().string(), results[i].size, results[i].xxh64});
  Manifest with = WriteManifest(tmp.path(), known, false);
  Manifest hashed = WriteManifest(tmp.path(), false);
  ASSERT_EQ(with.files.size(), hashed.files.size());
  for (size_t i = 0; i < with.files.size(); ++i) {
    EXPECT_EQ(with.files[i].path, hashed.files[i].path);
    EXPECT_EQ(with.files[i].size, hashed.files[i].size);
    EXPECT_EQ(with.files[i].xxh64, hashed.files[i].xxh64) << with.files[i].path;
  }
}

TEST(CopyPlan, PiecesThatDoNotTileAreRejected) {
  TempDir tmp;
  const auto bytes = RandomBytes(100, 1);
  for (int c = 0; c < 3; ++c) {
    CopyPlan plan;
    PlannedFile f;
    f.path = tmp / "bad";
    f.pieces = {{{bytes.data(), 10}, 0}, {{bytes.data(), 10}, c == 0 ? 5u : c == 1 ? 11u : 10u}};
    f.size = c == 2 ? 30 : 20;  // an overlap, a gap, a short cover
    plan.files.push_back(f);
    try {
      ExecuteCopyPlan(plan);
      ADD_FAILURE() << "case " << c << " accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(tmp / "bad"), std::string::npos) << e.what();
    }
  }
}

// An I/O error (from the fault-injection Env) stops the plan and names the file.
TEST(CopyPlan, IoErrorNamesTheFile) {
  const auto source = RandomBytes(4 << 20, 3);
  struct Case {
    IoOp op;
    const char* victim;
    bool hash;
  };
  for (const Case& c : {Case{IoOp::kWrite, "f3", true}, Case{IoOp::kWrite, "f5", false},
                        Case{IoOp::kCreate, "f2", true}, Case{IoOp::kCopy, "whole", true}}) {
    TempDir tmp;
    std::vector<std::string> expected;
    CopyPlan plan = RandomPlan(source, tmp.path(), 8, c.hash, 7, &expected);
    for (auto& f : plan.files) {  // every file non-empty, so each has a write
      f.pieces.push_back({{source.data(), 3 << 20}, f.size});
      f.size += 3 << 20;
    }
    const std::string src = tmp / "src.bin";
    std::ofstream(src) << "data";
    PlannedFile whole;
    whole.path = tmp / "whole.bin";
    whole.copy_from = src;
    plan.files.push_back(whole);
    FaultEnv env;
    env.Add({c.op, std::string("/") + c.victim, 1, ENOSPC});
    ScopedEnv use(env);
    try {
      ExecuteCopyPlan(plan, Threads(3, 1 << 20));
      ADD_FAILURE() << "no error for " << c.victim;
    } catch (const IoError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find(tmp / c.victim), std::string::npos) << what;
      EXPECT_NE(what.find(std::strerror(ENOSPC)), std::string::npos) << what;
    }
    EXPECT_GE(env.injected(), 1u);
  }
}

// Short writes (as on a nearly full disk) still write every byte.
TEST(CopyPlan, ShortWrites) {
  TempDir tmp;
  const auto source = RandomBytes(3 << 20, 11);
  std::vector<std::string> expected;
  CopyPlan plan = RandomPlan(source, tmp.path(), 5, true, 11, &expected);
  FaultEnv env;
  env.set_short_writes(true);
  ScopedEnv use(env);
  auto results = ExecuteCopyPlan(plan, Threads(2));
  for (size_t i = 0; i < plan.files.size(); ++i) {
    EXPECT_TRUE(ReadFile(plan.files[i].path) == expected[i]) << plan.files[i].path;
    EXPECT_EQ(results[i].xxh64, Xxh(expected[i]));
  }
}

// An exception from `done` (convert's Ctrl-C check) stops the plan.
TEST(CopyPlan, DoneCanStopThePlan) {
  TempDir tmp;
  const auto source = RandomBytes(1 << 20, 5);
  std::vector<std::string> expected;
  CopyPlan plan = RandomPlan(source, tmp.path(), 20, true, 5, &expected);
  int calls = 0;
  CopyOptions options;
  options.threads = 1;
  options.done = [&](size_t, const CopyResult&) {
    if (++calls == 3) throw IoError("stop");
  };
  EXPECT_THROW(ExecuteCopyPlan(plan, options), IoError);
  EXPECT_EQ(calls, 3);
}

// ---- Reads staged through windows. ----

std::span<const uint8_t> Bytes(const std::vector<uint8_t>& v, size_t at, size_t n) { return {v.data() + at, n}; }

TEST(StagedReads, ClipCutsPiecesThatStraddleTheWindow) {
  const auto src = RandomBytes(100, 11);
  // Pieces at [10, 30) and [30, 50) of a 64-byte buffer, given out of order.
  std::vector<ReadPiece> pieces = {{Bytes(src, 50, 20), 30}, {Bytes(src, 0, 20), 10}};
  const auto sorted = SortReads(pieces, 64);
  ASSERT_EQ(sorted.size(), 2u);
  EXPECT_EQ(sorted[0].to, 10u);
  const auto clipped = ClipReads(sorted, {25, 40});  // the end of one piece, the start of the next
  ASSERT_EQ(clipped.size(), 2u);
  EXPECT_EQ(clipped[0].to, 0u);
  EXPECT_EQ(clipped[0].from.data(), src.data() + 15);
  EXPECT_EQ(clipped[0].from.size(), 5u);
  EXPECT_EQ(clipped[1].to, 5u);
  EXPECT_EQ(clipped[1].from.data(), src.data() + 50);
  EXPECT_EQ(clipped[1].from.size(), 10u);
  const auto inside = ClipReads(sorted, {12, 14});  // inside one piece
  ASSERT_EQ(inside.size(), 1u);
  EXPECT_EQ(inside[0].from.data(), src.data() + 2);
  EXPECT_EQ(inside[0].from.size(), 2u);
  EXPECT_EQ(inside[0].to, 0u);
}

TEST(StagedReads, EmptyWindowsAndWindowsOverPaddingHaveNoPieces) {
  const auto src = RandomBytes(100, 12);
  const auto sorted = SortReads(std::vector<ReadPiece>{{Bytes(src, 0, 20), 10}}, 64);
  EXPECT_TRUE(ClipReads(sorted, {20, 20}).empty());
  EXPECT_TRUE(ClipReads(sorted, {30, 20}).empty());
  EXPECT_TRUE(ClipReads(sorted, {0, 10}).empty());   // ends where the piece begins
  EXPECT_TRUE(ClipReads(sorted, {30, 64}).empty());  // begins where it ends
  EXPECT_TRUE(ClipReads({}, {0, 64}).empty());
  EXPECT_EQ(UncoveredRanges({}, 64), (std::vector<ByteRange>{{0, 64}}));
  EXPECT_TRUE(UncoveredRanges({}, 0).empty());
}

TEST(StagedReads, UncoveredRangesAreThePaddingOnly) {
  const auto src = RandomBytes(100, 13);
  // [0, 4) gap, [4, 20) piece, [20, 20) empty piece, [20, 30) piece, [30, 40) gap, [40, 64) piece.
  const std::vector<ReadPiece> pieces = {
      {Bytes(src, 0, 16), 4}, {Bytes(src, 16, 0), 20}, {Bytes(src, 20, 10), 20}, {Bytes(src, 40, 24), 40}};
  const auto sorted = SortReads(pieces, 64);
  EXPECT_EQ(sorted.size(), 3u);  // the empty piece is dropped
  EXPECT_EQ(UncoveredRanges(sorted, 64), (std::vector<ByteRange>{{0, 4}, {30, 40}}));
  EXPECT_EQ(UncoveredRanges(sorted, 70), (std::vector<ByteRange>{{0, 4}, {30, 40}, {64, 70}}));
}

TEST(StagedReads, PiecesThatOverlapOrDoNotFitAreRejected) {
  const auto src = RandomBytes(100, 14);
  EXPECT_THROW(SortReads(std::vector<ReadPiece>{{Bytes(src, 0, 20), 50}}, 64), std::invalid_argument);
  EXPECT_THROW(SortReads(std::vector<ReadPiece>{{Bytes(src, 0, 1), 64}}, 64), std::invalid_argument);
  EXPECT_THROW(SortReads(std::vector<ReadPiece>{{Bytes(src, 0, 20), 0}, {Bytes(src, 0, 10), 19}}, 64),
               std::invalid_argument);
  EXPECT_NO_THROW(SortReads(std::vector<ReadPiece>{{Bytes(src, 0, 20), 0}, {Bytes(src, 0, 10), 20}}, 64));
}

// Random pieces with gaps, read window by window into a reused buffer full of
// stale bytes (gaps zeroed, clipped pieces read), give what one read into a
// zeroed buffer gives, for windows that cut pieces anywhere.
TEST(StagedReads, WindowByWindowEqualsOneRead) {
  std::mt19937 rng(15);
  const auto src = RandomBytes(1 << 16, 16);
  for (int round = 0; round < 50; ++round) {
    std::vector<ReadPiece> pieces;
    uint64_t at = 0;
    while (true) {
      at += rng() % 3 == 0 ? rng() % 40 : 0;  // a gap, sometimes
      const uint64_t n = rng() % 300;
      if (at + n > src.size()) break;
      pieces.push_back({Bytes(src, rng() % (src.size() - n + 1), n), at});
      at += n;
      if (rng() % 40 == 0) break;
    }
    const uint64_t size = at + rng() % 20;
    std::shuffle(pieces.begin(), pieces.end(), rng);
    std::vector<uint8_t> direct(size, 0);
    ExecuteReads(std::vector<ReadBatch>{{{direct.data(), direct.size()}, pieces}});

    const auto sorted = SortReads(pieces, size);
    const uint64_t window = 1 + rng() % 257;
    std::vector<uint8_t> staged(size), chunk(window);
    for (uint64_t begin = 0; begin < size; begin += window) {
      const ByteRange w{begin, std::min(size, begin + window)};
      std::fill(chunk.begin(), chunk.end(), 0xAB);  // what the previous window left
      const auto clipped = ClipReads(sorted, w);
      for (const ByteRange& gap : UncoveredRanges(clipped, w.size()))
        std::memset(chunk.data() + gap.begin, 0, gap.size());
      ExecuteReads(std::vector<ReadBatch>{{{chunk.data(), w.size()}, clipped}}, ReadOptions{2, 64});
      std::memcpy(staged.data() + begin, chunk.data(), w.size());
    }
    ASSERT_EQ(staged, direct) << "round " << round << ", window " << window;
  }
}

}  // namespace
}  // namespace uckpt::ckpt
