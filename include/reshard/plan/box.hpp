#pragma once
// Index sets and boxes: along one dim, the global indices two ranks both hold
// are a union of runs. intersect_dim() returns them as RunGroups: a run of
// `len` indices repeated `count` times at a fixed period, with the local index
// of each occurrence on both sides. A group is one or two box dims of a copy
// (count x len), so block-cyclic patterns never expand element by element.
#include <algorithm>
#include <array>
#include <cstdint>
#include <numeric>
#include <span>
#include <vector>

#include "../layout/dim_spec.hpp"

namespace reshard {

struct RunGroup {
  std::int64_t count = 1, len = 0;
  std::int64_t g0 = 0, gper = 0;  ///< global start and period
  std::int64_t s0 = 0, sper = 0;  ///< source local start and period
  std::int64_t d0 = 0, dper = 0;  ///< destination local start and period
  std::int64_t elements() const { return count * len; }
};

namespace detail {
/// Global index window covered by local window [a, b) of a part.
inline std::pair<std::int64_t, std::int64_t> global_window(const DimPart& p, std::int64_t a, std::int64_t b) {
  if (a >= b) return {0, 0};
  return {p.global(a), p.global(b - 1) + 1};
}
/// Local period of a part for a global period L (a multiple of k*B when cyclic).
inline std::int64_t local_period(const DimPart& p, std::int64_t L) {
  return p.cyclic ? L / (p.k * p.B) * p.B : L;
}
inline std::int64_t next_in(const DimPart& p, std::int64_t i) { return p.cyclic ? p.next_held(i) : i; }
inline std::int64_t run_end_in(const DimPart& p, std::int64_t i) {
  return p.cyclic ? p.run_end(i) : INT64_MAX;
}
/// Runs of indices held by both parts in [lo, hi); the window already lies
/// inside both contiguous ranges.
template <class F>
void sweep(const DimPart& s, const DimPart& d, std::int64_t lo, std::int64_t hi, F&& f) {
  std::int64_t i = lo;
  while (i < hi) {
    const std::int64_t a = next_in(s, i);
    const std::int64_t b = next_in(d, a);
    if (b != a) {
      i = b;
      continue;
    }
    if (a >= hi) break;
    const std::int64_t e = std::min({run_end_in(s, a), run_end_in(d, a), hi});
    f(a, e);
    i = e;
  }
}
}  // namespace detail

/// The global indices in [0, n) held both by source part `s` within its local
/// window [s_lo, s_hi) and by destination part `d` within [d_lo, d_hi),
/// appended to `out`.
/// @post every such index lies in exactly one occurrence of one group.
inline void intersect_dim(const DimPart& s, std::int64_t s_lo, std::int64_t s_hi, const DimPart& d,
                          std::int64_t d_lo, std::int64_t d_hi, std::int64_t n, std::vector<RunGroup>& out) {
  if (s_lo >= s_hi || d_lo >= d_hi) return;
  const auto [sa, sb] = detail::global_window(s, s_lo, s_hi);
  const auto [da, db] = detail::global_window(d, d_lo, d_hi);
  const std::int64_t lo = std::max(sa, da), hi = std::min({sb, db, n});
  if (lo >= hi) return;
  auto emit = [&](std::int64_t a, std::int64_t e, std::int64_t count, std::int64_t L) {
    out.push_back(RunGroup{count, e - a, a, L, s.local(a), detail::local_period(s, L), d.local(a),
                           detail::local_period(d, L)});
  };
  if (!s.cyclic && !d.cyclic) {
    emit(lo, hi, 1, 0);
    return;
  }
  std::int64_t L = 0;
  const std::int64_t Ls = s.cyclic ? s.k * s.B : 1, Ld = d.cyclic ? d.k * d.B : 1;
  const std::int64_t g = std::gcd(Ls, Ld);
  const bool fits = !__builtin_mul_overflow(Ls / g, Ld, &L);
  if (!fits || L >= hi - lo) {  // no repetition worth folding: list the runs
    detail::sweep(s, d, lo, hi, [&](std::int64_t a, std::int64_t e) { emit(a, e, 1, 0); });
    return;
  }
  // Both patterns repeat every L from 0: sweep one aligned period, then fold
  // each run's occurrences inside [lo, hi) into a group.
  const std::int64_t w0 = lo / L * L;
  detail::sweep(s, d, w0, w0 + L, [&](std::int64_t a, std::int64_t e) {
    const std::int64_t m_first = e > lo ? 0 : 1;
    if (a + m_first * L >= hi) return;
    const std::int64_t m_last = (hi - a + L - 1) / L - 1;
    const std::int64_t mf = a >= lo ? 0 : 1;
    const std::int64_t ml = hi >= e ? (hi - e) / L : -1;
    if (m_first < mf) {  // m = 0 clipped on the left
      const std::int64_t ca = std::max(a, lo), ce = std::min(e, hi);
      if (ca < ce) emit(ca, ce, 1, 0);
    }
    if (mf <= ml) emit(a + mf * L, e + mf * L, ml - mf + 1, L);
    const std::int64_t right = std::max(ml + 1, mf);
    if (right <= m_last && !(right == 0 && m_first < mf)) {
      const std::int64_t ca = std::max(a + right * L, lo), ce = std::min(e + right * L, hi);
      if (ca < ce) emit(ca, ce, 1, 0);
    }
  });
}

/// How many source-local indices of the groups lie below x (the groups of
/// one intersect_dim call: their occurrences never overlap).
inline std::int64_t source_indices_below(const std::vector<RunGroup>& groups, std::int64_t x) {
  std::int64_t n = 0;
  for (const auto& g : groups) {
    if (x <= g.s0) continue;
    if (g.count == 1) {
      n += std::min(g.len, x - g.s0);
      continue;
    }
    // Occurrences starting below x; all but the last lie wholly below it.
    const std::int64_t m = std::min(g.count, (x - g.s0 - 1) / g.sper + 1);
    n += (m - 1) * g.len + std::min(g.len, x - g.s0 - (m - 1) * g.sper);
  }
  return n;
}

/// A product of per-dim index sets in a part's local coordinates (what one
/// destination box needs of one source part): counts of its elements below
/// a local index along one dim or below a row-major position, so replicas can
/// be given slabs with equal element counts.
class NeededBox {
 public:
  /// A view: `dims` (one intersect_dim result per dim) and `extents` (the
  /// part's local extents) must outlive it.
  NeededBox(std::span<const std::vector<RunGroup>> dims, std::span<const std::int64_t> extents)
      : dims_(dims), extents_(extents) {
    for (std::size_t d = 0; d < dims_.size(); ++d) {
      std::int64_t n = 0;
      for (const auto& r : dims_[d]) n += r.elements();
      totals_[d] = n;
    }
  }
  int rank() const { return static_cast<int>(dims_.size()); }
  std::int64_t total(int d) const { return totals_[static_cast<std::size_t>(d)]; }
  std::int64_t elements() const {
    std::int64_t n = 1;
    for (std::size_t d = 0; d < dims_.size(); ++d) n *= totals_[d];
    return n;
  }
  std::int64_t below(int d, std::int64_t x) const { return source_indices_below(dims_[static_cast<std::size_t>(d)], x); }
  /// Smallest x in [lo, hi] with below(d, x) >= target. Closed form when the
  /// dim's needed set is one run group (the common case), else a search.
  std::int64_t first_reaching_on(int d, std::int64_t lo, std::int64_t hi, std::int64_t target) const {
    const auto& g = dims_[static_cast<std::size_t>(d)];
    if (g.size() == 1 && target > 0 && target <= g[0].elements()) {
      const RunGroup& r = g[0];
      const std::int64_t k = target - 1;  // the target-th needed index, 0-based
      const std::int64_t x = r.s0 + (k / r.len) * r.sper + k % r.len + 1;
      return std::clamp(x, lo, hi);
    }
    return first_reaching(lo, hi, target, [&](std::int64_t x) { return below(d, x); });
  }
  /// Needed elements whose row-major index in the local array is below x.
  std::int64_t linear_below(std::int64_t x) const {
    const int n = rank();
    std::int64_t size = 1;
    for (auto e : extents_) size *= e;
    if (x >= size) return elements();
    std::array<std::int64_t, kMaxTensorRank> digit{};
    for (int d = n - 1; d >= 0; --d) {
      digit[static_cast<std::size_t>(d)] = x % extents_[static_cast<std::size_t>(d)];
      x /= extents_[static_cast<std::size_t>(d)];
    }
    // Tuples that agree with x on dims < d and are below it on dim d.
    std::int64_t count = 0;
    for (int d = 0; d < n; ++d) {
      std::int64_t inner = 1;
      for (int e = d + 1; e < n; ++e) inner *= totals_[static_cast<std::size_t>(e)];
      const std::int64_t xd = digit[static_cast<std::size_t>(d)];
      count += below(d, xd) * inner;
      if (below(d, xd + 1) == below(d, xd)) break;  // x's own index on dim d is not needed
    }
    return count;
  }
  /// Smallest x in [lo, hi] with f(x) >= target, for a nondecreasing f.
  template <class F>
  static std::int64_t first_reaching(std::int64_t lo, std::int64_t hi, std::int64_t target, F&& f) {
    while (lo < hi) {
      const std::int64_t mid = lo + (hi - lo) / 2;
      if (f(mid) >= target)
        hi = mid;
      else
        lo = mid + 1;
    }
    return lo;
  }

 private:
  std::span<const std::vector<RunGroup>> dims_;
  std::span<const std::int64_t> extents_;
  std::array<std::int64_t, kMaxTensorRank> totals_{};
};

}  // namespace reshard
