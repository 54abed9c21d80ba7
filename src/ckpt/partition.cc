#include "ckpt/partition.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace uckpt::ckpt {

namespace {

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

void CheckDp(int dp) {
  if (dp < 1) throw std::invalid_argument("data-parallel size must be >= 1, got " + std::to_string(dp));
}

}  // namespace

int64_t FlatLayout::padding(int rank) const { return std::clamp(end(rank) - numel, int64_t{0}, partition_size); }

int64_t FlatLayout::legacy_padding(int rank) const { return rank == dp - 1 ? padded_numel - numel : 0; }

FlatLayout MakeFlatLayout(int64_t numel, int dp) {
  CheckDp(dp);
  if (numel < 0) throw std::invalid_argument("negative element count " + std::to_string(numel));
  FlatLayout l;
  l.numel = numel;
  l.dp = dp;
  l.padded_numel = CeilDiv(numel, l.alignment()) * l.alignment();
  l.partition_size = l.padded_numel / dp;
  return l;
}

std::vector<int64_t> FlatOffsets(std::span<const int64_t> numels) {
  std::vector<int64_t> offsets(numels.size());
  int64_t at = 0;
  for (size_t i = 0; i < numels.size(); ++i) {
    offsets[i] = at;
    at += numels[i];
  }
  return offsets;
}

ReverseBuckets PlanReverseBuckets(std::span<const int64_t> numels, int64_t bucket_numel) {
  const std::vector<int64_t> offsets = FlatOffsets(numels);
  ReverseBuckets plan;
  plan.bucket_of.resize(numels.size());
  for (size_t j = numels.size(); j-- > 0;) {
    if (plan.buckets.empty() || plan.buckets.back().numel >= bucket_numel) plan.buckets.emplace_back();
    ReverseBuckets::Bucket& b = plan.buckets.back();
    b.begin = offsets[j];  // moves down as parameters join
    b.numel += numels[j];
    ++b.params;
    plan.bucket_of[j] = plan.buckets.size() - 1;
  }
  return plan;
}

namespace {

// The part of parameter i (flat range [start, start+n)) inside rank's range, if any.
bool Overlap(const FlatLayout& l, size_t i, int64_t start, int64_t n, int rank, Fragment* f) {
  int64_t lo = std::max(start, l.begin(rank));
  int64_t hi = std::min(start + n, l.end(rank));
  if (lo >= hi) return false;
  *f = Fragment{i, rank, lo - start, lo - l.begin(rank), hi - lo};
  return true;
}

int64_t Sum(std::span<const int64_t> numels) {
  int64_t n = 0;
  for (int64_t x : numels) {
    if (x < 0) throw std::invalid_argument("negative parameter size " + std::to_string(x));
    n += x;
  }
  return n;
}

}  // namespace

std::vector<Fragment> RankFragments(std::span<const int64_t> numels, int dp, int rank) {
  FlatLayout l = MakeFlatLayout(Sum(numels), dp);
  std::vector<Fragment> out;
  int64_t start = 0;
  for (size_t i = 0; i < numels.size(); ++i) {
    Fragment f;
    if (Overlap(l, i, start, numels[i], rank, &f)) out.push_back(f);
    start += numels[i];
    if (start >= l.end(rank)) break;
  }
  return out;
}

std::vector<Fragment> ParamFragments(std::span<const int64_t> numels, int dp, size_t param) {
  FlatLayout l = MakeFlatLayout(Sum(numels), dp);
  if (param >= numels.size()) throw std::invalid_argument("parameter index out of range");
  int64_t start = 0;
  for (size_t i = 0; i < param; ++i) start += numels[i];
  std::vector<Fragment> out;
  if (numels[param] == 0) return out;
  int first = static_cast<int>(start / l.partition_size);
  for (int r = first; r < dp; ++r) {
    Fragment f;
    if (!Overlap(l, param, start, numels[param], r, &f)) break;
    out.push_back(f);
  }
  return out;
}

int64_t Stage3PartitionSize(int64_t numel, int dp) {
  CheckDp(dp);
  return CeilDiv(numel, dp);
}

int64_t Stage3RealNumel(int64_t numel, int dp, int rank) {
  int64_t ps = Stage3PartitionSize(numel, dp);
  return std::clamp(numel - rank * ps, int64_t{0}, ps);
}

std::vector<size_t> Stage3SubGroups(std::span<const int64_t> numels, int dp, int64_t sub_group_size) {
  std::vector<size_t> groups;
  int64_t total = 0;
  for (int64_t n : numels) total += Stage3PartitionSize(n, dp);
  if (numels.empty()) return groups;
  if (sub_group_size <= 0 || sub_group_size >= total) return {numels.size()};
  size_t count = 0;
  int64_t sum = 0;
  for (size_t i = 0; i < numels.size(); ++i) {
    ++count;
    sum += Stage3PartitionSize(numels[i], dp);
    if (sum >= sub_group_size || i + 1 == numels.size()) {
      groups.push_back(count);
      count = 0;
      sum = 0;
    }
  }
  return groups;
}

}  // namespace uckpt::ckpt
