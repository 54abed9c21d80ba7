// uckpt::ZeroInit (uckpt/zero_init.h): a model built unit by unit, each unit
// partitioned as it is built; the partitions reach the engine through
// EngineOptions::partitioned, as zero.Init's do from Python.
#include "uckpt/zero_init.h"

#include <c10/core/GradMode.h>

#include <stdexcept>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include "engine/engine_impl.h"
#include "engine/zero3_runtime.h"
#include "engine/zero3_unit.h"

namespace uckpt {
namespace {

thread_local ZeroInit* current_scope = nullptr;

// glibc keeps freed heap memory in its free lists, so a model of many
// mid-size parameters would grow to its whole size while being built: hand
// it back once every few MiB freed (as Python's zero.Init does).
constexpr int64_t kTrimEvery = int64_t{4} << 20;

void ReturnFreedMemory() {
#if defined(__GLIBC__)
  malloc_trim(0);
#endif
}

}  // namespace

ZeroInit::ZeroInit(const Config& config, const EngineOptions& options) {
  if (current_scope)
    throw std::logic_error("uckpt::ZeroInit: this thread is already inside a ZeroInit scope (one at a time)");
  const engine::TrainConfig c = engine::ParseConfig(config.json, config.source);
  if (c.zero.stage != 3)
    throw std::invalid_argument("uckpt::ZeroInit: building a model partitioned needs ZeRO stage 3; " + config.source +
                                " has zero_optimization.stage " + std::to_string(c.zero.stage) +
                                " (build the model whole, without ZeroInit, for stages 0-2)");
  dtype_ = engine::ModelDtype(c);
  comm_ = options.comm;
  if (!comm_) {
    comm_ = engine::CommFromEnvironment(c, options.device == "cuda");
    made_comm_ = true;
  }
  current_scope = this;
}

ZeroInit::~ZeroInit() {
  if (current_scope == this) current_scope = nullptr;
}

ZeroInit* ZeroInit::Current() { return current_scope; }

void ZeroInit::Partition(torch::nn::Module& module) {
  if (handed_over_)
    throw std::logic_error("uckpt::ZeroInit: Partition after AddTo (the partitions went to the engine already)");
  const int dp = comm_->world_size(), rank = comm_->rank();
  c10::NoGradGuard no_grad;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    const at::Tensor& p = item.value();
    if (seen_.count(p.unsafeGetTensorImpl())) continue;  // shared with a unit built before
    if (p.is_meta())
      throw std::invalid_argument("uckpt::ZeroInit: parameter " + item.key() +
                                  " is on the meta device, without values: build the unit on the CPU inside the "
                                  "scope, which partitions it");
    const int64_t bytes = p.numel() * static_cast<int64_t>(p.element_size());
    if (bytes > 0 && (!p.has_storage() || p.storage().nbytes() == 0))
      throw std::invalid_argument("uckpt::ZeroInit: parameter " + item.key() +
                                  " has no storage (partitioned already by another scope or engine)");
    at::Tensor whole = p.detach().cpu().contiguous();
    if (dp > 1) comm_->Broadcast(whole, 0);
    // Kept in the config's dtype, as zero.Init keeps it (the engine would convert it the same way).
    at::Tensor partition = engine::RankSlot(whole, dp, rank);
    if (partition.is_floating_point()) partition = partition.to(dtype_);
    whole = at::Tensor();
    partitions_.push_back({p, p.sizes().vec(), partition});
    partition_bytes_ += partition.numel() * static_cast<int64_t>(partition.element_size());
    seen_.insert(p.unsafeGetTensorImpl());
    p.set_data(engine::StoragelessTensor(p.sizes(), p.options().dtype(partition.scalar_type())));
    freed_since_trim_ += bytes;
  }
  if (freed_since_trim_ >= kTrimEvery) {
    ReturnFreedMemory();
    freed_since_trim_ = 0;
  }
}

void ZeroInit::AddTo(EngineOptions& options) {
  if (handed_over_)
    throw std::logic_error("uckpt::ZeroInit: AddTo called twice (the partitions went to the engine already)");
  handed_over_ = true;
  for (auto& p : partitions_) options.partitioned.push_back(std::move(p));
  partitions_.clear();
  partition_bytes_ = 0;
  options.comm = comm_;
  if (made_comm_) options.finish_comm = true;
}

}  // namespace uckpt
