#pragma once
// Mesh: named axes over a set of global ranks, row-major (first axis slowest).
// A mesh position p is the row-major index of a coordinate tuple; its global
// rank is first_rank + p, or ranks[p] when an explicit list is given.
#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "../base/error.hpp"

namespace reshard {

struct Axis {
  std::string name;
  std::int64_t size = 1;
};

/// A reference to a mesh axis or to a sub-axis of it: the digit
/// (c / stride) % size of the rank's coordinate c on that axis. `size` 0
/// (the default, as the JSON's omitted "size") is the rest of the axis,
/// axis size / stride: `AxisRef{tp}` cuts over the whole tp axis. Layout
/// validation resolves it; an explicit 1 is a cut into one part.
struct AxisRef {
  int axis = 0;
  std::int64_t stride = 1;
  std::int64_t size = 0;
  friend bool operator==(const AxisRef&, const AxisRef&) = default;
};

// The sub-axis rules, one code path for the validated Layout (layout.hpp) and the compile-time
// layouts (static_layout.hpp, which knows some sizes only at runtime: a size < 1 there is not known
// yet, and reaches to the end of the axis).

/// Does the sub-axis [stride, stride * size) fit its axis: stride * size (stride alone when the size
/// is not known) divides the axis size, without overflow?
constexpr bool sub_axis_divides(std::int64_t axis_size, std::int64_t stride, std::int64_t size) {
  std::int64_t span = stride;
  if (size >= 1 && __builtin_mul_overflow(stride, size, &span)) return false;
  return span >= 1 && axis_size % span == 0;
}

/// Do two sub-axes of one axis share a digit?
constexpr bool sub_axes_overlap(std::int64_t a_stride, std::int64_t a_size, std::int64_t b_stride, std::int64_t b_size) {
  const bool a_reaches = b_size < 1 || a_stride < b_stride * b_size;
  const bool b_reaches = a_size < 1 || b_stride < a_stride * a_size;
  return a_reaches && b_reaches;
}

class Mesh {
 public:
  std::vector<Axis> axes;
  std::int64_t first_rank = 0;
  std::vector<std::int64_t> ranks;  ///< explicit global ranks, one per position; empty = contiguous

  /// Number of positions (product of axis sizes). Valid after validate().
  std::int64_t size() const { return size_; }
  int rank_count() const { return static_cast<int>(size_); }

  int axis_index(std::string_view name) const {
    for (std::size_t i = 0; i < axes.size(); ++i)
      if (axes[i].name == name) return static_cast<int>(i);
    return -1;
  }

  std::int64_t global_rank(std::int64_t pos) const {
    return ranks.empty() ? first_rank + pos : ranks[static_cast<std::size_t>(pos)];
  }

  /// Position of a global rank in this mesh, if it belongs to it.
  std::optional<std::int64_t> position_of(std::int64_t rank) const {
    if (ranks.empty()) {
      if (rank < first_rank || rank >= first_rank + size_) return std::nullopt;
      return rank - first_rank;
    }
    auto it = rank_to_pos_.find(rank);
    if (it == rank_to_pos_.end()) return std::nullopt;
    return it->second;
  }

  /// Coordinate of a position on an axis.
  std::int64_t coord(std::int64_t pos, int axis) const {
    return (pos / axis_stride_[static_cast<std::size_t>(axis)]) %
           axes[static_cast<std::size_t>(axis)].size;
  }
  std::int64_t digit(std::int64_t pos, const AxisRef& r) const {
    return (coord(pos, r.axis) / r.stride) % r.size;
  }
  /// Row-major stride of an axis in position space.
  std::int64_t axis_stride(int axis) const { return axis_stride_[static_cast<std::size_t>(axis)]; }

  /// Checks sizes and rank lists and builds lookup tables. `ctx.field` is
  /// extended with the failing field.
  void validate(ErrorContext ctx) {
    ctx.tensor.clear();
    if (axes.empty()) layout_fail(with(ctx, "mesh.axes"), "a mesh needs at least one axis");
    size_ = 1;
    for (std::size_t i = 0; i < axes.size(); ++i) {
      const auto field = fmt::format("mesh.axes[{}]", i);
      if (axes[i].name.empty()) layout_fail(with(ctx, field), "axis name is empty");
      if (axes[i].size < 1)
        layout_fail(with(ctx, field), "axis '{}' has size {}, sizes must be >= 1", axes[i].name,
                    axes[i].size);
      for (std::size_t j = 0; j < i; ++j)
        if (axes[j].name == axes[i].name)
          layout_fail(with(ctx, field), "axis '{}' appears twice", axes[i].name);
      if (__builtin_mul_overflow(size_, axes[i].size, &size_) || size_ > (std::int64_t{1} << 31))
        layout_fail(with(ctx, field), "mesh has too many positions (product of axis sizes overflows)");
    }
    axis_stride_.assign(axes.size(), 1);
    for (int i = static_cast<int>(axes.size()) - 2; i >= 0; --i)
      axis_stride_[static_cast<std::size_t>(i)] =
          axis_stride_[static_cast<std::size_t>(i) + 1] * axes[static_cast<std::size_t>(i) + 1].size;
    rank_to_pos_.clear();
    if (!ranks.empty()) {
      if (static_cast<std::int64_t>(ranks.size()) != size_)
        layout_fail(with(ctx, "mesh.ranks"), "lists {} ranks but the mesh has {} positions",
                    ranks.size(), size_);
      for (std::size_t p = 0; p < ranks.size(); ++p) {
        if (ranks[p] < 0)
          layout_fail(with(ctx, fmt::format("mesh.ranks[{}]", p)), "rank {} is negative", ranks[p]);
        if (!rank_to_pos_.emplace(ranks[p], static_cast<std::int64_t>(p)).second)
          layout_fail(with(ctx, fmt::format("mesh.ranks[{}]", p)), "duplicate rank {}", ranks[p]);
      }
    } else if (first_rank < 0) {
      layout_fail(with(ctx, "mesh.first_rank"), "first_rank {} is negative", first_rank);
    }
  }

  /// All global ranks of the mesh, in position order.
  std::vector<std::int64_t> global_ranks() const {
    std::vector<std::int64_t> out(static_cast<std::size_t>(size_));
    for (std::int64_t p = 0; p < size_; ++p) out[static_cast<std::size_t>(p)] = global_rank(p);
    return out;
  }

 private:
  static ErrorContext with(ErrorContext c, const std::string& f) {
    c.field = f;
    return c;
  }
  std::int64_t size_ = 0;
  std::vector<std::int64_t> axis_stride_;
  std::unordered_map<std::int64_t, std::int64_t> rank_to_pos_;
};

}  // namespace reshard
