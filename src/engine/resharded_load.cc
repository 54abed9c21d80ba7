#include "engine/resharded_load.h"

#include <algorithm>
#include <iterator>
#include <map>
#include <set>
#include <stdexcept>

#include "ckpt/copy_plan.h"
#include "ckpt/deepspeed_names.h"
#include "ckpt/deepspeed_state.h"
#include "ckpt/universal_checkpoint.h"
#include "ckpt/zero_checkpoint.h"
#include "engine/staged_upload.h"
#include "engine/torch_bridge.h"
#include "format/error.h"

namespace uckpt::engine {

namespace {

// The parameters `slots` hold, each once, in slot order.
std::vector<std::string> SlotParams(const std::vector<PartitionSlot>& slots) {
  std::vector<std::string> names;
  std::set<std::string> seen;
  for (const PartitionSlot& slot : slots)
    for (const ckpt::TargetParam& p : slot.target.params)
      if (seen.insert(p.name).second) names.push_back(p.name);
  return names;
}

// The reads that fill `dst` with state `key` of `target`'s partition:
// straight into a CPU tensor of the source's dtype, else through staging
// chunks (staged_upload.h); padding is zeroed, nothing else.
TensorReads PlanLoad(const ckpt::ReadSource& source, const ckpt::PartitionTarget& target, const std::string& key,
                     at::Tensor dst) {
  ckpt::StateReads reads = ckpt::PlanStateReads(source, target, key);
  return {std::move(dst), ToScalarType(reads.dtype), std::move(reads.pieces)};
}

// Adam's step of a slot, as loading the converted checkpoint gives it: its
// step parameter's saved step, else (a source that keeps none) the applied steps.
double SavedStep(const LoadSource& source, const std::string& param, double applied_steps) {
  if (source.steps_applied) return applied_steps;
  for (const ckpt::ParamPlan& p : source.states.params)
    if (p.name == param) {
      if (!p.step) break;
      return ckpt::ScalarOf(p.step, source.optimizer_file + ": step of " + param);
    }
  throw FormatError(source.states.folder + ": the parameter group of " + param + " has no step");
}

// Whether `t` can be filled in place of a fresh empty_like(`like`).
bool SameLayout(const at::Tensor& t, const at::Tensor& like) {
  return t.defined() && t.sizes() == like.sizes() && t.scalar_type() == like.scalar_type() &&
         t.device() == like.device() && t.is_contiguous() && t.is_pinned() == like.is_pinned();
}

std::string KeyList(const std::vector<std::string>& keys) {
  std::string s;
  for (const auto& k : keys) s += (s.empty() ? "" : ", ") + k;
  return "{" + s + "}";
}

// A scalar state as the optimizer keeps it: a 0-d tensor of its dtype, a
// Python int or float as a 0-d int64 or float64 tensor (PartitionState::named).
at::Tensor ScalarTensor(const ValuePtr& v, const std::string& where) {
  const double x = ckpt::ScalarOf(v, where);
  if (v->kind == Kind::kInt) return at::full({}, static_cast<int64_t>(x), at::kLong);
  if (v->kind == Kind::kFloat) return at::full({}, x, at::kDouble);
  return at::full({}, x, ToScalarType(v->tensor->dtype));
}

// A client optimizer's state of `slot`: the saved step and other scalars of
// its step parameter, and every per-element state the source holds.
void PlanNamedLoads(const LoadSource& source, PartitionSlot& slot, double applied_steps,
                    std::vector<TensorReads>& loads) {
  PartitionState& st = *slot.state;
  st.named.clear();
  const ckpt::ParamPlan* plan = nullptr;
  for (const ckpt::ParamPlan& p : source.states.params)
    if (p.name == slot.step_param) plan = &p;
  const std::string where = source.optimizer_file + ": state of " + slot.step_param;
  if (plan && plan->step) {
    st.named.emplace_back(ckpt::kStep, ScalarTensor(plan->step, where + " 'step'"));
  } else if (source.steps_applied && ckpt::IsAdamStateKeys(source.state_keys) && (!plan || plan->scalars.empty())) {
    // Adam's keys from ZeRO-3 (RAdam's too) keep no step: the applied steps, as for Adam.
    st.named.emplace_back(ckpt::kStep, at::full({}, applied_steps, st.master.options().device(at::kCPU)));
  }
  if (plan) {
    for (const auto& [key, v] : plan->scalars) st.named.emplace_back(key, ScalarTensor(v, where + " '" + key + "'"));
    for (const auto& key : plan->none_states) st.named.emplace_back(key, at::Tensor());  // None, as saved
  }
  for (const std::string& key : source.state_keys) {
    at::Tensor t = at::empty_like(st.master);
    loads.push_back(PlanLoad(source.states, slot.target, key, t));
    st.named.emplace_back(key, t);
  }
}

// LoadSource::release for pieces of `files` (kept alive by the source's maps).
std::function<void(std::span<const uint8_t>)> PageDropper(const std::vector<TorchFile>& files) {
  std::map<const uint8_t*, const MappedFile*> by_start;
  for (const TorchFile& f : files)
    if (f.file && !f.file->bytes().empty()) by_start[f.file->bytes().data()] = f.file.get();
  return [by_start = std::move(by_start)](std::span<const uint8_t> piece) {
    auto it = by_start.upper_bound(piece.data());
    if (it == by_start.begin()) return;
    if (const MappedFile* f = std::prev(it)->second; f->Holds(piece)) f->DropPages(piece);
  };
}

}  // namespace

LoadSource OpenRankFiles(const ckpt::TagFolder& folder) {
  auto z = std::make_shared<ckpt::ZeroCheckpoint>(ckpt::OpenZeroCheckpoint(folder));
  LoadSource s;
  s.kind = SourceKind::kRankFiles;
  s.states = ckpt::ZeroReadSource(*z);
  // Stage 3 keeps Adam's state per parameter and no step; stages 1/2 a step per group.
  s.steps_applied = z->stage == 3;
  s.has_moments = z->stage == 3 ? ckpt::HasState(*z, ckpt::kExpAvg) && ckpt::HasState(*z, ckpt::kExpAvgSq)
                                : !z->params.empty() && z->params[0].step;
  s.state_keys = z->state_keys;
  s.optimizer_file = z->optim[0].file->path();
  s.files_layout = [z] { return ckpt::FingerprintLayout(*z); };
  // Rank 0's, as a universal folder holds it.
  const ckpt::UniversalOptimizerStateView saved =
      ckpt::ReadUniversalOptimizerStateValue(ckpt::UniversalOptimizerState(*z), s.optimizer_file);
  s.loss_scaler = saved.loss_scaler;
  s.param_groups = saved.param_groups;
  s.overflow = saved.overflow;
  s.maps = z;
  s.release = PageDropper(z->optim);
  return s;
}

LoadSource OpenUniversalFolder(const ckpt::TagFolder& folder, const std::vector<PartitionSlot>& slots, bool moments) {
  struct Maps {
    ckpt::UniversalCheckpoint u;
    ckpt::UniversalOptimizerFile optimizer;
    std::vector<TorchFile> files;
    std::vector<TorchFile> scalar_files;  // the step and other scalars read
  };
  auto maps = std::make_shared<Maps>();
  maps->u = ckpt::OpenUniversalCheckpoint(folder);
  const ckpt::UniversalCheckpoint& u = maps->u;
  maps->optimizer = ckpt::ReadUniversalOptimizerState(u);
  LoadSource s;
  s.kind = SourceKind::kUniversal;
  // Saved before any applied step (fp16 can skip the first steps): no moments.
  const auto& keys = u.state_keys;
  s.has_moments = moments && std::count(keys.begin(), keys.end(), ckpt::kExpAvg) &&
                  std::count(keys.begin(), keys.end(), ckpt::kExpAvgSq);
  std::vector<std::string> states{ckpt::kFp32};
  if (moments) {
    s.state_keys = keys;
    states.insert(states.end(), keys.begin(), keys.end());
  }
  ckpt::UniversalStates mapped = ckpt::MapUniversalStates(u, SlotParams(slots), states);
  s.states = std::move(mapped.source);
  maps->files = std::move(mapped.files);
  // A ZeRO-3-made folder has no step.pt: Adam's step is the applied steps.
  s.steps_applied = !u.has_step;
  if (moments)
    for (ckpt::ParamPlan& p : s.states.params)
      for (const PartitionSlot& slot : slots) {
        if (slot.step_param != p.name) continue;
        auto read = [&](const std::string& key) {
          ckpt::LoadedScalar v = ckpt::ReadUniversalScalar(u, p.name, key);
          maps->scalar_files.push_back(std::move(v.file));
          return v.value;
        };
        if (u.has_step && !p.step) p.step = read(ckpt::kStep);
        if (p.scalars.empty())
          for (const std::string& key : u.scalar_keys) p.scalars.emplace_back(key, read(key));
      }
  s.loss_scaler = maps->optimizer.loss_scaler;
  s.param_groups = maps->optimizer.param_groups;
  s.overflow = maps->optimizer.overflow;
  s.optimizer_file = ckpt::UniversalOptimizerStateFile(u.folder);
  s.files_layout = [maps] { return ckpt::FingerprintLayout(maps->u); };
  s.maps = maps;
  s.release = PageDropper(maps->files);
  return s;
}

LoadSource ModelStatesSource(const ckpt::ModelStatesView& m, const std::string& path,
                             const std::vector<PartitionSlot>& slots, bool moments) {
  LoadSource s;
  s.kind = SourceKind::kModelStates;
  // Stage 0's optimizer state is numbered over the parameters in the groups' order.
  s.states = ckpt::ModuleReadSource(m, path, SlotParams(slots));
  s.has_moments = ckpt::HasState(s.states, ckpt::kExpAvg) && ckpt::HasState(s.states, ckpt::kExpAvgSq);
  // The per-element keys the parameters' states hold (the first one's, in
  // file order); a parameter without one of them fails its read, naming it.
  for (const ckpt::ParamPlan& p : s.states.params) {
    if (p.states.size() <= 1) continue;
    for (size_t k = 1; k < p.states.size(); ++k) s.state_keys.push_back(p.states[k].key);
    break;
  }
  if (moments) s.param_groups = m.stage0_param_groups;
  s.optimizer_file = path;
  return s;
}

std::vector<TensorReads> PlanSlotLoads(const LoadSource& source, std::vector<PartitionSlot>& slots, bool moments,
                                       double applied_steps, bool named) {
  if (moments && !named && !source.state_keys.empty() && !source.has_moments)
    throw FormatError(source.optimizer_file + ": the optimizer state holds " + KeyList(source.state_keys) +
                      ", not Adam's (exp_avg, exp_avg_sq): it was saved by another optimizer than this run's");
  std::vector<TensorReads> loads;
  for (PartitionSlot& slot : slots) {
    const ckpt::PartitionTarget& target = slot.target;
    PartitionState& st = *slot.state;
    if (target.length != st.master.numel()) throw std::logic_error("load: partition sizes differ from the optimizer's");
    loads.push_back(PlanLoad(source.states, target, ckpt::kFp32, st.master));
    if (!moments) continue;
    if (named) {
      PlanNamedLoads(source, slot, applied_steps, loads);
      continue;
    }
    if (!source.has_moments) {
      st.step = st.exp_avg = st.exp_avg_sq = at::Tensor();
      continue;
    }
    // Filled in place where they exist: a resume holds one set of moments, not two.
    for (at::Tensor* t : {&st.exp_avg, &st.exp_avg_sq})
      if (!SameLayout(*t, st.master)) *t = at::empty_like(st.master);
    loads.push_back(PlanLoad(source.states, target, ckpt::kExpAvg, st.exp_avg));
    loads.push_back(PlanLoad(source.states, target, ckpt::kExpAvgSq, st.exp_avg_sq));
    st.step = at::full({}, SavedStep(source, slot.step_param, applied_steps), st.master.options());
  }
  return loads;
}

}  // namespace uckpt::engine
