// What DeepSpeed's checkpoint files hold: their keys and pickled classes
// (shared/spec/deepspeed-zero-checkpoint.md §3-6), as plain state. Each file
// and each field has its encoder (a ...Value function, what the engine's save
// and zero_writer write) beside its decoder (a Read... function, what every
// load, convert, verify, inspect and fingerprint reads through). The files'
// names are ckpt/deepspeed_names.h's. No libtorch: tensors travel as format
// values (ValuePtr of kind kTensor), so a caller can share one storage
// between views (a flat buffer) or stream data (zero_writer).
//
// Decoders throw FormatError naming the file and the key. Tensors they return
// point into the file's (memory-mapped) storage: keep the TorchFile alive.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "ckpt/deepspeed_names.h"
#include "ckpt/fp16_optimizer_state.h"
#include "ckpt/partition.h"
#include "ckpt/state_keys.h"
#include "format/torch_file.h"
#include "format/value.h"

namespace uckpt::ckpt {

// The DeepSpeed version our files claim to come from (the fixtures').
inline constexpr const char* kDeepSpeedVersion = "0.14.5";

// The value of a JSON document (dicts keep key order, ints stay ints): ds_config.
ValuePtr JsonToValue(const nlohmann::json& j);

// A 0-d (or 1-element) tensor's value, or a number; throws naming `where`.
double ScalarOf(const ValuePtr& v, const std::string& where);

// ---- Fields ----

// param_shapes: per optimizer group (stage 3: sub-group), each trainable
// parameter's name and shape, in flat-buffer order.
struct NamedShape {
  std::string name;
  std::vector<int64_t> shape;
  int64_t numel() const;
  bool operator==(const NamedShape&) const = default;
};
using ParamShapes = std::vector<std::vector<NamedShape>>;
ValuePtr ParamShapesValue(const ParamShapes& groups);  // a list of OrderedDicts of torch.Size
// The model-states file `root`'s param_shapes; empty when None (stage 0) or absent.
ParamShapes ReadParamShapes(const ValuePtr& root, const std::string& path);
// The same for a file that must have them (ZeRO 1-3, universal): FormatError when None or absent.
ParamShapes ReadRequiredParamShapes(const ValuePtr& root, const std::string& path);

// The Adam class DeepSpeed 0.14.5 builds for a config's Adam/AdamW
// (_configure_basic_optimizer): its param groups and state 'step' differ.
enum class AdamClass {
  kTorch,      // torch.optim.Adam/AdamW (torch_adam): torch's keys, step a 0-d tensor
  kFusedAdam,  // ops.adam.FusedAdam: lr, bias_correction, betas, eps, weight_decay, step 0 (once stepped); step an int
  kCpuAdam,    // ops.adam.DeepSpeedCPUAdam (offload_optimizer): lr, betas, eps, weight_decay, bias_correction,
               // amsgrad; step an int
};

// One Adam/AdamW param group's hyper-parameters (lr is the current one).
struct AdamHparams {
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0;
  AdamClass cls = AdamClass::kTorch;  // whose keys the group is saved with
  bool bias_correction = true;
  // Whether the config gave the betas: a JSON list reaches the group as a list; otherwise
  // the optimizer's default, the tuple (0.9, 0.999).
  bool betas_given = true;
};
// The param group as `h.cls` keeps it; `stepped`: the optimizer has stepped
// (FusedAdam adds its group's 'step' at its first step).
ValuePtr ParamGroupValue(const AdamHparams& h, const std::vector<int64_t>& ids, bool stepped = true);

// Another optimizer's param group: `entries` (a dict of its hyper-parameters
// as it keeps them) with `params` set to `ids`.
ValuePtr ParamGroupValue(const ValuePtr& entries, const std::vector<int64_t>& ids);
// param_groups[g]'s hyper-parameters; absent ones keep `base`'s.
AdamHparams ReadAdamHparams(const ValuePtr& group, const AdamHparams& base, const std::string& where);

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
ValuePtr LossScalerValue(const LossScalerState& s);
// A loss scaler object as pickled; fields missing from it keep `base`'s.
LossScalerState ReadLossScaler(const ValuePtr& v, const LossScalerState& base);
// The scale a stage-0 fp16 file keeps in its FP16_Optimizer's own entries, as its
// load_state_dict takes it back: dynamic, cur_scale and cur_iter, and when dynamic
// last_overflow_iter, scale_factor and scale_window; the rest keep `base`'s.
LossScalerState ReadLossScaler(const Fp16OptimizerView& w, const LossScalerState& base);

// zero_stage: getattr(ZeroStageEnum, name).
ValuePtr ZeroStageValue(int stage);
// ZeroStageEnum as pickled (getattr(ZeroStageEnum, 'gradients'),
// ZeroStageEnum(2) or an int): 1..3, or 0 when `v` is null (BF16_Optimizer).
int ParseZeroStage(const ValuePtr& v, const std::string& where);

// param_slice_mappings' entries: deepspeed.utils.tensor_fragment.fragment_address.
struct FragmentAddress {
  int64_t numel = 0, start = 0;  // start: the offset in the rank's partition
};
ValuePtr FragmentAddressValue(int64_t numel, int64_t start);
FragmentAddress ReadFragmentAddress(const ValuePtr& v, const std::string& where);

// Adam's per-element state of one flat partition or parameter: step (0-d),
// exp_avg, exp_avg_sq; empty before the first step.
using AdamState = std::vector<std::pair<std::string, ValuePtr>>;
// Its keys: kStep, kExpAvg, kExpAvgSq (ckpt/state_keys.h).
AdamState AdamStateValue(ValuePtr step, ValuePtr exp_avg, ValuePtr exp_avg_sq);
// Whether per-element state keys are Adam's (exp_avg and exp_avg_sq, any order).
bool IsAdamStateKeys(const std::vector<std::string>& keys);
// `s` as `cls` saves it: DeepSpeed's own classes count 'step' in a Python
// int (`step`), torch's in a 0-d tensor (as `s` holds it).
AdamState AdamStateOfClass(AdamState s, AdamClass cls, int64_t step);
// Stage 0's state of one parameter (torch's optimizer state_dict entry),
// read back: whichever element-wise optimizer saved it.
struct Stage0ParamState {
  std::vector<std::pair<std::string, const Tensor*>> tensors;  // per-element states (the parameter's shape), file order
  ValuePtr step;                                          // 'step' as saved (a 0-d tensor or a number); null if none
  std::vector<std::pair<std::string, ValuePtr>> scalars;  // its other scalars (NAdam's mu_product)
  std::vector<std::string> none_states;                   // states kept as None (SGD's momentum_buffer)
};

// ---- mp_rank_00_model_states.pt (ZeRO 0/1/2), and ZeRO 3's
// zero_pp_rank_<r>_mp_rank_00_model_states.pt (stage 3: the module's
// parameters as empty tensors, param_shapes per sub-group) ----

struct ModelStates {
  int stage = 1;
  std::vector<std::pair<std::string, ValuePtr>> module;  // state_dict order, tied aliases included
  std::vector<std::string> module_prefixes;              // state_dict _metadata ("" and every submodule)
  std::vector<std::string> buffer_names;
  ParamShapes param_shapes;                              // trainable, per group (stage >= 1)
  std::vector<std::pair<std::string, ValuePtr>> frozen;  // frozen parameters, flattened (stage 2 records them)
  std::vector<NamedShape> frozen_shapes;
  bool frozen_excluded = false;  // exclude_frozen_parameters: both frozen keys None, as DeepSpeed's
  std::vector<std::pair<std::string, std::string>> shared_params;  // alias -> owner
  ValuePtr stage0_optimizer;                    // stage 0: torch's optimizer state_dict (Stage0OptimizerValue)
  std::optional<int64_t> last_batch_iteration;  // the lr scheduler's, if there is one
  ValuePtr lr_scheduler;                        // a client scheduler's state_dict(), written instead when set
  int64_t global_steps = 0, global_samples = 0, skipped_steps = 0;
  int dp_world_size = 1;
  ValuePtr ds_config;
  // Keys added at the top level after DeepSpeed's: uckpt's own and the
  // client's (client_state, as DeepSpeed's state.update(client_state)).
  std::vector<std::pair<std::string, ValuePtr>> extra;
};
ValuePtr ModelStatesValue(const ModelStates& s);

struct ModelStatesView {
  std::map<std::string, const Tensor*> module;  // every tensor of the module state dict
  int64_t global_steps = 0, skipped_steps = 0;
  std::optional<int64_t> global_samples;        // uckpt's data position, else DeepSpeed's global_samples
  std::optional<int64_t> last_batch_iteration;  // the lr scheduler's
  ValuePtr lr_scheduler;                        // the scheduler's state as saved (null: None or absent)
  std::optional<int64_t> dp_world_size;
  // Stage 0: torch's optimizer state_dict: each parameter's state by id, param groups.
  std::map<int64_t, Stage0ParamState> stage0_state;
  ValuePtr stage0_param_groups;
  // uckpt's record of which parameter each stage-0 state id is (its 'uckpt'
  // dict's stage0_param_names); empty in DeepSpeed's files.
  std::vector<std::string> stage0_param_names;
  // Stage 0 in fp16: DeepSpeed's FP16_Optimizer / FP16_UnfusedOptimizer state, whose wrapped
  // optimizer's state_dict is what stage0_state and stage0_param_groups read.
  std::optional<Fp16OptimizerView> fp16_optimizer;
  std::vector<std::pair<std::string, ValuePtr>>
      client;  // the client_state: every key not IsModelStatesKey, but uckpt's defaults
};
ModelStatesView ReadModelStates(const ValuePtr& root, const std::string& path);

// The 'uckpt' dict's key naming the parameter of each stage-0 optimizer state
// id (a list of names in id order), which DeepSpeed's file does not record.
inline constexpr const char* kStage0ParamNames = "stage0_param_names";

// Whether `key` is one of the model-states file's own keys (DeepSpeed's or
// uckpt's); every other top-level key is client state. `iteration` and
// `universal_checkpoint_info` are the client's (DeepSpeed leaves them to it):
// uckpt writes defaults a client's value replaces, and a load returns them
// only where the saver gave them.
bool IsModelStatesKey(const std::string& key);

// The module state dict of a model-states file (its `module`); null when
// `root` is no DeepSpeed model-states dict.
ValuePtr ModuleStateDictOf(const ValuePtr& root);

// What a model-states file says of the module's entries (export): which are
// buffers, which are tied aliases, and the frozen parameters as recorded.
struct ModuleEntriesView {
  ValuePtr module;  // the state dict; null when None
  std::set<std::string> buffer_names;
  std::vector<std::pair<std::string, std::string>> shared_params;  // alias -> owner
  // frozen_param_shapes; nullopt when None (stage 1, BF16_Optimizer: frozen
  // parameters exist only in `module`).
  std::optional<std::vector<NamedShape>> frozen_shapes;
};
ModuleEntriesView ReadModuleEntries(const ValuePtr& root, const std::string& path);
// Stage 2's flattened copy of frozen parameter `name` (frozen_param_fragments[name]).
ValuePtr ReadFrozenFragment(const ValuePtr& root, const std::string& name, const std::string& path);

// The run a model-states file says it belongs to, each field when present as an int.
struct ModelStatesRun {
  std::optional<int64_t> dp_world_size, mp_world_size, global_steps;
};
ModelStatesRun ReadModelStatesRun(const ValuePtr& root);

// The DeepSpeed config a model-states file records (ds_config); null when absent.
ValuePtr ReadSavedConfig(const ValuePtr& root);

// The module state dict a file must have (`module`); FormatError naming the file otherwise.
ValuePtr RequiredModule(const ValuePtr& root, const std::string& path);

// Stage 0's `optimizer` (torch's optimizer state_dict) as it is, for checks
// (verify): each state entry's tensors by key, in file order. FormatError
// naming the place when it or an entry is not a dict.
struct Stage0OptimizerEntry {
  std::string where;  // "<file>: optimizer.state[<k>]"
  std::vector<std::pair<std::string, const Tensor*>> tensors;
};
// Null (no optimizer dict: not a stage-0 file) or the entries.
std::optional<std::vector<Stage0OptimizerEntry>> ReadStage0OptimizerEntries(const ValuePtr& root,
                                                                            const std::string& path);

// Stage 0's `optimizer`: the torch optimizer's state_dict: `states[i]` of
// parameter i (numbered over all groups), `group_params[g]` the ids of group
// g; group g's entries are `group_entries[g]` when given (another optimizer's
// own keys), else torch Adam's from groups[g].
ValuePtr Stage0OptimizerValue(const std::vector<AdamState>& states, const std::vector<AdamHparams>& groups,
                              const std::vector<std::vector<int64_t>>& group_params,
                              const std::vector<ValuePtr>& group_entries = {});

// ZeRO-3 frozen parameters. DeepSpeed (and uckpt) saves each one
// partitioned: an empty `module` entry, and in rank r's
// frozen_param_fragments[name] slot r of ceil(numel/dp) elements (the last
// one padded). Returns every rank's fragment of `name` from `ranks` (each
// rank's zero_pp_rank_<r>_mp_rank_00_model_states.pt, in rank order), each
// checked to hold one slot; FormatError naming the file otherwise. The
// parameter's elements are the first Stage3RealNumel(numel, dp, r) of each
// fragment, in rank order.
std::vector<ValuePtr> Stage3FrozenFragments(const std::vector<TorchFile>& ranks, const std::string& name,
                                            int64_t numel);

// ---- [bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt: one rank's
// optimizer state (stage 1/2: DeepSpeedZeroOptimizer or BF16_Optimizer;
// stage 3: DeepSpeedZeroOptimizer_Stage3) ----

// What every optimizer file says of its run.
struct OptimStatesHeader {
  int zero_stage = 0;  // ParseZeroStage: 0 for BF16_Optimizer's files
  int dp = 0;          // partition_count: stage 3's int, or stage 1/2's one per group (all equal)
};
OptimStatesHeader ReadOptimStatesHeader(const ValuePtr& root, const std::string& path);

// Stage 1/2, one group.
struct OptimGroupState {
  ValuePtr fp32;   // the lean fp32 partition (padding cut off)
  AdamState adam;  // of the padded partition
  AdamHparams hparams;
  ValuePtr group;  // set: the param group's entries as another optimizer keeps them, saved instead of hparams
  int64_t padding = 0;
  std::vector<std::pair<std::string, Fragment>> mappings;  // param_slice_mappings: name -> fragment
};
struct RankOptimStates {
  int stage = 1;                // 1 or 2
  bool bf16_optimizer = false;  // BF16_Optimizer's files: no loss scaler, overflow or zero_stage
  int dp = 1;
  std::vector<OptimGroupState> groups;
  LossScalerState scaler;
  bool overflow = false;  // the optimizer's `overflow`: the last step was skipped
  double clip_grad = 0;
  ValuePtr ds_config;
};
ValuePtr OptimStatesValue(const RankOptimStates& s);

// Stage 3, one sub-group: its flat fp32 partition (every parameter's ps
// elements, padding included) and Adam's state of it.
struct Stage3SubGroupState {
  ValuePtr fp32;
  AdamState adam;  // empty before the first step
};
struct Stage3RankOptimStates {
  int dp = 1;
  std::vector<Stage3SubGroupState> sub_groups;
  // Optimizer param groups: hyper-parameters and the sub-groups they hold.
  std::vector<std::pair<AdamHparams, std::vector<int64_t>>> param_groups;
  std::vector<ValuePtr> param_group_entries;  // per param group, when set: saved instead of its AdamHparams
  LossScalerState scaler;
  bool overflow = false;  // the optimizer's `overflow`: the last step was skipped
  ValuePtr ds_config;
};
ValuePtr Stage3OptimStatesValue(const Stage3RankOptimStates& s);

// Either stage's file, read back: each part checked for its kind, not for
// agreement with the model states (ckpt/zero_checkpoint.h plans that).
struct PartitionView {
  const Tensor* fp32 = nullptr;  // the fp32 master partition (stage 1/2: lean, padding cut off)
  ValuePtr state;                // the optimizer's state of it (Adam: step, exp_avg, exp_avg_sq); null when none
  std::vector<std::pair<std::string, FragmentAddress>> mappings;  // stage 1/2: param_slice_mappings
  std::string fp32_where, state_where, mappings_where;            // their places, for messages
};
struct RankOptimView {
  std::string where;                      // "<file>: optimizer_state_dict"
  std::string partitions_where;           // the place of the list of fp32 partitions, for messages
  std::vector<PartitionView> partitions;  // per group (stage 3: sub-group)
  ValuePtr param_groups;                  // the torch optimizer's param_groups
  ValuePtr loss_scaler;                   // for ReadLossScaler; null in BF16_Optimizer's files
};
RankOptimView ReadRankOptimStates(const ValuePtr& root, const std::string& path);  // stage 1/2
// The loss scaler an optimizer file (either stage) holds; null when none (BF16_Optimizer).
ValuePtr ReadOptimStatesLossScaler(const ValuePtr& root, const std::string& path);
// A pickled loss scaler's current scale; nullopt when `v` is none or has none.
std::optional<double> ReadLossScale(const ValuePtr& v);
RankOptimView ReadStage3RankOptimStates(const ValuePtr& root, const std::string& path);  // stage 3

// ---- A universal folder's zero/optimizer_state.pt ----

// What DeepSpeed's converter writes there (universal spec §3.3), from rank 0's
// optimizer file `rank0` (at `path`): stage 1/2 — its optimizer_state_dict
// without the sharded entries, group_paddings all 0, partition_count [dp]*groups,
// plus param_groups; stage 3 — its whole optimizer_state_dict plus param_groups.
// Every storage in it says "cpu", as DeepSpeed reads the rank file with map_location="cpu".
ValuePtr UniversalOptimizerStateValue(const ValuePtr& rank0, const std::string& path, int stage, size_t groups, int dp);
// Its parts, null when absent.
struct UniversalOptimizerStateView {
  ValuePtr loss_scaler, param_groups;  // what a resume needs
  std::optional<bool> overflow;        // the optimizer's `overflow` (a resume restores it); none in BF16_Optimizer's
  ValuePtr zero_stage;                 // as pickled (ParseZeroStage)
  ValuePtr zero3_step;                 // ZeRO-3's: Adam's step of sub-group 0 (no step.pt files there)
};
UniversalOptimizerStateView ReadUniversalOptimizerStateValue(const ValuePtr& root, const std::string& path);

}  // namespace uckpt::ckpt
