// What the runtimes hold at the peak of a step with gradient accumulation,
// counted by a CPU allocator that sums the bytes of every live tensor, against
// DeepSpeed 0.14.5's layout, and the chunked update's results against the whole one.
//
// DeepSpeed's stage 1/2 (stage_1_and_2.py) in bf16 at one rank, per parameter:
// the bf16 weights (2 B), the fp32 master (4), exp_avg and exp_avg_sq (8), and
// at the step the bf16 averaged_gradients (2) flattened (a bf16 copy, 2) and
// widened to the fp32 gradient of the step (4): 22 bytes at its peak, 18 while
// FusedAdam runs. uckpt holds its bf16 gradient buffer (2, the parameters'
// .grad views) and the bf16 gradient partition the micro-steps are summed in
// (2, as DeepSpeed sums them) instead: 18 bytes, with the step's element-wise
// temporaries (each chunk widened to fp32) bounded by a chunk.
#include <gtest/gtest.h>

#include <c10/core/CPUAllocator.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "engine/flat_runtime.h"
#include "engine/overlap_reducer.h"
#include "engine/zero3_runtime.h"
#include "ranks.h"
#include "uckpt/comm.h"

namespace uckpt::engine {
namespace {

// Wraps the CPU allocator while alive: the bytes of live CPU tensors it
// made, and their peak. The counts outlive it: a tensor it made may be freed
// after (a cache, the process's exit).
class CountingCpuAllocator final : public at::Allocator {
 public:
  CountingCpuAllocator() : inner_(c10::GetCPUAllocator()) { c10::SetCPUAllocator(this, kPriority); }
  ~CountingCpuAllocator() override { c10::SetCPUAllocator(inner_, kPriority); }

  at::DataPtr allocate(size_t n) override {
    auto* block = new Block{inner_->allocate(n), n};
    void* data = block->inner.get();
    Counts& c = counts();
    const int64_t now = c.live += static_cast<int64_t>(n);
    int64_t peak = c.peak.load();
    while (now > peak && !c.peak.compare_exchange_weak(peak, now)) {}
    return {data, block, &Free, at::Device(at::kCPU)};
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override { std::memcpy(dest, src, count); }

  int64_t live() const { return counts().live; }
  // The peak from now on starts at what is live now.
  void ResetPeak() { counts().peak = counts().live.load(); }
  int64_t peak() const { return counts().peak; }

 private:
  static constexpr uint8_t kPriority = 255;
  struct Block {
    at::DataPtr inner;
    size_t bytes;
  };
  struct Counts {
    std::atomic<int64_t> live{0}, peak{0};
  };
  static Counts& counts() {
    static Counts* c = new Counts;  // never destroyed
    return *c;
  }
  static void Free(void* p) {
    auto* b = static_cast<Block*>(p);
    counts().live -= static_cast<int64_t>(b->bytes);
    delete b;
  }
  at::Allocator* inner_;
};

// Bytes of the step's temporaries allowed beyond the buffers counted: a few
// chunks of the sizes the tests set, and small tensors (norms, flags, scalars).
constexpr int64_t kChunk = int64_t{1} << 14;
constexpr int64_t kSlack = 16 * kChunk * 8 + (int64_t{1} << 16);

ZeroSettings Bf16Stage2() {
  ZeroSettings s;
  s.stage = 2;
  s.model_dtype = at::kBFloat16;
  s.grad_accum_dtype = at::kBFloat16;  // DeepSpeed's default under ZeRO (stage 3 sums in it)
  s.optimizer.weight_decay = 0.01;
  s.gradient_clipping = 1.0;
  s.step_chunk_elements = kChunk;
  s.norm_span_elements = 2 * kChunk;
  return s;
}

std::vector<int64_t> Numels() { return {(int64_t{1} << 20) + 3, 3 << 18, 1000, (int64_t{1} << 19) + 7}; }

// Each micro-step's bf16 gradient, made before the runtime so that its
// temporaries are not counted.
std::vector<at::Tensor> MicroGradients(int64_t n, int count) {
  std::vector<at::Tensor> grads;
  for (int micro = 0; micro < count; ++micro)
    grads.push_back(at::sin(at::arange(n, at::kFloat) * (0.001 * (micro + 1))).to(at::kBFloat16));
  return grads;
}

int64_t PaddedNumel() {
  int64_t n = 0;
  for (int64_t k : Numels()) n += k;
  return ckpt::MakeFlatLayout(n, 1).padded_numel;
}

// ZeRO-2, bf16, one rank, gradient accumulation 4: at no point of the micro-steps
// and the step does the runtime hold more than 18 bytes per parameter
// (DeepSpeed: 22), i.e. beyond its resident buffers only the bf16 gradient
// partition (2 bytes) and chunk-sized temporaries.
TEST(StepMemory, Zero2Bf16WithAccumulationHoldsAtMostDeepSpeedsBytes) {
  CountingCpuAllocator counter;
  const int64_t n = PaddedNumel();
  const std::vector<at::Tensor> grads = MicroGradients(n, 4);
  const int64_t before = counter.live();
  auto comm = MakeSingleProcessComm();
  FlatRuntime z(*comm, Numels(), Bf16Stage2());
  ASSERT_EQ(z.layout().padded_numel, n);
  z.model_flat().copy_(at::cos(at::arange(n, at::kFloat)).to(at::kBFloat16));
  z.MastersFromWeights();
  auto step = [&] {
    for (int micro = 0; micro < 4; ++micro) {
      z.grad_flat().copy_(grads[micro]);
      z.FinishBackward(micro == 3);
    }
    return z.Step(1e-3);
  };
  ASSERT_FALSE(step().skipped);  // the moments exist from here on
  const int64_t resident = counter.live() - before;
  EXPECT_LE(resident, 16 * n + kSlack) << "bf16 weights and gradients, fp32 master, two moments";
  counter.ResetPeak();
  ASSERT_FALSE(step().skipped);
  const int64_t peak = counter.peak() - before;
  const double per_param = static_cast<double>(peak) / static_cast<double>(n);
  // The norm converts a fragment larger than the span to fp64 alone (DeepSpeed: each parameter's .double()).
  const std::vector<int64_t> numels = Numels();
  const int64_t largest_fp64 = 8 * *std::max_element(numels.begin(), numels.end());
  std::printf("ZeRO-2 bf16, GA 4, one rank: resident %.2f, peak %.2f bytes per parameter\n",
              static_cast<double>(resident) / static_cast<double>(n), per_param);
  EXPECT_LE(peak, 18 * n + largest_fp64 + kSlack) << "peak " << per_param << " bytes per parameter (DeepSpeed: 22)";
  EXPECT_LE(peak - resident, 2 * n + largest_fp64 + kSlack)
      << "beyond the resident buffers: more than the bf16 gradient partition";
}

// ZeRO-3 at one rank: the step itself (norms, clipping, Adam) adds only
// chunk-sized temporaries (each widened to fp32) to the bf16 gradient
// partitions it steps on.
TEST(StepMemory, Zero3StepAddsOnlyChunkSizedTemporaries) {
  CountingCpuAllocator counter;
  auto comm = MakeSingleProcessComm();
  Zero3Settings s;
  s.base = Bf16Stage2();
  s.base.stage = 3;
  std::vector<std::pair<std::string, at::Tensor>> group;
  std::vector<int> units;
  int64_t n = 0;
  for (int64_t numel : Numels()) {
    group.push_back({"p" + std::to_string(group.size()), at::zeros({numel}, at::kBFloat16).requires_grad_(true)});
    units.push_back(-1);
    n += numel;
  }
  Zero3Runtime z(*comm, {group}, {s.base.optimizer}, {units}, 0, s, at::kCPU);
  for (int step = 0; step < 2; ++step) {
    for (auto& [name, p] : group)
      p.mutable_grad() = at::sin(at::arange(p.numel(), at::kFloat) * 0.01 + step).to(at::kBFloat16);
    z.FinishBackward(true);
    counter.ResetPeak();
    const int64_t held = counter.live();
    ASSERT_FALSE(z.Step({1e-3}).skipped);
    const int64_t largest_fp64_norm = 8 * Numels()[0];  // stage 3 measures each parameter's piece alone
    if (step == 1) {                                    // (the first step makes the moments)
      EXPECT_LE(counter.peak() - held, largest_fp64_norm + kSlack)
          << "the step's temporaries: " << static_cast<double>(counter.peak() - held) / static_cast<double>(n)
          << " bytes per parameter";
    }
  }
}

// The update in chunks is the update at once, bit for bit (Adam's L2 decay and
// AdamW's decoupled one), at chunks that do and do not divide the partition.
TEST(StepMemory, ChunkedAdamIsTheWholeUpdate) {
  for (bool decoupled : {true, false}) {
    OptimizerConfig o;
    o.weight_decay = 0.05;
    o.decoupled_weight_decay = decoupled;
    const int64_t n = 100003;
    auto run = [&](int64_t chunk) {
      PartitionState st;
      st.master = at::cos(at::arange(n, at::kFloat));
      for (int step = 0; step < 3; ++step)
        TorchAdamStep(st, at::sin(at::arange(n, at::kFloat) * (0.37 + step)), o, 1e-2, chunk);
      return st;
    };
    const PartitionState whole = run(0);
    for (int64_t chunk : {int64_t{4096}, int64_t{1000}, int64_t{1} << 24}) {
      const PartitionState part = run(chunk);
      EXPECT_TRUE(at::equal(part.master, whole.master)) << "chunk " << chunk << " decoupled " << decoupled;
      EXPECT_TRUE(at::equal(part.exp_avg, whole.exp_avg)) << "chunk " << chunk;
      EXPECT_TRUE(at::equal(part.exp_avg_sq, whole.exp_avg_sq)) << "chunk " << chunk;
    }
  }
}

// Accumulating micro-steps piece by piece gives the masters the whole fp32
// copies gave (chunks of the default size are the whole buffer here).
TEST(StepMemory, ChunkedAccumulationIsTheWholeOne) {
  const std::vector<at::Tensor> grads = MicroGradients(PaddedNumel(), 4);
  auto masters = [&](int64_t chunk) {
    auto comm = MakeSingleProcessComm();
    ZeroSettings s = Bf16Stage2();
    s.step_chunk_elements = chunk;
    s.norm_span_elements = int64_t{1} << 25;
    FlatRuntime z(*comm, Numels(), s);
    z.model_flat().copy_(at::cos(at::arange(z.layout().padded_numel, at::kFloat)).to(at::kBFloat16));
    z.MastersFromWeights();
    for (int step = 0; step < 2; ++step) {
      for (int micro = 0; micro < 3; ++micro) {
        z.grad_flat().copy_(grads[micro + step]);
        z.FinishBackward(micro == 2);
      }
      z.Step(1e-3);
    }
    return std::vector<at::Tensor>{z.state().master.clone(), z.model_flat().clone(), z.state().exp_avg_sq.clone()};
  };
  const std::vector<at::Tensor> whole = masters(kStepChunkElements), chunked = masters(kChunk + 5);
  for (size_t i = 0; i < whole.size(); ++i) EXPECT_TRUE(at::equal(whole[i], chunked[i])) << "tensor " << i;
}

// ZeRO-2's overlapped reduction (overlap_reducer.h): at the end of backward
// it holds at most kInFlight buckets' bf16 copies, not one per bucket (the
// whole gradient), and a destination sum gets exactly the values the
// caller would have added from a new partition.
TEST(StepMemory, OverlappedReductionHoldsTwoBucketsAndAddsIntoTheSum) {
  const int64_t k = 8, numel = 10000, n = k * numel;
  auto comm = MakeSingleProcessComm();
  at::Tensor model = at::cos(at::arange(n, at::kFloat)).to(at::kBFloat16), grads = at::zeros({n}, at::kBFloat16);
  std::vector<at::Tensor> params;
  for (int64_t i = 0; i < k; ++i) {
    params.push_back(model.narrow(0, i * numel, numel).detach().requires_grad_(true));
    params.back().mutable_grad() = grads.narrow(0, i * numel, numel);
  }
  OverlappedGradReducer reducer(*comm, params, std::vector<int64_t>(k, numel), grads, 0, n, numel);
  ASSERT_EQ(reducer.num_buckets(), k);
  auto backward = [&](double coef) {
    at::Tensor loss = at::zeros({}, at::kFloat);
    for (int64_t i = 0; i < k; ++i) loss = loss + (params[i].to(at::kFloat) * (coef + i)).sin().sum();
    loss.backward();
  };
  CountingCpuAllocator counter;
  backward(0.5);
  const at::Tensor first = reducer.Finish();
  grads.zero_();
  const at::Tensor sum = first.clone();
  reducer.SetDestination(sum);
  const int64_t before = counter.live();
  backward(0.25);
  const int64_t held = counter.live() - before;
  EXPECT_LE(held, static_cast<int64_t>(OverlappedGradReducer::kInFlight) * numel * 2 + (int64_t{1} << 12))
      << "bytes held after backward: " << held << ", one bucket's bf16 copy " << numel * 2;
  const at::Tensor out = reducer.Finish();
  EXPECT_TRUE(out.is_same(sum));
  EXPECT_EQ(reducer.started_during_backward(), 2 * k);
  grads.zero_();
  backward(0.25);
  const at::Tensor second = reducer.Finish();  // no destination: a new partition
  EXPECT_FALSE(second.is_same(sum));
  EXPECT_TRUE(at::equal(sum, first + second));
}

// Stage 2 without overlap_comm, two ranks, bucketed reduce-scatter (NCCL's
// path; on Gloo only a runtime whose gradients were not bound takes it):
// each later micro-step's reduced buckets are added into the sum, which is
// the micro-steps' averages (divided and summed over the ranks in bf16)
// summed in bf16, as DeepSpeed's stage 2 sums them.
TEST(StepMemory, BucketedReduceScatterAddsEachMicroStepIntoTheSum) {
  const std::vector<int64_t> numels = {1000, 37, 2500};
  const int64_t n = ckpt::MakeFlatLayout(3537, 2).padded_numel, half = n / 2;
  auto grad_of = [&](int rank, int micro) {
    return at::sin(at::arange(n, at::kFloat) * (0.01 * (micro + 1)) + rank).to(at::kBFloat16);
  };
  std::vector<at::Tensor> got(2);
  std::mutex mu;
  testing::RunRanks(2, [&](Comm& comm) {
    ZeroSettings s = Bf16Stage2();
    s.reduce_bucket_size = 500;  // several buckets per partition
    s.optimizer_step = [&](std::vector<OptimizerPartition>& parts) {
      std::lock_guard<std::mutex> lock(mu);
      got[comm.rank()] = parts[0].grad.clone();
    };
    s.gradient_clipping = 0;
    FlatRuntime z(comm, numels, s);
    for (int micro = 0; micro < 3; ++micro) {
      z.grad_flat().copy_(grad_of(comm.rank(), micro));
      z.FinishBackward(micro == 2);
    }
    z.Step(1e-3);
  });
  for (int rank = 0; rank < 2; ++rank) {
    at::Tensor want;
    for (int micro = 0; micro < 3; ++micro) {
      const at::Tensor avg = (grad_of(0, micro) / 2 + grad_of(1, micro) / 2).narrow(0, rank * half, half);
      want = micro == 0 ? avg : want + avg;
    }
    ASSERT_TRUE(got[rank].defined()) << "rank " << rank;
    EXPECT_TRUE(at::equal(got[rank], want.to(at::kFloat))) << "rank " << rank;
  }
}

}  // namespace
}  // namespace uckpt::engine
