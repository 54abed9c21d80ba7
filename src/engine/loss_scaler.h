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
};

}  // namespace uckpt::engine
