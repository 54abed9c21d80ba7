// DistEnv::FromEnvironment: the one place that reads a launcher's variables,
// for the C++ engine, `uckpt train` and the Python package's init_distributed;
// and ReservedPort, the port a launcher hands its ranks.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include "uckpt/comm.h"

namespace uckpt {
namespace {

const char* NonEmptyEnv(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? v : nullptr;
}

int EnvInt(const char* name, int fallback) {
  const char* v = NonEmptyEnv(name);
  if (v == nullptr) return fallback;
  char* end = nullptr;
  long x = std::strtol(v, &end, 10);
  if (*end != '\0' || x < 0 || x > 1 << 30)
    throw std::invalid_argument(std::string("environment variable ") + name + "='" + v + "' is not a valid number");
  return static_cast<int>(x);
}

DistEnv FromTorchrunVariables() {
  DistEnv e;
  e.world_size = EnvInt("WORLD_SIZE", 1);
  if (e.world_size > 1)
    for (const char* v : {"RANK", "MASTER_ADDR", "MASTER_PORT"})
      if (NonEmptyEnv(v) == nullptr)
        throw std::invalid_argument(std::string("WORLD_SIZE is set but ") + v +
                                    " is not; start the ranks with `uckpt launch`, torchrun or deepspeed's launcher");
  e.rank = EnvInt("RANK", 0);
  e.local_rank = EnvInt("LOCAL_RANK", e.rank);
  e.master_port = EnvInt("MASTER_PORT", 29500);
  if (const char* a = NonEmptyEnv("MASTER_ADDR")) e.master_addr = a;
  if (const char* a = NonEmptyEnv("TORCHELASTIC_USE_AGENT_STORE"); a != nullptr && std::string(a) == "True") {
    e.agent_store = true;
    e.store_prefix = "/worker/attempt_" + std::to_string(EnvInt("TORCHELASTIC_RESTART_COUNT", 0));
  }
  if (e.world_size < 1 || e.rank >= e.world_size)
    throw std::invalid_argument("RANK " + std::to_string(e.rank) + " is not below WORLD_SIZE " +
                                std::to_string(e.world_size));
  return e;
}

// An MPI launcher's (or srun's) names for the rank, the world and this host's
// share of it. DeepSpeed asks mpi4py; these are what the launchers export.
struct LauncherVars {
  const char* name;
  const char* rank;
  const char* size;
  const char* local_rank;
  const char* local_size;  // ranks on this host (nullptr: `nodes` tells)
  const char* nodes;       // hosts in the job
};

// MPI first: mpirun inside a Slurm allocation also carries SLURM_*.
constexpr LauncherVars kLaunchers[] = {
    {"Open MPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
     "OMPI_COMM_WORLD_LOCAL_SIZE", nullptr},
    {"MVAPICH2", "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_SIZE",
     nullptr},
    {"MPICH/Intel MPI", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", nullptr},
    // SLURM_STEP_NUM_TASKS: set by srun only (a batch script has SLURM_NTASKS but runs one process).
    {"Slurm", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID", nullptr, "SLURM_STEP_NUM_NODES"},
};

const std::string kSetTorchrunVariables =
    "set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT for each rank, or start it with `uckpt launch` "
    "or torchrun";

DistEnv FromLauncher(const LauncherVars& l, int port) {
  const std::string who = std::string(l.name) + " (" + l.rank + ", " + l.size + ")";
  DistEnv e;
  e.launcher = l.name;
  e.rank = EnvInt(l.rank, 0);
  e.world_size = EnvInt(l.size, 1);
  if (e.world_size < 1 || e.rank >= e.world_size)
    throw std::invalid_argument(who + ": rank " + std::to_string(e.rank) + " is not below the world size " +
                                std::to_string(e.world_size));
  e.master_port = port;
  if (NonEmptyEnv(l.local_rank) != nullptr) {
    e.local_rank = EnvInt(l.local_rank, 0);
  } else if (NonEmptyEnv("LOCAL_RANK") != nullptr) {
    e.local_rank = EnvInt("LOCAL_RANK", 0);
  } else if (e.world_size > 1) {
    throw std::invalid_argument(who + " gives no local rank (" + l.local_rank + "); set LOCAL_RANK, or " +
                                kSetTorchrunVariables);
  }
  const bool one_host = l.local_size != nullptr ? EnvInt(l.local_size, 0) == e.world_size : EnvInt(l.nodes, 0) == 1;
  if (const char* a = NonEmptyEnv("MASTER_ADDR")) {
    e.master_addr = a;
  } else if (!one_host && e.world_size > 1) {
    // DeepSpeed broadcasts rank 0's `hostname -I` through mpi4py; uckpt reads only the environment.
    throw std::invalid_argument(
        who + " started " + std::to_string(e.world_size) +
        " ranks that are not all on this host, and MASTER_ADDR is not set: set it to rank 0's host address "
        "for every rank (mpirun -x MASTER_ADDR=<host>; under Slurm: export MASTER_ADDR=$(scontrol show hostnames "
        "\"$SLURM_JOB_NODELIST\" | head -n 1) before srun), or " +
        kSetTorchrunVariables);
  }
  return e;
}

// A launcher's traces with no world to read: refused, lest every process train alone.
void RefuseHalfSeenLauncher() {
  for (const auto& l : kLaunchers)
    if (NonEmptyEnv(l.rank) != nullptr && NonEmptyEnv(l.size) == nullptr && std::string(l.name) != "Slurm")
      throw std::invalid_argument(std::string(l.name) + " sets " + l.rank + " but not " + l.size +
                                  ", so the world cannot be found: " + kSetTorchrunVariables);
  if (NonEmptyEnv("PMIX_RANK") != nullptr)
    throw std::invalid_argument("PMIX_RANK is set (a PMIx launcher) but no world size uckpt reads is: " +
                                kSetTorchrunVariables);
  if (EnvInt("SLURM_NTASKS", 1) > 1)
    throw std::invalid_argument(
        "SLURM_NTASKS is " + std::to_string(EnvInt("SLURM_NTASKS", 1)) +
        " but this process was not started by srun (no SLURM_STEP_NUM_TASKS): start one process per task with "
        "srun, or set WORLD_SIZE=1 to train in this one process");
  if (EnvInt("RANK", 0) > 0)
    throw std::invalid_argument("RANK is " + std::to_string(EnvInt("RANK", 0)) +
                                " but WORLD_SIZE is not set: " + kSetTorchrunVariables);
}

}  // namespace

std::optional<DistEnv> DistEnv::FromEnvironment(bool discover, int discovery_port) {
  if (NonEmptyEnv("WORLD_SIZE") != nullptr) return FromTorchrunVariables();
  if (!discover) return std::nullopt;
  for (const auto& l : kLaunchers)
    if (NonEmptyEnv(l.rank) != nullptr && NonEmptyEnv(l.size) != nullptr) return FromLauncher(l, discovery_port);
  RefuseHalfSeenLauncher();
  return std::nullopt;
}

ReservedPort::ReservedPort() {
  fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd_ < 0) throw CommError(std::string("cannot create a socket to reserve a port: ") + std::strerror(errno));
  const int on = 1;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof addr;
  if (::setsockopt(fd_, SOL_SOCKET, SO_REUSEADDR, &on, sizeof on) != 0 ||
      ::bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
      ::getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    const int err = errno;
    ::close(fd_);
    throw CommError(std::string("cannot reserve a free TCP port on 127.0.0.1: ") + std::strerror(err));
  }
  port_ = ntohs(addr.sin_port);
}

ReservedPort::~ReservedPort() {
  if (fd_ >= 0) ::close(fd_);
}

ReservedPort::ReservedPort(ReservedPort&& other) noexcept : fd_(other.fd_), port_(other.port_) { other.fd_ = -1; }

ReservedPort& ReservedPort::operator=(ReservedPort&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = other.fd_;
    port_ = other.port_;
    other.fd_ = -1;
  }
  return *this;
}

}  // namespace uckpt
