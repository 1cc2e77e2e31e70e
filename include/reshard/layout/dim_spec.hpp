#pragma once
// DimSpec: how one tensor dim is cut over mesh axes (CONTRACT.md §1 "dimspec"),
// and DimCut: the resolved cut of a concrete extent into k parts, which
// answers "which global indices does part p hold, at which local index".
#include <algorithm>
#include <cstdint>
#include <iterator>
#include <numeric>
#include <string>
#include <vector>

#include "../base/error.hpp"
#include "mesh.hpp"

namespace reshard {

/// Most dims a tensor can have.
inline constexpr int kMaxTensorRank = 8;

enum class Split : std::uint8_t { even, chunk, balanced, sizes, cyclic };

struct DimSpec {
  std::vector<AxisRef> axes;       ///< major to minor; empty = not cut
  Split split = Split::even;       ///< how contiguous parts are cut (or cyclic)
  std::vector<std::int64_t> sizes; ///< Split::sizes: k part sizes
  std::int64_t block = 0;          ///< Split::cyclic: block size B
  std::int64_t pad_to = 0;         ///< padded extent P (0 = none)

  bool is_cut() const { return !axes.empty(); }
  std::int64_t parts() const {
    std::int64_t k = 1;
    for (const auto& a : axes) k *= a.size;
    return k;
  }
  /// The part index of a mesh position: mixed radix over the referenced digits.
  std::int64_t part_of(const Mesh& m, std::int64_t pos) const {
    std::int64_t p = 0;
    for (const auto& a : axes) p = p * a.size + m.digit(pos, a);
    return p;
  }
};

/// The index set one part holds along a dim: a contiguous range [lo, hi) of
/// the padded extent, or the blocks of a block-cyclic pattern. Local index j
/// is the j-th smallest held index (padding included).
struct DimPart {
  bool cyclic = false;
  std::int64_t lo = 0, hi = 0;        ///< contiguous: held range of [0, P)
  std::int64_t p = 0, k = 1, B = 1;   ///< cyclic: part p of k, block B
  std::int64_t padded = 0;            ///< P
  std::int64_t local_extent = 0;      ///< |H|

  std::int64_t global(std::int64_t j) const {
    if (!cyclic) return lo + j;
    return (j / B) * k * B + p * B + j % B;
  }
  /// Local index of a held global index i.
  std::int64_t local(std::int64_t i) const {
    if (!cyclic) return i - lo;
    return (i / (k * B)) * B + i % B;
  }
  bool holds(std::int64_t i) const {
    if (i < 0 || i >= padded) return false;
    if (!cyclic) return i >= lo && i < hi;
    return (i / B) % k == p;
  }
  /// Smallest held index >= i (padded if none).
  std::int64_t next_held(std::int64_t i) const {
    if (!cyclic) return i < lo ? lo : (i < hi ? i : padded);
    std::int64_t b = i / B;
    const std::int64_t r = ((p - b % k) % k + k) % k;
    if (r == 0) return i;
    b += r;
    return std::min(b * B, padded);
  }
  /// End of the run of held indices that contains held index i.
  std::int64_t run_end(std::int64_t i) const {
    if (!cyclic) return hi;
    return std::min((i / B + 1) * B, padded);
  }
};

/// A dimspec resolved against an extent: the cut points of all k parts.
struct DimCut {
  std::int64_t extent = 0;   ///< n, real elements
  std::int64_t padded = 0;   ///< P >= n
  std::int64_t k = 1;
  bool cyclic = false;
  std::int64_t B = 1;
  std::vector<std::int64_t> cuts;  ///< contiguous: k+1 cut points of [0, P)

  DimPart part(std::int64_t p) const {
    DimPart d;
    d.padded = padded;
    if (!cyclic) {
      d.lo = cuts[static_cast<std::size_t>(p)];
      d.hi = cuts[static_cast<std::size_t>(p) + 1];
      d.local_extent = d.hi - d.lo;
      return d;
    }
    d.cyclic = true;
    d.p = p;
    d.k = k;
    d.B = B;
    const std::int64_t period = k * B, full = padded / period;
    d.local_extent = full * B + std::clamp(padded - full * period - p * B, std::int64_t{0}, B);
    d.lo = 0;
    d.hi = padded;
    return d;
  }

  /// Parts whose held indices meet [glo, ghi), in increasing order.
  template <class F>
  void for_parts_meeting(std::int64_t glo, std::int64_t ghi, F&& f) const {
    if (glo >= ghi) return;
    if (!cyclic) {
      auto first = std::upper_bound(cuts.begin(), cuts.end(), glo) - cuts.begin() - 1;
      for (auto p = std::max<std::int64_t>(first, 0); p < k && cuts[static_cast<std::size_t>(p)] < ghi; ++p)
        if (cuts[static_cast<std::size_t>(p) + 1] > cuts[static_cast<std::size_t>(p)] &&
            cuts[static_cast<std::size_t>(p) + 1] > glo)
          f(p);
      return;
    }
    const std::int64_t b0 = glo / B, b1 = (ghi - 1) / B;
    if (b1 - b0 + 1 >= k) {
      for (std::int64_t p = 0; p < k; ++p) f(p);
      return;
    }
    std::vector<std::int64_t> ps;
    for (std::int64_t b = b0; b <= b1; ++b) ps.push_back(b % k);
    std::sort(ps.begin(), ps.end());
    ps.erase(std::unique(ps.begin(), ps.end()), ps.end());
    for (auto p : ps) f(p);
  }
};

/// What is wrong with cutting a dim of `extent` elements, padded to `padded`, into `parts` parts by
/// `split` (`sizes`: the explicit part sizes), the first fault in this order. One code path for the
/// validated Layout (resolve_dim) and the compile-time layouts (static_layout.hpp), where a value
/// < 0 is not known until runtime and the rules that need it wait for the Layout.
enum class CutFault : std::uint8_t { none, padded_below_extent, even_split_does_not_divide, sizes_count, size_negative,
                                     sizes_overflow, sizes_sum };
template <class Sizes>
constexpr CutFault cut_fault(Split split, std::int64_t extent, std::int64_t padded, std::int64_t parts, const Sizes& sizes) {
  if (padded >= 0 && extent >= 0 && padded < extent) return CutFault::padded_below_extent;
  if (split == Split::even && parts >= 1 && padded >= 0 && padded % parts != 0) return CutFault::even_split_does_not_divide;
  if (split != Split::sizes) return CutFault::none;
  if (parts >= 1 && static_cast<std::int64_t>(std::size(sizes)) != parts) return CutFault::sizes_count;
  std::int64_t sum = 0;
  for (const std::int64_t z : sizes) {
    if (z < 0) return CutFault::size_negative;
    if (__builtin_add_overflow(sum, z, &sum)) return CutFault::sizes_overflow;
  }
  return padded >= 0 && sum != padded ? CutFault::sizes_sum : CutFault::none;
}

/// Resolves `spec` against extent n, or throws LayoutError naming `ctx`.
inline DimCut resolve_dim(const DimSpec& spec, std::int64_t n, const ErrorContext& ctx) {
  DimCut c;
  c.extent = n;
  c.padded = spec.pad_to ? spec.pad_to : n;
  const std::int64_t P = c.padded;
  c.k = spec.parts();
  const std::int64_t k = c.k;
  switch (cut_fault(spec.split, n, P, k, spec.sizes)) {
    case CutFault::none: break;
    case CutFault::padded_below_extent: layout_fail(ctx, "pad_to {} is below the extent {}", spec.pad_to, n);
    case CutFault::even_split_does_not_divide:
      layout_fail(ctx, "even split of extent {} into {} parts does not divide", P, k);
    case CutFault::sizes_count:
      layout_fail(ctx, "explicit split lists {} sizes but the axes make {} parts", spec.sizes.size(), k);
    case CutFault::size_negative:
      layout_fail(ctx, "explicit size {} is negative", *std::find_if(spec.sizes.begin(), spec.sizes.end(), [](auto z) { return z < 0; }));
    case CutFault::sizes_overflow: layout_fail(ctx, "explicit sizes overflow");
    case CutFault::sizes_sum:
      layout_fail(ctx, "explicit sizes sum to {} but the {} extent is {}",
                   std::accumulate(spec.sizes.begin(), spec.sizes.end(), std::int64_t{0}), spec.pad_to ? "padded" : "dim", P);
  }
  if (spec.split == Split::cyclic) {
    if (spec.block < 1) layout_fail(ctx, "cyclic block size {} must be >= 1", spec.block);
    c.cyclic = true;
    c.B = spec.block;
    return c;
  }
  c.cuts.resize(static_cast<std::size_t>(k) + 1);
  switch (spec.split) {
    case Split::even:
      for (std::int64_t p = 0; p <= k; ++p) c.cuts[static_cast<std::size_t>(p)] = p * (P / k);
      break;
    case Split::chunk: {
      const std::int64_t q = (P + k - 1) / k;
      for (std::int64_t p = 0; p <= k; ++p) c.cuts[static_cast<std::size_t>(p)] = std::min(P, p * q);
      break;
    }
    case Split::balanced: {
      const std::int64_t q = P / k, r = P % k;
      for (std::int64_t p = 0; p <= k; ++p) c.cuts[static_cast<std::size_t>(p)] = p * q + std::min(p, r);
      break;
    }
    case Split::sizes: {  // cut_fault checked the count, the signs, the sum
      std::int64_t s = 0;
      for (std::size_t p = 0; p < spec.sizes.size(); ++p) {
        c.cuts[p] = s;
        s += spec.sizes[p];
      }
      c.cuts[static_cast<std::size_t>(k)] = s;
      break;
    }
    case Split::cyclic: break;
  }
  return c;
}

}  // namespace reshard
