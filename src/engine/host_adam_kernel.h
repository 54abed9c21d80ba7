// The element loops of the host Adam (cpu_adam.h) on plain arrays, without
// libtorch: compiled alone with -O3 -fno-math-errno (their loops vectorise
// only so), which costs a few seconds here and would cost half a minute in a
// unit that parses libtorch's headers. cpu_adam.cc checks the tensors and
// calls these.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

namespace uckpt::engine::host_adam {

// The step's scalars, computed once in double and used as floats.
struct Scalars {
  float grad_scale, decay, weight_decay, beta1, one_minus_beta1, beta2, one_minus_beta2;
  float bias_correction2_sqrt, eps, neg_step_size;
  bool decoupled;
};

// How the gradient's elements are stored: fp32, or the model's bf16 or fp16
// bits (widened to fp32 as read, exactly).
enum class GradElems { kFloat, kBFloat16, kHalf };
// A gradient: `zero_after` zeroes each element behind the update (an
// accumulation buffer). An fp32 gradient is always one.
struct Grad {
  void* data;
  GradElems elems;
  bool zero_after;
};

// The 16-bit type the updated weights are also written in.
enum class WeightElems { kBFloat16, kHalf };
// A piece of the partition's new weights: elements [begin, begin + numel)
// into `bits`, rounded as torch's .to() rounds.
struct WeightPiece {
  int64_t begin;
  int64_t numel;
  uint16_t* bits;
};

// Updates [begin, end) of p, m, v on `threads` threads (this one included);
// with `out`, that range's new weights also go there (out.begin == begin).
void Update(const Scalars& s, float* p, float* m, float* v, const Grad& g, int64_t begin, int64_t end,
            const WeightPiece* out, WeightElems out_elems, int threads);

// Updates [0, n) in one pass, each of `pieces` (in order, not overlapping,
// inside [0, n); gaps get no copy) receiving its new weights: the same bits as
// Update over the pieces.
void UpdateInto(const Scalars& s, float* p, float* m, float* v, const Grad& g, int64_t n,
                const std::vector<WeightPiece>& pieces, WeightElems out_elems, int threads);

// The sum of the squares of x[0, n), in fp64, in fixed chunks summed in
// order: the same bits whatever `threads`.
double SumOfSquares(const float* x, int64_t n, int threads);

// SumOfSquares of each piece (offset, numel) of `size` elements at `base`
// (16-bit ones widened exactly: the sums of their fp32 copy), in one pass.
std::vector<double> PieceSumsOfSquares(const void* base, GradElems elems, int64_t size,
                                       const std::vector<std::pair<int64_t, int64_t>>& pieces, int threads);

}  // namespace uckpt::engine::host_adam
