// Hostile pickles: torch files whose data.pkl tries to run `touch <marker>`
// through every calling trick pickle has. The reader must build inert object
// nodes (or refuse the file) and the marker must never appear. As a control,
// the same pickles do create the marker when real Python unpickles them.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <sstream>
#include <thread>

#include "format/error.h"
#include "format/torch_file.h"
#include "format/value_json.h"
#include "format/value_print.h"
#include "test_support.h"

namespace uckpt::test {
namespace {

struct HostileCase {
  std::string name;
  // Builds data.pkl for a payload shell command.
  std::string (*pickle)(const std::string& cmd);
  // The class path of the inert object the payload call must become
  // (empty: the reader may refuse the file instead).
  std::string object_class;
  // Where that object sits: "" root, "0" first list item, "config" dict value.
  std::string where;
  bool needs_storage = false;  // has a tensor record data/0
  bool live_in_python = true;  // plain pickle.loads runs the payload
};

std::string OsSystemReduce(const std::string& cmd) {
  return PickleBuilder().Proto(2).Global("os", "system").CallWithStr(cmd).Stop().bytes();
}
std::string PosixSystemStackGlobal(const std::string& cmd) {
  return PickleBuilder()
      .Proto(4)
      .ShortStr("posix")
      .ShortStr("system")
      .Op(pickle::kStackGlobal)
      .CallWithStr(cmd)
      .Stop()
      .bytes();
}
std::string InstOsSystem(const std::string& cmd) {
  // Protocol 0: INST calls without a REDUCE.
  return PickleBuilder().Mark().Str(cmd).Inst("os", "system").Stop().bytes();
}
std::string InstSubprocessGetoutput(const std::string& cmd) {
  return PickleBuilder().Mark().Str(cmd).Inst("subprocess", "getoutput").Stop().bytes();
}
std::string MemoIndirect(const std::string& cmd) {
  // The callable is memoized and popped, then fetched back by BINGET inside a list.
  return PickleBuilder()
      .Proto(2)
      .Global("os", "system")
      .Put(0)
      .Op(pickle::kPop)
      .Op(pickle::kEmptyList)
      .Get(0)
      .CallWithStr(cmd)
      .Op(pickle::kAppend)
      .Stop()
      .bytes();
}
// Python source that runs `cmd`, for builtins.eval.
std::string EvalSource(const std::string& cmd) { return "__import__('os').system('" + cmd + "')"; }
std::string BuiltinsEval(const std::string& cmd) {
  return PickleBuilder().Proto(2).Global("__builtin__", "eval").CallWithStr(EvalSource(cmd)).Stop().bytes();
}
// subprocess.Popen(['/bin/sh', '-c', cmd]), called with `call` (REDUCE or NEWOBJ).
std::string PopenShell(const std::string& cmd, pickle::Opcode call) {
  return PickleBuilder()
      .Proto(2)
      .Global("subprocess", "Popen")
      .Mark()
      .Str("/bin/sh")
      .Str("-c")
      .Str(cmd)
      .Op(pickle::kList)
      .Op(pickle::kTuple1)
      .Op(call)
      .Stop()
      .bytes();
}
std::string SubprocessPopen(const std::string& cmd) { return PopenShell(cmd, pickle::kReduce); }
// NEWOBJ: cls.__new__(cls, *args) does not run __init__, so Python does not
// run the command either; the reader must still keep it inert.
std::string PopenNewobj(const std::string& cmd) { return PopenShell(cmd, pickle::kNewObj); }
std::string ObjOpcode(const std::string& cmd) {
  return PickleBuilder().Mark().Global("os", "system").Str(cmd).Op(pickle::kObj).Stop().bytes();
}
std::string EvalInDictWithTensor(const std::string& cmd) {
  return PickleBuilder()
      .Proto(2)
      .Op(pickle::kEmptyDict)
      .Mark()
      .Str("weight")
      .Tensor("FloatStorage", "0", 2, 0, {2}, {1})
      .Str("config")
      .Global("__builtin__", "eval")
      .CallWithStr(EvalSource(cmd))
      .Op(pickle::kSetItems)
      .Stop()
      .bytes();
}
std::string GetattrChain(const std::string& cmd) {
  // getattr(__import__('os'), 'system')(cmd): the outer call's callable is
  // itself a call result.
  return PickleBuilder()
      .Proto(2)
      .Global("__builtin__", "getattr")
      .Global("__builtin__", "__import__")
      .CallWithStr("os")
      .Str("system")
      .Op(pickle::kTuple2)
      .Op(pickle::kReduce)
      .CallWithStr(cmd)
      .Stop()
      .bytes();
}
std::string BuildSetstate(const std::string& cmd) {
  // An object whose BUILD state would feed a __setstate__ / __dict__ update.
  return PickleBuilder()
      .Proto(2)
      .Global("os", "system")
      .CallWithStr(cmd)
      .Op(pickle::kEmptyDict)
      .Str("__setstate__")
      .Global("os", "system")
      .Op(pickle::kSetItem)
      .Op(pickle::kBuild)
      .Stop()
      .bytes();
}
std::string NestedPickleLoads(const std::string& cmd) {
  // pickle.loads(<bytes of a pickle that calls os.system>)
  std::string inner = OsSystemReduce(cmd);
  return PickleBuilder()
      .Proto(3)
      .Global("pickle", "loads")
      .Bytes(inner)
      .Op(pickle::kTuple1)
      .Op(pickle::kReduce)
      .Stop()
      .bytes();
}

const HostileCase kCases[] = {
    {"os_system_reduce", OsSystemReduce, "os.system", ""},
    {"posix_system_stack_global", PosixSystemStackGlobal, "posix.system", ""},
    {"inst_os_system", InstOsSystem, "os.system", ""},
    {"inst_subprocess_getoutput", InstSubprocessGetoutput, "subprocess.getoutput", ""},
    {"memo_indirect", MemoIndirect, "os.system", "0"},
    {"builtins_eval", BuiltinsEval, "builtins.eval", ""},
    {"subprocess_popen", SubprocessPopen, "subprocess.Popen", ""},
    {"popen_newobj", PopenNewobj, "subprocess.Popen", "", false, false},
    {"obj_opcode", ObjOpcode, "os.system", ""},
    {"eval_in_dict_with_tensor", EvalInDictWithTensor, "builtins.eval", "config", true, false},
    {"getattr_chain", GetattrChain, "", ""},
    {"build_setstate", BuildSetstate, "os.system", ""},
    {"nested_pickle_loads", NestedPickleLoads, "pickle.loads", ""},
};

class HostileTest : public ::testing::TestWithParam<HostileCase> {
 protected:
  TempDir dir_;
  std::string marker_ = dir_.File("pwned");
  std::string Command() const { return "touch " + marker_; }
  // The case's torch file, with its tensor record where it has one.
  std::string WriteCaseFile(const HostileCase& c) {
    const std::string path = dir_.File(c.name + ".pt");
    std::map<std::string, std::vector<uint8_t>> storages;
    if (c.needs_storage) storages["0"] = std::vector<uint8_t>(8, 0);
    WriteTorchZip(path, c.name, c.pickle(Command()), storages);
    return path;
  }
};

const Value* At(const ValuePtr& root, const std::string& where) {
  if (where.empty()) return root.get();
  if (root->kind == Kind::kList) return root->items.empty() ? nullptr : root->items[0].get();
  ValuePtr v = root->get(where);
  return v.get();
}

TEST_P(HostileTest, LoadsInertAndRunsNothing) {
  const HostileCase& c = GetParam();
  const std::string path = WriteCaseFile(c);

  ValuePtr root;
  try {
    root = LoadTorchFile(path, {.policy = PicklePolicy::kLenient}).root;
  } catch (const FormatError& e) {
    EXPECT_TRUE(c.object_class.empty()) << "refused, but should load as an inert object: " << e.what();
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
  }
  if (root) {
    ASSERT_FALSE(c.object_class.empty()) << "no expectation for a loaded value";
    const Value* call = At(root, c.where);
    ASSERT_NE(call, nullptr);
    EXPECT_EQ(call->kind, Kind::kObject) << KindName(*call);
    EXPECT_EQ(call->s, c.object_class);
    json j = ValueToJson(*root);
    std::ostringstream printed;
    PrintValue(printed, *root);
    EXPECT_NE(printed.str().find(c.object_class), std::string::npos) << printed.str();
    // Written back and read again, it is still the same inert value.
    SaveOptions so;
    so.durable = false;
    SaveTorchFile(dir_.File("again.pt"), root, so);
    auto diffs =
        JsonDiff(j, ValueToJson(*LoadTorchFile(dir_.File("again.pt"), {.policy = PicklePolicy::kLenient}).root),
                 {.map_storage_keys = true});
    EXPECT_TRUE(diffs.empty()) << DiffText(diffs);
  }
  EXPECT_FALSE(FileExists(marker_)) << "the payload ran";
}

// Strict mode (the default for training state) refuses every one of them,
// naming the global, and runs nothing either.
TEST_P(HostileTest, StrictRefusesNamingTheGlobal) {
  const HostileCase& c = GetParam();
  const std::string path = WriteCaseFile(c);
  // getattr_chain: getattr waits for its call; __import__ is refused first.
  const std::string global = c.object_class.empty() ? "builtins.__import__" : c.object_class;
  try {
    LoadTorchFile(path, {.policy = PicklePolicy::kStrict});
    ADD_FAILURE() << "strict mode accepted " << c.name;
  } catch (const FormatError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find(path), std::string::npos) << what;
    EXPECT_NE(what.find("strict mode refuses global " + global), std::string::npos) << what;
  }
  EXPECT_FALSE(FileExists(marker_)) << "the payload ran";
}

INSTANTIATE_TEST_SUITE_P(Pickles, HostileTest, ::testing::ValuesIn(kCases),
                         [](const auto& info) { return info.param.name; });

// Control: the payloads are real. Python's own unpickler runs them (all but
// the NEWOBJ case, which never calls, and the one that needs a tensor record).
class HostileControlTest : public HostileTest {};

std::vector<HostileCase> LiveCases() {
  std::vector<HostileCase> out;
  for (const auto& c : kCases)
    if (c.live_in_python) out.push_back(c);
  return out;
}

TEST_P(HostileControlTest, PayloadRunsInRealPython) {
  const HostileCase& c = GetParam();
  const std::string pkl = dir_.File("data.pkl");
  {
    std::ofstream out(pkl, std::ios::binary);
    out << c.pickle(Command());
  }
  const std::string cmd = "/usr/bin/python3 -c 'import pickle,sys; pickle.loads(open(sys.argv[1],\"rb\").read())' " +
                          pkl + " >/dev/null 2>&1";
  // The exit status does not matter: some pickles fail after their call ran.
  (void)std::system(cmd.c_str());
  // Popen returns before its child finishes.
  for (int k = 0; k < 100 && !FileExists(marker_); ++k) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_TRUE(FileExists(marker_)) << "the control payload did not run, so the test above proves nothing";
}

INSTANTIATE_TEST_SUITE_P(Pickles, HostileControlTest, ::testing::ValuesIn(LiveCases()),
                         [](const auto& info) { return info.param.name; });

// ---- Resource bombs: valid-looking input that would take unbounded time or memory

ValuePtr ReadPickleBytes(const std::string& pickle, const std::string& name) {
  return ReadPickle({reinterpret_cast<const uint8_t*>(pickle.data()), pickle.size()}, name, {});
}

std::string DoublingLists(int levels) {
  // x0 = None; x(k+1) = [x(k), x(k)]
  PickleBuilder p;
  p.Proto(2).Op(pickle::kNone);
  for (int k = 0; k < levels; ++k)
    p.Put(0).Op(pickle::kPop).Op(pickle::kEmptyList).Mark().Get(0).Get(0).Op(pickle::kAppends);
  return p.Stop().bytes();
}

TEST(ResourceBombs, SharedReferencesDoNotExplodeJson) {
  const std::string p = DoublingLists(60);
  auto v = ReadPickleBytes(p, "bomb.pkl");
  JsonOptions o;
  o.max_nodes = 100000;
  EXPECT_THROW(ValueToJson(*v, o), FormatError);
}

// The same with the default limit of 10 million nodes: refused at once
// instead of after minutes and gigabytes of JSON.
TEST(ResourceBombs, SharedReferencesRefusedBeforeRendering) {
  const std::string p = DoublingLists(60);
  auto v = ReadPickleBytes(p, "bomb.pkl");
  const auto start = std::chrono::steady_clock::now();
  EXPECT_THROW(ValueToJson(*v), FormatError);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(seconds, 5.0);
  // Sharing that stays under the limit renders every reference in full.
  const std::string small = DoublingLists(10);
  auto w = ReadPickleBytes(small, "small.pkl");
  json j = ValueToJson(*w);
  size_t leaves = 0;
  std::function<void(const json&)> count = [&](const json& n) {
    if (n["type"] == "none") ++leaves;
    if (n.contains("items"))
      for (const auto& c : n["items"]) count(c);
  };
  count(j);
  EXPECT_EQ(leaves, 1024u);
}

TEST(ResourceBombs, SharedReferencesDoNotExplodePrint) {
  const std::string p = DoublingLists(60);
  auto v = ReadPickleBytes(p, "bomb.pkl");
  std::ostringstream out;
  const auto start = std::chrono::steady_clock::now();
  try {
    PrintValue(out, *v);
  } catch (const FormatError&) {}
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(seconds, 10.0) << "printing 60 levels of shared lists";
  EXPECT_LT(out.str().size(), 100u << 20) << "printed " << out.str().size() << " bytes";
  EXPECT_NE(out.str().find("stopped after"), std::string::npos) << "the output does not say it is incomplete";
}

// torch allows expanded views (stride 0) far larger than their storage. A
// hostile file can claim 2^62 elements over one element of storage.
TEST(ResourceBombs, HugeExpandedTensor) {
  TempDir dir;
  for (const char* cls : {"FloatStorage", "ComplexDoubleStorage"}) {
    SCOPED_TRACE(cls);
    const int64_t es = std::string(cls) == "FloatStorage" ? 4 : 16;
    for (int64_t n : {int64_t{1} << 40, int64_t{1} << 62}) {
      SCOPED_TRACE(n);
      std::string pkl = PickleBuilder().Proto(2).Tensor(cls, "0", 1, 0, {n}, {0}).Stop().bytes();
      WriteTorchZip(dir.File("huge.pt"), "huge", pkl, {{"0", std::vector<uint8_t>(static_cast<size_t>(es), 0)}});
      ValuePtr root;
      try {
        root = LoadTorchFile(dir.File("huge.pt")).root;
      } catch (const FormatError&) {
        continue;  // refusing it is fine
      }
      std::ostringstream out;
      PrintValue(out, *root);
      try {
        ValueToJson(*root);
        ADD_FAILURE() << "rendered the SHA-256 of " << n << " elements";
      } catch (const FormatError& e) {
        EXPECT_NE(std::string(e.what()).find("too large"), std::string::npos) << e.what();
      }
    }
  }
}

}  // namespace
}  // namespace uckpt::test
