#pragma once
// Schedule: the plan's output. Per (source rank, destination rank), strided
// N-D copies between named local buffers (CONTRACT.md §2). A copy means:
// for every index tuple i in extent,
//   dst[dst_offset + sum i_k*dst_stride_k] = src[src_offset + sum i_k*src_stride_k]
// (offsets and strides in elements).
#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "strided_box.hpp"

namespace reshard {

/// Where a copy into a quantized destination tensor is quantized (docs/fp8.md),
/// or that a copy converts between float dtypes (PlanOptions::cast).
enum class CopyQuant : std::uint8_t {
  none,      ///< a plain copy
  sender,    ///< the sender quantizes whole tiles: FP8 crosses the wire (element_bytes 1)
  receiver,  ///< source-dtype elements cross; the receiver quantizes once its tiles are complete
  scale,     ///< scale entries of sender-quantized tiles: src offsets name each tile's first element
  cast,      ///< the sender converts its elements to the destination's dtype, which crosses (its element_bytes)
};

/// A strided box copy between two local buffers: the box (offsets, extents
/// and strides in elements) with its route. 112 bytes for up to two dims.
struct Copy : StridedBox {
  std::int32_t src_buffer = 0, dst_buffer = 0;  ///< ids into each layout's local_buffers()
  std::int32_t tensor = 0;                      ///< destination-layout tensor id
  std::int32_t element_bytes = 1;
  CopyQuant quant = CopyQuant::none;            ///< into a quantized destination, or a cast: see CopyQuant
  std::int64_t src_rank = 0, dst_rank = 0;

  std::int64_t bytes() const { return elements() * element_bytes; }
  bool is_local() const { return src_rank == dst_rank; }
};

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

namespace detail {
inline bool same_route(const Copy& a, const Copy& b) {
  return a.src_rank == b.src_rank && a.dst_rank == b.dst_rank && a.src_buffer == b.src_buffer &&
         a.dst_buffer == b.dst_buffer && a.element_bytes == b.element_bytes && a.tensor == b.tensor &&
         a.quant == b.quant;
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
    c.collapse();
    detail::push_coalesced(out, 0, c);
  }
  copies.swap(out);
}

}  // namespace reshard
