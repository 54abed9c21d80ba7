// `uckpt launch -n N -- CMD...`: N local ranks with torchrun's variables.
#include <signal.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <optional>
#include <sstream>

#include "cli/commands.h"
#include "cli/launch_supervisor.h"
#include "cli/memory_snapshot.h"
#include "uckpt/comm.h"

namespace uckpt::cli {
namespace {

std::atomic<int> g_signal{0};
void OnSignal(int sig) { g_signal = sig; }

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
  int world_size = 1;             // ranks on this host
  int nnodes = 1, node_rank = 0;  // hosts, each running world_size ranks; this one's index
  std::string master_addr;
  int master_port = 0;
  bool local_rank_argument = true;  // --local_rank=N to a Python script
  int restart_count = 0;            // UCKPT_RESTART_COUNT
  std::string visible_devices;      // CUDA_VISIBLE_DEVICES after a restart; empty: left as it is
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
  setenv("RANK", std::to_string(c.node_rank * c.world_size + r).c_str(), 1);
  setenv("LOCAL_RANK", std::to_string(r).c_str(), 1);
  setenv("WORLD_SIZE", std::to_string(c.nnodes * c.world_size).c_str(), 1);
  setenv("LOCAL_WORLD_SIZE", std::to_string(c.world_size).c_str(), 1);
  setenv("GROUP_RANK", std::to_string(c.node_rank).c_str(), 1);
  setenv("MASTER_ADDR", c.master_addr.c_str(), 1);
  setenv("MASTER_PORT", std::to_string(c.master_port).c_str(), 1);
  setenv("UCKPT_RESTART_COUNT", std::to_string(c.restart_count).c_str(), 1);
  if (!c.visible_devices.empty()) setenv("CUDA_VISIBLE_DEVICES", c.visible_devices.c_str(), 1);
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

// The devices of ranks 0..n-1: the first n of CUDA_VISIBLE_DEVICES when it
// lists that many, else 0..n-1 (on the CPU they only name the rank's slot).
std::vector<std::string> InitialDevices(int n) {
  std::vector<std::string> listed;
  if (const char* v = std::getenv("CUDA_VISIBLE_DEVICES")) {
    std::stringstream in(v);
    for (std::string d; std::getline(in, d, ',');)
      if (!d.empty()) listed.push_back(d);
  }
  std::vector<std::string> devices;
  for (int r = 0; r < n; ++r)
    devices.push_back(listed.size() >= static_cast<size_t>(n) ? listed[static_cast<size_t>(r)] : std::to_string(r));
  return devices;
}

std::string Join(const std::vector<std::string>& items) {
  std::string out;
  for (const auto& d : items) out += (out.empty() ? "" : ",") + d;
  return out;
}

// When a process started: /proc/<pid>/stat's starttime (clock ticks since
// boot); -1 when it does not run. With the pid, it names one process of this boot.
long long ProcessStartTime(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const size_t comm_end = stat.rfind(')');  // the command name may hold spaces
  if (comm_end == std::string::npos) return -1;
  std::istringstream fields(stat.substr(comm_end + 2));
  std::string field;
  for (int k = 3; k <= 22 && fields >> field; ++k)
    if (k == 22) return std::atoll(field.c_str());
  return -1;
}

// The job id of this launch's ranks (UCKPT_JOB_ID, the name of their
// snapshots in host memory, cli/memory_snapshot.h): the caller's, else one
// made here from this launcher's pid and start time, kept across restarts.
// Returns the id this launcher made ("" when the caller gave one). Snapshot
// folders whose launcher made their id and no longer runs (killed before it
// could remove them) are removed first.
std::string SetJobId() {
  if (const char* given = std::getenv("UCKPT_JOB_ID"); given != nullptr && *given != '\0') return "";
  const std::string prefix = "uckpt-snapshots-launch-";
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(SnapshotRoot(), ec)) {
    const std::string name = entry.path().filename().string();
    long long pid = 0, start = 0;
    if (name.rfind(prefix, 0) != 0 || std::sscanf(name.c_str() + prefix.size(), "%lld-%lld", &pid, &start) != 2)
      continue;
    if (ProcessStartTime(static_cast<pid_t>(pid)) == start) continue;  // its launcher still runs
    std::filesystem::remove_all(entry.path(), ec);
    std::cerr << "uckpt launch: removed " << entry.path().string() << ", left by a launcher that no longer runs\n";
  }
  const std::string id = "launch-" + std::to_string(getpid()) + "-" + std::to_string(ProcessStartTime(getpid()));
  setenv("UCKPT_JOB_ID", id.c_str(), 1);
  return id;
}

struct RestartPolicy {
  int max_restarts = 0;
  int min_nproc = 1;
};

// Why the job stops for good after `supervisor` ended it with `code` on
// `devices`, having restarted `restarts` times; empty when it restarts.
std::string NoRestartReason(const LaunchSupervisor& supervisor, int code, int restarts,
                            const std::vector<std::string>& devices, const RestartPolicy& p) {
  if (code == 0) return "done";
  if (supervisor.ended_by_signal()) return "the launcher was signalled";
  if (supervisor.first_failed_rank() < 0) return "a rank could not be started";
  if (restarts >= p.max_restarts)
    return p.max_restarts == 0 ? "no restarts asked (--max_restarts)"
                               : "--max_restarts " + std::to_string(p.max_restarts) + " used up";
  // Exit code 2 is a usage or input error (uckpt's, argparse's): fewer devices would not mend it.
  if (code == 2)
    return "rank " + std::to_string(supervisor.first_failed_rank()) + " exited with 2 (bad usage or input)";
  if (static_cast<int>(devices.size()) - 1 < p.min_nproc)
    return std::to_string(devices.size() - 1) + " device(s) would be left, fewer than --min_nproc " +
           std::to_string(p.min_nproc);
  return "";
}

// Runs the job; after a rank fails, and while the policy allows, again on the
// devices left (the failed rank's device left out): each command resumes from
// its newest checkpoint itself (`uckpt train --resume`, a script's
// load_checkpoint), with the world size, and so the gradient accumulation, new.
int RunWithRestarts(RankCommand c, int fixed_port, const LaunchSupervisor::Settings& settings,
                    const RestartPolicy& policy) {
  std::vector<std::string> devices = InitialDevices(c.world_size);
  for (int restarts = 0;; ++restarts) {
    c.world_size = static_cast<int>(devices.size());
    // Held until the ranks end, so no other job's ranks can take the port first.
    std::optional<ReservedPort> reserved;
    if (fixed_port == 0) reserved.emplace();
    c.master_port = reserved ? reserved->port() : fixed_port;
    c.restart_count = restarts;
    LaunchSupervisor supervisor(c.world_size, settings);
    const int code = supervisor.Run([&c](int r) { return StartRank(c, r); }, g_signal);
    const std::string why = NoRestartReason(supervisor, code, restarts, devices, policy);
    if (!why.empty()) {
      if (code != 0 && policy.max_restarts > 0)
        std::cerr << "uckpt launch: not restarting (" << why << "); exit code " << code << "\n";
      return code;
    }
    const auto failed = devices.begin() + supervisor.first_failed_rank();
    std::cerr << "uckpt launch: restart " << restarts + 1 << " of " << policy.max_restarts << ": device " << *failed
              << " (rank " << supervisor.first_failed_rank() << ") left out; starting " << devices.size() - 1
              << " rank(s) on device(s) ";
    devices.erase(failed);
    c.visible_devices = Join(devices);
    std::cerr << c.visible_devices << "\n";
  }
}

// DeepSpeed's launcher's options (`deepspeed --num_gpus 2 train.py`): accepted by the parser only to be refused by
// name, with uckpt launch's counterpart where it has one, instead of CLI11's "argument not expected" about the next
// word. {option, takes a value, what to say}.
struct DeepSpeedLauncherOption {
  const char* name;
  bool takes_value;
  const char* remedy;
};
constexpr DeepSpeedLauncherOption kDeepSpeedLauncherOptions[] = {
    {"--num_gpus", true, "give the ranks on this host with -n (and the devices with CUDA_VISIBLE_DEVICES)"},
    {"--num_accelerators", true, "give the ranks on this host with -n (and the devices with CUDA_VISIBLE_DEVICES)"},
    {"--num_nodes", true, "give the hosts with --nnodes, one `uckpt launch` per host"},
    {"--hostfile", true, "run one `uckpt launch` per host with --nnodes, --node_rank and --master_addr"},
    {"--include", true, "choose the devices with CUDA_VISIBLE_DEVICES"},
    {"--exclude", true, "choose the devices with CUDA_VISIBLE_DEVICES"},
    {"--launcher", true, "run one `uckpt launch` per host (or torchrun, srun, mpirun: init_distributed reads them)"},
    {"--launcher_args", true, "run one `uckpt launch` per host"},
    {"--autotuning", true, "DeepSpeed's autotuner is not supported by uckpt"},
    {"--elastic_training", false, "DeepSpeed's elastic training is not supported by uckpt (see --max_restarts)"},
    {"--min_elastic_nodes", true, "DeepSpeed's elastic training is not supported by uckpt (see --max_restarts)"},
    {"--max_elastic_nodes", true, "DeepSpeed's elastic training is not supported by uckpt (see --max_restarts)"},
    {"--bind_cores_to_rank", false,
     "binding ranks to cores is not supported by uckpt launch (it sets each rank's "
     "host threads; see OMP_NUM_THREADS)"},
    {"--bind_core_list", true, "binding ranks to cores is not supported by uckpt launch"},
    {"--module", false, "put `python -m MODULE` after `--`"},
    {"--no_python", false, "the command after `--` is run as given: put the executable there"},
    {"--no_ssh_check", false, "uckpt launch uses no ssh: run one per host"},
    {"--force_multi", false, "run one `uckpt launch` per host with --nnodes"},
    {"--ssh_port", true, "uckpt launch uses no ssh: run one per host"},
    {"--save_pid", false, "the launcher's pid is $! of the shell that starts it"},
    {"--enable_each_rank_log", true, "redirect the launcher's output; each line of a rank's is its own"},
};

// Registers DeepSpeed's launcher options on `cmd`; the names given land in `given`.
void AddDeepSpeedLauncherOptions(CLI::App* cmd, std::vector<std::string>& given) {
  for (const auto& o : kDeepSpeedLauncherOptions) {
    std::string name = o.name;
    if (o.takes_value)
      cmd->add_option_function<std::string>(name, [&given, name](const std::string&) { given.push_back(name); })
          ->group("");  // hidden from --help
    else cmd->add_flag_function(name, [&given, name](std::int64_t) { given.push_back(name); })->group("");
  }
}

void RefuseDeepSpeedLauncherOptions(const std::vector<std::string>& given) {
  if (given.empty()) return;
  for (const auto& o : kDeepSpeedLauncherOptions)
    if (given.front() == o.name)
      throw std::invalid_argument("launch: " + given.front() + " is an option of DeepSpeed's launcher (`deepspeed`), " +
                                  "not of uckpt launch: " + o.remedy + " (uckpt launch --help)");
}

// What `uckpt launch` parses.
struct LaunchArgs {
  int n = 1;
  int nnodes = 1, node_rank = 0;
  int master_port = 29500;
  std::string master_addr = "127.0.0.1";
  double grace_s = 10;
  double stop_timeout_s = 20;
  bool no_local_rank = false;
  RestartPolicy restart;
  std::vector<std::string> command;
  std::vector<std::string> deepspeed_options;  // DeepSpeed launcher options given: refused
};

// The launcher's own flags and the command after `--`.
void AddLaunchFlags(CLI::App* cmd, LaunchArgs& a) {
  cmd->add_option("-n,--nproc", a.n, "Number of ranks")->required()->check(CLI::Range(1, 4096));
  cmd->add_option("--nnodes", a.nnodes,
                  "Hosts in the job, each running its own `uckpt launch` with the same -n, --nnodes, --master_addr "
                  "(the host of --node_rank 0) and --master_port")
      ->capture_default_str()
      ->check(CLI::Range(1, 4096));
  cmd->add_option("--node_rank", a.node_rank, "This host's index, 0..nnodes-1: its ranks are node_rank * n + 0..n-1")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--master_port", a.master_port, "Rendezvous port; 0 picks a free one (for parallel jobs)")
      ->capture_default_str()
      ->check(CLI::Range(0, 65535));
  cmd->add_option("--master_addr", a.master_addr, "Rendezvous address")->capture_default_str();
  cmd->add_option("--grace", a.grace_s, "Seconds ranks get to exit after SIGTERM before SIGKILL")
      ->capture_default_str();
  cmd->add_option("--stop_timeout", a.stop_timeout_s,
                  "A rank stopped (SIGSTOP, SIGTSTP) this many seconds fails the job, as a dead one does; 0: wait "
                  "(default: the heartbeat timeout's default)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  cmd->add_flag("--no_local_rank", a.no_local_rank,
                "Do not pass --local_rank=N to a Python script (passed by default, as DeepSpeed's launcher does)");
  cmd->add_option("--max_restarts", a.restart.max_restarts,
                  "When a rank fails, stop the others and start again up to this many times on the devices left "
                  "(the failed rank's device left out, CUDA_VISIBLE_DEVICES set to the rest, UCKPT_RESTART_COUNT to "
                  "the count). The command must resume itself (uckpt train --resume; load_checkpoint in a script). "
                  "Not restarted: a signal to the launcher, a rank exiting with 2 (bad usage or input)")
      ->capture_default_str()
      ->check(CLI::Range(0, 1000));
  cmd->add_option("--min_nproc", a.restart.min_nproc, "With --max_restarts: never restart on fewer ranks than this")
      ->capture_default_str()
      ->check(CLI::Range(1, 4096));
  cmd->add_option("command", a.command, "The command after `--`")->required();
}

// Refuses what the flags cannot do together, naming them.
void CheckLaunchArgs(const LaunchArgs& a) {
  if (a.node_rank >= a.nnodes)
    throw std::invalid_argument("launch: --node_rank " + std::to_string(a.node_rank) + " is not below --nnodes " +
                                std::to_string(a.nnodes));
  if (a.nnodes > 1 && a.master_port == 0)
    throw std::invalid_argument("launch: --master_port 0 picks a port on one host only; with --nnodes " +
                                std::to_string(a.nnodes) + " give every host the same port");
  if (a.nnodes > 1 && a.restart.max_restarts > 0)
    throw std::invalid_argument(
        "launch: --max_restarts restarts the ranks of one host only; across hosts "
        "(--nnodes > 1) it is not supported yet: use torchrun's elastic agent "
        "(--max-restarts), whose restarts uckpt's load_checkpoint/--resume follow");
  const std::string& exe = a.command[0];
  const bool uckpt_train =
      exe.substr(exe.find_last_of('/') + 1) == "uckpt" && a.command.size() > 1 && a.command[1] == "train";
  if (a.restart.max_restarts > 0 && uckpt_train &&
      std::find(a.command.begin(), a.command.end(), "--resume") == a.command.end())
    throw std::invalid_argument(
        "launch: --max_restarts with `uckpt train` needs its --resume (and --checkpoint_dir): "
        "without it a restarted job would start again from step 1");
}

// SIGINT, SIGTERM and SIGHUP are recorded and passed on to the ranks.
void ForwardStopSignals() {
  struct sigaction sa {};
  sa.sa_handler = OnSignal;
  sigemptyset(&sa.sa_mask);
  for (int sig : {SIGINT, SIGTERM, SIGHUP}) sigaction(sig, &sa, nullptr);
}

RankCommand RankCommandOf(const LaunchArgs& a) {
  RankCommand c;
  c.argv = a.command;
  c.argv[0] = ResolveSelf(c.argv[0]);
  c.world_size = a.n;
  c.master_addr = a.master_addr;
  c.local_rank_argument = !a.no_local_rank;
  c.nnodes = a.nnodes;
  c.node_rank = a.node_rank;
  return c;
}

}  // namespace

Runner AddLaunch(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "launch",
      "Start N local ranks of a command with RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,\n"
      "MASTER_ADDR and MASTER_PORT set (as torchrun does). Signals are forwarded; when one rank\n"
      "fails the others are stopped and its exit code is returned; a rank that stays stopped\n"
      "(SIGSTOP) longer than --stop_timeout fails too. When the launcher dies, however it dies\n"
      "(even SIGKILL), the kernel kills its ranks. With --max_restarts, a failed job starts again\n"
      "on the devices left (docs/reliability.md). Across hosts: one launcher per host with\n"
      "--nnodes, --node_rank and --master_addr, as torchrun's static rendezvous.\n\n"
      "Examples:\n"
      "  uckpt launch -n 2 -- uckpt train --config ds.json --steps 100\n"
      "  uckpt launch -n 4 --max_restarts 2 -- uckpt train --config ds.json --steps 100 --checkpoint_dir ck --resume\n"
      "  uckpt launch -n 2 -- python3 train.py --deepspeed_config ds.json   (gets --local_rank=N, as from deepspeed)\n"
      "  torchrun --no-python --nproc-per-node 2 uckpt train --config ds.json --steps 100   (the same)");
  auto a = std::make_shared<LaunchArgs>();
  AddLaunchFlags(cmd, *a);
  AddDeepSpeedLauncherOptions(cmd, a->deepspeed_options);

  return [a] {
    RefuseDeepSpeedLauncherOptions(a->deepspeed_options);
    ForwardStopSignals();
    const RankCommand c = RankCommandOf(*a);
    CheckLaunchArgs(*a);
    // Only this launch's ranks could read snapshots under the id it made: they go when it ends.
    const std::string made_id = SetJobId();
    const int code =
        RunWithRestarts(c, a->master_port, {a->grace_s, a->stop_timeout_s, a->node_rank * a->n}, a->restart);
    std::error_code ec;
    if (!made_id.empty()) std::filesystem::remove_all(SnapshotFolder(SnapshotRoot(), made_id), ec);
    return code;
  };
}

}  // namespace uckpt::cli
