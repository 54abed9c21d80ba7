// DeepSpeed's checkpoint files as plain state: what a training engine (or a
// test writer) hands over to save a ZeRO 0/1/2 checkpoint, and the readers it
// uses to load one. The only code that knows the files' names, keys and
// classes (shared/spec/deepspeed-zero-checkpoint.md §3-6); no libtorch.
// Tensors travel as format values (ValuePtr of kind kTensor), so a caller can
// share one storage between views (a flat buffer) or stream data (zero_writer).
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "ckpt/partition.h"
#include "format/torch_file.h"
#include "format/value.h"

namespace uckpt::ckpt {

// The DeepSpeed version our files claim to come from (the fixtures').
inline constexpr const char* kDeepSpeedVersion = "0.14.5";

// File names inside a tag folder.
std::string ModelStatesFileName();                            // mp_rank_00_model_states.pt
std::string OptimStatesFileName(int dp_rank, bool bf16);      // [bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt
std::string Zero3ModelStatesFileName(int dp_rank);            // zero_pp_rank_<r>_mp_rank_00_model_states.pt (stage 3)

// The value of a JSON document (dicts keep key order, ints stay ints).
ValuePtr JsonToValue(const nlohmann::json& j);

struct NamedShape {
  std::string name;
  std::vector<int64_t> shape;
};

// One torch Adam/AdamW param group's hyper-parameters (lr is the current one).
struct AdamHparams {
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0;
};

// deepspeed.runtime.fp16.loss_scaler.{LossScaler,DynamicLossScaler} fields.
struct LossScalerState {
  bool dynamic = false;
  double cur_scale = 1.0;
  int64_t cur_iter = 0, last_overflow_iter = -1;
  double scale_factor = 2.0;
  int64_t scale_window = 1000;
  double min_scale = 1.0;
  int64_t delayed_shift = 1, cur_hysteresis = 1;
  bool consecutive_hysteresis = false, raise_error_at_min_scale = true;
};

// mp_rank_00_model_states.pt of a ZeRO 0/1/2 run.
struct ModelStates {
  int stage = 1;
  std::vector<std::pair<std::string, ValuePtr>> module;  // state_dict order, tied aliases included
  std::vector<std::string> module_prefixes;              // state_dict _metadata ("" and every submodule)
  std::vector<std::string> buffer_names;
  std::vector<std::vector<NamedShape>> param_shapes;     // trainable, per group (stage >= 1)
  std::vector<std::pair<std::string, ValuePtr>> frozen;  // frozen parameters, flattened (stage 2 records them)
  std::vector<NamedShape> frozen_shapes;
  std::vector<std::pair<std::string, std::string>> shared_params;  // alias -> owner
  ValuePtr stage0_optimizer;  // stage 0: torch's optimizer state_dict (Stage0OptimizerValue)
  std::optional<int64_t> last_batch_iteration;  // the lr scheduler's, if there is one
  int64_t global_steps = 0, global_samples = 0, skipped_steps = 0;
  int dp_world_size = 1;
  ValuePtr ds_config;
  // Keys added at the top level after DeepSpeed's: uckpt's own and the
  // client's (client_state, as DeepSpeed's state.update(client_state)).
  std::vector<std::pair<std::string, ValuePtr>> extra;
};
ValuePtr ModelStatesValue(const ModelStates& s);

// Whether `key` is one of the model-states file's own keys (DeepSpeed's or
// uckpt's); every other top-level key is client state. `iteration` and
// `universal_checkpoint_info` are the client's (DeepSpeed leaves them to it):
// uckpt writes defaults a client's value replaces, and a load returns them
// only where the saver gave them.
bool IsModelStatesKey(const std::string& key);

// Adam's per-element state of one flat partition or parameter: step (0-d),
// exp_avg, exp_avg_sq; empty before the first step.
using AdamState = std::vector<std::pair<std::string, ValuePtr>>;

// Stage 0: torch Adam's state_dict: `states[i]` of parameter i (numbered over
// all groups), `group_params[g]` the ids of group g.
ValuePtr Stage0OptimizerValue(const std::vector<AdamState>& states, const std::vector<AdamHparams>& groups,
                              const std::vector<std::vector<int64_t>>& group_params);

// One group of a rank's zero_pp_rank_<r>_mp_rank_00_optim_states.pt.
struct OptimGroupState {
  ValuePtr fp32;     // the lean fp32 partition (padding cut off)
  AdamState adam;    // of the padded partition
  AdamHparams hparams;
  int64_t padding = 0;
  std::vector<std::pair<std::string, Fragment>> mappings;  // param_slice_mappings: name -> fragment
};
struct RankOptimStates {
  int stage = 1;  // 1 or 2
  bool bf16_optimizer = false;  // BF16_Optimizer's files: no loss scaler, overflow or zero_stage
  int dp = 1;
  std::vector<OptimGroupState> groups;
  LossScalerState scaler;
  double clip_grad = 0;
  ValuePtr ds_config;
};
ValuePtr OptimStatesValue(const RankOptimStates& s);

// ---- ZeRO stage 3: every rank writes zero_pp_rank_<r>_mp_rank_00_model_states.pt
// (ModelStatesValue with stage 3: the module's parameters as empty tensors,
// param_shapes per sub-group) and its optim states below. ----

// One sub-group of a rank's stage-3 optimizer file: its flat fp32 partition
// (every parameter's ps elements, padding included) and Adam's state of it.
struct Stage3SubGroupState {
  ValuePtr fp32;
  AdamState adam;  // empty before the first step
};
struct Stage3RankOptimStates {
  int dp = 1;
  std::vector<Stage3SubGroupState> sub_groups;
  // Optimizer param groups: hyper-parameters and the sub-groups they hold.
  std::vector<std::pair<AdamHparams, std::vector<int64_t>>> param_groups;
  LossScalerState scaler;
  ValuePtr ds_config;
};
ValuePtr Stage3OptimStatesValue(const Stage3RankOptimStates& s);


// Pieces of the files, for writers of other layouts (zero_writer's stage 3).
ValuePtr ParamGroupValue(const AdamHparams& h, const std::vector<int64_t>& ids);  // torch AdamW's keys
ValuePtr LossScalerValue(const LossScalerState& s);
ValuePtr ZeroStageValue(int stage);  // getattr(ZeroStageEnum, name)
ValuePtr FragmentAddressValue(int64_t numel, int64_t start);

// ---- Readers: each names `path` in its errors (FormatError). Tensors point
// into the file's (memory-mapped) storage: keep the TorchFile alive. ----

// Adam's state of one partition or parameter, read back.
struct AdamStateView {
  const Tensor* exp_avg = nullptr;
  const Tensor* exp_avg_sq = nullptr;
  double step = 0;  // a 0-d tensor or a number in the file
};

// mp_rank_00_model_states.pt (ZeRO 0/1/2), read back.
struct ModelStatesView {
  std::map<std::string, const Tensor*> module;  // every tensor of the module state dict
  int64_t global_steps = 0, skipped_steps = 0;
  std::optional<int64_t> global_samples;        // uckpt's data position, else DeepSpeed's global_samples
  std::optional<int64_t> last_batch_iteration;  // the lr scheduler's
  std::optional<int64_t> dp_world_size;
  // Stage 0: torch's optimizer state_dict: Adam state by parameter id, param groups.
  std::map<int64_t, AdamStateView> stage0_state;
  ValuePtr stage0_param_groups;
  std::vector<std::pair<std::string, ValuePtr>> client;  // the client_state: every key not IsModelStatesKey, but uckpt's defaults
};
ModelStatesView ReadModelStates(const ValuePtr& root, const std::string& path);

// The module state dict of a model-states file (its `module`); null when
// `root` is no DeepSpeed model-states dict.
ValuePtr ModuleStateDictOf(const ValuePtr& root);

// ZeRO-3 frozen parameters. DeepSpeed (and uckpt) saves each one
// partitioned: an empty `module` entry, and in rank r's
// frozen_param_fragments[name] slot r of ceil(numel/dp) elements (the last
// one padded). Returns every rank's fragment of `name` from `ranks` (each
// rank's zero_pp_rank_<r>_mp_rank_00_model_states.pt, in rank order), each
// checked to hold one slot; FormatError naming the file otherwise. The
// parameter's elements are the first Stage3RealNumel(numel, dp, r) of each
// fragment, in rank order.
std::vector<ValuePtr> Stage3FrozenFragments(const std::vector<TorchFile>& ranks, const std::string& name, int64_t numel);

// zero_pp_rank_<r>_mp_rank_00_optim_states.pt (ZeRO 1/2), read back.
struct OptimGroupView {
  const Tensor* fp32 = nullptr;          // the fp32 partition (lean: padding cut off)
  std::optional<AdamStateView> adam;     // none before the first step
  ValuePtr hparams;                      // the param_groups entry
};
struct RankOptimView {
  std::vector<OptimGroupView> groups;
  std::vector<int64_t> partition_count;  // per group; empty if absent
  ValuePtr loss_scaler;                  // for ReadLossScaler
};
RankOptimView ReadRankOptimStates(const ValuePtr& root, const std::string& path);

// A 0-d (or 1-element) tensor's value, or a number; throws naming `where`.
double ScalarOf(const ValuePtr& v, const std::string& where);

// A loss scaler object as pickled; fields missing from it keep `base`'s.
LossScalerState ReadLossScaler(const ValuePtr& v, const LossScalerState& base);
// param_groups[g]'s hyper-parameters; absent ones keep `base`'s.
AdamHparams ReadAdamHparams(const ValuePtr& group, const AdamHparams& base, const std::string& where);
// param_shapes as saved: groups of (name, shape). Empty when None or absent.
std::vector<std::vector<NamedShape>> ReadParamShapes(const ValuePtr& root, const std::string& path);

// A stage-3 optim-states file, read back.
struct Stage3RankOptimView {
  std::vector<const Tensor*> fp32;                  // fp32_flat_groups, per sub-group
  std::vector<std::optional<AdamStateView>> adam;   // per sub-group; none before the first step
  ValuePtr param_groups;                            // the torch optimizer's param_groups
  std::optional<int64_t> partition_count;
  ValuePtr loss_scaler;
};
Stage3RankOptimView ReadStage3RankOptimStates(const ValuePtr& root, const std::string& path);

}  // namespace uckpt::ckpt
