// detail::CopyOrder (copy_order.hpp) against a simple reference: a stable
// sort of the copies by (destination rank, destination buffer, source rank,
// source buffer, tensor, destination offset). Batches small and large
// (compare sort and radix sort), route fields narrow and too wide to pack
// into one word, negative and huge offsets, many ties.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <tuple>
#include <vector>

#include "reshard/plan/copy_order.hpp"

using reshard::Copy;

namespace {

std::vector<std::uint32_t> reference_order(const std::vector<Copy>& copies) {
  std::vector<std::uint32_t> idx(copies.size());
  std::iota(idx.begin(), idx.end(), 0u);
  auto key = [&](std::uint32_t i) {
    const Copy& c = copies[i];
    return std::make_tuple(c.dst_rank, c.dst_buffer, c.src_rank, c.src_buffer, c.tensor, c.dst_offset);
  };
  std::stable_sort(idx.begin(), idx.end(), [&](std::uint32_t a, std::uint32_t b) { return key(a) < key(b); });
  return idx;
}

std::vector<std::uint32_t> found_order(reshard::detail::CopyOrder& order, const std::vector<Copy>& copies) {
  order.sort(copies.size(), [&](auto&& f) {
    for (std::size_t i = 0; i < copies.size(); ++i) f(static_cast<std::uint32_t>(i), copies[i]);
  });
  std::vector<std::uint32_t> got;
  order.for_each([&](std::uint32_t i) { got.push_back(i); });
  return got;
}

struct Spread {
  std::int64_t ranks, buffers, tensors, offsets;
  bool wide = false;  // ranks near both ends of int64: the route cannot be packed
};

std::vector<Copy> random_copies(std::mt19937_64& rng, std::size_t n, const Spread& s) {
  auto pick = [&](std::int64_t k) { return static_cast<std::int64_t>(rng() % static_cast<std::uint64_t>(k)); };
  std::vector<Copy> v(n);
  for (auto& c : v) {
    c.dst_rank = pick(s.ranks);
    c.src_rank = pick(s.ranks);
    if (s.wide && rng() % 2) c.src_rank = INT64_MAX - pick(s.ranks);
    if (s.wide && rng() % 2) c.dst_rank = INT64_MIN + pick(s.ranks);
    c.dst_buffer = static_cast<std::int32_t>(pick(s.buffers));
    c.src_buffer = static_cast<std::int32_t>(pick(s.buffers));
    c.tensor = static_cast<std::int32_t>(pick(s.tensors));
    c.dst_offset = pick(s.offsets) - s.offsets / 2;
    if (rng() % 16 == 0) c.dst_offset = INT64_MAX - pick(s.offsets);
    c.src_offset = static_cast<std::int64_t>(rng() % 1000);  // not part of the order
  }
  return v;
}

}  // namespace

TEST_CASE("CopyOrder sorts as a stable sort by route, then destination offset") {
  std::mt19937_64 rng(20261205);
  reshard::detail::CopyOrder order;  // reused across batches, as a planner does
  const Spread spreads[] = {
      {4, 2, 3, 8},                      // many ties: emission order decides
      {512, 16, 1000, 1 << 20},          // fields of many widths
      {3, 1, 1, INT64_C(1) << 40},       // one route mostly: offsets decide
      {64, 4, 8, 100, true},             // too wide to pack: field-by-field keys
      {1, 1, 1, 1},                      // every key equal: the order is emission order
  };
  int batches = 0;
  for (const auto& s : spreads)
    for (std::size_t n : {0, 1, 2, 17, 255, 256, 257, 3000, 20000}) {
      const auto copies = random_copies(rng, n, s);
      INFO("ranks " << s.ranks << " buffers " << s.buffers << " tensors " << s.tensors << " wide " << s.wide << " n " << n);
      CHECK(found_order(order, copies) == reference_order(copies));
      ++batches;
    }
  CHECK(batches == 45);
}
