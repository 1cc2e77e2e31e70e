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

/// Most dims a copy box can have: two per tensor dim (a periodic run set
/// becomes count x length) and one more for merged progressions.
inline constexpr int kMaxBoxRank = 20;

/// A strided box copy between two local buffers.
struct Copy {
  std::int64_t src_rank = 0, dst_rank = 0;
  std::int32_t src_buffer = 0, dst_buffer = 0;  ///< ids into each layout's local_buffers()
  std::int32_t tensor = 0;                      ///< destination-layout tensor id
  std::int32_t element_bytes = 1;
  std::int64_t src_offset = 0, dst_offset = 0;
  std::int32_t rank = 0;                        ///< number of box dims
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
    std::vector<std::pair<std::int64_t, std::int64_t>> sends, recvs;
    for (const auto& c : copies) {
      if (c.is_local()) {
        stats.local_bytes += c.bytes();
        continue;
      }
      stats.bytes += c.bytes();
      sends.emplace_back(c.src_rank, c.bytes());
      recvs.emplace_back(c.dst_rank, c.bytes());
    }
    auto max_of = [](std::vector<std::pair<std::int64_t, std::int64_t>>& v) {
      std::sort(v.begin(), v.end());
      std::int64_t best = 0;
      for (std::size_t i = 0; i < v.size();) {
        std::int64_t s = 0;
        std::size_t j = i;
        for (; j < v.size() && v[j].first == v[i].first; ++j) s += v[j].second;
        best = std::max(best, s);
        i = j;
      }
      return best;
    };
    stats.max_send_bytes = max_of(sends);
    stats.max_recv_bytes = max_of(recvs);
    stats.ranks = rank_count;
  }
};

/// Drops unit dims and merges dims that are contiguous on both sides, so a
/// contiguous piece becomes one 1-D run.
inline void collapse(Copy& c) {
  int r = 0;
  for (int d = 0; d < c.rank; ++d) {
    const auto ud = static_cast<std::size_t>(d);
    if (c.extent[ud] == 1) continue;
    if (r > 0) {
      const auto up = static_cast<std::size_t>(r - 1);
      if (c.src_stride[up] == c.src_stride[ud] * c.extent[ud] &&
          c.dst_stride[up] == c.dst_stride[ud] * c.extent[ud]) {
        c.extent[up] *= c.extent[ud];
        c.src_stride[up] = c.src_stride[ud];
        c.dst_stride[up] = c.dst_stride[ud];
        continue;
      }
    }
    const auto ur = static_cast<std::size_t>(r);
    c.extent[ur] = c.extent[ud];
    c.src_stride[ur] = c.src_stride[ud];
    c.dst_stride[ur] = c.dst_stride[ud];
    ++r;
  }
  for (int d = r; d < kMaxBoxRank; ++d) {
    const auto ud = static_cast<std::size_t>(d);
    c.extent[ud] = c.src_stride[ud] = c.dst_stride[ud] = 0;
  }
  if (r == 0) {  // a single element: keep one unit dim so the box has a shape
    c.extent[0] = 1;
    c.src_stride[0] = c.dst_stride[0] = 1;
    r = 1;
  }
  c.rank = r;
}

namespace detail {
inline bool same_route(const Copy& a, const Copy& b) {
  return a.src_rank == b.src_rank && a.dst_rank == b.dst_rank && a.src_buffer == b.src_buffer &&
         a.dst_buffer == b.dst_buffer && a.element_bytes == b.element_bytes && a.tensor == b.tensor;
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
/// b continues a along a's outermost dim on both sides.
inline bool extends(const Copy& a, const Copy& b) {
  if (!same_shape(a, b, 1) || a.src_stride[0] != b.src_stride[0] || a.dst_stride[0] != b.dst_stride[0])
    return false;
  return b.src_offset == a.src_offset + a.extent[0] * a.src_stride[0] &&
         b.dst_offset == a.dst_offset + a.extent[0] * a.dst_stride[0];
}
}  // namespace detail

/// Merges copies of one route that continue each other (adjacent boxes) and
/// equal boxes at a constant distance (a new outer dim). Input order is kept
/// per route; copies must be grouped by route and sorted by destination offset.
inline void coalesce(std::vector<Copy>& copies) {
  std::vector<Copy> out;
  out.reserve(copies.size());
  for (auto& c : copies) {
    collapse(c);
    if (!out.empty() && detail::same_route(out.back(), c)) {
      Copy& a = out.back();
      if (detail::extends(a, c)) {
        a.extent[0] += c.extent[0];
        collapse(a);
        continue;
      }
    }
    out.push_back(c);
  }
  // Second pass: equal boxes at a constant distance become one box with a new outer dim.
  std::vector<Copy> res;
  res.reserve(out.size());
  for (std::size_t i = 0; i < out.size();) {
    std::size_t j = i + 1;
    if (j < out.size() && detail::same_route(out[i], out[j]) && detail::same_shape(out[i], out[j], 0) &&
        out[i].rank < kMaxBoxRank) {
      const std::int64_t ds = out[j].src_offset - out[i].src_offset;
      const std::int64_t dd = out[j].dst_offset - out[i].dst_offset;
      while (j + 1 < out.size() && detail::same_route(out[i], out[j + 1]) &&
             detail::same_shape(out[i], out[j + 1], 0) &&
             out[j + 1].src_offset - out[j].src_offset == ds &&
             out[j + 1].dst_offset - out[j].dst_offset == dd)
        ++j;
      if (ds != 0 && dd != 0) {
        Copy m = out[i];
        for (int d = m.rank; d > 0; --d) {
          const auto ud = static_cast<std::size_t>(d);
          m.extent[ud] = m.extent[ud - 1];
          m.src_stride[ud] = m.src_stride[ud - 1];
          m.dst_stride[ud] = m.dst_stride[ud - 1];
        }
        m.extent[0] = static_cast<std::int64_t>(j - i + 1);
        m.src_stride[0] = ds;
        m.dst_stride[0] = dd;
        ++m.rank;
        collapse(m);
        res.push_back(m);
        i = j + 1;
        continue;
      }
      j = i + 1;
    }
    res.push_back(out[i]);
    i = i + 1;
  }
  copies.swap(res);
}

}  // namespace reshard
