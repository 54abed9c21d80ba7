// torch.distributed glue: init_distributed and the engine's collectives on
// torch.distributed's default group (see py_dist.h).
#include "py_dist.h"

#include <cstdlib>
#include <iostream>

#include "py_values.h"
#include "uckpt/process_group.h"

namespace uckpt::python {

using namespace pybind11::literals;

std::string PickDevice() {
  const char* acc = std::getenv("DS_ACCELERATOR");
  if (acc && std::string(acc) == "cpu") return "cpu";
  return py::module_::import("torch").attr("cuda").attr("is_available")().cast<bool>() ? "cuda" : "cpu";
}

namespace {

// An engine's comm on torch.distributed's group, which Python owns: the
// engine would keep the group (its threads and its sockets to the other
// ranks) alive past the script's or the exit's destroy_process_group, into
// interpreter finalization (an engine lives to the end: its module's hooks
// hold it). Release() drops the engine's share at exit
// (ReleaseTorchDistributedGroups); a collective after it is a CommError.
class TorchGroupComm : public Comm {
 public:
  explicit TorchGroupComm(std::unique_ptr<Comm> group)
      : group_(std::move(group)), rank_(group_->rank()), world_(group_->world_size()), backend_(group_->backend()) {}
  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  std::string backend() const override { return backend_; }
  void AllReduceSum(at::Tensor& t) override { Group().AllReduceSum(t); }
  void AllReduceMax(at::Tensor& t) override { Group().AllReduceMax(t); }
  void ReduceScatterSum(at::Tensor& in, at::Tensor& out) override { Group().ReduceScatterSum(in, out); }
  void AllGather(const at::Tensor& in, at::Tensor& out) override { Group().AllGather(in, out); }
  void Broadcast(at::Tensor& t, int root) override { Group().Broadcast(t, root); }
  void Barrier() override { Group().Barrier(); }
  std::unique_ptr<Pending> StartAllReduceSum(at::Tensor& t) override { return Group().StartAllReduceSum(t); }
  std::unique_ptr<Pending> StartReduceScatterSum(at::Tensor& in, at::Tensor& out) override {
    return Group().StartReduceScatterSum(in, out);
  }
  std::unique_ptr<Pending> StartAllGather(const at::Tensor& in, at::Tensor& out) override {
    return Group().StartAllGather(in, out);
  }
  void Release() { group_.reset(); }

 private:
  Comm& Group() {
    if (!group_)
      throw CommError("uckpt: rank " + std::to_string(rank_) +
                      ": a collective after the interpreter's exit began "
                      "(uckpt ended its use of torch.distributed's process group then)");
    return *group_;
  }
  std::unique_ptr<Comm> group_;
  int rank_, world_;
  std::string backend_;
};

// The live engines' comms on torch.distributed's group (kept for the process).
std::vector<std::weak_ptr<TorchGroupComm>>& TorchGroupComms() {
  static auto* comms = new std::vector<std::weak_ptr<TorchGroupComm>>();
  return *comms;
}

}  // namespace

std::shared_ptr<Comm> CommFromTorchDistributed(const std::string& device) {
  py::module_ dist = py::module_::import("torch.distributed");
  if (!dist.attr("is_initialized")().cast<bool>())
    InitDistributed(py::none(), true, 29500, true, py::none(), py::none(), py::none(), py::none(), -1, -1);
  if (dist.attr("get_world_size")().cast<int>() == 1) return MakeSingleProcessComm();
  py::object pg = dist.attr("distributed_c10d").attr("_get_default_group")();
  c10::intrusive_ptr<c10d::ProcessGroup> ptr;
  try {
    // Through the raw pointer: torch's Python holder type for process groups
    // differs between versions; the object itself is intrusive-refcounted.
    ptr = c10::intrusive_ptr<c10d::ProcessGroup>::reclaim_copy(pg.cast<c10d::ProcessGroup*>());
  } catch (const py::cast_error&) {
    throw std::runtime_error("uckpt: cannot use torch.distributed's process group (" + TypeName(pg) +
                             ") from C++: was uckpt built against the torch that Python imports?");
  }
  // NCCL's tensors live on this process's GPU: LOCAL_RANK's, as the engine places the module.
  const char* lr = std::getenv("LOCAL_RANK");
  const auto index = static_cast<c10::DeviceIndex>(lr && *lr ? std::atoi(lr) : 0);
  const at::Device d = device == "cuda" ? at::Device(at::kCUDA, index) : at::Device(at::kCPU);
  auto comm = std::make_shared<TorchGroupComm>(CommOnProcessGroup(ptr, d));
  TorchGroupComms().push_back(comm);
  py::module_::import("uckpt.comm").attr("_release_engines_at_exit")();
  return comm;
}

namespace {

// DeepSpeed's default_pg_timeout: DEEPSPEED_TIMEOUT minutes, else 30.
py::object DefaultTimeout() {
  const char* v = std::getenv("DEEPSPEED_TIMEOUT");
  const int minutes = v && *v ? std::atoi(v) : 30;
  return py::module_::import("datetime").attr("timedelta")("minutes"_a = minutes);
}

// configure(deepspeed_config=config) reads its comms_config (the comms
// logger); uckpt logs no collectives.
void CheckCommsConfig(py::handle config) {
  if (config.is_none()) return;
  if (!py::hasattr(config, "comms_config"))
    throw py::type_error(
        "uckpt.init_distributed: config must be a DeepSpeedConfig (DeepSpeed 0.14.5 reads its "
        "comms_config), got " +
        TypeName(config));
  py::object comms = config.attr("comms_config");
  if (py::hasattr(comms, "enabled") && comms.attr("enabled").cast<bool>())
    std::cerr << "uckpt: warning: init_distributed: the comms logger (comms_config) is not supported; collectives "
                 "are not logged\n";
}

// What deepspeed.init_distributed's MPI discovery exports: the world as
// RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT.
void ExportWorld(py::object environ, const DistEnv& env, bool overwrite) {
  const std::pair<const char*, std::string> vars[] = {{"RANK", std::to_string(env.rank)},
                                                      {"WORLD_SIZE", std::to_string(env.world_size)},
                                                      {"LOCAL_RANK", std::to_string(env.local_rank)},
                                                      {"MASTER_ADDR", env.master_addr},
                                                      {"MASTER_PORT", std::to_string(env.master_port)}};
  for (const auto& [k, v] : vars)
    if (overwrite || !environ.contains(k)) environ[py::str(k)] = v;
}

// deepspeed.init_distributed's discovery, when the launcher's variables are
// not all there: an MPI or Slurm launcher's world (DistEnv), or a world of one.
void DiscoverWorld(int distributed_port, bool verbose) {
  py::object environ = py::module_::import("os").attr("environ");
  bool all = true;
  for (const char* v : {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"}) all &= environ.contains(v);
  if (all) return;
  std::optional<DistEnv> env;
  try {
    env = DistEnv::FromEnvironment(true, distributed_port);
  } catch (const std::invalid_argument& e) {
    throw py::value_error(std::string("uckpt.init_distributed: ") + e.what());
  }
  if (env && !env->discovered()) return;  // torchrun-style variables: torch reads them
  if (!env) {
    // No launcher: a world of one, as mpi4py reports outside mpirun.
    DistEnv one;
    one.master_port = distributed_port;
    ExportWorld(environ, one, /*overwrite=*/false);
    return;
  }
  ExportWorld(environ, *env, /*overwrite=*/true);
  if (verbose)
    std::cerr << "uckpt: init_distributed: discovered " << env->launcher << " settings of world_rank=" << env->rank
              << ", local_rank=" << env->local_rank << ", world_size=" << env->world_size
              << ", master_addr=" << env->master_addr << ", master_port=" << env->master_port << "\n";
}

}  // namespace

void ReleaseTorchDistributedGroups() {
  std::vector<std::shared_ptr<TorchGroupComm>> live;
  for (auto& weak : TorchGroupComms())
    if (auto comm = weak.lock()) live.push_back(std::move(comm));
  TorchGroupComms().clear();
  // The last reference ends the group: its threads are joined, and one may need the GIL to free a tensor.
  py::gil_scoped_release no_gil;
  for (auto& comm : live) comm->Release();
}

void InitDistributed(py::object dist_backend, bool auto_mpi_discovery, int distributed_port, bool verbose,
                     py::object timeout, py::object init_method, py::object dist_init_required, py::object config,
                     int rank, int world_size) {
  py::module_ dist = py::module_::import("torch.distributed");
  CheckCommsConfig(config);
  const bool initialized = dist.attr("is_initialized")().cast<bool>();
  const bool required = dist_init_required.is_none() ? !initialized : dist_init_required.cast<bool>();
  if (!required && !initialized)
    throw py::value_error(
        "uckpt.init_distributed: dist_init_required=False but torch.distributed is not initialized; "
        "pass dist_init_required=True or initialize it before calling uckpt.initialize()");
  py::module_::import("uckpt.comm").attr("_end_cleanly_at_exit")();
  if (initialized) return;  // the script's own group (or an earlier call's)
  if (timeout.is_none()) timeout = DefaultTimeout();
  if (!py::isinstance(timeout, py::module_::import("datetime").attr("timedelta")))
    throw py::type_error("uckpt.init_distributed: timeout must be a datetime.timedelta, got " + TypeName(timeout));
  if (auto_mpi_discovery) DiscoverWorld(distributed_port, verbose);
  const std::string backend =
      !dist_backend.is_none() ? dist_backend.cast<std::string>() : (PickDevice() == "cuda" ? "nccl" : "gloo");
  py::object environ = py::module_::import("os").attr("environ");
  const int world = world_size != -1                 ? world_size
                    : environ.contains("WORLD_SIZE") ? py::int_(environ["WORLD_SIZE"]).cast<int>()
                                                     : -1;
  if (init_method.is_none() && world == 1 && rank <= 0) {
    // One process: a group of one on an in-memory store (no port to collide on).
    dist.attr("init_process_group")(backend, "store"_a = dist.attr("HashStore")(), "rank"_a = 0, "world_size"_a = 1,
                                    "timeout"_a = timeout);
    return;
  }
  // DeepSpeed's TorchBackend: init_method, rank and world_size as given (env:// by default).
  dist.attr("init_process_group")(backend, "timeout"_a = timeout, "init_method"_a = init_method, "rank"_a = rank,
                                  "world_size"_a = world_size);
}

void BindDistributed(py::module_& m) {
  m.def("init_distributed", &InitDistributed, "dist_backend"_a = py::none(), "auto_mpi_discovery"_a = true,
        "distributed_port"_a = 29500, "verbose"_a = true, "timeout"_a = py::none(), "init_method"_a = py::none(),
        "dist_init_required"_a = py::none(), "config"_a = py::none(), "rank"_a = -1, "world_size"_a = -1);
  m.def("_release_process_groups", &ReleaseTorchDistributedGroups,
        "At exit: the live engines stop using torch.distributed's process group (uckpt.comm's teardown).");
}

}  // namespace uckpt::python
