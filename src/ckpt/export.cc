#include "ckpt/export.h"

#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <span>
#include <vector>

#include "ckpt/deepspeed_state.h"
#include "ckpt/folder.h"
#include "ckpt/partition.h"
#include "ckpt/universal_checkpoint.h"
#include "ckpt/values.h"
#include "ckpt/zero_checkpoint.h"
#include "format/error.h"
#include "format/file.h"

namespace uckpt::ckpt {

namespace fs = std::filesystem;

std::string SafetensorsDtype(DType d) {
  switch (d) {
    case DType::kFloat32: return "F32";
    case DType::kFloat64: return "F64";
    case DType::kFloat16: return "F16";
    case DType::kBFloat16: return "BF16";
    case DType::kInt64: return "I64";
    case DType::kInt32: return "I32";
    case DType::kInt16: return "I16";
    case DType::kInt8: return "I8";
    case DType::kUInt8: return "U8";
    case DType::kBool: return "BOOL";
    case DType::kUInt16: return "U16";
    case DType::kUInt32: return "U32";
    case DType::kUInt64: return "U64";
    case DType::kFloat8E4M3FN: return "F8_E4M3";
    case DType::kFloat8E5M2: return "F8_E5M2";
    default: throw FormatError("safetensors has no dtype for " + std::string(DTypeName(d)));
  }
}

namespace {

using Pieces = std::vector<std::span<const uint8_t>>;

// One output tensor; its data is produced only when it is written, so a
// universal checkpoint's files are opened one at a time.
struct Entry {
  std::string name;
  std::vector<int64_t> shape;
  DType src = DType::kFloat32;
  std::function<Pieces(std::shared_ptr<const void>* hold)> data;
};

// The pieces of a tensor (copied when it is not contiguous).
Pieces TensorPieces(const Tensor& t, const std::string& where, std::shared_ptr<const void>* hold) {
  if (t.is_contiguous()) return {TensorBytes(t, where)};
  auto copy = std::make_shared<std::vector<uint8_t>>(t.contiguous_bytes());
  *hold = copy;
  return {std::span<const uint8_t>(*copy)};
}

class Collector {
 public:
  // Buffers, then frozen parameters, then trainable ones are added in
  // zero_to_fp32.py's order.
  void AddModelTensors(const TorchFile& model, const std::set<std::string>& trainable, int stage,
                       const std::vector<TorchFile>& rank_models, int dp) {
    const std::string path = model.file->path();
    const ModuleEntriesView m = ReadModuleEntries(model.root, path);
    const std::set<std::string>& buffers = m.buffer_names;
    aliases_.insert(aliases_.end(), m.shared_params.begin(), m.shared_params.end());
    std::set<std::string> alias_names;
    for (const auto& a : aliases_) alias_names.insert(a.first);
    if (!m.module) return;
    auto entries = NamedEntries(m.module, path + ": module");
    for (const auto& [name, v] : entries)
      if (buffers.count(name)) AddTensor(name, v, path + ": module['" + name + "']");
    if (!m.frozen_shapes) {
      // Stage 1 and BF16 keep no frozen_param_*: frozen parameters exist only
      // in `module` (zero_to_fp32.py drops them; we keep them).
      for (const auto& [name, v] : entries) {
        if (buffers.count(name) || trainable.count(name) || alias_names.count(name)) continue;
        if (v && v->tensor && v->tensor->numel() > 0) AddTensor(name, v, path + ": module['" + name + "']");
      }
      return;
    }
    for (const auto& [name, shape] : *m.frozen_shapes) {
      if (stage == 3) AddStage3Frozen(name, shape, rank_models, dp);
      else
        AddTensor(name, ReadFrozenFragment(model.root, name, path), path + ": frozen_param_fragments['" + name + "']",
                  shape);
    }
  }

  void Add(Entry e) { entries_.push_back(std::move(e)); }
  const std::vector<Entry>& entries() const { return entries_; }
  const std::vector<std::pair<std::string, std::string>>& aliases() const { return aliases_; }

 private:
  void AddTensor(const std::string& name, const ValuePtr& v, const std::string& where,
                 std::vector<int64_t> shape = {}) {
    const Tensor& t = AsTensor(v, where);
    if (!shape.empty() && NumelOf(shape) != t.numel())
      Fail(where, "has " + std::to_string(t.numel()) + " elements but its recorded shape is " + ShapeText(shape));
    Entry e{name, shape.empty() ? t.shape : shape, t.dtype, nullptr};
    ValuePtr keep = v;
    e.data = [keep, where](std::shared_ptr<const void>* hold) { return TensorPieces(*keep->tensor, where, hold); };
    entries_.push_back(std::move(e));
  }

  // ZeRO-3 frozen parameters: the real elements of every rank's slot
  // (Stage3FrozenFragments), in rank order.
  void AddStage3Frozen(const std::string& name, const std::vector<int64_t>& shape, const std::vector<TorchFile>& ranks,
                       int dp) {
    const int64_t numel = NumelOf(shape);
    if (static_cast<int>(ranks.size()) != dp)
      Fail(name, "frozen ZeRO-3 parameter needs the model states of all " + std::to_string(dp) + " ranks");
    std::vector<ValuePtr> frags = Stage3FrozenFragments(ranks, name, numel);
    Entry e{name, shape, frags.front()->tensor->dtype, nullptr};
    e.data = [frags, numel, dp](std::shared_ptr<const void>*) {
      Pieces p;
      for (int r = 0; r < dp; ++r) {
        int64_t real = Stage3RealNumel(numel, dp, r);
        if (real > 0) p.push_back(TensorElements(*frags[r]->tensor, 0, real, "frozen fragment"));
      }
      return p;
    };
    entries_.push_back(std::move(e));
  }

  std::vector<Entry> entries_;
  std::vector<std::pair<std::string, std::string>> aliases_;
};

void FromFloat(DType d, float f, uint8_t* p) {
  switch (d) {
    case DType::kFloat32: std::memcpy(p, &f, 4); return;
    case DType::kBFloat16: {
      uint16_t h = FloatToBFloat16(f);
      std::memcpy(p, &h, 2);
      return;
    }
    case DType::kFloat16: {
      uint16_t h = FloatToHalf(f);
      std::memcpy(p, &h, 2);
      return;
    }
    default: throw FormatError("cannot export as " + std::string(DTypeName(d)));
  }
}

// Writes `pieces` (elements of `src`) as `dst`, converting in small chunks.
void WriteConverted(AtomicFile& out, const Pieces& pieces, DType src, DType dst) {
  if (src == dst) {
    for (auto p : pieces) out.Write(p);
    return;
  }
  const size_t ss = DTypeSize(src), ds = DTypeSize(dst);
  std::vector<uint8_t> buf;
  for (auto p : pieces) {
    const size_t n = p.size() / ss;
    for (size_t at = 0; at < n;) {
      size_t k = std::min<size_t>(n - at, 1 << 16);
      buf.resize(k * ds);
      for (size_t i = 0; i < k; ++i)
        FromFloat(dst, static_cast<float>(ElementToDouble(src, p.data() + (at + i) * ss)), buf.data() + i * ds);
      out.Write(buf);
      at += k;
    }
  }
}

Collector CollectZero(const std::string& folder, bool verify_hashes) {
  auto z = std::make_shared<ZeroCheckpoint>(OpenZeroCheckpoint(folder, verify_hashes));
  Collector c;
  std::set<std::string> trainable;
  for (const auto& p : z->params) trainable.insert(p.name);
  std::vector<TorchFile> rank_models;
  if (z->stage == 3)
    for (const auto& f : z->model_files) rank_models.push_back(LoadTorchFile(f.path));
  c.AddModelTensors(z->model, trainable, z->stage, rank_models, z->dp);
  for (size_t i = 0; i < z->params.size(); ++i) {
    const ParamPlan& p = z->params[i];
    Entry e{p.name, p.shape, p.states[0].dtype, nullptr};
    e.data = [z, i](std::shared_ptr<const void>*) { return z->params[i].states[0].pieces; };
    c.Add(std::move(e));
  }
  return c;
}

Collector CollectUniversal(const std::string& folder, bool verify_hashes) {
  auto u = std::make_shared<UniversalCheckpoint>(OpenUniversalCheckpoint(folder, verify_hashes));
  Collector c;
  std::set<std::string> trainable;
  for (const auto& g : u->groups)
    for (const auto& p : g) trainable.insert(p.name);
  std::vector<TorchFile> rank_models;
  int dp = u->source_dp;
  if (u->zero3) {
    for (const auto& f : ListCheckpointFolder(u->folder))
      if (f.kind == FileKind::kZero3ModelStates) rank_models.push_back(LoadTorchFile(f.path));
  }
  c.AddModelTensors(u->model, trainable, u->zero3 ? 3 : 2, rank_models, dp);
  for (const auto& g : u->groups)
    for (const auto& p : g) {
      Entry e{p.name, p.shape, DType::kFloat32, nullptr};
      e.src = LoadUniversalState(*u, p.name, kFp32).tensor->dtype;
      std::string name = p.name;
      int64_t numel = p.numel;
      e.data = [u, name, numel](std::shared_ptr<const void>* hold) {
        auto s = std::make_shared<LoadedState>(LoadUniversalState(*u, name, kFp32));
        const std::string where = s->file.file->path();
        if (s->tensor->numel() != numel)
          Fail(where,
               "has " + std::to_string(s->tensor->numel()) + " elements, param_shapes says " + std::to_string(numel));
        std::shared_ptr<const void> copy;
        Pieces pieces = TensorPieces(*s->tensor, where, &copy);
        *hold = copy ? copy : std::static_pointer_cast<const void>(s);  // what the pieces point into
        return pieces;
      };
      c.Add(std::move(e));
    }
  return c;
}

}  // namespace

ExportStats ExportSafetensors(const std::string& checkpoint, const std::string& out_path, DType dtype,
                              bool verify_hashes) {
  if (dtype != DType::kFloat32 && dtype != DType::kBFloat16 && dtype != DType::kFloat16)
    throw FormatError("export dtype must be float32, bfloat16 or float16, not " + std::string(DTypeName(dtype)));
  auto tag = ResolveTagFolder(checkpoint);
  if (!tag) throw FormatError(checkpoint + ": not a checkpoint folder");
  std::error_code ec;
  Collector c = fs::is_directory(UniversalZeroDir(*tag), ec) ? CollectUniversal(*tag, verify_hashes)
                                                             : CollectZero(*tag, verify_hashes);

  auto out_dtype = [&](DType src) { return DTypeIsFloating(src) ? dtype : src; };
  nlohmann::json header = nlohmann::json::object();
  std::set<std::string> names;
  uint64_t offset = 0;
  for (const Entry& e : c.entries()) {
    if (!names.insert(e.name).second) Fail(*tag, "tensor '" + e.name + "' appears twice");
    const DType d = out_dtype(e.src);
    const uint64_t n = static_cast<uint64_t>(NumelOf(e.shape)) * DTypeSize(d);
    header[e.name] = {{"dtype", SafetensorsDtype(d)}, {"shape", e.shape}, {"data_offsets", {offset, offset + n}}};
    offset += n;
  }
  nlohmann::json meta = {{"format", "pt"}};
  for (const auto& [alias, owner] : c.aliases()) {
    // An alias of a tensor the folder does not hold (a frozen parameter left out by exclude_frozen_parameters) is
    // left out too, as DeepSpeed's zero_to_fp32 recovers a shared parameter only when its owner is there.
    if (!names.count(owner)) continue;
    if (names.count(alias)) continue;  // stored under both names already
    meta[alias] = owner;
  }
  header["__metadata__"] = meta;
  std::string text;
  try {
    text = header.dump();
  } catch (const nlohmann::json::type_error&) {
    // safetensors headers are UTF-8 JSON; a damaged name is not.
    Fail(*tag, "a tensor name is not valid UTF-8");
  }
  text.append((8 - text.size() % 8) % 8, ' ');  // data starts 8-byte aligned

  AtomicFile out(out_path);
  uint8_t len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<uint8_t>(static_cast<uint64_t>(text.size()) >> (8 * i));
  out.Write(std::span<const uint8_t>(len, 8));
  out.Write(text);
  for (const Entry& e : c.entries()) {
    std::shared_ptr<const void> hold;
    Pieces pieces = e.data(&hold);
    uint64_t bytes = 0;
    for (auto p : pieces) bytes += p.size();
    if (bytes != static_cast<uint64_t>(NumelOf(e.shape)) * DTypeSize(e.src))
      Fail(*tag, "'" + e.name + "' has " + std::to_string(bytes) + " bytes of data for shape " + ShapeText(e.shape));
    WriteConverted(out, pieces, e.src, out_dtype(e.src));
  }
  ExportStats st;
  st.tensors = c.entries().size();
  st.aliases = meta.size() - 1;
  st.bytes = out.offset();
  out.Commit();
  return st;
}

}  // namespace uckpt::ckpt
