// Stage 3's unit calls (engine/zero3_runtime.h): how the runtime drives its gather
// units (zero3_unit.h) and its gradient reducer (zero3_reduce.h), and the
// autograd identities that call them back in backward.
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/cuda.h>

#include <chrono>
#include <stdexcept>
#include <string>

#include "engine/zero3_runtime.h"

namespace uckpt::engine {
namespace {

// Identity in forward; its backward calls `OnBackward` for the unit. Placed
// at a unit's entry it runs once the unit's backward is done (BackwardDone);
// at its exit, before the unit's backward (BackwardGather).
template <void (Zero3Runtime::*OnBackward)(size_t)>
struct UnitBoundaryFn : public torch::autograd::Function<UnitBoundaryFn<OnBackward>> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, int64_t z3, int64_t unit) {
    ctx->saved_data["z3"] = z3;
    ctx->saved_data["unit"] = unit;
    return x;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto* z = reinterpret_cast<Zero3Runtime*>(ctx->saved_data["z3"].toInt());
    (z->*OnBackward)(static_cast<size_t>(ctx->saved_data["unit"].toInt()));
    return {grads[0], at::Tensor(), at::Tensor()};
  }
};
using EnterUnitFn = UnitBoundaryFn<&Zero3Runtime::BackwardDone>;
using ExitUnitFn = UnitBoundaryFn<&Zero3Runtime::BackwardGather>;

void CheckUnit(const char* call, size_t unit, size_t declared) {
  if (unit >= declared)
    throw std::out_of_range(std::string("uckpt::Engine::") + call + ": unit " + std::to_string(unit) + ", but " +
                            std::to_string(declared) + " gather units were declared");
}

}  // namespace

at::Tensor Zero3Runtime::EnterUnit(size_t unit, const at::Tensor& input) {
  CheckUnit("EnterUnit", unit, units_.size());
  units_.Enter(unit);
  if (!at::GradMode::is_enabled() || !input.requires_grad()) return input;
  return EnterUnitFn::apply(input, reinterpret_cast<int64_t>(this), static_cast<int64_t>(unit));
}

at::Tensor Zero3Runtime::ExitUnit(size_t unit, const at::Tensor& output) {
  CheckUnit("ExitUnit", unit, units_.size());
  units_.Exit(unit);
  if (!at::GradMode::is_enabled() || !output.requires_grad()) return output;
  return ExitUnitFn::apply(output, reinterpret_cast<int64_t>(this), static_cast<int64_t>(unit));
}

void Zero3Runtime::BackwardGather(size_t unit) { units_.BackwardGather(unit); }

// The unit's gradients go to the reducer before its parameters are freed.
void Zero3Runtime::BackwardDone(size_t unit) {
  reducer_.Add(units_.unit(unit).params());
  units_.BackwardDone(unit);
}

void Zero3Runtime::GatherAll() { units_.GatherAll(); }

void Zero3Runtime::ReleaseAll() { units_.ReleaseAll(); }

void Zero3Runtime::GatherSome(const std::vector<size_t>& ps) {
  units_.DropPrefetches();  // their holds would make the storage skip parameters whose bytes are still in flight
  storage_.GatherSome(ps);
}

void Zero3Runtime::ReleaseSome(const std::vector<size_t>& ps, int modifier_rank) {
  storage_.ReleaseSome(ps, modifier_rank);
}

void Zero3Runtime::FinishBackward() {
  if (!timing_) return FinishBackwardUntimed();
  // The time from the end of backward's compute until every bucket is reduced.
  const bool cuda = device_.is_cuda();
  if (cuda) torch::cuda::synchronize(device_.index());
  const auto t0 = std::chrono::steady_clock::now();
  FinishBackwardUntimed();
  if (cuda) torch::cuda::synchronize(device_.index());
  reduce_tail_s_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Units that backward gathered and autograd did not finish (their inputs
// needed no gradient) are done now; then the gradients not reduced yet (the
// root unit's) and the last bucket.
void Zero3Runtime::FinishBackwardUntimed() {
  units_.DropPrefetches();
  reducer_.BeginTail();
  for (size_t u = 0; u < units_.size(); ++u)
    while (units_.unit(u).backward_holds() > 0) BackwardDone(u);
  units_.EndBackward();
  reducer_.FinishTail();
}

Stage3Stats Zero3Runtime::stats() const {
  Stage3Stats s;
  s.gathered_elements = storage_.gathered_elements();
  s.peak_gathered_elements = storage_.peak_gathered_elements();
  s.unit_gathers = units_.stats().unit_gathers;
  s.prefetched_gathers = units_.stats().prefetched_gathers;
  s.unused_prefetches = units_.stats().unused_prefetches;
  s.reduce_buckets = reducer_.reduce_buckets();
  s.overlapped_buckets = reducer_.overlapped_buckets();
  s.reduce_wait_s = reduce_tail_s_;
  return s;
}

}  // namespace uckpt::engine
