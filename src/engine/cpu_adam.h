// Adam/AdamW on fp32 partitions in host memory (offload_optimizer): one pass
// over the parameter, its moments and its gradient instead of torch's seven
// (and no temporaries, whose fresh pages cost as much as the arithmetic).
//
// Numerics: torch.optim.Adam/AdamW's single-tensor formula (TorchAdamStep in
// flat_runtime.h), each operation rounded to fp32 in the same order, without
// fused multiply-adds. torch's vectorised CPU kernels use FMAs in add(alpha)
// and addcmul, so results may differ from TorchAdamStep in the last bit of an
// element; tests/engine/cpu_adam_test.cc bounds that.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

#include "engine/flat_runtime.h"
#include "engine/host_adam_kernel.h"

namespace uckpt::engine {

// One step on `st` (master, exp_avg, exp_avg_sq, step; host fp32, contiguous;
// moments created on the first step) with gradient `grad * grad_scale`
// (grad_scale: the unscale-and-clip factor). `grad` is a contiguous host
// tensor: fp32, zeroed on return (ready for the next accumulation), or the
// model's bf16 or fp16, only read and converted to fp32 as it is read (exact:
// the same update as from its fp32 copy). Runs on at::get_num_threads() threads.
void CpuAdamStep(PartitionState& st, const at::Tensor& grad, double grad_scale, const OptimizerConfig& o, double lr);

// The same step, run over consecutive ranges of `range` elements in order;
// `range_done(begin, end)` is called after each, while the later ranges are
// still to be updated (for copying the updated weights out meanwhile).
void CpuAdamStep(PartitionState& st, const at::Tensor& grad, double grad_scale, const OptimizerConfig& o, double lr,
                 int64_t range, const std::function<void(int64_t begin, int64_t end)>& range_done);

// The same again, and before each range `range_out(begin, end)` may return a
// contiguous host bf16 or fp16 tensor of end - begin elements (or an undefined
// one): the range's updated weights are also written there, rounded as .to()
// rounds, in the same pass (the upload's staging without a second pass).
void CpuAdamStep(PartitionState& st, const at::Tensor& grad, double grad_scale, const OptimizerConfig& o, double lr,
                 int64_t range, const std::function<at::Tensor(int64_t begin, int64_t end)>& range_out,
                 const std::function<void(int64_t begin, int64_t end)>& range_done);

// One step prepared once and then run piece by piece, in any order and from
// any thread: the constructor advances the step count (creating the moments
// on the first step) and takes the scalars and the thread count
// (at::get_num_threads() of the constructing thread); Run updates a range.
// Every element of the partition must be run exactly once per pass; the
// result is then CpuAdamStep's, bit for bit, whatever the pieces. `st` and
// `grad` must outlive the pass and not be touched by others while it runs.
class CpuAdamPass {
 public:
  // An fp32 `grad` is zeroed behind the update (an accumulation buffer); a
  // bf16/fp16 one only with zero_16bit_grad (else it may be the model's, only read).
  CpuAdamPass(PartitionState& st, const at::Tensor& grad, double grad_scale, const OptimizerConfig& o, double lr,
              bool zero_16bit_grad = false);
  // Updates [begin, end) of the partition; `out`, when defined, a contiguous
  // host bf16 or fp16 tensor of end - begin elements, receives the range's
  // new weights rounded as .to() rounds. `threads` > 0: on that many
  // threads instead of the pass's own count (the same bits either way).
  void Run(int64_t begin, int64_t end, const at::Tensor& out = at::Tensor(), int threads = 0) const;
  // Where a piece of the partition's new weights go: elements [begin,
  // begin + out.numel()) into `out`, a contiguous host bf16 or fp16 tensor.
  struct WeightOut {
    int64_t begin = 0;
    at::Tensor out;
  };
  // Updates the whole partition in one pass (one wait for the threads), each
  // of `pieces` (in order, not overlapping; gaps get no copy) receiving its
  // new weights as Run's `out` does; the same bits as Run over the pieces.
  void RunInto(const std::vector<WeightOut>& pieces, int threads = 0) const;
  int64_t numel() const { return n_; }
  int threads() const { return threads_; }

 private:
  host_adam::Scalars s_{};
  float *p_, *m_, *v_;
  at::Tensor grad_;
  int64_t n_;
  int threads_;
  bool zero_16bit_grad_;
};

// The sum of the squares of a host fp32 tensor, accumulated in fp64 (the
// squared L2 norm, for the global gradient norm without fp64 copies).
double SumOfSquares(const at::Tensor& t);

// SumOfSquares of each piece (offset, numel) of a host fp32, bf16 or fp16
// tensor (16-bit elements widened exactly: the sums of its fp32 copy), bit for
// bit, in one parallel pass over all of them (a gradient partition's
// per-parameter norms without a wait for the threads per parameter).
std::vector<double> PieceSumsOfSquares(const at::Tensor& t, const std::vector<std::pair<int64_t, int64_t>>& pieces);

}  // namespace uckpt::engine
