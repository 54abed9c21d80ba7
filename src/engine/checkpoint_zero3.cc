// Stage 3's checkpoints (DeepSpeed's ZeRO-3 layout).
#include <stdexcept>

#include "engine/engine_impl.h"

namespace uckpt::engine {

std::string SaveZero3Checkpoint(Engine::Impl&, const std::string& dir, const std::string&, const ClientState&) {
  throw std::runtime_error(dir + ": saving a ZeRO stage 3 checkpoint is not implemented yet");
}

LoadResult LoadZero3Checkpoint(Engine::Impl&, const std::string& dir, const std::string&, const LoadCheckpointOptions&) {
  throw std::runtime_error(dir + ": loading a checkpoint at ZeRO stage 3 is not implemented yet");
}

}  // namespace uckpt::engine
