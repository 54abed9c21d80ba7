// Helpers for the refrun-gpt2 fixture (shared/fixtures/refrun-gpt2).
#pragma once

#include <nlohmann/json.hpp>

#include <fstream>
#include <string>

#include "train/gpt2.h"

namespace uckpt::train::testing {

inline std::string RefrunDir() { return std::string(UCKPT_SHARED) + "/fixtures/refrun-gpt2"; }

inline nlohmann::json ReadJson(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot open " + path);
  return nlohmann::json::parse(in);
}

// The fixture's model: V=97, P=16, C=16, L=2, H=2.
inline Gpt2Config RefrunModel() {
  Gpt2Config c;
  c.vocab_size = 97;
  c.n_positions = 16;
  c.n_embd = 16;
  c.n_layer = 2;
  c.n_head = 2;
  return c;
}

}  // namespace uckpt::train::testing
