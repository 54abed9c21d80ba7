// A background thread that runs one job per gather unit, in order, while the
// caller goes on: the offloaded update overlapped with the next forward
// (flat_runtime.h). The caller waits for a unit's job (WaitFor) before it
// uses what the job wrote, and for all of them (WaitAll) before anything
// else touches the state they write.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>

namespace uckpt::engine {

class UnitPipeline {
 public:
  // `job(u)` runs on the pipeline's thread.
  explicit UnitPipeline(std::function<void(size_t unit)> job);
  // Ends a pass under way after its current job, then joins the thread.
  ~UnitPipeline();
  UnitPipeline(const UnitPipeline&) = delete;
  UnitPipeline& operator=(const UnitPipeline&) = delete;

  // job(0), ..., job(units - 1) on the thread. std::logic_error while a pass
  // is under way (WaitAll first).
  void Start(size_t units);
  // Returns once job(unit) has returned (at once if no pass is under way).
  // A job's exception ends its pass; the first wait for that unit or a later
  // one, or WaitAll, rethrows it (once).
  void WaitFor(size_t unit);
  // Returns once the pass is over; rethrows its exception as WaitFor does.
  void WaitAll();
  bool running() const;

 private:
  void Loop();
  void RethrowError(std::unique_lock<std::mutex>& lock);

  std::function<void(size_t)> job_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  size_t units_ = 0, done_ = 0;  // of the pass under way (or the last one)
  bool running_ = false, stop_ = false;
  std::exception_ptr error_;
  std::thread thread_;
};

}  // namespace uckpt::engine
