// What uckpt's own code may do with an Engine that programs may not (not
// installed): build one from a configuration already parsed, and, for the
// engine's tests, reach its state.
#pragma once

#include <memory>
#include <utility>

#include "engine/config.h"
#include "uckpt/engine.h"

namespace uckpt::engine {

struct EngineAccess {
  // `uckpt train` and the Python package: the config parsed once by the
  // caller, overrides applied (the public constructor parses uckpt::Config).
  static std::unique_ptr<Engine> Make(std::shared_ptr<torch::nn::Module> model, const TrainConfig& config,
                                      EngineOptions options = {});
  // The engine's tests only (tests/clients_public_api.cmake keeps clients out).
  static Engine::Impl& State(Engine& e) { return *e.impl_; }
  static const Engine::Impl& State(const Engine& e) { return *e.impl_; }
};

inline std::unique_ptr<Engine> MakeEngine(std::shared_ptr<torch::nn::Module> model, const TrainConfig& config,
                                          EngineOptions options = {}) {
  return EngineAccess::Make(std::move(model), config, std::move(options));
}

}  // namespace uckpt::engine
