#pragma once
// The plan oracle: an element-by-element reference for schedules, written
// straight from CONTRACT.md §1-2 with its own arithmetic. It reads only the
// fields of Layout/TensorSpec/DimSpec/Mesh and the buffer names and ids of
// Layout::local_buffers(); it never calls the library's storage, box or cut
// code, so a bug there cannot hide itself here.
//
//   local_slots(L, pos)         every slot of every local buffer of a mesh
//                               position: (tensor, global index) or padding
//   check_schedule(src, dst, s) simulates every copy slot by slot: complete,
//                               written once, same element, no padding, in
//                               bounds, minimal; the first fault in words
//   balance(src, dst, s)        bytes each source rank sends vs its even share
#include <algorithm>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "reshard/layout/layout.hpp"
#include "reshard/schedule/schedule.hpp"

namespace oracle {

using reshard::BufferKind;
using reshard::DimSpec;
using reshard::Layout;
using reshard::LayoutSpec;
using reshard::Mesh;
using reshard::Split;
using reshard::TensorSpec;

// ---------------------------------------------------------------------------
// Mesh arithmetic (§1 "mesh": row-major, first axis slowest)

inline std::int64_t mesh_positions(const Mesh& m) {
  std::int64_t n = 1;
  for (const auto& a : m.axes) n *= a.size;
  return n;
}

inline std::int64_t coordinate(const Mesh& m, std::int64_t pos, int axis) {
  std::int64_t below = 1;
  for (std::size_t b = static_cast<std::size_t>(axis) + 1; b < m.axes.size(); ++b) below *= m.axes[b].size;
  return (pos / below) % m.axes[static_cast<std::size_t>(axis)].size;
}

inline std::int64_t rank_at(const Mesh& m, std::int64_t pos) {
  return m.ranks.empty() ? m.first_rank + pos : m.ranks[static_cast<std::size_t>(pos)];
}

/// Global rank -> mesh position, by its own table.
class RankTable {
 public:
  explicit RankTable(const Mesh& m) {
    for (std::int64_t p = 0; p < mesh_positions(m); ++p) pos_[rank_at(m, p)] = p;
  }
  std::optional<std::int64_t> position(std::int64_t rank) const {
    auto it = pos_.find(rank);
    if (it == pos_.end()) return std::nullopt;
    return it->second;
  }

 private:
  std::unordered_map<std::int64_t, std::int64_t> pos_;
};

/// Part index of a position for a list of axis references: the mixed-radix
/// number of the digits (c / stride) % size, first most significant.
inline std::int64_t part_index(const Mesh& m, const std::vector<reshard::AxisRef>& refs, std::int64_t pos) {
  std::int64_t p = 0;
  for (const auto& r : refs) p = p * r.size + (coordinate(m, pos, r.axis) / r.stride) % r.size;
  return p;
}

inline std::int64_t part_count(const DimSpec& s) {
  std::int64_t k = 1;
  for (const auto& r : s.axes) k *= r.size;
  return k;
}

// ---------------------------------------------------------------------------
// Index sets (§1 "dimspec")

/// [lo, hi) of part p of k over a padded extent P, for the contiguous
/// splits, from the contract's definitions (CONTRACT.md section 1).
inline std::pair<std::int64_t, std::int64_t> contiguous_part(const DimSpec& s, std::int64_t P, std::int64_t k, std::int64_t p) {
  std::int64_t lo = 0, hi = 0;
  switch (s.split) {
    case Split::even:
      lo = p * (P / k);
      hi = lo + P / k;
      break;
    case Split::chunk: {
      const std::int64_t q = (P + k - 1) / k;
      lo = std::min(P, p * q);
      hi = std::min(P, (p + 1) * q);
      break;
    }
    case Split::balanced: {
      const std::int64_t base = P / k, extra = P % k;
      lo = p * base + std::min(p, extra);
      hi = lo + base + (p < extra ? 1 : 0);
      break;
    }
    case Split::sizes:
      for (std::int64_t q = 0; q < p; ++q) lo += s.sizes[static_cast<std::size_t>(q)];
      hi = lo + s.sizes[static_cast<std::size_t>(p)];
      break;
    case Split::cyclic: break;
  }
  return {lo, hi};
}

/// The sorted indices of [0, P) that part p of a dim of extent n holds
/// (padding included: indices >= n are padding).
inline std::vector<std::int64_t> held_indices(const DimSpec& s, std::int64_t n, std::int64_t p) {
  const std::int64_t P = s.pad_to > 0 ? s.pad_to : n;
  const std::int64_t k = part_count(s);
  std::vector<std::int64_t> out;
  if (s.split == Split::cyclic) {
    for (std::int64_t i = 0; i < P; ++i)
      if ((i / s.block) % k == p) out.push_back(i);
    return out;
  }
  const auto [lo, hi] = contiguous_part(s, P, k, p);
  for (std::int64_t i = lo; i < hi; ++i) out.push_back(i);
  return out;
}

/// |H| of part p, counting only indices below `limit` (n for real elements,
/// P for padding included), by arithmetic: for layouts too large to list.
inline std::int64_t held_count(const DimSpec& s, std::int64_t n, std::int64_t p, std::int64_t limit) {
  const std::int64_t P = s.pad_to > 0 ? s.pad_to : n;
  const std::int64_t k = part_count(s);
  limit = std::min(limit, P);
  if (s.split == Split::cyclic) {
    const std::int64_t period = k * s.block, full = limit / period;
    return full * s.block + std::clamp<std::int64_t>(limit - full * period - p * s.block, 0, s.block);
  }
  const auto [lo, hi] = contiguous_part(s, P, k, p);
  return std::max<std::int64_t>(0, std::min(hi, limit) - lo);
}

/// One dimspec of a tensor as the oracle sees it (an empty dims list means
/// none is cut).
inline DimSpec dim_spec(const TensorSpec& t, int d) {
  return t.dims.empty() ? DimSpec{} : t.dims[static_cast<std::size_t>(d)];
}

inline bool in_stage(const LayoutSpec& L, std::int64_t pos, const TensorSpec& t) {
  for (const auto& s : t.stage)
    if (coordinate(L.mesh, pos, s.axis) != s.coord) return false;
  return true;
}

/// H_d for every dim of tensor t on a position; empty when outside the stage.
inline std::vector<std::vector<std::int64_t>> held_sets(const LayoutSpec& L, std::int64_t pos, int t) {
  const auto& ts = L.tensors[static_cast<std::size_t>(t)];
  std::vector<std::vector<std::int64_t>> h;
  if (!in_stage(L, pos, ts)) return h;
  for (int d = 0; d < static_cast<int>(ts.shape.size()); ++d) {
    const DimSpec s = dim_spec(ts, d);
    h.push_back(held_indices(s, ts.shape[static_cast<std::size_t>(d)], part_index(L.mesh, s.axes, pos)));
  }
  return h;
}

inline bool holds_any(const std::vector<std::vector<std::int64_t>>& h) {
  if (h.empty()) return false;
  for (const auto& v : h)
    if (v.empty()) return false;
  return true;
}

/// Elements of tensor t's local array on a position (padding included), and
/// of them the real tensor elements, by arithmetic.
inline std::pair<std::int64_t, std::int64_t> held_elements(const LayoutSpec& L, std::int64_t pos, int t) {
  const auto& ts = L.tensors[static_cast<std::size_t>(t)];
  if (!in_stage(L, pos, ts)) return {0, 0};
  std::int64_t all = 1, real = 1;
  for (int d = 0; d < static_cast<int>(ts.shape.size()); ++d) {
    const DimSpec s = dim_spec(ts, d);
    const std::int64_t n = ts.shape[static_cast<std::size_t>(d)], p = part_index(L.mesh, s.axes, pos);
    all *= held_count(s, n, p, INT64_MAX);
    real *= held_count(s, n, p, n);
  }
  return {all, all == 0 ? 0 : real};
}

// ---------------------------------------------------------------------------
// Slots (§1 "Local memory of a rank")

/// One element slot of a local buffer: a tensor element, or padding.
struct Slot {
  std::int32_t tensor = -1;  ///< tensor id in its layout, -1 = padding
  std::int64_t index = -1;   ///< row-major index into the tensor's global shape
  bool padding() const { return tensor < 0; }
  friend bool operator==(const Slot&, const Slot&) = default;
};

/// All local buffers of one position, indexed like Layout::local_buffers().
struct RankSlots {
  std::vector<bool> present;               ///< does the rank have this buffer?
  std::vector<std::vector<Slot>> buffers;  ///< slots, in element order
};

namespace detail {
inline Slot tag(const TensorSpec& ts, int t, const std::vector<std::int64_t>& global) {
  std::int64_t lin = 0;
  for (std::size_t d = 0; d < global.size(); ++d) {
    if (global[d] >= ts.shape[d]) return Slot{};
    lin = lin * ts.shape[d] + global[d];
  }
  return Slot{t, lin};
}
/// Visits every tuple of a row-major box of extents e in order.
template <class F>
void for_each_index(const std::vector<std::int64_t>& e, F&& f) {
  for (auto x : e)
    if (x <= 0) return;
  std::vector<std::int64_t> j(e.size(), 0);
  while (true) {
    f(j);
    int d = static_cast<int>(e.size()) - 1;
    for (; d >= 0; --d) {
      if (++j[static_cast<std::size_t>(d)] < e[static_cast<std::size_t>(d)]) break;
      j[static_cast<std::size_t>(d)] = 0;
    }
    if (d < 0) return;
  }
}
/// The tensor's local array as slots, row-major.
inline std::vector<Slot> local_array(const TensorSpec& ts, int t, const std::vector<std::vector<std::int64_t>>& h) {
  std::vector<std::int64_t> e;
  for (const auto& v : h) e.push_back(static_cast<std::int64_t>(v.size()));
  std::vector<Slot> out;
  std::vector<std::int64_t> g(h.size());
  for_each_index(e, [&](const std::vector<std::int64_t>& j) {
    for (std::size_t d = 0; d < h.size(); ++d) g[d] = h[d][static_cast<std::size_t>(j[d])];
    out.push_back(tag(ts, t, g));
  });
  return out;
}
}  // namespace detail

/// Every slot of every local buffer of mesh position `pos`.
inline RankSlots local_slots(const Layout& L, std::int64_t pos) {
  RankSlots r;
  const auto& lbs = L.local_buffers();
  r.present.assign(lbs.size(), false);
  r.buffers.resize(lbs.size());
  for (std::size_t b = 0; b < lbs.size(); ++b) {
    const auto& lb = lbs[b];
    auto& out = r.buffers[b];
    if (lb.spec < 0) {  // a tensor stored alone
      const int t = lb.tensors[0];
      const auto h = held_sets(L, pos, t);
      if (!holds_any(h)) continue;
      r.present[b] = true;
      out = detail::local_array(L.tensors[static_cast<std::size_t>(t)], t, h);
      continue;
    }
    const auto& bs = L.buffers[static_cast<std::size_t>(lb.spec)];
    std::vector<int> parts;
    std::vector<std::vector<std::vector<std::int64_t>>> hs;
    for (const auto& name : bs.parts) {
      int t = -1;
      for (std::size_t i = 0; i < L.tensors.size(); ++i)
        if (L.tensors[i].name == name) t = static_cast<int>(i);
      auto h = held_sets(L, pos, t);
      if (!holds_any(h)) continue;
      parts.push_back(t);
      hs.push_back(std::move(h));
    }
    if (parts.empty()) continue;
    r.present[b] = true;
    if (bs.kind == BufferKind::flat) {
      std::vector<Slot> seq;
      for (std::size_t q = 0; q < parts.size(); ++q) {
        auto a = detail::local_array(L.tensors[static_cast<std::size_t>(parts[q])], parts[q], hs[q]);
        seq.insert(seq.end(), a.begin(), a.end());
      }
      const auto Ln = static_cast<std::int64_t>(seq.size());
      const auto range = held_indices(bs.flat, Ln, part_index(L.mesh, bs.flat.axes, pos));
      for (auto s : range) out.push_back(s < Ln ? seq[static_cast<std::size_t>(s)] : Slot{});
      continue;
    }
    // Concat along dim in G rounds: in round g, each part's g-th slice.
    const auto cd = static_cast<std::size_t>(bs.dim);
    const std::int64_t G = bs.interleave;
    std::vector<std::int64_t> shape;
    for (const auto& v : hs[0]) shape.push_back(static_cast<std::int64_t>(v.size()));
    std::int64_t total = 0;
    std::vector<std::int64_t> slice;  // per part, its slice along cd
    for (const auto& h : hs) {
      slice.push_back(static_cast<std::int64_t>(h[cd].size()) / G);
      total += static_cast<std::int64_t>(h[cd].size());
    }
    shape[cd] = total;
    const std::int64_t round = total / G;
    const auto& first = L.tensors[static_cast<std::size_t>(parts[0])];
    std::vector<std::int64_t> g(first.shape.size());
    detail::for_each_index(shape, [&](const std::vector<std::int64_t>& j) {
      const std::int64_t rnd = j[cd] / round;
      std::int64_t o = j[cd] % round;
      std::size_t q = 0;
      while (o >= slice[q]) {
        o -= slice[q];
        ++q;
      }
      const auto& h = hs[q];
      for (std::size_t d = 0; d < h.size(); ++d) {
        const std::int64_t local = d == cd ? rnd * slice[q] + o : j[d];
        g[d] = h[d][static_cast<std::size_t>(local)];
      }
      out.push_back(detail::tag(L.tensors[static_cast<std::size_t>(parts[q])], parts[q], g));
    });
  }
  return r;
}

/// The global index tuple of a row-major index.
inline std::vector<std::int64_t> unravel(const TensorSpec& ts, std::int64_t lin) {
  std::vector<std::int64_t> g(ts.shape.size());
  for (std::size_t d = ts.shape.size(); d-- > 0;) {
    g[d] = lin % ts.shape[d];
    lin /= ts.shape[d];
  }
  return g;
}

inline std::string describe_slot(const Layout& L, const Slot& s) {
  if (s.padding()) return "padding";
  const auto& ts = L.tensors[static_cast<std::size_t>(s.tensor)];
  return fmt::format("{}[{}]", ts.name, fmt::join(unravel(ts, s.index), ","));
}

inline std::string describe_copy(const reshard::Copy& c) {
  std::vector<std::int64_t> e, ss, ds;
  for (int d = 0; d < c.rank; ++d) {
    e.push_back(c.extent(d));
    ss.push_back(c.src_stride(d));
    ds.push_back(c.dst_stride(d));
  }
  return fmt::format("rank {} buf {} +{} -> rank {} buf {} +{}, extent [{}], src_stride [{}], dst_stride [{}], tensor {}",
                     c.src_rank, c.src_buffer, c.src_offset, c.dst_rank, c.dst_buffer, c.dst_offset,
                     fmt::join(e, ","), fmt::join(ss, ","), fmt::join(ds, ","), c.tensor);
}

// ---------------------------------------------------------------------------
// A short text form of a layout, for fault messages.

inline std::string describe_refs(const Layout& L, const std::vector<reshard::AxisRef>& refs) {
  std::vector<std::string> v;
  for (const auto& r : refs) {
    const auto& a = L.mesh.axes[static_cast<std::size_t>(r.axis)];
    v.push_back(r.stride == 1 && r.size == a.size ? a.name : fmt::format("{}/{}%{}", a.name, r.stride, r.size));
  }
  return fmt::format("{}", fmt::join(v, ","));
}

inline std::string describe_dim(const Layout& L, const DimSpec& s) {
  std::string out = s.axes.empty() ? "-" : describe_refs(L, s.axes);
  switch (s.split) {
    case Split::even: break;
    case Split::chunk: out += ":chunk"; break;
    case Split::balanced: out += ":balanced"; break;
    case Split::sizes: out += fmt::format(":sizes({})", fmt::join(s.sizes, ",")); break;
    case Split::cyclic: out += fmt::format(":cyclic{}", s.block); break;
  }
  if (s.pad_to) out += fmt::format(":pad{}", s.pad_to);
  return out;
}

inline std::string describe(const Layout& L) {
  std::vector<std::string> axes;
  for (const auto& a : L.mesh.axes) axes.push_back(fmt::format("{}={}", a.name, a.size));
  std::string out = fmt::format("mesh [{}] ", fmt::join(axes, " "));
  out += L.mesh.ranks.empty() ? fmt::format("first_rank {}", L.mesh.first_rank)
                              : fmt::format("ranks [{}]", fmt::join(L.mesh.ranks, ","));
  for (const auto& t : L.tensors) {
    std::vector<std::string> dims;
    for (int d = 0; d < static_cast<int>(t.shape.size()); ++d) dims.push_back(describe_dim(L, dim_spec(t, d)));
    out += fmt::format("\n  {} [{}] {} dims({})", t.name, fmt::join(t.shape, ","), reshard::to_string(t.dtype),
                       fmt::join(dims, " "));
    for (const auto& s : t.stage)
      out += fmt::format(" stage {}={}", L.mesh.axes[static_cast<std::size_t>(s.axis)].name, s.coord);
  }
  for (const auto& b : L.buffers) {
    if (b.kind == BufferKind::concat)
      out += fmt::format("\n  buffer {} concat({}) dim {} interleave {}", b.name, fmt::join(b.parts, ","), b.dim,
                         b.interleave);
    else
      out += fmt::format("\n  buffer {} flat({}) over {}", b.name, fmt::join(b.parts, ","), describe_dim(L, b.flat));
  }
  return out;
}

// ---------------------------------------------------------------------------
// All positions' slots of one layout, built on demand.

class SlotWorld {
 public:
  explicit SlotWorld(const Layout& L) : L_(L), ranks_(L.mesh), slots_(static_cast<std::size_t>(mesh_positions(L.mesh))) {}
  const Layout& layout() const { return L_; }
  const RankTable& ranks() const { return ranks_; }
  std::int64_t positions() const { return static_cast<std::int64_t>(slots_.size()); }
  const RankSlots& at(std::int64_t pos) {
    auto& s = slots_[static_cast<std::size_t>(pos)];
    if (!s) s = local_slots(L_, pos);
    return *s;
  }
  /// Does a position hold element `index` of tensor t in some local buffer?
  bool holds(std::int64_t pos, int t, std::int64_t index) {
    const auto key = std::make_pair(pos, t);
    auto it = held_.find(key);
    if (it == held_.end()) {
      std::vector<bool> bits(static_cast<std::size_t>(L_.tensors[static_cast<std::size_t>(t)].elements()), false);
      for (const auto& buf : at(pos).buffers)
        for (const auto& s : buf)
          if (s.tensor == t) bits[static_cast<std::size_t>(s.index)] = true;
      it = held_.emplace(key, std::move(bits)).first;
    }
    return it->second[static_cast<std::size_t>(index)];
  }

 private:
  const Layout& L_;
  RankTable ranks_;
  std::vector<std::optional<RankSlots>> slots_;
  std::map<std::pair<std::int64_t, int>, std::vector<bool>> held_;
};

// ---------------------------------------------------------------------------
// The schedule check

struct CheckOptions {
  bool minimal = true;          ///< also check that no copy crosses the network needlessly
  std::int64_t only_rank = -1;  ///< >= 0: the schedule of one rank (PlanOptions::only_rank)
};

struct CheckResult {
  bool ok = true;
  std::string fault;              ///< the first fault, in words
  std::int64_t copies = 0;        ///< copies simulated
  std::int64_t elements = 0;      ///< element copies simulated
  std::int64_t dst_elements = 0;  ///< destination slots that hold a tensor element
};

namespace detail {
/// Visits every index tuple of a copy's box with its two buffer offsets.
template <class F>
bool for_each_element(const reshard::Copy& c, F&& f) {
  const int n = c.rank;
  std::vector<std::int64_t> i(static_cast<std::size_t>(n), 0);
  while (true) {
    std::int64_t so = c.src_offset, dof = c.dst_offset;
    for (int d = 0; d < n; ++d) {
      so += i[static_cast<std::size_t>(d)] * c.src_stride(d);
      dof += i[static_cast<std::size_t>(d)] * c.dst_stride(d);
    }
    if (!f(i, so, dof)) return false;
    int d = n - 1;
    for (; d >= 0; --d) {
      if (++i[static_cast<std::size_t>(d)] < c.extent(d)) break;
      i[static_cast<std::size_t>(d)] = 0;
    }
    if (d < 0) return true;
  }
}
}  // namespace detail

/// Destination tensor id -> source tensor id, by name (-1: not in the source).
inline std::vector<int> source_of(const Layout& src, const Layout& dst) {
  std::vector<int> src_of(dst.tensors.size(), -1);
  for (std::size_t t = 0; t < dst.tensors.size(); ++t)
    for (std::size_t u = 0; u < src.tensors.size(); ++u)
      if (src.tensors[u].name == dst.tensors[t].name) src_of[t] = static_cast<int>(u);
  return src_of;
}

/// The fault when a schedule's stats are not what its copies add up to:
/// `bytes` and `local_bytes` as the oracle counted them.
inline std::optional<std::string> stats_fault(const reshard::Schedule& s, std::int64_t bytes, std::int64_t local_bytes) {
  if (s.stats.bytes == bytes && s.stats.local_bytes == local_bytes &&
      s.stats.copies == static_cast<std::int64_t>(s.copies.size()))
    return std::nullopt;
  return fmt::format("stats say bytes {} local_bytes {} copies {}, the copies add up to {} {} {}", s.stats.bytes,
                     s.stats.local_bytes, s.stats.copies, bytes, local_bytes, s.copies.size());
}

/// Completeness of a schedule's writes: the first destination slot holding
/// an element that `written` (per (position, buffer), per slot: >= 0 once
/// written) leaves unwritten, as a message; counts element slots into
/// `elements`. only_rank >= 0: that rank's slots only.
inline std::optional<std::string> unwritten_slot(
    const Layout& dst, SlotWorld& D, const std::map<std::pair<std::int64_t, std::size_t>, std::vector<std::int32_t>>& written,
    std::int64_t only_rank, std::int64_t& elements) {
  const auto& dbufs = dst.local_buffers();
  for (std::int64_t p = 0; p < D.positions(); ++p) {
    const std::int64_t rank = rank_at(dst.mesh, p);
    if (only_rank >= 0 && rank != only_rank) continue;
    const auto& dr = D.at(p);
    for (std::size_t b = 0; b < dbufs.size(); ++b) {
      if (!dr.present[b]) continue;
      auto it = written.find({p, b});
      for (std::size_t k = 0; k < dr.buffers[b].size(); ++k) {
        const Slot& to = dr.buffers[b][k];
        if (to.padding()) continue;
        ++elements;
        if (it == written.end() || it->second[k] < 0)
          return fmt::format("rank {}: {} at '{}'+{} is never written", rank, describe_slot(dst, to), dbufs[b].name, k);
      }
    }
  }
  return std::nullopt;
}

namespace detail {
/// Replays the copies of `s` slot by slot against the contract, in stage
/// order: `stage[ci]` (empty = all stage 0) and `from_dst[ci]` (empty = none:
/// the copy reads the destination buffer of its source rank, which an earlier
/// stage must have written). check_schedule and staged_oracle::check_staged
/// are this one walk; a flat schedule is a staged one with a single stage.
inline CheckResult replay(const Layout& src, const Layout& dst, const reshard::Schedule& s, const CheckOptions& opt,
                          const std::vector<std::int32_t>& stage, const std::vector<std::uint8_t>& from_dst) {
  CheckResult res;
  auto fault = [&](std::string msg) {
    res.ok = false;
    res.fault = std::move(msg);
    return res;
  };
  const bool staged = !stage.empty() || !from_dst.empty();
  if (!stage.empty() && stage.size() != s.copies.size())
    return fault(fmt::format("{} stages for {} copies", stage.size(), s.copies.size()));
  if (!from_dst.empty() && from_dst.size() != s.copies.size())
    return fault(fmt::format("{} src_layout flags for {} copies", from_dst.size(), s.copies.size()));
  const auto stage_of = [&](std::size_t ci) { return stage.empty() ? 0 : stage[ci]; };
  const auto reads_dst = [&](std::size_t ci) { return !from_dst.empty() && from_dst[ci] != 0; };
  const auto& sbufs = src.local_buffers();
  const auto& dbufs = dst.local_buffers();
  if (s.src_buffers.size() != sbufs.size() || s.dst_buffers.size() != dbufs.size())
    return fault(fmt::format("schedule names {} source and {} destination buffers, the layouts have {} and {}",
                             s.src_buffers.size(), s.dst_buffers.size(), sbufs.size(), dbufs.size()));
  for (std::size_t b = 0; b < sbufs.size(); ++b)
    if (s.src_buffers[b] != sbufs[b].name)
      return fault(fmt::format("source buffer {} is named '{}', the layout says '{}'", b, s.src_buffers[b], sbufs[b].name));
  for (std::size_t b = 0; b < dbufs.size(); ++b)
    if (s.dst_buffers[b] != dbufs[b].name)
      return fault(fmt::format("destination buffer {} is named '{}', the layout says '{}'", b, s.dst_buffers[b],
                               dbufs[b].name));
  // Destination tensor id -> source tensor id, by name.
  const std::vector<int> src_of = source_of(src, dst);
  SlotWorld S(src), D(dst);
  // writer[dst position, buffer][slot] = the copy that wrote it, -1 = none.
  std::map<std::pair<std::int64_t, std::size_t>, std::vector<std::int32_t>> writer;
  auto writer_of = [&](std::int64_t pos, std::size_t b) -> std::vector<std::int32_t>& {
    auto& w = writer[{pos, b}];
    if (w.empty()) w.assign(D.at(pos).buffers[b].size(), -1);
    return w;
  };
  std::vector<std::size_t> order(s.copies.size());
  for (std::size_t ci = 0; ci < order.size(); ++ci) order[ci] = ci;
  std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return stage_of(a) < stage_of(b); });
  std::int64_t bytes = 0, local_bytes = 0;
  for (const std::size_t ci : order) {
    const auto& c = s.copies[ci];
    const std::int32_t st = stage_of(ci);
    const bool via_dst = reads_dst(ci);
    const auto where = [&] {
      return staged ? fmt::format("copy {} (stage {}{}, {})", ci, st, via_dst ? ", src_layout dst" : "", describe_copy(c))
                    : fmt::format("copy {} ({})", ci, describe_copy(c));
    };
    if (st < 0) return fault(fmt::format("{}: negative stage", where()));
    if (c.rank < 1 || c.rank > reshard::kMaxBoxRank) return fault(fmt::format("{}: box rank {} is invalid", where(), c.rank));
    for (int d = 0; d < c.rank; ++d)
      if (c.extent(d) < 1)
        return fault(fmt::format("{}: extent {} along box dim {} is empty", where(), c.extent(d), d));
    if (opt.only_rank >= 0 && c.src_rank != opt.only_rank && c.dst_rank != opt.only_rank)
      return fault(fmt::format("{}: does not involve rank {}", where(), opt.only_rank));
    // A copy reading the destination layout takes its source from D.
    const Layout& from_layout = via_dst ? dst : src;
    SlotWorld& F = via_dst ? D : S;
    const auto& fbufs = via_dst ? dbufs : sbufs;
    const auto spos = F.ranks().position(c.src_rank);
    const auto dpos = D.ranks().position(c.dst_rank);
    if (!spos)
      return fault(fmt::format("{}: source rank {} is not in the {} mesh", where(), c.src_rank,
                               via_dst ? "destination" : "source"));
    if (!dpos) return fault(fmt::format("{}: destination rank {} is not in the destination mesh", where(), c.dst_rank));
    if (c.src_buffer < 0 || static_cast<std::size_t>(c.src_buffer) >= fbufs.size() || c.dst_buffer < 0 ||
        static_cast<std::size_t>(c.dst_buffer) >= dbufs.size())
      return fault(fmt::format("{}: buffer id out of range", where()));
    if (c.tensor < 0 || static_cast<std::size_t>(c.tensor) >= dst.tensors.size())
      return fault(fmt::format("{}: tensor id {} out of range", where(), c.tensor));
    const auto& dts = dst.tensors[static_cast<std::size_t>(c.tensor)];
    if (c.element_bytes != reshard::element_bytes(dts.dtype))
      return fault(fmt::format("{}: element_bytes {} but '{}' is {}", where(), c.element_bytes, dts.name,
                               reshard::to_string(dts.dtype)));
    const auto& sr = F.at(*spos);
    const auto& dr = D.at(*dpos);
    const auto sb = static_cast<std::size_t>(c.src_buffer), db = static_cast<std::size_t>(c.dst_buffer);
    if (!sr.present[sb])
      return fault(fmt::format("{}: rank {} has no source buffer '{}'", where(), c.src_rank, fbufs[sb].name));
    if (!dr.present[db])
      return fault(fmt::format("{}: rank {} has no destination buffer '{}'", where(), c.dst_rank, dbufs[db].name));
    const auto& sslots = sr.buffers[sb];
    const auto& dslots = dr.buffers[db];
    auto& w = writer_of(*dpos, db);
    // What the source slots hold was written by these copies (std::map keeps `w` valid).
    const std::vector<std::int32_t>* wsrc = via_dst ? &writer_of(*spos, sb) : nullptr;
    const bool local = c.src_rank == c.dst_rank && !via_dst;
    const std::optional<std::int64_t> dst_in_src = local ? std::nullopt : S.ranks().position(c.dst_rank);
    std::string msg;
    std::int64_t visited = 0;
    const bool fine = for_each_element(c, [&](const std::vector<std::int64_t>& i, std::int64_t so, std::int64_t dof) {
      const auto at = [&] { return fmt::format("{} at box index [{}]", where(), fmt::join(i, ",")); };
      if (so < 0 || so >= static_cast<std::int64_t>(sslots.size())) {
        msg = fmt::format("{}: source offset {} outside '{}' of {} elements on rank {}", at(), so, fbufs[sb].name,
                          sslots.size(), c.src_rank);
        return false;
      }
      if (dof < 0 || dof >= static_cast<std::int64_t>(dslots.size())) {
        msg = fmt::format("{}: destination offset {} outside '{}' of {} elements on rank {}", at(), dof,
                          dbufs[db].name, dslots.size(), c.dst_rank);
        return false;
      }
      const Slot& from = sslots[static_cast<std::size_t>(so)];
      const Slot& to = dslots[static_cast<std::size_t>(dof)];
      if (to.padding()) {
        msg = fmt::format("{}: writes padding at '{}'+{} on rank {} (reading {})", at(), dbufs[db].name, dof,
                          c.dst_rank, describe_slot(from_layout, from));
        return false;
      }
      if (from.padding()) {
        msg = fmt::format("{}: reads padding at '{}'+{} on rank {} (for {})", at(), fbufs[sb].name, so, c.src_rank,
                          describe_slot(dst, to));
        return false;
      }
      if (to.tensor != c.tensor) {
        msg = fmt::format("{}: writes {} but the copy says tensor {}", at(), describe_slot(dst, to), c.tensor);
        return false;
      }
      const int want = via_dst ? to.tensor : src_of[static_cast<std::size_t>(to.tensor)];
      if (want != from.tensor || from.index != to.index) {
        msg = fmt::format("{}: '{}'+{} on rank {} holds {} but reads {} from '{}'+{} on rank {}", at(), dbufs[db].name,
                          dof, c.dst_rank, describe_slot(dst, to), describe_slot(from_layout, from), fbufs[sb].name, so,
                          c.src_rank);
        return false;
      }
      if (wsrc) {
        const std::int32_t by = (*wsrc)[static_cast<std::size_t>(so)];
        if (by < 0 || stage_of(static_cast<std::size_t>(by)) >= st) {
          msg = fmt::format("{}: reads {} on rank {} before an earlier stage wrote it ({})", at(), describe_slot(dst, from),
                            c.src_rank,
                            by < 0 ? std::string("not written yet")
                                   : fmt::format("written in stage {}", stage_of(static_cast<std::size_t>(by))));
          return false;
        }
      }
      auto& wr = w[static_cast<std::size_t>(dof)];
      if (wr >= 0) {
        msg = fmt::format("{}: {} at '{}'+{} on rank {} is written again (first by copy {})", at(),
                          describe_slot(dst, to), dbufs[db].name, dof, c.dst_rank, wr);
        return false;
      }
      wr = static_cast<std::int32_t>(ci);
      if (opt.minimal && dst_in_src && S.holds(*dst_in_src, src_of[static_cast<std::size_t>(to.tensor)], to.index)) {
        msg = fmt::format("{}: not minimal: rank {} already holds {} in the source layout", at(), c.dst_rank,
                          describe_slot(dst, to));
        return false;
      }
      ++res.elements;
      ++visited;
      return true;
    });
    if (!fine) return fault(msg);
    ++res.copies;
    // Bytes counted here, from the elements visited and the tensor's dtype
    // (not the library's Copy::bytes(), which the stats under test use).
    (c.src_rank == c.dst_rank ? local_bytes : bytes) += visited * reshard::element_bytes(dts.dtype);
  }
  // Completeness: every destination slot holding an element was written.
  if (auto m = unwritten_slot(dst, D, writer, opt.only_rank, res.dst_elements)) return fault(*m);
  if (auto m = stats_fault(s, bytes, local_bytes)) return fault(*m);
  return res;
}
}  // namespace detail

/// Simulates every copy of `s` slot by slot against the contract.
inline CheckResult check_schedule(const Layout& src, const Layout& dst, const reshard::Schedule& s,
                                  const CheckOptions& opt = {}) {
  return detail::replay(src, dst, s, opt, {}, {});
}

// ---------------------------------------------------------------------------
// Balance: what each source rank sends against its even share. For every
// destination element that must cross the network (its rank does not hold
// it in the source layout), each of its R source holders owes 1/R of it.

struct Balance {
  std::vector<std::int64_t> ranks;  ///< source ranks, in position order
  std::vector<double> sent;         ///< bytes sent over the network
  std::vector<double> fair;         ///< even share of the bytes to send
  double worst_ratio = 0;           ///< max over ranks with fair > 0 of sent / fair
  std::int64_t worst_rank = -1;
  double total = 0;                 ///< network bytes of the schedule
};

inline Balance balance(const Layout& src, const Layout& dst, const reshard::Schedule& s) {
  Balance b;
  SlotWorld S(src), D(dst);
  const std::int64_t np = S.positions();
  for (std::int64_t p = 0; p < np; ++p) b.ranks.push_back(rank_at(src.mesh, p));
  b.sent.assign(static_cast<std::size_t>(np), 0);
  b.fair.assign(static_cast<std::size_t>(np), 0);
  const std::vector<int> src_of = source_of(src, dst);
  // holders[src tensor][element] = source positions holding it.
  std::map<int, std::vector<std::vector<std::int32_t>>> holders;
  auto holders_of = [&](int st) -> const std::vector<std::vector<std::int32_t>>& {
    auto it = holders.find(st);
    if (it != holders.end()) return it->second;
    std::vector<std::vector<std::int32_t>> h(static_cast<std::size_t>(src.tensors[static_cast<std::size_t>(st)].elements()));
    for (std::int64_t p = 0; p < np; ++p)
      for (const auto& buf : S.at(p).buffers)
        for (const auto& slot : buf)
          if (slot.tensor == st) h[static_cast<std::size_t>(slot.index)].push_back(static_cast<std::int32_t>(p));
    return holders.emplace(st, std::move(h)).first->second;
  };
  for (std::int64_t q = 0; q < D.positions(); ++q) {
    const auto local = S.ranks().position(rank_at(dst.mesh, q));
    for (const auto& buf : D.at(q).buffers)
      for (const auto& slot : buf) {
        if (slot.padding()) continue;
        const int st = src_of[static_cast<std::size_t>(slot.tensor)];
        if (local && S.holds(*local, st, slot.index)) continue;
        const auto& h = holders_of(st)[static_cast<std::size_t>(slot.index)];
        const double share = static_cast<double>(reshard::element_bytes(dst.tensors[static_cast<std::size_t>(slot.tensor)].dtype)) /
                             static_cast<double>(h.size());
        for (auto p : h) b.fair[static_cast<std::size_t>(p)] += share;
      }
  }
  for (const auto& c : s.copies) {
    if (c.is_local()) continue;
    const auto p = S.ranks().position(c.src_rank);
    if (!p) continue;
    b.sent[static_cast<std::size_t>(*p)] += static_cast<double>(c.bytes());
    b.total += static_cast<double>(c.bytes());
  }
  for (std::int64_t p = 0; p < np; ++p) {
    const auto up = static_cast<std::size_t>(p);
    if (b.fair[up] <= 0) {
      if (b.sent[up] > 0) {
        b.worst_ratio = 1e300;
        b.worst_rank = b.ranks[up];
      }
      continue;
    }
    const double r = b.sent[up] / b.fair[up];
    if (r > b.worst_ratio) {
      b.worst_ratio = r;
      b.worst_rank = b.ranks[up];
    }
  }
  return b;
}

inline std::string describe(const Balance& b) {
  std::string out = fmt::format("worst {:.3f}x on rank {}; sent/fair:", b.worst_ratio, b.worst_rank);
  for (std::size_t p = 0; p < b.ranks.size(); ++p)
    out += fmt::format(" r{} {:.0f}/{:.0f}", b.ranks[p], b.sent[p], b.fair[p]);
  return out;
}

}  // namespace oracle
