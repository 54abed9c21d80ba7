// SplitMix64: the counter-based hash behind uckpt's data rule, dropout masks
// and BERT's masks. A draw is a function of (seed, sample, position), never
// of a shared generator's history, so it does not depend on the world size or
// on how a batch is split.
#pragma once

#include <cstdint>

namespace uckpt {

inline uint64_t SplitMix64(uint64_t x) {
  uint64_t z = x + 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

}  // namespace uckpt
