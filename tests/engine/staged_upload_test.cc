// Filling tensors from read plans (engine/staged_upload.h): a direct read and
// reads staged through chunks of any size give the same bits as a reference
// built by hand (padding zeroed, whatever the tensor held before); dtype
// conversion, non-contiguous and empty destinations; bad plans are errors
// before anything is written, as are bad UCKPT_LOAD_CHUNK_BYTES and
// UCKPT_LOAD_THREADS values. The GPU cases run only where CUDA is available
// and say so when skipped.
#include "engine/staged_upload.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <random>
#include <stdexcept>

namespace uckpt::engine {
namespace {

// A source of random bytes and, per destination, random pieces with gaps
// between them (and before and after them).
struct Plan {
  std::vector<uint8_t> source;
  std::vector<std::vector<ckpt::ReadPiece>> pieces;  // per destination
};

Plan RandomPlan(const std::vector<int64_t>& elements, size_t element_size, uint32_t seed) {
  std::mt19937 rng(seed);
  Plan p;
  p.source.resize(1 << 16);
  for (auto& b : p.source) b = static_cast<uint8_t>(rng());
  for (int64_t n : elements) {
    const uint64_t size = static_cast<uint64_t>(n) * element_size;
    std::vector<ckpt::ReadPiece> pieces;
    for (uint64_t at = (rng() % 3) * element_size; at < size;) {
      const uint64_t len = std::min<uint64_t>(size - at, (1 + rng() % 40) * element_size);
      const size_t from = (rng() % (p.source.size() / element_size - 64)) * element_size;
      pieces.push_back({{p.source.data() + from, len}, at});
      at += len + (rng() % 4 == 0 ? (rng() % 5) * element_size : 0);  // a gap, sometimes
    }
    std::shuffle(pieces.begin(), pieces.end(), rng);
    p.pieces.push_back(std::move(pieces));
  }
  return p;
}

// What the destinations must hold: the pieces' bytes, zeros elsewhere.
std::vector<at::Tensor> Expected(const Plan& p, const std::vector<int64_t>& elements, at::ScalarType source) {
  std::vector<at::Tensor> out;
  for (size_t d = 0; d < elements.size(); ++d) {
    at::Tensor t = at::zeros({elements[d]}, at::TensorOptions().dtype(source));
    for (const auto& piece : p.pieces[d])
      std::memcpy(static_cast<uint8_t*>(t.data_ptr()) + piece.to, piece.from.data(), piece.from.size());
    out.push_back(t);
  }
  return out;
}

std::vector<TensorReads> Targets(const Plan& p, std::vector<at::Tensor> dsts, at::ScalarType source) {
  std::vector<TensorReads> out;
  for (size_t d = 0; d < dsts.size(); ++d) out.push_back({dsts[d], source, p.pieces[d]});
  return out;
}

uint64_t PieceBytes(const Plan& p) {
  uint64_t n = 0;
  for (const auto& ps : p.pieces)
    for (const auto& piece : ps) n += piece.from.size();
  return n;
}

// Destinations full of NaN (stale bytes where padding must become zero).
std::vector<at::Tensor> Stale(const std::vector<int64_t>& elements, const at::TensorOptions& o) {
  std::vector<at::Tensor> out;
  for (int64_t n : elements) out.push_back(at::full({n}, NAN, o));
  return out;
}

void ExpectEqual(const std::vector<at::Tensor>& got, const std::vector<at::Tensor>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t d = 0; d < got.size(); ++d) {
    const at::Tensor g = got[d].to(at::kCPU).contiguous().view(-1);
    const at::Tensor w = want[d].to(g.scalar_type());
    ASSERT_EQ(g.numel(), w.numel()) << what;
    // Bitwise (NaN-safe): compare the bytes.
    EXPECT_EQ(std::memcmp(g.data_ptr(), w.data_ptr(), g.nbytes()), 0) << what << ": destination " << d;
  }
}

// Sizes that put destinations across chunk edges and several in one chunk.
const std::vector<int64_t> kElements = {1, 300, 0, 17, 1000, 64, 3};

StagedOptions Staged(uint64_t chunk_bytes, bool stage_cpu = true) {
  StagedOptions o;
  o.chunk_bytes = chunk_bytes;
  o.stage_cpu = stage_cpu;
  o.reads.threads = 2;
  o.reads.chunk = 96;  // split pieces over the threads too
  return o;
}

TEST(StagedUpload, DirectAndStagedReadsGiveTheSameBitsAtEveryChunkSize) {
  const Plan p = RandomPlan(kElements, 4, 1);
  const auto want = Expected(p, kElements, at::kFloat);
  for (bool stage : {false, true}) {
    for (uint64_t chunk : {64ull, 100ull, 256ull, 4096ull, 1ull << 20}) {
      const std::string what = (stage ? "staged, chunk " : "direct, chunk ") + std::to_string(chunk);
      auto dsts = Stale(kElements, at::kFloat);
      auto targets = Targets(p, dsts, at::kFloat);
      EXPECT_EQ(FillFromReads(targets, Staged(chunk, stage)), PieceBytes(p)) << what;
      ExpectEqual(dsts, want, what);
    }
  }
}

// A direct read writes into the tensor's own memory, no copy.
TEST(StagedUpload, DirectReadFillsTheTensorsOwnMemory) {
  const Plan p = RandomPlan({100}, 4, 2);
  at::Tensor dst = at::full({100}, NAN);
  const void* memory = dst.data_ptr();
  auto targets = Targets(p, {dst}, at::kFloat);
  FillFromReads(targets, Staged(0, false));
  EXPECT_EQ(dst.data_ptr(), memory);
  ExpectEqual({dst}, Expected(p, {100}, at::kFloat), "direct");
}

TEST(StagedUpload, ConvertsTheSourceDtype) {
  const Plan p = RandomPlan(kElements, 2, 3);
  auto want = Expected(p, kElements, at::kBFloat16);
  for (auto& w : want) w = w.to(at::kFloat);
  for (uint64_t chunk : {64ull, 1000ull, 1ull << 20}) {
    auto dsts = Stale(kElements, at::kFloat);
    auto targets = Targets(p, dsts, at::kBFloat16);
    EXPECT_EQ(FillFromReads(targets, Staged(chunk, false)), PieceBytes(p));
    ExpectEqual(dsts, want, "bf16 -> fp32, chunk " + std::to_string(chunk));
  }
}

TEST(StagedUpload, FillsNonContiguousDestinations) {
  const Plan p = RandomPlan({12 * 7}, 4, 4);
  at::Tensor base = at::full({7, 12}, NAN);
  at::Tensor dst = base.t();  // 12 x 7, not contiguous
  ASSERT_FALSE(dst.is_contiguous());
  auto targets = Targets(p, {dst}, at::kFloat);
  FillFromReads(targets, Staged(128, false));
  ExpectEqual({dst}, Expected(p, {12 * 7}, at::kFloat), "transposed");
}

// Parameters (leaves that require grad) are filled too, outside any no-grad scope.
TEST(StagedUpload, FillsTensorsThatRequireGrad) {
  const Plan p = RandomPlan({50}, 2, 7);
  at::Tensor dst = at::full({50}, NAN).requires_grad_(true);
  auto targets = Targets(p, {dst}, at::kBFloat16);
  FillFromReads(targets, Staged(64, false));
  ExpectEqual({dst.detach()}, Expected(p, {50}, at::kBFloat16), "bf16 -> fp32 parameter");
}

TEST(StagedUpload, BadPlansAreRejectedBeforeAnythingIsWritten) {
  const Plan p = RandomPlan({10, 10}, 4, 5);
  for (bool stage : {false, true}) {
    auto dsts = Stale({10, 10}, at::kFloat);
    auto targets = Targets(p, dsts, at::kFloat);
    targets[1].pieces.push_back({{p.source.data(), 8}, 36});  // past the end of 40 bytes
    EXPECT_THROW(FillFromReads(targets, Staged(64, stage)), std::invalid_argument);
    targets[1].pieces = {{{p.source.data(), 8}, 0}, {{p.source.data(), 8}, 4}};  // overlapping
    EXPECT_THROW(FillFromReads(targets, Staged(64, stage)), std::invalid_argument);
    for (const auto& d : dsts) EXPECT_TRUE(at::isnan(d).all().item<bool>()) << "a destination was written";
  }
}

struct ScopedEnv {
  ScopedEnv(const char* name, const char* value) : name(name) { setenv(name, value, 1); }
  ~ScopedEnv() { unsetenv(name); }
  const char* name;
};

TEST(StagedUpload, ChunkSizeFromTheEnvironment) {
  EXPECT_EQ(DefaultChunkBytes(), 32ull << 20);
  {
    ScopedEnv env("UCKPT_LOAD_CHUNK_BYTES", "4096");
    EXPECT_EQ(DefaultChunkBytes(), 4096u);
  }
  for (const char* bad : {"12", "-1", "4k", "abc", "99999999999999999999999"}) {
    ScopedEnv env("UCKPT_LOAD_CHUNK_BYTES", bad);
    try {
      DefaultChunkBytes();
      ADD_FAILURE() << bad << " was accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("UCKPT_LOAD_CHUNK_BYTES"), std::string::npos) << e.what();
    }
  }
}

TEST(StagedUpload, ThreadsFromTheEnvironment) {
  EXPECT_GE(DefaultLoadThreads(), 1);
  EXPECT_LE(DefaultLoadThreads(), 8);
  {
    ScopedEnv env("UCKPT_LOAD_THREADS", "3");
    EXPECT_EQ(DefaultLoadThreads(), 3);
  }
  for (const char* bad : {"0", "-2", "many", "2000"}) {
    ScopedEnv env("UCKPT_LOAD_THREADS", bad);
    EXPECT_THROW(DefaultLoadThreads(), std::invalid_argument) << bad;
  }
}

// Onto a GPU: pinned chunks, asynchronous copies, conversion on the device.
TEST(StagedUpload, GpuDestinationsGiveTheSameBits) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA here: the GPU path is not tested";
  const at::TensorOptions gpu = at::TensorOptions().device(at::kCUDA);
  for (auto [source, size] : {std::pair{at::kFloat, 4}, {at::kBFloat16, 2}}) {
    const Plan p = RandomPlan(kElements, size, 6);
    auto want = Expected(p, kElements, source);
    for (uint64_t chunk : {64ull, 100ull, 4096ull, 1ull << 20}) {
      const std::string what = std::string(c10::toString(source)) + ", chunk " + std::to_string(chunk);
      auto dsts = Stale(kElements, gpu.dtype(at::kFloat));
      auto targets = Targets(p, dsts, source);
      StagedOptions o = Staged(chunk, false);
      o.chunks = 2;
      EXPECT_EQ(FillFromReads(targets, o), PieceBytes(p)) << what;
      ExpectEqual(dsts, want, what);
    }
  }
}

}  // namespace
}  // namespace uckpt::engine
