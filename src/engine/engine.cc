// uckpt::Engine: wraps a module for ZeRO data parallelism (engine_impl.h has
// the state; checkpoint.cc saves and loads it).
#include <c10/core/GradMode.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <map>
#include <set>
#include <stdexcept>

#include "ckpt/state_keys.h"
#include "engine/async_save.h"
#include "engine/checkpoint.h"
#include "engine/dist/agree.h"
#include "engine/engine_access.h"
#include "engine/engine_impl.h"
#include "engine/fingerprint.h"
#include "engine/host_threads.h"
#include "engine/runtime_setup.h"

namespace uckpt {

Config Config::FromFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error(path + ": cannot read the config file");
  Config c;
  try {
    c.json = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    throw std::runtime_error(path + ": not valid JSON: " + e.what());
  }
  c.source = path;
  return c;
}

Config Config::FromJson(nlohmann::json j, std::string source) {
  Config c;
  c.json = std::move(j);
  c.source = std::move(source);
  return c;
}

namespace {

using engine::TrainConfig;

std::string Join(const std::string& prefix, const std::string& name) {
  return prefix.empty() ? name : prefix + "." + name;
}

// PyTorch's state_dict order: each module's parameters, then its buffers,
// then its children's, depth first. Also lists every module's prefix.
void WalkModule(const torch::nn::Module& m, const std::string& prefix, std::vector<std::string>& names,
                std::vector<NamedParam>& buffers, std::vector<std::string>& prefixes) {
  prefixes.push_back(prefix);
  for (const auto& p : m.named_parameters(/*recurse=*/false)) names.push_back(Join(prefix, p.key()));
  for (const auto& b : m.named_buffers(/*recurse=*/false)) {
    names.push_back(Join(prefix, b.key()));
    buffers.push_back({Join(prefix, b.key()), b.value()});
  }
  for (const auto& c : m.named_children()) WalkModule(*c.value(), Join(prefix, c.key()), names, buffers, prefixes);
}

// Under mpirun or srun: MASTER_PORT where set, else DeepSpeed's 29500 (C++ has no distributed_port).
int DiscoveryPort() {
  const char* p = std::getenv("MASTER_PORT");
  return p && *p ? std::atoi(p) : 29500;
}

int LocalRankFromEnvironment() {
  const char* v = std::getenv("LOCAL_RANK");
  if (v && *v) return std::atoi(v);
  auto env = DistEnv::FromEnvironment();  // an MPI or Slurm launcher's
  return env ? env->local_rank : 0;
}

engine::OptimizerConfig GroupOptimizer(const engine::OptimizerConfig& base, const ParamGroup& g) {
  engine::OptimizerConfig o = base;
  if (g.lr) o.lr = *g.lr;
  if (g.weight_decay) o.weight_decay = *g.weight_decay;
  if (g.beta1) o.beta1 = *g.beta1;
  if (g.beta2) o.beta2 = *g.beta2;
  if (g.eps) o.eps = *g.eps;
  return o;
}

}  // namespace

std::shared_ptr<Comm> engine::CommFromEnvironment(const TrainConfig& c, bool cuda) {
  auto env = DistEnv::FromEnvironment(true, DiscoveryPort());
  if (!env || env->world_size <= 1) return MakeSingleProcessComm();
  const HeartbeatSettings heartbeat{c.heartbeat_interval_s, c.heartbeat_timeout_s};
  return ConnectC10d(*env, std::chrono::minutes(30), cuda, heartbeat);
}

// ---- Construction: parameters sorted into groups, frozen, tied, buffers. ----

namespace {

// Trainable parameters into groups (the user's, or one), the rest frozen;
// a tensor seen again under another name is a tied alias.
void SortParameters(Engine::Impl& e, const std::vector<ParamGroup>& user_groups,
                    std::vector<engine::GroupSpec>& specs) {
  std::map<const void*, std::string> owner_of;  // TensorImpl -> first name
  std::vector<NamedParam> trainable, in_order;
  for (const auto& p : e.model->named_parameters(/*recurse=*/true)) {
    const void* key = p.value().unsafeGetTensorImpl();
    if (auto it = owner_of.find(key); it != owner_of.end()) {
      e.aliases.emplace_back(p.key(), it->second);
      continue;
    }
    owner_of[key] = p.key();
    in_order.push_back({p.key(), p.value()});
    (p.value().requires_grad() ? trainable : e.frozen).push_back(in_order.back());
  }
  if (trainable.empty()) throw std::invalid_argument("uckpt::Engine: the module has no parameter that requires grad");
  if (user_groups.empty()) {
    e.groups.push_back(trainable);
    specs.push_back({{}, e.config.optimizer, {}, {}});
    return;
  }
  std::set<const void*> placed;
  for (size_t g = 0; g < user_groups.size(); ++g) {
    std::vector<NamedParam> group;
    for (const at::Tensor& t : user_groups[g].params) {
      const void* key = t.unsafeGetTensorImpl();
      auto it = owner_of.find(key);
      if (it == owner_of.end())
        throw std::invalid_argument("uckpt::Engine: param_groups[" + std::to_string(g) +
                                    "] holds a tensor that is not a parameter of the module");
      if (!t.requires_grad())
        throw std::invalid_argument("uckpt::Engine: param_groups[" + std::to_string(g) + "] holds " + it->second +
                                    ", which does not require grad (frozen parameters stay out of the optimizer)");
      if (!placed.insert(key).second)
        throw std::invalid_argument("uckpt::Engine: parameter " + it->second + " is in more than one param group");
      group.push_back({it->second, t});
    }
    if (group.empty()) throw std::invalid_argument("uckpt::Engine: param_groups[" + std::to_string(g) + "] is empty");
    e.groups.push_back(std::move(group));
    specs.push_back({{}, GroupOptimizer(e.config.optimizer, user_groups[g]), {}, {}});
  }
  // A trainable parameter in no group: DeepSpeed's optimizer never updates it
  // (autograd still gives it a local .grad), so at stages 0-2 it is kept as a
  // frozen one. ZeRO-3 would partition it with no optimizer state to restore
  // it from, which uckpt refuses.
  std::set<const void*> left_out;
  for (const auto& p : trainable) {
    if (placed.count(p.tensor.unsafeGetTensorImpl())) continue;
    if (e.config.zero.stage == 3)
      throw std::invalid_argument("uckpt::Engine: trainable parameter " + p.name +
                                  " is in no param group; at ZeRO stage 3 uckpt refuses that (DeepSpeed partitions it "
                                  "and never updates or saves its values): add it to a group or set requires_grad "
                                  "false to freeze it");
    left_out.insert(p.tensor.unsafeGetTensorImpl());
  }
  if (left_out.empty()) return;
  e.frozen.clear();  // again, in the module's order
  for (const auto& p : in_order)
    if (!p.tensor.requires_grad() || left_out.count(p.tensor.unsafeGetTensorImpl())) e.frozen.push_back(p);
}

// As Python's module.half()/bfloat16(): floating parameters and buffers
// change dtype, others (int position ids) stay; ties survive (set_data). At
// fp32 DeepSpeed casts nothing: buffers keep their dtype (parameters become
// fp32, the flat buffers' dtype).
void CastFloatingTensors(torch::nn::Module& m, at::ScalarType dtype) {
  c10::NoGradGuard no_grad;
  for (auto t : m.parameters(/*recurse=*/true))
    if (t.is_floating_point() && t.scalar_type() != dtype) t.set_data(t.to(dtype));
  if (dtype == at::kFloat) return;
  for (auto t : m.buffers(/*recurse=*/true))
    if (t.is_floating_point() && t.scalar_type() != dtype) t.set_data(t.to(dtype));
}

// Stage 0 in bf16 with a client optimizer, where DeepSpeed wraps it in its
// BF16_Optimizer, which uckpt does not reproduce (the config's Adam at stage 0
// in bf16 is uckpt's, as DeepSpeed's layout). fp16 at stage 0 is DeepSpeed's
// FP16_Optimizer / FP16_UnfusedOptimizer (fp16_stage0.cc).
void RefuseStage0Wrappers(const TrainConfig& c, const EngineOptions& options) {
  if (c.zero.stage != 0) return;
  if (c.bf16 && options.optimizer_step)
    throw std::invalid_argument(
        "ZeRO stage 0 in bf16 with an optimizer other than Adam/AdamW is not supported by uckpt (DeepSpeed wraps it in "
        "its BF16_Optimizer); use fp32 at stage 0, or stage 1, 2 or 3");
}

}  // namespace

Engine::Engine(std::shared_ptr<torch::nn::Module> model, const Config& config, EngineOptions options)
    : impl_(std::make_unique<Impl>(engine::ParseConfig(config.json, config.source))) {
  Init(std::move(model), std::move(options));
}

Engine::Engine(std::shared_ptr<torch::nn::Module> model, std::unique_ptr<Impl> state, EngineOptions options)
    : impl_(std::move(state)) {
  Init(std::move(model), std::move(options));
}

std::unique_ptr<Engine> engine::EngineAccess::Make(std::shared_ptr<torch::nn::Module> model, const TrainConfig& config,
                                                   EngineOptions options) {
  return std::unique_ptr<Engine>(
      new Engine(std::move(model), std::make_unique<Engine::Impl>(config), std::move(options)));
}

void Engine::Init(std::shared_ptr<torch::nn::Module> model, EngineOptions options) {
  Impl& e = *impl_;
  if (!model) throw std::invalid_argument("uckpt::Engine: no module");
  e.model = std::move(model);
  // Before any communicator is made: a ZeroInit scope's partitions not handed
  // over would otherwise meet a second communicator on the same port first.
  engine::RefuseTensorsWithoutValues(*e.model, options);
  const TrainConfig& c = e.config;
  const bool cuda = options.device == "cuda";
  if (!cuda && options.device != "cpu")
    throw std::invalid_argument("uckpt::Engine: device must be cpu or cuda, got " + options.device);
  e.owns_comm = !options.comm || options.finish_comm;
  e.comm = options.comm ? options.comm : engine::CommFromEnvironment(c, cuda);
  e.local_rank = options.local_rank >= 0 ? options.local_rank : LocalRankFromEnvironment();
  engine::ApplyHostThreads(options.host_threads, "EngineOptions::host_threads =",
                           "set OMP_NUM_THREADS or EngineOptions::host_threads to change", e.comm->rank() == 0);
  e.batch = engine::ResolveBatchSizes(c.train_batch_size, c.train_micro_batch_size_per_gpu,
                                      c.gradient_accumulation_steps, e.comm->world_size());
  if (cuda) {
    if (!at::hasCUDA())
      throw std::invalid_argument("uckpt::Engine: device cuda, but this libtorch has no CUDA or no GPU is visible");
    e.device = at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(e.local_rank));
    // This rank's GPU becomes the current device, as DeepSpeed's engine makes
    // it: tensors the caller creates without an index land there too.
    c10::impl::getDeviceGuardImpl(at::kCUDA)->setDevice(e.device);
  }
  RefuseStage0Wrappers(c, options);
  if (c.fp16.enabled && e.device.is_cpu()) {
    try {  // libtorch 1.13 has no CPU fp16 kernels for LayerNorm and friends.
      at::layer_norm(at::zeros({1, 2}, at::kHalf), {2});
    } catch (const std::exception&) {
      throw std::invalid_argument("fp16 training needs CUDA or a libtorch with CPU fp16 kernels; on this CPU use bf16");
    }
  }
  engine::CheckZeroStage(c.zero.stage, "uckpt::Engine");  // a TrainConfig made by hand
  engine::PreparePartitionedParameters({*e.comm, e.config, e.device, e}, options);
  e.model->to(e.device);
  CastFloatingTensors(*e.model, engine::ModelDtype(c));

  std::vector<engine::GroupSpec> specs;
  SortParameters(e, options.param_groups, specs);
  WalkModule(*e.model, "", e.state_names, e.buffers, e.module_prefixes);
  std::vector<double> group_lrs;
  for (size_t g = 0; g < e.groups.size(); ++g) {
    for (const auto& p : e.groups[g]) {
      specs[g].numels.push_back(p.tensor.numel());
      specs[g].names.push_back(p.name);
      specs[g].shapes.push_back(p.tensor.sizes().vec());
    }
    group_lrs.push_back(specs[g].optimizer.lr);
  }
  e.schedule.set_group_lrs(std::move(group_lrs));
  // OneCycle's constructor writes its first betas into every group.
  if (const auto& b = e.schedule.current_betas())
    for (auto& spec : specs) spec.optimizer.beta1 = b->first, spec.optimizer.beta2 = b->second;
  e.client_optimizer = static_cast<bool>(options.optimizer_step);
  e.client_param_group = options.optimizer_param_group;
  e.stage0_fp16 = engine::Stage0Fp16Of(c, e.client_optimizer, options.forward_only);
  e.runtime = engine::MakeShardedRuntime({*e.comm, e.config, e.device, e}, std::move(specs), options);
  e.model->train(true);
}

Engine::~Engine() {
  // A background save is not published here: that is collective, and other
  // ranks may be gone. Its files are finished; the next save removes them.
  // (A published save's sync ends in the writer's destructor; its marker may
  // stay, async_save.h.)
  if (impl_ && impl_->writer && impl_->writer->pending() && !impl_->writer->syncing())
    std::fprintf(stderr,
                 "uckpt: a background checkpoint save was not published (call WaitForCheckpoint before the end)\n");
  // Not while an exception unwinds: the other ranks may be gone.
  if (impl_ && impl_->owns_comm && std::uncaught_exceptions() == 0) impl_->comm->Finish();
}

void Engine::Backward(const at::Tensor& loss, const BackwardOptions& options) {
  Impl& e = *impl_;
  if (loss.numel() != 1) throw std::invalid_argument("uckpt::Engine::Backward: the loss must be a scalar");
  // DeepSpeed scales each micro loss by 1/GA unless told not to (and by the fp16 loss scale).
  const int64_t ga = e.batch.gradient_accumulation_steps;
  e.runtime->WaitForUpdate();
  // In fp16 the loss is scaled in fp32, as DeepSpeed's optimizers take loss.float().
  at::Tensor scaled = e.config.fp16.enabled ? loss.to(at::kFloat) : loss;
  if (ga > 1 && options.scale_wrt_gas) scaled = scaled / ga;
  scaled = scaled * e.runtime->loss_scale();
  e.runtime->BeginMicroStep(e.boundary());
  e.runtime->PrepareBackward();
  scaled.backward({}, options.retain_graph);
  e.runtime->FinishBackward(e.boundary());
  e.backward_pending = true;
}

void Engine::Step(const StepOptions& options) {
  Impl& e = *impl_;
  if (!e.backward_pending) throw std::logic_error("uckpt::Engine::Step: call Backward(loss) first");
  e.runtime->WaitForUpdate();
  e.backward_pending = false;
  e.step_applied = false;
  if (e.boundary()) {
    // A background save: published once every rank's files are durable;
    // its failure stops the run here, naming the file.
    for (auto* w : {&e.writer, &e.snapshot_writer})
      if (*w && (*w)->pending()) (*w)->PublishIfDone(*e.comm);
    const std::vector<double>& lrs = e.schedule.current_lrs();
    const engine::StepResult r = e.runtime->Step(lrs);
    if (!r.skipped) {
      e.schedule.Step(options.lr_schedule_iteration);
      e.ApplyScheduledBetas();
    }
    e.last = StepInfo{r.grad_norm, r.skipped, r.loss_scale};
    ++e.global_steps;
    e.global_samples += e.batch.train_batch_size;
    if (r.skipped) ++e.skipped_steps;
    e.last_step_skipped = r.skipped;
    e.step_applied = !r.skipped;
  }
  ++e.micro_steps;
}

void Engine::OptimizerStep() {
  Impl& e = *impl_;
  e.runtime->WaitForUpdate();
  e.runtime->StepFromParameterGradients(e.schedule.current_lrs());
}

void Engine::WaitForUpdate() { impl_->runtime->WaitForUpdate(); }

bool Engine::IsGradientAccumulationBoundary() const { return impl_->boundary(); }
void Engine::SetGradientAccumulationBoundary(std::optional<bool> is_boundary) {
  impl_->boundary_override = is_boundary;
}

namespace {

// What the checkpoint code takes of the engine's state (checkpoint.h).
engine::CheckpointState CheckpointStateOf(Engine::Impl& e, bool save_without_frozen, bool memory_snapshot = false) {
  return {*e.comm,
          e.config,
          e,
          *e.runtime,
          e,
          e.schedule,
          e.batch,
          e.client_optimizer,
          e.client_param_group,
          e.stage0_fp16,
          save_without_frozen,
          memory_snapshot,
          memory_snapshot ? e.snapshot_writer : e.writer,
          e.last_save,
          e.last_load};
}

}  // namespace

std::string Engine::SaveCheckpoint(const std::string& dir, const std::string& tag, const ClientState& client_state,
                                   const SaveCheckpointOptions& options) {
  WaitForUpdate();
  const auto at = engine::AgreeOnCheckpointPlace(*impl_->comm, dir, tag, "save_checkpoint",
                                                 impl_->config.checkpoint_tag_validation == "FAIL");
  impl_->schedule.client_state_to_save = options.lr_scheduler_state;
  const std::string tag_or_step = at.tag.empty() ? "global_step" + std::to_string(impl_->global_steps) : at.tag;
  const bool async = options.memory_snapshot || options.async_save.value_or(impl_->config.async_save);
  return engine::SaveEngineCheckpoint(
      CheckpointStateOf(*impl_, options.exclude_frozen_parameters, options.memory_snapshot), at.dir, tag_or_step,
      client_state, async);
}

void Engine::WaitForCheckpoint() {
  for (auto* w : {&impl_->writer, &impl_->snapshot_writer})
    if (*w) (*w)->Publish(*impl_->comm);
}

c10::IValue Engine::OptimizerStateDict() {
  WaitForUpdate();  // the partitions as the last step left them
  return engine::OptimizerStateDict(CheckpointStateOf(*impl_, false));
}

LoadResult Engine::LoadCheckpoint(const std::string& dir, const std::string& tag,
                                  const LoadCheckpointOptions& options) {
  // A load of weights and optimizer state replaces what a failed overlapped update left partly stepped.
  if (options.load_optimizer_states && !options.load_module_only) impl_->runtime->ForgetFailedUpdate();
  else WaitForUpdate();
  WaitForCheckpoint();  // a background save first: it may be the one to load
  impl_->last_load = {};
  const auto at = engine::AgreeOnCheckpointPlace(*impl_->comm, dir, tag, "load_checkpoint");
  LoadResult r = engine::LoadEngineCheckpoint(CheckpointStateOf(*impl_, false), at.dir, at.tag, options);
  // The restored scheduler position's betas (OneCycle), unless the saved ones are kept.
  if (!r.path.empty() && options.load_optimizer_states && !options.keep_saved_hparams && !options.load_module_only)
    impl_->ApplyScheduledBetas();
  return r;
}

void Engine::Train(bool on) {
  WaitForUpdate();  // (evaluation code may read weights outside the units)
  impl_->model->train(on);
}
at::Tensor Engine::EnterUnit(size_t unit, const at::Tensor& input) { return impl_->runtime->EnterUnit(unit, input); }
at::Tensor Engine::ExitUnit(size_t unit, const at::Tensor& output) { return impl_->runtime->ExitUnit(unit, output); }
UnitCalls Engine::unit_calls() {
  if (!impl_->runtime->uses_unit_calls()) return {};
  std::weak_ptr<int> alive = impl_->alive;
  auto check = [alive] {
    if (alive.expired())
      throw std::logic_error(
          "uckpt: a ZeRO-3 unit call after its Engine was destroyed (the module's parameters "
          "were partitioned by it; keep the Engine alive while the module runs)");
  };
  return UnitCalls{[this, check](size_t u, const at::Tensor& x) {
                     check();
                     return EnterUnit(u, x);
                   },
                   [this, check](size_t u, const at::Tensor& y) {
                     check();
                     return ExitUnit(u, y);
                   }};
}
void Engine::GatherParameters() {
  WaitForUpdate();
  impl_->runtime->GatherAll();
}

void Engine::ReleaseParameters() { impl_->runtime->ReleaseAll(); }

namespace {

// GatheredParameters' tensors that are the engine's whole frozen parameters
// (in the engine's order).
std::vector<NamedParam> FrozenAmong(const Engine::Impl& e, const std::vector<at::Tensor>& ts) {
  std::set<const void*> given;
  for (const auto& t : ts) given.insert(t.unsafeGetTensorImpl());
  std::vector<NamedParam> frozen;
  for (const auto& p : e.frozen)
    if (given.count(p.tensor.unsafeGetTensorImpl())) frozen.push_back(p);
  return frozen;
}

}  // namespace

void Engine::GatherParameters(const std::vector<at::Tensor>& params) {
  WaitForUpdate();
  Impl& e = *impl_;
  if (!e.runtime->partitions_parameters()) return;
  e.runtime->GatherParameters(params);
  const std::vector<NamedParam> frozen = FrozenAmong(e, params);
  // uckpt keeps frozen parameters whole; DeepSpeed's are partitioned, so a
  // write to one is discarded unless a modifier rank keeps it: remember it.
  c10::NoGradGuard no_grad;
  for (const auto& p : frozen) e.gathered_frozen[p.tensor.unsafeGetTensorImpl()].push_back(p.tensor.clone());
}

void Engine::ReleaseParameters(const std::vector<at::Tensor>& params, int modifier_rank) {
  Impl& e = *impl_;
  if (!e.runtime->partitions_parameters()) return;
  e.runtime->ReleaseParameters(params, modifier_rank);
  const std::vector<NamedParam> frozen = FrozenAmong(e, params);
  c10::NoGradGuard no_grad;
  for (const auto& p : frozen) {
    auto it = e.gathered_frozen.find(p.tensor.unsafeGetTensorImpl());
    if (it == e.gathered_frozen.end() || it->second.empty()) continue;
    at::Tensor before = std::move(it->second.back());
    it->second.pop_back();
    if (it->second.empty()) e.gathered_frozen.erase(it);
    if (modifier_rank < 0) {
      p.tensor.copy_(before);
    } else if (e.comm->world_size() > 1) {
      at::Tensor t = p.tensor.contiguous();
      e.comm->Broadcast(t, modifier_rank);
      if (!t.is_same(p.tensor)) p.tensor.copy_(t);
    }
  }
}

std::shared_ptr<torch::nn::Module> Engine::module() const { return impl_->model; }
Comm& Engine::comm() { return *impl_->comm; }

}  // namespace uckpt
