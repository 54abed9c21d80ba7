// Walks format/pickle_opcodes.h: the table matches the pickle format (as
// Python's pickletools describes it), the reader reads or refuses every
// opcode with an error and never crashes, the writer emits only what the
// table allows, and the fuzz dictionary's pickle tokens are real opcodes.
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include "format/error.h"
#include "format/pickle_opcodes.h"
#include "format/pickle_reader.h"
#include "format/pickle_writer.h"
#include "test_support.h"

namespace uckpt::test {
namespace {

using pickle::Arg;
using pickle::kOpcodeTable;
using pickle::OpInfo;

// ---- A table-driven disassembler ---------------------------------------------

struct Op {
  size_t offset;
  const OpInfo* info;
};

// The opcodes of `p` in order, found with the table's argument kinds only.
// Fails the test (and returns what it has) on an unknown byte or a cut argument.
std::vector<Op> Disassemble(const std::string& p) {
  std::vector<Op> ops;
  size_t pos = 0;
  auto le = [&](size_t at, size_t n) {
    uint64_t v = 0;
    for (size_t k = 0; k < n; ++k) v |= uint64_t{static_cast<uint8_t>(p[at + k])} << (8 * k);
    return v;
  };
  while (pos < p.size()) {
    const OpInfo* info = pickle::FindOpcode(static_cast<uint8_t>(p[pos]));
    if (!info) {
      ADD_FAILURE() << "byte " << int(static_cast<uint8_t>(p[pos])) << " at " << pos << " is no opcode";
      return ops;
    }
    ops.push_back({pos, info});
    pos += 1;
    const size_t fixed = pickle::FixedArgSize(info->arg);
    if (pos + fixed > p.size()) {
      ADD_FAILURE() << info->name << " at " << ops.back().offset << " is cut short";
      return ops;
    }
    uint64_t extra = pickle::IsLengthPrefixed(info->arg) ? le(pos, fixed) : 0;
    pos += fixed;
    for (int line = 0; line < pickle::ArgLines(info->arg); ++line) {
      size_t nl = p.find('\n', pos);
      if (nl == std::string::npos) {
        ADD_FAILURE() << info->name << " at " << ops.back().offset << " has no newline";
        return ops;
      }
      pos = nl + 1;
    }
    if (extra > p.size() - pos) {
      ADD_FAILURE() << info->name << " at " << ops.back().offset << " runs past the end";
      return ops;
    }
    pos += extra;
  }
  return ops;
}

// ---- The table against Python's own description --------------------------------

// pickletools' name for each argument kind.
const char* PickletoolsArgName(Arg a) {
  switch (a) {
    case Arg::kNone: return "None";
    case Arg::kU1: return "uint1";
    case Arg::kU2: return "uint2";
    case Arg::kU4: return "uint4";
    case Arg::kU8: return "uint8";
    case Arg::kI4: return "int4";
    case Arg::kF8: return "float8";
    case Arg::kLong1: return "long1";
    case Arg::kLong4: return "long4";
    case Arg::kStr1: return "string1";
    case Arg::kStr4: return "string4";
    case Arg::kBytes1: return "bytes1";
    case Arg::kBytes4: return "bytes4";
    case Arg::kBytes8: return "bytes8";
    case Arg::kByteArray8: return "bytearray8";
    case Arg::kUtf8_1: return "unicodestring1";
    case Arg::kUtf8_4: return "unicodestring4";
    case Arg::kUtf8_8: return "unicodestring8";
    case Arg::kDecimalLine: return "decimalnl_short";
    case Arg::kLongLine: return "decimalnl_long";
    case Arg::kFloatLine: return "floatnl";
    case Arg::kQuotedLine: return "stringnl";
    case Arg::kRawUnicodeLine: return "unicodestringnl";
    case Arg::kLine: return "stringnl_noescape";
    case Arg::kTwoLines: return "stringnl_noescape_pair";
  }
  return "?";
}

TEST(OpcodeTable, MatchesPythonPickletools) {
  FILE* py = ::popen(
      "/usr/bin/python3 -c \"import pickletools\n"
      "for o in pickletools.opcodes: print(o.name, ord(o.code), o.arg.name if o.arg else None, o.proto)\" "
      "2>/dev/null",
      "r");
  ASSERT_NE(py, nullptr);
  std::string out;
  char buf[4096];
  for (size_t n; (n = std::fread(buf, 1, sizeof buf, py)) > 0;) out.append(buf, n);
  if (::pclose(py) != 0 || out.empty()) GTEST_SKIP() << "no /usr/bin/python3 with pickletools";

  std::map<std::string, std::string> python;  // name -> "code arg proto"
  std::istringstream lines(out);
  for (std::string name, rest; lines >> name && std::getline(lines, rest);) python[name] = rest.substr(1);
  EXPECT_EQ(python.size(), std::size(kOpcodeTable));
  for (const OpInfo& op : kOpcodeTable) {
    std::string ours = std::to_string(op.code) + " " + PickletoolsArgName(op.arg) + " " + std::to_string(op.proto);
    auto it = python.find(std::string(op.name));
    if (it == python.end()) {
      ADD_FAILURE() << op.name << " is not a pickletools opcode";
      continue;
    }
    EXPECT_EQ(ours, it->second) << op.name << ": ours (code arg proto) vs pickletools";
  }
}

TEST(OpcodeTable, LookupAndArgumentKinds) {
  for (int b = 0; b < 256; ++b) {
    const OpInfo* info = pickle::FindOpcode(static_cast<uint8_t>(b));
    if (info) {
      EXPECT_EQ(info->code, b) << info->name;
    }
  }
  EXPECT_EQ(pickle::FindOpcode(0xff), nullptr);
  EXPECT_EQ(pickle::FindOpcode(pickle::kEmptyDict)->name, "EMPTY_DICT");
  for (const OpInfo& op : kOpcodeTable) {
    // An argument is a fixed field, a length field, lines, or nothing.
    const bool fixed = pickle::FixedArgSize(op.arg) > 0, lines = pickle::ArgLines(op.arg) > 0;
    EXPECT_EQ(op.arg == Arg::kNone, !fixed && !lines) << op.name;
    EXPECT_FALSE(fixed && lines) << op.name;
    if (pickle::IsLengthPrefixed(op.arg)) {
      EXPECT_TRUE(fixed) << op.name;
    }
  }
}

// ---- Reader: every opcode read or refused -----------------------------------------

// A valid argument of each kind; memo indices and persistent ids are 1.
std::string SampleArg(const OpInfo& op) {
  PickleBuilder b;
  switch (op.arg) {
    case Arg::kNone: break;
    case Arg::kU1: b.U8(op.code == pickle::kProto ? 2 : 1); break;
    case Arg::kU2: b.U8(1).U8(0); break;
    case Arg::kU4:
    case Arg::kI4: b.U32(1); break;
    case Arg::kU8: b.U32(1).U32(0); break;
    case Arg::kF8: b.Raw(std::string("\x3f\xf8\0\0\0\0\0\0", 8)); break;  // 1.5
    case Arg::kLong1:
    case Arg::kStr1:
    case Arg::kBytes1:
    case Arg::kUtf8_1: b.U8(1).Raw("a"); break;
    case Arg::kLong4:
    case Arg::kStr4:
    case Arg::kBytes4:
    case Arg::kUtf8_4: b.U32(1).Raw("a"); break;
    case Arg::kBytes8:
    case Arg::kByteArray8:
    case Arg::kUtf8_8: b.U32(1).U32(0).Raw("a"); break;
    case Arg::kDecimalLine: b.Line("1"); break;
    case Arg::kLongLine: b.Line("1L"); break;
    case Arg::kFloatLine: b.Line("1.5"); break;
    case Arg::kQuotedLine: b.Line("'a\\x41'"); break;
    case Arg::kRawUnicodeLine: b.Line("a\\u00e9"); break;
    case Arg::kLine: b.Line("1"); break;
    case Arg::kTwoLines: b.Line("collections").Line("OrderedDict"); break;
  }
  return b.bytes();
}

// What must be on the stack before `op` for it to be valid (in strict mode:
// only allowed globals). Opcodes that take nothing need nothing.
PickleBuilder Before(pickle::Opcode op) {
  using namespace pickle;
  PickleBuilder b;
  auto od = [&]() -> PickleBuilder& { return b.Global("collections", "OrderedDict"); };
  switch (op) {
    case kPop:
    case kDup:
    case kBinPersId:
    case kTuple1:
    case kPut:
    case kBinPut:
    case kLongBinPut:
    case kMemoize:
    case kStop: b.Op(kNone); break;
    case kTuple2: b.Op(kNone).Op(kNone); break;
    case kTuple3: b.Op(kNone).Op(kNone).Op(kNone); break;
    case kPopMark:
    case kList:
    case kTuple:
    case kDict:
    case kInst: b.Mark(); break;
    case kFrozenSet: b.Mark().Op(kNone); break;
    case kGet:
    case kBinGet:
    case kLongBinGet: b.Op(kNone).Put(1); break;
    case kAppend: b.Op(kEmptyList).Op(kNone); break;
    case kAppends: b.Op(kEmptyList).Mark().Op(kNone); break;
    case kAddItems: b.Op(kEmptySet).Mark().Op(kNone); break;
    case kSetItem: b.Op(kEmptyDict).Str("k").Op(kNone); break;
    case kSetItems: b.Op(kEmptyDict).Mark().Str("k").Op(kNone); break;
    case kReduce:
    case kNewObj: od().Op(kEmptyTuple); break;
    case kNewObjEx: od().Op(kEmptyTuple).Op(kEmptyDict); break;
    case kObj:
      b.Mark();
      od();
      break;
    case kBuild: od().Op(kEmptyTuple).Op(kReduce).Op(kEmptyDict); break;
    case kStackGlobal: b.Str("collections").Str("OrderedDict"); break;
    default: break;
  }
  return b;
}

// Resolves every persistent id to an int, so that PERSID / BINPERSID can run.
ValuePtr AnyPid(const ValuePtr&) { return Value::Int(0); }

std::string ReadError(const std::string& p, PicklePolicy policy) {
  try {
    ReadPickle({reinterpret_cast<const uint8_t*>(p.data()), p.size()}, "t.pkl", AnyPid, {}, policy);
  } catch (const FormatError& e) {
    return e.what();
  }
  return "";
}

TEST(OpcodeTable, ReaderReadsOrRefusesEveryOpcode) {
  size_t handled = 0, refused = 0;
  for (const OpInfo& op : kOpcodeTable) {
    PickleBuilder p = PickleBuilder().Proto(2).Raw(Before(op.code).bytes());
    const size_t at = p.bytes().size();
    p.Op(op.code).Raw(SampleArg(op));
    if (op.code != pickle::kStop) p.Op(pickle::kNone).Stop();
    for (PicklePolicy policy : {PicklePolicy::kStrict, PicklePolicy::kLenient}) {
      const std::string err = ReadError(p.bytes(), policy);
      if (!pickle::ReaderRefuses(op.group)) {
        EXPECT_EQ(err, "") << op.name << " is in a group the reader handles";
        continue;
      }
      // Refused: said so, at the opcode itself.
      const std::string where = "t.pkl: pickle offset " + std::to_string(at) + ": ";
      EXPECT_EQ(err.rfind(where, 0), 0u) << op.name << ": " << err;
      EXPECT_NE(err.find("not supported"), std::string::npos) << op.name << ": " << err;
    }
    (pickle::ReaderRefuses(op.group) ? refused : handled) += 1;
  }
  EXPECT_EQ(handled + refused, 68u);
  EXPECT_EQ(refused, 5u);  // EXT1/2/4, NEXT_BUFFER, READONLY_BUFFER
}

TEST(OpcodeTable, ReaderNamesEveryUndefinedByte) {
  for (int b = 0; b < 256; ++b) {
    if (pickle::FindOpcode(static_cast<uint8_t>(b))) continue;
    char hex[8];
    std::snprintf(hex, sizeof hex, "0x%02x", b);
    std::string p = PickleBuilder().Proto(2).Op(pickle::kNone).U8(static_cast<uint8_t>(b)).Stop().bytes();
    EXPECT_EQ(ReadError(p, PicklePolicy::kLenient), std::string("t.pkl: pickle offset 3: unknown opcode ") + hex);
  }
}

// Every opcode with its argument cut anywhere: an error, never a crash or an
// over-read (this runs under ASan too).
TEST(OpcodeTable, ReaderRefusesEveryCutArgument) {
  for (const OpInfo& op : kOpcodeTable) {
    const std::string whole = PickleBuilder().Proto(2).Raw(Before(op.code).bytes()).Op(op.code).bytes() + SampleArg(op);
    const size_t arg_start = whole.size() - SampleArg(op).size();
    for (size_t cut = arg_start; cut < whole.size(); ++cut) {
      std::string p = whole.substr(0, cut);
      // Heap copy of exactly the cut bytes, so ASan sees a read past them.
      std::vector<uint8_t> exact(p.begin(), p.end());
      try {
        ReadPickle(exact, "t.pkl", AnyPid, {}, PicklePolicy::kLenient);
        ADD_FAILURE() << op.name << " cut to " << cut - arg_start << " argument bytes was accepted";
      } catch (const FormatError&) {}
    }
  }
}

// ---- Writer: only what the table allows ---------------------------------------------

// One value of every kind the writer handles, sized to reach every form it
// writes: ints of each width and a big one (LONG4), more than 1000 items
// (APPENDS / SETITEMS batches), more than 256 memo entries with sharing after
// them (LONG_BINPUT / LONG_BINGET).
ValuePtr EverythingTheWriterWrites() {
  auto storage = Storage::Owned(std::vector<uint8_t>(16), DType::kFloat32);
  auto tensor = [&](DType dtype, bool attrs) {
    Tensor t;
    t.storage = storage;
    t.dtype = dtype;
    t.shape = {2, 2};
    t.stride = {2, 1};
    t.requires_grad = true;
    if (attrs) t.attrs = Value::Dict();
    return Value::FromTensor(std::move(t));
  };
  auto param = std::make_shared<Value>();
  param->kind = Kind::kParameter;
  param->tensor = tensor(DType::kFloat32, false)->tensor;
  param->state = Value::Dict();
  auto bytes_value = Value::Bytes(std::string("\x00\xff", 2));
  auto bytearray = Value::Bytes("x");
  bytearray->kind = Kind::kByteArray;
  auto set = std::make_shared<Value>();
  set->kind = Kind::kSet;
  set->items = {Value::Int(1), Value::Int(2)};
  auto device = std::make_shared<Value>();
  device->kind = Kind::kTorchDevice;
  device->s = "cuda:1";
  auto ordered = Value::Dict(true);
  ordered->state = Value::Dict();
  auto big = Value::Int(0);
  big->big.assign(300, 0x11);
  auto object = Value::Object("m.C", Value::Tuple(), true);
  object->state = Value::Dict();

  auto many = Value::List();
  for (int k = 0; k < 1100; ++k) many->items.push_back(Value::Str("s" + std::to_string(k)));
  many->items.push_back(many->items.back());  // memoized at an index > 255
  auto dict = Value::Dict();
  for (int k = 0; k < 1100; ++k) dict->set("k" + std::to_string(k), Value::Int(k));
  auto small_dict = Value::Dict();
  small_dict->set("one", Value::None());

  return Value::List({
      Value::None(),
      Value::Bool(true),
      Value::Bool(false),
      Value::Int(7),
      Value::Int(4000),
      Value::Int(-5),
      Value::Int(int64_t{1} << 40),
      big,
      Value::Float(0.5),
      Value::Str("text"),
      bytes_value,
      Value::Bytes(""),
      bytearray,
      Value::Tuple(),
      Value::Tuple({Value::None()}),
      Value::Tuple({Value::None(), Value::None()}),
      Value::Tuple({Value::None(), Value::None(), Value::None()}),
      Value::Tuple(many->items),
      Value::List({Value::None()}),
      many,
      dict,
      small_dict,
      ordered,
      set,
      Value::Size({2, 3}),
      device,
      tensor(DType::kFloat32, false),
      tensor(DType::kFloat32, true),
      param,
      object,
      Value::Object("m.D", Value::Tuple(), false),
  });
}

TEST(OpcodeTable, WriterEmitsOnlyWhatTheTableAllows) {
  const PickledValue out = PickleForTorch(EverythingTheWriterWrites());
  std::set<uint8_t> seen;
  for (const Op& op : Disassemble(out.pickle)) {
    seen.insert(op.info->code);
    EXPECT_TRUE(op.info->written) << "the writer emitted " << op.info->name << " at " << op.offset
                                  << ", which the table does not allow";
  }
  // The sample reaches every opcode the table lets the writer use, so that a
  // flag set for an opcode the writer no longer needs shows up here.
  for (const OpInfo& op : kOpcodeTable) {
    if (op.written) {
      EXPECT_TRUE(seen.count(op.code)) << op.name << " is allowed but the sample never needs it";
    }
  }
  // What it writes must load again.
  ASSERT_NO_THROW(ReadPickle(
      {reinterpret_cast<const uint8_t*>(out.pickle.data()), out.pickle.size()}, "t.pkl",
      [&](const ValuePtr&) {
        auto v = std::make_shared<Value>();
        v->kind = Kind::kStorage;
        v->storage = out.storages.at(0);
        return v;
      },
      {}, PicklePolicy::kLenient));
}

// The writer's opcodes are the torch.load(weights_only=True) subset, except
// LONG4 (pickle_writer.h): nothing else can hold an int of 256 bytes or more.
TEST(OpcodeTable, WrittenOpcodesAreTheWeightsOnlySubset) {
  for (const OpInfo& op : kOpcodeTable) {
    if (!op.written) continue;
    if (op.code == pickle::kLong4) {
      EXPECT_EQ(op.torch, pickle::Torch::kRefused);
      continue;
    }
    EXPECT_NE(op.torch, pickle::Torch::kRefused) << op.name << " is written but torch's weights_only loader refuses it";
    EXPECT_LE(op.proto, 2) << op.name << " is written in a protocol-2 pickle";
  }
}

// ---- The fuzz dictionary ---------------------------------------------------------

// libFuzzer token text ("\x80\x02", "\x0a") to bytes.
std::string Unescape(const std::string& s) {
  std::string out;
  for (size_t k = 0; k < s.size(); ++k) {
    if (s[k] == '\\' && k + 3 < s.size() && s[k + 1] == 'x') {
      out += static_cast<char>(std::stoi(s.substr(k + 2, 2), nullptr, 16));
      k += 3;
    } else if (s[k] == '\\' && k + 1 < s.size()) {
      out += s[++k];
    } else {
      out += s[k];
    }
  }
  return out;
}

// Tokens named after an opcode (GLOBAL_..., PROTO_...) must be whole opcodes
// with their arguments, starting with that opcode.
TEST(OpcodeTable, FuzzDictionaryTokensAreWholeOpcodes) {
  std::ifstream in(UCKPT_FUZZ_DICT);
  ASSERT_TRUE(in) << "cannot read " << UCKPT_FUZZ_DICT;
  size_t pickle_tokens = 0;
  for (std::string line; std::getline(in, line);) {
    size_t eq = line.find("=\"");
    if (line.empty() || line[0] == '#' || eq == std::string::npos) continue;
    const std::string name = line.substr(0, eq);
    const std::string token = Unescape(line.substr(eq + 2, line.size() - eq - 3));
    const OpInfo* named = nullptr;
    for (const OpInfo& op : kOpcodeTable)
      if (name.rfind(std::string(op.name) + "_", 0) == 0 && (!named || op.name.size() > named->name.size()))
        named = &op;
    if (!named) continue;
    ++pickle_tokens;
    auto ops = Disassemble(token);
    ASSERT_FALSE(ops.empty()) << name;
    EXPECT_EQ(ops[0].info, named) << name << " starts with " << ops[0].info->name;
  }
  EXPECT_GE(pickle_tokens, 10u) << "the dictionary's pickle tokens are no longer named after their opcode";
}

}  // namespace
}  // namespace uckpt::test
