// Runs one function per rank on threads of this process, each rank with its
// own c10d TCPStore client and Gloo process group (a real multi-rank setup,
// without processes).
#pragma once

#include <stdlib.h>

#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "uckpt/comm.h"

namespace uckpt::engine::testing {

// Calls fn(comm) on `world` ranks; world 1 uses the single-process comm.
// Rethrows the first exception a rank threw.
inline void RunRanks(int world, const std::function<void(Comm&)>& fn,
                     std::chrono::milliseconds timeout = std::chrono::seconds(60)) {
  if (world == 1) {
    auto c = MakeSingleProcessComm();
    fn(*c);
    return;
  }
  // Ranks on threads share this process's c10d flight recorder, which PyTorch 2.x updates from
  // every group's enqueue without guarding against groups on other threads (a map insert
  // crashed under load). Each real rank is a process of its own; here the recorder is off.
  ::setenv("TORCH_FR_BUFFER_SIZE", "0", /*overwrite=*/0);
  const ReservedPort reserved;  // held until every rank is done: no concurrent test can join this store
  const int port = reserved.port();
  std::exception_ptr error;
  std::mutex mu;
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    // The store's server (rank 0) first: clients that connect too early back off for a second.
    if (r == 1) std::this_thread::sleep_for(std::chrono::milliseconds(30));
    threads.emplace_back([&, r] {
      try {
        DistEnv env;
        env.rank = r;
        env.world_size = world;
        env.local_rank = r;
        env.master_port = port;
        auto comm = ConnectC10d(env, timeout, /*cuda=*/false);
        fn(*comm);
        comm->Barrier();
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu);
        if (!error) error = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  if (error) std::rethrow_exception(error);
}

}  // namespace uckpt::engine::testing
