// Collectives over the data-parallel ranks (public: an engine can be given one). One process (world size 1) needs
// no process group; several use c10d (TCPStore rendezvous, Gloo on CPU, NCCL
// on CUDA), see comm_c10d.cc, the one file that knows libtorch versions.
#pragma once

#include <ATen/ATen.h>

#include <chrono>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>

namespace uckpt {

// A collective failed: usually another rank died or timed out. The message
// says which rank saw it and what it was doing.
class CommError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class Comm {
 public:
  virtual ~Comm() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  virtual std::string backend() const = 0;

  // In place: every rank ends with the element-wise sum (max) over ranks.
  virtual void AllReduceSum(at::Tensor& t) = 0;
  virtual void AllReduceMax(at::Tensor& t) = 0;
  // `in` (world_size * out.numel() elements) is summed over ranks and rank r
  // keeps chunk r in `out`. `in` may be modified.
  virtual void ReduceScatterSum(at::Tensor& in, at::Tensor& out) = 0;
  // `out` (world_size * in.numel() elements) = every rank's `in`, in rank order.
  // `in` must not alias `out`.
  virtual void AllGather(const at::Tensor& in, at::Tensor& out) = 0;
  virtual void Broadcast(at::Tensor& t, int root) = 0;
  virtual void Barrier() = 0;

  // A collective started by Start*: Wait() finishes it (throws CommError on failure).
  class Pending {
   public:
    virtual ~Pending() = default;
    virtual void Wait() = 0;
  };
  // Starts an in-place sum over ranks and returns at once where the backend
  // can (NCCL, Gloo); `t` must stay alive and untouched until Wait(). Every
  // rank must start the same collectives in the same order, from any thread.
  // The default runs AllReduceSum now.
  virtual std::unique_ptr<Pending> StartAllReduceSum(at::Tensor& t);
  // ReduceScatterSum and AllGather, started the same way: `in` and `out` must
  // stay alive and untouched until Wait(), which leaves `out` complete. On
  // CUDA (NCCL) the collective runs on NCCL's stream; Wait() makes the
  // current stream wait for it. The defaults run the collective now.
  virtual std::unique_ptr<Pending> StartReduceScatterSum(at::Tensor& in, at::Tensor& out);
  virtual std::unique_ptr<Pending> StartAllGather(const at::Tensor& in, at::Tensor& out);

  // Failing ranks (RankMonitor; no-ops without one). What this rank is doing
  // now, named if the job fails ("step 7", "saving global_step6").
  virtual void SetActivity(std::string /*activity*/) {}
  // This rank is leaving with an error: tell the others, so they exit at once naming it.
  virtual void Abandon(const std::string& /*why*/) {}
  // The job ended cleanly on this rank (no more collectives).
  virtual void Finish() {}
};

// Heartbeats between ranks (see rank_monitor.h): a rank whose heartbeat is
// `timeout_s` old is dead and the others exit naming it.
struct HeartbeatSettings {
  double interval_s = 1.0;  // how often each rank beats and polls
  double timeout_s = 20.0;  // 0 turns the monitor off
  bool enabled() const { return timeout_s > 0; }
  // Throws std::invalid_argument unless 0 < interval <= timeout / 2 (or off).
  void Validate() const;
};

std::unique_ptr<Comm> MakeSingleProcessComm();

// Where this process's rank and world come from: what torchrun (or `uckpt
// launch`) puts in the environment, or, found as deepspeed.init_distributed
// discovers it, the world an MPI or Slurm launcher started (dist_env.cc).
struct DistEnv {
  int rank = 0, world_size = 1, local_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  // torchrun 2.x serves the store itself (TORCHELASTIC_USE_AGENT_STORE=True):
  // every rank is then a client, and keys go under
  // /worker/attempt_<TORCHELASTIC_RESTART_COUNT>/ as torch.distributed puts them.
  bool agent_store = false;
  std::string store_prefix;
  // The launcher whose variables gave this world: "torchrun" (RANK, WORLD_SIZE,
  // ...), "Open MPI", "MVAPICH2", "MPICH/Intel MPI" or "Slurm".
  std::string launcher = "torchrun";
  bool discovered() const { return launcher != "torchrun"; }

  // With WORLD_SIZE set: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT
  // and the two above. Otherwise, with `discover`, an MPI or Slurm launcher's
  // world (OMPI_COMM_WORLD_*, MV2_COMM_WORLD_*, PMI_RANK/PMI_SIZE, srun's
  // SLURM_PROCID/SLURM_STEP_NUM_TASKS/SLURM_LOCALID) on `discovery_port`, as
  // deepspeed.init_distributed sets MASTER_PORT; MASTER_ADDR from the
  // environment, or 127.0.0.1 when every rank is on this host. nullopt when
  // nothing names a world (one process). Throws std::invalid_argument naming
  // what to set when a launcher's signs are there but its world cannot be
  // found (never a world of one then), or a value is malformed.
  static std::optional<DistEnv> FromEnvironment(bool discover = true, int discovery_port = 29500);
};

// A TCP port on this host for a TCPStore to serve, chosen by the kernel and
// held until destroyed: no other socket's bind(0) or connect() is given it
// meanwhile, yet the store may bind it (both set SO_REUSEADDR). Choosing a
// free port and closing it let another job's ranks take it first and join
// the wrong store. The socket is not inherited across exec.
class ReservedPort {
 public:
  ReservedPort();  // throws CommError naming the system's error
  ~ReservedPort();
  ReservedPort(ReservedPort&& other) noexcept;
  ReservedPort& operator=(ReservedPort&& other) noexcept;
  int port() const { return port_; }

 private:
  int fd_ = -1;
  int port_ = 0;
};

// Rendezvous through a TCPStore on master_addr:master_port (rank 0 serves it,
// or torchrun's agent: DistEnv::agent_store)
// and a Gloo (CPU) or NCCL (CUDA) process group. `timeout` bounds the
// rendezvous and every collective, so a dead rank ends the job with CommError
// instead of a hang. With `heartbeat` enabled a RankMonitor watches the ranks
// and ends this process (naming the dead rank) well before that; it is off by
// default because it exits the whole process (wrong for ranks on threads).
std::unique_ptr<Comm> ConnectC10d(const DistEnv& env, std::chrono::milliseconds timeout, bool cuda,
                                  const HeartbeatSettings& heartbeat = HeartbeatSettings{1.0, 0.0});

}  // namespace uckpt
