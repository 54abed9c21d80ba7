// uckpt::Engine's statistics calls (include/uckpt/engine.h): what tools such
// as `uckpt train` report, read from the engine's state.
#include "engine/engine_impl.h"

namespace uckpt {

Stage3Stats Engine::stage3_stats() const {
  Stage3Stats out;
  const engine::Zero3Stats s = impl_->runtime->stats();
  out.gathered_elements = s.gathered_elements;
  out.peak_gathered_elements = s.peak_gathered_elements;
  out.unit_gathers = s.unit_gathers;
  out.prefetched_gathers = s.prefetched_gathers;
  out.unused_prefetches = s.unused_prefetches;
  out.reduce_buckets = s.reduce_buckets;
  out.overlapped_buckets = s.overlapped_buckets;
  out.reduce_wait_s = s.reduce_tail_s;
  return out;
}

void Engine::SetTiming(bool on) {
  impl_->runtime->set_timing(on);
}

}  // namespace uckpt
