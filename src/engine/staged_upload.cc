#include "engine/staged_upload.h"

#include <c10/core/GradMode.h>
#include <c10/core/Stream.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>

#include "ckpt/parallel.h"

namespace uckpt::engine {

namespace {

constexpr uint64_t kDefaultChunkBytes = 32ull << 20;
constexpr uint64_t kAlign = 64;  // where a destination's bytes start in a chunk

// One target, checked, with its pieces sorted.
struct Target {
  TensorReads* reads;
  uint64_t bytes = 0;  // dst.numel() elements of the source dtype
  std::vector<ckpt::ReadPiece> sorted;
  at::Tensor flat;  // what the chunks fill: dst, or a contiguous stand-in
};

// Bytes [begin, begin + size) of a target, at `offset` of a chunk.
struct Segment {
  size_t target;
  uint64_t begin, size, offset;
};

bool ReadsDirectly(const at::Tensor& dst, at::ScalarType source, const StagedOptions& o) {
  return !o.stage_cpu && dst.device().is_cpu() && dst.is_contiguous() && dst.scalar_type() == source;
}

void ZeroUncovered(uint8_t* buffer, const std::vector<ckpt::ReadPiece>& sorted, uint64_t size) {
  for (const ckpt::ByteRange& gap : ckpt::UncoveredRanges(sorted, size)) std::memset(buffer + gap.begin, 0, gap.size());
}

// Cuts the targets into segments that fill chunks of `chunk` bytes, in
// order, each starting kAlign-aligned and cut at element boundaries.
std::vector<std::vector<Segment>> PlanChunks(const std::vector<Target>& targets, const std::vector<size_t>& staged,
                                             uint64_t chunk) {
  std::vector<std::vector<Segment>> chunks(1);
  uint64_t used = 0;
  for (size_t t : staged) {
    const uint64_t es = c10::elementSize(targets[t].reads->source);
    for (uint64_t at = 0; at < targets[t].bytes;) {
      const uint64_t offset = (used + kAlign - 1) / kAlign * kAlign;
      const uint64_t room = offset < chunk ? (chunk - offset) / es * es : 0;
      if (room == 0) {
        chunks.emplace_back();
        used = 0;
        continue;
      }
      const uint64_t n = std::min(room, targets[t].bytes - at);
      chunks.back().push_back({t, at, n, offset});
      used = offset + n;
      at += n;
    }
  }
  if (chunks.back().empty()) chunks.pop_back();
  return chunks;
}

// The streams that upload each chunk slot to one GPU, one per slot, so that
// waiting for a slot's copies waits for nothing else. Empty on the CPU.
class UploadStreams {
 public:
  UploadStreams(std::optional<at::Device> gpu, size_t slots) {
    if (!gpu) return;
    c10::impl::VirtualGuardImpl impl(gpu->type());
    // Work queued on the current stream (the kernels that last used the
    // destinations' memory) is done before a side stream writes to it.
    impl.getStream(*gpu).synchronize();
    for (size_t k = 0; k < slots; ++k) streams_.push_back(impl.getStreamFromGlobalPool(*gpu));
  }
  // Every copy still in flight is waited for, also when a read failed.
  ~UploadStreams() {
    for (const c10::Stream& s : streams_) {
      try {
        s.synchronize();
      } catch (...) {
        // An error is already on its way out; the first one is the one to report.
      }
    }
  }
  bool on_gpu() const { return !streams_.empty(); }
  const c10::Stream& slot(size_t k) const { return streams_.at(k); }
  void Wait(size_t k) const {
    if (on_gpu()) streams_.at(k).synchronize();
  }
  void WaitAll() const {
    for (const c10::Stream& s : streams_) s.synchronize();
  }

 private:
  std::vector<c10::Stream> streams_;
};

// The one GPU the staged destinations live on, if any.
std::optional<at::Device> StagedGpu(const std::vector<Target>& targets, const std::vector<size_t>& staged) {
  std::optional<at::Device> gpu;
  for (size_t t : staged) {
    const at::Device d = targets[t].reads->dst.device();
    if (d.is_cpu()) continue;
    if (gpu && *gpu != d)
      throw std::invalid_argument("FillFromReads: destinations on " + gpu->str() + " and " + d.str() +
                                  "; one load fills one device");
    gpu = d;
  }
  return gpu;
}

// Sends a filled chunk to its destinations: an asynchronous copy on the
// slot's stream for a GPU (through a device buffer when the dtype changes),
// a copy (converting) on the CPU.
void Deliver(const std::vector<Segment>& chunk, std::vector<Target>& targets, const at::Tensor& host,
             at::Tensor& device_buffer, const UploadStreams& streams, size_t slot) {
  std::optional<c10::StreamGuard> guard;
  if (streams.on_gpu()) guard.emplace(streams.slot(slot));
  for (const Segment& s : chunk) {
    Target& t = targets[s.target];
    const at::ScalarType source = t.reads->source;
    const int64_t es = static_cast<int64_t>(c10::elementSize(source));
    at::Tensor from = host.narrow(0, static_cast<int64_t>(s.offset), static_cast<int64_t>(s.size)).view(source);
    at::Tensor to = t.flat.narrow(0, static_cast<int64_t>(s.begin) / es, static_cast<int64_t>(s.size) / es);
    if (to.device().is_cpu()) {
      to.copy_(from);
    } else if (to.scalar_type() == source) {
      to.copy_(from, /*non_blocking=*/true);
    } else {
      if (!device_buffer.defined())
        device_buffer = at::empty({host.numel()}, at::TensorOptions().dtype(at::kByte).device(to.device()));
      at::Tensor staged =
          device_buffer.narrow(0, static_cast<int64_t>(s.offset), static_cast<int64_t>(s.size)).view(source);
      staged.copy_(from, /*non_blocking=*/true);
      to.copy_(staged, /*non_blocking=*/true);
    }
  }
}

// Fills the staged targets chunk by chunk through `slots` reused buffers:
// reading chunk k+1 overlaps the upload of chunk k.
uint64_t FillStaged(std::vector<Target>& targets, const std::vector<size_t>& staged, const StagedOptions& o,
                    uint64_t chunk_bytes) {
  const std::vector<std::vector<Segment>> chunks = PlanChunks(targets, staged, chunk_bytes);
  if (chunks.empty()) return 0;
  const size_t slots = std::min<size_t>(chunks.size(), static_cast<size_t>(std::max(1, o.chunks)));
  const std::optional<at::Device> gpu = StagedGpu(targets, staged);
  const bool pinned = gpu && gpu->is_cuda();
  uint64_t buffer_bytes = 0;  // no more than the chunks use (a small load needs less than a chunk)
  for (const auto& c : chunks) buffer_bytes = std::max(buffer_bytes, c.back().offset + c.back().size);
  const auto host_options = at::TensorOptions().dtype(at::kByte).pinned_memory(pinned);
  std::vector<at::Tensor> host, device(slots);
  for (size_t k = 0; k < slots; ++k) host.push_back(at::empty({static_cast<int64_t>(buffer_bytes)}, host_options));
  UploadStreams streams(gpu, slots);
  uint64_t bytes = 0;
  for (size_t k = 0; k < chunks.size(); ++k) {
    const size_t slot = k % slots;
    if (k >= slots) streams.Wait(slot);  // its previous upload is done before it is overwritten
    uint8_t* base = static_cast<uint8_t*>(host[slot].data_ptr());
    std::vector<ckpt::ReadBatch> batches;
    for (const Segment& s : chunks[k]) {
      std::vector<ckpt::ReadPiece> pieces = ckpt::ClipReads(targets[s.target].sorted, {s.begin, s.begin + s.size});
      ZeroUncovered(base + s.offset, pieces, s.size);
      batches.push_back({{base + s.offset, s.size}, std::move(pieces)});
    }
    bytes += ckpt::ExecuteReads(batches, o.reads);
    Deliver(chunks[k], targets, host[slot], device[slot], streams, slot);
  }
  streams.WaitAll();
  return bytes;
}

// The value of environment variable `name`, when set: a decimal integer in
// [lo, hi], else std::invalid_argument naming the variable.
std::optional<uint64_t> EnvNumber(const char* name, uint64_t lo, uint64_t hi, const char* what) {
  const char* env = std::getenv(name);
  if (!env || !*env) return std::nullopt;
  char* end = nullptr;
  errno = 0;
  const unsigned long long v = std::strtoull(env, &end, 10);
  if (*end != '\0' || errno != 0 || env[0] == '-' || v < lo || v > hi)
    throw std::invalid_argument(std::string(name) + "='" + env + "': not " + what + " from " + std::to_string(lo) +
                                " to " + std::to_string(hi));
  return v;
}

}  // namespace

uint64_t DefaultChunkBytes() {
  return EnvNumber("UCKPT_LOAD_CHUNK_BYTES", kAlign, UINT64_MAX, "a number of bytes").value_or(kDefaultChunkBytes);
}

int DefaultLoadThreads() {
  if (auto n = EnvNumber("UCKPT_LOAD_THREADS", 1, 1024, "a number of threads")) return static_cast<int>(*n);
  return std::min(8, ckpt::DefaultThreads());
}

uint64_t FillFromReads(std::vector<TensorReads>& in, const StagedOptions& options) {
  c10::NoGradGuard no_grad;  // destinations may be parameters
  StagedOptions o = options;
  const uint64_t chunk_bytes = o.chunk_bytes ? std::max(o.chunk_bytes, kAlign) : DefaultChunkBytes();
  if (o.reads.threads <= 0) o.reads.threads = DefaultLoadThreads();
  // Direct reads split pieces at 8 MiB; a staging chunk is split over every thread.
  const uint64_t per_thread = (chunk_bytes + o.reads.threads - 1) / static_cast<uint64_t>(o.reads.threads);
  ckpt::ReadOptions direct_reads{o.reads.threads, o.reads.chunk ? o.reads.chunk : 8ull << 20, o.reads.read};
  if (!o.reads.chunk) o.reads.chunk = std::max<uint64_t>(per_thread, 64 << 10);
  std::vector<Target> targets;
  std::vector<ckpt::ReadBatch> direct;
  std::vector<size_t> staged;
  for (TensorReads& r : in) {  // every plan is checked before anything is written
    Target t{&r, static_cast<uint64_t>(r.dst.numel()) * c10::elementSize(r.source), {}, {}};
    t.sorted = ckpt::SortReads(r.pieces, t.bytes);
    targets.push_back(std::move(t));
  }
  for (size_t k = 0; k < targets.size(); ++k) {
    Target& t = targets[k];
    const at::Tensor& dst = t.reads->dst;
    if (ReadsDirectly(dst, t.reads->source, o)) {
      uint8_t* base = static_cast<uint8_t*>(dst.data_ptr());
      ZeroUncovered(base, t.sorted, t.bytes);
      direct.push_back({{base, t.bytes}, t.sorted});
    } else {
      t.flat = (dst.is_contiguous() ? dst : at::empty(dst.sizes(), dst.options())).view({-1});
      staged.push_back(k);
    }
  }
  uint64_t bytes = ckpt::ExecuteReads(direct, direct_reads);
  bytes += FillStaged(targets, staged, o, chunk_bytes);
  for (size_t t : staged) {
    at::Tensor& dst = targets[t].reads->dst;
    if (!dst.is_contiguous()) dst.copy_(targets[t].flat.view(dst.sizes()));
  }
  return bytes;
}

}  // namespace uckpt::engine
