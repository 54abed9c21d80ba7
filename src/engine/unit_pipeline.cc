#include "engine/unit_pipeline.h"

#include <stdexcept>
#include <utility>

namespace uckpt::engine {

UnitPipeline::UnitPipeline(std::function<void(size_t unit)> job) : job_(std::move(job)) {
  thread_ = std::thread([this] { Loop(); });
}

UnitPipeline::~UnitPipeline() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void UnitPipeline::Start(size_t units) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (running_) throw std::logic_error("UnitPipeline::Start: the previous pass is still under way");
    units_ = units;
    done_ = 0;
    error_ = nullptr;
    running_ = true;
  }
  cv_.notify_all();
}

void UnitPipeline::Loop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [&] { return stop_ || running_; });
    if (stop_) return;
    while (done_ < units_ && !stop_) {
      const size_t u = done_;
      lock.unlock();
      std::exception_ptr error;
      try {
        job_(u);
      } catch (...) {
        error = std::current_exception();
      }
      lock.lock();
      if (error) {
        error_ = error;
        break;
      }
      done_ = u + 1;
      cv_.notify_all();
    }
    running_ = false;
    cv_.notify_all();
  }
}

void UnitPipeline::RethrowError(std::unique_lock<std::mutex>& lock) {
  if (!error_) return;
  std::exception_ptr e = std::move(error_);
  error_ = nullptr;
  lock.unlock();
  std::rethrow_exception(e);
}

void UnitPipeline::WaitFor(size_t unit) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return done_ > unit || !running_; });
  if (done_ <= unit) RethrowError(lock);  // (a later unit's failure is for a later wait)
}

void UnitPipeline::WaitAll() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return !running_; });
  RethrowError(lock);
}

bool UnitPipeline::running() const {
  std::lock_guard<std::mutex> lock(mu_);
  return running_;
}

}  // namespace uckpt::engine
