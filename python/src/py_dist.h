// torch.distributed glue: deepspeed.init_distributed, and the engine's
// collectives on torch.distributed's default group (one rendezvous, one
// port, the same ranks as the script's).
#pragma once

#include <torch/csrc/utils/pybind.h>

#include <memory>
#include <string>

#include "uckpt/comm.h"

namespace uckpt::python {

namespace py = pybind11;

// "cuda" when torch sees a GPU (and DS_ACCELERATOR is not "cpu"), else "cpu".
std::string PickDevice();

// deepspeed.init_distributed: torch.distributed's default group, from the
// arguments, the launcher's environment, or an MPI or Slurm launcher's world
// (DistEnv::FromEnvironment); a group of one with no launcher.
void InitDistributed(py::object dist_backend, bool auto_mpi_discovery, int distributed_port, bool verbose,
                     py::object timeout, py::object init_method, py::object dist_init_required, py::object config,
                     int rank, int world_size);

// The engine's collectives on torch.distributed's default group (initialised
// first if the script did not).
std::shared_ptr<Comm> CommFromTorchDistributed(const std::string& device);

// At interpreter exit (uckpt.comm, before its teardown of the default group):
// the live engines stop using torch.distributed's process group, so that
// destroy_process_group ends it while the interpreter is whole (an engine
// would keep it into finalization). Later collectives of theirs throw CommError.
void ReleaseTorchDistributedGroups();

// init_distributed, _release_process_groups.
void BindDistributed(py::module_& m);

}  // namespace uckpt::python
