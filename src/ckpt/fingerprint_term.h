// The state fingerprint's term (fingerprint.h), the one definition that the
// host loop and the CUDA kernel (engine/fingerprint_kernel.cu) share: only
// <cstdint>, so nvcc compiles it without the rest of uckpt.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define UCKPT_FINGERPRINT_FN __host__ __device__ __forceinline__
#else
#define UCKPT_FINGERPRINT_FN inline
#endif

namespace uckpt::ckpt {

inline constexpr uint64_t kFingerprintGolden = 0x9E3779B97F4A7C15ull;
inline constexpr uint64_t kFingerprintMul1 = 0xBF58476D1CE4E5B9ull;
inline constexpr uint64_t kFingerprintMul2 = 0x94D049BB133111EBull;

// splitmix64's finaliser (logical shifts).
UCKPT_FINGERPRINT_FN uint64_t FingerprintMix(uint64_t z) {
  z = (z ^ (z >> 30)) * kFingerprintMul1;
  z = (z ^ (z >> 27)) * kFingerprintMul2;
  return z ^ (z >> 31);
}

// term(seed, i, bits): element i of a tensor whose fp32 bit pattern is `bits`.
UCKPT_FINGERPRINT_FN uint64_t FingerprintTerm(uint64_t seed, uint64_t i, uint32_t bits) {
  return FingerprintMix((seed + i * kFingerprintGolden) ^ (static_cast<uint64_t>(bits) << 32));
}

}  // namespace uckpt::ckpt
