// uckpt's training engine: DeepSpeed's programming model for any libtorch
// module, with ZeRO data parallelism and checkpoints in DeepSpeed's layout.
//
//   auto model = std::make_shared<MyModule>();
//   uckpt::Engine engine(model, uckpt::Config::FromFile("ds_config.json"));
//   for (each micro-batch) {
//     at::Tensor loss = model->forward(batch);
//     engine.Backward(loss);
//     engine.Step();  // updates at the gradient-accumulation boundary
//   }
//   engine.SaveCheckpoint("ckpt", "", client_state);
//   auto [path, client_state] = engine.LoadCheckpoint("ckpt");
//
// The model's named_parameters() names are the checkpoint's names, as in a
// PyTorch state_dict. Every call below is collective: all ranks call it in
// the same order. Errors are exceptions whose messages name the file, key or
// parameter. See docs/engine.md.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <torch/nn/module.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "uckpt/comm.h"
#include "uckpt/units.h"

namespace uckpt {

namespace engine {
struct EngineAccess;  // src/engine/engine_access.h, not installed
}

// A DeepSpeed JSON configuration (the subset uckpt implements; unknown keys
// are warnings, see docs/engine.md).
struct Config {
  nlohmann::json json = nlohmann::json::object();
  std::string source = "config";  // names the configuration in messages

  // Reads a JSON file. Throws std::runtime_error naming the file.
  static Config FromFile(const std::string& path);
  static Config FromJson(nlohmann::json j, std::string source = "config");
};

// One optimizer parameter group, as DeepSpeed's `model_parameters` list of
// dicts: its parameters (tensors of the module) and the hyper-parameters that
// differ from the config's optimizer section.
struct ParamGroup {
  std::vector<at::Tensor> params;
  std::optional<double> lr, weight_decay, beta1, beta2, eps;
};

// A param group's Adam hyper-parameters other than the lr (Engine::Optimizer::SetGroupHparams).
struct GroupHparams {
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0;
};

// One partition of the fp32 masters, handed to an element-wise optimizer
// (EngineOptions::optimizer_step) at each applied step.
struct OptimizerPartition {
  at::Tensor master;  // [P] fp32, this rank's partition (padding included): updated in place
  at::Tensor grad;    // [P] fp32, its averaged gradient, unscaled and clipped
  size_t group = 0;   // the param group it belongs to
  double lr = 0;      // that group's lr for this step
  // The optimizer's state of the partition under its keys ([P] tensors and
  // 0-d scalars; empty before its first step or after a load without one):
  // read before the step, replaced by the state after it.
  std::vector<std::pair<std::string, at::Tensor>>* state = nullptr;
};
// Steps every partition this rank owns (one call per applied step).
using OptimizerStepFn = std::function<void(std::vector<OptimizerPartition>&)>;

struct BackwardOptions {
  // Divide the loss by the gradient-accumulation steps (DeepSpeed's
  // scale_wrt_gas); false: the caller has scaled it.
  bool scale_wrt_gas = true;
  bool retain_graph = false;  // passed to autograd's backward
};

struct StepOptions {
  // At the boundary, the lr scheduler steps to this iteration instead of the
  // next one (DeepSpeed's step(lr_kwargs={"last_batch_iteration": n})).
  // Ignored without a configured scheduler, as DeepSpeed's engine ignores
  // lr_kwargs without one.
  std::optional<int64_t> lr_schedule_iteration;
};

// A parameter that arrives partitioned (built under Python's zero.Init, or
// by a C++ program that made only its partition): the module's tensor (any
// shape and storage: the engine replaces them), its whole shape, and this
// rank's partition: elements [rank*ps, (rank+1)*ps) of the flattened value,
// ps = ceil(numel / world size), zeros past the end (DeepSpeed's ds_tensor).
struct PartitionedParameter {
  at::Tensor param;
  std::vector<int64_t> shape;
  at::Tensor partition;
};

struct EngineOptions {
  // The communicator; null: from the environment (RANK, WORLD_SIZE,
  // LOCAL_RANK, MASTER_ADDR, MASTER_PORT as torchrun sets them; one process
  // when WORLD_SIZE is unset). The engine keeps it alive.
  std::shared_ptr<Comm> comm;
  // With comm: the engine ends it (Comm::Finish) when destroyed outside an
  // exception, as it ends a communicator it made. ZeroInit::AddTo sets it
  // for the communicator the scope made from the environment.
  bool finish_comm = false;
  // Empty: one group of every parameter that requires grad. Otherwise every
  // trainable parameter must be in exactly one group.
  std::vector<ParamGroup> param_groups;
  // "cpu" or "cuda" (the device LOCAL_RANK). The module is moved there.
  std::string device = "cpu";
  // -1: LOCAL_RANK from the environment (0 if unset).
  int local_rank = -1;
  // ZeRO stage 3: the submodules whose parameters are gathered only while
  // they compute (gather units, e.g. every transformer block), in forward
  // order; unit i is index i in Engine::EnterUnit/ExitUnit. Parameters in no
  // unit, and parameters tied across units, form the root unit, which stays
  // gathered. Empty: everything is the root unit. At stages 0-2 only
  // overlap_update_with_forward uses them.
  // Prefetching (stage3_prefetch_bucket_size) follows this order: entering
  // unit i starts the all-gathers of units i+1, ... (in backward i-1, ...).
  std::vector<std::shared_ptr<torch::nn::Module>> gather_units;
  // Host threads of this rank: libtorch's intra-op pool (at::set_num_threads,
  // which the host Adam uses too) and uckpt's own checkpoint threads. 0: the
  // program's own at::set_num_threads if it called it, else OMP_NUM_THREADS,
  // else this rank's share of the host, max(1, CPUs this process may run on /
  // LOCAL_WORLD_SIZE), at most libtorch's default. Rank 0 prints the choice
  // once. See docs/engine.md.
  int host_threads = 0;
  // The engine is never stepped (DeepSpeed's engine without an optimizer: a reference model for forward and
  // evaluation). At ZeRO stage 0 in fp16 DeepSpeed then only casts the module, which uckpt does too, where an
  // engine with an optimizer is refused (DeepSpeed's FP16_Optimizer).
  bool forward_only = false;
  // ZeRO stage 3 only (refused at stages 0-2): parameters that arrive
  // partitioned (uckpt::ZeroInit's, uckpt/zero_init.h; Python's zero.Init's).
  // The engine makes the stage-3 partitions from them without gathering
  // them: gather units start sharded (the parameters of every unit,
  // these and the others, have no storage until the unit is entered); root
  // and persistent parameters, and frozen ones, are gathered whole once.
  std::vector<PartitionedParameter> partitioned;
  // Set: the optimizer update of each applied step, instead of the config's
  // Adam: an element-wise optimizer (a client's torch optimizer) stepping the
  // rank's fp32 partitions, as DeepSpeed steps its basic optimizer over them.
  // Its state is saved and loaded under its own keys; the param groups'
  // lr comes from the schedule as for Adam.
  OptimizerStepFn optimizer_step;
  // ZeRO stages 1-2 with offload_optimizer, at world size 1, with
  // gather_units declared (and the config's Adam, not optimizer_step): the
  // host update of each step overlaps the next forward, unit by unit.
  // Step() updates, and uploads to the device, the root unit's parameters
  // (those in no gather unit or tied across units: embeddings, final norm)
  // and returns; the gather units' updates follow in forward order on a
  // background thread, and EnterUnit(i) returns once unit i's parameters are
  // updated and uploaded (the device waits for their copy). Every other
  // Engine call that touches weights, gradients or optimizer state
  // (Backward, Step, SaveCheckpoint, LoadCheckpoint, LoadWeights,
  // Save16bitModel, GatherParameters, Train/Eval) first waits for the whole
  // update, and so does the destructor. So the model must run each unit's parameters only
  // between EnterUnit(i) and ExitUnit(i) (Engine::unit_calls()); code that
  // reads a parameter between Step and its unit's EnterUnit calls
  // WaitForUpdate() first. The results are the synchronous update's, bit for
  // bit. An exception of the background update is thrown by the next call
  // that waits, and every later one refuses, naming it (the state is partly
  // stepped), until LoadCheckpoint loads the optimizer states. Elsewhere (other stages, several ranks, no units, a
  // client optimizer) the update stays synchronous. Off by default; `uckpt train
  // --device cuda` turns it on; the Python package does not (a script may
  // read parameters right after step(), as DeepSpeed allows).
  bool overlap_update_with_forward = false;
  // With optimizer_step: param group g's entries as that optimizer keeps them
  // (a dict of its hyper-parameters, lr the current one), saved as the
  // group's param_groups entry in the optimizer files (torch's state_dict).
  std::function<c10::IValue(size_t)> optimizer_param_group;
};

// client_state: any value made of dicts with string keys, lists, tuples,
// ints, doubles, bools, strings, None and tensors (c10::IValue), and
// PickledObject capsules (IValue::make_capsule) for any other value.
using ClientState = c10::IValue;

// A client_state value that is none of the kinds above (a numpy array, an
// object of the script's): its protocol-2 pickle, as Python's pickler writes
// it, with no tensor inside. Saved into the model-states file as part of its
// pickle (read by the reader without running anything, never executed); given
// back by a load the same way, re-pickled, for the caller to rebuild.
struct PickledObject : torch::CustomClassHolder {
  explicit PickledObject(std::string p) : pickle(std::move(p)) {}
  std::string pickle;
};

struct LoadCheckpointOptions {
  bool load_optimizer_states = true;
  bool load_lr_scheduler_states = true;
  bool load_module_only = false;    // weights only, at any stage: counters, optimizer state and schedule are not loaded
  bool universal = false;           // a universal checkpoint (any world size); tag from `latest_universal`
  bool verify_hashes = false;       // compare the manifest's XXH64 hashes too (sizes always)
  bool keep_saved_hparams = false;  // lr/betas/eps/weight decay from the checkpoint, not the config
  // The model-states file is read naming any class or function (still never run; its client keys come back as
  // PickledObject capsules), not only the strict reader's allow-list (format/strict_globals.h): for a checkpoint
  // whose client_state holds objects of the script's, which its caller trusts to rebuild.
  bool trust_pickled_client_state = false;
  // DeepSpeed's load_module_strict: false lets the model-states file lack
  // frozen parameters and buffers (a save with exclude_frozen_parameters),
  // which then keep the values the model has, as torch's
  // load_state_dict(strict=False) under DeepSpeed.
  bool load_module_strict = true;
};

struct LoadResult {
  std::string path;          // the tag folder loaded
  ClientState client_state;  // a dict of the keys the saver added
};

// What the last LoadCheckpoint did (Engine::Stats::last_load()).
struct LoadStats {
  // Optimizer-state bytes this rank read from the ZeRO rank files: those of
  // its own partition only, at any world size (resharded while loading); 0
  // for universal, weights-only and stage-0 loads.
  uint64_t optimizer_bytes_read = 0;
  // The resume proof (docs/manifest-format.md, "State fingerprint"): how the
  // loaded state was checked: "recorded" (against the manifest's record),
  // "computed from the files" (a checkpoint without one, DeepSpeed's), or
  // "unchecked: why"; empty when nothing was loaded.
  std::string fingerprint;
  double fingerprint_s = 0;  // the whole check, wall time
  // Of it, a checkpoint without a record: the expected value (the bytes the load
  // read, hashed where they landed by the files' own layout) and its reduction.
  double fingerprint_files_s = 0;
  // The model-states file's 'lr_scheduler' value as saved (None when absent),
  // for a client scheduler's load_state_dict (SaveCheckpointOptions::lr_scheduler_state).
  ClientState lr_scheduler_state;
  // The optimizer's param_groups as saved (torch's dicts; None unless optimizer
  // state was loaded): a client optimizer's own hyper-parameters (SGD's
  // momentum, Adagrad's lr_decay, ...), as DeepSpeed's load_state_dict restores them.
  ClientState optimizer_param_groups;
};

// Engine::Weights::LoadWeights: how a file's tensor names become the model's.
struct LoadWeightsOptions {
  // A file's tensor name -> the model's state_dict name; std::nullopt skips
  // the tensor. Unset: the prefix rule below.
  std::function<std::optional<std::string>(const std::string&)> name_map;
  // A name starting with strip_prefix loses it and gains add_prefix (others
  // are kept as they are); both empty: the names as they are.
  std::string strip_prefix, add_prefix;
  // As torch's load_state_dict(strict=...): missing or unexpected names are
  // an error (naming them all) instead of being returned.
  bool strict = true;
};

// What LoadWeights did not match, as torch's _IncompatibleKeys.
struct LoadWeightsResult {
  std::vector<std::string> missing_keys;     // the model's names the file lacks, in state_dict order
  std::vector<std::string> unexpected_keys;  // the file's (mapped) names the model lacks, sorted
};

struct SaveCheckpointOptions {
  // Write in the background: SaveCheckpoint returns once the state is copied
  // to host memory, and the files are written while training goes on (see
  // WaitForCheckpoint). Unset: the config's "checkpoint": {"async_save": ...}.
  std::optional<bool> async_save;
  // A client scheduler's state_dict() (DeepSpeed's lr_scheduler.state_dict()),
  // saved under the model-states file's 'lr_scheduler' key in place of the
  // config scheduler's position; the same kinds of values as client_state.
  // None: the config scheduler's, if there is one.
  ClientState lr_scheduler_state;
  // DeepSpeed's exclude_frozen_parameters: the frozen parameters (requires_grad
  // false) are left out of the model-states file's module, and there is no
  // frozen_param_shapes/frozen_param_fragments. A load then needs
  // load_module_strict = false.
  bool exclude_frozen_parameters = false;
  // A snapshot for a quick restart (uckpt train's checkpoint.snapshot_interval,
  // docs/reliability.md): always written in the background, by a writer of
  // its own with its own host buffers, so that it neither waits for a save
  // to disk nor delays one. Published as any background save (at a later
  // Step, SaveCheckpoint, LoadCheckpoint or WaitForCheckpoint); the next
  // snapshot waits for it (Stats::save_pending(true) says whether it is
  // still being written). A folder `kReusedSnapshotFolder` in `dir`, which the
  // caller moves an older snapshot of this engine's to, becomes the new one's
  // temporary folder and its files are written over in place: on /dev/shm
  // the pages are reused instead of freed and allocated again, which halves
  // the write. Its files the new snapshot does not write are removed before
  // it is published.
  bool memory_snapshot = false;
  static constexpr const char* kReusedSnapshotFolder = ".uckpt-reuse";
};

// What the last SaveCheckpoint cost the caller.
struct SaveStats {
  bool async = false;
  double blocked_s = 0;         // time SaveCheckpoint blocked (async: waiting for the previous save + snapshot)
  uint64_t snapshot_bytes = 0;  // host memory the snapshot holds until its files are written
  double fingerprint_s = 0;     // hashing the state for the manifest's state fingerprint (while the files are written)
  // Synchronous saves, this rank (parts of blocked_s): waiting for the
  // previous save (its files written, or made durable after it was
  // published); the state gathered as values; its files laid out (CRCs) and
  // written; waiting for the other ranks and publishing.
  double previous_s = 0, state_s = 0, layout_s = 0, write_s = 0, publish_s = 0;
};

struct StepInfo {
  double grad_norm = 0;   // pre-clipping global norm (-1 on overflow)
  bool skipped = false;   // fp16 overflow: no update
  double loss_scale = 1;  // the scale the step's gradients carried
};

// What ZeRO stage 3's gathers and reduce-scatters did on this rank since the
// engine was made (Engine::Stats::stage3_stats()); all zero at stages 0-2.
struct Stage3Stats {
  int64_t gathered_elements = 0;       // elements of gather units' parameters whole (or being gathered) now
  int64_t peak_gathered_elements = 0;  // the most at once
  int64_t unit_gathers = 0;            // all-gathers of gather units, prefetched ones included
  int64_t prefetched_gathers = 0;      // of them, started before their unit was entered (stage3_prefetch_bucket_size)
  int64_t unused_prefetches = 0;       // prefetched units dropped before being entered
  int64_t reduce_buckets = 0;          // reduce-scatters of gradient buckets (reduce_bucket_size)
  int64_t overlapped_buckets = 0;      // of them, started during backward and left running (overlap_comm)
  // Timing on (Engine::Stats::SetTiming): seconds Backward spent at its end on the
  // last reduce-scatters and waiting for the others; 0 while timing is off.
  double reduce_wait_s = 0;
};

class Engine {
 public:
  // Wraps `model`: moves it to the device and the config's dtype (bf16/fp16)
  // and takes over its trainable parameters: at stages 0-2 they become views
  // into ZeRO's flat buffers, their gradients views into the flat gradient
  // buffers; at stage 3 each rank keeps its partition of every parameter, and
  // a gather unit's parameters have storage only while gathered (EnterUnit).
  // Throws std::invalid_argument / std::runtime_error on a bad config or
  // parameter groups (naming the parameter).
  Engine(std::shared_ptr<torch::nn::Module> model, const Config& config, EngineOptions options = {});
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // loss.backward() with DeepSpeed's scaling (1/GA, and the fp16 loss scale),
  // then the ZeRO gradient reduction of this micro-step.
  void Backward(const at::Tensor& loss, const BackwardOptions& options = {});
  // Called after every Backward. At the gradient-accumulation boundary: the
  // optimizer step, the lr schedule and the counters; otherwise nothing.
  void Step(const StepOptions& options = {});
  // DeepSpeed's optimizer.step() called by a script itself where DeepSpeed's optimizer is the torch optimizer
  // (ZeRO stage 0 in fp32, no offload): one update of every trainable parameter from its own .grad (zeros where
  // it has none), with the groups' current learning rates, as that optimizer's step() does: the gradients are
  // not averaged over the ranks nor clipped, and the lr schedule and the step counters do not move.
  // std::logic_error elsewhere.
  void OptimizerStep();
  // Under EngineOptions::overlap_update_with_forward: returns once the last
  // Step's update is complete (every parameter updated and on the device);
  // throws the update's exception, if it failed. A no-op otherwise.
  void WaitForUpdate();
  bool IsGradientAccumulationBoundary() const;
  // DeepSpeed's set_gradient_accumulation_boundary: from now on the boundary
  // is `is_boundary` (for the next Backward's reduction and Step's update),
  // not the micro-step count; nullopt returns to the count.
  void SetGradientAccumulationBoundary(std::optional<bool> is_boundary);

  // ---- ZeRO stage 3 gather units (identities at stages 0-2, where under
  // EngineOptions::overlap_update_with_forward EnterUnit(i) waits for unit
  // i's update). ----
  // Contract: a model runs unit i (EngineOptions::gather_units[i]) as
  //   x = engine.EnterUnit(i, x);   // gathers unit i's parameters
  //   y = unit_i(x);                // any code using only unit i's and the root's parameters
  //   y = engine.ExitUnit(i, y);    // frees them again
  // `x` is the unit's input that carries the gradient (the hidden state) and
  // `y` its output; both come back as autograd identities. In backward,
  // ExitUnit's identity gathers the unit again before the unit's backward and
  // EnterUnit's identity, reached when the unit's backward is done, hands the
  // unit's gradients to the reduce-scatter bucket (reduce_bucket_size) and
  // frees the parameters; Backward() reduces what is left (the root unit) at
  // its end. Units may nest or repeat (a gather count per unit). From the
  // first EnterUnit on, a unit's parameters have no storage outside these
  // calls (as FSDP's): read weights between GatherParameters() and
  // ReleaseParameters(); a model that never calls EnterUnit keeps them whole.
  // A Python binding calls EnterUnit from a forward pre-hook (on the first
  // tensor argument) and ExitUnit from a forward hook (on the output).
  at::Tensor EnterUnit(size_t unit, const at::Tensor& input);
  at::Tensor ExitUnit(size_t unit, const at::Tensor& output);
  UnitCalls unit_calls();  // EnterUnit/ExitUnit bound to this engine
  // Stage 3: gathers every parameter (to read or evaluate whole weights),
  // until ReleaseParameters(). Collective. No-ops at stages 0-2.
  void GatherParameters();
  void ReleaseParameters();
  // Stage 3, as DeepSpeed's zero.GatheredParameters(params, modifier_rank):
  // the module's parameters among `params` (others are ignored) whole until
  // ReleaseParameters(params, modifier_rank) with the same list. Releasing
  // with modifier_rank >= 0 makes that rank's values every rank's (their
  // partitions, so the next forward sees them; the fp32 masters are not
  // written, as DeepSpeed's: the next step starts from those); -1 discards
  // writes made meanwhile. Collective. No-ops at stages 0-2.
  void GatherParameters(const std::vector<at::Tensor>& params);
  void ReleaseParameters(const std::vector<at::Tensor>& params, int modifier_rank);
  // Saves <dir>/<tag>/ in DeepSpeed's layout (tag "" = "global_step<N>") with
  // client_state's keys at the top of the model-states file, then points
  // <dir>/latest at it. Crash-safe: until it returns, `latest` names the
  // previous checkpoint. Returns the tag folder. A new tag returns as soon as
  // its files are written (as DeepSpeed's save) and becomes durable in the
  // background; until a later Step, SaveCheckpoint, LoadCheckpoint or
  // WaitForCheckpoint has seen every rank's files on disk, a marker beside
  // the folder makes every reader check its files by hash
  // (docs/reliability.md). Over an existing tag it returns durable.
  // With async_save the call returns once the state is snapshotted and the
  // files are written in the background: the checkpoint is published (its
  // folder renamed into place, then `latest`) at a later Step, SaveCheckpoint,
  // LoadCheckpoint or WaitForCheckpoint call once every rank's files are
  // durable; a failed background write throws there, naming the file.
  std::string SaveCheckpoint(const std::string& dir, const std::string& tag = "",
                             const ClientState& client_state = c10::IValue(),
                             const SaveCheckpointOptions& options = {});
  // Waits for a background save and publishes it, or for a published save's
  // files to be durable; throws its error (naming the file). Collective. Call
  // it before the end of training: the destructor also waits, but can only
  // report an error on stderr.
  void WaitForCheckpoint();
  // engine.optimizer.state_dict() as DeepSpeed 0.14.5's optimizer for this
  // run returns it, made by the encoders a save writes with: at stage 0 in
  // fp16 its FP16_Optimizer's / FP16_UnfusedOptimizer's (the model-states
  // file's 'optimizer'), at ZeRO 1-2 this rank's ZeRO optimizer's (its
  // optim-states file's 'optimizer_state_dict'). Tensors are host copies;
  // DeepSpeed's objects (loss scaler, ZeroStageEnum, fragment_address) come
  // as their pickles. Not collective. std::invalid_argument naming the run
  // elsewhere.
  c10::IValue OptimizerStateDict();
  // Loads <dir>/<tag> (tag "" = what `latest`, or `latest_universal`, names).
  // A missing `latest` is not an error: nothing is loaded and path is "".
  LoadResult LoadCheckpoint(const std::string& dir, const std::string& tag = "",
                            const LoadCheckpointOptions& options = {});

  void Train(bool on = true);  // module train/eval mode
  void Eval() { Train(false); }
  std::shared_ptr<torch::nn::Module> module() const;
  Comm& comm();

  // ---- The rest, by role: engine.optimizer().SetLearningRate(0, 1e-4),
  // engine.settings().zero_stage(), engine.stats().global_steps(),
  // engine.weights().LoadWeights(path). Each is a view of this engine (not
  // copyable, alive as long as the engine). ----

  // The param groups, their hyper-parameters, the lr schedule and the
  // optimizer's state at stage 0 (DeepSpeed's engine.optimizer and
  // engine.lr_scheduler).
  class Optimizer {
   public:
    // Trainable parameters by group, flat order (names as in the checkpoint).
    std::vector<std::vector<std::pair<std::string, at::Tensor>>> param_groups() const;
    // Contract: at each optimizer step, group g (param_groups()[g]) updates
    // with learning_rate(g) and group_hparams(g). learning_rate(g) starts as
    // the group's ParamGroup::lr, else the config's optimizer lr. A configured
    // scheduler writes its value into every group after each applied step (as
    // DeepSpeed's scheduler.step() writes param_groups[g]['lr']); without one
    // nothing changes it but SetLearningRate. SetLearningRate/SetGroupHparams
    // between steps take effect at the next optimizer step, as writes to
    // DeepSpeed's param_groups[g] do; a scheduler step overwrites the lr again.
    // Checkpoints save each group's learning_rate(g) and hyper-parameters as
    // param_groups[g] of the optimizer state. Not collective, but every rank
    // must set the same values. Throws std::out_of_range for a bad group.
    size_t num_param_groups() const;
    double learning_rate(size_t group) const;
    void SetLearningRate(size_t group, double lr);
    GroupHparams group_hparams(size_t group) const;
    void SetGroupHparams(size_t group, const GroupHparams& hparams);
    double lr() const { return learning_rate(0); }  // group 0's
    // The optimizer's state at ZeRO stage 0 (DeepSpeed's basic optimizer's).
    // Contract: at stage 0 every rank holds param group g's whole state, under
    // the keys of the optimizer that made it: the config's Adam's step,
    // exp_avg, exp_avg_sq; a client optimizer's (EngineOptions::optimizer_step)
    // own, in its order, a state torch keeps as None as an undefined tensor.
    // Element states are flat fp32 tensors over param_groups()[g] in order
    // (past the parameters' numel: padding), scalars are 0-d. Empty before the
    // first step. stage0_optimizer_state returns the engine's own tensors:
    // writes to them reach the next step. SetStage0OptimizerState replaces the
    // group's state by a copy of `state` in that form (element states of the
    // parameters' numel, padding optional: zeros); an empty one drops it (the
    // next step starts afresh). Adam's must be its three keys. Throws
    // std::logic_error at stages 1-3, std::out_of_range for a bad group,
    // std::invalid_argument for a state not in that form. Not collective.
    std::vector<std::pair<std::string, at::Tensor>> stage0_optimizer_state(size_t group) const;
    void SetStage0OptimizerState(size_t group, const std::vector<std::pair<std::string, at::Tensor>>& state);
    // The configured scheduler (config "scheduler"): whether there is one, its
    // last_batch_iteration (-1 before its first step), its value at an
    // iteration, and one step of it outside Step() (DeepSpeed's
    // lr_scheduler.step(last_batch_iteration)): every group's lr is set to its
    // value. StepLrSchedule throws std::logic_error without a scheduler.
    bool has_lr_schedule() const;
    int64_t lr_schedule_iteration() const;
    double ScheduledLr(int64_t iteration, size_t group = 0) const;  // group: WarmupCosineLR scales each group's own lr
    void StepLrSchedule(std::optional<int64_t> iteration = std::nullopt);
    double loss_scale() const;  // the fp16 loss scale (1 otherwise)
    // DeepSpeed's `optimizer.overflow`: the last step was skipped (an fp16 overflow); a
    // load of a ZeRO checkpoint restores it, as DeepSpeed's ZeRO optimizers do.
    bool overflow() const;

   private:
    friend class Engine;
    explicit Optimizer(Engine& e) : e_(e) {}
    Optimizer(const Optimizer&) = delete;
    Engine& e_;
  };

  // What the config and the environment resolved to (DeepSpeed's engine
  // properties), and the one of them a script may change.
  class Settings {
   public:
    int rank() const;
    int world_size() const;
    int local_rank() const;
    at::Device device() const;
    int zero_stage() const;
    int64_t train_batch_size() const;
    int64_t train_micro_batch_size_per_gpu() const;
    int64_t gradient_accumulation_steps() const;
    bool fp16_enabled() const;
    bool bf16_enabled() const;
    // The config's stage3_gather_16bit_weights_on_model_save.
    bool zero_gather_16bit_weights_on_model_save() const;
    size_t num_gather_units() const;  // EngineOptions::gather_units' (0 at stages 0-2 without overlap)
    // What the config said that uckpt ignores or does differently.
    const std::vector<std::string>& warnings() const;
    // DeepSpeed's set_train_batch_size: the accumulation steps become
    // train_batch_size / (micro batch * world size), the micro batch stays;
    // std::invalid_argument unless it divides.
    void SetTrainBatchSize(int64_t train_batch_size);

   private:
    friend class Engine;
    explicit Settings(Engine& e) : e_(e) {}
    Settings(const Settings&) = delete;
    Engine& e_;
  };

  // The counters and what the last calls did, for tools and benchmarks
  // (uckpt train's UCKPT_TIMERS). Not collective.
  class Stats {
   public:
    int64_t global_steps() const;
    int64_t global_samples() const;
    int64_t skipped_steps() const;
    int64_t micro_steps() const;
    const StepInfo& last_step() const;  // of the last update
    // Whether the last Step updated the weights (a boundary without overflow).
    bool last_step_applied() const;
    const SaveStats& last_save() const;
    // Whether a save (memory_snapshot: a SaveCheckpointOptions::memory_snapshot
    // one) is still being written or made durable. Every rank gives the same
    // answer between the calls that agree on it: Step at a boundary,
    // SaveCheckpoint, LoadCheckpoint, WaitForCheckpoint.
    bool save_pending(bool memory_snapshot = false) const;
    const LoadStats& last_load() const;
    // Stage 3's gather and reduce-scatter counters of this rank, summed since
    // construction; all zero at stages 0-2. Not collective.
    Stage3Stats stage3_stats() const;
    // Whether the engine times what only it can see: stage 3's wait for its
    // reduce-scatters at the end of Backward (Stage3Stats::reduce_wait_s). The
    // device is synchronised around it, which costs throughput. Off by
    // default; a no-op at stages 0-2. Not collective.
    void SetTiming(bool on);

   private:
    friend class Engine;
    explicit Stats(Engine& e) : e_(e) {}
    Stats(const Stats&) = delete;
    Engine& e_;
  };

  // Weights alone, in and out of the running engine (docs/safetensors.md),
  // and stage 3's partitions of them.
  class Weights {
   public:
    // Loads pretrained weights into the running engine at any stage: a
    // .safetensors file, a sharded model.safetensors.index.json (Hugging
    // Face's layout), or a folder holding either. Each rank reads, through a
    // memory map, only the bytes of the partitions it owns (the whole tensors
    // at stage 0); the fp32 masters and the model's weights become the file's
    // values converted to their dtypes (F32, F16, BF16, F64 and the integer
    // types; frozen parameters and buffers are read whole). Adam's moments
    // and the counters are left as they are. Names map as `options` says;
    // a shape that differs is always an error (naming every one). Collective;
    // not between Backward and Step. Throws FormatError / IoError naming the
    // file (and the tensor).
    LoadWeightsResult LoadWeights(const std::string& path, const LoadWeightsOptions& options = {});
    // DeepSpeed's save_16bit_model: the module's state_dict (tied weights
    // under each name, persistent buffers) in the model's dtype, written by
    // rank 0 to <save_dir>/<save_filename>: a safetensors file when the name
    // ends in ".safetensors" (tied weights stored once, their other names in
    // its metadata, as safetensors' save_model does), else torch.save's
    // format. At stage 3 each parameter is gathered, written and freed in
    // turn, so no rank holds more than one whole parameter; and, as
    // DeepSpeed, only with zero_optimization.stage3_gather_16bit_weights_on_model_save:
    // without it nothing is saved and it returns false. Crash-safe (a
    // temporary file renamed into place). Collective.
    bool Save16bitModel(const std::string& save_dir, const std::string& save_filename = "pytorch_model.bin",
                        bool exclude_frozen_parameters = false);
    // DeepSpeed's _zero3_consolidated_16bit_state_dict: on rank 0 the whole
    // state_dict on the CPU (tied names sharing one tensor), gathered one
    // parameter at a time; empty on the other ranks. Stage 3 only (else
    // std::invalid_argument, as DeepSpeed's ValueError). Collective.
    std::vector<std::pair<std::string, at::Tensor>> Zero3Consolidated16bitStateDict(
        bool exclude_frozen_parameters = false);

    // Stage 3: each partitioned parameter with this rank's partition of it (the
    // runtime's own tensor, model dtype: DeepSpeed's ds_tensor). Empty at stages 0-2.
    std::vector<std::pair<at::Tensor, at::Tensor>> ParameterPartitions() const;

   private:
    friend class Engine;
    explicit Weights(Engine& e) : e_(e) {}
    Weights(const Weights&) = delete;
    Engine& e_;
  };

  Optimizer& optimizer() { return optimizer_; }
  const Optimizer& optimizer() const { return optimizer_; }
  Settings& settings() { return settings_; }
  const Settings& settings() const { return settings_; }
  Stats& stats() { return stats_; }
  const Stats& stats() const { return stats_; }
  Weights& weights() { return weights_; }
  const Weights& weights() const { return weights_; }

  // The engine's state (src/engine/engine_impl.h, not installed): opaque
  // here; the engine's tests reach it through engine/engine_access.h.
  struct Impl;

 private:
  // uckpt's own tools build an engine from a configuration already parsed
  // (engine/engine_access.h, not installed).
  friend struct engine::EngineAccess;
  Engine(std::shared_ptr<torch::nn::Module> model, std::unique_ptr<Impl> state, EngineOptions options);
  void Init(std::shared_ptr<torch::nn::Module> model, EngineOptions options);
  std::unique_ptr<Impl> impl_;
  Optimizer optimizer_{*this};
  Settings settings_{*this};
  Stats stats_{*this};
  Weights weights_{*this};
};

}  // namespace uckpt
