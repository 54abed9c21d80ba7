// The pickle opcodes of protocols 0-5: the one place in uckpt that spells
// their byte values. The reader dispatches through kOpcodeTable, the writer and
// the tests' pickle builder emit the named constants below, and the tests walk
// the table (every opcode read or refused; the writer only emits what the table
// allows). Facts from the pickle format as documented by CPython (pickletools).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace uckpt::pickle {

// Byte values. Unscoped so that a constant is usable wherever a byte is.
enum Opcode : uint8_t {
  // Protocol 0 (text) and 1 (binary forms of the same machine).
  kMark = '(',
  kStop = '.',
  kPop = '0',
  kPopMark = '1',
  kDup = '2',
  kFloat = 'F',
  kInt = 'I',
  kBinInt = 'J',
  kBinInt1 = 'K',
  kLong = 'L',
  kBinInt2 = 'M',
  kNone = 'N',
  kPersId = 'P',
  kBinPersId = 'Q',
  kReduce = 'R',
  kString = 'S',
  kBinString = 'T',
  kShortBinString = 'U',
  kUnicode = 'V',
  kBinUnicode = 'X',
  kAppend = 'a',
  kBuild = 'b',
  kGlobal = 'c',
  kDict = 'd',
  kEmptyDict = '}',
  kAppends = 'e',
  kGet = 'g',
  kBinGet = 'h',
  kInst = 'i',
  kLongBinGet = 'j',
  kList = 'l',
  kEmptyList = ']',
  kObj = 'o',
  kPut = 'p',
  kBinPut = 'q',
  kLongBinPut = 'r',
  kSetItem = 's',
  kTuple = 't',
  kEmptyTuple = ')',
  kSetItems = 'u',
  kBinFloat = 'G',
  // Protocol 2.
  kProto = 0x80,
  kNewObj = 0x81,
  kExt1 = 0x82,
  kExt2 = 0x83,
  kExt4 = 0x84,
  kTuple1 = 0x85,
  kTuple2 = 0x86,
  kTuple3 = 0x87,
  kNewTrue = 0x88,
  kNewFalse = 0x89,
  kLong1 = 0x8a,
  kLong4 = 0x8b,
  // Protocol 3.
  kBinBytes = 'B',
  kShortBinBytes = 'C',
  // Protocol 4.
  kShortBinUnicode = 0x8c,
  kBinUnicode8 = 0x8d,
  kBinBytes8 = 0x8e,
  kEmptySet = 0x8f,
  kAddItems = 0x90,
  kFrozenSet = 0x91,
  kNewObjEx = 0x92,
  kStackGlobal = 0x93,
  kMemoize = 0x94,
  kFrame = 0x95,
  // Protocol 5.
  kByteArray8 = 0x96,
  kNextBuffer = 0x97,
  kReadOnlyBuffer = 0x98,
};

// The highest protocol the reader understands (PROTO's argument).
inline constexpr int kHighestProtocol = 5;

// What follows the opcode byte in the stream. Integers are little-endian
// unless said otherwise; "line" arguments run to a '\n' that ends them.
enum class Arg : uint8_t {
  kNone,
  kU1,              // unsigned, 1 byte
  kU2,              // unsigned, 2 bytes
  kU4,              // unsigned, 4 bytes
  kU8,              // unsigned, 8 bytes
  kI4,              // signed, 4 bytes
  kF8,              // IEEE-754 double, 8 bytes, big-endian
  kLong1,           // 1-byte length, then that many bytes of two's complement
  kLong4,           // signed 4-byte length, then two's complement
  kStr1,            // Python 2 str: 1-byte length, then the bytes
  kStr4,            // Python 2 str: signed 4-byte length, then the bytes
  kBytes1,          // bytes: 1-byte length, then the bytes
  kBytes4,          // bytes: unsigned 4-byte length
  kBytes8,          // bytes: 8-byte length
  kByteArray8,      // bytearray: 8-byte length
  kUtf8_1,          // text: 1-byte length, then UTF-8
  kUtf8_4,          // text: unsigned 4-byte length, then UTF-8
  kUtf8_8,          // text: 8-byte length, then UTF-8
  kDecimalLine,     // decimal integer ("01"/"00" are True/False for INT)
  kLongLine,        // decimal integer, optionally ending in 'L'
  kFloatLine,       // decimal float as Python's repr writes it
  kQuotedLine,      // Python 2 string literal in quotes, with escapes
  kRawUnicodeLine,  // text with \uXXXX / \UXXXXXXXX escapes
  kLine,            // raw text (a persistent id)
  kTwoLines,        // module line, then name line
};

// How the reader treats an opcode; each group has one handler in the VM.
enum class Group : uint8_t {
  kFraming,     // PROTO, FRAME, STOP
  kStack,       // MARK, POP, POP_MARK, DUP
  kConstant,    // None, True, False
  kInteger,     // every int form
  kFloat,       // FLOAT, BINFLOAT
  kString,      // str, bytes and bytearray forms
  kContainer,   // tuples, lists, dicts, sets and adding to them
  kObject,      // globals, calls (REDUCE, NEWOBJ, INST, OBJ) and BUILD
  kMemo,        // PUT / GET forms, MEMOIZE
  kPersistent,  // PERSID, BINPERSID
  kExtension,   // EXT1/2/4: the copyreg extension registry; refused
  kBuffer,      // out-of-band buffers (protocol 5); refused
};

// Which torch.load(weights_only=True) unpicklers take an opcode.
enum class Torch : uint8_t {
  kRefused,  // none of them
  kNewer,    // torch 2.x (as of 2.11), not 1.13
  kAll,      // 1.13 and 2.x
};

struct OpInfo {
  Opcode code;
  std::string_view name;  // as CPython's pickletools names it
  Arg arg;
  uint8_t proto;  // the protocol that introduced it
  Group group;
  Torch torch;
  // PickleForTorch may emit it: the weights_only subset, plus LONG4, which
  // only ints of 256 bytes or more need (nothing else can express them).
  bool written;
};

// Every opcode of protocols 0-5, in the order of the constants above.
inline constexpr OpInfo kOpcodeTable[] = {
    // clang-format off
    {kMark,            "MARK",             Arg::kNone,           0, Group::kStack,      Torch::kAll,     true},
    {kStop,            "STOP",             Arg::kNone,           0, Group::kFraming,    Torch::kAll,     true},
    {kPop,             "POP",              Arg::kNone,           0, Group::kStack,      Torch::kRefused, false},
    {kPopMark,         "POP_MARK",         Arg::kNone,           1, Group::kStack,      Torch::kRefused, false},
    {kDup,             "DUP",              Arg::kNone,           0, Group::kStack,      Torch::kRefused, false},
    {kFloat,           "FLOAT",            Arg::kFloatLine,      0, Group::kFloat,      Torch::kRefused, false},
    {kInt,             "INT",              Arg::kDecimalLine,    0, Group::kInteger,    Torch::kRefused, false},
    {kBinInt,          "BININT",           Arg::kI4,             1, Group::kInteger,    Torch::kAll,     true},
    {kBinInt1,         "BININT1",          Arg::kU1,             1, Group::kInteger,    Torch::kAll,     true},
    {kLong,            "LONG",             Arg::kLongLine,       0, Group::kInteger,    Torch::kRefused, false},
    {kBinInt2,         "BININT2",          Arg::kU2,             1, Group::kInteger,    Torch::kAll,     true},
    {kNone,            "NONE",             Arg::kNone,           0, Group::kConstant,   Torch::kAll,     true},
    {kPersId,          "PERSID",           Arg::kLine,           0, Group::kPersistent, Torch::kRefused, false},
    {kBinPersId,       "BINPERSID",        Arg::kNone,           1, Group::kPersistent, Torch::kAll,     true},
    {kReduce,          "REDUCE",           Arg::kNone,           0, Group::kObject,     Torch::kAll,     true},
    {kString,          "STRING",           Arg::kQuotedLine,     0, Group::kString,     Torch::kRefused, false},
    {kBinString,       "BINSTRING",        Arg::kStr4,           1, Group::kString,     Torch::kRefused, false},
    {kShortBinString,  "SHORT_BINSTRING",  Arg::kStr1,           1, Group::kString,     Torch::kAll,     false},
    {kUnicode,         "UNICODE",          Arg::kRawUnicodeLine, 0, Group::kString,     Torch::kRefused, false},
    {kBinUnicode,      "BINUNICODE",       Arg::kUtf8_4,         1, Group::kString,     Torch::kAll,     true},
    {kAppend,          "APPEND",           Arg::kNone,           0, Group::kContainer,  Torch::kAll,     true},
    {kBuild,           "BUILD",            Arg::kNone,           0, Group::kObject,     Torch::kAll,     true},
    {kGlobal,          "GLOBAL",           Arg::kTwoLines,       0, Group::kObject,     Torch::kAll,     true},
    {kDict,            "DICT",             Arg::kNone,           0, Group::kContainer,  Torch::kRefused, false},
    {kEmptyDict,       "EMPTY_DICT",       Arg::kNone,           1, Group::kContainer,  Torch::kAll,     true},
    {kAppends,         "APPENDS",          Arg::kNone,           1, Group::kContainer,  Torch::kAll,     true},
    {kGet,             "GET",              Arg::kDecimalLine,    0, Group::kMemo,       Torch::kRefused, false},
    {kBinGet,          "BINGET",           Arg::kU1,             1, Group::kMemo,       Torch::kAll,     true},
    {kInst,            "INST",             Arg::kTwoLines,       0, Group::kObject,     Torch::kRefused, false},
    {kLongBinGet,      "LONG_BINGET",      Arg::kU4,             1, Group::kMemo,       Torch::kAll,     true},
    {kList,            "LIST",             Arg::kNone,           0, Group::kContainer,  Torch::kRefused, false},
    {kEmptyList,       "EMPTY_LIST",       Arg::kNone,           1, Group::kContainer,  Torch::kAll,     true},
    {kObj,             "OBJ",              Arg::kNone,           1, Group::kObject,     Torch::kRefused, false},
    {kPut,             "PUT",              Arg::kDecimalLine,    0, Group::kMemo,       Torch::kRefused, false},
    {kBinPut,          "BINPUT",           Arg::kU1,             1, Group::kMemo,       Torch::kAll,     true},
    {kLongBinPut,      "LONG_BINPUT",      Arg::kU4,             1, Group::kMemo,       Torch::kAll,     true},
    {kSetItem,         "SETITEM",          Arg::kNone,           0, Group::kContainer,  Torch::kAll,     true},
    {kTuple,           "TUPLE",            Arg::kNone,           0, Group::kContainer,  Torch::kAll,     true},
    {kEmptyTuple,      "EMPTY_TUPLE",      Arg::kNone,           1, Group::kContainer,  Torch::kAll,     true},
    {kSetItems,        "SETITEMS",         Arg::kNone,           1, Group::kContainer,  Torch::kAll,     true},
    {kBinFloat,        "BINFLOAT",         Arg::kF8,             1, Group::kFloat,      Torch::kNewer,   true},
    {kProto,           "PROTO",            Arg::kU1,             2, Group::kFraming,    Torch::kAll,     true},
    {kNewObj,          "NEWOBJ",           Arg::kNone,           2, Group::kObject,     Torch::kAll,     true},
    {kExt1,            "EXT1",             Arg::kU1,             2, Group::kExtension,  Torch::kRefused, false},
    {kExt2,            "EXT2",             Arg::kU2,             2, Group::kExtension,  Torch::kRefused, false},
    {kExt4,            "EXT4",             Arg::kI4,             2, Group::kExtension,  Torch::kRefused, false},
    {kTuple1,          "TUPLE1",           Arg::kNone,           2, Group::kContainer,  Torch::kAll,     true},
    {kTuple2,          "TUPLE2",           Arg::kNone,           2, Group::kContainer,  Torch::kAll,     true},
    {kTuple3,          "TUPLE3",           Arg::kNone,           2, Group::kContainer,  Torch::kAll,     true},
    {kNewTrue,         "NEWTRUE",          Arg::kNone,           2, Group::kConstant,   Torch::kAll,     true},
    {kNewFalse,        "NEWFALSE",         Arg::kNone,           2, Group::kConstant,   Torch::kAll,     true},
    {kLong1,           "LONG1",            Arg::kLong1,          2, Group::kInteger,    Torch::kAll,     true},
    {kLong4,           "LONG4",            Arg::kLong4,          2, Group::kInteger,    Torch::kRefused, true},
    {kBinBytes,        "BINBYTES",         Arg::kBytes4,         3, Group::kString,     Torch::kRefused, false},
    {kShortBinBytes,   "SHORT_BINBYTES",   Arg::kBytes1,         3, Group::kString,     Torch::kRefused, false},
    {kShortBinUnicode, "SHORT_BINUNICODE", Arg::kUtf8_1,         4, Group::kString,     Torch::kRefused, false},
    {kBinUnicode8,     "BINUNICODE8",      Arg::kUtf8_8,         4, Group::kString,     Torch::kRefused, false},
    {kBinBytes8,       "BINBYTES8",        Arg::kBytes8,         4, Group::kString,     Torch::kRefused, false},
    {kEmptySet,        "EMPTY_SET",        Arg::kNone,           4, Group::kContainer,  Torch::kAll,     false},
    {kAddItems,        "ADDITEMS",         Arg::kNone,           4, Group::kContainer,  Torch::kRefused, false},
    {kFrozenSet,       "FROZENSET",        Arg::kNone,           4, Group::kContainer,  Torch::kRefused, false},
    {kNewObjEx,        "NEWOBJ_EX",        Arg::kNone,           4, Group::kObject,     Torch::kRefused, false},
    {kStackGlobal,     "STACK_GLOBAL",     Arg::kNone,           4, Group::kObject,     Torch::kRefused, false},
    {kMemoize,         "MEMOIZE",          Arg::kNone,           4, Group::kMemo,       Torch::kRefused, false},
    {kFrame,           "FRAME",            Arg::kU8,             4, Group::kFraming,    Torch::kRefused, false},
    {kByteArray8,      "BYTEARRAY8",       Arg::kByteArray8,     5, Group::kString,     Torch::kRefused, false},
    {kNextBuffer,      "NEXT_BUFFER",      Arg::kNone,           5, Group::kBuffer,     Torch::kRefused, false},
    {kReadOnlyBuffer,  "READONLY_BUFFER",  Arg::kNone,           5, Group::kBuffer,     Torch::kRefused, false},
    // clang-format on
};

namespace detail {
// byte -> index into kOpcodeTable, or -1 for a byte that is no opcode.
constexpr std::array<int8_t, 256> IndexOfByte() {
  std::array<int8_t, 256> index{};
  index.fill(-1);
  for (size_t k = 0; k < std::size(kOpcodeTable); ++k) index[kOpcodeTable[k].code] = static_cast<int8_t>(k);
  return index;
}
inline constexpr std::array<int8_t, 256> kIndexOfByte = IndexOfByte();

constexpr bool CodesAreUnique() {
  size_t defined = 0;
  for (int8_t i : kIndexOfByte) defined += i >= 0;
  return defined == std::size(kOpcodeTable);
}
}  // namespace detail

// A duplicated byte in the table would silently shadow an opcode.
static_assert(detail::CodesAreUnique(), "two opcode table entries share a byte");
static_assert(std::size(kOpcodeTable) == 68, "protocols 0-5 define 68 opcodes");

// The table entry of `byte`, or nullptr if no protocol defines it.
constexpr const OpInfo* FindOpcode(uint8_t byte) {
  int8_t i = detail::kIndexOfByte[byte];
  return i < 0 ? nullptr : &kOpcodeTable[i];
}

// True for the groups the reader refuses with an error of their own.
constexpr bool ReaderRefuses(Group g) { return g == Group::kExtension || g == Group::kBuffer; }

// Bytes of the fixed part of an argument: the whole argument for fixed-size
// kinds, the length field for length-prefixed ones, 0 for line kinds and kNone.
constexpr size_t FixedArgSize(Arg a) {
  switch (a) {
    case Arg::kU1:
    case Arg::kLong1:
    case Arg::kStr1:
    case Arg::kBytes1:
    case Arg::kUtf8_1: return 1;
    case Arg::kU2: return 2;
    case Arg::kU4:
    case Arg::kI4:
    case Arg::kLong4:
    case Arg::kStr4:
    case Arg::kBytes4:
    case Arg::kUtf8_4: return 4;
    case Arg::kU8:
    case Arg::kF8:
    case Arg::kBytes8:
    case Arg::kByteArray8:
    case Arg::kUtf8_8: return 8;
    default: return 0;
  }
}
// The fixed part is a length of the bytes that follow it.
constexpr bool IsLengthPrefixed(Arg a) {
  switch (a) {
    case Arg::kLong1:
    case Arg::kLong4:
    case Arg::kStr1:
    case Arg::kStr4:
    case Arg::kBytes1:
    case Arg::kBytes4:
    case Arg::kBytes8:
    case Arg::kByteArray8:
    case Arg::kUtf8_1:
    case Arg::kUtf8_4:
    case Arg::kUtf8_8: return true;
    default: return false;
  }
}
// Newline-terminated lines follow the opcode (2 for kTwoLines).
constexpr int ArgLines(Arg a) {
  switch (a) {
    case Arg::kDecimalLine:
    case Arg::kLongLine:
    case Arg::kFloatLine:
    case Arg::kQuotedLine:
    case Arg::kRawUnicodeLine:
    case Arg::kLine: return 1;
    case Arg::kTwoLines: return 2;
    default: return 0;
  }
}

}  // namespace uckpt::pickle
