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

#include <functional>

#include "engine/flat_runtime.h"

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

// The sum of the squares of a host fp32 tensor, accumulated in fp64 (the
// squared L2 norm, for the global gradient norm without fp64 copies).
double SumOfSquares(const at::Tensor& t);

}  // namespace uckpt::engine
