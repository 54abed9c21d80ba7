// The config's rules that weigh several sections against each other
// (config.h): gradient scaling, and the gradient accumulation dtype.
#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "engine/config.h"

namespace uckpt::engine {

// prescale_gradients and gradient_predivide_factor as DeepSpeed 0.14.5 takes them: honoured at stage 0 (its
// engine's allreduce); at stages 1-2 its reduce_scatter averaging (the default) ignores them, and its averaging
// without reduce_scatter, which uses them, is not uckpt's; at stage 3 with reduce_scatter it refuses them.
void CheckGradientScaling(TrainConfig& c, const std::string& source) {
  const bool given = c.prescale_gradients || c.gradient_predivide_factor != 1.0;
  if (!(c.gradient_predivide_factor > 0))
    throw ConfigError(source + ": gradient_predivide_factor must be > 0 (DeepSpeed divides the gradients by it)");
  if (!given || c.zero.stage == 0) return;
  const std::string what = c.prescale_gradients ? "prescale_gradients = true" : "gradient_predivide_factor != 1.0";
  if (c.zero.stage == 3 && c.zero.reduce_scatter)
    throw ConfigError(source + ": " + what +
                      " at ZeRO stage 3 with reduce_scatter (the default) is refused, as "
                      "DeepSpeed 0.14.5 asserts it is not supported there");
  if (!c.zero.reduce_scatter)
    throw ConfigError(source + ": " + what +
                      " with zero_optimization.reduce_scatter = false is not supported by "
                      "uckpt (its ZeRO " +
                      std::to_string(c.zero.stage) +
                      " averages gradients as DeepSpeed's "
                      "reduce_scatter does, which ignores it; set reduce_scatter to true)");
  c.warnings.push_back(source + ": " + what + " changes nothing at ZeRO stage " + std::to_string(c.zero.stage) +
                       " with reduce_scatter (DeepSpeed 0.14.5 ignores it there too)");
}

std::string GradAccumDtypeName(const std::string& given) {
  // DeepSpeed 0.14.5's DtypeEnum spellings (runtime/config.py).
  static const std::vector<std::pair<std::string, std::vector<std::string>>> kSpellings = {
      {"fp16", {"torch.float16", "fp16", "float16", "half"}},
      {"fp32", {"torch.float32", "fp32", "float32", "float"}},
      {"bf16", {"torch.bfloat16", "bf16", "bfloat16"}},
      {"int8", {"torch.int8", "int8"}}};
  for (const auto& [name, spellings] : kSpellings)
    if (std::find(spellings.begin(), spellings.end(), given) != spellings.end()) return name;
  throw ConfigError("'data_types.grad_accum_dtype' = \"" + given +
                    "\" is not a dtype DeepSpeed 0.14.5 knows (\"fp32\", \"fp16\" or \"bf16\")");
}

namespace {

std::string ModelDtypeName(const TrainConfig& c) { return c.bf16 ? "bf16" : c.fp16.enabled ? "fp16" : "fp32"; }

}  // namespace

// DeepSpeed 0.14.5's engine.get_data_types: fp32 for bf16 without ZeRO (its BF16_Optimizer), else the model's.
std::string EffectiveGradAccumDtype(const TrainConfig& c) {
  if (!c.grad_accum_dtype.empty()) return c.grad_accum_dtype;
  return c.zero.stage == 0 && c.bf16 ? "fp32" : ModelDtypeName(c);
}

// What DeepSpeed 0.14.5 does with each value (docs/engine.md, "Gradient accumulation"): uckpt does the same, or
// refuses naming the key, the value, the stage and why.
void CheckGradAccumDtype(const TrainConfig& c, const std::string& source) {
  if (c.grad_accum_dtype.empty()) return;
  const std::string model = ModelDtypeName(c), given = c.grad_accum_dtype;
  const int stage = c.zero.stage;
  TrainConfig unset = c;
  unset.grad_accum_dtype.clear();
  const std::string fallback = EffectiveGradAccumDtype(unset);
  if (given == fallback) return;
  std::string why;
  if (stage == 0) {
    why = model == "bf16" && given == "bf16"
              ? "DeepSpeed 0.14.5 raises NotImplementedError (its BF16 wrapper must accumulate in fp32; bf16 "
                "accumulation needs ZeRO)"
              : "DeepSpeed 0.14.5 raises NotImplementedError (an unsupported mix of model dtype and gradient "
                "accumulation type)";
  } else if (given == "int8") {
    why = "uckpt accumulates gradients in a floating-point dtype only";
  } else if (stage == 1 && model == "bf16" && given == "fp32" && !c.zero.offload_optimizer_cpu) {
    why = "DeepSpeed 0.14.5 runs its BF16_Optimizer there, which uckpt does not implement";
  } else if (stage == 1) {
    why =
        "DeepSpeed 0.14.5's ZeRO-1 then steps each rank's partition on that rank's unreduced gradient (its "
        "reduced bucket is never copied back into the separate accumulation)";
  } else if (model != "fp32" && given == "fp32") {
    return;  // stage 2: DeepSpeed sums in the model dtype all the same; stage 3: fp32 sums, honoured
  } else {
    why = model == "fp32" ? "uckpt sums an fp32 model's gradients in fp32 only"
                          : "uckpt sums a " + model + " model's gradients in " + model + " or fp32 only";
  }
  const std::string article = model == "bf16" ? "a " : "an ";
  throw ConfigError(source + ": 'data_types.grad_accum_dtype' = \"" + given + "\" with " + article + model +
                    " model at ZeRO stage " + std::to_string(stage) + " is refused: " + why +
                    "; leave it out (DeepSpeed's default there is \"" + fallback + "\")");
}

}  // namespace uckpt::engine
