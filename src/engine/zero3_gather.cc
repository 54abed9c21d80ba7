// Stage 3's gathers (engine/zero3.h): units gathered on entry and freed on
// exit, and the all-gathers of the next units started ahead of their use.
#include <c10/core/DeviceGuard.h>
#include <c10/core/GradMode.h>
#include <c10/core/StorageImpl.h>

#include <algorithm>
#include <stdexcept>

#include "engine/zero3.h"

namespace uckpt::engine {
namespace {

// A parameter's storage without its bytes (FSDP's resize_(0)): the tensor
// keeps its shape; views that autograd saved see the bytes again once
// AllocateStorage gives them back.
void FreeStorage(const at::Tensor& t) {
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  s->set_data_ptr_noswap(at::DataPtr(nullptr, t.device()));
  s->set_nbytes(0);
}

// Allocates the parameter's bytes and returns a flat tensor over them with
// its own version counter (writing it does not invalidate saved tensors).
at::Tensor AllocateStorage(const at::Tensor& t) {
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  const size_t nbytes = static_cast<size_t>(t.numel()) * t.element_size();
  if (s->nbytes() != nbytes) {
    // The caching allocator serves the thread's current device: make it the tensor's.
    const c10::DeviceGuard on(t.device());
    s->set_data_ptr_noswap(s->allocator()->allocate(nbytes));
    s->set_nbytes(nbytes);
  }
  return at::from_blob(s->data_ptr().get(), {t.numel()}, at::TensorOptions().dtype(t.scalar_type()).device(t.device()));
}

}  // namespace

bool Zero3Optimizer::Hold(size_t i) {
  Zero3Param& p = params_[i];
  if (p.live++ > 0) return false;
  if (p.unit >= 0 && !p.persistent) {
    stats_.gathered_elements += p.numel;
    stats_.peak_gathered_elements = std::max(stats_.peak_gathered_elements, stats_.gathered_elements);
  }
  return true;
}

void Zero3Optimizer::Unhold(size_t i) {
  Zero3Param& p = params_[i];
  if (--p.live > 0) return;
  FreeStorage(p.tensor);
  if (p.unit >= 0 && !p.persistent) stats_.gathered_elements -= p.numel;
}

// Each partition is copied into one buffer on the model's device (from pinned
// host memory under offload_param: asynchronous copies, no host-side
// concatenation into fresh pages) and the all-gather started. The buffers live
// in the Gathering until FinishFetch, after the collective's Wait.
Zero3Optimizer::Gathering Zero3Optimizer::StartFetch(const std::vector<size_t>& list) {
  Gathering g;
  g.params = list;
  if (list.empty()) return g;
  c10::NoGradGuard no_grad;
  for (size_t i : list) g.total += params_[i].partition_size;
  at::Tensor in = at::empty({g.total}, params_[list[0]].partition.options().device(device_).pinned_memory(false));
  int64_t at_ = 0;
  for (size_t i : list) {
    in.narrow(0, at_, params_[i].partition_size).copy_(params_[i].partition, /*non_blocking=*/true);
    at_ += params_[i].partition_size;
  }
  g.all = in;
  if (dp() > 1) {
    g.all = at::empty({g.total * dp()}, in.options());
    g.work = comm_.StartAllGather(in, g.all);
  }
  return g;
}

void Zero3Optimizer::FinishFetch(Gathering& g) {
  if (g.params.empty()) return;
  c10::NoGradGuard no_grad;
  if (g.work) g.work->Wait();
  at::Tensor by_rank = g.all.view({dp(), g.total});
  int64_t off = 0;
  for (size_t i : g.params) {
    const Zero3Param& p = params_[i];
    CopyRankColumn(AllocateStorage(p.tensor), by_rank.narrow(1, off, p.partition_size), p.numel, false);
    off += p.partition_size;
  }
  g.all = at::Tensor();
  g.work.reset();
}

void Zero3Optimizer::Gather(size_t unit) {
  if (std::optional<Gathering>& pf = prefetched_.at(unit)) {  // its hold becomes this gather's
    FinishFetch(*pf);
    pf.reset();
    return;
  }
  std::vector<size_t> need;
  for (size_t i : units_.at(unit))
    if (Hold(i)) need.push_back(i);
  if (!need.empty()) ++stats_.unit_gathers;
  Fetch(need);
}

void Zero3Optimizer::Release(size_t unit) {
  if (prefetched_.at(unit))
    throw std::logic_error("ZeRO-3: unit " + std::to_string(unit) + " exited before it was entered");
  for (size_t i : units_.at(unit)) {
    if (params_[i].live <= 0)
      throw std::logic_error("ZeRO-3: unit " + std::to_string(unit) + " released more often than gathered");
    Unhold(i);
  }
}

void Zero3Optimizer::GatherAll() {
  for (size_t u = 0; u < units_.size(); ++u) Gather(u);
}

void Zero3Optimizer::ReleaseAll() {
  DropPrefetches();
  for (size_t u = 0; u < units_.size(); ++u) Release(u);
}

void Zero3Optimizer::GatherSome(const std::vector<size_t>& ps) {
  DropPrefetches();  // their holds would make Hold() skip parameters whose bytes are still in flight
  std::vector<size_t> need;
  for (size_t i : ps)
    if (Hold(i)) need.push_back(i);
  Fetch(need);
}

void Zero3Optimizer::ReleaseSome(const std::vector<size_t>& ps, int modifier_rank) {
  for (size_t i : ps)
    if (params_.at(i).live <= 0) throw std::logic_error("ZeRO-3: " + params_[i].name + " released but not gathered");
  if (modifier_rank >= 0) {
    if (modifier_rank >= dp())
      throw std::invalid_argument("GatheredParameters: modifier_rank " + std::to_string(modifier_rank) +
                                  " is not a rank (world size " + std::to_string(dp()) + ")");
    c10::NoGradGuard no_grad;
    for (size_t i : ps) {
      Zero3Param& p = params_[i];
      at::Tensor whole = AllocateStorage(p.tensor);  // already allocated: the flat view of its bytes
      if (dp() > 1) comm_.Broadcast(whole, modifier_rank);
      p.partition.copy_(RankSlot(whole, dp(), comm_.rank()));
    }
  }
  std::vector<size_t> still_whole;
  for (size_t i : ps) {
    Unhold(i);
    if (params_[i].live > 0 && modifier_rank < 0) still_whole.push_back(i);
  }
  Fetch(still_whole);
}

bool Zero3Optimizer::UnitGathered(size_t unit) const {
  for (size_t i : units_[unit])
    if (params_[i].live > 0) return true;
  return false;
}

// Walks from `unit` in `direction`, prefetching units not gathered yet until
// stage3_prefetch_bucket_size elements are ahead (at least one unit when it is
// positive) or the next unit would take the gathered elements past
// stage3_max_live_parameters. Only unit calls and sizes decide: the same on
// every rank. One rank has no collective to overlap: the copies would run on
// the compute stream anyway, and prefetched buffers would only cost memory.
void Zero3Optimizer::Prefetch(size_t unit, int direction) {
  if (s_.prefetch_bucket_size <= 0 || dp() == 1) return;
  int64_t ahead = 0;
  for (int64_t v = static_cast<int64_t>(unit) + direction; v >= 0 && v < num_units(); v += direction) {
    const size_t u = static_cast<size_t>(v);
    if (prefetched_[u]) {
      ahead += unit_numel_[u];
      continue;
    }
    if (units_[u].empty() || UnitGathered(u)) continue;
    if (ahead >= s_.prefetch_bucket_size) return;
    if (stats_.gathered_elements + unit_numel_[u] > s_.max_live_parameters) return;
    StartPrefetch(u);
    ahead += unit_numel_[u];
  }
}

void Zero3Optimizer::StartPrefetch(size_t unit) {
  for (size_t i : units_[unit]) Hold(i);
  prefetched_[unit] = StartFetch(units_[unit]);
  ++stats_.unit_gathers;
  ++stats_.prefetched_gathers;
}

// The collectives finish before their buffers are dropped (Wait); the
// parameters' storage was never allocated for them.
void Zero3Optimizer::DropPrefetches() {
  for (size_t u = 0; u < prefetched_.size(); ++u) {
    std::optional<Gathering>& pf = prefetched_[u];
    if (!pf) continue;
    if (pf->work) pf->work->Wait();
    pf.reset();
    for (size_t i : units_[u]) Unhold(i);
    ++stats_.unused_prefetches;
  }
}

}  // namespace uckpt::engine
