// Stage 3's gradient reduction (engine/zero3_runtime.h): gradients go into a bucket
// when their unit's backward is done; a full bucket (reduce_bucket_size
// elements) or the end of backward reduce-scatters it as DeepSpeed does
// (reduce_scatter_coalesced: per rank, each parameter's chunk, padded;
// divided by dp; summed) into the owners' fp32 gradient partitions. Under
// overlap_comm a full bucket's reduce-scatter runs while backward goes on (at
// most two in flight); buckets finish in the order they started, so every
// gradient partition sums the same values in the same order as without overlap.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <deque>
#include <memory>
#include <vector>

#include "uckpt/comm.h"

namespace uckpt::engine {

struct Zero3Param;
struct Zero3SubGroup;
struct Zero3Settings;

class GradientReducer {
 public:
  GradientReducer(Comm& comm, std::vector<Zero3Param>& params, std::vector<Zero3SubGroup>& subs,
                  const Zero3Settings& settings)
      : comm_(comm), params_(params), subs_(subs), s_(settings) {}

  // The gradients of `ps` that backward left (a unit's, when its backward is
  // done) into the bucket, reduce-scattering it first when it would overflow;
  // each parameter's .grad is taken (its memory goes with the bucket).
  void Add(const std::vector<size_t>& ps);
  // Backward's compute is over: the buckets reduced from now on are its tail
  // (not counted as overlapped).
  void BeginTail();
  // Every gradient left, the last bucket, and every reduce-scatter finished.
  void FinishTail();

  int64_t reduce_buckets() const { return reduce_buckets_; }          // reduce-scatters of buckets
  int64_t overlapped_buckets() const { return overlapped_buckets_; }  // of them, left running during backward

 private:
  // A bucket's reduce-scatter in flight.
  struct Reducing {
    std::vector<size_t> params;  // in the buffer's order
    at::Tensor buffer, mine;     // [dp * total] the averaged chunks; [total] this rank's sum
    std::unique_ptr<Comm::Pending> work;
  };

  int dp() const { return comm_.world_size(); }
  void Bucket(size_t p);
  void Flush();
  Reducing Pack();
  void StartReduce(Reducing& r);
  void FinishReduce(Reducing& r);
  void FinishReduces(size_t keep);  // all but the newest `keep`, oldest first
  void AddToPartitions(const Reducing& r);
  at::Tensor ToHostStaging(const at::Tensor& t);

  Comm& comm_;
  std::vector<Zero3Param>& params_;
  std::vector<Zero3SubGroup>& subs_;
  const Zero3Settings& s_;
  std::vector<size_t> bucket_;  // parameters whose gradients wait for the reduce-scatter
  std::vector<at::Tensor> bucket_grads_;
  int64_t bucket_numel_ = 0;
  std::deque<Reducing> reducing_;  // overlap_comm: reduce-scatters in flight, oldest first
  bool tail_ = false;              // in backward's tail (its buckets are not overlapped with backward)
  int64_t reduce_buckets_ = 0, overlapped_buckets_ = 0;
  at::Tensor host_staging_;  // offload_optimizer: pinned, for reduced gradient chunks
};

}  // namespace uckpt::engine
