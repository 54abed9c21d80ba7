// How many host threads a rank uses: libtorch's intra-op pool (compute on
// the CPU, the host Adam) and uckpt's own pools (checkpoint writing, loading,
// hashing). The one place that decides it, for `uckpt train`, the C++ Engine
// and the Python package.
//
// Rule, first that applies:
//   1. an explicit request: `uckpt train --threads N`, EngineOptions::host_threads;
//   2. the program's own at::set_num_threads / torch.set_num_threads, seen as
//      libtorch's count differing from libtorch's default (a value equal to
//      that default cannot be told apart, and is replaced by 3 or 4);
//   3. OMP_NUM_THREADS (its first level, "4" of "4,2");
//   4. this rank's share of the host: max(1, cores / local ranks), cores being
//      the CPUs this process may run on (sched_getaffinity), local ranks
//      LOCAL_WORLD_SIZE (torchrun, `uckpt launch`), else LOCAL_SIZE
//      (DeepSpeed's launcher), else OMPI_COMM_WORLD_LOCAL_SIZE (mpirun), else 1;
//      never above libtorch's own default: uckpt shares the host, it does not
//      raise what libtorch would use.
// UCKPT_HOST_CORES=N, when set, stands for the cores and for libtorch's
// default (tests of an N-core host on small machines).
#pragma once

#include <string>

namespace uckpt::engine {

// What the choice is made from; 0 means "not given" for every count but cores.
struct HostThreadInputs {
  int cores = 1;                                                // CPUs this process may run on
  int local_ranks = 1;                                          // ranks on this host
  int requested = 0;                                            // explicit request
  std::string requested_by;                                     // names it in the message, e.g. "--threads"
  int program_threads = 0;                                      // set by the program through libtorch
  int omp_num_threads = 0;                                      // OMP_NUM_THREADS
  int libtorch_default = 0;                                     // libtorch's own default count; 0: no bound
  std::string how_to_change = "set OMP_NUM_THREADS to change";  // the message's hint for the default
};

struct HostThreadChoice {
  int threads = 1;
  std::string why;              // e.g. "32 cores / 4 local ranks; set OMP_NUM_THREADS or --threads to change"
  std::string Message() const;  // "uckpt: 8 host threads per rank (<why>)"
};

// The rule above; no side effects.
HostThreadChoice ChooseHostThreads(const HostThreadInputs& in);

// The inputs from this process: affinity (or UCKPT_HOST_CORES), the launcher's
// variables, OMP_NUM_THREADS and libtorch's current count. Throws
// std::invalid_argument naming a variable that is set but not a positive
// number of threads.
HostThreadInputs HostThreadInputsFromProcess(int requested, const std::string& requested_by,
                                             const std::string& how_to_change);

// Chooses from this process's inputs and applies the result: libtorch's
// intra-op threads (at::set_num_threads) and the default of uckpt's own pools
// (ckpt::SetDefaultThreads). Prints choice.Message() to stderr when `print`
// and this process has not printed the same choice before. Returns the choice.
HostThreadChoice ApplyHostThreads(int requested, const std::string& requested_by, const std::string& how_to_change,
                                  bool print);

// This rank's host-thread budget: what ApplyHostThreads last applied, else
// libtorch's current intra-op count. For uckpt's own parallel loops.
int HostThreads();

}  // namespace uckpt::engine
