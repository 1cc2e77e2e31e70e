// intersect_dim against a brute-force reference over contiguous and cyclic parts.
#include <doctest/doctest.h>

#include <map>
#include <random>

#include "reshard/plan/box.hpp"

using namespace reshard;

namespace {
DimPart make_part(bool cyclic, std::int64_t P, std::int64_t lo, std::int64_t hi, std::int64_t p, std::int64_t k,
                  std::int64_t B) {
  DimCut c;
  c.padded = P;
  c.extent = P;
  if (cyclic) {
    c.cyclic = true;
    c.k = k;
    c.B = B;
    return c.part(p);
  }
  c.k = 1;
  c.cuts = {lo, hi};
  DimPart d = c.part(0);
  return d;
}
}  // namespace

TEST_CASE("intersect_dim matches a brute-force overlay") {
  std::mt19937_64 rng(12345);
  for (int iter = 0; iter < 20000; ++iter) {
    const std::int64_t P = 1 + static_cast<std::int64_t>(rng() % 60);
    const std::int64_t n = P - static_cast<std::int64_t>(rng() % (P / 4 + 1));
    auto random_part = [&]() {
      if (rng() % 2) {
        const std::int64_t k = 1 + static_cast<std::int64_t>(rng() % 5), B = 1 + static_cast<std::int64_t>(rng() % 4);
        return make_part(true, P, 0, 0, static_cast<std::int64_t>(rng() % k), k, B);
      }
      std::int64_t a = static_cast<std::int64_t>(rng() % (P + 1)), b = static_cast<std::int64_t>(rng() % (P + 1));
      if (a > b) std::swap(a, b);
      return make_part(false, P, a, b, 0, 1, 1);
    };
    const DimPart s = random_part(), d = random_part();
    auto win = [&](const DimPart& p) {
      std::int64_t a = p.local_extent ? static_cast<std::int64_t>(rng() % (p.local_extent + 1)) : 0;
      std::int64_t b = p.local_extent ? static_cast<std::int64_t>(rng() % (p.local_extent + 1)) : 0;
      if (a > b) std::swap(a, b);
      return std::make_pair(a, b);
    };
    auto [sa, sb] = win(s);
    auto [da, db] = win(d);
    std::vector<RunGroup> groups;
    intersect_dim(s, sa, sb, d, da, db, n, groups);
    std::map<std::int64_t, std::pair<std::int64_t, std::int64_t>> got;
    for (const auto& g : groups)
      for (std::int64_t m = 0; m < g.count; ++m)
        for (std::int64_t t = 0; t < g.len; ++t) {
          const std::int64_t i = g.g0 + m * g.gper + t;
          REQUIRE(got.count(i) == 0);
          got[i] = {g.s0 + m * g.sper + t, g.d0 + m * g.dper + t};
        }
    std::map<std::int64_t, std::pair<std::int64_t, std::int64_t>> want;
    for (std::int64_t i = 0; i < n; ++i)
      if (s.holds(i) && d.holds(i) && s.local(i) >= sa && s.local(i) < sb && d.local(i) >= da && d.local(i) < db)
        want[i] = {s.local(i), d.local(i)};
    REQUIRE(got == want);
  }
}
