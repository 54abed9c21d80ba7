// The pickle reader (pickle_reader.h): the virtual machine's loop and one
// handler per opcode group (its globals and calls: pickle_calls.cc).
#include "format/pickle_reader.h"

#include <atomic>
#include <bit>
#include <cmath>
#include <cstring>
#include <unordered_map>
#include <unordered_set>

#include "format/error.h"
#include "format/pickle_machine.h"
#include "format/pickle_opcodes.h"

namespace uckpt {
namespace pickle_vm {
namespace {

// Appends code point `cp` to `out` as UTF-8 (surrogates passed through, as
// Python's "surrogatepass" does).
void AppendUtf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

// Normalizes little-endian two's complement bytes into an int value.
ValuePtr IntFromBytes(const uint8_t* p, size_t n) {
  auto v = Value::Int(0);
  if (n == 0) return v;
  // Drop redundant sign-extension bytes.
  while (n > 1 && ((p[n - 1] == 0x00 && !(p[n - 2] & 0x80)) || (p[n - 1] == 0xFF && (p[n - 2] & 0x80)))) --n;
  if (n <= 8) {
    uint64_t u = 0;
    for (size_t k = 0; k < n; ++k) u |= uint64_t{p[k]} << (8 * k);
    if (n < 8 && (p[n - 1] & 0x80)) u |= ~uint64_t{0} << (8 * n);
    v->i = static_cast<int64_t>(u);
  } else {
    v->big.assign(p, p + n);
  }
  return v;
}

// Parses a decimal integer of any size (text opcodes INT / LONG).
// Python refuses decimal integers of more than 4300 digits (its
// int_max_str_digits); so do we, which also keeps this quadratic loop cheap.
constexpr size_t kMaxDecimalDigits = 4300;

ValuePtr IntFromDecimal(std::string text, size_t max_bytes) {
  if (!text.empty() && (text.back() == 'L')) text.pop_back();
  bool neg = false;
  size_t k = 0;
  if (k < text.size() && (text[k] == '-' || text[k] == '+')) neg = text[k++] == '-';
  if (k == text.size() || text.size() - k > kMaxDecimalDigits) return nullptr;
  std::vector<uint8_t> mag{0};
  for (; k < text.size(); ++k) {
    if (text[k] < '0' || text[k] > '9') return nullptr;
    uint32_t carry = static_cast<uint32_t>(text[k] - '0');
    for (auto& b : mag) {
      uint32_t cur = b * 10u + carry;
      b = static_cast<uint8_t>(cur & 0xFF);
      carry = cur >> 8;
    }
    if (carry) mag.push_back(static_cast<uint8_t>(carry));
    if (mag.size() > max_bytes) return nullptr;
  }
  mag.push_back(0);  // room for the sign bit
  if (neg) {
    for (auto& b : mag) b = static_cast<uint8_t>(~b);
    for (auto& b : mag)
      if (++b != 0) break;
  }
  return IntFromBytes(mag.data(), mag.size());
}

}  // namespace

// ---- The VM loop and one handler per opcode group ---------------------------
//
// Run() looks each byte up in pickle::kOpcodeTable and hands it to its group's
// handler, which switches on the opcode. Adding an opcode to a group means a
// table entry and a case in that group's handler; a table entry without one
// fails loudly (NoHandler) instead of being skipped.

ValuePtr Machine::Run() {
  using pickle::Group;
  while (true) {
    op_pos_ = pos_;
    const uint8_t op = U8();
    const pickle::OpInfo* info = pickle::FindOpcode(op);
    if (!info) UnknownOpcode(op);
    switch (info->group) {
      case Group::kFraming:
        if (op == pickle::kStop) return Stop();
        Framing(op);
        break;
      case Group::kStack: StackOp(op); break;
      case Group::kConstant: Constant(op); break;
      case Group::kInteger: Integer(op); break;
      case Group::kFloat: Float(op); break;
      case Group::kString: String(op); break;
      case Group::kContainer: Container(op); break;
      case Group::kObject: Object(op); break;
      case Group::kMemo: Memo(op); break;
      case Group::kPersistent: Persistent(op); break;
      // Both would need Python-side state (the copyreg registry, buffers
      // handed to the unpickler) that a torch file cannot carry.
      case Group::kExtension: Fail("extension-registry opcodes (EXT1/2/4) are not supported");
      case Group::kBuffer: Fail("out-of-band buffers (protocol 5) are not supported");
    }
  }
}

void Machine::UnknownOpcode(uint8_t op) const {
  char hex[8];
  std::snprintf(hex, sizeof hex, "0x%02x", op);
  Fail(std::string("unknown opcode ") + hex);
}

void Machine::NoHandler(uint8_t op) const {
  Fail("opcode " + std::string(pickle::FindOpcode(op)->name) + " has no handler in its group (a uckpt bug)");
}

// STOP: the top of the stack is the result; check its shape before handing it out.
ValuePtr Machine::Stop() {
  ValuePtr result = Pop();
  stack_.assign(1, result);
  CheckShape();
  if (strict_) CheckStrictResult();
  done_ = true;
  return result;
}

void Machine::Framing(uint8_t op) {
  switch (op) {
    case pickle::kProto:
      if (U8() > pickle::kHighestProtocol) Fail("unsupported pickle protocol");
      return;
    case pickle::kFrame: Take(8); return;  // a length hint only
    default: NoHandler(op);
  }
}

void Machine::StackOp(uint8_t op) {
  switch (op) {
    case pickle::kMark: marks_.push_back(stack_.size()); return;
    case pickle::kPop:  // pops the mark when nothing is above it, like Python
      if (stack_.size() > Base()) stack_.pop_back();
      else if (!marks_.empty()) marks_.pop_back();
      else Fail("POP on an empty stack");
      return;
    case pickle::kPopMark: PopMark(); return;
    case pickle::kDup: Push(Top()); return;
    default: NoHandler(op);
  }
}

void Machine::Constant(uint8_t op) {
  switch (op) {
    case pickle::kNone: Push(Value::None()); return;
    case pickle::kNewTrue: Push(Value::Bool(true)); return;
    case pickle::kNewFalse: Push(Value::Bool(false)); return;
    default: NoHandler(op);
  }
}

void Machine::Integer(uint8_t op) {
  switch (op) {
    case pickle::kBinInt1: Push(Value::Int(U8())); return;
    case pickle::kBinInt2: {
      const uint8_t* p = Take(2);
      Push(Value::Int(p[0] | (p[1] << 8)));
      return;
    }
    case pickle::kBinInt: Push(Value::Int(static_cast<int32_t>(U32()))); return;
    case pickle::kLong1: {
      size_t n = U8();
      Push(IntFromBytes(Take(n), n));
      return;
    }
    case pickle::kLong4: {
      int32_t n = static_cast<int32_t>(U32());
      if (n < 0) Fail("negative LONG4 length");
      if (static_cast<size_t>(n) > limits_.max_int_bytes)
        Fail("integer of " + std::to_string(n) + " bytes exceeds the limit");
      Push(IntFromBytes(Take(static_cast<size_t>(n)), static_cast<size_t>(n)));
      return;
    }
    case pickle::kInt: {  // text; protocol 0 wrote bools as INT 01 / 00
      std::string t = Line();
      if (t == "01" || t == "00") return Push(Value::Bool(t == "01"));
      auto v = IntFromDecimal(t, limits_.max_int_bytes);
      if (!v) Fail("bad or over-long INT text");
      return Push(v);
    }
    case pickle::kLong: {
      auto v = IntFromDecimal(Line(), limits_.max_int_bytes);
      if (!v) Fail("bad or over-long LONG text");
      return Push(v);
    }
    default: NoHandler(op);
  }
}

void Machine::Float(uint8_t op) {
  switch (op) {
    case pickle::kBinFloat: {  // big-endian
      const uint8_t* p = Take(8);
      uint64_t u = 0;
      for (int k = 0; k < 8; ++k) u = (u << 8) | p[k];
      return Push(Value::Float(std::bit_cast<double>(u)));
    }
    case pickle::kFloat: {  // text
      std::string t = Line();
      char* end = nullptr;
      double d = std::strtod(t.c_str(), &end);
      if (t.empty() || end != t.c_str() + t.size()) Fail("bad FLOAT text");
      return Push(Value::Float(d));
    }
    default: NoHandler(op);
  }
}

void Machine::String(uint8_t op) {
  switch (op) {
    case pickle::kBinUnicode: return Push(Value::Str(Bytes(U32())));
    case pickle::kShortBinUnicode: return Push(Value::Str(Bytes(U8())));
    case pickle::kBinUnicode8: return Push(Value::Str(Bytes(U64())));
    // Python 2 str: read as text, as torch.load's default encoding does.
    case pickle::kBinString: return Push(Value::Str(Bytes(U32())));
    case pickle::kShortBinString: return Push(Value::Str(Bytes(U8())));
    case pickle::kBinBytes: return Push(Value::Bytes(Bytes(U32())));
    case pickle::kShortBinBytes: return Push(Value::Bytes(Bytes(U8())));
    case pickle::kBinBytes8: return Push(Value::Bytes(Bytes(U64())));
    case pickle::kByteArray8: {
      auto v = Value::Bytes(Bytes(U64()));
      v->kind = Kind::kByteArray;
      return Push(v);
    }
    case pickle::kString: return Push(Value::Str(QuotedString(Line())));
    case pickle::kUnicode: return Push(Value::Str(RawUnicode(Line())));
    default: NoHandler(op);
  }
}

namespace {
int HexDigit(char h) {
  return (h >= '0' && h <= '9')   ? h - '0'
         : (h >= 'a' && h <= 'f') ? h - 'a' + 10
         : (h >= 'A' && h <= 'F') ? h - 'A' + 10
                                  : -1;
}
}  // namespace

// STRING's argument: a quoted Python 2 literal.
std::string Machine::QuotedString(const std::string& t) {
  if (t.size() < 2 || (t.front() != '\'' && t.front() != '"') || t.back() != t.front()) Fail("bad STRING quoting");
  std::string out;
  for (size_t k = 1; k + 1 < t.size(); ++k) {
    char c = t[k];
    if (c != '\\' || k + 2 >= t.size()) {
      out.push_back(c);
      continue;
    }
    char e = t[++k];
    switch (e) {
      case 'n': out.push_back('\n'); break;
      case 't': out.push_back('\t'); break;
      case 'r': out.push_back('\r'); break;
      case '0': out.push_back('\0'); break;
      case 'x':  // two hex digits, as Python requires
        if (k + 2 >= t.size() - 1 || HexDigit(t[k + 1]) < 0 || HexDigit(t[k + 2]) < 0) Fail("bad \\x escape in STRING");
        out.push_back(static_cast<char>(HexDigit(t[k + 1]) * 16 + HexDigit(t[k + 2])));
        k += 2;
        break;
      default: out.push_back(e);
    }
  }
  return out;
}

// UNICODE's argument: raw-unicode-escape text (only \u and \U are escapes;
// every other byte is the code point of its value).
std::string Machine::RawUnicode(const std::string& t) {
  std::string out;
  for (size_t k = 0; k < t.size(); ++k) {
    uint8_t c = static_cast<uint8_t>(t[k]);
    if (c == '\\' && k + 1 < t.size() && (t[k + 1] == 'u' || t[k + 1] == 'U')) {
      size_t n = t[k + 1] == 'u' ? 4 : 8;
      if (k + 2 + n > t.size()) Fail("bad \\u escape");
      uint32_t cp = 0;
      for (size_t j = 0; j < n; ++j) {
        int d = HexDigit(t[k + 2 + j]);
        if (d < 0) Fail("bad \\u escape");
        cp = cp * 16 + static_cast<uint32_t>(d);
      }
      if (cp > 0x10FFFF) Fail("code point out of range");
      AppendUtf8(out, cp);
      k += 1 + n;
    } else {
      AppendUtf8(out, c);
    }
  }
  return out;
}

// Making tuples, lists, dicts and sets.
void Machine::Container(uint8_t op) {
  switch (op) {
    case pickle::kEmptyTuple: return Push(Value::Tuple());
    case pickle::kTuple1: {
      auto a = Pop();
      return Push(Value::Tuple({a}));
    }
    case pickle::kTuple2: {
      auto b = Pop(), a = Pop();
      return Push(Value::Tuple({a, b}));
    }
    case pickle::kTuple3: {
      auto c = Pop(), b = Pop(), a = Pop();
      return Push(Value::Tuple({a, b, c}));
    }
    case pickle::kTuple: return Push(Value::Tuple(PopMark()));
    case pickle::kEmptyList: return Push(Value::List());
    case pickle::kList: return Push(Value::List(PopMark()));
    case pickle::kEmptyDict: return Push(Value::Dict());
    case pickle::kDict: {
      auto items = PopMark();
      if (items.size() % 2) Fail("DICT with an odd number of items");
      auto d = Value::Dict();
      for (size_t k = 0; k < items.size(); k += 2) SetItem(*d, items[k], items[k + 1]);
      return Push(d);
    }
    case pickle::kEmptySet: return Push(MakeSet(Kind::kSet, {}));
    case pickle::kFrozenSet: return Push(MakeSet(Kind::kFrozenSet, PopMark()));
    default: return Fill(op);
  }
}

// Adding to the container on top of the stack.
void Machine::Fill(uint8_t op) {
  switch (op) {
    case pickle::kAddItems: {
      auto items = PopMark();
      auto& s = Top();
      if (s->kind != Kind::kSet) Fail("ADDITEMS on a " + KindName(*s));
      for (auto& it : items) s->items.push_back(std::move(it));
      return;
    }
    case pickle::kAppend: {
      auto item = Pop();
      return Append(*Top(), std::move(item));
    }
    case pickle::kAppends: {
      auto items = PopMark();
      auto& target = *Top();
      for (auto& it : items) Append(target, std::move(it));
      return;
    }
    case pickle::kSetItem: {
      auto v = Pop(), k = Pop();
      return SetItem(*Top(), std::move(k), std::move(v));
    }
    case pickle::kSetItems: {
      auto items = PopMark();
      if (items.size() % 2) Fail("SETITEMS with an odd number of items");
      auto& target = *Top();
      for (size_t k = 0; k < items.size(); k += 2) SetItem(target, items[k], items[k + 1]);
      return;
    }
    default: NoHandler(op);
  }
}

// Globals, calls and BUILD. No opcode here runs anything: MakeGlobal names a
// global (strict mode checks the name), Call models known builders.
void Machine::Object(uint8_t op) {
  switch (op) {
    case pickle::kGlobal: {
      std::string module = Line(), name = Line();
      return Push(MakeGlobal(module, name));
    }
    case pickle::kStackGlobal: {
      auto name = Pop(), module = Pop();
      if (module->kind != Kind::kStr || name->kind != Kind::kStr) Fail("STACK_GLOBAL needs two strings");
      return Push(MakeGlobal(module->s, name->s));
    }
    case pickle::kReduce: {
      auto args = Pop();
      auto callable = Pop();
      return Push(Call(callable, args));
    }
    case pickle::kInst: {  // module, name; args up to the mark
      std::string module = Line(), name = Line();
      auto args = Value::Tuple(PopMark());
      return Push(Call(MakeGlobal(module, name), args));
    }
    case pickle::kObj: {  // class and args up to the mark
      auto items = PopMark();
      if (items.empty()) Fail("OBJ without a class");
      auto cls = items.front();
      items.erase(items.begin());
      return Push(Call(cls, Value::Tuple(std::move(items))));
    }
    case pickle::kBuild: {
      auto state = Pop();
      return Build(*Top(), std::move(state));
    }
    default: return NewObject(op);
  }
}

// NEWOBJ / NEWOBJ_EX: cls.__new__(cls, *args[, **kwargs]) becomes an inert
// object; strict mode still refuses getattr as the class.
void Machine::NewObject(uint8_t op) {
  switch (op) {
    case pickle::kNewObj: {
      auto args = Pop();
      auto cls = Pop();
      if (cls->kind != Kind::kGlobal || args->kind != Kind::kTuple) Fail("NEWOBJ needs a class and a tuple");
      if (strict_ && cls->s == "builtins.getattr") CheckStrictGetattr(Value::Tuple());
      return Push(Value::Object(cls->s, args, true));
    }
    case pickle::kNewObjEx: {
      auto kwargs = Pop(), args = Pop(), cls = Pop();
      if (cls->kind != Kind::kGlobal || args->kind != Kind::kTuple || !kwargs->is_dict())
        Fail("NEWOBJ_EX needs a class, a tuple and a dict");
      if (strict_ && cls->s == "builtins.getattr") CheckStrictGetattr(Value::Tuple());
      auto v = Value::Object(cls->s, args, true);
      if (!kwargs->entries.empty()) v->kwargs = kwargs;
      return Push(v);
    }
    default: NoHandler(op);
  }
}

void Machine::Memo(uint8_t op) {
  switch (op) {
    case pickle::kBinPut: return Put(U8());
    case pickle::kLongBinPut: return Put(U32());
    case pickle::kPut: return Put(LineIndex("bad PUT index"));
    case pickle::kMemoize: return Put(memo_.size());
    case pickle::kBinGet: return Push(Get(U8()));
    case pickle::kLongBinGet: return Push(Get(U32()));
    case pickle::kGet: return Push(Get(LineIndex("bad GET index")));
    default: NoHandler(op);
  }
}

// The decimal memo index of PUT / GET.
uint64_t Machine::LineIndex(const char* error) {
  std::string t = Line();
  char* end = nullptr;
  unsigned long long idx = std::strtoull(t.c_str(), &end, 10);
  if (t.empty() || end != t.c_str() + t.size()) Fail(error);
  return idx;
}

// Persistent ids are how torch refers to storages; the loader resolves them.
void Machine::Persistent(uint8_t op) {
  ValuePtr pid;
  switch (op) {
    case pickle::kBinPersId: pid = Pop(); break;
    case pickle::kPersId: pid = Value::Str(Line()); break;
    default: NoHandler(op);
  }
  if (!load_) Fail("persistent id found but no loader given");
  Push(load_(pid));
}

}  // namespace pickle_vm

namespace {
std::atomic<PicklePolicy> g_default_policy{PicklePolicy::kStrict};
}

PicklePolicy DefaultPicklePolicy() { return g_default_policy.load(std::memory_order_relaxed); }
void SetDefaultPicklePolicy(PicklePolicy policy) { g_default_policy.store(policy, std::memory_order_relaxed); }

ValuePtr ReadPickle(std::span<const uint8_t> data, const std::string& where, const PersistentLoader& persistent_load,
                    const PickleLimits& limits, PicklePolicy policy) {
  pickle_vm::Machine m(data, where, persistent_load, limits, policy);
  return m.Run();
}

}  // namespace uckpt
