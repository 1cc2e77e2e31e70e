// NCCL M2N's reshard test matrix, as named cases: full replication, full
// sharding, same-dim and cross-dim, 2-D placements, world ratios 3:1 and 1:3,
// 1-D and 3-D tensors, tiny and > 2^31-element shapes, disjoint and reversed
// meshes. Small shapes go through the element oracle; huge ones are planned
// without allocating anything and checked structurally.
#include <doctest/doctest.h>

#include <numeric>

#include "plan_test_util.hpp"

using namespace reshard;
using namespace plantest;

namespace {

/// A DTensor-style placement: a mesh and, per mesh axis, Replicate (-1) or
/// Shard(tensor dim). Several axes sharding one dim cut it major to minor in
/// mesh order.
struct Placement {
  std::vector<std::int64_t> mesh;
  std::vector<int> shard;
  std::string str() const {
    std::string s = "[";
    for (std::size_t a = 0; a < mesh.size(); ++a)
      s += fmt::format("{}{}:{}", a ? " " : "", mesh[a], shard[a] < 0 ? std::string("R") : fmt::format("S{}", shard[a]));
    return s + "]";
  }
};

/// Ranks of a mesh: contiguous from `first`, or listed (reversed meshes).
Layout placed(const Placement& p, const std::vector<std::int64_t>& shape, std::int64_t first,
              std::vector<std::int64_t> ranks = {}, DType dtype = DType::bf16) {
  std::vector<Axis> axes;
  for (std::size_t a = 0; a < p.mesh.size(); ++a) axes.push_back({fmt::format("m{}", a), p.mesh[a]});
  LayoutSpec L = mesh_layout(axes, first, std::move(ranks));
  std::vector<DimSpec> dims(shape.size());
  for (std::size_t a = 0; a < p.mesh.size(); ++a)
    if (p.shard[a] >= 0) dims[static_cast<std::size_t>(p.shard[a])].axes.push_back(AxisRef{static_cast<int>(a), 1, p.mesh[a]});
  // M2N needs equal blocks; we also take the rest (balanced) when they are not.
  for (std::size_t d = 0; d < dims.size(); ++d)
    if (dims[d].is_cut() && shape[d] % dims[d].parts() != 0) dims[d].split = Split::balanced;
  add_tensor(L, "t", shape, dims, dtype);
  return Layout(std::move(L));
}

std::int64_t world(const Placement& p) {
  return std::accumulate(p.mesh.begin(), p.mesh.end(), std::int64_t{1}, std::multiplies<>());
}

/// Every placement of a mesh for a tensor of `rank` dims.
std::vector<Placement> all_placements(const std::vector<std::int64_t>& mesh, int rank) {
  std::vector<Placement> out{{mesh, {}}};
  for (std::size_t a = 0; a < mesh.size(); ++a) {
    std::vector<Placement> next;
    for (const auto& p : out)
      for (int s = -1; s < rank; ++s) {
        auto q = p;
        q.shard.push_back(s);
        next.push_back(q);
      }
    out.swap(next);
  }
  return out;
}

/// Plans src -> dst and requires the oracle's approval; returns the schedule.
Schedule oracle_pass(const Layout& src, const Layout& dst, const std::string& what) {
  for (bool coalesce : {true, false}) {
    PlanOptions opt;
    opt.coalesce = coalesce;
    const auto c = plan_and_check(src, dst, opt);
    if (!c.result.ok) FAIL(what << " (coalesce " << coalesce << "): " << c.result.fault);
    if (coalesce) return c.schedule;
  }
  return {};
}

/// Runs every placement pair of the two meshes through the oracle.
int run_matrix(const std::vector<std::int64_t>& smesh, const std::vector<std::int64_t>& dmesh,
               const std::vector<std::int64_t>& shape, bool colocated = false) {
  int n = 0;
  const int rank = static_cast<int>(shape.size());
  for (const auto& sp : all_placements(smesh, rank))
    for (const auto& dp : all_placements(dmesh, rank)) {
      const auto src = placed(sp, shape, 0);
      const auto dst = placed(dp, shape, colocated ? 0 : world(sp));
      oracle_pass(src, dst, sp.str() + " -> " + dp.str());
      ++n;
    }
  return n;
}

/// Structural facts of a plan too large to simulate: what each destination
/// receives adds up to the real elements it holds, and every copy's box stays
/// inside both buffers.
void check_structure(const Layout& src, const Layout& dst, const Schedule& s) {
  const oracle::RankTable sranks(src.mesh), dranks(dst.mesh);
  std::map<std::int64_t, std::int64_t> received;
  for (const auto& c : s.copies) {
    INFO(oracle::describe_copy(c));
    const auto sp = sranks.position(c.src_rank);
    const auto dp = dranks.position(c.dst_rank);
    REQUIRE(sp);
    REQUIRE(dp);
    // Tensors are stored alone here: a buffer is its tensor's local array.
    const auto sbuf = oracle::held_elements(src, *sp, c.src_buffer).first;
    const auto dbuf = oracle::held_elements(dst, *dp, c.dst_buffer).first;
    std::int64_t slo = c.src_offset, shi = c.src_offset, dlo = c.dst_offset, dhi = c.dst_offset;
    for (int d = 0; d < c.rank; ++d) {
      const auto ud = static_cast<std::size_t>(d);
      REQUIRE(c.extent(ud) >= 1);
      const std::int64_t sreach = (c.extent(ud) - 1) * c.src_stride(ud), dreach = (c.extent(ud) - 1) * c.dst_stride(ud);
      (sreach < 0 ? slo : shi) += sreach;
      (dreach < 0 ? dlo : dhi) += dreach;
    }
    CHECK(slo >= 0);
    CHECK(shi < sbuf);
    CHECK(dlo >= 0);
    CHECK(dhi < dbuf);
    received[c.dst_rank] += c.elements();
  }
  for (std::int64_t q = 0; q < dst.mesh.size(); ++q) {
    const std::int64_t rank = dst.mesh.global_rank(q);
    CAPTURE(rank);
    CHECK(received[rank] == oracle::held_elements(dst, q, 0).second);
  }
}

/// Contiguous copies into one buffer must tile it without overlap.
void check_tiling(const Layout& dst, const Schedule& s) {
  std::map<std::int64_t, std::vector<std::pair<std::int64_t, std::int64_t>>> runs;
  for (const auto& c : s.copies) {
    REQUIRE(c.contiguous());
    runs[c.dst_rank].emplace_back(c.dst_offset, c.dst_offset + c.elements());
  }
  for (auto& [rank, v] : runs) {
    std::sort(v.begin(), v.end());
    std::int64_t at = 0;
    for (const auto& [a, b] : v) {
      CHECK(a == at);
      at = b;
    }
    CHECK(at == oracle::held_elements(dst, *oracle::RankTable(dst.mesh).position(rank), 0).first);
  }
}

/// Plans src -> dst without executing (the shapes are too large to allocate)
/// and checks the schedule's structure and that its copies tile dst.
Schedule plan_and_check_tiling(const Layout& src, const Layout& dst) {
  Schedule s = plan(src, dst);
  check_structure(src, dst, s);
  check_tiling(dst, s);
  return s;
}

}  // namespace

TEST_CASE("M2N matrix: full replication") {
  // Replicated -> replicated, and replicated <-> sharded, over several worlds.
  for (std::int64_t ws : {1, 2, 4})
    for (std::int64_t wd : {1, 2, 3}) {
      const Placement rs{{ws}, {-1}}, rd{{wd}, {-1}}, sd{{wd}, {0}};
      oracle_pass(placed(rs, {12, 5}, 0), placed(rd, {12, 5}, ws), rs.str() + " -> " + rd.str());
      oracle_pass(placed(rs, {12, 5}, 0), placed(sd, {12, 5}, ws), rs.str() + " -> " + sd.str());
      oracle_pass(placed(sd, {12, 5}, 0), placed(rs, {12, 5}, wd), sd.str() + " -> " + rs.str());
    }
  // Every replica receives the whole tensor exactly once: bytes = receivers x size.
  const auto s = plan(placed({{4}, {-1}}, {12, 5}, 0), placed({{3}, {-1}}, {12, 5}, 4));
  CHECK(s.stats.bytes == 3 * 12 * 5 * 2);
}

TEST_CASE("M2N matrix: full sharding (every mesh axis cuts the tensor)") {
  int n = 0;
  for (const auto& [sm, dm] : std::vector<std::pair<std::vector<std::int64_t>, std::vector<std::int64_t>>>{
           {{2, 2}, {4}}, {{4}, {2, 2}}, {{2, 3}, {3, 2}}, {{2, 2}, {2, 2}}})
    for (const auto& sp : all_placements(sm, 2))
      for (const auto& dp : all_placements(dm, 2)) {
        if (std::count(sp.shard.begin(), sp.shard.end(), -1) || std::count(dp.shard.begin(), dp.shard.end(), -1)) continue;
        const auto src = placed(sp, {12, 18}, 0);
        const auto dst = placed(dp, {12, 18}, world(sp));
        const auto s = oracle_pass(src, dst, sp.str() + " -> " + dp.str());
        CHECK(s.stats.bytes == 12 * 18 * 2);  // fully sharded: every element moves once
        ++n;
      }
  MESSAGE(n << " fully sharded placement pairs");
}

TEST_CASE("M2N matrix: same-dim reshard (one copy per peer pair) and cross-dim") {
  for (std::int64_t ws : {1, 2, 3, 4, 8})
    for (std::int64_t wd : {1, 2, 3, 4, 8}) {
      const Placement s0{{ws}, {0}}, d0{{wd}, {0}}, d1{{wd}, {1}};
      const auto src = placed(s0, {48, 10}, 0);
      const auto same = oracle_pass(src, placed(d0, {48, 10}, ws), s0.str() + " -> " + d0.str());
      CHECK(static_cast<std::int64_t>(same.copies.size()) == peer_pairs(same));
      for (const auto& c : same.copies) CHECK(c.contiguous());
      const auto cross = oracle_pass(src, placed(d1, {48, 10}, ws), s0.str() + " -> " + d1.str());
      CHECK(static_cast<std::int64_t>(cross.copies.size()) == peer_pairs(cross));  // one 2-D box per pair
    }
}

TEST_CASE("M2N matrix: 2-D placements, 2-D and 3-D tensors") {
  int n = run_matrix({2, 2}, {2, 2}, {8, 6});
  n += run_matrix({2, 3}, {3, 2}, {6, 12});
  n += run_matrix({2, 2}, {4}, {4, 6, 10});
  n += run_matrix({2, 2}, {2, 2}, {4, 6, 10}, true);
  MESSAGE(n << " placement pairs of 2-D meshes");
}

TEST_CASE("M2N matrix: uneven world ratios 3:1 and 1:3") {
  int n = run_matrix({3}, {1}, {9, 4});
  n += run_matrix({1}, {3}, {9, 4});
  n += run_matrix({3, 2}, {2}, {6, 10});
  n += run_matrix({2}, {3, 2}, {6, 10});
  n += run_matrix({3}, {1}, {7, 5});  // uneven blocks (balanced), beyond M2N
  n += run_matrix({1}, {3}, {7, 5});
  MESSAGE(n << " placement pairs at ratios 3:1 and 1:3");
}

TEST_CASE("M2N matrix: 1-D and 3-D tensors") {
  int n = run_matrix({4}, {2}, {64});
  n += run_matrix({2}, {3}, {30});
  n += run_matrix({4}, {2}, {4, 6, 8});
  n += run_matrix({2}, {4}, {8, 3, 4});
  MESSAGE(n << " placement pairs of 1-D and 3-D tensors");
}

TEST_CASE("M2N matrix: tiny tensors of 4 elements over larger meshes") {
  int n = run_matrix({8}, {3}, {4});
  n += run_matrix({2, 2}, {8}, {4});
  n += run_matrix({4}, {2, 2}, {2, 2});
  MESSAGE(n << " placement pairs of 4-element tensors (empty parts included)");
}

TEST_CASE("M2N matrix: disjoint and reversed meshes") {
  for (const auto& [sp, dp] : std::vector<std::pair<Placement, Placement>>{
           {{{4}, {0}}, {{4}, {0}}}, {{{4}, {0}}, {{2}, {1}}}, {{{2, 2}, {0, 1}}, {{4}, {0}}}, {{{4}, {-1}}, {{4}, {0}}}}) {
    const std::vector<std::int64_t> shape{16, 12};
    const auto src = placed(sp, shape, 0);
    std::vector<std::int64_t> reversed(static_cast<std::size_t>(world(dp)));
    std::iota(reversed.rbegin(), reversed.rend(), 0);  // colocated, reversed order
    oracle_pass(src, placed(dp, shape, 0, reversed), sp.str() + " -> reversed " + dp.str());
    std::iota(reversed.rbegin(), reversed.rend(), world(sp));  // disjoint, reversed order
    oracle_pass(src, placed(dp, shape, 0, reversed), sp.str() + " -> disjoint reversed " + dp.str());
    // Source after destination in rank order.
    oracle_pass(placed(sp, shape, 100), placed(dp, shape, 0), sp.str() + " at 100 -> " + dp.str() + " at 0");
  }
  // Reversed identical sharding: rank r's shard goes to rank W-1-r, nothing is local.
  const auto s = plan(placed({{4}, {0}}, {16, 12}, 0), placed({{4}, {0}}, {16, 12}, 0, {3, 2, 1, 0}));
  CHECK(s.stats.local_bytes == 0);
  CHECK(s.copies.size() == 4);
  for (const auto& c : s.copies) CHECK(c.src_rank == 3 - c.dst_rank);
}

TEST_CASE("M2N matrix: shapes beyond 2^31 elements, planned without allocating") {
  SUBCASE("[65536, 65536] bf16, tp=8 rows -> tp=4 rows: one copy per peer pair") {
    const std::vector<std::int64_t> shape{65536, 65536};
    const auto s = plan_and_check_tiling(placed({{8}, {0}}, shape, 0), placed({{4}, {0}}, shape, 8));
    CHECK(static_cast<std::int64_t>(s.copies.size()) == peer_pairs(s));
    CHECK(s.copies.size() == 8);
    CHECK(s.stats.bytes == std::int64_t{65536} * 65536 * 2);
  }
  SUBCASE("[65536, 65536] tp=4 -> one rank: copies of 2^30 elements into a 2^32-element buffer") {
    const std::vector<std::int64_t> shape{65536, 65536};
    const auto s = plan_and_check_tiling(placed({{4}, {0}}, shape, 0), placed({{1}, {-1}}, shape, 4));
    CHECK(s.copies.size() == 4);
  }
  SUBCASE("1-D of 2^32 + 3 elements, balanced over 3 -> 4") {
    const std::vector<std::int64_t> shape{(std::int64_t{1} << 32) + 3};
    const auto s = plan_and_check_tiling(placed({{3}, {0}}, shape, 0), placed({{4}, {0}}, shape, 3));
    CHECK(static_cast<std::int64_t>(s.copies.size()) == peer_pairs(s));
  }
  SUBCASE("3-D [4096, 1024, 1024] cross-dim: dim 0 over 4 -> dim 2 over 2, on a 2-D source mesh") {
    const std::vector<std::int64_t> shape{4096, 1024, 1024};
    const auto src = placed({{2, 4}, {-1, 0}}, shape, 0, {}, DType::f32);
    const auto dst = placed({{2}, {2}}, shape, 8, {}, DType::f32);
    const auto s = plan(src, dst);
    check_structure(src, dst, s);
    CHECK(static_cast<std::int64_t>(s.copies.size()) >= peer_pairs(s));
    for (const auto& c : s.copies) CHECK(c.rank == 2);  // [rows, half a row]
  }
  SUBCASE("2-D mesh, both axes on one dim: [2^20, 4096] S0 S0 (2x2) -> [8] S1") {
    const std::vector<std::int64_t> shape{1 << 20, 4096};
    const auto src = placed({{2, 2}, {0, 0}}, shape, 0);
    const auto dst = placed({{8}, {1}}, shape, 4);
    const auto s = plan(src, dst);
    check_structure(src, dst, s);
    CHECK(s.copies.size() == 32);
  }
}
