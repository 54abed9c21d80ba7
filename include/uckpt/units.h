// ZeRO-3 gather-unit calls as plain functions, for model code that should
// not depend on uckpt::Engine (Engine::unit_calls() makes them; see
// Engine::EnterUnit for the contract).
#pragma once

#include <ATen/ATen.h>

#include <cstddef>
#include <functional>

namespace uckpt {

// The engine's unit calls as plain functions, for model code that should not
// depend on uckpt::Engine (see Engine::EnterUnit). Unset: identities.
struct UnitCalls {
  std::function<at::Tensor(size_t unit, const at::Tensor& input)> enter;
  std::function<at::Tensor(size_t unit, const at::Tensor& output)> exit;
  at::Tensor Enter(size_t unit, const at::Tensor& input) const { return enter ? enter(unit, input) : input; }
  at::Tensor Exit(size_t unit, const at::Tensor& output) const { return exit ? exit(unit, output) : output; }
};

}  // namespace uckpt
