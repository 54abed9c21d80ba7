#include "engine/dist/rank_monitor.h"

#include <unistd.h>

#include <c10/util/Exception.h>

#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <thread>
#include <vector>

namespace uckpt::engine {

namespace {

using Clock = std::chrono::steady_clock;

std::vector<uint8_t> Bytes(const std::string& s) { return {s.begin(), s.end()}; }

// The first line, without c10's backtrace.
std::string FirstLine(const std::exception& e) {
  const auto* c10 = dynamic_cast<const c10::Error*>(&e);
  std::string m = c10 ? c10->what_without_backtrace() : e.what();
  if (auto nl = m.find('\n'); nl != std::string::npos) m.resize(nl);
  return m;
}

std::string Seconds(double s) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f s", s);
  return buf;
}

std::chrono::milliseconds Ms(double seconds) { return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000)); }

}  // namespace

struct RankMonitor::State {
  Connect connect;
  Exit exit_fn;
  int rank = 0, world = 1;
  HeartbeatSettings hs;
  std::string address, store_host;
  // torchrun's restarts that reuse its store get a fresh key space from
  // ConnectC10d (/worker/attempt_<n>/, DistEnv::store_prefix).
  std::string prefix = "uckpt_monitor/";
  std::string verdict_key = prefix + "verdict";
  std::string HeartbeatKey(int r) const { return prefix + "hb/" + std::to_string(r); }
  std::string DoneKey(int r) const { return prefix + "done/" + std::to_string(r); }

  std::timed_mutex client_mu;  // one store round at a time
  c10::intrusive_ptr<c10d::Store> client;

  std::mutex mu;
  std::condition_variable cv;
  bool stop = false;       // threads end
  bool finishing = false;  // Finish/Abandon: no more judging
  bool exited = false;     // Exit was called (and returned: tests)
  int threads = 0;         // still running
  std::string activity = "start-up";
  const char* collective = nullptr;
  Clock::time_point collective_since;
  bool scan_all = false;
  std::string verdict;        // a dead rank, found here or read from the store
  std::string store_problem;  // why the store is unusable
  bool store_gone = false;
  Clock::time_point last_ok = Clock::now();  // last completed store round
  std::function<void()> abort;

  void Beat();
  void Watch();
  void Die(std::unique_lock<std::mutex>& lock, const std::string& why);
};

// One round: beat, read the verdict, check the watched ranks.
void RankMonitor::State::Beat() {
  struct Seen {
    int64_t value = -1;
    Clock::time_point since;
  };
  std::vector<Seen> seen(static_cast<size_t>(world));
  std::unique_lock<std::mutex> lock(mu);
  while (!stop) {
    const bool all = scan_all || (collective != nullptr && Clock::now() - collective_since > Ms(hs.timeout_s));
    const bool judging = !finishing;
    lock.unlock();
    std::string found, problem;
    bool gone = false, ok = false;
    {
      std::unique_lock<std::timed_mutex> cl(client_mu);
      try {
        client->add(HeartbeatKey(rank), 1);
        if (client->check({verdict_key})) {
          auto v = client->get(verdict_key);
          found.assign(v.begin(), v.end());
        }
        std::vector<int> watch;
        if (all) {
          for (int r = 0; r < world; ++r)
            if (r != rank) watch.push_back(r);
        } else if (world > 1) {
          watch.push_back((rank + 1) % world);
        }
        for (int r : watch) {
          const int64_t v = client->add(HeartbeatKey(r), 0);
          const auto now = Clock::now();
          Seen& s = seen[static_cast<size_t>(r)];
          if (s.value != v) {
            s = {v, now};
            continue;
          }
          const double age = std::chrono::duration<double>(now - s.since).count();
          if (judging && found.empty() && age >= hs.timeout_s && !client->check({DoneKey(r)})) {
            found = "rank " + std::to_string(r) + " stopped responding (no heartbeat for " + Seconds(age) +
                    ", noticed by rank " + std::to_string(rank) + ")";
            client->set(verdict_key, Bytes(found));  // the others read it on their next round
          }
        }
        ok = true;
      } catch (const std::exception& e) {
        // The connection broke. A store that refuses a new one is gone.
        problem = FirstLine(e);
        try {
          client = connect(Ms(2 * hs.interval_s));
        } catch (const std::exception& e2) {
          gone = true;
          problem += "; reconnecting: " + FirstLine(e2);
        }
      }
    }
    lock.lock();
    if (ok) last_ok = Clock::now();
    if (!problem.empty()) store_problem = problem;
    if (gone) store_gone = true;
    if (!found.empty() && verdict.empty()) verdict = found;
    if (gone || !found.empty()) cv.notify_all();
    cv.wait_for(lock, Ms(hs.interval_s), [&] { return stop; });
  }
  --threads;
  cv.notify_all();
}

// Decides, without touching the store (a stuck store cannot stall it).
void RankMonitor::State::Watch() {
  std::unique_lock<std::mutex> lock(mu);
  const auto tick = Ms(std::max(0.01, hs.interval_s / 4));
  while (!stop) {
    if (!finishing && !exited) {
      const double silent = std::chrono::duration<double>(Clock::now() - last_ok).count();
      if (!verdict.empty()) {
        Die(lock, verdict);
      } else if (store_gone) {
        Die(lock, store_host + " (the rendezvous host) is gone: its store at " + address + " refuses connections (" +
                      store_problem + ")");
      } else if (silent > hs.timeout_s) {
        Die(lock, store_host + " (the rendezvous host) is gone: its store at " + address + " has not answered for " +
                      Seconds(silent) + (store_problem.empty() ? "" : " (" + store_problem + ")"));
      }
    }
    cv.wait_for(lock, tick, [&] { return stop; });
  }
  --threads;
  cv.notify_all();
}

void RankMonitor::State::Die(std::unique_lock<std::mutex>& lock, const std::string& why) {
  exited = true;
  const std::string where = activity + (collective != nullptr ? std::string(", waiting in ") + collective : "");
  const std::string msg = "uckpt train: rank " + std::to_string(rank) + " of " + std::to_string(world) + ": " + why +
                          "; this rank: " + where + "; exiting";
  auto abort_hook = abort;
  const bool linger = rank == 0 && !store_gone;
  lock.unlock();
  // Rank 0 serves the store: stay a moment so every rank reads the verdict
  // instead of finding the store gone.
  if (linger) std::this_thread::sleep_for(Ms(3 * hs.interval_s));
  if (abort_hook) {
    // A communicator abort may itself block: give it 2 s, then exit anyway.
    auto done = std::make_shared<std::atomic<bool>>(false);
    std::thread([abort_hook, done] {
      try {
        abort_hook();
      } catch (...) {}
      *done = true;
    }).detach();
    for (int i = 0; i < 200 && !*done; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  exit_fn(msg);
  lock.lock();
  cv.notify_all();
}

RankMonitor::RankMonitor(Connect connect, int rank, int world_size, HeartbeatSettings settings,
                         std::string store_address, Exit exit, std::string store_host)
    : s_(std::make_shared<State>()) {
  settings.Validate();
  s_->connect = std::move(connect);
  s_->rank = rank;
  s_->world = world_size;
  s_->hs = settings;
  s_->address = std::move(store_address);
  s_->store_host = std::move(store_host);
  s_->exit_fn = exit ? std::move(exit) : Exit([](const std::string& msg) {
    std::string line = msg + "\n";
    ssize_t n = ::write(STDERR_FILENO, line.data(), line.size());
    (void)n;
    ::_exit(1);
  });
  s_->client = s_->connect(Ms(std::max(10.0, settings.timeout_s)));
  s_->client->add(s_->HeartbeatKey(rank), 1);
  s_->last_ok = Clock::now();
  s_->threads = 2;
  std::thread([s = s_] { s->Beat(); }).detach();
  std::thread([s = s_] { s->Watch(); }).detach();
}

namespace {
// Stops both threads; a thread stuck in a store call is left behind (it owns
// a reference to the state, so that is safe).
void StopThreads(RankMonitor::State& s, std::unique_lock<std::mutex>& lock) {
  s.stop = true;
  s.cv.notify_all();
  s.cv.wait_for(lock, Ms(2 * s.hs.interval_s + 1), [&] { return s.threads == 0; });
}
}  // namespace

RankMonitor::~RankMonitor() {
  std::unique_lock<std::mutex> lock(s_->mu);
  StopThreads(*s_, lock);
}

void RankMonitor::SetActivity(std::string activity) {
  std::lock_guard<std::mutex> lock(s_->mu);
  s_->activity = std::move(activity);
}

void RankMonitor::EnterCollective(const char* name) {
  std::lock_guard<std::mutex> lock(s_->mu);
  s_->collective = name;
  s_->collective_since = Clock::now();
}

void RankMonitor::LeaveCollective() {
  std::lock_guard<std::mutex> lock(s_->mu);
  s_->collective = nullptr;
}

void RankMonitor::SetAbortHook(std::function<void()> abort) {
  std::lock_guard<std::mutex> lock(s_->mu);
  s_->abort = std::move(abort);
}

void RankMonitor::AfterCommError() {
  std::unique_lock<std::mutex> lock(s_->mu);
  if (s_->finishing) return;
  s_->scan_all = true;
  s_->cv.notify_all();
  // A dead peer is named within the timeout (+ a round or two, + a reconnect).
  s_->cv.wait_for(lock, Ms(s_->hs.timeout_s + 6 * s_->hs.interval_s + 1), [&] { return s_->exited; });
}

void RankMonitor::Abandon(const std::string& why) {
  std::unique_lock<std::mutex> lock(s_->mu);
  if (s_->finishing || s_->exited) return;
  s_->finishing = true;
  StopThreads(*s_, lock);
  lock.unlock();
  std::string line = why.substr(0, why.find('\n'));
  if (line.size() > 400)
    line.replace(400, std::string::npos, "...");  // not substr + "...": a GCC 12 -Warray-bounds false positive
  std::unique_lock<std::timed_mutex> cl(s_->client_mu, std::defer_lock);
  if (!cl.try_lock_for(Ms(s_->hs.interval_s))) return;
  try {
    if (!s_->client->check({s_->verdict_key}))
      s_->client->set(s_->verdict_key, Bytes("rank " + std::to_string(s_->rank) + " failed: " + line));
  } catch (const std::exception&) {
    return;  // the store is gone too; the others notice that
  }
  if (s_->rank == 0) std::this_thread::sleep_for(Ms(3 * s_->hs.interval_s));  // let them read it
}

void RankMonitor::Finish() {
  std::unique_lock<std::mutex> lock(s_->mu);
  if (s_->finishing || s_->exited) return;
  s_->finishing = true;
  lock.unlock();
  // One store call at a time, between the heartbeat rounds (which go on).
  auto with_client = [&](auto&& f) {
    std::unique_lock<std::timed_mutex> cl(s_->client_mu, std::defer_lock);
    if (!cl.try_lock_for(Ms(2 * s_->hs.interval_s))) return false;
    f(*s_->client);
    return true;
  };
  try {
    with_client([&](c10d::Store& st) { st.set(s_->DoneKey(s_->rank), Bytes("1")); });
    if (s_->rank == 0) {
      std::vector<std::string> keys;
      for (int r = 1; r < s_->world; ++r) keys.push_back(s_->DoneKey(r));
      const auto deadline = Clock::now() + Ms(s_->hs.timeout_s);
      bool all = false;
      while (Clock::now() < deadline) {
        with_client([&](c10d::Store& st) { all = st.check(keys); });
        if (all) break;
        std::this_thread::sleep_for(Ms(s_->hs.interval_s / 4));
      }
    }
  } catch (const std::exception&) {
    // The store is gone: nothing left to coordinate, the job is done anyway.
  }
  lock.lock();
  StopThreads(*s_, lock);
}

}  // namespace uckpt::engine
