// Property tests: thousands of seeded random layout pairs through plan() and
// the element oracle; per-rank plans equal the full plan's share; coalescing
// never changes which element goes where.
#include <doctest/doctest.h>

#include <chrono>
#include <cstdlib>

#include "plan_test_util.hpp"
#include "random_layouts.hpp"

using namespace reshard;
using namespace plantest;

namespace {

/// Seeds to run: RESHARD_SEEDS=first:count overrides the default range.
std::pair<std::uint64_t, std::uint64_t> seed_range(std::uint64_t first, std::uint64_t count) {
  if (const char* e = std::getenv("RESHARD_SEEDS")) {
    const std::string s(e);
    const auto colon = s.find(':');
    if (colon != std::string::npos) return {std::stoull(s.substr(0, colon)), std::stoull(s.substr(colon + 1))};
  }
  return {first, count};
}

/// The split threshold varies with the seed so small pieces also take the
/// replica-slab path.
std::int64_t split_bytes_for(std::uint64_t seed) {
  static const std::int64_t choices[] = {1, 64, 512, 64 * 1024};
  return choices[seed % 4];
}

/// The minimum slab of the replica balance varies too, so whole pieces are
/// also reassigned and cut into slabs (0), reassigned only (the default), or
/// rotated (balance off).
void balance_for(std::uint64_t seed, PlanOptions& opt) {
  switch (seed / 4 % 3) {
    case 0: opt.min_slab_bytes = 0; break;
    case 1: break;
    default: opt.balance_limit = 0;
  }
}

}  // namespace

namespace {

/// Runs seeds [first, first + count) through plan() and the oracle.
void oracle_sweep(const std::string& label, std::uint64_t first, std::uint64_t count, const testgen::RandomOptions& o) {
  std::int64_t elements = 0, copies = 0, rejected = 0;
  std::map<std::string, int> modes;
  const auto t0 = std::chrono::steady_clock::now();
  for (std::uint64_t seed = first; seed < first + count; ++seed) {
    const auto pair = testgen::random_layout_pair(seed, o);
    rejected += pair.rejected;
    ++modes[pair.ranks];
    PlanOptions opt;
    opt.split_bytes = split_bytes_for(seed);
    balance_for(seed, opt);
    Schedule s;
    try {
      s = plan(pair.src, pair.dst, opt);
    } catch (const std::exception& e) {
      FAIL("plan threw: " << e.what() << "\n" << pair.describe());
    }
    const auto r = oracle::check_schedule(pair.src, pair.dst, s);
    if (!r.ok) FAIL(r.fault << "\nsplit_bytes " << opt.split_bytes << "\n" << pair.describe());
    // Coalesced to the end: no copy loses a dim to collapse(), and a second
    // coalescing pass finds nothing left to merge.
    for (const auto& c : s.copies) {
      Copy m = c;
      m.collapse();
      if (copy_key(m) != copy_key(c)) FAIL("copy not collapsed: " << oracle::describe_copy(c) << "\n" << pair.describe());
    }
    auto again = s.copies;
    coalesce(again);
    if (again.size() != s.copies.size())
      FAIL("a second coalescing pass merges " << s.copies.size() << " copies into " << again.size() << "\n"
                                              << pair.describe());
    elements += r.elements;
    copies += r.copies;
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  MESSAGE("oracle (" << label << "): " << count << " random pairs, seeds [" << first << ", " << first + count << "), "
                     << copies << " copies, " << elements << " element moves checked, disjoint " << modes["disjoint"]
                     << " colocated " << modes["colocated"] << " overlap " << modes["overlap"] << ", " << secs << " s");
  CHECK_MESSAGE(rejected == 0, "the generator drafted " << rejected << " layouts the validator refused");
}

}  // namespace

TEST_CASE("random layout pairs: the plan passes the element oracle") {
  const auto [first, count] = seed_range(1, 8000);
  oracle_sweep("default options", first, count, {});
}

TEST_CASE("random layout pairs: larger meshes and more tensors pass the element oracle") {
  testgen::RandomOptions big;
  big.max_world = 64;
  big.max_tensors = 8;
  big.max_elements = 20000;
  const auto [first, count] = seed_range(300001, 2000);
  oracle_sweep("worlds up to 64, 8 tensors of up to 20000 elements", first, count, big);
}

TEST_CASE("random layout pairs: coalescing on and off move the same elements") {
  const auto [first, count] = seed_range(100001, 2000);
  std::int64_t merged = 0, unmerged = 0;
  for (std::uint64_t seed = first; seed < first + count; ++seed) {
    const auto pair = testgen::random_layout_pair(seed);
    PlanOptions on, off;
    on.split_bytes = off.split_bytes = split_bytes_for(seed);
    balance_for(seed, on);
    balance_for(seed, off);
    off.coalesce = false;
    const auto a = plan(pair.src, pair.dst, on);
    const auto b = plan(pair.src, pair.dst, off);
    const auto rb = oracle::check_schedule(pair.src, pair.dst, b);
    if (!rb.ok) FAIL("uncoalesced: " << rb.fault << "\n" << pair.describe());
    if (moves(a) != moves(b)) FAIL("coalescing changed the element moves\n" << pair.describe());
    if (a.copies.size() > b.copies.size()) FAIL("coalescing added copies\n" << pair.describe());
    merged += static_cast<std::int64_t>(a.copies.size());
    unmerged += static_cast<std::int64_t>(b.copies.size());
  }
  MESSAGE("coalescing: " << count << " random pairs, seeds [" << first << ", " << first + count << "): " << unmerged
                         << " copies uncoalesced, " << merged << " coalesced");
}

TEST_CASE("random layout pairs: only_rank plans are exactly the full plan's copies of that rank, in its order") {
  const auto [first, count] = seed_range(200001, 1000);
  std::int64_t plans = 0;
  for (std::uint64_t seed = first; seed < first + count; ++seed) {
    const auto pair = testgen::random_layout_pair(seed);
    PlanOptions opt;
    opt.split_bytes = split_bytes_for(seed);
    balance_for(seed, opt);
    opt.coalesce = seed % 2 == 0;
    const auto full = plan(pair.src, pair.dst, opt);
    std::set<std::int64_t> ranks;
    for (auto r : pair.src.mesh.global_ranks()) ranks.insert(r);
    for (auto r : pair.dst.mesh.global_ranks()) ranks.insert(r);
    ranks.insert(*ranks.rbegin() + 1);  // a rank in neither mesh plans nothing
    for (auto rank : ranks) {
      PlanOptions one = opt;
      one.only_rank = rank;
      const auto part = plan(pair.src, pair.dst, one);
      ++plans;
      std::vector<Copy> want;
      for (const auto& c : full.copies)
        if (c.src_rank == rank || c.dst_rank == rank) want.push_back(c);
      if (copy_multiset(part.copies) != copy_multiset(want))
        FAIL("only_rank " << rank << ": " << part.copies.size() << " copies, the full plan has " << want.size()
                          << " involving it (coalesce " << opt.coalesce << ")\n"
                          << pair.describe());
      // In the same order too: a rank's copies sorted as the full plan sorts them.
      for (std::size_t i = 0; i < want.size(); ++i)
        if (copy_key(part.copies[i]) != copy_key(want[i]))
          FAIL("only_rank " << rank << ": copy " << i << " differs from the full plan's order (coalesce " << opt.coalesce
                            << ")\n"
                            << pair.describe());
      oracle::CheckOptions co;
      co.only_rank = rank;
      const auto r = oracle::check_schedule(pair.src, pair.dst, part, co);
      if (!r.ok) FAIL("only_rank " << rank << ": " << r.fault << "\n" << pair.describe());
    }
  }
  MESSAGE("only_rank: " << count << " random pairs, seeds [" << first << ", " << first + count << "), " << plans
                        << " per-rank plans compared");
}

TEST_CASE("the generator covers every contract feature") {
  // Not a tautology: a generator that silently stopped drafting a feature
  // would leave the planner untested there.
  std::map<std::string, int> seen;
  for (std::uint64_t seed = 1; seed <= 400; ++seed) {
    const auto pair = testgen::random_layout_pair(seed);
    for (const Layout* L : {&pair.src, &pair.dst}) {
      seen[fmt::format("axes{}", L->mesh.axes.size())]++;
      if (!L->mesh.ranks.empty()) seen["ranks list"]++;
      if (L->mesh.ranks.empty() && L->mesh.first_rank > 0) seen["first_rank"]++;
      for (const auto& t : L->tensors) {
        seen[fmt::format("rank{}", t.shape.size())]++;
        if (!t.stage.empty()) seen["stage"]++;
        for (const auto& d : t.dims) {
          if (!d.is_cut()) continue;
          seen[fmt::format("split{}", static_cast<int>(d.split))]++;
          if (d.pad_to) seen["pad_to"]++;
          for (const auto& a : d.axes)
            if (a.stride > 1 || a.size < L->mesh.axes[static_cast<std::size_t>(a.axis)].size) seen["sub-axis"]++;
        }
      }
      for (const auto& b : L->buffers) {
        if (b.kind == BufferKind::flat) seen[fmt::format("flat split{}", static_cast<int>(b.flat.split))]++;
        if (b.kind == BufferKind::concat) seen[b.interleave > 1 ? "interleave" : "concat"]++;
      }
    }
    seen[pair.ranks]++;
    if (pair.src.tensors.size() > pair.dst.tensors.size()) seen["src-only tensor"]++;
  }
  for (const char* f : {"axes1", "axes2", "axes3", "axes4", "ranks list", "first_rank", "rank1", "rank2", "rank3",
                        "rank4", "stage", "split0", "split1", "split2", "split3", "split4", "pad_to", "sub-axis",
                        "flat split0", "flat split1", "flat split2", "flat split3", "concat", "interleave", "disjoint",
                        "colocated", "overlap", "src-only tensor"})
    CHECK_MESSAGE(seen[f] > 0, "no random layout in seeds 1..400 has: " << f);
}
