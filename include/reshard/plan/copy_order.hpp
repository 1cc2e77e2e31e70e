#pragma once
// The order a plan lists its copies in, found by sorting small keys instead
// of the copies themselves (a Copy is 112 bytes or more; its key 24).
#include <algorithm>
#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "../schedule/schedule.hpp"

namespace reshard::detail {

/// Orders copies by (destination rank, destination buffer, source rank,
/// source buffer, tensor, destination offset), ties by emission order. Keeps
/// its key arrays between calls: a planner sorts one batch per destination.
class CopyOrder {
 public:
  /// Finds the order of n copies. each(f) calls f(idx, copy) for every copy
  /// in emission order (ascending idx; only the route and the destination
  /// offset are read); it may be called twice. When the five route fields'
  /// ranges fit in 64 bits together (always, in practice), the keys sort as
  /// two packed words: a third of the work of a field-by-field compare.
  template <class Each>
  void sort(std::size_t n, Each&& each) {
    packed_.clear();
    keys_.clear();
    if (n == 0) return;
    std::array<std::int64_t, 5> lo, hi;  // dst_rank, dst_buffer, src_rank, src_buffer, tensor
    lo.fill(INT64_MAX);
    hi.fill(INT64_MIN);
    std::int64_t off_lo = INT64_MAX;
    each([&](std::uint32_t, const Copy& c) {
      const auto f = route_fields(c);
      for (std::size_t k = 0; k < f.size(); ++k) {
        lo[k] = std::min(lo[k], f[k]);
        hi[k] = std::max(hi[k], f[k]);
      }
      off_lo = std::min(off_lo, c.dst_offset);
    });
    std::array<int, 5> width{};
    int total = 0;
    for (std::size_t k = 0; k < width.size(); ++k) {
      width[k] = static_cast<int>(std::bit_width(static_cast<std::uint64_t>(hi[k]) - static_cast<std::uint64_t>(lo[k])));
      total += width[k];
    }
    if (total <= 64) {
      sort_packed(n, each, lo, width, total, off_lo);
      return;
    }
    keys_.reserve(n);
    each([&](std::uint32_t idx, const Copy& c) {
      keys_.push_back(Key{c.dst_rank, c.src_rank, c.dst_offset, c.dst_buffer, c.src_buffer, c.tensor, idx});
    });
    std::sort(keys_.begin(), keys_.end(), [](const Key& a, const Key& b) {
      // Field by field with early exits (a tuple compare costs more here).
      if (a.dst_rank != b.dst_rank) return a.dst_rank < b.dst_rank;
      if (a.dst_buffer != b.dst_buffer) return a.dst_buffer < b.dst_buffer;
      if (a.src_rank != b.src_rank) return a.src_rank < b.src_rank;
      if (a.src_buffer != b.src_buffer) return a.src_buffer < b.src_buffer;
      if (a.tensor != b.tensor) return a.tensor < b.tensor;
      if (a.dst_offset != b.dst_offset) return a.dst_offset < b.dst_offset;
      return a.idx < b.idx;
    });
  }

  /// f(idx) for every copy in the order sort() found.
  template <class F>
  void for_each(F&& f) const {
    for (const PackedKey& k : packed_) f(k.idx);
    for (const Key& k : keys_) f(k.idx);
  }

 private:
  /// Batches at least this large sort packed keys by radix, smaller ones by compares.
  static constexpr std::size_t kRadixFrom = 256;

  struct Key {
    std::int64_t dst_rank, src_rank, dst_offset;
    std::int32_t dst_buffer, src_buffer, tensor;
    std::uint32_t idx;
  };
  struct PackedKey {
    std::uint64_t route, offset;  // route fields packed in order; dst_offset - its minimum
    std::uint32_t idx;
  };

  static std::array<std::int64_t, 5> route_fields(const Copy& c) {
    return {c.dst_rank, c.dst_buffer, c.src_rank, c.src_buffer, c.tensor};
  }

  template <class Each>
  void sort_packed(std::size_t n, Each& each, const std::array<std::int64_t, 5>& lo, const std::array<int, 5>& width,
                   int total, std::int64_t off_lo) {
    packed_.reserve(n);
    each([&](std::uint32_t idx, const Copy& c) {
      const auto f = route_fields(c);
      std::uint64_t route = 0;
      for (std::size_t k = 0; k < f.size(); ++k)
        route = (width[k] >= 64 ? 0 : route << width[k]) | (static_cast<std::uint64_t>(f[k]) - static_cast<std::uint64_t>(lo[k]));
      packed_.push_back(PackedKey{route, static_cast<std::uint64_t>(c.dst_offset) - static_cast<std::uint64_t>(off_lo), idx});
    });
    auto by_key = [](const PackedKey& a, const PackedKey& b) {
      if (a.route != b.route) return a.route < b.route;
      if (a.offset != b.offset) return a.offset < b.offset;
      return a.idx < b.idx;
    };
    if (packed_.size() < kRadixFrom) {
      std::sort(packed_.begin(), packed_.end(), by_key);
      return;
    }
    // By route in radix passes (stable), then each run of one route (most
    // are a single copy) by offset.
    radix_sort_routes(total);
    for (std::size_t a = 0, b; a < packed_.size(); a = b) {
      for (b = a + 1; b < packed_.size() && packed_[b].route == packed_[a].route;) ++b;
      if (b - a > 1)
        std::sort(packed_.begin() + static_cast<std::ptrdiff_t>(a), packed_.begin() + static_cast<std::ptrdiff_t>(b), by_key);
    }
  }

  /// Stable LSD radix sort of packed_ by route in 11-bit digits, skipping
  /// digits all keys share: a few passes over the keys instead of n log n
  /// compares.
  void radix_sort_routes(int route_bits) {
    constexpr int kDigit = 11;
    constexpr std::uint64_t kMask = (std::uint64_t{1} << kDigit) - 1;
    std::array<std::uint32_t, std::size_t{1} << kDigit> at;
    radix_tmp_.resize(packed_.size());
    auto pass = [&](auto digit) {
      at.fill(0);
      for (const PackedKey& k : packed_) ++at[digit(k)];
      if (at[digit(packed_.front())] == packed_.size()) return;  // one value: nothing moves
      std::uint32_t sum = 0;
      for (auto& a : at) sum += std::exchange(a, sum);
      for (const PackedKey& k : packed_) radix_tmp_[at[digit(k)]++] = k;
      packed_.swap(radix_tmp_);
    };
    for (int s = 0; s < route_bits; s += kDigit)
      pass([s](const PackedKey& k) { return static_cast<std::size_t>((k.route >> s) & kMask); });
  }

  std::vector<Key> keys_;                      // route fields too wide to pack
  std::vector<PackedKey> packed_, radix_tmp_;  // the usual case
};

}  // namespace reshard::detail
