// The shared files of a universal folder made from an opened ZeRO checkpoint
// (zero_checkpoint.h): the optimizer state beside the parameters' folders, and
// stage 0's model states.
#include "ckpt/zero_checkpoint.h"

#include "ckpt/deepspeed_state.h"
#include "ckpt/fp16_optimizer_state.h"
#include "ckpt/values.h"

namespace uckpt::ckpt {

ValuePtr Stage0UniversalModelStates(const ZeroCheckpoint& ckpt) {
  ParamShapes groups;
  for (const ParamPlan& p : ckpt.params) {
    if (p.group >= groups.size()) groups.resize(p.group + 1);
    groups[p.group].push_back({p.name, p.shape});
  }
  ValuePtr out = Value::Dict();
  for (const auto& [k, v] : ckpt.model.root->entries) out->entries.emplace_back(k, v);
  out->set("param_shapes", ParamShapesValue(groups));
  out->set("optimizer", Value::None());
  return out;
}

ValuePtr UniversalOptimizerState(const ZeroCheckpoint& ckpt) {
  if (ckpt.stage == 0) {  // the torch optimizer's param groups (an fp16/bf16 wrapper's: its optimizer's)
    ValuePtr opt = Need(ckpt.model.root, "optimizer", ckpt.model.file->path());
    if (IsFp16OptimizerState(opt)) opt = Need(opt, "optimizer_state_dict", ckpt.model.file->path() + ": optimizer");
    ValuePtr out = Value::Dict();
    out->set("param_groups", Need(opt, "param_groups", ckpt.model.file->path() + ": optimizer"));
    return out;
  }
  return UniversalOptimizerStateValue(ckpt.optim[0].root, ckpt.optim[0].file->path(), ckpt.stage, ckpt.layouts.size(),
                                      ckpt.dp);
}

}  // namespace uckpt::ckpt
