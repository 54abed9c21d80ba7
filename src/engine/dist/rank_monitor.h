// Failing ranks end the job: a heartbeat per rank in the c10d TCPStore and a
// watchdog that exits the process, naming the failed rank, when a peer stops
// beating or the store (served by rank 0) is gone.
//
// It does not rely on the backend noticing a dead peer (NCCL may just hang).
//  - Every rank bumps the counter `uckpt_monitor/hb/<rank>` each interval
//    through its own store client (not the process group's), from a thread
//    that keeps beating while the main thread computes or writes.
//  - Rank r watches rank r+1's counter (O(1) store traffic per rank); after a
//    collective failed, or while one has waited longer than the timeout, it
//    watches every rank. A counter unchanged for `timeout` local seconds, from
//    a rank that did not mark itself finished, is a dead rank: the watcher
//    publishes a verdict under `uckpt_monitor/verdict` and exits; every rank
//    polls that key and exits with the same verdict.
//  - A store that stops answering (rank 0 died: reconnecting is refused, or no
//    answer for `timeout`) means the rendezvous host is gone.
// Counters, not timestamps, travel between hosts, so clocks need not agree.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <functional>
#include <memory>
#include <string>

#include "uckpt/comm.h"

namespace uckpt::engine {

class RankMonitor {
 public:
  // Opens a new client of the rendezvous store (called again to reconnect).
  using Connect = std::function<c10::intrusive_ptr<c10d::Store>(std::chrono::milliseconds timeout)>;
  // Ends the process with a message (default: stderr, then _exit(1)). Tests
  // pass one that records and returns; the monitor then stops.
  using Exit = std::function<void(const std::string& message)>;

  // `store_host` names who serves the store in messages ("rank 0", or
  // "torchrun's agent" when torchrun's agent does).
  RankMonitor(Connect connect, int rank, int world_size, HeartbeatSettings settings, std::string store_address,
              Exit exit = {}, std::string store_host = "rank 0");
  ~RankMonitor();  // stops beating (no verdict: to the others this rank looks dead unless it Finish()ed)
  RankMonitor(const RankMonitor&) = delete;
  RankMonitor& operator=(const RankMonitor&) = delete;

  // What the main thread is doing, for the exit message ("step 7", "saving global_step6").
  void SetActivity(std::string activity);
  // Brackets a collective or barrier.
  void EnterCollective(const char* name);
  void LeaveCollective();
  // Called right before process exit: aborts the backend's communicators
  // (bounded to 2 s, after the message is printed).
  void SetAbortHook(std::function<void()> abort);

  // A collective failed: watch every rank and give the watchdog the timeout
  // to name a dead one (it ends the process). Returns when none is found.
  void AfterCommError();
  // This rank is leaving with an error: publish it, so the others exit at
  // once naming this rank instead of waiting for the heartbeat timeout.
  void Abandon(const std::string& why);
  // Clean end: mark this rank finished and stop judging. Rank 0 (whose
  // process serves the store) waits up to the timeout for the others'
  // marks, so no rank sees the store vanish while it still needs it.
  void Finish();

  struct State;  // shared with the threads (which may outlive a stuck join)

 private:
  std::shared_ptr<State> s_;
};

}  // namespace uckpt::engine
