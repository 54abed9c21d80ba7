// Helpers for the refrun-gpt2 fixture: shared/fixtures/refrun-gpt2's runs made again on the
// PyTorch the tests build against (UCKPT_REFRUN, tests/fixtures/make_refrun.sh).
#pragma once

#include <nlohmann/json.hpp>

#include <fstream>
#include <string>

#include "cli/trainer.h"
#include "engine/config.h"
#include "engine/engine_access.h"
#include "engine/engine_impl.h"
#include "engine/flat_runtime.h"
#include "models/gpt2.h"

namespace uckpt::engine::testing {

using cli::Trainer;
using cli::TrainOptions;

inline std::string RefrunDir() { return UCKPT_REFRUN; }

inline nlohmann::json ReadJson(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot open " + path);
  return nlohmann::json::parse(in);
}

// The fixture's model: V=97, P=16, C=16, L=2, H=2.
inline models::Gpt2Config RefrunModel() {
  models::Gpt2Config c;
  c.vocab_size = 97;
  c.n_positions = 16;
  c.n_embd = 16;
  c.n_layer = 2;
  c.n_head = 2;
  return c;
}

// The fixture's DeepSpeed config of run `run` (as passed to DeepSpeed).
inline nlohmann::json RefrunDsConfig(const std::string& run) {
  const nlohmann::json config = ReadJson(RefrunDir() + "/runs/" + run + "/config.json");
  return config.at("ds_config_as_passed");
}

// A run of the fixture's model, data rule (seed 42, 16 tokens) and init.pt,
// 12 steps, with DeepSpeed config `ds`.
inline TrainOptions RefrunOptions(const nlohmann::json& ds, const std::string& run) {
  TrainOptions o;
  o.config = ParseConfig(ds, run);
  o.model = RefrunModel();
  o.seq_len = 16;
  o.seed = 42;
  o.init_file = RefrunDir() + "/init.pt";
  o.steps = 12;
  return o;
}

// The stage 0-2 runtime behind a Trainer's engine: tests reach into the
// engine's state (engine_impl.h), `uckpt train` does not. Typed, for what
// only flat buffers have (their layout, the overlapped reducer); throws
// std::bad_cast at stage 3.
inline const FlatRuntime& ZeroOf(Trainer& t) {
  return dynamic_cast<const FlatRuntime&>(*engine::EngineAccess::State(t.engine()).runtime);
}

}  // namespace uckpt::engine::testing
