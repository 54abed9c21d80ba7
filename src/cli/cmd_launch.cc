// `uckpt launch -n N -- CMD...`: N local ranks with torchrun's variables.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <iostream>

#include "cli/commands.h"
#include "cli/launch_supervisor.h"

namespace uckpt::cli {
namespace {

std::atomic<int> g_signal{0};
void OnSignal(int sig) { g_signal = sig; }

// A TCP port that is free now: the kernel picks it for a socket bound to
// port 0. (Another process could take it before rank 0 binds it; far less
// likely than a collision between fixed or derived port numbers.)
int FreePort() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) throw std::runtime_error(std::string("launch: cannot create a socket: ") + std::strerror(errno));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof addr;
  int port = -1;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0)
    port = ntohs(addr.sin_port);
  ::close(fd);
  if (port <= 0) throw std::runtime_error(std::string("launch: cannot find a free port: ") + std::strerror(errno));
  return port;
}

// Where DeepSpeed's launcher puts `--local_rank=N`: right after the script
// (or `-m module`) of a Python command, before the script's own arguments.
// Other commands (`uckpt train`, shell scripts) and `python -c` get nothing.
std::vector<std::string> WithLocalRankArgument(std::vector<std::string> argv, int local_rank) {
  const std::string exe = argv[0].substr(argv[0].find_last_of('/') + 1);
  if (exe.rfind("python", 0) != 0) return argv;
  for (size_t i = 1; i < argv.size(); ++i) {
    const std::string& a = argv[i];
    if (a == "-c" || a == "-") return argv;
    size_t script = i;
    if (a == "-m") {
      script = i + 1;
    } else if (!a.empty() && a[0] == '-') {
      if (a == "-W" || a == "-X" || a == "-Q") ++i;  // options with a separate value
      continue;
    }
    if (script >= argv.size()) return argv;
    argv.insert(argv.begin() + static_cast<std::ptrdiff_t>(script) + 1, "--local_rank=" + std::to_string(local_rank));
    return argv;
  }
  return argv;
}

// What every rank of one launch gets.
struct RankCommand {
  std::vector<std::string> argv;  // argv[0]: a path or a name on PATH
  int world_size = 1;
  std::string master_addr;
  int master_port = 0;
  bool local_rank_argument = true;  // --local_rank=N to a Python script
};

// Forks rank r in its own process group and execs the command with
// torchrun's variables. Returns its pid, or -1 (saying why) when fork fails.
pid_t StartRank(const RankCommand& c, int r) {
  const pid_t launcher = getpid();
  const pid_t pid = fork();
  if (pid < 0) {
    std::cerr << "uckpt launch: fork failed: " << std::strerror(errno) << "\n";
    return -1;
  }
  if (pid > 0) {
    setpgid(pid, pid);  // also here, so no signal can race the child's own call
    return pid;
  }
  setpgid(0, 0);  // its own process group: signals reach the rank's children too
  // No orphans: when the launcher dies, by any signal (SIGKILL included), the
  // kernel kills the rank. (The launcher is one thread: the death signal
  // follows the thread that forked.) It survives exec. Should the launcher
  // have died before this call, exit now.
  if (prctl(PR_SET_PDEATHSIG, SIGKILL) != 0 || getppid() != launcher) _exit(1);
  setenv("RANK", std::to_string(r).c_str(), 1);
  setenv("LOCAL_RANK", std::to_string(r).c_str(), 1);
  setenv("WORLD_SIZE", std::to_string(c.world_size).c_str(), 1);
  setenv("LOCAL_WORLD_SIZE", std::to_string(c.world_size).c_str(), 1);
  setenv("GROUP_RANK", "0", 1);
  setenv("MASTER_ADDR", c.master_addr.c_str(), 1);
  setenv("MASTER_PORT", std::to_string(c.master_port).c_str(), 1);
  std::vector<std::string> rank_argv = c.local_rank_argument ? WithLocalRankArgument(c.argv, r) : c.argv;
  std::vector<char*> args;
  for (auto& s : rank_argv) args.push_back(s.data());
  args.push_back(nullptr);
  execvp(args[0], args.data());
  std::cerr << "uckpt launch: cannot run " << c.argv[0] << ": " << std::strerror(errno) << "\n";
  _exit(127);
}

// `uckpt` means this very binary, wherever it lives.
std::string ResolveSelf(const std::string& exe) {
  if (exe != "uckpt") return exe;
  char self[4096];
  const ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
  return n > 0 ? std::string(self, static_cast<size_t>(n)) : exe;
}

}  // namespace

Runner AddLaunch(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "launch",
      "Start N local ranks of a command with RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,\n"
      "MASTER_ADDR and MASTER_PORT set (as torchrun does). Signals are forwarded; when one rank\n"
      "fails the others are stopped and its exit code is returned; a rank that stays stopped\n"
      "(SIGSTOP) longer than --stop_timeout fails too. When the launcher dies, however it dies\n"
      "(even SIGKILL), the kernel kills its ranks. Multi-node runs are torchrun's or Slurm's job.\n\n"
      "Examples:\n"
      "  uckpt launch -n 2 -- uckpt train --config ds.json --steps 100\n"
      "  uckpt launch -n 2 -- python3 train.py --deepspeed_config ds.json   (gets --local_rank=N, as from deepspeed)\n"
      "  torchrun --no-python --nproc-per-node 2 uckpt train --config ds.json --steps 100   (the same)");
  struct Args {
    int n = 1;
    int master_port = 29500;
    std::string master_addr = "127.0.0.1";
    double grace_s = 10;
    double stop_timeout_s = 20;
    bool no_local_rank = false;
    std::vector<std::string> command;
  };
  auto a = std::make_shared<Args>();
  cmd->add_option("-n,--nproc", a->n, "Number of ranks")->required()->check(CLI::Range(1, 4096));
  cmd->add_option("--master_port", a->master_port, "Rendezvous port; 0 picks a free one (for parallel jobs)")
      ->capture_default_str()
      ->check(CLI::Range(0, 65535));
  cmd->add_option("--master_addr", a->master_addr, "Rendezvous address")->capture_default_str();
  cmd->add_option("--grace", a->grace_s, "Seconds ranks get to exit after SIGTERM before SIGKILL")
      ->capture_default_str();
  cmd->add_option("--stop_timeout", a->stop_timeout_s,
                  "A rank stopped (SIGSTOP, SIGTSTP) this many seconds fails the job, as a dead one does; 0: wait "
                  "(default: the heartbeat timeout's default)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  cmd->add_flag("--no_local_rank", a->no_local_rank,
                "Do not pass --local_rank=N to a Python script (passed by default, as DeepSpeed's launcher does)");
  cmd->add_option("command", a->command, "The command after `--`")->required();

  return [a] {
    struct sigaction sa{};
    sa.sa_handler = OnSignal;
    sigemptyset(&sa.sa_mask);
    for (int sig : {SIGINT, SIGTERM, SIGHUP}) sigaction(sig, &sa, nullptr);

    RankCommand c;
    c.argv = a->command;
    c.argv[0] = ResolveSelf(c.argv[0]);
    c.world_size = a->n;
    c.master_addr = a->master_addr;
    c.master_port = a->master_port == 0 ? FreePort() : a->master_port;
    c.local_rank_argument = !a->no_local_rank;
    LaunchSupervisor supervisor(a->n, {a->grace_s, a->stop_timeout_s});
    return supervisor.Run([&c](int r) { return StartRank(c, r); }, g_signal);
  };
}

}  // namespace uckpt::cli
