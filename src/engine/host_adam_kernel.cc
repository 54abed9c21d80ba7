// The host Adam's element loops (host_adam_kernel.h): kept free of aliasing
// and branches so that they vectorise, each operation rounded as torch rounds
// it (no -ffast-math, no fused multiply-adds).
#include "engine/host_adam_kernel.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <type_traits>
#include <utility>

namespace uckpt::engine::host_adam {
namespace {

using AdamScalars = Scalars;

inline uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}
inline float FromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// fp32 -> bf16 as torch rounds it (to nearest even; NaN to c10's quiet NaN),
// branch-free so its loop vectorises.
inline uint16_t ToBFloat16Bits(float f) {
  const uint32_t u = Bits(f);
  const uint32_t rounded = (u + UINT32_C(0x7FFF) + ((u >> 16) & 1)) >> 16;
  return f != f ? UINT16_C(0x7FC0) : static_cast<uint16_t>(rounded);
}

// fp32 -> fp16 as c10::Half rounds it on the host (IEEE, to nearest even;
// too large: infinity; NaN: 0x7E00), branch-free for the same reason (the
// selects written as max and masks, which GCC vectorises). The float
// multiplications round the mantissa to fp16's width and saturate.
inline uint16_t ToHalfBits(float f) {
  const uint32_t w = Bits(f), sign = w & UINT32_C(0x80000000);
  float base = (std::fabs(f) * FromBits(UINT32_C(0x77800000))) * FromBits(UINT32_C(0x08800000));  // * 2^112 * 2^-110
  // The exponent, no lower than where fp16's normal range ends (-14).
  const int32_t bias = std::max<int32_t>(static_cast<int32_t>(w & UINT32_C(0x7F800000)), INT32_C(0x38800000));
  base = FromBits(static_cast<uint32_t>(bias) + UINT32_C(0x07800000)) + base;
  const uint32_t b = Bits(base);
  const uint32_t nonsign = ((b >> 13) & UINT32_C(0x7C00)) + (b & UINT32_C(0x0FFF));
  const uint32_t nan = -static_cast<uint32_t>(static_cast<int32_t>(w & UINT32_C(0x7FFFFFFF)) > INT32_C(0x7F800000));
  return static_cast<uint16_t>((sign >> 16) | (nonsign ^ ((nonsign ^ UINT32_C(0x7E00)) & nan)));
}

// The element loops are built twice, for AVX2 (twice the width: the
// divisions and square roots bound a core's pace) and for any x86-64, the
// one the host has chosen at load time; AVX2 without FMA, so both round
// every operation alike (tests/engine/cpu_adam_test.cc checks the bits).
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define UCKPT_ADAM_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define UCKPT_ADAM_CLONES
#endif

// Where a range's updated weights also go: nowhere, or converted to bf16 or
// fp16 (`out` holds the range from `out_begin` on). A second loop over the
// chunk the update just wrote (still in cache): the conversions vectorise
// alone, not inside the update's loop.
struct NoCopy {
  void operator()(const float*, int64_t, int64_t) const {}
};
template <uint16_t (*Convert)(float)>
UCKPT_ADAM_CLONES void ConvertRange(const float* __restrict p, uint16_t* __restrict o, int64_t n) {
  for (int64_t i = 0; i < n; ++i) o[i] = Convert(p[i]);
}
template <uint16_t (*Convert)(float)>
struct ConvertingCopy {
  uint16_t* out;
  int64_t out_begin;
  void operator()(const float* p, int64_t begin, int64_t end) const {
    ConvertRange<Convert>(p + begin, out + (begin - out_begin), end - begin);
  }
};
using BFloat16Copy = ConvertingCopy<ToBFloat16Bits>;
using HalfCopy = ConvertingCopy<ToHalfBits>;

// The same conversion into several outputs, each holding the weights of one
// piece of the partition (UpdateInto): a chunk of the update may
// span pieces, or fall in a gap between them (no copy there).
template <uint16_t (*Convert)(float)>
struct PiecewiseCopy {
  const std::vector<WeightPiece>* pieces;  // sorted by begin, not overlapping
  void operator()(const float* p, int64_t begin, int64_t end) const {
    const auto& ps = *pieces;
    auto k = static_cast<size_t>(
        std::upper_bound(ps.begin(), ps.end(), begin, [](int64_t at, const WeightPiece& w) { return at < w.begin; }) -
        ps.begin());
    for (k = k > 0 ? k - 1 : 0; k < ps.size() && ps[k].begin < end; ++k) {
      const int64_t a = std::max(begin, ps[k].begin), b = std::min(end, ps[k].begin + ps[k].numel);
      if (b > a) ConvertRange<Convert>(p + a, ps[k].bits + (a - ps[k].begin), b - a);
    }
  }
};

// How the update reads a gradient element (Format::Load): fp32 as it is, or
// the model's bf16 or fp16 bits widened to fp32 (exact), branch-free so the
// loop vectorises.
// kZeroAfter: the gradient is an accumulation buffer, zeroed behind the update.
struct Fp32Grad {
  using Elem = float;
  static constexpr bool kZeroAfter = true;
  static float Load(float g) { return g; }
};
struct BFloat16Grad {
  using Elem = uint16_t;
  static constexpr bool kZeroAfter = false;
  static float Load(uint16_t g) { return FromBits(static_cast<uint32_t>(g) << 16); }
};
// IEEE fp16 -> fp32 (c10::Half's conversion): normal numbers rebias the
// exponent by a multiplication, subnormals come out of a float subtraction;
// infinity and NaN keep their payload.
struct HalfGrad {
  using Elem = uint16_t;
  static constexpr bool kZeroAfter = false;
  static float Load(uint16_t g) {
    const uint32_t w = static_cast<uint32_t>(g) << 16;
    const uint32_t sign = w & UINT32_C(0x80000000), two_w = w + w;
    const float normalized =
        FromBits((two_w >> 4) + (UINT32_C(0xE0) << 23)) * FromBits(UINT32_C(0x07800000));  // * 2^-112
    const float denormalized = FromBits((two_w >> 17) | (UINT32_C(126) << 23)) - 0.5f;
    // The select as a mask: nothing for the vectoriser to convert.
    const uint32_t subnormal = -static_cast<uint32_t>(two_w < (UINT32_C(1) << 27));
    return FromBits(sign | (Bits(denormalized) & subnormal) | (Bits(normalized) & ~subnormal));
  }
};
// A 16-bit accumulation buffer (ZeRO-3's host gradient under offload_optimizer,
// in grad_accum_dtype): read as the model's bits, zeroed behind the update.
template <typename Grad16>
struct Zeroed : Grad16 {
  static constexpr bool kZeroAfter = true;
};

// Calls f(Format{}, elements) with the Format that reads g.
template <typename F>
decltype(auto) WithFormat(const Grad& g, F&& f) {
  auto* g16 = static_cast<uint16_t*>(g.data);
  switch (g.elems) {
    case GradElems::kFloat: return f(Fp32Grad{}, static_cast<float*>(g.data));
    case GradElems::kBFloat16: return g.zero_after ? f(Zeroed<BFloat16Grad>{}, g16) : f(BFloat16Grad{}, g16);
    case GradElems::kHalf: return g.zero_after ? f(Zeroed<HalfGrad>{}, g16) : f(HalfGrad{}, g16);
  }
  throw std::invalid_argument("host_adam: unknown gradient element type");
}

// The element loop, kept free of aliasing and branches so the compiler
// vectorises it (no -ffast-math: the order of operations is torch's); the
// weight-decay form is a template argument, not a branch the compiler would
// have to move out (it does not for the longer fp16 loop). An fp32 gradient
// is zeroed behind it (an accumulation buffer); a model-dtype one is left as
// it is.
template <typename Format, bool kDecoupled>
UCKPT_ADAM_CLONES void AdamLoop(const AdamScalars& s, float* __restrict p, float* __restrict m, float* __restrict v,
                                typename Format::Elem* __restrict g, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    float grad = Format::Load(g[i]) * s.grad_scale;
    float param = p[i];
    if constexpr (kDecoupled) {
      param = param * s.decay;
    } else {
      grad = grad + param * s.weight_decay;
    }
    const float mi = m[i] * s.beta1 + grad * s.one_minus_beta1;
    const float vi = v[i] * s.beta2 + (s.one_minus_beta2 * grad) * grad;  // addcmul: (value * t1) * t2
    const float denom = std::sqrt(vi) / s.bias_correction2_sqrt + s.eps;
    p[i] = param + (s.neg_step_size * mi) / denom;  // addcdiv: (value * t1) / t2
    m[i] = mi;
    v[i] = vi;
    if constexpr (Format::kZeroAfter) g[i] = 0;
  }
}

// The update of [begin, end); then `copy` receives the new weights in the
// model dtype. With a copy, in blocks of kCopyBlock elements, each converted
// right after its update: a job's whole range (up to 4 MiB over the four
// arrays) would have left the core's cache by the time the copy read it back.
constexpr int64_t kCopyBlock = 8192;
template <typename Format, typename Copy>
void AdamRange(const AdamScalars& s, float* p, float* m, float* v, typename Format::Elem* g, const Copy& copy,
               int64_t begin, int64_t end) {
  const int64_t block = std::is_same_v<Copy, NoCopy> ? end - begin : kCopyBlock;
  for (int64_t b = begin; b < end; b += block) {
    const int64_t e = std::min(end, b + block);
    if (s.decoupled) {
      AdamLoop<Format, true>(s, p, m, v, g, b, e);
    } else {
      AdamLoop<Format, false>(s, p, m, v, g, b, e);
    }
    copy(p, b, e);
  }
}

constexpr int64_t kChunk = 1 << 18;  // elements per job: 1 MiB of each array

// Threads that stay for the calling thread's later passes: the offloaded
// step updates ~30 ranges one after another, and starting and joining a
// thread per core for each (tens of microseconds apiece, one after another)
// would cost a fifth of a range's time. One pool per calling thread (ranks
// run as threads in tests), its workers joined when that thread ends.
//
// After fork() the child has none of the workers, and the mutex and
// condition variables are as the parent's threads left them (possibly held,
// or counting waiters that do not exist in the child: a notify could then
// block for ever). So everything shared with the workers lives in a Shared
// block, and a child that finds the pool made by another process leaves the
// parent's block untouched (never destroyed, never locked) and starts afresh.
class WorkerPool {
 public:
  static WorkerPool& ForThisThread() {
    thread_local WorkerPool pool;
    if (pool.pid_ != getpid()) pool.ForgetAfterFork();
    return pool;
  }
  ~WorkerPool() {
    if (pid_ != getpid()) {  // a forked child's exit: nothing of it is ours to join or destroy
      ForgetAfterFork();
      return;
    }
    {
      std::lock_guard<std::mutex> lock(s_->mu);
      s_->stop = true;
    }
    s_->wake.notify_all();
    for (std::thread& t : workers_) t.join();
  }

  // job(k) for k in [0, jobs) on `threads` threads (this one included), each
  // taking the next k; the first exception is rethrown once all are done.
  void Run(size_t jobs, int threads, const std::function<void(size_t)>& job) {
    Shared& s = *s_;
    const size_t helpers = static_cast<size_t>(std::max(1, threads)) - 1;
    while (workers_.size() < helpers) {
      uint64_t seen;
      {
        std::lock_guard<std::mutex> lock(s.mu);
        seen = s.generation;
      }
      workers_.emplace_back([&s, id = workers_.size(), seen] { Serve(s, id, seen); });
    }
    {
      std::lock_guard<std::mutex> lock(s.mu);
      s.job = &job;
      s.jobs = jobs;
      s.next = 0;
      s.failed = false;
      s.error = nullptr;
      s.helpers = helpers;
      s.busy = helpers;
      ++s.generation;
    }
    s.wake.notify_all();
    Work(s);
    std::unique_lock<std::mutex> lock(s.mu);
    s.done.wait(lock, [&] { return s.busy == 0; });
    s.job = nullptr;
    if (s.error) std::rethrow_exception(s.error);
  }

 private:
  struct Shared {
    std::mutex mu;
    std::condition_variable wake, done;
    const std::function<void(size_t)>* job = nullptr;
    size_t jobs = 0, helpers = 0, busy = 0;
    std::atomic<size_t> next{0};
    std::atomic<bool> failed{false};
    std::exception_ptr error;
    uint64_t generation = 0;
    bool stop = false;
  };

  static void Work(Shared& s) {
    for (size_t k; !s.failed && (k = s.next++) < s.jobs;) {
      try {
        (*s.job)(k);
      } catch (...) {
        std::lock_guard<std::mutex> lock(s.mu);
        if (!s.error) s.error = std::current_exception();
        s.failed = true;
      }
    }
  }
  static void Serve(Shared& s, size_t id, uint64_t seen) {  // `seen`: the pass before it started
    std::unique_lock<std::mutex> lock(s.mu);
    for (;;) {
      s.wake.wait(lock, [&] { return s.stop || s.generation != seen; });
      if (s.stop) return;
      seen = s.generation;
      if (id >= s.helpers) continue;  // not needed for this pass
      lock.unlock();
      Work(s);
      lock.lock();
      if (--s.busy == 0) s.done.notify_one();
    }
  }
  // In a forked child: the parent's workers and Shared block are dropped
  // unjoined and undestroyed (kept, never used); new ones start on demand.
  void ForgetAfterFork() {
    new std::vector<std::thread>(std::move(workers_));
    workers_.clear();
    s_.release();
    s_ = std::make_unique<Shared>();
    pid_ = getpid();
  }

  pid_t pid_ = getpid();
  std::vector<std::thread> workers_;
  std::unique_ptr<Shared> s_ = std::make_unique<Shared>();
};

// Runs fn(begin, end) over [0, n) in chunks of `chunk` elements on
// `max_threads` threads. Our own threads: at::parallel_for's OpenMP pragma
// would need this file built with OpenMP, next to libtorch's own runtime.
template <typename Fn>
void ParallelChunks(int64_t n, Fn fn, int max_threads, int64_t chunk = kChunk) {
  const size_t jobs = static_cast<size_t>((n + chunk - 1) / chunk);
  const int threads = std::max(1, std::min(max_threads, static_cast<int>(jobs)));
  const std::function<void(size_t)> job = [&](size_t k) {
    const int64_t begin = static_cast<int64_t>(k) * chunk;
    fn(begin, std::min(n, begin + chunk));
  };
  if (threads == 1) {
    for (size_t k = 0; k < jobs; ++k) job(k);
    return;
  }
  WorkerPool::ForThisThread().Run(jobs, threads, job);
}

// Elements per job of an update of `len` elements on `threads` threads:
// two jobs per thread (a thread that starts late still finds work), each a
// multiple of 64 elements and at least 16 Ki. The offloaded step runs 4 Mi
// elements at a time, and fixed 256 Ki jobs gave it 16 jobs: half the
// threads of a 32-core host sat idle.
int64_t AdamJobElements(int64_t len, int threads) {
  const int64_t jobs = 2 * static_cast<int64_t>(std::max(1, threads));
  const int64_t per_job = (len + jobs - 1) / jobs;
  return std::min(kChunk, std::max<int64_t>(int64_t{1} << 14, (per_job + 63) / 64 * 64));
}

// The update of [begin, end) on `threads` threads, each job's new weights then to `copy`.
template <typename Format, typename Copy>
void AdamParallel(const AdamScalars& s, float* p, float* m, float* v, typename Format::Elem* g, int64_t begin,
                  int64_t end, const Copy& copy, int threads) {
  const int64_t len = end - begin;
  ParallelChunks(
      len, [&](int64_t b, int64_t e) { AdamRange<Format>(s, p, m, v, g, copy, begin + b, begin + e); }, threads,
      AdamJobElements(len, threads));
}

// PieceSumsOfSquares over elements read as Format::Load widens them (exact), so
// a 16-bit gradient's sums are those of its fp32 copy, without the copy.
template <typename Format>
std::vector<double> PieceSums(const typename Format::Elem* base, int64_t size,
                              const std::vector<std::pair<int64_t, int64_t>>& pieces, int threads) {
  // SumOfSquares's chunks of every piece, in one list: each summed alone,
  // in order, as SumOfSquares sums it; a job takes up to kWays chunks side
  // by side (independent sums: the adds' latency overlaps, the bits stay).
  using Elem = typename Format::Elem;
  struct Chunk {
    const Elem* x;
    int64_t n;
  };
  std::vector<Chunk> chunks;
  std::vector<size_t> first_chunk;  // per piece, then the end
  for (const auto& [offset, numel] : pieces) {
    if (offset < 0 || numel < 0 || offset + numel > size)
      throw std::out_of_range("PieceSumsOfSquares: piece [" + std::to_string(offset) + ", " +
                              std::to_string(offset + numel) + ") outside " + std::to_string(size) + " elements");
    first_chunk.push_back(chunks.size());
    for (int64_t b = 0; b < numel; b += kChunk) chunks.push_back({base + offset + b, std::min(kChunk, numel - b)});
  }
  first_chunk.push_back(chunks.size());
  constexpr int64_t kWays = 8;
  std::vector<double> partial(chunks.size(), 0.0);
  const int64_t count = static_cast<int64_t>(chunks.size());
  auto square = [](Elem e) {
    const double v = Format::Load(e);
    return v * v;
  };
  ParallelChunks(
      count,
      [&](int64_t begin, int64_t end) {
        double acc[kWays] = {};
        int64_t common = kChunk;
        for (int64_t k = begin; k < end; ++k) common = std::min(common, chunks[k].n);
        if (end - begin == kWays) {
          const Elem* x[kWays];
          for (int64_t w = 0; w < kWays; ++w) x[w] = chunks[begin + w].x;
          for (int64_t i = 0; i < common; ++i)
            for (int64_t w = 0; w < kWays; ++w) acc[w] += square(x[w][i]);
        } else {
          common = 0;
        }
        for (int64_t k = begin; k < end; ++k) {
          double& a = acc[k - begin];
          for (int64_t i = common; i < chunks[k].n; ++i) a += square(chunks[k].x[i]);
          partial[k] = a;
        }
      },
      threads, kWays);
  std::vector<double> sums(pieces.size(), 0.0);
  for (size_t p = 0; p < pieces.size(); ++p)
    for (size_t k = first_chunk[p]; k < first_chunk[p + 1]; ++k) sums[p] += partial[k];  // SumOfSquares's order
  return sums;
}

}  // namespace

void Update(const Scalars& s, float* p, float* m, float* v, const Grad& g, int64_t begin, int64_t end,
            const WeightPiece* out, WeightElems out_elems, int threads) {
  WithFormat(g, [&]<typename Format>(Format, auto* ge) {
    auto run = [&](const auto& copy) { AdamParallel<Format>(s, p, m, v, ge, begin, end, copy, threads); };
    if (out == nullptr) return run(NoCopy{});
    if (out_elems == WeightElems::kBFloat16) return run(BFloat16Copy{out->bits, out->begin});
    run(HalfCopy{out->bits, out->begin});
  });
}

void UpdateInto(const Scalars& s, float* p, float* m, float* v, const Grad& g, int64_t n,
                const std::vector<WeightPiece>& pieces, WeightElems out_elems, int threads) {
  WithFormat(g, [&]<typename Format>(Format, auto* ge) {
    if (out_elems == WeightElems::kBFloat16)
      return AdamParallel<Format>(s, p, m, v, ge, 0, n, PiecewiseCopy<ToBFloat16Bits>{&pieces}, threads);
    AdamParallel<Format>(s, p, m, v, ge, 0, n, PiecewiseCopy<ToHalfBits>{&pieces}, threads);
  });
}

double SumOfSquares(const float* x, int64_t n, int threads) {
  std::vector<double> partial(static_cast<size_t>((n + kChunk - 1) / kChunk), 0.0);
  ParallelChunks(
      n,
      [&](int64_t begin, int64_t end) {
        double s = 0;
        for (int64_t i = begin; i < end; ++i) s += static_cast<double>(x[i]) * x[i];
        partial[static_cast<size_t>(begin / kChunk)] = s;
      },
      threads);
  double total = 0;
  for (double s : partial) total += s;  // in chunk order: the same on every run
  return total;
}

std::vector<double> PieceSumsOfSquares(const void* base, GradElems elems, int64_t size,
                                       const std::vector<std::pair<int64_t, int64_t>>& pieces, int threads) {
  const Grad g{const_cast<void*>(base), elems, false};  // only read
  return WithFormat(g, [&]<typename Format>(Format, auto* x) { return PieceSums<Format>(x, size, pieces, threads); });
}

}  // namespace uckpt::engine::host_adam
