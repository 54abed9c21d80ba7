// The keys of the universal layout (zero/<param>/<key>.pt) and of the
// optimizer states that DeepSpeed's rank files and torch's optimizer hold
// per parameter: the one place they are spelled.
#pragma once

namespace uckpt::ckpt {

// The fp32 master copy of a parameter (zero/<param>/fp32.pt).
inline constexpr const char* kFp32 = "fp32";
// The optimizer's step, a scalar (zero/<param>/step.pt; 'step' of torch's state).
inline constexpr const char* kStep = "step";
// Adam's moments, torch's keys, as DeepSpeed and the universal folders name them.
inline constexpr const char* kExpAvg = "exp_avg";
inline constexpr const char* kExpAvgSq = "exp_avg_sq";
// The tensor of a universal state file that holds a dict ({'param': tensor}).
inline constexpr const char* kUniversalParam = "param";

}  // namespace uckpt::ckpt
