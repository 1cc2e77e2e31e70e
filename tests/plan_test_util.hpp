#pragma once
// Helpers shared by the planner tests: compact layout builders, element
// expansion of schedules and copy comparison.
#include <algorithm>
#include <array>
#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "oracle.hpp"
#include "reshard/plan/plan.hpp"

namespace plantest {

using namespace reshard;

/// One element move of a schedule: (dst rank, dst buffer, dst offset, src rank, src buffer, src offset).
using Move = std::array<std::int64_t, 6>;

/// Every element move of a schedule, sorted.
inline std::vector<Move> moves(const Schedule& s) {
  std::vector<Move> out;
  for (const auto& c : s.copies)
    oracle::detail::for_each_element(c, [&](const std::vector<std::int64_t>&, std::int64_t so, std::int64_t dof) {
      out.push_back(Move{c.dst_rank, c.dst_buffer, dof, c.src_rank, c.src_buffer, so});
      return true;
    });
  std::sort(out.begin(), out.end());
  return out;
}

inline auto copy_key(const Copy& c) {
  auto box = [&](int side) {  // side -1: the extents
    std::vector<std::int64_t> v;
    for (int d = 0; d < c.rank; ++d) v.push_back(side < 0 ? c.extent(d) : c.stride(side, d));
    return v;
  };
  return std::make_tuple(c.src_rank, c.dst_rank, c.src_buffer, c.dst_buffer, c.tensor, c.element_bytes, c.src_offset,
                         c.dst_offset, c.rank, box(-1), box(0), box(1));
}

/// The copies as a sorted multiset of their fields.
inline auto copy_multiset(const std::vector<Copy>& cs) {
  std::vector<decltype(copy_key(cs.front()))> v;
  for (const auto& c : cs) v.push_back(copy_key(c));
  std::sort(v.begin(), v.end());
  return v;
}

/// A reference to a whole axis (of a LayoutSpec or a Layout).
inline AxisRef ax(const LayoutSpec& L, const std::string& name) {
  const int a = L.mesh.axis_index(name);
  if (a < 0) fail("test layout: no axis '{}'", name);
  return AxisRef{a, 1, L.mesh.axes[static_cast<std::size_t>(a)].size};
}
/// A sub-axis {axis, stride, size}.
inline AxisRef sub(const LayoutSpec& L, const std::string& name, std::int64_t stride, std::int64_t size) {
  return AxisRef{ax(L, name).axis, stride, size};
}

inline DimSpec cut(std::vector<AxisRef> axes, Split split = Split::even) {
  DimSpec d;
  d.axes = std::move(axes);
  d.split = split;
  return d;
}
inline DimSpec cyclic(std::vector<AxisRef> axes, std::int64_t block) {
  DimSpec d = cut(std::move(axes), Split::cyclic);
  d.block = block;
  return d;
}
inline DimSpec padded(DimSpec d, std::int64_t pad_to) {
  d.pad_to = pad_to;
  return d;
}

inline LayoutSpec mesh_layout(std::vector<Axis> axes, std::int64_t first_rank = 0, std::vector<std::int64_t> ranks = {}) {
  LayoutSpec L;
  L.mesh.axes = std::move(axes);
  L.mesh.first_rank = first_rank;
  L.mesh.ranks = std::move(ranks);
  return L;
}

inline TensorSpec& add_tensor(LayoutSpec& L, std::string name, std::vector<std::int64_t> shape, std::vector<DimSpec> dims = {},
                              DType dtype = DType::bf16) {
  L.tensors.push_back(tensor_spec(std::move(name), std::move(shape), dtype, std::move(dims)));
  return L.tensors.back();
}

/// A validated layout on a mesh of `axes` holding one tensor "w".
inline Layout one_tensor(std::vector<Axis> axes, std::vector<std::int64_t> shape, std::int64_t first_rank = 0,
                         std::vector<DimSpec> dims = {}, DType dtype = DType::bf16) {
  LayoutSpec L = mesh_layout(std::move(axes), first_rank);
  add_tensor(L, "w", std::move(shape), std::move(dims), dtype);
  return Layout(std::move(L));
}

inline void add_concat(LayoutSpec& L, std::string name, std::vector<std::string> parts, int dim = 0, std::int64_t interleave = 1) {
  L.buffers.push_back(concat_buffer(std::move(name), std::move(parts), dim, interleave));
}

inline void add_flat(LayoutSpec& L, std::string name, std::vector<std::string> parts, DimSpec flat) {
  BufferSpec b;
  b.name = std::move(name);
  b.parts = std::move(parts);
  b.kind = BufferKind::flat;
  b.flat = std::move(flat);
  L.buffers.push_back(std::move(b));
}

/// Plans src -> dst and runs the oracle; returns the schedule.
struct Checked {
  Schedule schedule;
  oracle::CheckResult result;
};
inline Checked plan_and_check(const Layout& src, const Layout& dst, const PlanOptions& opt = {},
                              const oracle::CheckOptions& copt = {}) {
  Checked c;
  c.schedule = plan(src, dst, opt);
  c.result = oracle::check_schedule(src, dst, c.schedule, copt);
  return c;
}

/// Copies between one ordered pair of ranks.
inline std::int64_t copies_between(const Schedule& s, std::int64_t from, std::int64_t to) {
  return std::count_if(s.copies.begin(), s.copies.end(),
                       [&](const Copy& c) { return c.src_rank == from && c.dst_rank == to; });
}

/// Distinct (src rank, dst rank) pairs of a schedule.
inline std::int64_t peer_pairs(const Schedule& s) {
  std::vector<std::pair<std::int64_t, std::int64_t>> v;
  for (const auto& c : s.copies) v.emplace_back(c.src_rank, c.dst_rank);
  std::sort(v.begin(), v.end());
  return std::unique(v.begin(), v.end()) - v.begin();
}

}  // namespace plantest
