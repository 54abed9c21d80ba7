#include "ckpt/zero_writer.h"

#include <algorithm>
#include <cstring>
#include <filesystem>

#include "ckpt/deepspeed_state.h"
#include "ckpt/partition.h"
#include "ckpt/torch_out.h"
#include "format/error.h"
#include "format/value.h"

namespace uckpt::ckpt {

namespace fs = std::filesystem;

namespace {

using Pieces = std::vector<std::span<const uint8_t>>;

// Zero bytes for padding, handed out as repeated pieces of one buffer.
void AppendZeros(uint64_t bytes, Pieces* pieces) {
  static const std::vector<uint8_t> zeros(1 << 20, 0);
  while (bytes > 0) {
    size_t n = static_cast<size_t>(std::min<uint64_t>(bytes, zeros.size()));
    pieces->emplace_back(zeros.data(), n);
    bytes -= n;
  }
}

// The hyper-parameters the test checkpoints claim (torch AdamW, wd 0.01).
const AdamHparams kWriterHparams{0.001, 0.9, 0.999, 1e-8, 0.01};

ValuePtr FloatScalar(float v) {
  std::vector<uint8_t> b(4);
  std::memcpy(b.data(), &v, 4);
  return Value::FromTensor(Tensor::FromBytes(DType::kFloat32, {}, std::move(b)));
}

// A 1-D float32 tensor of `numel` elements over a storage of `storage_numel`
// whose bytes are `pieces` (registered in `all`).
ValuePtr FlatTensor(int64_t numel, int64_t storage_numel, Pieces pieces, StoragePieces* all,
                    bool requires_grad = false) {
  ValuePtr t = PiecewiseTensor(DType::kFloat32, {storage_numel}, requires_grad);
  t->tensor->shape = {numel};
  t->tensor->stride = {1};
  (*all)[t->tensor->storage.get()] = std::move(pieces);
  return t;
}

class Writer {
 public:
  Writer(std::string folder, const ZeroWriteSpec& spec) : folder_(std::move(folder)), s_(spec) {
    size_t base = 0;
    for (const auto& g : s_.groups) {
      bases_.push_back(base);
      std::vector<int64_t> numels;
      for (const auto& p : g) {
        int64_t n = 1;
        for (int64_t d : p.shape) n *= d;
        numels.push_back(n);
      }
      numels_.push_back(std::move(numels));
      base += g.size();
    }
  }

  void Write() {
    if (s_.stage < 1 || s_.stage > 3 || s_.dp < 1) throw std::invalid_argument("bad ZeRO stage or dp size");
    if (fs::exists(folder_)) throw IoError(folder_ + " already exists");
    fs::create_directories(folder_);
    if (s_.stage == 3) {
      PlanSubGroups();
      for (int r = 0; r < s_.dp; ++r) {
        WriteModelStates(folder_ + "/" + Zero3ModelStatesFileName(r));
        WriteStage3Optim(r);
      }
    } else {
      WriteModelStates(folder_ + "/" + ModelStatesFileName());
      for (int r = 0; r < s_.dp; ++r) WriteStage12Optim(r);
    }
  }

 private:
  std::string OptimPath(int r) const { return folder_ + "/" + OptimStatesFileNameWithPrefix(r, s_.optim_prefix); }

  // Stage 3: the sub-groups of every param group, as (group, first, count).
  void PlanSubGroups() {
    for (size_t g = 0; g < s_.groups.size(); ++g) {
      size_t first = 0;
      for (size_t count : Stage3SubGroups(numels_[g], s_.dp, s_.sub_group_size)) {
        subs_.push_back({g, first, count});
        first += count;
      }
    }
  }

  std::vector<std::vector<NamedShape>> ParamShapes() const {
    std::vector<std::vector<NamedShape>> list;
    auto add = [&](size_t g, size_t first, size_t count) {
      list.emplace_back();
      for (size_t i = first; i < first + count; ++i)
        list.back().push_back({s_.groups[g][i].name, s_.groups[g][i].shape});
    };
    if (s_.stage == 3) {
      for (const auto& sg : subs_) add(sg.group, sg.first, sg.count);
    } else {
      for (size_t g = 0; g < s_.groups.size(); ++g) add(g, 0, s_.groups[g].size());
    }
    return list;
  }

  void WriteModelStates(const std::string& path) {
    StoragePieces pieces;
    ModelStates m;
    m.stage = s_.stage;
    for (size_t g = 0; g < s_.groups.size(); ++g)
      for (size_t i = 0; i < s_.groups[g].size(); ++i) {
        const ZeroParam& p = s_.groups[g][i];
        if (s_.stage == 3) {
          m.module.emplace_back(p.name, Value::FromTensor(Tensor::FromBytes(DType::kFloat32, {0}, {})));
        } else if (s_.write_module) {
          ValuePtr t = PiecewiseTensor(DType::kFloat32, p.shape, false);
          s_.source(bases_[g] + i, kFp32, 0, numels_[g][i], &pieces[t->tensor->storage.get()]);
          m.module.emplace_back(p.name, t);
        }
      }
    m.param_shapes = ParamShapes();
    m.last_batch_iteration = s_.global_steps - 1;
    m.global_steps = s_.global_steps;
    m.global_samples = s_.global_steps * 8;
    m.dp_world_size = s_.dp;
    m.ds_config = Config();
    WriteTorchFile(path, ModelStatesValue(m), pieces);
  }

  ValuePtr Config() const {
    auto zero = Value::Dict();
    zero->set("stage", Value::Int(s_.stage));
    auto cfg = Value::Dict();
    cfg->set("train_batch_size", Value::Int(8));
    cfg->set("zero_optimization", zero);
    return cfg;
  }

  // The bytes of `key` for partition [begin, begin + n) of flat group g: the
  // fragments of the parameters there, then zeros.
  Pieces PartitionPieces(size_t g, int rank, const std::string& key, int64_t* real) const {
    Pieces pieces;
    *real = 0;
    for (const Fragment& f : RankFragments(numels_[g], s_.dp, rank)) {
      s_.source(bases_[g] + f.param, key, f.param_offset, f.numel, &pieces);
      *real += f.numel;
    }
    FlatLayout l = MakeFlatLayout(Sum(numels_[g]), s_.dp);
    AppendZeros(static_cast<uint64_t>(l.partition_size - *real) * 4, &pieces);
    return pieces;
  }

  static int64_t Sum(const std::vector<int64_t>& v) {
    int64_t n = 0;
    for (int64_t x : v) n += x;
    return n;
  }

  void WriteStage12Optim(int r) {
    StoragePieces all;
    RankOptimStates o;
    o.stage = s_.stage;
    o.bf16_optimizer = s_.bf16_optimizer;
    o.dp = s_.dp;
    o.clip_grad = 1.0;
    o.ds_config = Config();
    for (size_t g = 0; g < s_.groups.size(); ++g) {
      FlatLayout l = MakeFlatLayout(Sum(numels_[g]), s_.dp);
      OptimGroupState gs;
      gs.padding = s_.legacy_group_paddings || s_.bf16_optimizer ? l.legacy_padding(r) : l.padding(r);
      int64_t real = 0;
      if (!s_.state_keys.empty()) {
        gs.adam.emplace_back(kStep, FloatScalar(s_.step));
        for (const auto& key : s_.state_keys)
          gs.adam.emplace_back(key,
                               FlatTensor(l.partition_size, l.partition_size, PartitionPieces(g, r, key, &real), &all));
      }
      gs.hparams = kWriterHparams;
      // Stage 1/2 keep partition[:P - pad] (Python slicing: a negative end
      // counts from the back); BF16_Optimizer keeps the whole partition.
      int64_t lean = l.partition_size;
      if (!s_.bf16_optimizer) {
        int64_t end = l.partition_size - gs.padding;
        lean = end >= 0 ? end : std::max<int64_t>(0, l.partition_size + end);
      }
      gs.fp32 = FlatTensor(lean, l.partition_size, PartitionPieces(g, r, kFp32, &real), &all, /*requires_grad=*/true);
      for (const Fragment& f : RankFragments(numels_[g], s_.dp, r))
        gs.mappings.emplace_back(s_.groups[g][f.param].name, f);
      o.groups.push_back(std::move(gs));
    }
    WriteTorchFile(OptimPath(r), OptimStatesValue(o), all);
  }

  void WriteStage3Optim(int r) {
    StoragePieces all;
    Stage3RankOptimStates o;
    o.dp = s_.dp;
    o.ds_config = Config();
    std::vector<std::vector<int64_t>> group_subs(s_.groups.size());
    for (size_t s = 0; s < subs_.size(); ++s) {
      const SubGroup& sg = subs_[s];
      group_subs[sg.group].push_back(static_cast<int64_t>(s));
      auto pieces_for = [&](const std::string& key, int64_t* length) {
        Pieces pieces;
        *length = 0;
        for (size_t i = sg.first; i < sg.first + sg.count; ++i) {
          const int64_t n = numels_[sg.group][i], ps = Stage3PartitionSize(n, s_.dp);
          const int64_t real = Stage3RealNumel(n, s_.dp, r);
          if (real > 0) s_.source(bases_[sg.group] + i, key, r * ps, real, &pieces);
          AppendZeros(static_cast<uint64_t>(ps - real) * 4, &pieces);
          *length += ps;
        }
        return pieces;
      };
      Stage3SubGroupState sub;
      int64_t length = 0;
      if (!s_.state_keys.empty()) {
        sub.adam.emplace_back(kStep, FloatScalar(s_.step));
        for (const auto& key : s_.state_keys) {
          Pieces p = pieces_for(key, &length);
          sub.adam.emplace_back(key, FlatTensor(length, length, std::move(p), &all));
        }
      }
      Pieces p = pieces_for(kFp32, &length);
      sub.fp32 = FlatTensor(length, length, std::move(p), &all, /*requires_grad=*/true);
      o.sub_groups.push_back(std::move(sub));
    }
    for (auto& ids : group_subs) o.param_groups.emplace_back(kWriterHparams, std::move(ids));
    WriteTorchFile(OptimPath(r), Stage3OptimStatesValue(o), all);
  }

  struct SubGroup {
    size_t group, first, count;
  };

  std::string folder_;
  const ZeroWriteSpec& s_;
  std::vector<size_t> bases_;
  std::vector<std::vector<int64_t>> numels_;
  std::vector<SubGroup> subs_;
};

}  // namespace

namespace {

constexpr int64_t kPeriod = 1000003;

const std::vector<float>& PatternTable() {
  static const std::vector<float> table = [] {
    std::vector<float> t(kPeriod);
    for (int64_t i = 0; i < kPeriod; ++i) t[i] = static_cast<float>(i) * 1e-6f - 0.5f;
    return t;
  }();
  return table;
}

int64_t PatternShift(size_t param, const std::string& key) {
  uint64_t h = 1469598103934665603ull ^ param;
  for (char c : key) h = (h ^ static_cast<uint8_t>(c)) * 1099511628211ull;
  return static_cast<int64_t>(h % kPeriod);
}

}  // namespace

float PatternValue(size_t param, const std::string& key, int64_t element) {
  return PatternTable()[(element + PatternShift(param, key)) % kPeriod];
}

StateSource PatternSource() {
  return [](size_t param, const std::string& key, int64_t first, int64_t count,
            std::vector<std::span<const uint8_t>>* pieces) {
    const auto& table = PatternTable();
    int64_t at = (first + PatternShift(param, key)) % kPeriod;
    while (count > 0) {
      int64_t n = std::min(count, kPeriod - at);
      pieces->emplace_back(reinterpret_cast<const uint8_t*>(table.data() + at), static_cast<size_t>(n) * 4);
      count -= n;
      at = 0;
    }
  };
}

void WriteZeroCheckpoint(const std::string& folder, const ZeroWriteSpec& spec) {
  if (!spec.source) throw std::invalid_argument("WriteZeroCheckpoint needs a data source");
  Writer(folder, spec).Write();
}

}  // namespace uckpt::ckpt
