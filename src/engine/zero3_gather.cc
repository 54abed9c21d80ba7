// Stage 3's parameter storage (engine/zero3_unit.h): a parameter's bytes
// allocated and filled by an all-gather while it is held, freed when not.
#include <c10/core/DeviceGuard.h>
#include <c10/core/GradMode.h>
#include <c10/core/StorageImpl.h>

#include <algorithm>
#include <stdexcept>

#include "engine/zero3_runtime.h"
#include "engine/zero3_unit.h"

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

at::Tensor StoragelessTensor(at::IntArrayRef shape, const at::TensorOptions& options) {
  at::Tensor t = at::empty({0}, options);
  FreeStorage(t);
  t.unsafeGetTensorImpl()->set_sizes_contiguous(shape);
  return t;
}

namespace {
// GatheredParameters' exit as DeepSpeed's release (`param.data = torch.empty(0)`): a tensor that still shares
// the parameter's bytes (`v.data.cpu()` on the CPU, kept past the block, as DeepSpeed-Chat's
// save_zero_three_model does) keeps them; the parameter gets a storage of its own, the one freed and gathered
// into from now on. Not done in the module hooks, whose saved views must see the bytes again.
void KeepBytesForOtherUsers(at::Tensor& t) {
  if (t.storage().use_count() <= 1) return;
  t.set_data(StoragelessTensor(t.sizes(), t.options()));  // freed by Unhold; the old storage stays with its users
}
}  // namespace

void ParamStorage::TrackWhole(size_t i) { gathered_elements_ += params_[i].numel; }

void ParamStorage::StartSharded(size_t i) {
  Zero3Param& p = params_[i];
  if (p.live > 0) FreeStorage(p.tensor);
  p.live = 0;
}

bool ParamStorage::Hold(size_t i) {
  Zero3Param& p = params_[i];
  if (p.live++ > 0) return false;
  if (p.unit >= 0 && !p.persistent) {
    gathered_elements_ += p.numel;
    peak_gathered_elements_ = std::max(peak_gathered_elements_, gathered_elements_);
  }
  return true;
}

void ParamStorage::Unhold(size_t i) {
  Zero3Param& p = params_[i];
  if (--p.live > 0) return;
  FreeStorage(p.tensor);
  if (p.unit >= 0 && !p.persistent) gathered_elements_ -= p.numel;
}

bool ParamStorage::IsWhole(size_t i) const { return params_[i].live > 0; }

// Each partition is copied into one buffer on the model's device (from pinned
// host memory under offload_param: asynchronous copies, no host-side
// concatenation into fresh pages) and the all-gather started. The buffers live
// in the Pending until Finish, after the collective's Wait.
ParamStorage::Pending ParamStorage::Start(const std::vector<size_t>& list) {
  Pending g;
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

void ParamStorage::Finish(Pending& g) {
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

void ParamStorage::Cancel(Pending& g) {
  if (g.work) g.work->Wait();
  g = Pending();
}

void ParamStorage::RefetchWhole() {
  std::vector<size_t> whole;
  for (size_t i = 0; i < params_.size(); ++i)
    if (params_[i].live > 0) whole.push_back(i);
  Fetch(whole);
}

void ParamStorage::GatherSome(const std::vector<size_t>& ps) {
  std::vector<size_t> need;
  for (size_t i : ps)
    if (Hold(i)) need.push_back(i);
  Fetch(need);
}

void ParamStorage::ReleaseSome(const std::vector<size_t>& ps, int modifier_rank) {
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
    if (params_[i].live == 1) KeepBytesForOtherUsers(params_[i].tensor);
    Unhold(i);
    if (params_[i].live > 0 && modifier_rank < 0) still_whole.push_back(i);
  }
  Fetch(still_whole);
}

}  // namespace uckpt::engine
