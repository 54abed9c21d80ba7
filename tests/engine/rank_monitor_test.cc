// RankMonitor in one process: ranks are monitors on one in-memory store, a
// "dead" rank is a monitor destroyed without Finish(), the store host's death
// is a store that starts failing. Exits are recorded instead of taken.
#include "engine/dist/rank_monitor.h"

#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <atomic>
#include <mutex>
#include <thread>

namespace uckpt::engine {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

// An in-memory store that can be switched off, as rank 0's TCPStore dies.
class SwitchableStore : public c10d::Store {
 public:
  SwitchableStore(c10::intrusive_ptr<c10d::HashStore> inner, std::shared_ptr<std::atomic<bool>> down)
      : inner_(std::move(inner)), down_(std::move(down)) {}
  void set(const std::string& k, const std::vector<uint8_t>& v) override { Up(), inner_->set(k, v); }
  std::vector<uint8_t> get(const std::string& k) override { return Up(), inner_->get(k); }
  int64_t add(const std::string& k, int64_t v) override { return Up(), inner_->add(k, v); }
  bool deleteKey(const std::string& k) override { return Up(), inner_->deleteKey(k); }
  bool check(const std::vector<std::string>& ks) override { return Up(), inner_->check(ks); }
  int64_t getNumKeys() override { return Up(), inner_->getNumKeys(); }
  void wait(const std::vector<std::string>& ks) override { Up(), inner_->wait(ks); }
  void wait(const std::vector<std::string>& ks, const std::chrono::milliseconds& t) override {
    Up(), inner_->wait(ks, t);
  }
  // Newer PyTorch stores clone themselves (a client of its own per thread); this one shares state.
  // Without `override`: PyTorch 2.7's Store has no clone() to override.
  c10::intrusive_ptr<c10d::Store> clone() {  // NOLINT(modernize-use-override)
    return c10::make_intrusive<SwitchableStore>(inner_, down_);
  }

 private:
  void Up() const {
    if (*down_) throw std::runtime_error("Connection reset by peer");
  }
  c10::intrusive_ptr<c10d::HashStore> inner_;
  std::shared_ptr<std::atomic<bool>> down_;
};

// One job: `world` monitors with their recorded exits.
struct Job {
  explicit Job(int world, HeartbeatSettings hs = {0.05, 0.5}) : exits(world) {
    for (int r = 0; r < world; ++r) {
      monitors.push_back(std::make_unique<RankMonitor>(
          [this](std::chrono::milliseconds) -> c10::intrusive_ptr<c10d::Store> {
            if (*down) throw std::runtime_error("Connection refused");
            return c10::make_intrusive<SwitchableStore>(store, down);
          },
          r, world, hs, "test-store",
          [this, r](const std::string& m) {
            std::lock_guard<std::mutex> lock(mu);
            exits[r] = m;
          }));
    }
  }
  std::string Exit(int r) {
    std::lock_guard<std::mutex> lock(mu);
    return exits[r];
  }
  // Waits until every rank in `ranks` has exited; returns the seconds taken.
  double AwaitExits(std::initializer_list<int> ranks, double limit_s = 10) {
    const auto t0 = Clock::now();
    for (;;) {
      bool all = true;
      for (int r : ranks) all &= !Exit(r).empty();
      double s = std::chrono::duration<double>(Clock::now() - t0).count();
      if (all || s > limit_s) return s;
      std::this_thread::sleep_for(10ms);
    }
  }
  c10::intrusive_ptr<c10d::HashStore> store = c10::make_intrusive<c10d::HashStore>();
  std::shared_ptr<std::atomic<bool>> down = std::make_shared<std::atomic<bool>>(false);
  std::mutex mu;
  std::vector<std::string> exits;
  std::vector<std::unique_ptr<RankMonitor>> monitors;
};

TEST(RankMonitor, ADeadRankIsNamedByEveryOther) {
  Job job(4);
  job.monitors[1]->SetActivity("step 7");
  job.monitors[1]->EnterCollective("all-reduce");
  std::this_thread::sleep_for(200ms);
  job.monitors[2].reset();  // rank 2 stops beating, as a SIGKILLed process
  double s = job.AwaitExits({0, 1, 3});
  EXPECT_LT(s, 0.5 + 1.0) << "timeout 0.5 s, interval 0.05 s";
  EXPECT_GE(s, 0.45);  // not before the timeout
  for (int r : {0, 1, 3}) EXPECT_NE(job.Exit(r).find("rank 2 stopped responding"), std::string::npos) << job.Exit(r);
  EXPECT_NE(job.Exit(1).find("uckpt train: rank 1 of 4: "), std::string::npos) << job.Exit(1);
  EXPECT_NE(job.Exit(1).find("this rank: step 7, waiting in all-reduce; exiting"), std::string::npos) << job.Exit(1);
}

TEST(RankMonitor, LiveRanksThatAreBusyAreNotDead) {
  // Heartbeats come from the monitor's thread: a main thread busy (or waiting
  // in a collective) for many timeouts is no failure.
  Job job(3);
  for (auto& m : job.monitors) m->EnterCollective("barrier");
  std::this_thread::sleep_for(1500ms);  // 3 timeouts, with every rank watching every other
  for (int r = 0; r < 3; ++r) EXPECT_EQ(job.Exit(r), "") << r;
}

TEST(RankMonitor, FinishedRanksAreNotDead) {
  Job job(3);
  std::thread t0([&] { job.monitors[0]->Finish(); });  // rank 0 waits for the others' marks
  job.monitors[2]->Finish();
  job.monitors[2].reset();
  std::this_thread::sleep_for(1s);  // rank 1 watches rank 2: finished, not dead
  EXPECT_EQ(job.Exit(1), "");
  job.monitors[1]->Finish();
  t0.join();
  for (int r = 0; r < 3; ++r) EXPECT_EQ(job.Exit(r), "") << r;
}

TEST(RankMonitor, AbandonNamesTheRankAtOnce) {
  Job job(3, {0.05, 5.0});  // a long timeout: only the published failure can be this fast
  job.monitors[1]->Abandon("cannot open ckpt/global_step4/zero_pp_rank_1_mp_rank_00_optim_states.pt\nmore");
  double s = job.AwaitExits({0, 2});
  EXPECT_LT(s, 1.0);
  for (int r : {0, 2})
    EXPECT_NE(
        job.Exit(r).find("rank 1 failed: cannot open ckpt/global_step4/zero_pp_rank_1_mp_rank_00_optim_states.pt;"),
        std::string::npos)
        << job.Exit(r);
  EXPECT_EQ(job.Exit(1), "");  // it reports its own error itself
}

TEST(RankMonitor, StoreGoneMeansRankZeroIsGone) {
  Job job(3, {0.05, 5.0});
  job.monitors[0].reset();
  *job.down = true;  // rank 0's process (and the store it served) died
  double s = job.AwaitExits({1, 2});
  EXPECT_LT(s, 1.0);
  for (int r : {1, 2})
    EXPECT_NE(job.Exit(r).find("rank 0 (the rendezvous host) is gone"), std::string::npos) << job.Exit(r);
}

TEST(RankMonitor, AfterACommErrorEveryRankIsWatched) {
  // Rank 1 watches only rank 2; rank 3 dies after rank 2 finished (so its
  // own watcher is gone): rank 1's failed collective makes it look at all.
  Job job(4);
  job.monitors[2]->Finish();
  job.monitors[2].reset();
  job.monitors[3].reset();
  std::thread waiter([&] { job.monitors[1]->AfterCommError(); });
  double s = job.AwaitExits({1});
  waiter.join();
  EXPECT_LT(s, 2.0);
  EXPECT_NE(job.Exit(1).find("rank 3 stopped responding"), std::string::npos) << job.Exit(1);
}

TEST(RankMonitor, SettingsAreChecked) {
  EXPECT_NO_THROW((HeartbeatSettings{1, 20}.Validate()));
  EXPECT_NO_THROW((HeartbeatSettings{1, 0}.Validate()));  // off
  EXPECT_THROW((HeartbeatSettings{0, 20}.Validate()), std::invalid_argument);
  EXPECT_THROW((HeartbeatSettings{15, 20}.Validate()), std::invalid_argument);
}

}  // namespace
}  // namespace uckpt::engine
