#pragma once
// Schedule: the plan's output. Per (source rank, destination rank), strided
// N-D copies between named local buffers (CONTRACT.md §2). A copy means:
// for every index tuple i in extent,
//   dst[dst_offset + sum i_k*dst_stride_k] = src[src_offset + sum i_k*src_stride_k]
// (offsets and strides in elements).
#include <algorithm>
#include <array>
#include <cstdint>
#include <string>
#include <vector>

namespace reshard {

/// Most dims a copy box can have. A piece of a tensor of rank n can need up
/// to 2n dims (a periodic run set becomes count x length); the planner cuts
/// such rare pieces into several copies of at most kMaxBoxRank dims, so that
/// every Copy stays small (a full plan holds millions of them).
inline constexpr int kMaxBoxRank = 8;

/// Where a copy into a quantized destination tensor is quantized (docs/fp8.md).
enum class CopyQuant : std::uint8_t {
  none,      ///< a plain copy
  sender,    ///< the sender quantizes whole tiles: FP8 crosses the wire (element_bytes 1)
  receiver,  ///< source-dtype elements cross; the receiver quantizes once its tiles are complete
  scale,     ///< scale entries of sender-quantized tiles: src offsets name each tile's first element
};

/// A strided box copy between two local buffers.
struct Copy {
  std::int64_t src_rank = 0, dst_rank = 0;
  std::int32_t src_buffer = 0, dst_buffer = 0;  ///< ids into each layout's local_buffers()
  std::int32_t tensor = 0;                      ///< destination-layout tensor id
  std::int32_t element_bytes = 1;
  std::int64_t src_offset = 0, dst_offset = 0;
  std::int32_t rank = 0;                        ///< number of box dims
  CopyQuant quant = CopyQuant::none;            ///< into a quantized destination: see CopyQuant
  std::array<std::int64_t, kMaxBoxRank> extent{}, src_stride{}, dst_stride{};

  std::int64_t elements() const {
    std::int64_t n = 1;
    for (int d = 0; d < rank; ++d) n *= extent[static_cast<std::size_t>(d)];
    return n;
  }
  std::int64_t bytes() const { return elements() * element_bytes; }
  bool is_local() const { return src_rank == dst_rank; }
  /// Both sides one contiguous run (rank <= 1 with unit strides).
  bool contiguous() const {
    return rank == 0 || (rank == 1 && src_stride[0] == 1 && dst_stride[0] == 1);
  }
};

/// Drops unit dims and merges dims that are contiguous on both sides, in
/// place on dims [0, rank) of three parallel arrays; returns the new rank
/// (>= 1: a single element keeps one unit dim so the box has a shape). Dims
/// past the new rank are left as they were.
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

struct ScheduleStats {
  std::int64_t bytes = 0;        ///< between different ranks
  std::int64_t local_bytes = 0;  ///< within one rank
  std::int64_t copies = 0;
  std::int64_t max_send_bytes = 0, max_recv_bytes = 0;
  std::int64_t ranks = 0;        ///< distinct ranks of both sides
  double plan_seconds = 0;
};

struct Schedule {
  std::vector<Copy> copies;
  std::vector<std::string> src_buffers, dst_buffers;  ///< buffer names by id
  ScheduleStats stats;
  std::int64_t only_rank = -1;  ///< >= 0: only what this rank sends or receives

  /// Recomputes byte counts and per-rank maxima from the copies.
  void compute_stats(std::int64_t rank_count) {
    stats.bytes = stats.local_bytes = 0;
    stats.copies = static_cast<std::int64_t>(copies.size());
    // Per-rank sums: a schedule has millions of copies but few ranks, whose
    // ids are usually small.
    std::int64_t lo = 0, hi = -1;
    for (const auto& c : copies) {
      lo = std::min({lo, c.src_rank, c.dst_rank});
      hi = std::max({hi, c.src_rank, c.dst_rank});
    }
    // Sums indexed by the rank itself, or by its place among the distinct
    // ranks when ids are negative or huge.
    const bool direct = lo >= 0 && hi < (std::int64_t{1} << 22);
    std::vector<std::int64_t> ids;
    if (!direct) {
      for (const auto& c : copies) ids.insert(ids.end(), {c.src_rank, c.dst_rank});
      std::sort(ids.begin(), ids.end());
      ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
    }
    const auto index = [&](std::int64_t r) {
      return static_cast<std::size_t>(direct ? r : std::lower_bound(ids.begin(), ids.end(), r) - ids.begin());
    };
    const std::size_t n_ranks = direct ? static_cast<std::size_t>(hi + 1) : ids.size();
    std::vector<std::int64_t> sends(n_ranks), recvs(n_ranks);
    for (const auto& c : copies) {
      const std::int64_t n = c.bytes();
      if (c.is_local()) {
        stats.local_bytes += n;
        continue;
      }
      stats.bytes += n;
      sends[index(c.src_rank)] += n;
      recvs[index(c.dst_rank)] += n;
    }
    stats.max_send_bytes = sends.empty() ? 0 : *std::max_element(sends.begin(), sends.end());
    stats.max_recv_bytes = recvs.empty() ? 0 : *std::max_element(recvs.begin(), recvs.end());
    stats.ranks = rank_count;
  }
};

/// collapse_dims on a copy: a contiguous piece becomes one 1-D run.
/// Dims past the rank are zeroed, so equal boxes compare equal as structs.
inline void collapse(Copy& c) {
  const int old = c.rank;
  c.rank = collapse_dims(c.rank, c.extent, c.src_stride, c.dst_stride);
  for (int d = c.rank; d < old; ++d) {
    const auto ud = static_cast<std::size_t>(d);
    c.extent[ud] = c.src_stride[ud] = c.dst_stride[ud] = 0;
  }
}

namespace detail {
inline bool same_route(const Copy& a, const Copy& b) {
  return a.src_rank == b.src_rank && a.dst_rank == b.dst_rank && a.src_buffer == b.src_buffer &&
         a.dst_buffer == b.dst_buffer && a.element_bytes == b.element_bytes && a.tensor == b.tensor &&
         a.quant == b.quant;
}
inline bool same_shape(const Copy& a, const Copy& b, int from) {
  if (a.rank != b.rank) return false;
  for (int d = from; d < a.rank; ++d) {
    const auto ud = static_cast<std::size_t>(d);
    if (a.extent[ud] != b.extent[ud] || a.src_stride[ud] != b.src_stride[ud] ||
        a.dst_stride[ud] != b.dst_stride[ud])
      return false;
  }
  return true;
}
/// Dims [af, a.rank) of a equal dims [bf, b.rank) of b.
inline bool same_dims(const Copy& a, int af, const Copy& b, int bf) {
  if (a.rank - af != b.rank - bf) return false;
  for (int d = 0; d < a.rank - af; ++d) {
    const auto ua = static_cast<std::size_t>(af + d), ub = static_cast<std::size_t>(bf + d);
    if (a.extent[ua] != b.extent[ub] || a.src_stride[ua] != b.src_stride[ub] || a.dst_stride[ua] != b.dst_stride[ub])
      return false;
  }
  return true;
}
/// b starts where a's outermost dim would take its next step, on both sides.
inline bool next_step(const Copy& a, const Copy& b) {
  return b.src_offset == a.src_offset + a.extent[0] * a.src_stride[0] &&
         b.dst_offset == a.dst_offset + a.extent[0] * a.dst_stride[0];
}
/// b continues a along a's outermost dim on both sides (b's own outermost
/// dim may be a unit one, whose strides mean nothing).
inline bool extends(const Copy& a, const Copy& b) {
  if (!same_shape(a, b, 1)) return false;
  if (b.extent[0] != 1 && (a.src_stride[0] != b.src_stride[0] || a.dst_stride[0] != b.dst_stride[0])) return false;
  return next_step(a, b);
}
/// b is one more slice of a's outermost dim: b's box is a's inner box.
inline bool adds_slice(const Copy& a, const Copy& b) {
  return a.rank == b.rank + 1 && same_dims(a, 1, b, 0) && next_step(a, b);
}
}  // namespace detail

namespace detail {
/// Merges b into a when their union is one box: b continues a along its
/// outermost dim, is one more slice of that dim, or is an equal box at some
/// distance (which becomes a new outer dim).
inline bool merge_into(Copy& a, const Copy& b) {
  if (extends(a, b)) {
    a.extent[0] += b.extent[0];
  } else if (a.rank == 1 && a.extent[0] == 1 && b.rank == 1 && b.src_offset == a.src_offset + b.src_stride[0] &&
             b.dst_offset == a.dst_offset + b.dst_stride[0]) {
    // a single element that b's run continues backwards (a's strides mean nothing)
    a.extent[0] = b.extent[0] + 1;
    a.src_stride[0] = b.src_stride[0];
    a.dst_stride[0] = b.dst_stride[0];
  } else if (adds_slice(a, b)) {
    a.extent[0] += 1;
  } else {
    const std::int64_t ds = b.src_offset - a.src_offset, dd = b.dst_offset - a.dst_offset;
    if (!same_shape(a, b, 0) || a.rank >= kMaxBoxRank || ds == 0 || dd == 0) return false;
    for (int d = a.rank; d > 0; --d) {
      const auto ud = static_cast<std::size_t>(d);
      a.extent[ud] = a.extent[ud - 1];
      a.src_stride[ud] = a.src_stride[ud - 1];
      a.dst_stride[ud] = a.dst_stride[ud - 1];
    }
    a.extent[0] = 2;
    a.src_stride[0] = ds;
    a.dst_stride[0] = dd;
    ++a.rank;
  }
  collapse(a);
  return true;
}

/// Appends c to out, then merges the last box into the one before it while
/// both have one route and form one box (merge_into): a merged box is tried
/// again against the one before it, so runs that grow into equal boxes stack
/// up. Boxes before out[start] are left alone.
inline void push_coalesced(std::vector<Copy>& out, std::size_t start, const Copy& c) {
  out.push_back(c);
  while (out.size() - start >= 2 && same_route(out[out.size() - 2], out.back()) && merge_into(out[out.size() - 2], out.back()))
    out.pop_back();
}
}  // namespace detail

/// Merges copies of one route into as few boxes as a greedy sweep finds
/// (see detail::push_coalesced). Copies must be grouped by route and sorted
/// by destination offset; order is kept.
inline void coalesce(std::vector<Copy>& copies) {
  std::vector<Copy> out;
  out.reserve(copies.size());
  for (auto& c : copies) {
    collapse(c);
    detail::push_coalesced(out, 0, c);
  }
  copies.swap(out);
}

}  // namespace reshard
