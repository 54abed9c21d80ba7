// `uckpt launch -n N -- CMD...`: N local ranks with torchrun's variables.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <thread>

#include "cli/commands.h"

namespace uckpt::cli {
namespace {

std::atomic<int> g_signal{0};
void OnSignal(int sig) { g_signal = sig; }

// The exit status a shell would report for `status`.
int ExitCode(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

// " (killed by signal 9: Killed)" when a signal ended it, else "".
std::string SignalNote(int status) {
  if (!WIFSIGNALED(status)) return "";
  return " (killed by signal " + std::to_string(WTERMSIG(status)) + ": " + strsignal(WTERMSIG(status)) + ")";
}

// Signals each rank's process group (the rank and whatever it started). A
// stopped (SIGSTOP) rank would hold any signal but SIGKILL until continued:
// SIGCONT follows, so it ends now rather than whenever someone continues it.
void SignalAll(const std::vector<pid_t>& pids, int sig) {
  for (pid_t p : pids) {
    if (p <= 0) continue;
    kill(-p, sig);
    if (sig != SIGKILL && sig != SIGCONT) kill(-p, SIGCONT);
  }
}

std::chrono::steady_clock::duration Secs(double s) {
  return std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(s));
}

}  // namespace

namespace {

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
    std::vector<std::string> argv = a->command;
    // `uckpt` means this very binary, wherever it lives.
    if (argv[0] == "uckpt") {
      char self[4096];
      ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
      if (n > 0) argv[0] = std::string(self, static_cast<size_t>(n));
    }
    struct sigaction sa{};
    sa.sa_handler = OnSignal;
    sigemptyset(&sa.sa_mask);
    for (int sig : {SIGINT, SIGTERM, SIGHUP}) sigaction(sig, &sa, nullptr);

    if (a->master_port == 0) a->master_port = FreePort();

    std::vector<pid_t> pids(static_cast<size_t>(a->n), -1);
    const pid_t launcher = getpid();
    for (int r = 0; r < a->n; ++r) {
      pid_t pid = fork();
      if (pid < 0) {
        std::cerr << "uckpt launch: fork failed: " << std::strerror(errno) << "\n";
        SignalAll(pids, SIGTERM);
        return 1;
      }
      if (pid == 0) {
        setpgid(0, 0);  // its own process group: signals reach the rank's children too
        // No orphans: when the launcher dies, by any signal (SIGKILL
        // included), the kernel kills the rank. (The launcher is one thread:
        // the death signal follows the thread that forked.) It survives
        // exec. Should the launcher have died before this call, exit now.
        if (prctl(PR_SET_PDEATHSIG, SIGKILL) != 0 || getppid() != launcher) _exit(1);
        setenv("RANK", std::to_string(r).c_str(), 1);
        setenv("LOCAL_RANK", std::to_string(r).c_str(), 1);
        setenv("WORLD_SIZE", std::to_string(a->n).c_str(), 1);
        setenv("LOCAL_WORLD_SIZE", std::to_string(a->n).c_str(), 1);
        setenv("GROUP_RANK", "0", 1);
        setenv("MASTER_ADDR", a->master_addr.c_str(), 1);
        setenv("MASTER_PORT", std::to_string(a->master_port).c_str(), 1);
        std::vector<std::string> rank_argv = a->no_local_rank ? argv : WithLocalRankArgument(argv, r);
        std::vector<char*> args;
        for (auto& s : rank_argv) args.push_back(s.data());
        args.push_back(nullptr);
        execvp(args[0], args.data());
        std::cerr << "uckpt launch: cannot run " << argv[0] << ": " << std::strerror(errno) << "\n";
        _exit(127);
      }
      setpgid(pid, pid);  // also here, so no signal can race the child's own call
      pids[static_cast<size_t>(r)] = pid;
    }

    using Clock = std::chrono::steady_clock;
    int result = 0, running = a->n;
    bool stopping = false;
    auto stop_deadline = Clock::time_point::max();
    auto begin_stopping = [&](int code) {
      result = code;
      stopping = true;
      SignalAll(pids, SIGTERM);
      stop_deadline = Clock::now() + Secs(a->grace_s);
    };
    // Since when each rank has been stopped (max: running).
    std::vector<Clock::time_point> stopped_since(pids.size(), Clock::time_point::max());
    std::vector<int> stop_signal(pids.size(), 0);
    while (running > 0) {
      if (int sig = g_signal.exchange(0); sig != 0) {
        SignalAll(pids, sig);  // forward; the ranks decide how to end
        if (!stopping) {
          stopping = true;
          result = 128 + sig;
          stop_deadline = Clock::now() + Secs(a->grace_s);
        }
      }
      int status = 0;
      pid_t pid = waitpid(-1, &status, WNOHANG | WUNTRACED | WCONTINUED);
      if (pid > 0) {
        for (size_t r = 0; r < pids.size(); ++r) {
          if (pids[r] != pid) continue;
          if (WIFSTOPPED(status)) {
            stopped_since[r] = Clock::now();
            stop_signal[r] = WSTOPSIG(status);
            break;
          }
          if (WIFCONTINUED(status)) {
            stopped_since[r] = Clock::time_point::max();
            break;
          }
          pids[r] = -1;
          stopped_since[r] = Clock::time_point::max();
          --running;
          int code = ExitCode(status);
          if (code != 0 && !stopping) {
            std::cerr << "uckpt launch: rank " << r << " exited with code " << code << SignalNote(status)
                      << "; stopping the other ranks\n";
            begin_stopping(code);
          }
        }
        continue;
      }
      if (pid < 0 && errno != EINTR) break;
      if (!stopping && a->stop_timeout_s > 0) {
        for (size_t r = 0; r < pids.size(); ++r) {
          if (stopped_since[r] == Clock::time_point::max() || Clock::now() - stopped_since[r] < Secs(a->stop_timeout_s))
            continue;
          char secs[32];
          std::snprintf(secs, sizeof secs, "%.1f", a->stop_timeout_s);
          std::cerr << "uckpt launch: rank " << r << " has been stopped (signal " << stop_signal[r] << ": "
                    << strsignal(stop_signal[r]) << ") for " << secs << " s; stopping the job\n";
          begin_stopping(1);
          break;
        }
      }
      if (stopping && Clock::now() > stop_deadline) {
        SignalAll(pids, SIGKILL);
        stop_deadline = Clock::time_point::max();
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return result;
  };
}

}  // namespace uckpt::cli
