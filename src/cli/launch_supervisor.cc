#include "cli/launch_supervisor.h"

#include <signal.h>
#include <sys/wait.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <string>
#include <thread>

namespace uckpt::cli {
namespace {

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

std::chrono::steady_clock::duration Secs(double s) {
  return std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(s));
}

}  // namespace

LaunchSupervisor::LaunchSupervisor(int num_ranks, Settings settings)
    : ranks_(static_cast<size_t>(num_ranks)), settings_(settings) {}

int LaunchSupervisor::Run(const StartRank& start, std::atomic<int>& pending_signal) {
  StartAll(start);
  while (state_ != State::kDone) {
    if (int sig = pending_signal.exchange(0); sig != 0) ForwardSignal(sig);
    int status = 0;
    const pid_t pid = waitpid(-1, &status, WNOHANG | WUNTRACED | WCONTINUED);
    if (pid > 0) {
      OnWaitStatus(pid, status);
      continue;
    }
    if (pid < 0 && errno != EINTR) break;  // no child left to wait for
    if (state_ == State::kRunning) FailStoppedRank();
    if (state_ == State::kStopping && Clock::now() > kill_at_) {
      Signal(SIGKILL);
      kill_at_ = Clock::time_point::max();
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  state_ = State::kDone;
  return result_;
}

void LaunchSupervisor::StartAll(const StartRank& start) {
  for (size_t r = 0; r < ranks_.size(); ++r) {
    const pid_t pid = start(static_cast<int>(r));
    if (pid < 0) {
      Signal(SIGTERM);
      result_ = 1;
      state_ = State::kDone;
      return;
    }
    ranks_[r].pid = pid;
    ++running_;
  }
  state_ = State::kRunning;
}

// Forwarded as it came; the ranks decide how to end. The first one decides
// the exit code and starts the grace period.
void LaunchSupervisor::ForwardSignal(int sig) {
  Signal(sig);
  ended_by_signal_ = true;
  if (state_ != State::kRunning) return;
  state_ = State::kStopping;
  result_ = 128 + sig;
  kill_at_ = Clock::now() + Secs(settings_.grace_s);
}

void LaunchSupervisor::OnWaitStatus(pid_t pid, int status) {
  for (size_t r = 0; r < ranks_.size(); ++r) {
    Rank& rank = ranks_[r];
    if (rank.pid != pid) continue;
    if (WIFSTOPPED(status)) {
      rank.stopped_since = Clock::now();
      rank.stop_signal = WSTOPSIG(status);
      return;
    }
    if (WIFCONTINUED(status)) {
      rank.stopped_since = Clock::time_point::max();
      return;
    }
    rank.pid = -1;
    rank.stopped_since = Clock::time_point::max();
    const int code = ExitCode(status);
    if (code != 0 && state_ == State::kRunning) {
      std::cerr << "uckpt launch: rank " << settings_.first_rank + static_cast<int>(r) << " exited with code " << code
                << SignalNote(status) << "; stopping the other ranks\n";
      first_failed_rank_ = static_cast<int>(r);
      BeginStopping(code);
    }
    if (--running_ == 0) state_ = State::kDone;
    return;
  }
}

// A rank stopped longer than stop_timeout_s fails the job, as a dead one does.
void LaunchSupervisor::FailStoppedRank() {
  if (settings_.stop_timeout_s <= 0) return;
  for (size_t r = 0; r < ranks_.size(); ++r) {
    const Rank& rank = ranks_[r];
    if (rank.stopped_since == Clock::time_point::max() ||
        Clock::now() - rank.stopped_since < Secs(settings_.stop_timeout_s))
      continue;
    char secs[32];
    std::snprintf(secs, sizeof secs, "%.1f", settings_.stop_timeout_s);
    std::cerr << "uckpt launch: rank " << settings_.first_rank + static_cast<int>(r) << " has been stopped (signal "
              << rank.stop_signal << ": " << strsignal(rank.stop_signal) << ") for " << secs
              << " s; stopping the job\n";
    first_failed_rank_ = static_cast<int>(r);
    BeginStopping(1);
    return;
  }
}

void LaunchSupervisor::BeginStopping(int code) {
  result_ = code;
  state_ = State::kStopping;
  Signal(SIGTERM);
  kill_at_ = Clock::now() + Secs(settings_.grace_s);
}

// Signals each rank's process group (the rank and whatever it started). A
// stopped (SIGSTOP) rank would hold any signal but SIGKILL until continued:
// SIGCONT follows, so it ends now rather than whenever someone continues it.
void LaunchSupervisor::Signal(int sig) {
  for (const Rank& rank : ranks_) {
    if (rank.pid <= 0) continue;
    kill(-rank.pid, sig);
    if (sig != SIGKILL && sig != SIGCONT) kill(-rank.pid, SIGCONT);
  }
}

}  // namespace uckpt::cli
