#include "uckpt/comm.h"

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

}  // namespace uckpt
