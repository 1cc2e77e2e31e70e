#pragma once
// The strided box: the one shape of data movement in reshard. A box is `rank`
// dims, each with an extent, and two sides (source and destination), each
// with an element offset and a stride per dim: element i of the box is
//   src[src_offset + sum_k i_k * src_stride(k)] on one side and
//   dst[dst_offset + sum_k i_k * dst_stride(k)] on the other,
// std::mdspan's layout_stride mapping twice over one extents. A schedule Copy
// is a box with a route; the executor's parts are boxes in view coordinates
// (a one-sided part leaves the other side's offset and strides 0).
//
// Variable rank: up to kInlineRank dims live inside the box (every copy of
// the preset plans has rank 1 or 2, and a full plan holds millions of them);
// a box that needs more dims moves them to the heap, up to kMaxBoxRank.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <utility>

#include "../base/error.hpp"

namespace reshard {

/// Most dims a box can have. A piece of a tensor of rank n can need up to 2n
/// dims (a periodic run set becomes count x length); the planner cuts such
/// rare pieces into several boxes of at most kMaxBoxRank dims.
inline constexpr int kMaxBoxRank = 8;

/// Drops unit dims and merges dims that are contiguous on both sides, in
/// place on dims [0, rank) of three parallel arrays; returns the new rank
/// (>= 1: a single element keeps one unit dim so the box has a shape). Dims
/// past the new rank are left as they were. The one collapse routine: boxes,
/// the planner's scratch dims and the device descriptors all use it.
template <class Ext>
int collapse_dims(int rank, Ext& extent, Ext& src_stride, Ext& dst_stride) {
  int r = 0;
  for (int d = 0; d < rank; ++d) {
    const auto ud = static_cast<std::size_t>(d);
    if (extent[ud] == 1) continue;
    if (r > 0) {
      const auto up = static_cast<std::size_t>(r - 1);
      if (src_stride[up] == src_stride[ud] * extent[ud] && dst_stride[up] == dst_stride[ud] * extent[ud]) {
        extent[up] *= extent[ud];
        src_stride[up] = src_stride[ud];
        dst_stride[up] = dst_stride[ud];
        continue;
      }
    }
    const auto ur = static_cast<std::size_t>(r);
    extent[ur] = extent[ud];
    src_stride[ur] = src_stride[ud];
    dst_stride[ur] = dst_stride[ud];
    ++r;
  }
  if (r == 0) {
    extent[0] = 1;
    src_stride[0] = dst_stride[0] = 1;
    r = 1;
  }
  return r;
}

/// A box of `rank` dims on two sides: see the top of this file.
class StridedBox {
 public:
  static constexpr int kInlineRank = 2;

  std::int64_t src_offset = 0, dst_offset = 0;  ///< in elements

  StridedBox() = default;
  StridedBox(const StridedBox& o) : src_offset(o.src_offset), dst_offset(o.dst_offset), rank(o.rank) { copy_dims(o); }
  StridedBox(StridedBox&& o) noexcept : src_offset(o.src_offset), dst_offset(o.dst_offset), rank(o.rank) { take_dims(o); }
  StridedBox& operator=(const StridedBox& o) {
    if (this != &o) {
      src_offset = o.src_offset;
      dst_offset = o.dst_offset;
      rank = o.rank;
      copy_dims(o);
    }
    return *this;
  }
  StridedBox& operator=(StridedBox&& o) noexcept {
    if (this != &o) {
      src_offset = o.src_offset;
      dst_offset = o.dst_offset;
      rank = o.rank;
      delete[] heap_;
      heap_ = nullptr;
      take_dims(o);
    }
    return *this;
  }
  ~StridedBox() { delete[] heap_; }

  // Dims past the storage read 0; writing dim d makes room for it.
  std::int64_t extent(int d) const { return get(0, d); }
  std::int64_t src_stride(int d) const { return get(1, d); }
  std::int64_t dst_stride(int d) const { return get(2, d); }
  std::int64_t stride(int side, int d) const { return get(1 + side, d); }
  std::int64_t& extent(int d) { return at(0, d); }
  std::int64_t& src_stride(int d) { return at(1, d); }
  std::int64_t& dst_stride(int d) { return at(2, d); }
  std::int64_t& stride(int side, int d) { return at(1 + side, d); }
  std::int64_t offset(int side) const { return side == 0 ? src_offset : dst_offset; }
  std::int64_t& offset(int side) { return side == 0 ? src_offset : dst_offset; }

  /// The `rank` extents / one side's `rank` strides, contiguous (what the
  /// copy kernels take).
  const std::int64_t* extents() const { return array(0); }
  const std::int64_t* strides(int side) const { return array(1 + side); }
  /// Room for dims [0, r) (r <= kMaxBoxRank), then one side's strides to write.
  std::int64_t* strides_for(int side, int r) { return array_for(1 + side, r); }

  std::int64_t elements() const {
    std::int64_t n = 1;
    for (int d = 0; d < rank; ++d) n *= extent(d);
    return n;
  }
  /// Both sides one contiguous run (rank <= 1 with unit strides).
  bool contiguous() const { return rank == 0 || (rank == 1 && src_stride(0) == 1 && dst_stride(0) == 1); }

  /// Sets rank and dims from three arrays of r values (not this box's own).
  void assign(int r, const std::int64_t* ext, const std::int64_t* ss, const std::int64_t* ds) {
    reserve(r);
    rank = r;
    std::int64_t* w = words();
    const auto n = static_cast<std::size_t>(r);
    std::copy_n(ext, n, w);
    std::copy_n(ss, n, w + capacity());
    std::copy_n(ds, n, w + 2 * capacity());
    zero_past_rank();
  }

  /// Side `side` of b as this box's side 0 (offset, extents, strides), the
  /// other side 0: the one-sided box the executor and the delta streams walk.
  void assign_side(const StridedBox& b, int side) {
    const std::int64_t none[kMaxBoxRank] = {};
    assign(b.rank, b.extents(), b.strides(side), none);
    src_offset = b.offset(side);
    dst_offset = 0;
  }

  /// collapse_dims on the box; dims past the new rank read 0 and a box that
  /// fits inline again moves back inline.
  void collapse() {
    const int cap = capacity();
    std::int64_t *e = words(), *ss = e + cap, *ds = e + 2 * cap;
    rank = collapse_dims(rank, e, ss, ds);
    zero_past_rank();
    if (heap_ && rank <= kInlineRank) {
      for (int a = 0; a < 3; ++a) std::copy_n(heap_ + a * cap, kInlineRank, inline_ + a * kInlineRank);
      delete[] heap_;
      heap_ = nullptr;
    }
  }

  /// Adds an outer dim 0 (extent, source stride, destination stride).
  void push_outer(std::int64_t e, std::int64_t ss, std::int64_t ds) {
    if (rank >= kMaxBoxRank) fail("strided box: a box has at most {} dims", kMaxBoxRank);
    reserve(rank + 1);
    const int cap = capacity();
    std::int64_t* w = words();
    for (int a = 0; a < 3; ++a) std::copy_backward(w + a * cap, w + a * cap + rank, w + a * cap + rank + 1);
    w[0] = e;
    w[cap] = ss;
    w[2 * cap] = ds;
    ++rank;
  }

  /// Dims [af, a.rank) of a equal dims [bf, b.rank) of b, on both sides.
  friend bool same_dims(const StridedBox& a, int af, const StridedBox& b, int bf) {
    if (a.rank - af != b.rank - bf) return false;
    for (int d = 0; d < a.rank - af; ++d)
      if (a.extent(af + d) != b.extent(bf + d) || a.src_stride(af + d) != b.src_stride(bf + d) ||
          a.dst_stride(af + d) != b.dst_stride(bf + d))
        return false;
    return true;
  }
  /// Same offsets, rank and dims (what is stored past the rank is not part of a box).
  friend bool operator==(const StridedBox& a, const StridedBox& b) {
    return a.src_offset == b.src_offset && a.dst_offset == b.dst_offset && same_dims(a, 0, b, 0);
  }

  int capacity() const { return heap_ ? kMaxBoxRank : kInlineRank; }
  void reserve(int r) {
    if (r <= capacity()) return;
    if (r > kMaxBoxRank) fail("strided box: {} dims asked, a box has at most {}", r, kMaxBoxRank);
    auto* h = new std::int64_t[3 * kMaxBoxRank]();
    for (int a = 0; a < 3; ++a) std::copy_n(inline_ + a * kInlineRank, kInlineRank, h + a * kMaxBoxRank);
    heap_ = h;
  }

 private:
  std::int64_t* heap_ = nullptr;  ///< 3 x kMaxBoxRank words once a dim past kInlineRank is written
  std::int64_t inline_[3 * kInlineRank] = {};

 public:
  std::int32_t rank = 0;  ///< number of dims (last, so a derived type's small fields fill the padding after it)

 private:
  std::int64_t* words() { return heap_ ? heap_ : inline_; }
  const std::int64_t* words() const { return heap_ ? heap_ : inline_; }
  std::int64_t get(int a, int d) const { return d < capacity() ? words()[a * capacity() + d] : 0; }
  std::int64_t& at(int a, int d) {
    reserve(d + 1);
    return words()[a * capacity() + d];
  }
  const std::int64_t* array(int a) const {
    if (rank > capacity()) fail("strided box: rank {} set without its dims", rank);
    return words() + a * capacity();
  }
  std::int64_t* array_for(int a, int r) {
    reserve(r);
    return words() + a * capacity();
  }
  void zero_past_rank() {
    const int cap = capacity();
    std::int64_t* w = words();
    for (int a = 0; a < 3; ++a) std::fill(w + a * cap + std::min(rank, cap), w + (a + 1) * cap, 0);
  }
  void copy_dims(const StridedBox& o) {
    if (o.heap_ && o.rank > kInlineRank) {
      reserve(kMaxBoxRank);
      std::copy_n(o.heap_, 3 * kMaxBoxRank, heap_);
      return;
    }
    delete[] heap_;
    heap_ = nullptr;
    const int cap = o.capacity();
    for (int a = 0; a < 3; ++a) std::copy_n(o.words() + a * cap, kInlineRank, inline_ + a * kInlineRank);
  }
  void take_dims(StridedBox& o) {
    if (o.heap_) {
      heap_ = std::exchange(o.heap_, nullptr);
      return;
    }
    std::memcpy(inline_, o.inline_, sizeof inline_);
  }
};

namespace detail {
/// b starts where a's outermost dim would take its next step, on both sides.
inline bool next_step(const StridedBox& a, const StridedBox& b) {
  return b.src_offset == a.src_offset + a.extent(0) * a.src_stride(0) &&
         b.dst_offset == a.dst_offset + a.extent(0) * a.dst_stride(0);
}
/// b continues a along a's outermost dim on both sides (b's own outermost
/// dim may be a unit one, whose strides mean nothing).
inline bool extends(const StridedBox& a, const StridedBox& b) {
  if (a.rank != b.rank || !same_dims(a, 1, b, 1)) return false;
  if (b.extent(0) != 1 && (a.src_stride(0) != b.src_stride(0) || a.dst_stride(0) != b.dst_stride(0))) return false;
  return next_step(a, b);
}
/// b is one more slice of a's outermost dim: b's box is a's inner box.
inline bool adds_slice(const StridedBox& a, const StridedBox& b) {
  return a.rank == b.rank + 1 && same_dims(a, 1, b, 0) && next_step(a, b);
}

/// Merges b into a when their union is one box whose row-major order is a's
/// elements then b's: b continues a along its outermost dim, is one more
/// slice of that dim, or is an equal box at some distance (which becomes a
/// new outer dim). The one merge routine: the schedule stacks copies with it
/// and the executor its parts (sides 1: a one-sided part, whose destination
/// side is all 0).
inline bool merge_into(StridedBox& a, const StridedBox& b, int sides = 2) {
  if (extends(a, b)) {
    a.extent(0) += b.extent(0);
  } else if (a.rank == 1 && a.extent(0) == 1 && b.rank == 1 && b.src_offset == a.src_offset + b.src_stride(0) &&
             b.dst_offset == a.dst_offset + b.dst_stride(0)) {
    // a single element that b's run continues backwards (a's strides mean nothing)
    a.extent(0) = b.extent(0) + 1;
    a.src_stride(0) = b.src_stride(0);
    a.dst_stride(0) = b.dst_stride(0);
  } else if (adds_slice(a, b)) {
    a.extent(0) += 1;
  } else {
    const std::int64_t ds = b.src_offset - a.src_offset, dd = b.dst_offset - a.dst_offset;
    if (a.rank != b.rank || !same_dims(a, 0, b, 0) || a.rank >= kMaxBoxRank || ds == 0 || (sides > 1 && dd == 0))
      return false;
    a.push_outer(2, ds, dd);
  }
  a.collapse();
  return true;
}
}  // namespace detail

}  // namespace reshard
