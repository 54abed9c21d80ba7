// `uckpt launch`'s supervisor: starts N ranks, forwards signals, and ends the
// job when one rank fails, as a small state machine:
//
//   Starting --every rank started--> Running --a rank failed, was stopped too
//   long, or a signal came--> Stopping (the others signalled; SIGKILL after
//   the grace period) --no rank left--> Done
//   Running --every rank exited 0--> Done;  Starting --a start failed--> Done
//
// Starting a rank (fork/exec) is the caller's: StartRank.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <vector>

namespace uckpt::cli {

class LaunchSupervisor {
 public:
  enum class State { kStarting, kRunning, kStopping, kDone };
  struct Settings {
    double grace_s = 10;         // after SIGTERM, seconds before SIGKILL
    double stop_timeout_s = 20;  // a rank stopped (SIGSTOP) this long fails the job; 0: wait
    int first_rank = 0;          // the global rank of local rank 0 (in messages)
  };
  // Starts rank r in its own process group; returns its pid, or -1 when it
  // could not (after saying why on stderr).
  using StartRank = std::function<pid_t(int rank)>;

  LaunchSupervisor(int num_ranks, Settings settings);

  // Runs the job to Done; returns the launcher's exit code: 0, the first
  // failing rank's code, 128 + a signal the launcher got, or 1 (a start
  // failed, or a rank stayed stopped). `pending_signal` is set by the
  // launcher's signal handler (0: none) and cleared here.
  int Run(const StartRank& start, std::atomic<int>& pending_signal);
  State state() const { return state_; }
  // After Run: the rank whose failure ended the job (-1: none did), and
  // whether a signal to the launcher ended it (then nothing restarts it).
  int first_failed_rank() const { return first_failed_rank_; }
  bool ended_by_signal() const { return ended_by_signal_; }

 private:
  using Clock = std::chrono::steady_clock;
  struct Rank {
    pid_t pid = -1;                                              // -1: not started, or exited
    Clock::time_point stopped_since = Clock::time_point::max();  // max: not stopped
    int stop_signal = 0;
  };

  void StartAll(const StartRank& start);  // Starting -> Running, or Done
  void ForwardSignal(int sig);            // Running -> Stopping
  void OnWaitStatus(pid_t pid, int status);
  void FailStoppedRank();        // Running -> Stopping
  void BeginStopping(int code);  // SIGTERM to the others
  void Signal(int sig);          // every rank's process group

  std::vector<Rank> ranks_;
  Settings settings_;
  State state_ = State::kStarting;
  int result_ = 0, running_ = 0;
  int first_failed_rank_ = -1;
  bool ended_by_signal_ = false;
  Clock::time_point kill_at_ = Clock::time_point::max();  // Stopping: SIGKILL then
};

}  // namespace uckpt::cli
