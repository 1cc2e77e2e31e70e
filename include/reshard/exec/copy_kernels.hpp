#pragma once
// Host copy kernels for strided boxes: what the executor uses to pack the
// pieces of a message into staging memory, unpack them at the receiver, and
// copy pieces that stay on one rank.
//
// A box is an N-D index range `extent` with, on each side, an element stride
// per dim (the meaning of a schedule Copy). Kernels are templated on the
// element size E and the box rank R, so the inner loops compile to plain
// moves; runs that are contiguous on both sides become one memcpy. Runtime
// (E, R) pick the instantiation through copy_box() / pack_range() /
// unpack_range(). copy_box_reference() is the slow element-by-element
// definition the tests check the kernels against.
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "../base/error.hpp"

namespace reshard {

/// One side of a strided box: where element i lives is
/// base + (offset + sum_k i_k * stride[k]) * element_bytes.
struct BoxSide {
  std::byte* base = nullptr;
  std::int64_t offset = 0;
  const std::int64_t* stride = nullptr;  ///< `rank` strides in elements
};

namespace kernels {

/// A run of n elements of E bytes: memcpy when both sides are contiguous,
/// else element moves (memcpy of a constant E is one load and one store).
template <std::size_t E>
inline void run(const std::byte* s, std::int64_t ss, std::byte* d, std::int64_t ds, std::int64_t n) {
  if (ss == 1 && ds == 1) {
    std::memcpy(d, s, static_cast<std::size_t>(n) * E);
    return;
  }
  const auto sstep = static_cast<std::ptrdiff_t>(ss) * static_cast<std::ptrdiff_t>(E);
  const auto dstep = static_cast<std::ptrdiff_t>(ds) * static_cast<std::ptrdiff_t>(E);
  for (std::int64_t i = 0; i < n; ++i, s += sstep, d += dstep) std::memcpy(d, s, E);
}

/// Runtime element size (not 1/2/4/8): same contract as run<E>.
inline void run_bytes(std::size_t E, const std::byte* s, std::int64_t ss, std::byte* d, std::int64_t ds,
                      std::int64_t n) {
  if (ss == 1 && ds == 1) {
    std::memcpy(d, s, static_cast<std::size_t>(n) * E);
    return;
  }
  for (std::int64_t i = 0; i < n; ++i)
    std::memcpy(d + static_cast<std::ptrdiff_t>(i * ds) * static_cast<std::ptrdiff_t>(E),
                s + static_cast<std::ptrdiff_t>(i * ss) * static_cast<std::ptrdiff_t>(E), E);
}

/// Full box of fixed rank R: nested loops, the innermost dim a run.
template <std::size_t E, int R>
inline void box_fixed(const std::byte* s, const std::int64_t* ss, std::byte* d, const std::int64_t* ds,
                      const std::int64_t* ext) {
  if constexpr (R == 1) {
    run<E>(s, ss[0], d, ds[0], ext[0]);
  } else {
    const auto sstep = static_cast<std::ptrdiff_t>(ss[0]) * static_cast<std::ptrdiff_t>(E);
    const auto dstep = static_cast<std::ptrdiff_t>(ds[0]) * static_cast<std::ptrdiff_t>(E);
    for (std::int64_t i = 0; i < ext[0]; ++i, s += sstep, d += dstep)
      box_fixed<E, R - 1>(s, ss + 1, d, ds + 1, ext + 1);
  }
}

/// Elements [first, first + count) of a box in row-major order, any rank:
/// an odometer over rows, each row (or row remainder) one run. E == 0 means
/// a runtime element size `eb`.
template <std::size_t E>
inline void box_range(std::size_t eb, int rank, const std::int64_t* ext, const std::byte* s, const std::int64_t* ss,
                      std::byte* d, const std::int64_t* ds, std::int64_t first, std::int64_t count) {
  if (count <= 0) return;
  const std::size_t esz = E ? E : eb;
  std::array<std::int64_t, 32> idx{};
  // Unravel `first` into a multi-index (row-major).
  std::int64_t rem = first;
  for (int k = rank - 1; k >= 0; --k) {
    idx[static_cast<std::size_t>(k)] = rem % ext[k];
    rem /= ext[k];
  }
  std::int64_t so = 0, dof = 0;
  for (int k = 0; k < rank; ++k) {
    so += idx[static_cast<std::size_t>(k)] * ss[k];
    dof += idx[static_cast<std::size_t>(k)] * ds[k];
  }
  const int in = rank - 1;
  while (count > 0) {
    const std::int64_t n = std::min(count, ext[in] - idx[static_cast<std::size_t>(in)]);
    const std::byte* sp = s + static_cast<std::ptrdiff_t>(so) * static_cast<std::ptrdiff_t>(esz);
    std::byte* dp = d + static_cast<std::ptrdiff_t>(dof) * static_cast<std::ptrdiff_t>(esz);
    if constexpr (E != 0)
      run<E>(sp, ss[in], dp, ds[in], n);
    else
      run_bytes(esz, sp, ss[in], dp, ds[in], n);
    count -= n;
    if (count == 0) break;
    // Next row: reset the inner dim, carry into the outer ones, recompute offsets.
    idx[static_cast<std::size_t>(in)] = 0;
    int k = in - 1;
    for (; k >= 0; --k) {
      if (++idx[static_cast<std::size_t>(k)] < ext[k]) break;
      idx[static_cast<std::size_t>(k)] = 0;
    }
    if (k < 0) break;  // past the end of the box: count was larger than the box
    so = dof = 0;
    for (int j = 0; j < rank; ++j) {
      so += idx[static_cast<std::size_t>(j)] * ss[j];
      dof += idx[static_cast<std::size_t>(j)] * ds[j];
    }
  }
}

template <std::size_t E>
inline void box_dispatch_rank(int rank, const std::int64_t* ext, const std::byte* s, const std::int64_t* ss,
                              std::byte* d, const std::int64_t* ds) {
  switch (rank) {
    case 1: box_fixed<E, 1>(s, ss, d, ds, ext); return;
    case 2: box_fixed<E, 2>(s, ss, d, ds, ext); return;
    case 3: box_fixed<E, 3>(s, ss, d, ds, ext); return;
    case 4: box_fixed<E, 4>(s, ss, d, ds, ext); return;
    default: {
      std::int64_t n = 1;
      for (int k = 0; k < rank; ++k) n *= ext[k];
      box_range<E>(E, rank, ext, s, ss, d, ds, 0, n);
    }
  }
}

inline std::int64_t box_elements(int rank, const std::int64_t* ext) {
  std::int64_t n = 1;
  for (int k = 0; k < rank; ++k) n *= ext[k];
  return n;
}

/// Row-major (dense) strides of a box: the layout of a packed stream.
inline void dense_strides(int rank, const std::int64_t* ext, std::int64_t* out) {
  std::int64_t s = 1;
  for (int k = rank - 1; k >= 0; --k) {
    out[k] = s;
    s *= ext[k];
  }
}

inline void check_rank(int rank) {
  if (rank < 1 || rank > 32) fail("copy kernel: box rank {} is outside 1..32", rank);
}

}  // namespace kernels

/// Copies a full box: dst element i = src element i for every i in extent.
inline void copy_box(std::size_t element_bytes, int rank, const std::int64_t* extent, const BoxSide& src,
                     const BoxSide& dst) {
  kernels::check_rank(rank);
  if (kernels::box_elements(rank, extent) == 0) return;
  const std::byte* s = src.base + src.offset * static_cast<std::int64_t>(element_bytes);
  std::byte* d = dst.base + dst.offset * static_cast<std::int64_t>(element_bytes);
  switch (element_bytes) {
    case 1: kernels::box_dispatch_rank<1>(rank, extent, s, src.stride, d, dst.stride); return;
    case 2: kernels::box_dispatch_rank<2>(rank, extent, s, src.stride, d, dst.stride); return;
    case 4: kernels::box_dispatch_rank<4>(rank, extent, s, src.stride, d, dst.stride); return;
    case 8: kernels::box_dispatch_rank<8>(rank, extent, s, src.stride, d, dst.stride); return;
    default:
      kernels::box_range<0>(element_bytes, rank, extent, s, src.stride, d, dst.stride, 0,
                            kernels::box_elements(rank, extent));
  }
}

namespace kernels {
/// The rows of elements [first, first + count) of a box (row-major order)
/// by odometer: f(offset, n) for each run of n elements along the innermost
/// dim, `offset` the run's first element in the box's strides, from its start.
template <class Row>
inline void for_each_row(int rank, const std::int64_t* extent, const std::int64_t* stride, std::int64_t first,
                         std::int64_t count, Row&& f) {
  std::array<std::int64_t, 32> idx{};
  std::int64_t rem = first;
  for (int k = rank - 1; k >= 0; --k) {
    idx[static_cast<std::size_t>(k)] = rem % extent[k];
    rem /= extent[k];
  }
  const int in = rank - 1;
  while (count > 0) {
    std::int64_t bo = 0;
    for (int k = 0; k < rank; ++k) bo += idx[static_cast<std::size_t>(k)] * stride[k];
    const std::int64_t n = std::min(count, extent[in] - idx[static_cast<std::size_t>(in)]);
    f(bo, n);
    count -= n;
    idx[static_cast<std::size_t>(in)] = 0;
    for (int k = in - 1; k >= 0; --k) {
      if (++idx[static_cast<std::size_t>(k)] < extent[k]) break;
      idx[static_cast<std::size_t>(k)] = 0;
    }
  }
}

template <bool Pack>
inline void stream_range(std::size_t eb, int rank, const std::int64_t* extent, const BoxSide& box,
                         std::int64_t first, std::int64_t count, std::byte* stream) {
  check_rank(rank);
  const std::int64_t total = box_elements(rank, extent);
  if (first < 0 || count < 0 || first + count > total)
    fail("copy kernel: element range [{}, {}) is outside a box of {} elements", first, first + count, total);
  if (count == 0) return;
  std::array<std::int64_t, 32> dense{};
  dense_strides(rank, extent, dense.data());
  std::byte* b = box.base + box.offset * static_cast<std::int64_t>(eb);
  if (first == 0 && count == total) {
    if (Pack) {
      BoxSide s{box.base, box.offset, box.stride}, d{stream, 0, dense.data()};
      copy_box(eb, rank, extent, s, d);
    } else {
      BoxSide s{stream, 0, dense.data()}, d{box.base, box.offset, box.stride};
      copy_box(eb, rank, extent, s, d);
    }
    return;
  }
  // Partial range (a message chunk starts or ends inside the box): rows by
  // odometer, the stream pointer advancing with each run.
  const int in = rank - 1;
  std::byte* sp = stream;
  for_each_row(rank, extent, box.stride, first, count, [&](std::int64_t bo, std::int64_t n) {
    std::byte* bp = b + static_cast<std::ptrdiff_t>(bo) * static_cast<std::ptrdiff_t>(eb);
    switch (eb) {
      case 1: Pack ? run<1>(bp, box.stride[in], sp, 1, n) : run<1>(sp, 1, bp, box.stride[in], n); break;
      case 2: Pack ? run<2>(bp, box.stride[in], sp, 1, n) : run<2>(sp, 1, bp, box.stride[in], n); break;
      case 4: Pack ? run<4>(bp, box.stride[in], sp, 1, n) : run<4>(sp, 1, bp, box.stride[in], n); break;
      case 8: Pack ? run<8>(bp, box.stride[in], sp, 1, n) : run<8>(sp, 1, bp, box.stride[in], n); break;
      default:
        Pack ? run_bytes(eb, bp, box.stride[in], sp, 1, n) : run_bytes(eb, sp, 1, bp, box.stride[in], n);
    }
    sp += static_cast<std::ptrdiff_t>(n) * static_cast<std::ptrdiff_t>(eb);
  });
}
}  // namespace kernels

/// Packs elements [first, first + count) of the box (row-major order) into the
/// contiguous `stream`.
inline void pack_range(std::size_t element_bytes, int rank, const std::int64_t* extent, const BoxSide& box,
                       std::int64_t first, std::int64_t count, std::byte* stream) {
  kernels::stream_range<true>(element_bytes, rank, extent, box, first, count, stream);
}

/// Unpacks the contiguous `stream` into elements [first, first + count) of the box.
inline void unpack_range(std::size_t element_bytes, int rank, const std::int64_t* extent, const BoxSide& box,
                         std::int64_t first, std::int64_t count, const std::byte* stream) {
  kernels::stream_range<false>(element_bytes, rank, extent, box, first, count, const_cast<std::byte*>(stream));
}

/// The definition: every element, one at a time, by multi-index.
inline void copy_box_reference(std::size_t element_bytes, int rank, const std::int64_t* extent, const BoxSide& src,
                               const BoxSide& dst) {
  const std::int64_t n = kernels::box_elements(rank, extent);
  std::array<std::int64_t, 32> idx{};
  for (std::int64_t e = 0; e < n; ++e) {
    std::int64_t rem = e, so = src.offset, dof = dst.offset;
    for (int k = rank - 1; k >= 0; --k) {
      idx[static_cast<std::size_t>(k)] = rem % extent[k];
      rem /= extent[k];
    }
    for (int k = 0; k < rank; ++k) {
      so += idx[static_cast<std::size_t>(k)] * src.stride[k];
      dof += idx[static_cast<std::size_t>(k)] * dst.stride[k];
    }
    std::memcpy(dst.base + dof * static_cast<std::int64_t>(element_bytes),
                src.base + so * static_cast<std::int64_t>(element_bytes), element_bytes);
  }
}

}  // namespace reshard
