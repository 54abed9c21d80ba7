// Checked access to the value trees of checkpoint files: every failure is a
// FormatError that names the file and the path of the missing or wrong value.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "format/value.h"

namespace uckpt::ckpt {

// `where` is the file and the path so far, e.g. "x.pt: optimizer_state_dict".
[[noreturn]] void Fail(const std::string& where, const std::string& what);

// dict[key]; throws if `dict` is not a dict or has no such key.
ValuePtr Need(const ValuePtr& dict, std::string_view key, const std::string& where);
// dict[int key] (optimizer `state` dicts are keyed by ints); null if absent.
ValuePtr GetIntKey(const ValuePtr& dict, int64_t key);
bool IsNone(const ValuePtr& v);

int64_t AsInt(const ValuePtr& v, const std::string& where);
const std::vector<ValuePtr>& AsList(const ValuePtr& v, const std::string& where);  // list or tuple
const Tensor& AsTensor(const ValuePtr& v, const std::string& where);
std::string AsStr(const ValuePtr& v, const std::string& where);
// torch.Size (or a tuple/list of ints) -> dims.
std::vector<int64_t> AsShape(const ValuePtr& v, const std::string& where);
int64_t NumelOf(const std::vector<int64_t>& shape);

// The bytes of elements [first, first + count) of a contiguous tensor, checked
// against its storage.
std::span<const uint8_t> TensorElements(const Tensor& t, int64_t first, int64_t count, const std::string& where);
// All bytes of a contiguous tensor, checked against its storage.
std::span<const uint8_t> TensorBytes(const Tensor& t, const std::string& where);

// An OrderedDict / dict of name -> value as (name, value) pairs.
std::vector<std::pair<std::string, ValuePtr>> NamedEntries(const ValuePtr& dict, const std::string& where);

// "1, 2, 3" style shape text: "[37, 11]".
std::string ShapeText(const std::vector<int64_t>& shape);

// The same value: tensors of equal dtype, shape and bytes; equal numbers; else equal HashKey texts.
bool SameValue(const ValuePtr& a, const ValuePtr& b);
// A step as text for messages: a one-element tensor's or a number's value, "none" for null.
std::string StepText(const ValuePtr& v);

}  // namespace uckpt::ckpt
