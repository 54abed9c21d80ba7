// Training data. Global batch k (1-based optimizer step) is a fixed set of
// rows whatever the world size; rank r in micro step m takes rows
// [m*W*MB + r*MB, m*W*MB + (r+1)*MB) of it (shared/fixtures/refrun-gpt2/README.md,
// "Data rule"). No libtorch here: rows are plain int64 token ids.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "uckpt/random.h"

namespace uckpt::engine {

using uckpt::SplitMix64;  // include/uckpt/random.h

// The first global-batch row of rank `rank`'s micro step `micro_step`.
inline int64_t FirstRow(int64_t micro_step, int rank, int world_size, int64_t micro_batch) {
  return micro_step * world_size * micro_batch + rank * micro_batch;
}

// Where training sequences come from.
class TokenSource {
 public:
  virtual ~TokenSource() = default;
  // Writes the tokens of row `row` of step `step`'s global batch into `out`
  // (its size is the sequence length). `samples_before` is the data position:
  // samples consumed by all steps before `step`.
  virtual void Row(int64_t step, int64_t samples_before, int64_t row, std::span<int64_t> out) const = 0;
  // Tokens are < this.
  virtual int64_t vocab_limit() const = 0;
  virtual std::string Describe() const = 0;
};

// The fixture's synthetic rule: token(s, i, t) = splitmix64(seed + s*1000003 +
// i*1009 + t) mod vocab. Depends only on (step, row), never on the split.
class SyntheticSource : public TokenSource {
 public:
  SyntheticSource(uint64_t seed, int64_t vocab_size) : seed_(seed), vocab_(vocab_size) {}
  static int64_t Token(uint64_t seed, int64_t vocab, int64_t step, int64_t row, int64_t t) {
    uint64_t x =
        seed + static_cast<uint64_t>(step) * 1000003u + static_cast<uint64_t>(row) * 1009u + static_cast<uint64_t>(t);
    return static_cast<int64_t>(SplitMix64(x) % static_cast<uint64_t>(vocab));
  }
  void Row(int64_t step, int64_t samples_before, int64_t row, std::span<int64_t> out) const override;
  int64_t vocab_limit() const override { return vocab_; }
  std::string Describe() const override;

 private:
  uint64_t seed_;
  int64_t vocab_;
};

// A token file read as consecutive sequences of `seq_len` tokens: sample n
// (n = samples_before + row) is sequence n mod (tokens / seq_len). Either
// little-endian uint16 ids (nanoGPT .bin, or llm.c .bin with its 1 KiB
// header) or the bytes of any
// file (byte-level, vocab 256). Throws FormatError naming the file if it is
// too short or an id is >= vocab_size.
class TokenFileSource : public TokenSource {
 public:
  enum class Encoding { kUInt16, kBytes };
  TokenFileSource(const std::string& path, Encoding encoding, int64_t seq_len, int64_t vocab_size);
  void Row(int64_t step, int64_t samples_before, int64_t row, std::span<int64_t> out) const override;
  int64_t vocab_limit() const override { return vocab_; }
  std::string Describe() const override;
  int64_t num_sequences() const { return num_sequences_; }

 private:
  std::string path_;
  Encoding encoding_;
  std::vector<uint16_t> tokens_;
  int64_t seq_len_;
  int64_t vocab_;
  int64_t num_sequences_ = 0;
};

// `rows` consecutive rows starting at `first_row`, row-major [rows, seq_len].
std::vector<int64_t> GatherRows(const TokenSource& source, int64_t step, int64_t samples_before, int64_t first_row,
                                int64_t rows, int64_t seq_len);

}  // namespace uckpt::engine
