// uckpt::Engine's roles (include/uckpt/engine.h): the optimizer's param
// groups, hyper-parameters, lr schedule and stage-0 state; the settings the
// config resolved to; the counters and statistics. (The weights role is in
// weights_io.cc's calls, forwarded from here.)
#include <map>
#include <set>
#include <stdexcept>

#include "ckpt/state_keys.h"
#include "engine/engine_impl.h"
#include "engine/weights_io.h"

namespace uckpt {

// ---- Optimizer. ----

size_t Engine::Optimizer::num_param_groups() const { return e_.impl_->schedule.num_groups(); }
double Engine::Optimizer::learning_rate(size_t group) const { return e_.impl_->schedule.current_lr(group); }
void Engine::Optimizer::SetLearningRate(size_t group, double lr) {
  if (!(lr >= 0))
    throw std::invalid_argument("uckpt::Engine: param group " + std::to_string(group) + ": lr must be >= 0");
  e_.impl_->schedule.set_current_lr(group, lr);
}
GroupHparams Engine::Optimizer::group_hparams(size_t group) const {
  const engine::OptimizerConfig& o = e_.impl_->runtime->optimizer_config(group);
  return {o.beta1, o.beta2, o.eps, o.weight_decay};
}
void Engine::Optimizer::SetGroupHparams(size_t group, const GroupHparams& h) {
  const std::string where = "uckpt::Engine: param group " + std::to_string(group) + ": ";
  if (!(h.beta1 >= 0 && h.beta1 < 1 && h.beta2 >= 0 && h.beta2 < 1))
    throw std::invalid_argument(where + "betas must be in [0, 1)");
  if (!(h.eps >= 0)) throw std::invalid_argument(where + "eps must be >= 0");
  engine::OptimizerConfig o = e_.impl_->runtime->optimizer_config(group);
  o.beta1 = h.beta1;
  o.beta2 = h.beta2;
  o.eps = h.eps;
  o.weight_decay = h.weight_decay;
  e_.impl_->runtime->set_optimizer_config(group, o);
}
namespace {

// Param group g's optimizer state at stage 0, where a rank holds it whole.
engine::PartitionState& Stage0State(engine::ShardedRuntime& runtime, int stage, size_t num_groups, size_t group,
                                    const char* call) {
  const std::string where = std::string("uckpt::Engine::") + call + ": ";
  if (stage != 0)
    throw std::logic_error(where + "the optimizer state is partitioned at ZeRO stage " + std::to_string(stage) +
                           " (stage 0 only; use SaveCheckpoint)");
  if (group >= num_groups)
    throw std::out_of_range(where + "no param group " + std::to_string(group) + " (there are " +
                            std::to_string(num_groups) + ")");
  for (const engine::PartitionSlot& slot : runtime.Slots())
    if (slot.group == group) return *slot.state;
  throw std::logic_error(where + "param group " + std::to_string(group) + " has no optimizer state");
}

// A copy of `state` on the group's device: element states full length (padding zero), scalars as they are.
std::vector<std::pair<std::string, at::Tensor>> Stage0Copy(const engine::PartitionState& st, int64_t numel,
                                                           const std::vector<std::pair<std::string, at::Tensor>>& state,
                                                           const std::string& where) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  std::set<std::string> keys;
  for (const auto& [key, t] : state) {
    if (!keys.insert(key).second) throw std::invalid_argument(where + "state '" + key + "' given twice");
    if (!t.defined()) {
      out.emplace_back(key, at::Tensor());
    } else if (t.dim() == 0) {
      out.emplace_back(key, t.detach().to(st.master.device()).clone());
    } else if (t.dim() == 1 && t.numel() >= numel && t.numel() <= st.master.numel()) {
      at::Tensor flat = at::zeros_like(st.master);
      flat.narrow(0, 0, t.numel()).copy_(t.detach());
      out.emplace_back(key, flat);
    } else {
      throw std::invalid_argument(where + "state '" + key + "' has shape " + c10::str(t.sizes()) +
                                  ", not a scalar or the group's flat " + std::to_string(numel) + " elements");
    }
  }
  return out;
}

}  // namespace

std::vector<std::pair<std::string, at::Tensor>> Engine::Optimizer::stage0_optimizer_state(size_t group) const {
  const engine::PartitionState& st =
      Stage0State(*e_.impl_->runtime, e_.impl_->stage(), e_.impl_->groups.size(), group, "stage0_optimizer_state");
  return e_.impl_->client_optimizer ? st.named : engine::OptimizerStates(st);
}

void Engine::Optimizer::SetStage0OptimizerState(size_t group,
                                                const std::vector<std::pair<std::string, at::Tensor>>& state) {
  engine::PartitionState& st =
      Stage0State(*e_.impl_->runtime, e_.impl_->stage(), e_.impl_->groups.size(), group, "SetStage0OptimizerState");
  const std::string where = "uckpt::Engine::SetStage0OptimizerState: param group " + std::to_string(group) + ": ";
  int64_t numel = 0;
  for (const auto& p : e_.impl_->groups[group]) numel += p.tensor.numel();
  auto copied = Stage0Copy(st, numel, state, where);
  if (e_.impl_->client_optimizer) {
    st.named = std::move(copied);
    return;
  }
  // The engine's own Adam: torch Adam's keys, or no state at all.
  std::map<std::string, at::Tensor> by_key(copied.begin(), copied.end());
  const auto has = [&](const char* key, int64_t dim) {
    return by_key.count(key) && by_key[key].defined() && by_key[key].dim() == dim;
  };
  using ckpt::kExpAvg, ckpt::kExpAvgSq, ckpt::kStep;
  if (!by_key.empty() && (by_key.size() != 3 || !has(kStep, 0) || !has(kExpAvg, 1) || !has(kExpAvgSq, 1)))
    throw std::invalid_argument(where + "the state is not torch Adam's (step, exp_avg, exp_avg_sq)");
  st.step = by_key.empty() ? at::Tensor() : by_key[kStep].to(st.master.options()).reshape({});
  st.exp_avg = by_key.empty() ? at::Tensor() : by_key[kExpAvg];
  st.exp_avg_sq = by_key.empty() ? at::Tensor() : by_key[kExpAvgSq];
}

bool Engine::Optimizer::has_lr_schedule() const { return e_.impl_->schedule.configured(); }
int64_t Engine::Optimizer::lr_schedule_iteration() const { return e_.impl_->schedule.last_batch_iteration(); }
double Engine::Optimizer::ScheduledLr(int64_t iteration, size_t group) const {
  return e_.impl_->schedule.LrAt(iteration, group);
}
void Engine::Optimizer::StepLrSchedule(std::optional<int64_t> iteration) {
  if (!has_lr_schedule()) throw std::logic_error("uckpt::Engine::StepLrSchedule: the config has no 'scheduler'");
  e_.impl_->schedule.Step(iteration);
  e_.impl_->ApplyScheduledBetas();
}
double Engine::Optimizer::loss_scale() const { return e_.impl_->runtime->loss_scale(); }
bool Engine::Optimizer::overflow() const { return e_.impl_->last_step_skipped; }

std::vector<std::vector<std::pair<std::string, at::Tensor>>> Engine::Optimizer::param_groups() const {
  std::vector<std::vector<std::pair<std::string, at::Tensor>>> out;
  for (const auto& g : e_.impl_->groups) {
    out.emplace_back();
    for (const auto& p : g) out.back().emplace_back(p.name, p.tensor);
  }
  return out;
}

// ---- Stats. ----

int64_t Engine::Stats::global_steps() const { return e_.impl_->global_steps; }
int64_t Engine::Stats::global_samples() const { return e_.impl_->global_samples; }
int64_t Engine::Stats::skipped_steps() const { return e_.impl_->skipped_steps; }
int64_t Engine::Stats::micro_steps() const { return e_.impl_->micro_steps; }
const StepInfo& Engine::Stats::last_step() const { return e_.impl_->last; }

bool Engine::Stats::last_step_applied() const { return e_.impl_->step_applied; }
const SaveStats& Engine::Stats::last_save() const { return e_.impl_->last_save; }
bool Engine::Stats::save_pending(bool memory_snapshot) const {
  const auto& w = memory_snapshot ? e_.impl_->snapshot_writer : e_.impl_->writer;
  return w && w->pending();
}
const LoadStats& Engine::Stats::last_load() const { return e_.impl_->last_load; }
Stage3Stats Engine::Stats::stage3_stats() const { return e_.impl_->runtime->stats(); }
void Engine::Stats::SetTiming(bool on) { e_.impl_->runtime->set_timing(on); }

// ---- Settings. ----

size_t Engine::Settings::num_gather_units() const { return e_.impl_->runtime->num_gather_units(); }
bool Engine::Settings::zero_gather_16bit_weights_on_model_save() const {
  return e_.impl_->config.zero.gather_16bit_weights_on_model_save;
}
int Engine::Settings::rank() const { return e_.impl_->comm->rank(); }
int Engine::Settings::world_size() const { return e_.impl_->comm->world_size(); }
int Engine::Settings::local_rank() const { return e_.impl_->local_rank; }
at::Device Engine::Settings::device() const { return e_.impl_->device; }
int Engine::Settings::zero_stage() const { return e_.impl_->stage(); }
int64_t Engine::Settings::train_batch_size() const { return e_.impl_->batch.train_batch_size; }
int64_t Engine::Settings::train_micro_batch_size_per_gpu() const { return e_.impl_->batch.micro_batch; }
int64_t Engine::Settings::gradient_accumulation_steps() const { return e_.impl_->batch.gradient_accumulation_steps; }
bool Engine::Settings::fp16_enabled() const { return e_.impl_->config.fp16.enabled; }
bool Engine::Settings::bf16_enabled() const { return e_.impl_->config.bf16; }
const std::vector<std::string>& Engine::Settings::warnings() const { return e_.impl_->config.warnings; }

void Engine::Settings::SetTrainBatchSize(int64_t train_batch_size) {
  engine::BatchSizes& b = e_.impl_->batch;
  const int64_t per_step = b.micro_batch * e_.impl_->comm->world_size();
  if (train_batch_size <= 0 || train_batch_size % per_step != 0)
    throw std::invalid_argument("set_train_batch_size: " + std::to_string(train_batch_size) +
                                " is not a multiple of train_micro_batch_size_per_gpu " +
                                std::to_string(b.micro_batch) + " * world size " +
                                std::to_string(e_.impl_->comm->world_size()));
  b.train_batch_size = train_batch_size;
  b.gradient_accumulation_steps = train_batch_size / per_step;
}

// ---- Weights (weights_io.h). ----

LoadWeightsResult Engine::Weights::LoadWeights(const std::string& path, const LoadWeightsOptions& options) {
  e_.WaitForUpdate();
  Impl& e = *e_.impl_;
  if (e.backward_pending)
    throw std::logic_error("LoadWeights: called between Backward and Step; load weights between optimizer steps");
  return engine::LoadWeights(e, *e.runtime, *e.comm, path, options);
}

bool Engine::Weights::Save16bitModel(const std::string& save_dir, const std::string& save_filename,
                                     bool exclude_frozen_parameters) {
  e_.WaitForUpdate();
  Impl& e = *e_.impl_;
  return engine::Save16bitModel(e, *e.runtime, *e.comm, e.stage(), e.config.zero.gather_16bit_weights_on_model_save,
                                save_dir, save_filename, exclude_frozen_parameters);
}

std::vector<std::pair<std::string, at::Tensor>> Engine::Weights::Zero3Consolidated16bitStateDict(
    bool exclude_frozen_parameters) {
  Impl& e = *e_.impl_;
  if (e.stage() != 3) throw std::invalid_argument("this function requires ZeRO-3 mode");
  return engine::Consolidated16bitStateDict(e, *e.runtime, *e.comm, exclude_frozen_parameters);
}

std::vector<std::pair<at::Tensor, at::Tensor>> Engine::Weights::ParameterPartitions() const {
  return e_.impl_->runtime->ParameterPartitions();
}

}  // namespace uckpt
