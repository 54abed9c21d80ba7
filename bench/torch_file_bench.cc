// Times uckpt's torch-file writer and reader on a GPT-like state dict of a few
// hundred fp32/bf16 tensors (about 1.2 GiB). bench/torch_file.sh runs it and
// compares the times with `cp` and `cat` of the same file.
//
//   torch_file_bench write FILE [--durable] [--runs N] [--layers L]
//       Builds the state dict in memory (not timed), then saves it to FILE N
//       times (best time reported). Before each run FILE is removed and the
//       page cache written back (`sync`), neither timed, as the script does
//       before each `cp`.
//   torch_file_bench read FILE [--runs N]
//       Loads FILE and reads every byte of every tensor (summing 64-bit
//       words), N times in this process; each run maps the file afresh.
//
// Both print one line: "<mode> best_s=<wall seconds> cpu_s=<CPU seconds of
// that run> bytes=<tensor bytes> file_bytes=<n> tensors=<n> checksum=<hex>";
// write and read of the same state dict print the same checksum.
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "format/error.h"
#include "format/torch_file.h"
#include "format/value.h"

namespace {

using namespace uckpt;
using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }

// User + system CPU seconds of this process so far.
double CpuSeconds() {
  struct rusage ru;
  ::getrusage(RUSAGE_SELF, &ru);
  auto s = [](const timeval& t) { return static_cast<double>(t.tv_sec) + t.tv_usec * 1e-6; };
  return s(ru.ru_utime) + s(ru.ru_stime);
}

// The fastest of several timed runs, and the CPU time that run used.
struct Best {
  double wall = 1e9, cpu = 0;
  void Add(Clock::time_point start, double cpu_start) {
    double w = Seconds(start, Clock::now());
    if (w < wall) {
      wall = w;
      cpu = CpuSeconds() - cpu_start;
    }
  }
};

// Sum of the 64-bit little-endian words of `bytes` (a short tail is zero-padded).
uint64_t SumWords(std::span<const uint8_t> bytes) {
  const size_t words = bytes.size() / 8;
  uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  const uint8_t* p = bytes.data();
  size_t k = 0;
  for (; k + 4 <= words; k += 4) {
    uint64_t w[4];
    std::memcpy(w, p + 8 * k, sizeof w);
    s0 += w[0];
    s1 += w[1];
    s2 += w[2];
    s3 += w[3];
  }
  for (; k < words; ++k) {
    uint64_t w;
    std::memcpy(&w, p + 8 * k, 8);
    s0 += w;
  }
  uint64_t tail = 0;
  std::memcpy(&tail, p + 8 * words, bytes.size() % 8);
  return s0 + s1 + s2 + s3 + tail;
}

struct Touched {
  uint64_t checksum = 0, bytes = 0, tensors = 0;
};

// Reads every byte of every tensor in the tree under `v`.
void TouchTensors(const Value& v, Touched& t) {
  if (v.tensor) {
    auto view = v.tensor->contiguous_view();
    if (view.size() != v.tensor->nbytes()) throw FormatError("benchmark expects contiguous tensors");
    t.checksum = t.checksum * 31 + SumWords(view);
    t.bytes += view.size();
    t.tensors += 1;
  }
  for (const auto& it : v.items) TouchTensors(*it, t);
  for (const auto& [k, val] : v.entries) TouchTensors(*val, t);
}

// Deterministic, non-repeating contents (compressible data would flatter nothing
// here, but a constant might let a filesystem play tricks).
std::vector<uint8_t> Fill(size_t n, uint64_t seed) {
  std::vector<uint8_t> out(n);
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  size_t k = 0;
  for (; k + 8 <= n; k += 8) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    std::memcpy(out.data() + k, &x, 8);
  }
  for (; k < n; ++k) out[k] = static_cast<uint8_t>(k);
  return out;
}

// A GPT-2-medium-like state dict: embeddings, then `layers` transformer blocks
// of hidden size 1024, even blocks fp32 and odd blocks bf16.
ValuePtr MakeStateDict(int layers) {
  const int64_t h = 1024, vocab = 50304, ctx = 2048;
  auto root = Value::Dict(/*ordered=*/true);
  uint64_t seed = 0;
  auto add = [&](const std::string& name, DType dt, std::vector<int64_t> shape) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    auto bytes = Fill(static_cast<size_t>(n) * DTypeSize(dt), ++seed);
    root->set(name, Value::FromTensor(Tensor::FromBytes(dt, std::move(shape), std::move(bytes))));
  };
  add("wte.weight", DType::kFloat32, {vocab, h});
  add("wpe.weight", DType::kFloat32, {ctx, h});
  for (int l = 0; l < layers; ++l) {
    const DType dt = l % 2 == 0 ? DType::kFloat32 : DType::kBFloat16;
    const std::string p = "h." + std::to_string(l) + ".";
    add(p + "ln_1.weight", dt, {h});
    add(p + "ln_1.bias", dt, {h});
    add(p + "attn.c_attn.weight", dt, {3 * h, h});
    add(p + "attn.c_attn.bias", dt, {3 * h});
    add(p + "attn.c_proj.weight", dt, {h, h});
    add(p + "attn.c_proj.bias", dt, {h});
    add(p + "ln_2.weight", dt, {h});
    add(p + "ln_2.bias", dt, {h});
    add(p + "mlp.c_fc.weight", dt, {4 * h, h});
    add(p + "mlp.c_fc.bias", dt, {4 * h});
    add(p + "mlp.c_proj.weight", dt, {h, 4 * h});
    add(p + "mlp.c_proj.bias", dt, {h});
  }
  add("ln_f.weight", DType::kFloat32, {h});
  add("ln_f.bias", DType::kFloat32, {h});
  return root;
}

uint64_t FileSize(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 ? static_cast<uint64_t>(st.st_size) : 0;
}

void Print(const char* mode, const Best& best, const Touched& t, const std::string& path) {
  std::printf("%s best_s=%.4f cpu_s=%.4f bytes=%llu file_bytes=%llu tensors=%llu checksum=%016llx\n", mode, best.wall,
              best.cpu, static_cast<unsigned long long>(t.bytes), static_cast<unsigned long long>(FileSize(path)),
              static_cast<unsigned long long>(t.tensors), static_cast<unsigned long long>(t.checksum));
}

int Write(const std::string& path, bool durable, int runs, int layers) {
  ValuePtr root = MakeStateDict(layers);
  Touched t;
  TouchTensors(*root, t);
  Best best;
  for (int r = 0; r < runs; ++r) {
    ::unlink(path.c_str());
    ::sync();
    const double cpu = CpuSeconds();
    const auto start = Clock::now();
    SaveTorchFile(path, root, {.durable = durable});
    best.Add(start, cpu);
  }
  Print(durable ? "write_durable" : "write", best, t, path);
  return 0;
}

int Read(const std::string& path, int runs) {
  Best best;
  Touched t;
  for (int r = 0; r < runs; ++r) {
    const double cpu = CpuSeconds();
    const auto start = Clock::now();
    {
      TorchFile f = LoadTorchFile(path);
      t = {};
      TouchTensors(*f.root, t);
    }  // unmapping is part of the run
    best.Add(start, cpu);
  }
  Print("read", best, t, path);
  return 0;
}

int Usage() {
  std::fprintf(stderr,
               "usage: torch_file_bench write FILE [--durable] [--runs N] [--layers L]\n"
               "       torch_file_bench read FILE [--runs N]\n");
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) return Usage();
  const std::string mode = argv[1], path = argv[2];
  bool durable = false;
  int runs = 3, layers = 28;
  for (int k = 3; k < argc; ++k) {
    std::string a = argv[k];
    if (a == "--durable") durable = true;
    else if (a == "--runs" && k + 1 < argc) runs = std::max(1, std::atoi(argv[++k]));
    else if (a == "--layers" && k + 1 < argc) layers = std::max(0, std::atoi(argv[++k]));
    else return Usage();
  }
  try {
    if (mode == "write") return Write(path, durable, runs, layers);
    if (mode == "read") return Read(path, runs);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "torch_file_bench: %s\n", e.what());
    return 1;
  }
  return Usage();
}
