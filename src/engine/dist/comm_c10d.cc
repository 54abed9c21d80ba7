// The c10d process group behind Comm, and the only place that knows libtorch
// versions:
//  - libtorch 1.13: Gloo has no _reduce_scatter_base / _allgather_base;
//    reduce-scatter is an all-reduce plus a local slice, and all-gather the
//    list form with views into the output.
//  - libtorch 2.x: the flat _reduce_scatter_base / _allgather_base. Its wheels
//    have Gloo but not Gloo's headers: Debian's libgloo-dev declares the types
//    ProcessGroupGloo.hpp names (only through pointers, so no layout is taken
//    from them).
//  - Gloo of libtorch 1.13 knows no bfloat16: all-gathers move its bits as
//    fp16, reductions go through fp32. From 2.x on its reductions are in bf16
//    (as torch.distributed's, which DeepSpeed calls: at more than 2 ranks an
//    fp32 sum rounded once is another number).
#include <torch/version.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#if __has_include(<torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>) && __has_include(<gloo/algorithm.h>) && \
    !defined(UCKPT_NO_GLOO)
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#define UCKPT_HAVE_GLOO 1
#endif
#ifdef USE_C10D_NCCL
#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <functional>
#include <thread>

#include "engine/dist/rank_monitor.h"
#include "uckpt/comm.h"
#include "uckpt/process_group.h"

namespace uckpt {
namespace {

constexpr bool kFlatCollectives = TORCH_VERSION_MAJOR >= 2;

// c10::Error messages carry a C++ backtrace; users need the first line.
std::string Brief(const std::exception& e) {
  const auto* c10 = dynamic_cast<const c10::Error*>(&e);
  std::string msg = c10 ? c10->what_without_backtrace() : e.what();
  if (auto nl = msg.find('\n'); nl != std::string::npos) msg.resize(nl);
  return msg;
}

// NCCL takes only GPU tensors: CPU ones (scalars, offloaded partitions) travel
// through a device copy.
template <typename F>
void OnDevice(at::Device device, std::initializer_list<at::Tensor*> ts, F&& f) {
  bool stage = false;
  for (auto* t : ts) stage |= t->device() != device;
  if (!stage) return f();
  std::vector<at::Tensor> orig;
  for (auto* t : ts) {
    orig.push_back(*t);
    *t = t->to(device);
  }
  f();
  size_t k = 0;
  for (auto* t : ts) {
    orig[k].copy_(*t);
    *t = orig[k++];
  }
}

template <typename PG>
class C10dComm : public Comm {
 public:
  C10dComm(c10::intrusive_ptr<c10d::Store> store, c10::intrusive_ptr<PG> pg, int rank, int world, std::string backend,
           std::chrono::milliseconds timeout, at::Device device, bool owns_pg = true)
      : store_(std::move(store)),
        pg_(std::move(pg)),
        rank_(rank),
        world_(world),
        backend_(std::move(backend)),
        timeout_(timeout),
        device_(device),
        owns_pg_(owns_pg) {}

  ~C10dComm() override {
    // A group borrowed from the caller (Python's) is the caller's to end.
    if (owns_pg_ && !shut_down_) ShutDownGroup();
  }

  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  std::string backend() const override { return backend_; }

  void Watch(std::unique_ptr<engine::RankMonitor> monitor) { monitor_ = std::move(monitor); }
  void SetActivity(std::string activity) override {
    if (monitor_) monitor_->SetActivity(std::move(activity));
  }
  void Abandon(const std::string& why) override {
    if (monitor_) monitor_->Abandon(why);
  }
  void Finish() override {
    if (monitor_) monitor_->Finish();
    if (owns_pg_ && store_ && !shut_down_) LeaveInOrder();
  }

  void AllReduceSum(at::Tensor& t) override {
    OnDevice(device_, {&t}, [&] { AllReduce(t, c10d::ReduceOp::SUM, "all-reduce"); });
  }
  std::unique_ptr<Pending> StartAllReduceSum(at::Tensor& t) override {
    if (t.device() != device_ || (backend_ == "gloo" && t.scalar_type() == at::kBFloat16))
      return Comm::StartAllReduceSum(t);  // staged or converted: synchronous
    std::vector<at::Tensor> ts{t};
    return Start("all-reduce (overlapped)", [&] { return pg_->allreduce(ts); }, {t});
  }

  std::unique_ptr<Pending> StartReduceScatterSum(at::Tensor& in, at::Tensor& out) override {
    if (in.device() != device_ || out.device() != device_ || (backend_ == "gloo" && in.scalar_type() == at::kBFloat16))
      return Comm::StartReduceScatterSum(in, out);  // staged or converted: synchronous
    if constexpr (kFlatCollectives) {
      return Start("reduce-scatter (overlapped)", [&] { return pg_->_reduce_scatter_base(out, in); }, {in, out});
    } else {  // an all-reduce, then this rank's chunk once it is done
      std::vector<at::Tensor> ts{in};
      const int64_t begin = rank_ * out.numel();
      return Start(
          "reduce-scatter (overlapped all-reduce)", [&] { return pg_->allreduce(ts); }, {in, out},
          [in, out, begin]() mutable { out.copy_(in.view(-1).narrow(0, begin, out.numel()).view_as(out)); });
    }
  }

  std::unique_ptr<Pending> StartAllGather(const at::Tensor& in_any, at::Tensor& out_any) override {
    if (in_any.device() != device_ || out_any.device() != device_) return Comm::StartAllGather(in_any, out_any);
    // Gloo (1.13) has no bf16: gather its bits as fp16 (a copy, no arithmetic).
    const bool bits = backend_ == "gloo" && in_any.scalar_type() == at::kBFloat16;
    at::Tensor in = bits ? in_any.view(at::kHalf) : in_any;
    at::Tensor out = bits ? out_any.view(at::kHalf) : out_any;
    if constexpr (kFlatCollectives) {
      return Start("all-gather (overlapped)", [&] { return pg_->_allgather_base(out, in); }, {in, out});
    } else {
      std::vector<std::vector<at::Tensor>> outs(1);
      at::Tensor flat = out.view(-1);
      for (int r = 0; r < world_; ++r) outs[0].push_back(flat.narrow(0, r * in.numel(), in.numel()).view_as(in));
      std::vector<at::Tensor> ins{in};
      return Start("all-gather (overlapped)", [&] { return pg_->allgather(outs, ins); }, {in, out});
    }
  }

  void AllReduceMax(at::Tensor& t) override {
    OnDevice(device_, {&t}, [&] { AllReduce(t, c10d::ReduceOp::MAX, "all-reduce (max)"); });
  }

  void ReduceScatterSum(at::Tensor& in, at::Tensor& out) override {
    OnDevice(device_, {&in, &out}, [&] { ReduceScatterOnDevice(in, out); });
  }
  void ReduceScatterOnDevice(at::Tensor& in, at::Tensor& out) {
    if constexpr (kFlatCollectives) {
      Run("reduce-scatter", [&] { return pg_->_reduce_scatter_base(out, in); });
    } else {
      AllReduce(in, c10d::ReduceOp::SUM, "reduce-scatter (all-reduce)");
      out.copy_(in.view(-1).narrow(0, rank_ * out.numel(), out.numel()).view_as(out));
    }
  }

  void AllGather(const at::Tensor& in_const, at::Tensor& out_any) override {
    at::Tensor in_any = in_const;
    OnDevice(device_, {&in_any, &out_any}, [&] { AllGatherOnDevice(in_any, out_any); });
  }
  void AllGatherOnDevice(const at::Tensor& in_any, at::Tensor& out_any) {
    // Gloo (1.13) has no bf16: gather its bits as fp16 (a copy, no arithmetic).
    const bool bits = backend_ == "gloo" && in_any.scalar_type() == at::kBFloat16;
    const at::Tensor in = bits ? in_any.view(at::kHalf) : in_any;
    at::Tensor out = bits ? out_any.view(at::kHalf) : out_any;
    if constexpr (kFlatCollectives) {
      at::Tensor src = in;
      Run("all-gather", [&] { return pg_->_allgather_base(out, src); });
    } else {
      std::vector<std::vector<at::Tensor>> outs(1);
      at::Tensor flat = out.view(-1);
      for (int r = 0; r < world_; ++r) outs[0].push_back(flat.narrow(0, r * in.numel(), in.numel()).view_as(in));
      std::vector<at::Tensor> ins{in};
      Run("all-gather", [&] { return pg_->allgather(outs, ins); });
    }
  }

  void Broadcast(at::Tensor& t_any, int root) override {
    OnDevice(device_, {&t_any}, [&] { BroadcastOnDevice(t_any, root); });
  }
  void BroadcastOnDevice(at::Tensor& t, int root) {
    // Gloo (1.13) has no bf16: broadcast its bits as fp16 (a copy, no arithmetic).
    std::vector<at::Tensor> ts{backend_ == "gloo" && t.scalar_type() == at::kBFloat16 ? t.view(at::kHalf) : t};
    c10d::BroadcastOptions o;
    o.rootRank = root;
    Run("broadcast", [&] { return pg_->broadcast(ts, o); });
  }

  void Barrier() override {
    Run("barrier", [&] { return pg_->barrier(); });
  }

 private:
  void AllReduce(at::Tensor& t, c10d::ReduceOp op, const char* what) {
    if (!kFlatCollectives && backend_ == "gloo" && t.scalar_type() == at::kBFloat16) {  // Gloo (1.13) has no bf16
      at::Tensor f = t.to(at::kFloat);
      AllReduce(f, op, what);
      t.copy_(f);
      return;
    }
    std::vector<at::Tensor> ts{t};
    c10d::AllreduceOptions o;
    o.reduceOp = op;
    Run(what, [&] { return pg_->allreduce(ts, o); });
  }

  using WorkPtr = decltype(std::declval<PG&>().barrier());  // c10d::Work (2.x) or ProcessGroup::Work (1.13)

  // A collective started by Start(): Wait() waits for it as Run() does (under
  // NCCL: the current stream waits), then runs `finish`. `keep` holds its tensors until then.
  struct Started : Pending {
    C10dComm* comm = nullptr;
    const char* what = "";
    WorkPtr work;
    std::vector<at::Tensor> keep;
    std::function<void()> finish;
    void Wait() override {
      if (!work) return;  // waited before
      comm->Run(what, [&] { return work; });
      work = WorkPtr();
      if (finish) finish();
      keep.clear();
    }
  };

  template <typename F>
  std::unique_ptr<Pending> Start(const char* what, F&& start, std::vector<at::Tensor> keep,
                                 std::function<void()> finish = {}) {
    auto p = std::make_unique<Started>();
    p->comm = this;
    p->what = what;
    p->keep = std::move(keep);
    p->finish = std::move(finish);
    try {
      p->work = start();
    } catch (const std::exception& e) {
      throw CommError("rank " + std::to_string(rank_) + " of " + std::to_string(world_) + ": starting " + what +
                      " over " + backend_ + " failed: " + Brief(e));
    }
    return p;
  }

  // PyTorch 2.x wants groups shut down explicitly (1.13 has no shutdown()).
  void ShutDownGroup() {
    shut_down_ = true;
    if constexpr (kFlatCollectives) {
      try {
        pg_->shutdown();
      } catch (...) {}
    }
  }

  // A clean end: every rank arrives, the others shut their group down (NCCL's
  // heartbeat thread of torch 2.x polls the store until then) and say so, and
  // the store's owner, rank 0, leaves last. Bounded: a rank that never comes
  // costs the others a wait, never a hang or an error.
  void LeaveInOrder() {
    const auto bound = std::min<std::chrono::milliseconds>(timeout_, std::chrono::seconds(60));
    auto wait_for_count = [&](const std::string& key, int64_t n) {
      const auto deadline = std::chrono::steady_clock::now() + bound;
      while (store_->add(key, 0) < n && std::chrono::steady_clock::now() < deadline)
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
    };
    try {
#ifdef USE_C10D_NCCL
      if (device_.is_cuda()) c10::cuda::device_synchronize();  // this rank's collectives are done
#endif
      store_->add("uckpt/exit/arrived", 1);
      wait_for_count("uckpt/exit/arrived", world_);
      ShutDownGroup();
      if (rank_ != 0) {
        store_->add("uckpt/exit/left", 1);
      } else {
        wait_for_count("uckpt/exit/left", world_ - 1);
      }
    } catch (const std::exception&) {
      // The store is gone (its owner left): nothing to order any more.
    }
    shut_down_ = true;
  }

  template <typename F>
  void Run(const char* what, F&& start) {
    if (monitor_) monitor_->EnterCollective(what);
    try {
      auto work = start();
      // NCCL: wait() without a timeout only orders the current stream after the
      // collective, so the host runs ahead (with one it spins until the GPU is
      // done, after every collective: stage 3 has dozens per step). The group's
      // own timeout (its watchdog) and the rank monitor still end a hung job.
      if (backend_ == "nccl") work->wait();
      else work->wait(timeout_);
      if (monitor_) monitor_->LeaveCollective();
    } catch (const std::exception& e) {
      const std::string msg = Brief(e);
      // Usually a peer died: the monitor names it and ends the process.
      if (monitor_) {
        monitor_->AfterCommError();
        monitor_->LeaveCollective();
      }
      throw CommError("rank " + std::to_string(rank_) + " of " + std::to_string(world_) + ": " + what + " over " +
                      backend_ + " failed (another rank probably exited or timed out): " + msg);
    }
  }

  c10::intrusive_ptr<c10d::Store> store_;
  c10::intrusive_ptr<PG> pg_;
  int rank_, world_;
  std::string backend_;
  std::chrono::milliseconds timeout_;
  at::Device device_;  // where this backend needs its tensors
  bool owns_pg_;
  bool shut_down_ = false;
  std::unique_ptr<engine::RankMonitor> monitor_;  // destroyed first: it may call into pg_
};

c10::intrusive_ptr<c10d::Store> WithPrefix(c10::intrusive_ptr<c10d::Store> store, const std::string& prefix) {
  if (prefix.empty()) return store;
  return c10::make_intrusive<c10d::PrefixStore>(prefix, std::move(store));
}

// The monitor's own store client (a second connection to rank 0's TCPStore),
// and, where the backend can, a communicator abort before the process exits.
template <typename PG>
std::unique_ptr<Comm> Monitored(std::unique_ptr<C10dComm<PG>> comm, c10::intrusive_ptr<PG> pg, const DistEnv& env,
                                const HeartbeatSettings& hs) {
  if (!hs.enabled()) return comm;
  const std::string addr = env.master_addr, prefix = env.store_prefix;
  const auto port = static_cast<std::uint16_t>(env.master_port);
  auto connect = [addr, port, prefix](std::chrono::milliseconds timeout) -> c10::intrusive_ptr<c10d::Store> {
    c10d::TCPStoreOptions so;
    so.port = port;
    so.isServer = false;
    so.waitWorkers = false;  // numWorkers unset: not part of the rendezvous count
    so.timeout = timeout;
    return WithPrefix(c10::make_intrusive<c10d::TCPStore>(addr, so), prefix);
  };
  auto monitor = std::make_unique<engine::RankMonitor>(
      connect, env.rank, env.world_size, hs, addr + ":" + std::to_string(env.master_port), engine::RankMonitor::Exit{},
      env.agent_store ? "torchrun's agent" : "rank 0");
  if constexpr (requires(PG & p) { p.abort(); }) monitor->SetAbortHook([pg] { pg->abort(); });
  comm->Watch(std::move(monitor));
  return comm;
}

}  // namespace

std::unique_ptr<Comm> ConnectC10d(const DistEnv& env, std::chrono::milliseconds timeout, bool cuda,
                                  const HeartbeatSettings& heartbeat) {
  heartbeat.Validate();
  c10d::TCPStoreOptions so;
  so.port = static_cast<std::uint16_t>(env.master_port);
  so.isServer = env.rank == 0 && !env.agent_store;
  so.numWorkers = static_cast<std::size_t>(env.world_size);
  so.waitWorkers = !env.agent_store;  // the process group's own exchange waits for every rank
  so.timeout = timeout;
  c10::intrusive_ptr<c10d::Store> store;
  try {
    store = WithPrefix(c10::make_intrusive<c10d::TCPStore>(env.master_addr, so), env.store_prefix);
  } catch (const std::exception& e) {
    throw CommError("rank " + std::to_string(env.rank) + " of " + std::to_string(env.world_size) + ": rendezvous at " +
                    env.master_addr + ":" + std::to_string(env.master_port) + " failed: " + Brief(e));
  }
  if (cuda) {
#ifdef USE_C10D_NCCL
    auto opts = c10d::ProcessGroupNCCL::Options::create();
    opts->timeout = timeout;
    auto pg = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, env.rank, env.world_size, opts);
    return Monitored(std::make_unique<C10dComm<c10d::ProcessGroupNCCL>>(
                         store, pg, env.rank, env.world_size, "nccl", timeout,
                         at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(env.local_rank))),
                     pg, env, heartbeat);
#else
    throw CommError("this uckpt was built without NCCL; CUDA training across processes needs it");
#endif
  }
#ifdef UCKPT_HAVE_GLOO
  auto opts = c10d::ProcessGroupGloo::Options::create(timeout);
  if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME"); ifname != nullptr && *ifname != '\0') {
    opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(ifname));
  } else if (env.master_addr == "127.0.0.1" || env.master_addr == "localhost") {
    opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
  } else {
    opts->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
  }
  c10::intrusive_ptr<c10d::ProcessGroupGloo> pg;
  try {
    pg = c10::make_intrusive<c10d::ProcessGroupGloo>(store, env.rank, env.world_size, opts);
  } catch (const std::exception& e) {
    throw CommError("rank " + std::to_string(env.rank) + " of " + std::to_string(env.world_size) +
                    ": connecting the Gloo process group through " + env.master_addr + ":" +
                    std::to_string(env.master_port) + " failed within " + std::to_string(timeout.count() / 1000) +
                    " s (did every rank start?): " + Brief(e));
  }
  return Monitored(std::make_unique<C10dComm<c10d::ProcessGroupGloo>>(store, pg, env.rank, env.world_size, "gloo",
                                                                      timeout, at::Device(at::kCPU)),
                   pg, env, heartbeat);
#else
  throw CommError("this uckpt was built without Gloo (its libtorch has no Gloo headers); use CUDA with NCCL");
#endif
}

std::unique_ptr<Comm> CommOnProcessGroup(c10::intrusive_ptr<c10d::ProcessGroup> pg, at::Device device,
                                         std::chrono::milliseconds timeout) {
  if (!pg) throw std::invalid_argument("CommOnProcessGroup: no process group");
  const int rank = pg->getRank(), world = pg->getSize();
  std::string backend = pg->getBackendName();
  return std::make_unique<C10dComm<c10d::ProcessGroup>>(c10::intrusive_ptr<c10d::Store>(), std::move(pg), rank, world,
                                                        std::move(backend), timeout, device, /*owns_pg=*/false);
}

}  // namespace uckpt
