// The pickle reader's virtual machine (pickle_reader.cc: the loop and one
// handler per opcode group; pickle_calls.cc: globals, calls and the shape
// check). Internal to src/format: callers use pickle_reader.h.
#pragma once

#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "format/error.h"
#include "format/pickle_reader.h"

namespace uckpt::pickle_vm {

// A set or frozenset value of `items`.
ValuePtr MakeSet(Kind kind, std::vector<ValuePtr> items);

class Machine {
 public:
  Machine(std::span<const uint8_t> data, const std::string& where, const PersistentLoader& load,
          const PickleLimits& limits, PicklePolicy policy)
      : data_(data), where_(where), load_(load), limits_(limits), strict_(policy == PicklePolicy::kStrict) {}

  ~Machine() {
    // Values left out of the result (all of them on failure) may hold cycles
    // or very deep chains; cut their edges first so that freeing them neither
    // leaks nor recurses deeply.
    for (auto& v : created_) {
      if (done_ && reachable_.count(v.get())) continue;
      v->items.clear();
      v->entries.clear();
      v->listitems.clear();
      v->state.reset();
      v->kwargs.reset();
      v->tensor.reset();  // a tensor's attrs can lead back to it
    }
  }

  ValuePtr Run();

 private:
  [[noreturn]] void Fail(const std::string& what) const {
    throw FormatError(where_ + ": pickle offset " + std::to_string(op_pos_) + ": " + what);
  }
  const uint8_t* Take(size_t n) {
    if (data_.size() - pos_ < n) Fail("unexpected end of data");
    const uint8_t* p = data_.data() + pos_;
    pos_ += n;
    return p;
  }
  uint8_t U8() { return *Take(1); }
  uint32_t U32() {
    const uint8_t* p = Take(4);
    return uint32_t{p[0]} | (uint32_t{p[1]} << 8) | (uint32_t{p[2]} << 16) | (uint32_t{p[3]} << 24);
  }
  uint64_t U64() {
    uint64_t lo = U32();
    return lo | (uint64_t{U32()} << 32);
  }
  std::string Line() {
    const uint8_t* start = data_.data() + pos_;
    const void* nl = std::memchr(start, '\n', data_.size() - pos_);
    if (!nl) Fail("unterminated text argument");
    size_t n = static_cast<const uint8_t*>(nl) - start;
    pos_ += n + 1;
    return std::string(reinterpret_cast<const char*>(start), n);
  }
  std::string Bytes(uint64_t n) {
    if (n > data_.size() - pos_) Fail("length " + std::to_string(n) + " runs past the end of data");
    const uint8_t* p = Take(static_cast<size_t>(n));
    return std::string(reinterpret_cast<const char*>(p), static_cast<size_t>(n));
  }

  ValuePtr Track(ValuePtr v) {
    if (v->kind == Kind::kList || v->kind == Kind::kTuple || v->kind == Kind::kDict || v->kind == Kind::kOrderedDict ||
        v->kind == Kind::kSet || v->kind == Kind::kFrozenSet || v->kind == Kind::kObject ||
        v->kind == Kind::kParameter || v->kind == Kind::kTensor)
      created_.push_back(v);
    return v;
  }
  void Push(ValuePtr v) {
    if (stack_.size() >= limits_.max_stack) Fail("stack limit exceeded");
    stack_.push_back(Track(std::move(v)));
  }
  size_t Base() const { return marks_.empty() ? 0 : marks_.back(); }
  ValuePtr Pop() {
    if (stack_.size() <= Base()) Fail("stack underflow");
    ValuePtr v = std::move(stack_.back());
    stack_.pop_back();
    return v;
  }
  ValuePtr& Top() {
    if (stack_.size() <= Base()) Fail("stack underflow");
    return stack_.back();
  }
  std::vector<ValuePtr> PopMark() {
    if (marks_.empty()) Fail("no MARK on the stack");
    size_t m = marks_.back();
    marks_.pop_back();
    std::vector<ValuePtr> items(std::make_move_iterator(stack_.begin() + static_cast<ptrdiff_t>(m)),
                                std::make_move_iterator(stack_.end()));
    stack_.resize(m);
    return items;
  }
  void Put(uint64_t idx) {
    if (memo_.size() >= limits_.max_memo && !memo_.count(idx)) Fail("memo limit exceeded");
    memo_[idx] = Top();
  }
  ValuePtr Get(uint64_t idx) {
    auto it = memo_.find(idx);
    if (it == memo_.end()) Fail("memo key " + std::to_string(idx) + " is not defined");
    return it->second;
  }

  ValuePtr MakeGlobal(std::string module, std::string name);
  void CheckStrictGetattr(const ValuePtr& args);
  void CheckStrictResult();
  ValuePtr Call(const ValuePtr& callable, const ValuePtr& args);
  ValuePtr CallTorchUtils(const std::string& fn, const std::vector<ValuePtr>& a);
  ValuePtr CallRebuildFromType(const std::vector<ValuePtr>& a);
  ValuePtr CallOrderedDict(const std::vector<ValuePtr>& a);
  ValuePtr CallBuiltin(const std::string& fn, const std::vector<ValuePtr>& a);
  ValuePtr CallOther(const std::string& path, const std::vector<ValuePtr>& a);
  ValuePtr RebuildTensor(const std::string& fn, const std::vector<ValuePtr>& a);
  void SetItem(Value& target, ValuePtr key, ValuePtr value);
  void Append(Value& target, ValuePtr item);
  void Build(Value& target, ValuePtr state);
  void CheckShape();

  // The VM: Run() dispatches each opcode to its group's handler
  // (pickle::Group); the handlers switch on the opcode.
  [[noreturn]] void UnknownOpcode(uint8_t op) const;
  [[noreturn]] void NoHandler(uint8_t op) const;
  ValuePtr Stop();
  void Framing(uint8_t op);
  void StackOp(uint8_t op);
  void Constant(uint8_t op);
  void Integer(uint8_t op);
  void Float(uint8_t op);
  void String(uint8_t op);
  std::string QuotedString(const std::string& line);
  std::string RawUnicode(const std::string& line);
  void Container(uint8_t op);
  void Fill(uint8_t op);
  void Object(uint8_t op);
  void NewObject(uint8_t op);
  void Memo(uint8_t op);
  uint64_t LineIndex(const char* error);
  void Persistent(uint8_t op);

  std::span<const uint8_t> data_;
  const std::string& where_;
  const PersistentLoader& load_;
  const PickleLimits& limits_;
  const bool strict_;
  size_t pos_ = 0, op_pos_ = 0;
  std::vector<ValuePtr> stack_;
  std::vector<size_t> marks_;
  std::unordered_map<uint64_t, ValuePtr> memo_;
  std::vector<ValuePtr> created_;
  // Key index of large dicts so that SETITEMS stays linear.
  std::unordered_map<const Value*, std::unordered_map<std::string, size_t>> dict_index_;
  bool done_ = false;
  std::unordered_set<const Value*> reachable_;  // from the result, filled by CheckShape
};

}  // namespace uckpt::pickle_vm
