#include "engine/data/data.h"

#include <algorithm>

#include "format/error.h"
#include "format/file.h"

namespace uckpt::engine {

void SyntheticSource::Row(int64_t step, int64_t, int64_t row, std::span<int64_t> out) const {
  for (size_t t = 0; t < out.size(); ++t) out[t] = Token(seed_, vocab_, step, row, static_cast<int64_t>(t));
}

std::string SyntheticSource::Describe() const {
  return "synthetic splitmix64 rule (seed " + std::to_string(seed_) + ", vocab " + std::to_string(vocab_) + ")";
}

TokenFileSource::TokenFileSource(const std::string& path, Encoding encoding, int64_t seq_len, int64_t vocab_size)
    : path_(path), encoding_(encoding), seq_len_(seq_len), vocab_(vocab_size) {
  auto file = MappedFile::Open(path);
  auto bytes = file->bytes();
  if (encoding == Encoding::kUInt16) {
    // llm.c's .bin files start with a 256 x int32 header: magic 20240520,
    // version 1, token count. nanoGPT's are bare ids.
    auto i32 = [&](size_t k) {
      return static_cast<int32_t>(bytes[4 * k] | bytes[4 * k + 1] << 8 | bytes[4 * k + 2] << 16 |
                                  static_cast<uint32_t>(bytes[4 * k + 3]) << 24);
    };
    if (bytes.size() >= 1024 && i32(0) == 20240520) {
      if (i32(1) != 1) throw FormatError(path + ": llm.c token file version " + std::to_string(i32(1)) + " (need 1)");
      const uint64_t n = static_cast<uint32_t>(i32(2));
      if (1024 + 2 * n > bytes.size())
        throw FormatError(path + ": llm.c header promises " + std::to_string(n) + " tokens, the file holds " +
                          std::to_string((bytes.size() - 1024) / 2));
      bytes = bytes.subspan(1024, 2 * n);
    }
    if (bytes.size() % 2 != 0)
      throw FormatError(path + ": a uint16 token file must have an even size, has " + std::to_string(bytes.size()) +
                        " bytes");
    tokens_.resize(bytes.size() / 2);
    for (size_t i = 0; i < tokens_.size(); ++i)
      tokens_[i] = static_cast<uint16_t>(bytes[2 * i] | (bytes[2 * i + 1] << 8));
  } else {
    tokens_.assign(bytes.begin(), bytes.end());
  }
  num_sequences_ = seq_len > 0 ? static_cast<int64_t>(tokens_.size()) / seq_len : 0;
  if (num_sequences_ == 0)
    throw FormatError(path + ": " + std::to_string(tokens_.size()) + " tokens, fewer than one sequence of " +
                      std::to_string(seq_len));
  auto it = std::max_element(tokens_.begin(), tokens_.end());
  if (*it >= vocab_size)
    throw FormatError(path + ": token " + std::to_string(*it) + " at position " + std::to_string(it - tokens_.begin()) +
                      " is not below the vocabulary size " + std::to_string(vocab_size));
}

void TokenFileSource::Row(int64_t, int64_t samples_before, int64_t row, std::span<int64_t> out) const {
  int64_t seq = (samples_before + row) % num_sequences_;
  for (size_t t = 0; t < out.size(); ++t) out[t] = tokens_[static_cast<size_t>(seq * seq_len_) + t];
}

std::string TokenFileSource::Describe() const {
  return path_ + " (" + (encoding_ == Encoding::kUInt16 ? "uint16 ids" : "bytes") + ", " +
         std::to_string(tokens_.size()) + " tokens, " + std::to_string(num_sequences_) + " sequences)";
}

std::vector<int64_t> GatherRows(const TokenSource& source, int64_t step, int64_t samples_before, int64_t first_row,
                                int64_t rows, int64_t seq_len) {
  std::vector<int64_t> out(static_cast<size_t>(rows * seq_len));
  for (int64_t i = 0; i < rows; ++i)
    source.Row(step, samples_before, first_row + i,
               std::span<int64_t>(out).subspan(static_cast<size_t>(i * seq_len), static_cast<size_t>(seq_len)));
  return out;
}

}  // namespace uckpt::engine
