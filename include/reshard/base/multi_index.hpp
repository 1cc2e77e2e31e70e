#pragma once
// Stepping a multi-index through a box in row-major order: the last dim
// fastest, as an odometer turns.
#include <cstddef>
#include <type_traits>

namespace reshard {

/// Steps i[0..n) to the next index of the box lo(d) <= i[d] < hi(d) in
/// row-major order; false after the last one (i is back at lo). lo and hi
/// give the bounds of dim d (a std::size_t).
template <class Index, class Lo, class Hi>
constexpr bool next_index(Index& i, int n, Lo&& lo, Hi&& hi) {
  for (int d = n - 1; d >= 0; --d) {
    const auto u = static_cast<std::size_t>(d);
    if (++i[u] < hi(u)) return true;
    i[u] = lo(u);
  }
  return false;
}

/// next_index over the box 0 <= i[d] < hi(d).
template <class Index, class Hi>
constexpr bool next_index(Index& i, int n, Hi&& hi) {
  return next_index(i, n, [](std::size_t) { return std::remove_cvref_t<decltype(i[0])>{}; }, hi);
}

}  // namespace reshard
