// Which parameter each optimizer state id of a ZeRO stage-0 file is, when the
// file does not say (DeepSpeed's: torch numbers the ids 0..N-1 over the param
// groups in order and records no names; uckpt's own files record them).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace uckpt::ckpt {

struct ModelStatesView;

// The names in id order, found by shape: each state id is given the module's
// parameter of its shape, in module order, when that is the only reading the
// file allows: every parameter shape an optimizer state has is the shape of
// states of one param group only, and of as many states as the module has
// parameters of that shape (so each group lists its parameters in module
// order, as `[p for n, p in model.named_parameters() if ...]` gives). Module
// parameters of a shape no state has are frozen (no state). `module` is the
// module's parameters (no buffers, no tied aliases) in state_dict order with
// their shapes; `group_shapes[g]` the shape of each state id of group g in id
// order (the ids being 0..N-1 over the groups, which the caller checks).
// FormatError naming `path`, the shape and the groups when the shapes leave
// more than one reading (a shape in two groups, frozen and trainable
// parameters of one shape, tied parameters).
std::vector<std::string> Stage0NamesByShape(const std::vector<std::pair<std::string, std::vector<int64_t>>>& module,
                                            const std::vector<std::vector<std::vector<int64_t>>>& group_shapes,
                                            const std::string& path);

// The same for a file's view: the shapes of the ids are those of their
// per-element states (fp32), or of FP16_UnfusedOptimizer's fp32 masters
// (fp16/bf16). `ids` are the param groups' 'params'. FormatError when an id
// has no state of the parameter's shape, when the ids are not 0..N-1 in
// group order, and for FP16_Optimizer's flat masters (no shape per parameter).
std::vector<std::string> Stage0NamesOfFile(const ModelStatesView& v,
                                           const std::vector<std::pair<std::string, std::vector<int64_t>>>& module,
                                           const std::vector<std::vector<int64_t>>& ids, const std::string& path);

}  // namespace uckpt::ckpt
