// Schedule::compute_stats: totals and per-rank maxima, against sums taken
// here over the same copies, for rank ids that index an array (small) and
// for ids that do not (negative-free but huge, as a caller's global ranks).
#include <doctest/doctest.h>

#include <cstdint>
#include <map>
#include <random>

#include "reshard/schedule/schedule.hpp"

using namespace reshard;

namespace {
Copy one_row(std::int64_t from, std::int64_t to, std::int64_t elements) {
  Copy c;
  c.src_rank = from;
  c.dst_rank = to;
  c.element_bytes = 2;
  c.rank = 1;
  c.extent(0) = elements;
  c.src_stride(0) = c.dst_stride(0) = 1;
  return c;
}
}  // namespace

TEST_CASE("compute_stats: bytes, local bytes and the busiest sender and receiver, small and huge rank ids") {
  for (const std::int64_t base : {std::int64_t{0}, std::int64_t{1} << 40}) {
    std::mt19937_64 rng(static_cast<std::uint64_t>(base) + 7);
    Schedule s;
    std::map<std::int64_t, std::int64_t> sent, received;
    std::int64_t bytes = 0, local = 0;
    for (int i = 0; i < 500; ++i) {
      const std::int64_t from = base + static_cast<std::int64_t>(rng() % 9), to = base + static_cast<std::int64_t>(rng() % 9);
      const std::int64_t n = 1 + static_cast<std::int64_t>(rng() % 100);
      s.copies.push_back(one_row(from, to, n));
      if (from == to) {
        local += 2 * n;
        continue;
      }
      bytes += 2 * n;
      sent[from] += 2 * n;
      received[to] += 2 * n;
    }
    s.compute_stats(9);
    std::int64_t most_sent = 0, most_received = 0;
    for (const auto& [r, b] : sent) most_sent = std::max(most_sent, b);
    for (const auto& [r, b] : received) most_received = std::max(most_received, b);
    CAPTURE(base);
    CHECK(s.stats.bytes == bytes);
    CHECK(s.stats.local_bytes == local);
    CHECK(s.stats.copies == 500);
    CHECK(s.stats.max_send_bytes == most_sent);
    CHECK(s.stats.max_recv_bytes == most_received);
    CHECK(s.stats.ranks == 9);
  }
  Schedule empty;
  empty.compute_stats(0);
  CHECK(empty.stats.bytes == 0);
  CHECK(empty.stats.max_send_bytes == 0);
}
