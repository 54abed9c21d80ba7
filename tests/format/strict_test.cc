// Strict mode: every real checkpoint (torch fixtures, DeepSpeed's own ZeRO and
// universal folders, the reference GPT-2 run) loads; every hostile file is
// refused with a message naming the file and the global; getattr passes only
// in the one form DeepSpeed writes.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>

#include "format/error.h"
#include "format/strict_globals.h"
#include "format/torch_file.h"
#include "format/value_json.h"
#include "test_support.h"

namespace uckpt::test {
namespace {

namespace fs = std::filesystem;
const LoadOptions kStrict{.policy = PicklePolicy::kStrict};

ValuePtr ReadStrict(const std::string& pickle) {
  return ReadPickle({reinterpret_cast<const uint8_t*>(pickle.data()), pickle.size()}, "t.pkl", {}, {},
                    PicklePolicy::kStrict);
}
std::string StrictError(const std::string& pickle) {
  try {
    ReadStrict(pickle);
  } catch (const FormatError& e) {
    return e.what();
  }
  return "";
}

TEST(StrictFixtures, TorchFixturesLoadAndHostileOnesAreRefused) {
  size_t loaded = 0, refused = 0;
  for (const Fixture& fx : AllFixtures()) {
    SCOPED_TRACE(fx.path);
    if (fx.legacy) continue;  // refused in every mode (manifest_test)
    if (!fx.malicious) {
      TorchFile f = LoadTorchFile(fx.path, kStrict);
      // The same value as the lenient reader builds.
      auto diffs = JsonDiff(fx.entry()["expected"], ValueToJson(*f.root));
      EXPECT_TRUE(diffs.empty()) << DiffText(diffs);
      ++loaded;
      continue;
    }
    try {
      LoadTorchFile(fx.path, kStrict);
      ADD_FAILURE() << "strict mode accepted a malicious fixture";
    } catch (const FormatError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find(fx.path), std::string::npos) << what;
      // It names the first dangerous callable, as the manifest spells it
      // (__builtin__.eval) or renamed (builtins.eval).
      std::string want = fx.entry()["dangerous_callables"][0];
      std::string renamed = want.rfind("__builtin__.", 0) == 0 ? "builtins." + want.substr(12) : want;
      EXPECT_NE(what.find("strict mode refuses global " + renamed), std::string::npos) << what;
      ++refused;
    }
  }
  EXPECT_GE(loaded, 70u);
  EXPECT_EQ(refused, 10u);
}

// Every .pt file under the DeepSpeed and reference-run fixtures (ZeRO 1/2/3
// rank files, universal folders, re-sharded states, init weights).
TEST(StrictFixtures, DeepSpeedCheckpointsLoad) {
  size_t files = 0, with_deepspeed_classes = 0, with_getattr = 0;
  for (const char* sub : {"fixtures/deepspeed", "fixtures/refrun-gpt2"}) {
    const fs::path root = fs::path(SharedDir()) / sub;
    ASSERT_TRUE(fs::is_directory(root)) << root;
    for (const auto& e : fs::recursive_directory_iterator(root)) {
      if (!e.is_regular_file() || e.path().extension() != ".pt") continue;
      SCOPED_TRACE(e.path().string());
      TorchFile f;
      ASSERT_NO_THROW(f = LoadTorchFile(e.path().string(), kStrict));
      ++files;
      // Lenient and strict build the same tree.
      TorchFile g = LoadTorchFile(e.path().string(), {.policy = PicklePolicy::kLenient});
      const json a = ValueToJson(*f.root), b = ValueToJson(*g.root);
      EXPECT_EQ(a, b);
      const std::string text = a.dump();
      with_deepspeed_classes += text.find("deepspeed.") != std::string::npos;
      with_getattr += text.find("builtins.getattr") != std::string::npos;
    }
  }
  // The fixtures hold hundreds of files; the DeepSpeed classes and the
  // getattr(ZeroStageEnum, ...) call are really exercised.
  EXPECT_GE(files, 300u);
  EXPECT_GE(with_deepspeed_classes, 20u);
  EXPECT_GE(with_getattr, 20u);
}

TEST(StrictGetattr, OnlyZeroStageEnumMembers) {
  auto getattr = [](const std::string& cls_module, const std::string& cls, const std::string& attr) {
    return PickleBuilder()
        .Proto(2)
        .Global("__builtin__", "getattr")
        .Global(cls_module, cls)
        .Str(attr)
        .Op(pickle::kTuple2)
        .Op(pickle::kReduce)
        .Stop()
        .bytes();
  };
  // DeepSpeed's zero_stage.
  ValuePtr v = ReadStrict(getattr("deepspeed.runtime.zero.config", "ZeroStageEnum", "gradients"));
  ASSERT_EQ(v->kind, Kind::kObject);
  EXPECT_EQ(v->s, "builtins.getattr");
  // Another attribute of the same class, or another (allowed) class.
  EXPECT_NE(StrictError(getattr("deepspeed.runtime.zero.config", "ZeroStageEnum", "__class__"))
                .find("refuses global builtins.getattr(deepspeed.runtime.zero.config.ZeroStageEnum, '__class__')"),
            std::string::npos);
  EXPECT_NE(StrictError(getattr("collections", "OrderedDict", "fromkeys")).find("refuses global builtins.getattr"),
            std::string::npos);
  // getattr kept as a value (through the memo) instead of being called.
  std::string bare = PickleBuilder()
                         .Proto(2)
                         .Global("__builtin__", "getattr")
                         .Put(0)
                         .Op(pickle::kPop)
                         .Op(pickle::kEmptyList)
                         .Get(0)
                         .Op(pickle::kAppend)
                         .Stop()
                         .bytes();
  EXPECT_NE(StrictError(bare).find("refuses global builtins.getattr"), std::string::npos);
  EXPECT_NO_THROW(ReadPickle({reinterpret_cast<const uint8_t*>(bare.data()), bare.size()}, "t.pkl", {}, {},
                             PicklePolicy::kLenient));
  // NEWOBJ with getattr as the class.
  std::string newobj = PickleBuilder()
                           .Proto(2)
                           .Global("__builtin__", "getattr")
                           .Op(pickle::kEmptyTuple)
                           .Op(pickle::kNewObj)
                           .Stop()
                           .bytes();
  EXPECT_NE(StrictError(newobj).find("refuses global builtins.getattr"), std::string::npos);
}

TEST(StrictGlobals, RefusalNamesTheGlobalAsWrittenAndRenamed) {
  std::string p = PickleBuilder()
                      .Proto(2)
                      .Global("__builtin__", "eval")
                      .Str("1")
                      .Op(pickle::kTuple1)
                      .Op(pickle::kReduce)
                      .Stop()
                      .bytes();
  const std::string what = StrictError(p);
  EXPECT_NE(what.find("t.pkl"), std::string::npos) << what;
  EXPECT_NE(what.find("strict mode refuses global builtins.eval (written __builtin__.eval)"), std::string::npos)
      << what;
  // A global that is never called is refused as well: the name is enough.
  std::string bare = PickleBuilder().Proto(2).Global("os", "system").Stop().bytes();
  EXPECT_NE(StrictError(bare).find("refuses global os.system"), std::string::npos);
  // Allowed names build the same values as in lenient mode.
  std::string ok = PickleBuilder()
                       .Proto(2)
                       .Global("collections", "OrderedDict")
                       .Op(pickle::kEmptyTuple)
                       .Op(pickle::kReduce)
                       .Stop()
                       .bytes();
  EXPECT_EQ(ReadStrict(ok)->kind, Kind::kOrderedDict);
  std::string ds = PickleBuilder()
                       .Proto(2)
                       .Global("deepspeed.runtime.zero.config", "ZeroStageEnum")
                       .Int(2)
                       .Op(pickle::kTuple1)
                       .Op(pickle::kReduce)
                       .Stop()
                       .bytes();
  EXPECT_EQ(ReadStrict(ds)->kind, Kind::kObject);
}

// The list holds data types only: no module that can reach the system.
TEST(StrictGlobals, AllowListHoldsOnlyDataModules) {
  const auto list = StrictAllowList();
  EXPECT_GT(list.size(), 100u);
  const std::vector<std::string> prefixes = {"torch.",     "collections.",       "_codecs.encode",
                                             "deepspeed.", "argparse.Namespace", "numpy."};
  const std::vector<std::string> builtins = {"builtins.set", "builtins.frozenset", "builtins.bytes",
                                             "builtins.bytearray", "builtins.complex"};
  for (const auto& g : list) {
    bool ok = std::find(builtins.begin(), builtins.end(), g) != builtins.end();
    for (const auto& p : prefixes) ok = ok || g.rfind(p, 0) == 0;
    EXPECT_TRUE(ok) << g;
    for (const char* bad : {"os.", "sys.", "posix.", "nt.", "subprocess.", "pickle.", "torch.load", "torch.jit",
                            "torch.hub", "torch.ops", "torch.classes"})
      EXPECT_NE(g.rfind(bad, 0), 0u) << g;
  }
  for (const char* g : {"builtins.getattr", "builtins.eval", "builtins.exec", "builtins.__import__", "os.system",
                        "posix.system", "subprocess.Popen", "copyreg._reconstructor"})
    EXPECT_FALSE(StrictAllowsGlobal(g)) << g;
  EXPECT_TRUE(StrictAllowsGlobal("torch._utils._rebuild_tensor_v2"));
  EXPECT_TRUE(StrictAllowsGlobal("deepspeed.utils.tensor_fragment.fragment_address"));
}

// The process-wide default is strict; programs (the CLI) can switch it.
TEST(StrictDefault, DefaultIsStrictAndCanBeChanged) {
  ASSERT_EQ(DefaultPicklePolicy(), PicklePolicy::kStrict);
  TempDir dir;
  const std::string path = dir.File("bad.pt");
  WriteTorchZip(path, "bad",
                PickleBuilder()
                    .Proto(2)
                    .Global("os", "system")
                    .Str("true")
                    .Op(pickle::kTuple1)
                    .Op(pickle::kReduce)
                    .Stop()
                    .bytes());
  EXPECT_THROW(LoadTorchFile(path), FormatError);
  SetDefaultPicklePolicy(PicklePolicy::kLenient);
  ValuePtr root;
  EXPECT_NO_THROW(root = LoadTorchFile(path).root);
  SetDefaultPicklePolicy(PicklePolicy::kStrict);
  ASSERT_TRUE(root);
  EXPECT_EQ(root->s, "os.system");
  EXPECT_THROW(LoadTorchFile(path), FormatError);
}

}  // namespace
}  // namespace uckpt::test
