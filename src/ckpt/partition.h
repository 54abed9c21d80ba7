// ZeRO partition math: how a parameter group is flattened, aligned, padded and
// split over data-parallel ranks (DeepSpeed's layout, see
// shared/spec/deepspeed-zero-checkpoint.md §5-6). Pure arithmetic, no I/O:
// the converter uses it to validate checkpoints and the training engine uses
// it to load a universal checkpoint at any world size.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace uckpt::ckpt {

// ---- ZeRO stage 1/2 (and BF16_Optimizer): one flat buffer per group. ----

// The flat buffer of one parameter group at data-parallel size `dp`.
struct FlatLayout {
  int64_t numel = 0;           // N: sum of the group's parameter numels
  int dp = 1;                  // ranks the group is partitioned over
  int64_t padded_numel = 0;    // Npad = ceil(N / (2*dp)) * 2*dp; zeros at the end
  int64_t partition_size = 0;  // P = Npad / dp, what every rank owns

  int64_t alignment() const { return 2 * int64_t{dp}; }
  // Flat positions [begin, end) owned by `rank`.
  int64_t begin(int rank) const { return rank * partition_size; }
  int64_t end(int rank) const { return (rank + 1) * partition_size; }
  // Padding positions (>= N) inside rank's partition:
  // clamp((r+1)*P - N, 0, P), correct for every rank (DeepSpeed >= 0.16.4).
  int64_t padding(int rank) const;
  // What DeepSpeed <= 0.16.3 and BF16_Optimizer record as group_paddings:
  // Npad - N on the last rank, 0 elsewhere.
  int64_t legacy_padding(int rank) const;
  // Real (non-padding) elements in rank's partition: P - padding(rank).
  int64_t real_numel(int rank) const { return partition_size - padding(rank); }
};

// Throws std::invalid_argument if dp < 1 or numel < 0.
FlatLayout MakeFlatLayout(int64_t numel, int dp);

// A piece of one parameter that lies inside one rank's partition.
struct Fragment {
  size_t param = 0;  // index into the group's parameter list
  int rank = 0;
  int64_t param_offset = 0;      // first element, in the flattened parameter ("lp" start)
  int64_t partition_offset = 0;  // where it sits in the rank's partition ("hp" start)
  int64_t numel = 0;
};

// The fragments of `rank`'s partition, in flat order: exactly the entries of
// DeepSpeed's param_slice_mappings (name -> {start = partition_offset, numel}).
// `numels` are the group's parameter sizes in flat-buffer order.
std::vector<Fragment> RankFragments(std::span<const int64_t> numels, int dp, int rank);

// The fragments of parameter `param` over all ranks, in rank order (their
// concatenation is the whole flattened parameter). Zero-size parameters have none.
std::vector<Fragment> ParamFragments(std::span<const int64_t> numels, int dp, size_t param);

// Start of each parameter in the flat buffer (prefix sums of `numels`).
std::vector<int64_t> FlatOffsets(std::span<const int64_t> numels);

// Gradient buckets of a flat buffer in reverse parameter order (the order
// backward produces gradients): whole parameters from the last one
// backwards, a new bucket once the current one holds >= bucket_numel
// elements. Each bucket is one contiguous range of the flat buffer.
struct ReverseBuckets {
  struct Bucket {
    int64_t begin = 0, numel = 0;  // range of the flat buffer
    int params = 0;                // parameters in it
  };
  std::vector<Bucket> buckets;    // buckets[0] holds the last parameters
  std::vector<size_t> bucket_of;  // per parameter: its bucket
};
ReverseBuckets PlanReverseBuckets(std::span<const int64_t> numels, int64_t bucket_numel);

// ---- ZeRO stage 3: every parameter partitioned on its own. ----

// Elements of one parameter on every rank: ceil(numel / dp) (0 for numel 0).
int64_t Stage3PartitionSize(int64_t numel, int dp);
// Real elements of the parameter on `rank`: clamp(numel - rank*ps, 0, ps).
// (DeepSpeed's converter uses min(ps, |numel - rank*ps|), which leaks padding
// when numel < (dp-1)*ps; this is the corrected amount.)
int64_t Stage3RealNumel(int64_t numel, int dp, int rank);

// Splits a parameter group into stage-3 sub-groups: walks the per-rank
// partition sizes, closing a sub-group when its sum reaches `sub_group_size`
// or at the last parameter. Returns the number of parameters in each sub-group.
std::vector<size_t> Stage3SubGroups(std::span<const int64_t> numels, int dp, int64_t sub_group_size);

}  // namespace uckpt::ckpt
