// uckpt::Engine's statistics calls (include/uckpt/engine.h): what tools such
// as `uckpt train` report, read from the engine's state; and its weights
// calls, forwarded to weights_io.h.
#include <stdexcept>

#include "engine/engine_impl.h"
#include "engine/weights_io.h"

namespace uckpt {

Stage3Stats Engine::stage3_stats() const { return impl_->runtime->stats(); }

void Engine::SetTiming(bool on) {
  impl_->runtime->set_timing(on);
}

LoadWeightsResult Engine::LoadWeights(const std::string& path, const LoadWeightsOptions& options) {
  WaitForUpdate();
  Impl& e = *impl_;
  if (e.backward_pending)
    throw std::logic_error("LoadWeights: called between Backward and Step; load weights between optimizer steps");
  return engine::LoadWeights(e, *e.runtime, *e.comm, path, options);
}

bool Engine::zero_gather_16bit_weights_on_model_save() const {
  return impl_->config.zero.gather_16bit_weights_on_model_save;
}

bool Engine::Save16bitModel(const std::string& save_dir, const std::string& save_filename,
                            bool exclude_frozen_parameters) {
  WaitForUpdate();
  Impl& e = *impl_;
  return engine::Save16bitModel(e, *e.runtime, *e.comm, e.stage(), e.config.zero.gather_16bit_weights_on_model_save,
                                save_dir, save_filename, exclude_frozen_parameters);
}

std::vector<std::pair<std::string, at::Tensor>> Engine::Zero3Consolidated16bitStateDict(bool exclude_frozen_parameters) {
  Impl& e = *impl_;
  if (e.stage() != 3) throw std::invalid_argument("this function requires ZeRO-3 mode");
  return engine::Consolidated16bitStateDict(e, *e.runtime, *e.comm, exclude_frozen_parameters);
}

}  // namespace uckpt
