#include "ckpt/tp_merge.h"

#include <algorithm>
#include <numeric>

#include "ckpt/values.h"
#include "format/error.h"

namespace uckpt::ckpt {

namespace {

// The affine map encoding this reader knows (DeepSpeed 0.19.8's
// AFFINE_MAP_FORMAT_VERSION); DeepSpeed refuses newer ones too.
constexpr int64_t kTpAffineMapVersion = 1;

// `^<re.escape(name)>$` -> name; nullopt for any other pattern.
std::optional<std::string> TpEscapedLiteral(const std::string& p) {
  if (p.size() < 2 || p.front() != '^' || p.back() != '$') return std::nullopt;
  std::string out;
  for (size_t i = 1; i + 1 < p.size(); ++i) {
    const char c = p[i];
    if (c == '\\') {
      if (i + 2 >= p.size()) return std::nullopt;
      const char e = p[++i];
      if (std::isalnum(static_cast<unsigned char>(e))) return std::nullopt;  // \d, \w, ...: a class
      out += e;
    } else if (std::isalnum(static_cast<unsigned char>(c)) || c == '_' || static_cast<unsigned char>(c) >= 0x80) {
      out += c;
    } else {
      return std::nullopt;  // an unescaped metacharacter
    }
  }
  return out;
}

TpPattern TpMakePattern(const std::string& text, const std::string& where) {
  TpPattern p;
  p.text = text;
  p.literal = TpEscapedLiteral(text);
  if (!p.literal) {
    try {
      p.re = std::make_shared<const std::regex>(text, std::regex::ECMAScript);
    } catch (const std::regex_error& e) {
      Fail(where, "pattern '" + text + "' cannot be read as a regular expression (" + e.what() + ")");
    }
  }
  return p;
}

std::vector<TpPattern> TpPatterns(const ValuePtr& info, const char* key, const std::string& where) {
  std::vector<TpPattern> out;
  ValuePtr v = info->get(key);
  if (!v || IsNone(v)) return out;
  const std::string at = where + "['" + key + "']";
  for (const ValuePtr& p : AsList(v, at)) out.push_back(TpMakePattern(AsStr(p, at), at));
  return out;
}

std::vector<int64_t> TpInts(const ValuePtr& v, const std::string& where) {
  std::vector<int64_t> out;
  for (const ValuePtr& x : AsList(v, where)) out.push_back(AsInt(x, where));
  return out;
}

// [offset, [strides]] of an affine piece's 'source' or 'dest'.
void TpReadPlace(const ValuePtr& v, const std::string& where, int64_t* offset, std::vector<int64_t>* strides) {
  const auto& pair = AsList(v, where);
  if (pair.size() != 2) Fail(where, "is not [offset, strides]");
  *offset = AsInt(pair[0], where);
  *strides = TpInts(pair[1], where);
}

TpAffinePiece TpReadPiece(const ValuePtr& v, const std::string& where) {
  TpAffinePiece p;
  p.shape = TpInts(Need(v, "shape", where), where + "['shape']");
  TpReadPlace(Need(v, "source", where), where + "['source']", &p.source_offset, &p.source_strides);
  TpReadPlace(Need(v, "dest", where), where + "['dest']", &p.dest_offset, &p.dest_strides);
  p.locations = TpInts(Need(v, "locations", where), where + "['locations']");
  if (ValuePtr s = v->get("scale"); s && !IsNone(s)) p.scale = s->kind == Kind::kFloat ? s->f : AsInt(s, where);
  if (p.source_strides.size() != p.shape.size() || p.dest_strides.size() != p.shape.size())
    Fail(where, "has strides that do not match its shape " + ShapeText(p.shape));
  return p;
}

TpAffineMap TpReadAffineMap(const ValuePtr& v, const std::string& where) {
  TpAffineMap m;
  m.logical_shape = TpInts(Need(v, "logical_shape", where), where + "['logical_shape']");
  ValuePtr ranks = Need(v, "ranks", where);
  if (!ranks->is_dict()) Fail(where + "['ranks']", "is not a dict");
  for (const auto& [k, r] : ranks->entries) {
    const std::string at = where + "['ranks'][" + (k && k->kind == Kind::kInt ? std::to_string(k->i) : "?") + "]";
    const int64_t rank = AsInt(k, at);
    m.shard_shapes.emplace_back(rank, TpInts(Need(r, "shard_shape", at), at + "['shard_shape']"));
    std::vector<TpAffinePiece> pieces;
    const auto& list = AsList(Need(r, "pieces", at), at + "['pieces']");
    for (size_t i = 0; i < list.size(); ++i)
      pieces.push_back(TpReadPiece(list[i], at + "['pieces'][" + std::to_string(i) + "]"));
    m.pieces.emplace_back(rank, std::move(pieces));
  }
  return m;
}

}  // namespace

bool TpPattern::Matches(const std::string& name) const {
  if (literal) return name == *literal;
  return std::regex_search(name, *re, std::regex_constants::match_continuous);
}

std::set<std::string> TpRules::CategoryPatterns() const {
  std::set<std::string> all;
  for (const auto* list : {&replicated, &average, &row_parallel, &vocabulary, &two_sub_params_cat_dim_0, &sub_params})
    for (const TpPattern& p : *list) all.insert(p.text);
  return all;
}

TpRules ReadTpRules(const ValuePtr& info, const std::string& where) {
  if (!info || !info->is_dict()) Fail(where, "is not a dict");
  TpRules r;
  r.where = where;
  if (ValuePtr v = info->get("universal_checkpoint_version"); v && !IsNone(v))
    r.version = v->kind == Kind::kFloat ? v->f : static_cast<double>(AsInt(v, where));
  r.replicated = TpPatterns(info, "tp_replicated_parameter_patterns", where);
  r.average = TpPatterns(info, "parameter_to_average_patterns", where);
  r.row_parallel = TpPatterns(info, "parameter_with_row_parallelism_patterns", where);
  r.vocabulary = TpPatterns(info, "vocabulary_parameter_patterns", where);
  r.two_sub_params_cat_dim_0 = TpPatterns(info, "parameter_with_2_sub_params_cat_dim_0", where);
  if (ValuePtr v = info->get("parameter_with_sub_params"); v && !IsNone(v)) {
    const std::string at = where + "['parameter_with_sub_params']";
    for (const ValuePtr& s : AsList(v, at)) {
      for (const ValuePtr& p : AsList(Need(s, "patterns", at), at + "['patterns']"))
        r.sub_params.push_back(TpMakePattern(AsStr(p, at), at));
    }
  }
  if (ValuePtr v = info->get("original_vocab_size"); v && !IsNone(v))
    r.original_vocab_size = AsInt(v, where + "['original_vocab_size']");
  if (ValuePtr v = info->get("autotp_unsupported_parameter_patterns"); v && v->is_dict())
    for (const auto& [k, reason] : v->entries)
      r.unsupported.emplace_back(AsStr(k, where), reason && reason->kind == Kind::kStr ? reason->s : KindName(*reason));
  if (ValuePtr am = info->get("affine_map"); am && !IsNone(am)) {
    const std::string at = where + "['affine_map']";
    if (ValuePtr ver = am->get("version"); ver && AsInt(ver, at + "['version']") > kTpAffineMapVersion)
      Fail(at, "has format version " + std::to_string(AsInt(ver, at)) + "; uckpt reads up to version " +
                   std::to_string(kTpAffineMapVersion) + " (as DeepSpeed 0.19.8 does)");
    if (ValuePtr params = am->get("params"); params && params->is_dict())
      for (const auto& [k, m] : params->entries) {
        const std::string pattern = AsStr(k, at + "['params']");
        r.affine.emplace_back(TpMakePattern(pattern, at), TpReadAffineMap(m, at + "['params']['" + pattern + "']"));
      }
  }
  return r;
}

namespace {

// Appends `r`, merged into the previous run when it continues it on both sides.
void TpAddRun(std::vector<TpRun>& runs, const TpRun& r) {
  if (r.length == 0) return;
  if (!runs.empty()) {
    TpRun& b = runs.back();
    if (b.rank == r.rank && b.shard_start + b.length == r.shard_start && b.out_start + b.length == r.out_start) {
      b.length += r.length;
      return;
    }
  }
  runs.push_back(r);
}

// The runs of one affine piece of `rank`, in its index order: rows of its
// last dimension when that is contiguous on both sides, else single elements.
std::vector<TpRun> TpPieceRuns(const TpAffinePiece& p, int rank) {
  std::vector<TpRun> runs;
  const size_t k = p.shape.size();
  for (int64_t d : p.shape)
    if (d == 0) return runs;
  const bool rows = k > 0 && p.source_strides[k - 1] == 1 && p.dest_strides[k - 1] == 1;
  const size_t outer_dims = rows ? k - 1 : k;
  const int64_t length = rows ? p.shape[k - 1] : 1;
  std::vector<int64_t> idx(k, 0);
  for (;;) {
    int64_t src = p.source_offset, dst = p.dest_offset;
    for (size_t a = 0; a < outer_dims; ++a) {
      src += idx[a] * p.source_strides[a];
      dst += idx[a] * p.dest_strides[a];
    }
    TpAddRun(runs, {rank, dst, src, length});
    size_t a = outer_dims;
    for (;;) {
      if (a == 0) return runs;
      --a;
      if (++idx[a] < p.shape[a]) break;
      idx[a] = 0;
    }
  }
}

// The last element a strided view reaches past its offset; -1 for negative strides.
int64_t TpReach(const std::vector<int64_t>& shape, const std::vector<int64_t>& strides) {
  int64_t reach = 0;
  for (size_t a = 0; a < shape.size(); ++a) {
    if (strides[a] < 0) return -1;
    if (shape[a] > 0) reach += (shape[a] - 1) * strides[a];
  }
  return reach;
}

// Sorts `runs` by output offset and checks they cover [0, numel) exactly once.
void TpCheckCoverage(std::vector<TpRun>& runs, int64_t numel, const std::string& where) {
  std::sort(runs.begin(), runs.end(), [](const TpRun& a, const TpRun& b) { return a.out_start < b.out_start; });
  int64_t at = 0;
  std::vector<TpRun> merged;
  for (const TpRun& r : runs) {
    if (r.out_start < at)
      Fail(where, "two ranks' pieces both write element " + std::to_string(r.out_start) + " of the parameter");
    if (r.out_start > at) Fail(where, "no rank holds element " + std::to_string(at) + " of the parameter");
    TpAddRun(merged, r);
    at = r.out_start + r.length;
  }
  if (at != numel)
    Fail(where, "no rank holds element " + std::to_string(at) + " of the parameter's " + std::to_string(numel));
  runs = std::move(merged);
}

void TpAffineMerge(const TpAffineMap& m, const std::vector<std::vector<int64_t>>& rank_shapes, const std::string& where,
                   TpParamMerge* out) {
  const int tp = static_cast<int>(rank_shapes.size());
  if (static_cast<int>(m.shard_shapes.size()) != tp)
    Fail(where, "describes " + std::to_string(m.shard_shapes.size()) + " ranks, the checkpoint has " +
                    std::to_string(tp) + " tensor-parallel ranks");
  for (const auto& [rank, shape] : m.shard_shapes) {
    if (rank < 0 || rank >= tp) Fail(where, "names rank " + std::to_string(rank) + " of " + std::to_string(tp));
    if (NumelOf(shape) != NumelOf(rank_shapes[rank]))
      Fail(where, "gives rank " + std::to_string(rank) + " a shard of shape " + ShapeText(shape) +
                      ", but that rank's param_shapes say " + ShapeText(rank_shapes[rank]));
  }
  const int64_t numel = NumelOf(m.logical_shape);
  std::set<int64_t> written_at;  // source offsets of the pieces written (DeepSpeed compares replicas by it)
  std::vector<TpRun> runs;
  for (const auto& [rank, pieces] : m.pieces) {
    const int64_t shard = NumelOf(rank_shapes.at(rank));
    int64_t held = 0;
    for (const TpAffinePiece& p : pieces) {
      if (p.scale != 1.0)
        Fail(where, "has a piece scaled by " + std::to_string(p.scale) + " on rank " + std::to_string(rank) +
                        "; scaled pieces are not supported (DeepSpeed 0.19.8 cannot convert their optimizer "
                        "states either)");
      const int64_t src = TpReach(p.shape, p.source_strides), dst = TpReach(p.shape, p.dest_strides);
      held += NumelOf(p.shape);
      if (NumelOf(p.shape) == 0) continue;
      if (src < 0 || dst < 0 || p.source_offset < 0 || p.dest_offset < 0 || p.source_offset + src >= numel ||
          p.dest_offset + dst >= shard)
        Fail(where, "has a piece on rank " + std::to_string(rank) + " outside the parameter or its shard");
      std::vector<TpRun> piece = TpPieceRuns(p, static_cast<int>(rank));
      const bool replica = p.locations.size() > 1 && written_at.count(p.source_offset);
      for (const TpRun& r : piece) (replica ? out->replicas : runs).push_back(r);
      if (!replica) written_at.insert(p.source_offset);
    }
    if (held != shard)
      Fail(where, "gives rank " + std::to_string(rank) + " pieces of " + std::to_string(held) +
                      " elements for a shard of " + std::to_string(shard));
  }
  TpCheckCoverage(runs, numel, where);
  out->runs = std::move(runs);
  out->merged_shape = m.logical_shape;
  out->rule = "affine map";
}

// The shards concatenated on `dim` (torch.cat), every other size equal.
void TpCatMerge(const std::vector<std::vector<int64_t>>& rank_shapes, size_t dim, const std::string& where,
                TpParamMerge* out) {
  const std::vector<int64_t>& first = rank_shapes[0];
  if (dim >= first.size())
    Fail(where, "is merged on dim " + std::to_string(dim) + " but its shards have " + std::to_string(first.size()) +
                    " dimension(s)");
  int64_t outer = 1, inner = 1, width = 0;
  for (size_t a = 0; a < dim; ++a) outer *= first[a];
  for (size_t a = dim + 1; a < first.size(); ++a) inner *= first[a];
  for (const auto& s : rank_shapes) {
    bool fits = s.size() == first.size();
    for (size_t a = 0; fits && a < s.size(); ++a) fits = a == dim || s[a] == first[a];
    if (!fits)
      Fail(where, "has shards of shapes " + ShapeText(first) + " and " + ShapeText(s) +
                      ", which cannot be concatenated on dim " + std::to_string(dim));
    width += s[dim];
  }
  for (int64_t o = 0; o < outer; ++o) {
    int64_t at = 0;
    for (size_t r = 0; r < rank_shapes.size(); ++r) {
      const int64_t w = rank_shapes[r][dim];
      TpAddRun(out->runs, {static_cast<int>(r), o * w * inner, (o * width + at) * inner, w * inner});
      at += w;
    }
  }
  out->merged_shape = first;
  out->merged_shape[dim] = width;
  out->rule = "cat dim " + std::to_string(dim);
  out->universal_keys.emplace_back("cat_dim", Value::Int(static_cast<int64_t>(dim)));
}

// Every rank holds it whole; rank 0's is written, the others must agree.
void TpReplicatedMerge(const std::vector<std::vector<int64_t>>& rank_shapes, const std::string& where,
                       TpParamMerge* out) {
  const int64_t numel = NumelOf(rank_shapes[0]);
  for (size_t r = 0; r < rank_shapes.size(); ++r) {
    if (rank_shapes[r] != rank_shapes[0])
      Fail(where, "is TP-replicated but rank " + std::to_string(r) + " holds shape " + ShapeText(rank_shapes[r]) +
                      ", rank 0 " + ShapeText(rank_shapes[0]));
    TpAddRun(r == 0 ? out->runs : out->replicas, {static_cast<int>(r), 0, 0, numel});
  }
  out->merged_shape = rank_shapes[0];
  out->rule = "replicated";
}

}  // namespace

TpParamMerge PlanTpMerge(const TpRules& rules, const std::string& name,
                         const std::vector<std::vector<int64_t>>& rank_shapes) {
  const std::string where = rules.where + ": parameter '" + name + "'";
  if (rank_shapes.empty()) Fail(where, "has no tensor-parallel shards");
  TpParamMerge out;
  // re.match over one pattern list: DeepSpeed refuses a name two patterns match.
  auto match = [&](const std::vector<TpPattern>& list) -> bool {
    const TpPattern* hit = nullptr;
    for (const TpPattern& p : list)
      if (p.Matches(name)) {
        if (hit) Fail(where, "matches two patterns of one list, '" + hit->text + "' and '" + p.text + "'");
        hit = &p;
      }
    if (hit) out.patterns.insert(hit->text);
    return hit != nullptr;
  };
  const TpAffineMap* affine = nullptr;
  for (const auto& [pattern, map] : rules.affine)
    if (pattern.Matches(name)) {
      if (affine) Fail(where, "matches two affine map patterns");
      affine = &map;
    }
  const bool sub_params = match(rules.sub_params);
  if (affine) {
    // The map supersedes the categories; their patterns count as used.
    for (const auto* list :
         {&rules.replicated, &rules.average, &rules.row_parallel, &rules.vocabulary, &rules.two_sub_params_cat_dim_0})
      match(*list);
    TpAffineMerge(*affine, rank_shapes, where + " (affine_map)", &out);
  } else if (match(rules.replicated)) {
    TpReplicatedMerge(rank_shapes, where, &out);
  } else if (match(rules.average)) {
    Fail(where, "is averaged over TP ranks (parameter_to_average_patterns), which uckpt does not convert");
  } else if (match(rules.two_sub_params_cat_dim_0)) {
    Fail(where, "has two sub-parameters (parameter_with_2_sub_params_cat_dim_0), which uckpt does not convert");
  } else if (sub_params) {
    Fail(where, "has sub-parameters (parameter_with_sub_params) and no affine map, which uckpt does not convert");
  } else {
    TpCatMerge(rank_shapes, match(rules.row_parallel) ? 1 : 0, where, &out);
  }
  out.shape = out.merged_shape;
  if (match(rules.vocabulary)) {
    // param[:original_vocab_size, :]: DeepSpeed saves the view, with the whole storage.
    if (!rules.original_vocab_size) Fail(where, "is a vocabulary parameter but original_vocab_size is not recorded");
    if (out.shape.size() != 2) Fail(where, "is a vocabulary parameter of shape " + ShapeText(out.shape) + ", not 2-D");
    out.shape[0] = std::clamp<int64_t>(*rules.original_vocab_size, 0, out.shape[0]);
    out.universal_keys.emplace_back("vocab_tensor", Value::Bool(true));
  }
  return out;
}

}  // namespace uckpt::ckpt
