// Where the ranks come from (DistEnv::FromEnvironment: torchrun's, MPI's and
// srun's variables, and the refusals) and ranks agreeing on a checkpoint folder.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <map>
#include <string>

#include "engine/dist/agree.h"
#include "ranks.h"
#include "uckpt/comm.h"

namespace uckpt::engine {
namespace {

// Sets exactly `vars` among the launcher variables for one test, then restores them.
class LauncherEnv {
 public:
  explicit LauncherEnv(const std::map<std::string, std::string>& vars) {
    for (const char* k : kNames) {
      if (const char* v = std::getenv(k)) saved_[k] = v;
      unsetenv(k);
    }
    for (const auto& [k, v] : vars) setenv(k.c_str(), v.c_str(), 1);
  }
  ~LauncherEnv() {
    for (const char* k : kNames) unsetenv(k);
    for (const auto& [k, v] : saved_) setenv(k.c_str(), v.c_str(), 1);
  }

 private:
  static constexpr const char* kNames[] = {"RANK",
                                           "WORLD_SIZE",
                                           "LOCAL_RANK",
                                           "MASTER_ADDR",
                                           "MASTER_PORT",
                                           "TORCHELASTIC_USE_AGENT_STORE",
                                           "OMPI_COMM_WORLD_RANK",
                                           "OMPI_COMM_WORLD_SIZE",
                                           "OMPI_COMM_WORLD_LOCAL_RANK",
                                           "OMPI_COMM_WORLD_LOCAL_SIZE",
                                           "MV2_COMM_WORLD_RANK",
                                           "MV2_COMM_WORLD_SIZE",
                                           "MV2_COMM_WORLD_LOCAL_RANK",
                                           "MV2_COMM_WORLD_LOCAL_SIZE",
                                           "PMI_RANK",
                                           "PMI_SIZE",
                                           "MPI_LOCALRANKID",
                                           "MPI_LOCALNRANKS",
                                           "PMIX_RANK",
                                           "SLURM_PROCID",
                                           "SLURM_STEP_NUM_TASKS",
                                           "SLURM_LOCALID",
                                           "SLURM_STEP_NUM_NODES",
                                           "SLURM_NTASKS"};
  std::map<std::string, std::string> saved_;
};

std::string Refusal(const std::map<std::string, std::string>& vars) {
  LauncherEnv env(vars);
  try {
    DistEnv::FromEnvironment(true, 29600);
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}

TEST(DistEnv, NoLauncherIsOneProcess) {
  LauncherEnv env({});
  EXPECT_FALSE(DistEnv::FromEnvironment().has_value());
}

TEST(DistEnv, TorchrunVariables) {
  LauncherEnv env({{"RANK", "1"},
                   {"WORLD_SIZE", "4"},
                   {"LOCAL_RANK", "1"},
                   {"MASTER_ADDR", "10.0.0.2"},
                   {"MASTER_PORT", "1234"},
                   {"OMPI_COMM_WORLD_RANK", "3"},
                   {"OMPI_COMM_WORLD_SIZE", "8"}});
  auto e = DistEnv::FromEnvironment(true, 29600);
  ASSERT_TRUE(e);
  EXPECT_EQ(e->rank, 1);
  EXPECT_EQ(e->world_size, 4);
  EXPECT_EQ(e->master_addr, "10.0.0.2");
  EXPECT_EQ(e->master_port, 1234);
  EXPECT_FALSE(e->discovered());
}

TEST(DistEnv, OpenMpiOnOneHost) {
  LauncherEnv env({{"OMPI_COMM_WORLD_RANK", "1"},
                   {"OMPI_COMM_WORLD_SIZE", "2"},
                   {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                   {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"},
                   {"MASTER_PORT", "1"}});
  auto e = DistEnv::FromEnvironment(true, 29600);
  ASSERT_TRUE(e);
  EXPECT_EQ(e->launcher, "Open MPI");
  EXPECT_EQ(e->rank, 1);
  EXPECT_EQ(e->world_size, 2);
  EXPECT_EQ(e->local_rank, 1);
  EXPECT_EQ(e->master_addr, "127.0.0.1");
  EXPECT_EQ(e->master_port, 29600);  // as deepspeed.init_distributed: distributed_port, not MASTER_PORT
}

TEST(DistEnv, MpiOverSeveralHostsNeedsMasterAddr) {
  const std::map<std::string, std::string> two_hosts = {{"OMPI_COMM_WORLD_RANK", "2"},
                                                        {"OMPI_COMM_WORLD_SIZE", "4"},
                                                        {"OMPI_COMM_WORLD_LOCAL_RANK", "0"},
                                                        {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}};
  EXPECT_NE(Refusal(two_hosts).find("MASTER_ADDR is not set"), std::string::npos) << Refusal(two_hosts);
  auto with_addr = two_hosts;
  with_addr["MASTER_ADDR"] = "node7";
  LauncherEnv env(with_addr);
  auto e = DistEnv::FromEnvironment(true, 29600);
  ASSERT_TRUE(e);
  EXPECT_EQ(e->master_addr, "node7");
  EXPECT_EQ(e->rank, 2);
}

TEST(DistEnv, MpichAndMvapich) {
  {
    LauncherEnv env({{"PMI_RANK", "3"}, {"PMI_SIZE", "4"}, {"MPI_LOCALRANKID", "3"}, {"MPI_LOCALNRANKS", "4"}});
    auto e = DistEnv::FromEnvironment();
    ASSERT_TRUE(e);
    EXPECT_EQ(e->launcher, "MPICH/Intel MPI");
    EXPECT_EQ(e->rank, 3);
    EXPECT_EQ(e->local_rank, 3);
  }
  {
    LauncherEnv env({{"MV2_COMM_WORLD_RANK", "0"},
                     {"MV2_COMM_WORLD_SIZE", "2"},
                     {"MV2_COMM_WORLD_LOCAL_RANK", "0"},
                     {"MV2_COMM_WORLD_LOCAL_SIZE", "2"}});
    auto e = DistEnv::FromEnvironment();
    ASSERT_TRUE(e);
    EXPECT_EQ(e->launcher, "MVAPICH2");
    EXPECT_EQ(e->world_size, 2);
  }
  // No local rank anywhere: refused rather than every rank taking GPU 0.
  EXPECT_NE(Refusal({{"PMI_RANK", "1"}, {"PMI_SIZE", "2"}}).find("LOCAL_RANK"), std::string::npos);
}

TEST(DistEnv, SlurmStepAndBatchScript) {
  {
    LauncherEnv env({{"SLURM_PROCID", "1"},
                     {"SLURM_STEP_NUM_TASKS", "2"},
                     {"SLURM_NTASKS", "2"},
                     {"SLURM_LOCALID", "1"},
                     {"SLURM_STEP_NUM_NODES", "1"}});
    auto e = DistEnv::FromEnvironment();
    ASSERT_TRUE(e);
    EXPECT_EQ(e->launcher, "Slurm");
    EXPECT_EQ(e->rank, 1);
    EXPECT_EQ(e->local_rank, 1);
    EXPECT_EQ(e->master_addr, "127.0.0.1");
  }
  EXPECT_NE(
      Refusal(
          {{"SLURM_PROCID", "1"}, {"SLURM_STEP_NUM_TASKS", "4"}, {"SLURM_LOCALID", "1"}, {"SLURM_STEP_NUM_NODES", "2"}})
          .find("scontrol show hostnames"),
      std::string::npos);
  EXPECT_NE(Refusal({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}}).find("not started by srun"), std::string::npos);
}

TEST(DistEnv, HalfSeenLaunchersAreRefused) {
  EXPECT_NE(Refusal({{"WORLD_SIZE", "2"}, {"MASTER_ADDR", "a"}, {"MASTER_PORT", "1"}}).find("RANK"), std::string::npos);
  EXPECT_NE(Refusal({{"RANK", "1"}}).find("WORLD_SIZE is not set"), std::string::npos);
  EXPECT_NE(Refusal({{"OMPI_COMM_WORLD_RANK", "1"}}).find("OMPI_COMM_WORLD_SIZE"), std::string::npos);
  EXPECT_NE(Refusal({{"PMIX_RANK", "1"}}).find("PMIX_RANK"), std::string::npos);
  EXPECT_NE(Refusal({{"OMPI_COMM_WORLD_RANK", "2"}, {"OMPI_COMM_WORLD_SIZE", "2"}}).find("not below"),
            std::string::npos);
}

TEST(AgreeOnCheckpointPlace, RanksUseRank0sFolderAndTagAndTheOthersWarn) {
  std::vector<CheckpointPlace> got(2);
  ::testing::internal::CaptureStderr();
  testing::RunRanks(2, [&](Comm& comm) {
    const std::string r = std::to_string(comm.rank());
    got[static_cast<size_t>(comm.rank())] =
        AgreeOnCheckpointPlace(comm, "/runs/exp_" + r, comm.rank() == 0 ? "" : "t1", "save_checkpoint");
  });
  const std::string err = ::testing::internal::GetCapturedStderr();
  for (const auto& p : got) {
    EXPECT_EQ(p.dir, "/runs/exp_0");
    EXPECT_EQ(p.tag, "");
  }
  EXPECT_NE(err.find("rank 1 was given folder '/runs/exp_1' tag 't1', rank 0 folder '/runs/exp_0'"), std::string::npos)
      << err;
  EXPECT_EQ(err.find("rank 0 was given"), std::string::npos) << err;
}

TEST(AgreeOnCheckpointPlace, RanksThatAgreeSayNothing) {
  ::testing::internal::CaptureStderr();
  testing::RunRanks(2, [&](Comm& comm) {
    auto p = AgreeOnCheckpointPlace(comm, "ckpt", "global_step3", "load_checkpoint");
    EXPECT_EQ(p.dir, "ckpt");
    EXPECT_EQ(p.tag, "global_step3");
  });
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), "");
}

// Binds 127.0.0.1:port as any other program would (no SO_REUSEADDR); the errno, 0 on success.
int PlainBind(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<uint16_t>(port));
  const int err = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 ? 0 : errno;
  ::close(fd);
  return err;
}

TEST(ReservedPort, NoOtherSocketGetsThePortUntilItIsReleased) {
  int port = 0;
  {
    const ReservedPort reserved;
    port = reserved.port();
    ASSERT_GT(port, 0);
    EXPECT_EQ(PlainBind(port), EADDRINUSE) << "port " << port << " was free to take while reserved";
    ReservedPort moved = ReservedPort();
    EXPECT_NE(moved.port(), port);
  }
  EXPECT_EQ(PlainBind(port), 0) << "port " << port << " still held after the reservation ended";
}

TEST(ReservedPort, TheStoreOfTheRanksBindsIt) {
  // RunRanks reserves its port; rank 0's TCPStore serves on it while it is held.
  std::vector<int> ranks(2, -1);
  testing::RunRanks(2, [&](Comm& comm) { ranks[static_cast<size_t>(comm.rank())] = comm.rank(); });
  EXPECT_EQ(ranks, (std::vector<int>{0, 1}));
}

}  // namespace
}  // namespace uckpt::engine
