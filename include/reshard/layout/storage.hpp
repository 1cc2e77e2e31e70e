#pragma once
// Storage: where a rank's local pieces sit in its local buffers. Every storage
// form (a tensor alone, concat with interleave, flat buckets) reduces to a
// list of HeldBoxes: boxes of the tensor's local array with an affine map into
// a buffer. Concat rounds become one box per round; a flat range becomes the
// few boxes that tile a row-major interval.
#include <algorithm>
#include <array>
#include <cstdint>
#include <map>
#include <utility>
#include <vector>

#include "layout.hpp"

namespace reshard {

/// Local index window [lo, hi) of a tensor's local array, stored at buffer
/// element `base + sum_d j_d * stride[d]` for local index j.
struct HeldBox {
  int rank = 0;
  std::array<std::int64_t, kMaxTensorRank> lo{}, hi{}, stride{};
  std::int64_t base = 0;
  std::int64_t elements() const {
    std::int64_t n = 1;
    for (int d = 0; d < rank; ++d) n *= hi[static_cast<std::size_t>(d)] - lo[static_cast<std::size_t>(d)];
    return n;
  }
};

/// What one rank holds of one tensor.
struct TensorStorage {
  int buffer = -1;                      ///< local buffer id
  std::vector<DimPart> parts;           ///< per dim
  std::vector<std::int64_t> extents;    ///< local array extents
  std::int64_t lin_lo = 0, lin_hi = 0;  ///< held interval of the row-major local array
  std::vector<HeldBox> boxes;
  bool empty() const { return boxes.empty(); }
};

/// A flat buffer on one rank: each part's offset in the flattened sequence
/// (-1 = not held), the sequence length L and the rank's range [lo, hi).
struct FlatRange {
  std::vector<std::int64_t> offset;
  std::int64_t length = 0, lo = 0, hi = 0;
  bool any = false;
};

/// A concat buffer on one rank: each part's offset along the concat dim (-1 =
/// not held) and the buffer's extent along it. Computing it once per (rank,
/// buffer) keeps tensor_storage linear in the number of parts.
struct ConcatRange {
  std::vector<std::int64_t> offset;
  std::int64_t total = 0;
};

inline ConcatRange concat_range(const Layout& L, std::int64_t pos, const BufferSpec& bs) {
  ConcatRange c;
  c.offset.reserve(bs.part_ids.size());
  for (int t : bs.part_ids) {
    if (!L.holds(pos, t)) {
      c.offset.push_back(-1);
      continue;
    }
    c.offset.push_back(c.total);
    c.total += L.dim_part(pos, t, bs.dim).local_extent;
  }
  return c;
}

inline std::int64_t product(const std::vector<std::int64_t>& e) {
  std::int64_t n = 1;
  for (auto x : e) n *= x;
  return n;
}

inline FlatRange flat_range(const Layout& L, std::int64_t pos, const BufferSpec& bs) {
  FlatRange f;
  for (int t : bs.part_ids) {
    if (!L.holds(pos, t)) {
      f.offset.push_back(-1);
      continue;
    }
    f.any = true;
    f.offset.push_back(f.length);
    std::int64_t size = 1;
    for (int d = 0; d < L.tensors[static_cast<std::size_t>(t)].rank(); ++d) size *= L.dim_part(pos, t, d).local_extent;
    f.length += size;
  }
  if (!f.any) return f;
  const DimCut cut = resolve_dim(bs.flat, f.length, ErrorContext{L.origin, "", bs.name});
  const DimPart part = cut.part(bs.flat.part_of(L.mesh, pos));
  f.lo = part.lo;
  f.hi = part.hi;
  return f;
}

/// Appends the boxes that tile the row-major interval [a, b) of an array with
/// extents e (at most 2*rank-1 boxes).
inline void linear_to_boxes(const std::vector<std::int64_t>& e, std::int64_t a, std::int64_t b,
                            std::vector<std::array<std::int64_t, 2 * kMaxTensorRank>>& out) {
  const int n = static_cast<int>(e.size());
  std::array<std::int64_t, kMaxTensorRank + 1> row{};  // row[d] = elements of one index of dim d
  row[static_cast<std::size_t>(n)] = 1;
  for (int d = n - 1; d >= 0; --d) row[static_cast<std::size_t>(d)] = row[static_cast<std::size_t>(d) + 1] * e[static_cast<std::size_t>(d)];
  // row[d+1] is the size of one step along dim d.
  while (a < b) {
    // The coarsest dim whose step divides a; take whole steps along it.
    int d = 0;
    for (; d < n; ++d)
      if (a % row[static_cast<std::size_t>(d) + 1] == 0) break;
    std::int64_t step = row[static_cast<std::size_t>(d) + 1];
    std::int64_t idx = (a / step) % e[static_cast<std::size_t>(d)];
    std::int64_t cnt = std::min((b - a) / step, e[static_cast<std::size_t>(d)] - idx);
    while (cnt == 0) {  // not even one step fits: go finer
      ++d;
      step = row[static_cast<std::size_t>(d) + 1];
      idx = (a / step) % e[static_cast<std::size_t>(d)];
      cnt = std::min((b - a) / step, e[static_cast<std::size_t>(d)] - idx);
    }
    std::array<std::int64_t, 2 * kMaxTensorRank> box{};
    for (int k = 0; k < n; ++k) {
      const auto uk = static_cast<std::size_t>(k);
      if (k < d) {
        const std::int64_t c = (a / row[uk + 1]) % e[uk];
        box[2 * uk] = c;
        box[2 * uk + 1] = c + 1;
      } else if (k == d) {
        box[2 * uk] = idx;
        box[2 * uk + 1] = idx + cnt;
      } else {
        box[2 * uk] = 0;
        box[2 * uk + 1] = e[uk];
      }
    }
    out.push_back(box);
    a += cnt * step;
  }
}

/// What position `pos` holds of tensor t under layout L, and where, into s
/// (its vectors are reused: a planner asks for thousands of storages and
/// keeps few). `flat` and `concat`, when given, are the precomputed ranges of
/// t's buffer on pos.
inline void tensor_storage_into(const Layout& L, std::int64_t pos, int t, const FlatRange* flat,
                                const ConcatRange* concat, TensorStorage& s) {
  const auto& ts = L.tensors[static_cast<std::size_t>(t)];
  s.buffer = L.buffer_of(t);
  s.parts.clear();
  s.extents.clear();
  s.boxes.clear();
  s.lin_lo = s.lin_hi = 0;
  if (!L.holds(pos, t)) return;
  const int n = ts.rank();
  s.parts.reserve(static_cast<std::size_t>(n));
  s.extents.reserve(static_cast<std::size_t>(n));
  for (int d = 0; d < n; ++d) {
    s.parts.push_back(L.dim_part(pos, t, d));
    s.extents.push_back(s.parts.back().local_extent);
  }
  const std::int64_t size = product(s.extents);
  std::array<std::int64_t, kMaxTensorRank> rowstride;
  rowstride.fill(1);
  for (int d = n - 2; d >= 0; --d)
    rowstride[static_cast<std::size_t>(d)] = rowstride[static_cast<std::size_t>(d) + 1] * s.extents[static_cast<std::size_t>(d) + 1];
  HeldBox whole;
  whole.rank = n;
  for (int d = 0; d < n; ++d) {
    whole.hi[static_cast<std::size_t>(d)] = s.extents[static_cast<std::size_t>(d)];
    whole.stride[static_cast<std::size_t>(d)] = rowstride[static_cast<std::size_t>(d)];
  }
  s.lin_lo = 0;
  s.lin_hi = size;
  if (ts.buffer < 0) {
    s.boxes.push_back(whole);
    return;
  }
  const auto& bs = L.buffers[static_cast<std::size_t>(ts.buffer)];
  const auto slot = static_cast<std::size_t>(L.slot_in_buffer(t));
  if (bs.kind == BufferKind::concat) {
    const auto cd = static_cast<std::size_t>(bs.dim);
    const std::int64_t G = bs.interleave;
    const ConcatRange cr = concat ? ConcatRange{} : concat_range(L, pos, bs);
    const ConcatRange& c = concat ? *concat : cr;
    const std::int64_t total = c.total, prefix = c.offset[slot];
    // Buffer extents equal the local array's except along cd (total).
    std::array<std::int64_t, kMaxTensorRank> bstride;
    bstride.fill(1);
    for (int d = n - 2; d >= 0; --d) {
      const auto ud = static_cast<std::size_t>(d);
      bstride[ud] = bstride[ud + 1] * (ud + 1 == cd ? total : s.extents[ud + 1]);
    }
    const std::int64_t S = s.extents[cd] / G, T = total / G, off = prefix / G;
    for (std::int64_t g = 0; g < G; ++g) {
      HeldBox hb = whole;
      for (int d = 0; d < n; ++d) hb.stride[static_cast<std::size_t>(d)] = bstride[static_cast<std::size_t>(d)];
      hb.lo[cd] = g * S;
      hb.hi[cd] = (g + 1) * S;
      // buffer index along cd of local j: g*T + off + (j - g*S)
      hb.base = (g * T + off - g * S) * bstride[cd];
      s.boxes.push_back(hb);
    }
    return;
  }
  FlatRange computed;  // only when the caller has no cached one
  if (!flat) computed = flat_range(L, pos, bs);
  const FlatRange& fr = flat ? *flat : computed;
  const std::int64_t off = fr.offset[slot];
  s.lin_lo = std::max<std::int64_t>(0, fr.lo - off);
  s.lin_hi = std::min<std::int64_t>(size, fr.hi - off);
  if (s.lin_lo >= s.lin_hi) {
    s.lin_lo = s.lin_hi = 0;
    return;
  }
  std::vector<std::array<std::int64_t, 2 * kMaxTensorRank>> tiles;
  linear_to_boxes(s.extents, s.lin_lo, s.lin_hi, tiles);
  for (const auto& tile : tiles) {
    HeldBox hb = whole;
    for (int d = 0; d < n; ++d) {
      hb.lo[static_cast<std::size_t>(d)] = tile[2 * static_cast<std::size_t>(d)];
      hb.hi[static_cast<std::size_t>(d)] = tile[2 * static_cast<std::size_t>(d) + 1];
    }
    hb.base = off - fr.lo;
    s.boxes.push_back(hb);
  }
}

/// What position `pos` holds of tensor t under layout L, and where.
inline TensorStorage tensor_storage(const Layout& L, std::int64_t pos, int t,
                                    const FlatRange* flat = nullptr, const ConcatRange* concat = nullptr) {
  TensorStorage s;
  tensor_storage_into(L, pos, t, flat, concat, s);
  return s;
}

/// Positions that store a tensor alike. tensor_storage(L, pos, t) reads
/// only the axis digits that t's buffer reads: the cuts and stages of every
/// tensor in the buffer (they decide what each holds and at which offset) and
/// a flat buffer's own cut. Positions that agree on those digits (replicas
/// over dp or cp, say) hold the same boxes at the same offsets, so a plan
/// computes one storage per class. canonical(pos, t) is the class's
/// smallest position. Tables are built per buffer on first use.
class StorageClasses {
 public:
  explicit StorageClasses(const Layout& L) : L_(L), groups_(L.buffers.size() + L.tensors.size()) {}

  std::int64_t canonical(std::int64_t pos, int t) {
    const int b = L_.tensors[static_cast<std::size_t>(t)].buffer;  // BufferSpec index, -1 = alone
    const std::size_t g = b >= 0 ? static_cast<std::size_t>(b) : L_.buffers.size() + static_cast<std::size_t>(t);
    auto& axis_tables = groups_[g];
    if (axis_tables.empty()) axis_tables = build(b, t);
    std::int64_t c = 0;
    for (std::size_t a = 0; a < axis_tables.size(); ++a)
      c += (*axis_tables[a])[static_cast<std::size_t>(L_.mesh.coord(pos, static_cast<int>(a)))] *
           L_.mesh.axis_stride(static_cast<int>(a));
    return c;
  }

 private:
  using Table = std::vector<std::int64_t>;  // coordinate -> smallest coordinate with the same read digits

  std::vector<const Table*> build(int b, int t) {
    const auto& axes = L_.mesh.axes;
    std::vector<std::vector<AxisRef>> reads(axes.size());
    auto read_tensor = [&](int u) {
      const auto& ts = L_.tensors[static_cast<std::size_t>(u)];
      for (const auto& d : ts.dims)
        for (const auto& r : d.axes) reads[static_cast<std::size_t>(r.axis)].push_back(r);
      for (const auto& s : ts.stage)
        reads[static_cast<std::size_t>(s.axis)].push_back(AxisRef{s.axis, 1, axes[static_cast<std::size_t>(s.axis)].size});
    };
    if (b < 0) {
      read_tensor(t);
    } else {
      const auto& bs = L_.buffers[static_cast<std::size_t>(b)];
      for (int u : bs.part_ids) read_tensor(u);
      if (bs.kind == BufferKind::flat)
        for (const auto& r : bs.flat.axes) reads[static_cast<std::size_t>(r.axis)].push_back(r);
    }
    std::vector<const Table*> out(axes.size());
    for (std::size_t a = 0; a < axes.size(); ++a) {
      auto& rs = reads[a];
      std::sort(rs.begin(), rs.end(), [](const AxisRef& x, const AxisRef& y) {
        return std::pair(x.stride, x.size) < std::pair(y.stride, y.size);
      });
      rs.erase(std::unique(rs.begin(), rs.end()), rs.end());
      auto key = std::make_pair(static_cast<int>(a), std::vector<std::pair<std::int64_t, std::int64_t>>{});
      for (const auto& r : rs) key.second.emplace_back(r.stride, r.size);
      auto it = tables_.find(key);
      if (it == tables_.end()) {
        const std::int64_t n = axes[a].size;
        Table tab(static_cast<std::size_t>(n));
        std::map<std::vector<std::int64_t>, std::int64_t> first;  // read digits -> first coordinate
        std::vector<std::int64_t> digits(rs.size());
        for (std::int64_t c = 0; c < n; ++c) {
          for (std::size_t k = 0; k < rs.size(); ++k) digits[k] = (c / rs[k].stride) % rs[k].size;
          tab[static_cast<std::size_t>(c)] = first.emplace(digits, c).first->second;
        }
        it = tables_.emplace(std::move(key), std::move(tab)).first;
      }
      out[a] = &it->second;
    }
    return out;
  }

  const Layout& L_;
  std::vector<std::vector<const Table*>> groups_;  // per buffer, then per lone tensor
  std::map<std::pair<int, std::vector<std::pair<std::int64_t, std::int64_t>>>, Table> tables_;  // node-stable
};

/// Shape of local buffer `buf` on a position: empty when the rank has no such
/// buffer; a flat buffer is 1-D (possibly of extent 0).
inline std::vector<std::int64_t> buffer_shape(const Layout& L, std::int64_t pos, int buf) {
  const auto& lb = L.local_buffers()[static_cast<std::size_t>(buf)];
  if (lb.spec < 0) {
    const int t = lb.tensors[0];
    return L.holds(pos, t) ? L.local_extents(pos, t) : std::vector<std::int64_t>{};
  }
  const auto& bs = L.buffers[static_cast<std::size_t>(lb.spec)];
  if (bs.kind == BufferKind::flat) {
    const FlatRange fr = flat_range(L, pos, bs);
    if (!fr.any) return {};
    return {fr.hi - fr.lo};
  }
  std::vector<std::int64_t> shape;
  for (int t : bs.part_ids) {
    if (!L.holds(pos, t)) continue;
    auto e = L.local_extents(pos, t);
    if (shape.empty())
      shape = e;
    else
      shape[static_cast<std::size_t>(bs.dim)] += e[static_cast<std::size_t>(bs.dim)];
  }
  return shape;
}

inline std::int64_t buffer_elements(const Layout& L, std::int64_t pos, int buf) {
  auto s = buffer_shape(L, pos, buf);
  return s.empty() ? 0 : product(s);
}

}  // namespace reshard
