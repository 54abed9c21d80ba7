#include "format/value_print.h"

#include <cstdio>
#include <sstream>

#include "format/value_json.h"

namespace uckpt {

std::string HumanBytes(uint64_t n) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(n);
  int u = 0;
  while (v >= 1024 && u < 4) {
    v /= 1024;
    ++u;
  }
  char buf[32];
  if (u == 0) std::snprintf(buf, sizeof buf, "%llu B", static_cast<unsigned long long>(n));
  else std::snprintf(buf, sizeof buf, "%.1f %s", v, units[u]);
  return buf;
}

namespace {

std::string Quote(const std::string& s) {
  std::string out = "'";
  for (unsigned char c : s) {
    if (c == '\'' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c == '\n') {
      out += "\\n";
    } else if (c < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", c);
      out += buf;
    } else {
      out += static_cast<char>(c);
    }
  }
  return out + "'";
}

std::string Shape(const std::vector<int64_t>& shape) {
  std::string out = "[";
  for (size_t k = 0; k < shape.size(); ++k) out += (k ? ", " : "") + std::to_string(shape[k]);
  return out + "]";
}

class Printer {
 public:
  Printer(std::ostream& os, const PrintOptions& o) : os_(os), o_(o) {}

  // A one-line form for scalars, or empty if `v` needs several lines.
  std::string Inline(const Value& v) {
    switch (v.kind) {
      case Kind::kNone: return "None";
      case Kind::kBool: return v.b ? "True" : "False";
      case Kind::kInt: return IntToDecimal(v);
      case Kind::kFloat: return PythonFloatRepr(v.f);
      case Kind::kComplex: return "complex(" + PythonFloatRepr(v.f) + ", " + PythonFloatRepr(v.imag) + ")";
      case Kind::kStr: return Quote(v.s);
      case Kind::kBytes: return "bytes[" + std::to_string(v.s.size()) + "]";
      case Kind::kByteArray: return "bytearray[" + std::to_string(v.s.size()) + "]";
      case Kind::kTorchSize: {
        std::vector<int64_t> d;
        for (const auto& it : v.items) d.push_back(it->i);
        return "torch.Size(" + Shape(d) + ")";
      }
      case Kind::kTorchDevice: return "device(" + Quote(v.s) + ")";
      case Kind::kTorchDtype: return "torch." + v.s;
      case Kind::kGlobal: return "<global " + v.s + ">";
      case Kind::kTensor: return TensorLine(*v.tensor);
      case Kind::kParameter: return "Parameter " + TensorLine(*v.tensor);
      case Kind::kStorage: return "storage " + v.storage->storage_class + " " + HumanBytes(v.storage->bytes.size());
      default: break;
    }
    if ((v.is_seq() || v.is_dict() || v.kind == Kind::kSet || v.kind == Kind::kFrozenSet) && v.items.empty() &&
        v.entries.empty() && !v.state) {
      switch (v.kind) {
        case Kind::kList: return "[]";
        case Kind::kTuple: return "()";
        case Kind::kDict: return "{}";
        case Kind::kOrderedDict: return "OrderedDict()";
        default: return "set()";
      }
    }
    return {};
  }

  void Print(const Value& v, const std::string& indent, size_t depth) {
    if (Stopped()) return;
    ++printed_;
    std::string one = Inline(v);
    if (!one.empty()) {
      os_ << one << "\n";
      return;
    }
    if (depth >= o_.max_depth) {
      os_ << KindName(v) << " ...\n";
      return;
    }
    const std::string inner = indent + "  ";
    if (v.is_dict()) {
      os_ << (v.kind == Kind::kDict ? "dict" : "OrderedDict") << " (" << v.entries.size() << " items)\n";
      size_t shown = 0;
      for (const auto& [k, val] : v.entries) {
        if (Stopped()) return;
        if (shown++ == o_.max_items) {
          os_ << inner << "... " << v.entries.size() - o_.max_items << " more\n";
          break;
        }
        std::string key = Inline(*k);
        os_ << inner << (key.empty() ? KindName(*k) : key) << ": ";
        Print(*val, inner, depth + 1);
      }
      if (v.state && !Stopped()) {
        os_ << inner << "(state): ";
        Print(*v.state, inner, depth + 1);
      }
      return;
    }
    if (v.kind == Kind::kObject) {
      os_ << "object " << v.s << (v.newobj ? " (newobj)" : " (call)") << "\n";
      os_ << inner << "args: ";
      Print(*v.items.at(0), inner, depth + 1);
      if (v.state && !Stopped()) {
        os_ << inner << "state: ";
        Print(*v.state, inner, depth + 1);
      }
      return;
    }
    // list, tuple, set, frozenset
    os_ << KindName(v) << " (" << v.items.size() << " items)\n";
    for (size_t k = 0; k < v.items.size(); ++k) {
      if (Stopped()) return;
      if (k == o_.max_items) {
        os_ << inner << "... " << v.items.size() - o_.max_items << " more\n";
        break;
      }
      os_ << inner << "[" << k << "] ";
      Print(*v.items[k], inner, depth + 1);
    }
  }

 private:
  static std::string TensorLine(const Tensor& t) {
    std::string s = "tensor " + std::string(DTypeName(t.dtype)) + " " + Shape(t.shape) + " " + HumanBytes(t.nbytes());
    if (!t.is_contiguous()) s += " (strided " + Shape(t.stride) + ")";
    if (t.storage_offset) s += " offset " + std::to_string(t.storage_offset);
    if (t.storage && t.storage->bytes.size() != t.nbytes()) s += " of storage " + t.storage->key;
    if (t.requires_grad) s += " requires_grad";
    return s;
  }

  // True once max_nodes values were printed; says so once.
  bool Stopped() {
    if (printed_ < o_.max_nodes) return false;
    if (!noted_) os_ << "... (stopped after " << o_.max_nodes << " values)\n";
    noted_ = true;
    return true;
  }

  std::ostream& os_;
  const PrintOptions& o_;
  size_t printed_ = 0;  // values printed so far
  bool noted_ = false;
};

}  // namespace

void PrintValue(std::ostream& os, const Value& v, const PrintOptions& options) { Printer(os, options).Print(v, "", 0); }

}  // namespace uckpt
