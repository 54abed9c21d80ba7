// Stage 3's gradient buckets (engine/zero3_reduce.h): reduce-scattered into
// the owners' fp32 gradient partitions, during backward under overlap_comm.
#include "engine/zero3_reduce.h"

#include <c10/core/GradMode.h>

#include <algorithm>
#include <numeric>

#include "ckpt/partition.h"
#include "engine/pinned_host.h"
#include "engine/zero3_runtime.h"

namespace uckpt::engine {
namespace {

// Reduce-scatters left running at once under overlap_comm: each holds a
// bucket's buffer (dp * its elements, model dtype), so this bounds the extra memory.
constexpr size_t kMaxReducesInFlight = 2;

}  // namespace

void CopyRankColumn(const at::Tensor& flat, const at::Tensor& column, int64_t numel, bool to_column) {
  const int64_t ps = column.size(1), full = ps > 0 ? std::min(numel / ps, column.size(0)) : 0;
  const int64_t rest = numel - full * ps;
  auto copy = [to_column](const at::Tensor& in_flat, const at::Tensor& in_column) {
    to_column ? in_column.copy_(in_flat) : in_flat.copy_(in_column);
  };
  if (full > 0) copy(flat.narrow(0, 0, full * ps).view({full, ps}), column.narrow(0, 0, full));
  if (rest > 0) copy(flat.narrow(0, full * ps, rest), column[full].narrow(0, 0, rest));
}

at::Tensor RankSlot(const at::Tensor& t, int dp, int rank) {
  const int64_t numel = t.numel(), ps = ckpt::Stage3PartitionSize(numel, dp);
  const int64_t first = std::min(numel, ps * rank), real = ckpt::Stage3RealNumel(numel, dp, rank);
  at::Tensor slot = at::zeros({ps}, t.options());
  if (real > 0) slot.narrow(0, 0, real).copy_(t.reshape(-1).narrow(0, first, real));
  return slot;
}

void GradientReducer::Add(const std::vector<size_t>& ps) {
  for (size_t i : ps)
    if (params_[i].tensor.grad().defined()) Bucket(i);
}

void GradientReducer::Bucket(size_t i) {
  Zero3Param& p = params_[i];
  if (bucket_numel_ > 0 && bucket_numel_ + p.numel > s_.base.reduce_bucket_size) Flush();
  bucket_.push_back(i);
  bucket_grads_.push_back(p.tensor.grad());
  bucket_numel_ += p.numel;
  p.tensor.mutable_grad() = at::Tensor();  // the gradient's memory goes with the bucket
}

void GradientReducer::BeginTail() { tail_ = true; }

void GradientReducer::FinishTail() {
  for (size_t i = 0; i < params_.size(); ++i)
    if (params_[i].tensor.grad().defined()) Bucket(i);
  Flush();
  FinishReduces(0);
  tail_ = false;
}

void GradientReducer::Flush() {
  if (bucket_.empty()) return;
  Reducing r = Pack();
  StartReduce(r);
  ++reduce_buckets_;
  if (!s_.base.overlap_comm) return FinishReduce(r);
  reducing_.push_back(std::move(r));
  if (!tail_) ++overlapped_buckets_;
  FinishReduces(kMaxReducesInFlight);
}

// DeepSpeed sorts the bucket by parameter id, then lays out per rank each
// parameter's chunk (padded to ps); that layout sets Gloo's summation order.
// Divided and reduced in the model dtype (DeepSpeed's communication_data_type).
GradientReducer::Reducing GradientReducer::Pack() {
  c10::NoGradGuard no_grad;
  const int dp = this->dp();
  std::vector<size_t> order(bucket_.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return bucket_[a] < bucket_[b]; });
  int64_t total = 0;
  for (size_t i : bucket_) total += params_[i].partition_size;
  Reducing r;
  r.buffer = at::zeros({dp, total}, bucket_grads_[0].options());
  int64_t off = 0;
  for (size_t j : order) {
    const Zero3Param& p = params_[bucket_[j]];
    // The last ranks' chunks are short or empty (their padding stays zero).
    CopyRankColumn(bucket_grads_[j].reshape(-1), r.buffer.narrow(1, off, p.partition_size), p.numel, true);
    bucket_grads_[j] = at::Tensor();  // each gradient freed once it is in the buffer
    off += p.partition_size;
    r.params.push_back(bucket_[j]);
  }
  r.buffer = r.buffer.view({-1});
  r.buffer.div_(static_cast<double>(dp));
  bucket_.clear();
  bucket_grads_.clear();
  bucket_numel_ = 0;
  return r;
}

void GradientReducer::StartReduce(Reducing& r) {
  const int64_t total = r.buffer.numel() / dp();
  if (dp() == 1) {
    r.mine = r.buffer;
    return;
  }
  r.mine = at::empty({total}, r.buffer.options());
  r.work = comm_.StartReduceScatterSum(r.buffer, r.mine);
}

// Waits for the collective, then adds this rank's chunk into the sub-groups'
// gradient partitions.
void GradientReducer::FinishReduce(Reducing& r) {
  c10::NoGradGuard no_grad;
  if (r.work) r.work->Wait();
  AddToPartitions(r);
  r = Reducing();
}

// Piece by piece (host_staging_elements), each piece added into the
// partitions of the parameters it overlaps; under offload from a device each
// piece goes through the pinned staging buffer first.
void GradientReducer::AddToPartitions(const Reducing& r) {
  const at::Tensor& mine = r.mine;
  const bool staged = s_.base.offload_optimizer_cpu && !mine.device().is_cpu();
  const int64_t step = std::max<int64_t>(1, s_.host_staging_elements);
  size_t k = 0;
  int64_t start = 0;  // of parameter r.params[k] in `mine`
  for (int64_t c0 = 0; c0 < mine.numel(); c0 += step) {
    const int64_t c1 = std::min(mine.numel(), c0 + step);
    const at::Tensor piece = staged ? ToHostStaging(mine.narrow(0, c0, c1 - c0)) : mine.narrow(0, c0, c1 - c0);
    for (; k < r.params.size(); ++k) {
      const Zero3Param& p = params_[r.params[k]];
      const int64_t end = start + p.partition_size;
      const int64_t a = std::max(start, c0), b = std::min(end, c1);
      if (b > a)
        subs_[p.sub_group].Grad().narrow(0, p.offset + (a - start), b - a).add_(piece.narrow(0, a - c0, b - a));
      if (end > c1) break;  // goes on in the next piece
      start = end;
    }
  }
}

void GradientReducer::FinishReduces(size_t keep) {
  while (reducing_.size() > keep) {
    FinishReduce(reducing_.front());
    reducing_.pop_front();
  }
}

// The reduced chunk in host memory through one reused pinned buffer (fresh
// pageable memory for every bucket would cost a page fault per 4 KiB).
at::Tensor GradientReducer::ToHostStaging(const at::Tensor& t) {
  if (!host_staging_.defined() || host_staging_.numel() < t.numel())
    host_staging_ = PinnedHostZeros({t.numel()}, t.scalar_type());
  at::Tensor out = host_staging_.narrow(0, 0, t.numel());
  out.copy_(t);  // synchronous: the host adds read it next
  return out;
}

}  // namespace uckpt::engine
