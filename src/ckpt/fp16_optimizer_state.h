// ZeRO stage 0 in fp16: the state_dict() of DeepSpeed 0.14.5's FP16_Optimizer
// (runtime/fp16/fused_optimizer.py, around FusedAdam) and FP16_UnfusedOptimizer
// (unfused_optimizer.py, around any other optimizer), which DeepSpeed saves as
// mp_rank_00_model_states.pt's 'optimizer'. Both hold their loss scale
// (dynamic_loss_scale, cur_scale, cur_iter; when dynamic also
// last_overflow_iter, scale_factor, scale_window), the wrapped optimizer's own
// state_dict (optimizer_state_dict) and the fp32 masters: FP16_Optimizer one
// flat tensor per param group (fp32_groups_flat, the group's parameters one
// after another, unpadded) and clip_grad, whose wrapped optimizer numbers its
// states by group; FP16_UnfusedOptimizer a tensor per parameter (fp32_groups)
// and states numbered by parameter, as torch's.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "format/value.h"

namespace uckpt::ckpt {

struct ReadSource;
struct ModelStatesView;

// What a save writes. Numbers are values: DeepSpeed keeps the scale as the
// Python int or float it is (fp32_groups_flat and fp32_groups requires_grad).
struct Fp16OptimizerState {
  bool fused = true;
  bool dynamic = true;
  ValuePtr cur_scale, scale_factor, clip_grad;  // clip_grad: fused only
  int64_t cur_iter = 0, last_overflow_iter = -1, scale_window = 1000;
  ValuePtr optimizer_state_dict;
  std::vector<std::vector<ValuePtr>> fp32;  // per group: its flat master (fused), its parameters' (unfused)
};
ValuePtr Fp16OptimizerValue(const Fp16OptimizerState& s);

// The same read back (views into the file's tensors).
struct Fp16OptimizerView {
  bool fused = true;
  bool dynamic = true;
  double cur_scale = 1;
  bool cur_scale_integral = false;
  int64_t cur_iter = 0, last_overflow_iter = -1, scale_window = 1000;
  double scale_factor = 2;
  std::vector<std::vector<const Tensor*>> fp32;
  ValuePtr optimizer_state_dict;
};
// Whether `optimizer` (a model-states file's 'optimizer') is such a wrapper's state.
bool IsFp16OptimizerState(const ValuePtr& optimizer);
// FormatError naming `where` (the file) and the key when it is not whole.
Fp16OptimizerView ReadFp16Optimizer(const ValuePtr& optimizer, const std::string& where);

// reshard.h's ModuleReadSource for such a file: each parameter of `names`
// (trainable, the groups' order) with its fp32 master and optimizer states cut
// from the wrapper's, found by walking the parameters in the file's order
// (uckpt's recorded stage0_param_names, else `names`: DeepSpeed's file does not
// name them) through the groups' masters.
ReadSource Fp16OptimizerReadSource(const ModelStatesView& m, const std::string& path,
                                   const std::vector<std::string>& names);

}  // namespace uckpt::ckpt
