// uckpt::Engine's statistics calls (include/uckpt/engine.h): what tools such
// as `uckpt train` report, read from the engine's state.
#include "engine/engine_impl.h"

namespace uckpt {

Stage3Stats Engine::stage3_stats() const { return impl_->runtime->stats(); }

void Engine::SetTiming(bool on) {
  impl_->runtime->set_timing(on);
}

}  // namespace uckpt
