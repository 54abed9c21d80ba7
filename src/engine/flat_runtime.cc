#include "engine/flat_runtime.h"

#include <c10/core/Event.h>
#include <c10/core/GradMode.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <stdexcept>

#include "engine/cpu_adam.h"
#include "engine/grad_numerics.h"
#include "engine/host_grad_copy.h"
#include "engine/overlap_reducer.h"
#include "engine/pinned_host.h"
#include "engine/unit_pipeline.h"

namespace uckpt::engine {
namespace {

// Elements per overlapped host<->device copy (16 MiB of fp32): large enough
// for the copy engine's full speed, small enough that the first chunk's
// host work starts early.
constexpr int64_t kCopyChunk = int64_t{1} << 22;

// Elements per bucket of gradients copied to the host during backward (8 MiB
// of bf16; reduce_bucket_size when smaller): a copy starts soon after its
// gradients are done, and one event pair per bucket costs nothing next to it.
constexpr int64_t kHostCopyBucket = int64_t{1} << 22;

// Side streams of `device` for the offload copies, one per staging slot,
// starting after the work queued on the current stream (which produced or
// last read the device buffers). Waiting for a slot's stream is waiting for
// that slot's last copy.
class CopyStreams {
 public:
  CopyStreams(at::Device device, size_t slots) {
    c10::impl::VirtualGuardImpl impl(device.type());
    impl.getStream(device).synchronize();
    for (size_t k = 0; k < slots; ++k) streams_.push_back(impl.getStreamFromGlobalPool(device));
  }
  ~CopyStreams() {
    for (const c10::Stream& s : streams_) {
      try {
        s.synchronize();
      } catch (...) {
        // An error is already on its way out.
      }
    }
  }
  const c10::Stream& operator[](size_t k) const { return streams_[k % streams_.size()]; }
  void Wait(size_t k) const { (*this)[k].synchronize(); }
  void WaitAll() const {
    for (const c10::Stream& s : streams_) s.synchronize();
  }

 private:
  std::vector<c10::Stream> streams_;
};

// Two reused pinned host buffers of `n` elements of `dtype` in `slots`.
void EnsureStaging(std::vector<at::Tensor>& slots, int64_t n, at::ScalarType dtype) {
  if (slots.size() == 2 && slots[0].numel() >= n && slots[0].scalar_type() == dtype) return;
  slots.clear();
  for (int k = 0; k < 2; ++k)
    slots.push_back(at::empty({n}, at::TensorOptions().dtype(dtype).device(at::kCPU).pinned_memory(true)));
}

// DeepSpeed's per-fragment gradient norms of `partition`, on its device
// (grad_numerics.h), converting up to `span` elements to fp64 at once; empty
// when this rank holds no fragment.
at::Tensor FragmentNorms(const std::vector<ckpt::Fragment>& fragments, const at::Tensor& partition, int64_t span) {
  std::vector<GradPiece> pieces;
  pieces.reserve(fragments.size());
  for (const ckpt::Fragment& f : fragments) pieces.push_back({f.partition_offset, f.numel});
  return PieceNorms(partition, pieces, partition.device(), span);
}

// sum += part (a 16-bit or fp32 tensor as long), `chunk` elements at a time:
// each piece widened exactly and added, as a whole fp32 copy of `part` would
// be, with a piece's temporary at most (on the CPU the widening is a copy).
void AddWidened(const at::Tensor& sum, const at::Tensor& part, int64_t chunk) {
  const int64_t n = sum.numel(), c = chunk > 0 ? chunk : std::max<int64_t>(n, 1);
  for (int64_t begin = 0; begin < n; begin += c) {
    const int64_t len = std::min(c, n - begin);
    sum.narrow(0, begin, len).add_(part.narrow(0, begin, len));
  }
}

}  // namespace

FlatRuntime::FlatRuntime(Comm& comm, std::vector<int64_t> numels, ZeroSettings settings, at::Device device)
    : FlatRuntime(comm, std::vector<GroupSpec>{GroupSpec{std::move(numels), settings.optimizer, {}, {}}}, settings,
                  device) {}

FlatRuntime::FlatRuntime(Comm& comm, std::vector<GroupSpec> specs, ZeroSettings settings, at::Device device)
    : comm_(comm), s_(std::move(settings)) {
  if (s_.stage < 0 || s_.stage > 2) throw std::invalid_argument("ZeRO stage must be 0, 1 or 2");
  if (specs.empty()) throw std::invalid_argument("FlatRuntime: no parameter group");
  const int dp = s_.stage == 0 ? 1 : comm_.world_size();
  auto model_opts = at::TensorOptions().dtype(s_.model_dtype).device(device);
  at::Device opt_device = s_.offload_optimizer_cpu ? at::Device(at::kCPU) : device;
  groups_.resize(specs.size());
  for (size_t gi = 0; gi < specs.size(); ++gi) {
    Group& g = groups_[gi];
    g.numels = std::move(specs[gi].numels);
    g.optimizer = specs[gi].optimizer;
    g.names = std::move(specs[gi].names);
    g.shapes = std::move(specs[gi].shapes);
    g.names.resize(g.numels.size());
    for (size_t k = g.shapes.size(); k < g.numels.size(); ++k) g.shapes.push_back({g.numels[k]});
    g.layout = ckpt::MakeFlatLayout(std::accumulate(g.numels.begin(), g.numels.end(), int64_t{0}), dp);
    g.offsets = ckpt::FlatOffsets(g.numels);
    g.fragments = ckpt::RankFragments(g.numels, dp, partition_rank());
    g.fragment_of.assign(g.numels.size(), -1);
    for (size_t i = 0; i < g.fragments.size(); ++i) g.fragment_of[g.fragments[i].param] = static_cast<int>(i);
    g.model_flat = at::zeros({g.layout.padded_numel}, model_opts);
    g.grad_flat = at::zeros({g.layout.padded_numel}, model_opts);
    // One rank holds the whole gradient: nothing to reduce, so it goes to the host during backward.
    if (s_.offload_optimizer_cpu && comm_.world_size() == 1)
      g.host_copy =
          std::make_unique<BucketedHostCopy>(g.numels, g.grad_flat, std::min(kHostCopyBucket, s_.reduce_bucket_size));
    // Pinned under offload to a GPU: the updated weights go up straight from it.
    g.state.master =
        s_.offload_optimizer_cpu && !device.is_cpu()
            ? PinnedHostZeros({g.layout.partition_size}, at::kFloat)
            : at::zeros({g.layout.partition_size}, at::TensorOptions().dtype(at::kFloat).device(opt_device));
  }
  if (s_.model_dtype == at::kHalf) scaler_ = LossScaler::FromConfig(s_.fp16);
  if (s_.stage0_fp16 != Stage0Fp16::kNone)
    scaler_ = LossScaler::ForFp16Optimizer(s_.fp16, s_.stage0_fp16 == Stage0Fp16::kFused);
}

// The overlapped update's device side: two side streams for the uploads with
// a pinned staging slot each (the weights in the model dtype, written by the
// update pass), and per unit an event on each stream after its last upload.
struct FlatRuntime::Uploads {
  at::Device device;
  std::vector<c10::Stream> streams;
  std::vector<at::Tensor> staging;                  // [kCopyChunk], model dtype, pinned; slot k on streams[k]
  std::vector<std::unique_ptr<c10::Event>> events;  // unit u: 2u (stream 0), 2u + 1 (stream 1)
  c10::Event compute_done;
  size_t next_slot = 0;

  Uploads(at::Device d, size_t units, at::ScalarType dtype) : device(d), compute_done(d.type()) {
    c10::impl::VirtualGuardImpl impl(d.type());
    for (int k = 0; k < 2; ++k) streams.push_back(impl.getStreamFromGlobalPool(d));
    if (dtype != at::kFloat) EnsureStaging(staging, kCopyChunk, dtype);  // (fp32 goes up from the pinned masters)
    for (size_t k = 0; k < 2 * units; ++k) events.push_back(std::make_unique<c10::Event>(d.type()));
  }
  // The uploads start after the work queued so far on the current stream
  // (the last backward, which read the weights they overwrite).
  void AfterCompute() {
    c10::impl::VirtualGuardImpl impl(device.type());
    compute_done.record(impl.getStream(device));
    for (const c10::Stream& s : streams) compute_done.block(s);
  }
  // The current stream's next work waits for unit u's uploads.
  void ComputeWaitsFor(size_t u) {
    c10::impl::VirtualGuardImpl impl(device.type());
    const c10::Stream current = impl.getStream(device);
    for (int k = 0; k < 2; ++k) events[2 * u + k]->block(current);
  }
  void Synchronize() {
    for (const c10::Stream& s : streams) s.synchronize();
  }
};

FlatRuntime::~FlatRuntime() {
  // The module may outlive the engine: every unit updated, as a synchronous step leaves it.
  if (pipeline_) try {
      pipeline_->WaitAll();
    } catch (...) {
      // Its error was the caller's to see at a wait; nothing is left to do with it here.
    }
  pipeline_.reset();  // joins the update's thread
  if (uploads_) {
    try {
      uploads_->Synchronize();  // no upload outlives its staging
    } catch (...) {
      // An error is already on its way out.
    }
  }
}

bool FlatRuntime::OverlapUpdateWithForward(const std::vector<std::vector<int>>& unit_of, size_t num_units) {
  if (!s_.offload_optimizer_cpu || s_.stage < 1 || comm_.world_size() != 1 || s_.optimizer_step || num_units == 0)
    return false;
  if (unit_of.size() != groups_.size()) throw std::invalid_argument("OverlapUpdateWithForward: wrong group count");
  // Each unit's ranges of each group's partition (the whole flat buffer at
  // one rank): runs of consecutive parameters of one unit; the padding and
  // parameters in no unit are the root's.
  unit_pieces_.assign(num_units + 1, {});
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    const Group& g = groups_[gi];
    if (unit_of[gi].size() != g.numels.size())
      throw std::invalid_argument("OverlapUpdateWithForward: wrong parameter count");
    auto add = [&](size_t u, int64_t begin, int64_t end) {
      if (begin == end) return;
      std::vector<Piece>& pieces = unit_pieces_[u];
      if (!pieces.empty() && pieces.back().group == gi && pieces.back().end == begin) {
        pieces.back().end = end;
      } else {
        pieces.push_back({gi, begin, end});
      }
    };
    for (size_t k = 0; k < g.numels.size(); ++k) {
      const int u = unit_of[gi][k];
      if (u >= static_cast<int>(num_units)) throw std::out_of_range("OverlapUpdateWithForward: unit out of range");
      add(static_cast<size_t>(u + 1), g.offsets[k], g.offsets[k] + g.numels[k]);
    }
    add(0, g.layout.numel, g.layout.padded_numel);
  }
  const at::Device device = groups_.front().model_flat.device();
  if (!device.is_cpu()) uploads_ = std::make_unique<Uploads>(device, num_units + 1, s_.model_dtype);
  pipeline_ = std::make_unique<UnitPipeline>([this](size_t i) {
    if (before_unit_update_) before_unit_update_(i);
    UpdateUnit(i + 1);
  });
  return true;
}

void FlatRuntime::AwaitUpdate() const {
  if (!pipeline_) return;
  RefuseAfterFailedUpdate();
  try {
    pipeline_->WaitAll();
  } catch (const std::exception& e) {
    UpdateFailed(e);
  }
  if (uploads_) uploads_->Synchronize();  // the staging and the masters may be written next
}

void FlatRuntime::ForgetFailedUpdate() {
  if (!pipeline_) return;
  try {
    pipeline_->WaitAll();
  } catch (const std::exception&) {
    // The load replaces what it left partly stepped.
  }
  if (uploads_) uploads_->Synchronize();
  failed_update_.clear();
}

void FlatRuntime::UpdateFailed(const std::exception& error) const {
  failed_update_ = std::string("uckpt: the optimizer update overlapped with the forward failed (") + error.what() +
                   "); the weights and optimizer state are partly stepped: load a checkpoint to go on";
  throw std::runtime_error(failed_update_);
}

void FlatRuntime::RefuseAfterFailedUpdate() const {
  if (!failed_update_.empty()) throw std::runtime_error(failed_update_);
}

at::Tensor FlatRuntime::EnterUnit(size_t unit, const at::Tensor& input) {
  if (!pipeline_) return input;
  if (unit + 1 >= unit_pieces_.size())
    throw std::out_of_range("EnterUnit: unit " + std::to_string(unit) + " of " +
                            std::to_string(unit_pieces_.size() - 1) + " gather units");
  RefuseAfterFailedUpdate();
  try {
    pipeline_->WaitFor(unit);
  } catch (const std::exception& e) {
    UpdateFailed(e);
  }
  if (uploads_ && unit + 1 < unit_pieces_.size()) uploads_->ComputeWaitsFor(unit + 1);
  return input;
}

void FlatRuntime::StartOverlappedStep(float grad_scale, const std::vector<double>& group_lrs) {
  c10::NoGradGuard no_grad;
  passes_.clear();
  passes_.reserve(groups_.size());
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    Group& g = groups_[gi];
    const at::Tensor grad = StepGradient(g);  // host: the bf16/fp16 copy (only read) or the fp32 sum (zeroed)
    g.in_host_copy = false;
    passes_.emplace_back(g.state, grad, grad_scale, g.optimizer, group_lrs[gi]);
  }
  if (uploads_) uploads_->AfterCompute();
  UpdateUnit(0);  // the root, before the forward's first use of it
  if (uploads_) uploads_->ComputeWaitsFor(0);
  pipeline_->Start(unit_pieces_.size() - 1);
}

void FlatRuntime::UpdateUnit(size_t u) {
  c10::NoGradGuard no_grad;
  const bool narrow_dtype = s_.model_dtype != at::kFloat;
  for (const Piece& piece : unit_pieces_[u]) {
    Group& g = groups_[piece.group];
    const CpuAdamPass& pass = passes_[piece.group];
    if (!uploads_) {
      // On the host: the pass writes the weights (rounded as .to() rounds), or they are the fp32 masters.
      at::Tensor weights = g.model_flat.narrow(0, piece.begin, piece.end - piece.begin);
      if (narrow_dtype) {
        pass.Run(piece.begin, piece.end, weights);
      } else {
        pass.Run(piece.begin, piece.end);
        weights.copy_(g.state.master.narrow(0, piece.begin, piece.end - piece.begin));
      }
      continue;
    }
    // To a GPU, chunk by chunk: bf16/fp16 written by the pass into a staging
    // slot, fp32 straight from the pinned master; each goes up on its slot's
    // stream once the slot's previous upload is done. A gather unit's pass
    // leaves one core to the forward's kernel launches.
    Uploads& up = *uploads_;
    const int threads = u == 0 ? pass.threads() : std::max(1, pass.threads() - 1);
    for (int64_t begin = piece.begin; begin < piece.end; begin += kCopyChunk) {
      const int64_t len = std::min(kCopyChunk, piece.end - begin);
      const size_t slot = up.next_slot++ % 2;
      at::Tensor src = g.state.master.narrow(0, begin, len);
      if (narrow_dtype) {
        up.streams[slot].synchronize();
        src = up.staging[slot].narrow(0, 0, len);
        pass.Run(begin, begin + len, src, threads);
      } else {
        pass.Run(begin, begin + len, at::Tensor(), threads);
      }
      c10::StreamGuard guard(up.streams[slot]);
      g.model_flat.narrow(0, begin, len).copy_(src, /*non_blocking=*/true);
    }
  }
  if (uploads_)
    for (int k = 0; k < 2; ++k) uploads_->events[2 * u + k]->record(uploads_->streams[k]);
}

std::vector<PartitionSlot> FlatRuntime::Slots() {
  AwaitUpdate();
  std::vector<PartitionSlot> slots;
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    Group& g = groups_[gi];
    std::vector<ckpt::TargetParam> params;
    for (size_t k = 0; k < g.numels.size(); ++k) params.push_back({g.names[k], g.numels[k], g.shapes[k]});
    slots.push_back(
        {gi, ckpt::FlatPartitionTarget(std::move(params), g.layout.dp, partition_rank()), &g.state, g.names.front()});
  }
  return slots;
}

at::Tensor FlatRuntime::PartitionOf(const Group& g, const at::Tensor& flat) const {
  return flat.narrow(0, g.layout.begin(partition_rank()), g.layout.partition_size);
}

// Stages 1-2 at dp > 1, bucketed: bucket k holds columns [o, o+b) of every
// rank's partition, so one reduce-scatter hands each owner its own columns.
// Returns this rank's averaged partition, or, with `add_in_place`, adds it
// into the sum bucket by bucket and returns an undefined tensor.
at::Tensor FlatRuntime::ReduceScatterInBuckets(Group& g, bool add_in_place) {
  const int64_t dp = g.layout.dp, P = g.layout.partition_size;
  const int64_t b_max = std::max<int64_t>(1, s_.reduce_bucket_size / dp);
  const auto model = g.grad_flat.options();
  at::Tensor part = add_in_place ? at::Tensor() : at::empty({P}, model);
  at::Tensor by_rank = g.grad_flat.view({dp, P});
  for (int64_t o = 0; o < P; o += b_max) {
    const int64_t b = std::min(b_max, P - o);
    // Flat [dp * b] (Gloo's reduce-scatter checks the first dimension; NCCL's the elements).
    at::Tensor bucket = by_rank.narrow(1, o, b).clone(at::MemoryFormat::Contiguous).view({-1});
    bucket.div_(static_cast<double>(dp));
    at::Tensor out = add_in_place ? at::empty({b}, model) : part.narrow(0, o, b);
    comm_.ReduceScatterSum(bucket, out);
    if (add_in_place) g.grad_partition.narrow(0, o, b).add_(out);
  }
  return part;
}

// Stage 0: every rank steps the whole model on the averaged gradient, averaged as DeepSpeed's
// engine.allreduce_bucket does (at one rank too): prescale_gradients scales before the sum; otherwise (the
// default) the sum is of the gradients over gradient_predivide_factor, scaled by predivide/world after it.
at::Tensor FlatRuntime::Stage0AllReduce(Group& g) {
  at::Tensor grad = g.grad_flat.to(at::kFloat, /*non_blocking=*/false, /*copy=*/true);
  const double world = comm_.world_size(), f = s_.gradient_predivide_factor;
  if (s_.prescale_gradients) {
    grad.mul_(1.0 / world);
    if (world > 1) comm_.AllReduceSum(grad);
  } else {
    if (f != 1.0) grad.mul_(1.0 / f);
    if (world > 1) comm_.AllReduceSum(grad);
    if (f != world) grad.mul_(f / world);
  }
  return grad;
}

void FlatRuntime::ReduceIntoPartition(Group& g, bool boundary) {
  if (g.host_copy) return TakeHostCopy(g, boundary);
  // DeepSpeed's average_tensor: divide by dp, then sum over ranks, in the model
  // dtype at stages 1-2 (its communication_data_type), where the micro-steps'
  // averages are summed in the model dtype too (its averaged_gradients).
  at::Tensor part;
  // Accumulating on the device: this micro-step's average is added into the
  // sum piece by piece, the values a whole fp32 copy would add, without it.
  const bool add_in_place = g.have_grad_partition && !s_.offload_optimizer_cpu;
  if (g.overlap) {
    part = g.overlap->Finish();
    if (part.is_same(g.grad_partition)) {  // added bucket by bucket (PrepareBackward set it)
      g.grad_flat.zero_();
      return;
    }
  } else if (deepspeed_order_) {
    part = AllReduceInDeepSpeedOrder(g);
  } else if (g.layout.dp > 1) {
    part = ReduceScatterInBuckets(g, add_in_place);
    if (!part.defined()) {  // added into the sum bucket by bucket
      g.grad_flat.zero_();
      return;
    }
  } else if (s_.stage0_fp16 != Stage0Fp16::kNone) {
    part = Fp16WrapperAllReduce(g);
  } else if (s_.stage == 0 && (comm_.world_size() > 1 || s_.gradient_predivide_factor != 1.0)) {
    part = Stage0AllReduce(g);
  } else if (add_in_place) {
    AddWidened(g.grad_partition, g.grad_flat, s_.step_chunk_elements);
    g.grad_flat.zero_();
    return;
  } else if (s_.stage == 0) {
    part = g.grad_flat.to(at::kFloat, /*non_blocking=*/false, /*copy=*/true);
  } else {
    part = g.grad_flat.clone();  // one rank: the average is the gradient, kept in the model dtype
  }
  // offload_optimizer: the host sums in fp32 (DeepSpeed 0.14.5's offload sums in the model dtype:
  // docs/engine.md says so).
  if (s_.offload_optimizer_cpu) part = part.to(at::kFloat);
  if (s_.offload_optimizer_cpu && !part.device().is_cpu()) {
    // As DeepSpeed's offload: the norms on the device, not over the host copy.
    g.device_norms = g.have_grad_partition ? at::Tensor() : FragmentNorms(g.fragments, part, s_.norm_span_elements);
    AddToHostGradient(g, part);
    g.grad_flat.zero_();
    return;
  }
  part = part.to(g.state.master.device());
  if (g.have_grad_partition) {
    g.grad_partition.add_(part);
  } else {
    g.grad_partition = part;
    g.have_grad_partition = true;
  }
  g.grad_flat.zero_();
}

at::Tensor FlatRuntime::HostFloatBuffer(int64_t n) const {
  if (groups_.front().model_flat.device().is_cuda()) return PinnedHostZeros({n}, at::kFloat);
  return at::empty({n}, at::TensorOptions().dtype(at::kFloat).device(at::kCPU));
}

void FlatRuntime::TakeHostCopy(Group& g, bool boundary) {
  c10::NoGradGuard no_grad;
  if (g.in_host_copy)
    KeepHostCopyAsSum(g);  // (unarmed, the hooks copied nothing over it: PrepareBackward was not called)
  // The step's gradient alone, unconverted: its norms as DeepSpeed's offload
  // takes them, on the device, from the gradient before it is zeroed (model
  // dtype -> fp64 gives the values fp32 -> fp64 gives).
  const bool alone = boundary && !g.have_grad_partition;
  g.device_norms =
      alone ? FragmentNorms(g.fragments, PartitionOf(g, g.grad_flat), s_.norm_span_elements) : at::Tensor();
  g.host_copy->Finish();
  g.grad_flat.zero_();  // queued after the copies
  if (alone) {
    g.in_host_copy = true;
    g.have_grad_partition = true;
    return;
  }
  // Accumulating (stage 2): summed in fp32 on the host, one micro-step at a
  // time, before the next backward overwrites the copy.
  if (g.have_grad_partition) {
    g.grad_partition.add_(g.host_copy->Host());
    return;
  }
  KeepHostCopyAsSum(g);
}

void FlatRuntime::KeepHostCopyAsSum(Group& g) {
  c10::NoGradGuard no_grad;
  const at::Tensor& host = g.host_copy->Host();
  if (!g.grad_partition.defined() || g.grad_partition.numel() != host.numel())
    g.grad_partition = HostFloatBuffer(host.numel());
  g.grad_partition.copy_(host);  // exact
  g.have_grad_partition = true;
  g.in_host_copy = false;
}

const at::Tensor& FlatRuntime::StepGradient(Group& g) {
  return g.in_host_copy ? g.host_copy->Host() : g.grad_partition;
}

void FlatRuntime::DropGradient(Group& g) {
  g.have_grad_partition = false;
  g.in_host_copy = false;
}

// DeepSpeed's stage 1/2 global norm (grad_numerics.h): each parameter
// fragment's fp64 norm (offloaded from a GPU: taken on the device before the
// copy down), summed as fp32 per group over the ranks; -1 when inf or nan.
at::Tensor FlatRuntime::GlobalNorm() {
  std::vector<at::Tensor> group_norms;
  for (const Group& g : groups_) {
    const at::Tensor norms =
        g.device_norms.defined() ? g.device_norms : FragmentNorms(g.fragments, g.grad_partition, s_.norm_span_elements);
    group_norms.push_back(
        GroupGradNormStacked(comm_, norms, at::kFloat, norms.device(), s_.stage != 0 && comm_.world_size() > 1));
  }
  bool finite = true;
  at::Tensor norm = GlobalGradNorm(group_norms, &finite);
  return finite ? norm : at::full({}, -1.0, norm.options());
}

FlatRuntime::StepResult FlatRuntime::Step(const std::vector<double>& group_lrs) {
  if (group_lrs.size() != groups_.size()) throw std::logic_error("FlatRuntime::Step: one lr per group");
  AwaitUpdate();
  for (const Group& g : groups_)
    if (!g.have_grad_partition) throw std::logic_error("FlatRuntime::Step without reduced gradients");
  if (s_.stage0_fp16 != Stage0Fp16::kNone) return Fp16WrapperStep(group_lrs);
  StepResult r;
  const double prev_scale = scaler_.cur_scale;
  r.loss_scale = prev_scale;
  bool overflow = false;
  if (s_.model_dtype == at::kHalf) {
    // Offloaded from a GPU, over the device norms: a fragment's fp64 norm is
    // finite iff its fp32 elements are (their squares cannot overflow fp64).
    std::vector<at::Tensor> checked;
    for (const Group& g : groups_) checked.push_back(g.device_norms.defined() ? g.device_norms : g.grad_partition);
    overflow = AnyRankOverflowed(comm_, checked, checked[0].device());
  }
  scaler_.Update(overflow);
  if (overflow) {
    for (Group& g : groups_) DropGradient(g);
    r.skipped = true;
    r.grad_norm = -1;
    return r;
  }
  const at::Tensor scaled_norm = GlobalNorm();  // fp32
  r.grad_norm = static_cast<float>(scaled_norm.item<float>() / prev_scale);
  // DeepSpeed 0.14.5 unscales and clips by the scale it has just updated (stage_1_and_2.py step():
  // _update_scale, then unscale_and_clip_grads over self.loss_scale): on a step where the scale
  // grows, the gradients are divided by the grown one. Its reported norm keeps the previous scale.
  const UnscaleAndClip unscale(scaled_norm, scaler_.cur_scale, s_.gradient_clipping);
  // Stage 0 in fp32: DeepSpeed's optimizer steps the module's parameters
  // themselves, so a write to one (p.data) is where the step starts.
  if (s_.stage == 0 && s_.model_dtype == at::kFloat) MastersFromWeights();
  if (s_.optimizer_step) {
    ClientStep(unscale, group_lrs);
    return r;
  }
  if (pipeline_) {
    for (Group& g : groups_) g.have_grad_partition = false;
    StartOverlappedStep(static_cast<float>(unscale.host_factor()), group_lrs);
    return r;
  }

  for (Group& g : groups_) {
    const double lr = group_lrs[static_cast<size_t>(&g - groups_.data())];
    at::Tensor grad = g.grad_partition;
    g.have_grad_partition = false;
    if (s_.offload_optimizer_cpu) {
      // The same fp32 product, taken inside the fused host pass.
      OffloadedAdamStep(g, static_cast<float>(unscale.host_factor()), lr);
      continue;
    }
    if (grad.scalar_type() == at::kFloat) {
      unscale.Apply(grad);
      AdamStep(g, grad, lr);
    } else {  // the model-dtype sum: each piece widened and unscaled (DeepSpeed: one fp32 copy of it)
      TorchAdamStep(g.state, grad, g.optimizer, lr, s_.step_chunk_elements, &unscale);
    }
    g.grad_partition = at::Tensor();
  }
  if (!s_.offload_optimizer_cpu) WeightsFromMasters();
  return r;
}

void FlatRuntime::AddToHostGradient(Group& g, const at::Tensor& part) {
  c10::NoGradGuard no_grad;
  const int64_t P = part.numel();
  if (!g.grad_partition.defined() || !g.grad_partition.is_pinned()) g.grad_partition = PinnedHostZeros({P}, at::kFloat);
  if (!g.have_grad_partition || P == 0) {
    g.grad_partition.copy_(part);  // one copy straight into pinned memory
    g.have_grad_partition = true;
    return;
  }
  // Accumulating: chunk k+1 comes down into one staging slot while chunk k,
  // in the other, is added on the host.
  const int64_t C = std::min(kCopyChunk, P);
  EnsureStaging(g.host_staging, C, at::kFloat);
  CopyStreams streams(part.device(), 2);
  auto add = [&](int64_t k) {
    const int64_t begin = k * C, len = std::min(C, P - begin);
    streams.Wait(static_cast<size_t>(k));
    g.grad_partition.narrow(0, begin, len).add_(g.host_staging[k % 2].narrow(0, 0, len));
  };
  const int64_t chunks = (P + C - 1) / C;
  for (int64_t k = 0; k < chunks; ++k) {
    const int64_t begin = k * C, len = std::min(C, P - begin);
    {
      c10::StreamGuard guard(streams[static_cast<size_t>(k)]);
      g.host_staging[k % 2].narrow(0, 0, len).copy_(part.narrow(0, begin, len), /*non_blocking=*/true);
    }
    if (k > 0) add(k - 1);
  }
  if (chunks > 0) add(chunks - 1);
}

void FlatRuntime::OffloadedAdamStep(Group& g, float grad_scale, double lr) {
  c10::NoGradGuard no_grad;
  const at::Device device = g.model_flat.device();
  const at::Tensor grad = StepGradient(g);  // host fp32 (zeroed by the pass) or the model dtype (only read)
  g.in_host_copy = false;
  if (device.is_cpu()) {
    CpuAdamStep(g.state, grad, grad_scale, g.optimizer, lr);
    if (!g.host_copy) g.grad_partition = at::Tensor();  // else reused for the next accumulation
    GatherModel(g, g.state.master);
    return;
  }
  // Each updated range goes up on a side stream while the next is updated:
  // fp32 straight from the pinned master, else converted on the host (the
  // rounding .to() does on the device) into a pinned staging slot.
  const at::Tensor& master = g.state.master;
  const int64_t P = master.numel(), C = std::min(kCopyChunk, std::max<int64_t>(P, 1));
  if (!g.device_partition.defined() || g.device_partition.numel() != P)
    g.device_partition = at::empty({P}, g.model_flat.options());
  const bool convert = s_.model_dtype != at::kFloat || !master.is_pinned();
  std::vector<at::Tensor> weight_staging;
  if (convert) {
    // The slots of the gradient staging when they fit (fp32 holds any model dtype's chunk).
    EnsureStaging(g.host_staging, C, at::kFloat);
    for (const at::Tensor& t : g.host_staging) weight_staging.push_back(t.view(s_.model_dtype).narrow(0, 0, C));
  }
  CopyStreams streams(device, 2);
  size_t k = 0;
  // bf16/fp16: the update pass itself writes each range's weights into its slot.
  const bool fused = convert && s_.model_dtype != at::kFloat;
  auto staging_for = [&](int64_t begin, int64_t end) -> at::Tensor {
    if (!fused) return at::Tensor();
    streams.Wait(k);  // this slot's previous upload is done before it is overwritten
    return weight_staging[k % 2].narrow(0, 0, end - begin);
  };
  CpuAdamStep(g.state, grad, grad_scale, g.optimizer, lr, C, staging_for, [&](int64_t begin, int64_t end) {
    const size_t slot = k++;
    at::Tensor src = master.narrow(0, begin, end - begin);
    if (fused) {
      src = weight_staging[slot % 2].narrow(0, 0, end - begin);
    } else if (convert) {
      streams.Wait(slot);
      at::Tensor staged = weight_staging[slot % 2].narrow(0, 0, end - begin);
      staged.copy_(src);
      src = staged;
    }
    c10::StreamGuard guard(streams[slot]);
    g.device_partition.narrow(0, begin, end - begin).copy_(src, /*non_blocking=*/true);
  });
  streams.WaitAll();
  GatherModel(g, g.device_partition);
}

}  // namespace uckpt::engine
