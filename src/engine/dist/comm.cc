#include "uckpt/comm.h"

#include <cstdlib>

namespace uckpt {
namespace {

class SingleProcessComm : public Comm {
 public:
  int rank() const override { return 0; }
  int world_size() const override { return 1; }
  std::string backend() const override { return "none"; }
  void AllReduceSum(at::Tensor&) override {}
  void AllReduceMax(at::Tensor&) override {}
  void ReduceScatterSum(at::Tensor& in, at::Tensor& out) override {
    if (!in.is_same(out)) out.copy_(in.view_as(out));
  }
  void AllGather(const at::Tensor& in, at::Tensor& out) override { out.copy_(in.view_as(out)); }
  void Broadcast(at::Tensor&, int) override {}
  void Barrier() override {}
};

int EnvInt(const char* name, int fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  char* end = nullptr;
  long x = std::strtol(v, &end, 10);
  if (*end != '\0' || x < 0 || x > 1 << 30)
    throw std::invalid_argument(std::string("environment variable ") + name + "='" + v + "' is not a valid number");
  return static_cast<int>(x);
}

}  // namespace

namespace {
struct Done : Comm::Pending {
  void Wait() override {}
};
}  // namespace

std::unique_ptr<Comm::Pending> Comm::StartAllReduceSum(at::Tensor& t) {
  AllReduceSum(t);
  return std::make_unique<Done>();
}

std::unique_ptr<Comm::Pending> Comm::StartReduceScatterSum(at::Tensor& in, at::Tensor& out) {
  ReduceScatterSum(in, out);
  return std::make_unique<Done>();
}

std::unique_ptr<Comm::Pending> Comm::StartAllGather(const at::Tensor& in, at::Tensor& out) {
  AllGather(in, out);
  return std::make_unique<Done>();
}

void HeartbeatSettings::Validate() const {
  if (!enabled()) return;
  if (!(interval_s > 0) || !(interval_s * 2 <= timeout_s))
    throw std::invalid_argument("heartbeat: the interval (" + std::to_string(interval_s) +
                                " s) must be > 0 and at most half the timeout (" + std::to_string(timeout_s) +
                                " s; 0 turns the monitor off)");
}

std::unique_ptr<Comm> MakeSingleProcessComm() { return std::make_unique<SingleProcessComm>(); }

std::optional<DistEnv> DistEnv::FromEnvironment() {
  if (std::getenv("WORLD_SIZE") == nullptr) return std::nullopt;
  DistEnv e;
  e.world_size = EnvInt("WORLD_SIZE", 1);
  e.rank = EnvInt("RANK", 0);
  e.local_rank = EnvInt("LOCAL_RANK", e.rank);
  e.master_port = EnvInt("MASTER_PORT", 29500);
  if (const char* a = std::getenv("MASTER_ADDR"); a != nullptr && *a != '\0') e.master_addr = a;
  if (const char* a = std::getenv("TORCHELASTIC_USE_AGENT_STORE"); a != nullptr && std::string(a) == "True") {
    e.agent_store = true;
    e.store_prefix = "/worker/attempt_" + std::to_string(EnvInt("TORCHELASTIC_RESTART_COUNT", 0));
  }
  if (e.world_size < 1 || e.rank >= e.world_size)
    throw std::invalid_argument("RANK " + std::to_string(e.rank) + " is not below WORLD_SIZE " +
                                std::to_string(e.world_size));
  return e;
}

}  // namespace uckpt
