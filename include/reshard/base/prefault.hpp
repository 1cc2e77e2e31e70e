#pragma once
// Growing a vector with its pages faulted in ahead, in one call: a plan
// writes gigabytes of copies, and on virtual machines one page fault per
// 4 KiB costs as much as planning the copies in it.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <vector>

#ifdef __linux__
#include <sys/mman.h>
#endif

namespace reshard::detail {

/// Prefaults the storage for the next `n` elements of v (within its
/// capacity) in one call: a full plan writes gigabytes of copies, and taking
/// one page fault per 4 KiB would cost more than planning them.
template <class T>
void prefault(std::vector<T>& v, std::size_t n) {
#if defined(__linux__) && defined(MADV_POPULATE_WRITE) && !defined(RESHARD_NO_PREFAULT)
  constexpr std::uintptr_t page = 4096;
  n = std::min(n, v.capacity() - v.size());
  if (n * sizeof(T) < 16 * page) return;
  const auto at = reinterpret_cast<std::uintptr_t>(v.data() + v.size());
  const std::uintptr_t lo = at & ~(page - 1), hi = (at + n * sizeof(T) + page - 1) & ~(page - 1);
  (void)madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_POPULATE_WRITE);  // a hint only: may fail
#else
  (void)v;
  (void)n;
#endif
}
/// Doubles v's capacity and prefaults the new part: a plan's copy vectors
/// grow to megabytes, and on virtual machines one page fault per 4 KiB costs
/// as much as planning the copies in it.
template <class T>
void grow_prefaulted(std::vector<T>& v) {
  std::vector<T> bigger;
  bigger.reserve(std::max<std::size_t>(64, 2 * v.capacity()));
  prefault(bigger, bigger.capacity());  // before the copy touches it page by page
  bigger.insert(bigger.end(), std::make_move_iterator(v.begin()), std::make_move_iterator(v.end()));
  v.swap(bigger);
}

}  // namespace reshard::detail
