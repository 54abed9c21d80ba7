// The host-thread rule (engine/host_threads.h): the pure choice, the inputs
// read from this process, and what applying it sets.
#include <ATen/Parallel.h>
#include <gtest/gtest.h>
#include <sched.h>

#include <cstdlib>
#include <optional>
#include <string>

#include "ckpt/parallel.h"
#include "engine/host_threads.h"
#include "engine/staged_upload.h"

namespace uckpt::engine {
namespace {

HostThreadInputs Host(int cores, int local_ranks) {
  HostThreadInputs in;
  in.cores = cores;
  in.local_ranks = local_ranks;
  in.how_to_change = "set OMP_NUM_THREADS or --threads to change";
  return in;
}

TEST(HostThreads, ShareOfTheHost) {
  HostThreadChoice c = ChooseHostThreads(Host(32, 2));
  EXPECT_EQ(c.threads, 16);
  EXPECT_EQ(c.Message(),
            "uckpt: 16 host threads per rank (32 cores / 2 local ranks; set OMP_NUM_THREADS or --threads to change)");
  EXPECT_EQ(ChooseHostThreads(Host(32, 4)).threads, 8);
  EXPECT_EQ(ChooseHostThreads(Host(7, 2)).threads, 3);  // rounds down
  EXPECT_EQ(ChooseHostThreads(Host(8, 1)).threads, 8);
}

TEST(HostThreads, NeverAboveLibtorchsDefault) {
  HostThreadInputs in = Host(32, 1);
  in.libtorch_default = 16;  // e.g. physical cores
  EXPECT_EQ(ChooseHostThreads(in).Message(),
            "uckpt: 16 host threads per rank (32 cores / 1 local rank, at most libtorch's default of 16; set "
            "OMP_NUM_THREADS or --threads to change)");
  in.local_ranks = 4;
  EXPECT_EQ(ChooseHostThreads(in).threads, 8);
  in.requested = 20;
  in.requested_by = "--threads";
  EXPECT_EQ(ChooseHostThreads(in).Message(),
            "uckpt: 20 host threads per rank (--threads 20; above this rank's share of 8: 32 cores / 4 local ranks)");
}

TEST(HostThreads, NeverFewerThanOne) {
  HostThreadChoice c = ChooseHostThreads(Host(2, 4));
  EXPECT_EQ(c.threads, 1);
  EXPECT_EQ(c.Message(),
            "uckpt: 1 host thread per rank (2 cores / 4 local ranks; set OMP_NUM_THREADS or --threads to change)");
}

TEST(HostThreads, OmpNumThreadsWinsOverTheShare) {
  HostThreadInputs in = Host(32, 2);
  in.omp_num_threads = 3;
  EXPECT_EQ(ChooseHostThreads(in).threads, 3);
  EXPECT_EQ(ChooseHostThreads(in).Message(), "uckpt: 3 host threads per rank (OMP_NUM_THREADS=3)");
  in.omp_num_threads = 20;  // more than the share: the user's word, said in the message
  EXPECT_EQ(ChooseHostThreads(in).threads, 20);
  EXPECT_EQ(ChooseHostThreads(in).Message(),
            "uckpt: 20 host threads per rank (OMP_NUM_THREADS=20; above this rank's share of 16: 32 cores / 2 local "
            "ranks)");
}

TEST(HostThreads, ProgramsOwnCountWinsOverOmpNumThreads) {
  HostThreadInputs in = Host(32, 2);
  in.omp_num_threads = 3;
  in.program_threads = 5;
  EXPECT_EQ(ChooseHostThreads(in).threads, 5);
}

TEST(HostThreads, ExplicitRequestWinsOverEverything) {
  HostThreadInputs in = Host(2, 4);
  in.omp_num_threads = 3;
  in.program_threads = 5;
  in.requested = 6;
  in.requested_by = "--threads";
  EXPECT_EQ(ChooseHostThreads(in).threads, 6);
  EXPECT_EQ(ChooseHostThreads(in).Message(),
            "uckpt: 6 host threads per rank (--threads 6; above this rank's share of 1: 2 cores / 4 local ranks)");
}

// Sets (or, for nullopt, unsets) a variable for one scope.
class ScopedVar {
 public:
  ScopedVar(const char* name, std::optional<std::string> value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    if (value) setenv(name, value->c_str(), 1);
    else unsetenv(name);
  }
  ~ScopedVar() {
    if (old_) setenv(name_, old_->c_str(), 1);
    else unsetenv(name_);
  }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

struct CleanEnv {
  ScopedVar cores{"UCKPT_HOST_CORES", std::nullopt}, lws{"LOCAL_WORLD_SIZE", std::nullopt},
      ls{"LOCAL_SIZE", std::nullopt}, ompi{"OMPI_COMM_WORLD_LOCAL_SIZE", std::nullopt},
      omp{"OMP_NUM_THREADS", std::nullopt}, load{"UCKPT_LOAD_THREADS", std::nullopt};
};

TEST(HostThreads, CoresAreThoseThisProcessMayRunOn) {
  CleanEnv clean;
  cpu_set_t all;
  ASSERT_EQ(sched_getaffinity(0, sizeof(all), &all), 0);
  const int allowed = CPU_COUNT(&all);
  EXPECT_EQ(HostThreadInputsFromProcess(0, "", "").cores, allowed);
  int first = 0;
  while (!CPU_ISSET(first, &all)) ++first;
  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(first, &one);
  ASSERT_EQ(sched_setaffinity(0, sizeof(one), &one), 0);
  const int restricted = HostThreadInputsFromProcess(0, "", "").cores;
  ASSERT_EQ(sched_setaffinity(0, sizeof(all), &all), 0);
  EXPECT_EQ(restricted, 1);
}

TEST(HostThreads, InputsFromTheEnvironment) {
  CleanEnv clean;
  EXPECT_EQ(HostThreadInputsFromProcess(0, "", "").local_ranks, 1);
  {
    ScopedVar cores("UCKPT_HOST_CORES", "8"), ls("LOCAL_SIZE", "3"), omp("OMP_NUM_THREADS", " 4,2");
    HostThreadInputs in = HostThreadInputsFromProcess(0, "", "");
    EXPECT_EQ(in.cores, 8);
    EXPECT_EQ(in.local_ranks, 3);      // DeepSpeed's launcher's name
    EXPECT_EQ(in.omp_num_threads, 4);  // the outer level of a nested list
    ScopedVar lws("LOCAL_WORLD_SIZE", "2");
    EXPECT_EQ(HostThreadInputsFromProcess(0, "", "").local_ranks, 2);  // torchrun's wins
  }
  for (const char* name : {"OMP_NUM_THREADS", "LOCAL_WORLD_SIZE", "UCKPT_HOST_CORES"})
    for (const char* bad : {"0", "-2", "four", "3x"}) {
      ScopedVar v(name, bad);
      try {
        HostThreadInputsFromProcess(0, "", "");
        ADD_FAILURE() << name << "=" << bad << " accepted";
      } catch (const std::invalid_argument& e) {
        EXPECT_EQ(std::string(e.what()), std::string(name) + "='" + bad + "': not a positive number");
      }
    }
}

TEST(HostThreads, ApplySetsLibtorchAndUckptsOwnPools) {
  CleanEnv clean;
  const int before = at::get_num_threads();
  {
    ScopedVar cores("UCKPT_HOST_CORES", "8"), lws("LOCAL_WORLD_SIZE", "2");
    at::set_num_threads(at::intraop_default_num_threads());  // as a program that never chose
    HostThreadChoice c = ApplyHostThreads(0, "", "hint", false);
    EXPECT_EQ(c.threads, 4) << c.Message();
    EXPECT_EQ(at::get_num_threads(), 4);
    EXPECT_EQ(HostThreads(), 4);
    EXPECT_EQ(ckpt::DefaultThreads(), 4);
    EXPECT_EQ(ckpt::WorkerThreads(0, 100), 4);
    EXPECT_EQ(DefaultLoadThreads(), 4);
    // Applied again (the engine after `uckpt train`): uckpt's own count is not the program's.
    EXPECT_EQ(ApplyHostThreads(0, "", "hint", false).threads, 4);
    // The program's own count wins over the share, an explicit request over both.
    at::set_num_threads(3);
    EXPECT_EQ(ApplyHostThreads(0, "", "hint", false).threads, 3);
    EXPECT_EQ(ApplyHostThreads(0, "", "hint", false).threads, 3);  // still the program's (the engine after initialize)
    EXPECT_EQ(ApplyHostThreads(2, "--threads", "hint", false).threads, 2);
    EXPECT_EQ(at::get_num_threads(), 2);
    EXPECT_EQ(ckpt::WorkerThreads(0, 100), 2);
  }
  at::set_num_threads(before);
  ckpt::SetDefaultThreads(0);
}

}  // namespace
}  // namespace uckpt::engine
