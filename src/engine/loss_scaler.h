// DeepSpeed's loss scalers: a static scale (1.0 for fp32/bf16) or fp16's
// dynamic scaler, which halves the scale and skips the step on overflow and
// doubles it after `window` clean steps (with hysteresis). Field names follow
// deepspeed.runtime.fp16.loss_scaler, which the checkpoint files pickle.
#pragma once

#include <algorithm>
#include <cstdint>
#include <stdexcept>

#include "ckpt/deepspeed_state.h"
#include "engine/config.h"

namespace uckpt::engine {

// The state (what checkpoints store) is ckpt's; the update rule is here.
struct LossScaler : ckpt::LossScalerState {
  // ZeRO stage 0 in fp16: the scale DeepSpeed's FP16_Optimizer / FP16_UnfusedOptimizer keep
  // themselves (ForFp16Optimizer): no hysteresis, growth scale_window steps after the step
  // following the last overflow, cur_iter counted at every step, static or dynamic.
  bool fp16_optimizer_rule = false;
  // Whether that scale, its minimum and its factor are Python ints there (its checkpoint
  // pickles them as the numbers they are: a halving makes the scale a float).
  bool integral_scale = false, integral_min_scale = false, integral_factor = false;

  // `fused`: FP16_Optimizer (DeepSpeed's FusedAdam: the config's Adam/AdamW), else FP16_UnfusedOptimizer.
  static LossScaler ForFp16Optimizer(const Fp16Config& c, bool fused) {
    LossScaler s;
    s.fp16_optimizer_rule = true;
    s.integral_factor = fused;  // 2 there, 2.0 in the unfused one
    s.delayed_shift = s.cur_hysteresis = 1;
    if (c.loss_scale != 0) {
      s.cur_scale = c.loss_scale;
      s.integral_scale = c.loss_scale_integral;
      return s;
    }
    s.dynamic = true;
    if (!c.dynamic_keys_given && !fused) {  // FP16_UnfusedOptimizer's own defaults
      s.cur_scale = 65536.0;
      s.scale_window = 1000;
      s.min_scale = 0.25;
      return s;
    }
    // The fused one without those keys starts at the config's 2**initial_scale_power (its default 16).
    s.cur_scale = static_cast<double>(int64_t{1} << c.initial_scale_power);
    s.integral_scale = true;
    s.scale_window = c.dynamic_keys_given ? c.loss_scale_window : 1000;
    s.min_scale = c.dynamic_keys_given ? c.min_loss_scale : 1.0;
    s.integral_min_scale = c.dynamic_keys_given ? c.min_loss_scale_integral : true;
    return s;
  }

  static LossScaler FromConfig(const Fp16Config& c) {
    LossScaler s;
    if (!c.enabled) return s;
    if (c.loss_scale != 0) {
      s.cur_scale = c.loss_scale;
      return s;
    }
    s.dynamic = true;
    if (!c.dynamic_keys_given) {
      // DeepSpeed 0.14.5's ZeRO optimizers build DynamicLossScaler() with its own
      // defaults when the fp16 section writes none of its keys: 2^32, no hysteresis.
      s.cur_scale = 4294967296.0;
      s.scale_window = 1000;
      s.min_scale = 1;
      s.delayed_shift = s.cur_hysteresis = 1;
      s.consecutive_hysteresis = false;
      return s;
    }
    s.cur_scale = static_cast<double>(int64_t{1} << c.initial_scale_power);
    s.scale_window = c.loss_scale_window;
    s.min_scale = c.min_loss_scale;
    s.delayed_shift = s.cur_hysteresis = c.hysteresis;
    s.consecutive_hysteresis = c.consecutive_hysteresis;
    return s;
  }

  // Called once per optimizer step, as DeepSpeed's update_scale.
  void Update(bool overflow) {
    if (fp16_optimizer_rule) return UpdateAsFp16Optimizer(overflow);
    if (!dynamic) return;
    if (overflow) {
      if (delayed_shift == 1 || cur_hysteresis == 1) {
        if (cur_scale == min_scale && raise_error_at_min_scale)
          throw std::runtime_error("fp16 loss scale already at its minimum " + std::to_string(min_scale) +
                                   " and the gradients still overflow; stopping");
        cur_scale = std::max(cur_scale / scale_factor, min_scale);
      } else {
        --cur_hysteresis;
      }
      last_overflow_iter = cur_iter;
    } else {
      if (consecutive_hysteresis) cur_hysteresis = delayed_shift;
      if ((cur_iter - last_overflow_iter) % scale_window == 0) {
        if (!consecutive_hysteresis) cur_hysteresis = delayed_shift;
        cur_scale *= scale_factor;
      }
    }
    ++cur_iter;
  }

  // FP16_Optimizer._update_scale (FP16_UnfusedOptimizer's is the same).
  void UpdateAsFp16Optimizer(bool overflow) {
    if (dynamic && overflow) {
      const double halved = cur_scale / scale_factor;  // Python's max(halved, min) keeps the first of equals
      integral_scale = min_scale > halved && integral_min_scale;
      cur_scale = std::max(halved, min_scale);
      last_overflow_iter = cur_iter;
    } else if (dynamic) {
      const int64_t stable = cur_iter - last_overflow_iter - 1;
      if (stable > 0 && stable % scale_window == 0) {
        cur_scale *= scale_factor;
        integral_scale = integral_scale && integral_factor;
      }
    }
    ++cur_iter;
  }
};

}  // namespace uckpt::engine
