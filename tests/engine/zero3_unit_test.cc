// Stage 3's gather units as objects with a lifecycle (engine/zero3_unit.h):
// the states a forward and backward take them through, with prefetching at
// two ranks, and the verbs refused where they do not fit.
#include <gtest/gtest.h>

#include <functional>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "engine/zero3_runtime.h"
#include "ranks.h"

namespace uckpt::engine {
namespace {

using testing::RunRanks;
using State = GatherUnit::State;
using Pass = GatherUnit::Pass;

// Two gather units of one 4-element parameter each, every parameter
// gathered and freed with its unit (threshold 0), prefetching one unit ahead.
std::unique_ptr<Zero3Runtime> TwoUnits(Comm& comm) {
  std::vector<std::vector<std::pair<std::string, at::Tensor>>> groups(1);
  for (const char* name : {"a.w", "b.w"})
    groups[0].emplace_back(name, (at::arange(4, at::kFloat) * 0.25 + 1).requires_grad_(true));
  Zero3Settings s;
  s.base.stage = 3;
  s.persistence_threshold = 0;
  s.prefetch_bucket_size = 1;
  return std::make_unique<Zero3Runtime>(comm, groups, std::vector<OptimizerConfig>(1),
                                        std::vector<std::vector<int>>{{0, 1}}, 2, s, at::Device(at::kCPU));
}

// What a unit is at one point: "state/pass/holds".
std::string Snap(const Zero3Runtime& z, size_t u) {
  const GatherUnit& unit = z.units().unit(u);
  return std::string(GatherUnit::Name(unit.state())) + "/" + GatherUnit::Name(unit.pass()) + "/" +
         std::to_string(unit.holds());
}

void ExpectRefused(const std::function<void()>& call, const std::string& needle) {
  try {
    call();
    ADD_FAILURE() << "not refused; expected an error naming \"" << needle << "\"";
  } catch (const std::logic_error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

// A forward through unit 0 then unit 1 and its backward, at two ranks (the
// units are prefetched): every state on the way, rank 0's.
TEST(Zero3Unit, ForwardAndBackwardGoThroughTheirStates) {
  std::vector<std::string> seen;
  std::mutex mu;
  RunRanks(2, [&](Comm& comm) {
    std::vector<std::string> log;
    auto z = TwoUnits(comm);
    auto note = [&](const std::string& when) { log.push_back(when + ": " + Snap(*z, 0) + " | " + Snap(*z, 1)); };
    at::Tensor w0 = z->params()[0].tensor, w1 = z->params()[1].tensor;
    note("built");
    at::Tensor x = at::ones({4}).requires_grad_(true);
    at::Tensor h = z->EnterUnit(0, x);
    note("enter 0");
    at::Tensor a = h * w0;
    a.register_hook([&](const at::Tensor&) { note("backward of unit 0"); });
    at::Tensor a_out = z->ExitUnit(0, a);
    note("exit 0");
    a_out.register_hook([&](const at::Tensor&) { note("unit 1 backward done"); });
    at::Tensor b = z->EnterUnit(1, a_out) * w1;
    note("enter 1");
    b.register_hook([&](const at::Tensor&) { note("backward of unit 1"); });
    at::Tensor y = z->ExitUnit(1, b);
    note("exit 1");
    y.sum().backward();
    note("backward");
    z->FinishBackward();
    note("finish backward");
    EXPECT_EQ(z->stats().prefetched_gathers, 2);  // unit 1 in forward, unit 0 in backward
    EXPECT_EQ(z->stats().unused_prefetches, 0);
    EXPECT_EQ(z->stats().gathered_elements, 0);
    if (comm.rank() == 0) {
      std::lock_guard<std::mutex> lock(mu);
      seen = log;
    }
  });
  const std::vector<std::string> expected = {
      "built: gathered/idle/1 | gathered/idle/1",  // parameters start whole
      "enter 0: gathered/forward/1 | gathering (prefetch in flight)/idle/0",
      "exit 0: sharded/idle/0 | gathering (prefetch in flight)/idle/0",
      "enter 1: sharded/idle/0 | gathered/forward/1",
      "exit 1: sharded/idle/0 | sharded/idle/0",
      "backward of unit 1: gathering (prefetch in flight)/idle/0 | gathered/backward/1",
      "unit 1 backward done: gathering (prefetch in flight)/idle/0 | sharded/backward done/0",
      "backward of unit 0: gathered/backward/1 | sharded/backward done/0",
      "backward: sharded/backward done/0 | sharded/backward done/0",
      "finish backward: sharded/idle/0 | sharded/idle/0",
  };
  EXPECT_EQ(seen, expected);
}

// Verbs that do not fit the unit's state throw, naming the unit and why,
// and leave the state as it was.
TEST(Zero3Unit, IllegalTransitionsAreRefused) {
  RunRanks(2, [&](Comm& comm) {
    auto z = TwoUnits(comm);
    const at::Tensor x = at::ones({4});
    z->EnterUnit(0, x);  // unit 1 prefetched
    ExpectRefused([&] { z->ExitUnit(1, x); }, "gather unit 1: ExitUnit refused while gathering (prefetch in flight)");
    EXPECT_EQ(Snap(*z, 1), "gathering (prefetch in flight)/idle/0");
    z->ExitUnit(0, x);
    ExpectRefused([&] { z->ExitUnit(0, x); }, "gather unit 0: ExitUnit refused while sharded: it was not entered");
    EXPECT_EQ(Snap(*z, 0), "sharded/idle/0");
    // ReleaseParameters() without GatherParameters(), refused before any unit changes.
    ExpectRefused([&] { z->ReleaseAll(); },
                  "gather unit 0: free refused while sharded: it was released more often than gathered");
    EXPECT_EQ(Snap(*z, 1), "gathering (prefetch in flight)/idle/0");
    EXPECT_THROW(z->EnterUnit(2, x), std::out_of_range);
    z->FinishBackward();  // drops the prefetch
    EXPECT_EQ(Snap(*z, 1), "sharded/idle/0");
    EXPECT_EQ(z->stats().unused_prefetches, 1);
  });
}

// The unit alone (no parameters): each verb's precondition.
TEST(Zero3Unit, VerbsCheckTheState) {
  auto comm = MakeSingleProcessComm();
  std::vector<Zero3Param> none;
  ParamStorage storage(*comm, none, at::Device(at::kCPU));
  GatherUnit unit(3, {}, 0);
  EXPECT_EQ(unit.state(), State::kGathered);
  ExpectRefused([&] { unit.StartPrefetch(storage); }, "gather unit 3: prefetch refused while gathered");
  ExpectRefused([&] { unit.CancelPrefetch(storage); }, "no prefetch is in flight");
  ExpectRefused([&] { unit.Exit(storage); }, "it was not entered");
  unit.Free(storage);  // the initial hold
  EXPECT_EQ(unit.state(), State::kSharded);
  ExpectRefused([&] { unit.Free(storage); }, "released more often than gathered");
  unit.BackwardGather(storage);
  EXPECT_EQ(unit.pass(), Pass::kBackward);
  ExpectRefused([&] { unit.EndBackward(); }, "a backward gather of it was not done");
  unit.BackwardDone(storage);
  EXPECT_EQ(unit.state(), State::kSharded);
  EXPECT_EQ(unit.pass(), Pass::kBackwardDone);
  unit.EndBackward();
  EXPECT_EQ(unit.pass(), Pass::kIdle);
  unit.StartPrefetch(storage);
  EXPECT_EQ(unit.state(), State::kGathering);
  unit.Enter(storage);
  EXPECT_EQ(unit.state(), State::kGathered);
  EXPECT_EQ(unit.holds(), 1);
  unit.Exit(storage);
  EXPECT_EQ(unit.state(), State::kSharded);
}

}  // namespace
}  // namespace uckpt::engine
