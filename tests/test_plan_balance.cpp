// Balance and coalescing: with replicated sources every replica sends close
// to its even share (worst <= 1.10x), and copies come out as few and as
// low-dimensional as the layouts allow.
#include <doctest/doctest.h>

#include <set>

#include "plan_test_util.hpp"
#include "random_layouts.hpp"

using namespace reshard;
using namespace plantest;

namespace {

/// Plans, checks with the oracle, and requires the worst source within `limit`
/// of its even share.
oracle::Balance check_balanced(const Layout& src, const Layout& dst, double limit = 1.10, PlanOptions opt = {}) {
  const auto c = plan_and_check(src, dst, opt);
  REQUIRE_MESSAGE(c.result.ok, c.result.fault);
  const auto b = oracle::balance(src, dst, c.schedule);
  MESSAGE(oracle::describe(b));
  CHECK(b.total > 0);
  CHECK(b.worst_ratio <= limit);
  return b;
}

/// A train-like mesh (dp outer, tp inner) holding one [rows, cols] tensor
/// cut by tp along `dim`.
Layout dp_tp(std::int64_t dp, std::int64_t tp, int dim, std::vector<std::int64_t> shape, std::int64_t first = 0) {
  std::vector<DimSpec> dims(shape.size());
  dims[static_cast<std::size_t>(dim)] = cut({AxisRef{1, 1, tp}});
  return one_tensor({{"dp", dp}, {"tp", tp}}, shape, first, dims);
}

Layout tp_only(std::int64_t tp, int dim, std::vector<std::int64_t> shape, std::int64_t first) {
  std::vector<DimSpec> dims(shape.size());
  dims[static_cast<std::size_t>(dim)] = cut({AxisRef{0, 1, tp}});
  return one_tensor({{"tp", tp}}, shape, first, dims);
}

/// No copy can lose a dim: collapse() finds nothing to merge or drop.
void require_collapsed(const Schedule& s) {
  for (const auto& c : s.copies) {
    Copy m = c;
    m.collapse();
    INFO(oracle::describe_copy(c));
    REQUIRE(copy_key(m) == copy_key(c));
  }
}

}  // namespace

TEST_CASE("balance: dp=4,tp=2 rows cut -> tp=8 columns cut, large pieces split into slabs") {
  const auto src = dp_tp(4, 2, 0, {512, 1024});
  const auto dst = tp_only(8, 1, {512, 1024}, 8);
  check_balanced(src, dst);
}

TEST_CASE("balance: dp=4,tp=2 rows cut -> tp=8 columns cut, small pieces rotate over replicas") {
  const auto src = dp_tp(4, 2, 0, {64, 256});
  const auto dst = tp_only(8, 1, {64, 256}, 8);
  check_balanced(src, dst);
}

TEST_CASE("balance: fully replicated dp=8 -> tp=4") {
  check_balanced(one_tensor({{"dp", 8}}, {1024, 256}), tp_only(4, 0, {1024, 256}, 8));
}

TEST_CASE("balance: replicated dp=4 -> replicated dp=4 (every receiver needs everything)") {
  check_balanced(one_tensor({{"dp", 4}}, {512, 512}), one_tensor({{"dp", 4}}, {512, 512}, 4));
}

TEST_CASE("balance: dp=2,tp=4 -> tp=2 same dim, and dp=3 replicas with uneven slabs") {
  SUBCASE("dp=2,tp=4 -> tp=2") { check_balanced(dp_tp(2, 4, 0, {1024, 256}), tp_only(2, 0, {1024, 256}, 8)); }
  SUBCASE("dp=3,tp=2 -> tp=4 columns") { check_balanced(dp_tp(3, 2, 0, {998, 516}), tp_only(4, 1, {998, 516}, 6)); }
}

TEST_CASE("balance: colocated dp=4,tp=2 -> tp=8 on the same ranks (local pieces stay local)") {
  const auto src = dp_tp(4, 2, 0, {512, 1024});
  const auto dst = tp_only(8, 1, {512, 1024}, 0);
  check_balanced(src, dst);
  // Rank r holds rows of part r%2 in the source: 1/2 of its dst block is local.
  const auto s = plan(src, dst);
  CHECK(s.stats.local_bytes == 512 * 1024 * 2 / 2);
}

TEST_CASE("balance: a many-tensor model, pp=2,dp=2,tp=2 -> tp=4 (stages, column and row parallel, norms)") {
  LayoutSpec src_spec = mesh_layout({{"pp", 2}, {"dp", 2}, {"tp", 2}});
  LayoutSpec dst_spec = mesh_layout({{"tp", 4}}, 8);
  const AxisRef s_tp{2, 1, 2}, d_tp{0, 1, 4};
  for (int layer = 0; layer < 4; ++layer) {
    const std::int64_t stage = layer / 2;
    auto name = [&](const char* w) { return fmt::format("layers.{}.{}", layer, w); };
    add_tensor(src_spec, name("qkv"), {768, 256}, {cut({s_tp}), {}}).stage = {{0, stage}};
    add_tensor(src_spec, name("o"), {256, 512}, {{}, cut({s_tp})}).stage = {{0, stage}};
    add_tensor(src_spec, name("norm"), {256}, {}).stage = {{0, stage}};
    add_tensor(dst_spec, name("qkv"), {768, 256}, {cut({d_tp}), {}});
    add_tensor(dst_spec, name("o"), {256, 512}, {{}, cut({d_tp})});
    add_tensor(dst_spec, name("norm"), {256}, {});
  }
  Layout src(std::move(src_spec));
  Layout dst(std::move(dst_spec));
  check_balanced(src, dst);
}

TEST_CASE("balance: cyclic experts replicated over dp=2 -> linear experts over ep=4") {
  LayoutSpec src_spec = mesh_layout({{"dp", 2}, {"ep", 4}});
  add_tensor(src_spec, "experts.w1", {16, 128, 64}, {cyclic({AxisRef{1, 1, 4}}, 1), {}, {}});
  Layout src(std::move(src_spec));
  LayoutSpec dst_spec = mesh_layout({{"ep", 4}}, 8);
  add_tensor(dst_spec, "experts.w1", {16, 128, 64}, {cut({AxisRef{0, 1, 4}}), {}, {}});
  Layout dst(std::move(dst_spec));
  check_balanced(src, dst);
}

TEST_CASE("balance: linear experts on dp=3 replicas -> cyclic experts over ep=4 (slabs by needed rows)") {
  // Each receiver needs every 4th expert: the bounding window of its piece
  // has gaps, so slabs must be cut by the rows needed, not by the window.
  LayoutSpec src_spec = mesh_layout({{"dp", 3}});
  add_tensor(src_spec, "experts.w1", {16, 128, 64});
  Layout src(std::move(src_spec));
  LayoutSpec dst_spec = mesh_layout({{"ep", 4}}, 3);
  add_tensor(dst_spec, "experts.w1", {16, 128, 64}, {cyclic({AxisRef{0, 1, 4}}, 1), {}, {}});
  Layout dst(std::move(dst_spec));
  check_balanced(src, dst);
}

TEST_CASE("balance: a flat parameter buffer replicated over dp=4 (Megatron's param buffer) -> tp=2") {
  LayoutSpec src_spec = mesh_layout({{"dp", 4}, {"tp", 2}});
  add_tensor(src_spec, "w1", {512, 512}, {cut({AxisRef{1, 1, 2}}), {}});
  add_tensor(src_spec, "w2", {512, 256}, {{}, cut({AxisRef{1, 1, 2}})});
  add_flat(src_spec, "params", {"w1", "w2"}, DimSpec{});
  Layout src(std::move(src_spec));
  LayoutSpec dst_spec = mesh_layout({{"tp", 2}}, 8);
  add_tensor(dst_spec, "w1", {512, 512}, {{}, cut({AxisRef{0, 1, 2}})});
  add_tensor(dst_spec, "w2", {512, 256}, {cut({AxisRef{0, 1, 2}}), {}});
  Layout dst(std::move(dst_spec));
  check_balanced(src, dst);
}

TEST_CASE("balance: sweep of replicated sources dp x tp -> tp' (same and cross dim, disjoint and colocated)") {
  // 240 x 192 divides by every tp used; a small split threshold makes every
  // piece large enough to be cut over its replicas.
  PlanOptions opt;
  opt.split_bytes = 1024;
  int cases = 0;
  double worst = 0;
  for (std::int64_t dp : {2, 3, 4})
    for (std::int64_t tp : {1, 2, 4})
      for (std::int64_t tp2 : {1, 2, 3, 4, 6, 8})
        for (int sdim : {0, 1})
          for (int ddim : {0, 1})
            for (bool colocated : {false, true}) {
              CAPTURE(dp);
              CAPTURE(tp);
              CAPTURE(tp2);
              CAPTURE(sdim);
              CAPTURE(ddim);
              CAPTURE(colocated);
              LayoutSpec src_spec = mesh_layout({{"dp", dp}, {"tp", tp}});
              std::vector<DimSpec> sd(2), dd(2);
              sd[static_cast<std::size_t>(sdim)] = cut({AxisRef{1, 1, tp}});
              add_tensor(src_spec, "w", {240, 192}, sd, DType::f32);
              Layout src(std::move(src_spec));
              LayoutSpec dst_spec = mesh_layout({{"tp", tp2}}, colocated ? 0 : dp * tp);
              dd[static_cast<std::size_t>(ddim)] = cut({AxisRef{0, 1, tp2}});
              add_tensor(dst_spec, "w", {240, 192}, dd, DType::f32);
              Layout dst(std::move(dst_spec));
              const auto c = plan_and_check(src, dst, opt);
              REQUIRE_MESSAGE(c.result.ok, c.result.fault);
              const auto b = oracle::balance(src, dst, c.schedule);
              if (b.total == 0) continue;  // everything local
              INFO(oracle::describe(b));
              CHECK(b.worst_ratio <= 1.10);
              worst = std::max(worst, b.worst_ratio);
              ++cases;
            }
  MESSAGE(cases << " replicated layouts, worst source at " << worst << "x its even share");
}

namespace {

/// The oracle's balance of a plan of src -> dst under opt (checked first).
oracle::Balance planned_balance(const Layout& src, const Layout& dst, const PlanOptions& opt, Schedule* out = nullptr) {
  const auto c = plan_and_check(src, dst, opt);
  REQUIRE_MESSAGE(c.result.ok, c.result.fault);
  if (out) *out = c.schedule;
  return oracle::balance(src, dst, c.schedule);
}

/// One-rank plans of every rank hold exactly the full plan's copies of it.
void require_one_rank_plans_match(const Layout& src, const Layout& dst, const PlanOptions& opt, const Schedule& full) {
  std::set<std::int64_t> ranks;
  for (auto r : src.mesh.global_ranks()) ranks.insert(r);
  for (auto r : dst.mesh.global_ranks()) ranks.insert(r);
  for (auto rank : ranks) {
    PlanOptions one = opt;
    one.only_rank = rank;
    std::vector<Copy> want;
    for (const auto& c : full.copies)
      if (c.src_rank == rank || c.dst_rank == rank) want.push_back(c);
    INFO("only_rank " << rank);
    REQUIRE(copy_multiset(plan(src, dst, one).copies) == copy_multiset(want));
  }
}

/// A random replicated pair around one large tensor: dp x tp sources cut
/// along rows or columns (even, chunk, balanced or cyclic), few destination
/// ranks (tp', sometimes replicated over dp'), disjoint or colocated.
struct ReplicatedCase {
  Layout src, dst;
  std::string what;
};
ReplicatedCase replicated_case(std::uint64_t seed) {
  testgen::Rng r(seed * 0x9E3779B97F4A7C15ull + 17);
  ReplicatedCase c;
  const std::int64_t dp = r.pick(std::vector<std::int64_t>{2, 3, 3, 4, 5, 8});
  const std::int64_t tp = r.pick(std::vector<std::int64_t>{1, 2, 2, 3, 4});
  const std::int64_t tp2 = r.between(1, 8), dp2 = r.chance(0.2) ? 2 : 1;
  const int rank = r.chance(0.2) ? 3 : 2;
  std::vector<std::int64_t> shape;
  shape.push_back(r.between(tp * tp2, 900));
  shape.push_back(r.between(1, 24));
  if (rank == 3) shape.push_back(r.between(1, 4));
  const DType dtype = r.chance(0.5) ? DType::f32 : DType::bf16;
  auto spec = [&](AxisRef a, std::int64_t n) {
    const int kind = static_cast<int>(r.below(4));
    if (kind == 0 && n % a.size == 0) return cut({a});
    if (kind == 1) return cyclic({a}, r.between(1, 3));
    return cut({a}, kind == 2 ? Split::chunk : Split::balanced);
  };
  const int sdim = r.chance(0.8) ? 0 : 1, ddim = r.chance(0.7) ? 0 : 1;
  LayoutSpec src = mesh_layout({{"dp", dp}, {"tp", tp}});
  std::vector<DimSpec> sd(shape.size()), dd(shape.size());
  sd[static_cast<std::size_t>(sdim)] = spec(AxisRef{1, 1, tp}, shape[static_cast<std::size_t>(sdim)]);
  add_tensor(src, "w", shape, sd, dtype);
  c.src = Layout(std::move(src));
  const bool colocated = r.chance(0.25);
  LayoutSpec dst = mesh_layout({{"dp", dp2}, {"tp", tp2}}, colocated ? 0 : dp * tp);
  dd[static_cast<std::size_t>(ddim)] = spec(AxisRef{1, 1, tp2}, shape[static_cast<std::size_t>(ddim)]);
  add_tensor(dst, "w", shape, dd, dtype);
  c.dst = Layout(std::move(dst));
  c.what = fmt::format("seed {}: dp={} x tp={} (dim {}) -> dp={} x tp={} (dim {}), shape [{}]{}\nsrc: {}\ndst: {}", seed, dp, tp,
                       sdim, dp2, tp2, ddim, fmt::join(shape, ", "), colocated ? ", colocated" : "",
                       oracle::describe(c.src), oracle::describe(c.dst));
  return c;
}

}  // namespace

TEST_CASE("balance: few unequal pieces over many replicas (dp=3,tp=2 [61,7] chunk -> tp=5 balanced)") {
  // The tp-0 replicas hold 31 rows; the destination pieces they serve are 13,
  // 12 and 6 rows: one each, whole, puts 91 elements on one replica where
  // its group's even share is 72.3.
  LayoutSpec src_spec = mesh_layout({{"dp", 3}, {"tp", 2}});
  add_tensor(src_spec, "w", {61, 7}, {cut({AxisRef{1, 1, 2}}, Split::chunk), {}}, DType::f32);
  Layout src(std::move(src_spec));
  LayoutSpec dst_spec = mesh_layout({{"tp", 5}}, 6);
  add_tensor(dst_spec, "w", {61, 7}, {cut({AxisRef{0, 1, 5}}, Split::balanced), {}}, DType::f32);
  Layout dst(std::move(dst_spec));
  PlanOptions rotation;
  rotation.balance_limit = 0;
  const auto before = planned_balance(src, dst, rotation);
  MESSAGE("rotation: " << oracle::describe(before));
  CHECK(before.worst_ratio > 1.25);
  // The default minimum slab (256 KiB) keeps these 364-byte pieces whole.
  Schedule whole;
  planned_balance(src, dst, PlanOptions{}, &whole);
  CHECK(whole.copies.size() == 6);
  // A small minimum slab lets the planner cut them.
  PlanOptions opt;
  opt.min_slab_bytes = 0;
  Schedule s;
  const auto after = planned_balance(src, dst, opt, &s);
  MESSAGE("balanced: " << oracle::describe(after));
  CHECK(after.worst_ratio <= 1.10);
  // Wrap-around cuts at most R - 1 pieces per group: 6 pieces + 2 x 2 cuts.
  CHECK(s.copies.size() <= 10);
  PlanOptions always;  // every piece in R slabs, the other way to balance
  always.split_bytes = 1;
  CHECK(s.copies.size() < plan(src, dst, always).copies.size());
  // reshard-plan's figure (replica_shares) agrees with the oracle's.
  const auto shares = replica_shares(s, src, dst);
  CHECK(shares.worst_ratio == doctest::Approx(after.worst_ratio));
  CHECK(replica_shares(plan(src, dst, rotation), src, dst).worst_ratio == doctest::Approx(before.worst_ratio));
  require_one_rank_plans_match(src, dst, opt, s);
}

TEST_CASE("balance: random replicated layouts around one large tensor, worst replica <= 1.10x its share") {
  PlanOptions opt;
  opt.min_slab_bytes = 0;  // let every piece be cut: the limit is then always reachable here
  PlanOptions rotation = opt;
  rotation.balance_limit = 0;
  double worst = 0, worst_rotation = 0;
  std::uint64_t worst_seed = 0;
  std::int64_t copies = 0, copies_rotation = 0, over = 0, coarse = 0;
  const int cases = 400;
  for (std::uint64_t seed = 1; seed <= static_cast<std::uint64_t>(cases); ++seed) {
    const auto c = replicated_case(seed);
    INFO(c.what);
    Schedule s;
    const auto b = planned_balance(c.src, c.dst, opt, &s);
    const auto s0 = plan(c.src, c.dst, rotation);
    const auto b0 = oracle::balance(c.src, c.dst, s0);
    copies += static_cast<std::int64_t>(s.copies.size());
    copies_rotation += static_cast<std::int64_t>(s0.copies.size());
    if (b.total == 0) continue;
    // A slab is whole indices of one dim: the finest is at most the
    // tensor's elements over its longest extent (unit). Where that is over a
    // tenth of a replica's share, 1.10x may be out of reach (e.g. [10, 5]
    // over 8 replicas): counted, not required.
    const auto& shape = c.src.tensors[0].shape;
    std::int64_t elements = 1;
    for (auto e : shape) elements *= e;
    const double unit = static_cast<double>(elements / *std::max_element(shape.begin(), shape.end())) *
                        static_cast<double>(element_bytes(c.src.tensors[0].dtype));
    double least = 0;
    for (auto f : b.fair)
      if (f > 0 && (least == 0 || f < least)) least = f;
    if (unit * 10 > least) {
      ++coarse;
      continue;
    }
    CHECK_MESSAGE(b.worst_ratio <= 1.10, oracle::describe(b));
    worst_rotation = std::max(worst_rotation, b0.worst_ratio);
    over += b0.worst_ratio > 1.10;
    if (b.worst_ratio > worst) {
      worst = b.worst_ratio;
      worst_seed = seed;
    }
    if (seed % 25 == 0) require_one_rank_plans_match(c.src, c.dst, opt, s);
  }
  MESSAGE(cases << " replicated one-tensor layouts (" << coarse << " too coarse to require 1.10x): worst source " << worst
                << "x its share (seed " << worst_seed << "); rotation alone: worst " << worst_rotation << "x, " << over
                << " over 1.10x; copies " << copies << " (rotation " << copies_rotation << ")");
  CHECK(over > 0);  // the sweep does meet the problem
}

TEST_CASE("balance: random layout pairs (every contract feature) stay exact, far fewer over 1.10x than the rotation") {
  // Small tensors of every shape: a row can be a large part of a group, so
  // 1.10x is not always reachable; every plan must be exact, and far fewer
  // over 1.10x than with the rotation.
  PlanOptions opt;
  opt.min_slab_bytes = 0;
  PlanOptions rotation = opt;
  rotation.balance_limit = 0;
  double worst = 0, worst_rotation = 0;
  std::uint64_t worst_seed = 0;
  int cases = 0, over = 0, over_rotation = 0;
  for (std::uint64_t seed = 1; seed <= 1500; ++seed) {
    const auto pair = testgen::random_layout_pair(seed);
    INFO(pair.describe());
    const auto b = planned_balance(pair.src, pair.dst, opt);
    const auto b0 = oracle::balance(pair.src, pair.dst, plan(pair.src, pair.dst, rotation));
    if (b.total == 0) continue;
    ++cases;
    over += b.worst_ratio > 1.10;
    over_rotation += b0.worst_ratio > 1.10;
    worst_rotation = std::max(worst_rotation, b0.worst_ratio);
    if (b.worst_ratio > worst) {
      worst = b.worst_ratio;
      worst_seed = seed;
    }
  }
  MESSAGE(cases << " random pairs with network traffic: " << over << " over 1.10x (rotation alone: " << over_rotation
                << "); worst " << worst << "x (seed " << worst_seed << "), rotation alone " << worst_rotation << "x");
  // Per group the balanced plan never does worse than the rotation, but a
  // rank in several groups can (a different replica may take the extra):
  // required in aggregate only.
  CHECK(over * 10 < over_rotation * 7);
}

TEST_CASE("coalescing: a same-dim contiguous reshard is one copy per peer pair") {
  SUBCASE("tp=2 -> tp=4") {
    const auto s = plan(tp_only(2, 0, {64, 48}, 0), tp_only(4, 0, {64, 48}, 2));
    CHECK(s.copies.size() == 4);
    CHECK(peer_pairs(s) == 4);
  }
  SUBCASE("tp=4 -> tp=2") {
    const auto s = plan(tp_only(4, 0, {64, 48}, 0), tp_only(2, 0, {64, 48}, 4));
    CHECK(s.copies.size() == 4);
    CHECK(peer_pairs(s) == 4);
  }
  SUBCASE("tp=3 balanced -> tp=2 chunk on a 3-D tensor") {
    LayoutSpec src_spec = mesh_layout({{"tp", 3}});
    add_tensor(src_spec, "w", {29, 6, 5}, {cut({AxisRef{0, 1, 3}}, Split::balanced), {}, {}});
    Layout src(std::move(src_spec));
    LayoutSpec dst_spec = mesh_layout({{"tp", 2}}, 3);
    add_tensor(dst_spec, "w", {29, 6, 5}, {cut({AxisRef{0, 1, 2}}, Split::chunk), {}, {}});
    Layout dst(std::move(dst_spec));
    const auto c = plan_and_check(src, dst);
    REQUIRE_MESSAGE(c.result.ok, c.result.fault);
    CHECK(static_cast<std::int64_t>(c.schedule.copies.size()) == peer_pairs(c.schedule));
    for (const auto& cp : c.schedule.copies) CHECK(cp.contiguous());
  }
  SUBCASE("columns: tp=2 -> tp=4 along dim 1 is one 2-D copy per pair") {
    const auto c = plan_and_check(tp_only(2, 1, {16, 64}, 0), tp_only(4, 1, {16, 64}, 2));
    REQUIRE_MESSAGE(c.result.ok, c.result.fault);
    CHECK(c.schedule.copies.size() == 4);
    for (const auto& cp : c.schedule.copies) {
      CHECK(cp.rank == 2);
      CHECK(cp.extent(0) == 16);
      CHECK(cp.extent(1) == 16);
    }
  }
  SUBCASE("cyclic experts -> linear experts: one strided copy per peer pair") {
    LayoutSpec src_spec = mesh_layout({{"ep", 4}});
    add_tensor(src_spec, "w", {16, 8, 4}, {cyclic({AxisRef{0, 1, 4}}, 1), {}, {}});
    Layout src(std::move(src_spec));
    LayoutSpec dst_spec = mesh_layout({{"ep", 2}}, 4);
    add_tensor(dst_spec, "w", {16, 8, 4}, {cut({AxisRef{0, 1, 2}}), {}, {}});
    Layout dst(std::move(dst_spec));
    const auto c = plan_and_check(src, dst);
    REQUIRE_MESSAGE(c.result.ok, c.result.fault);
    CHECK(c.schedule.copies.size() == 8);
    CHECK(peer_pairs(c.schedule) == 8);
    for (const auto& cp : c.schedule.copies) {
      CHECK(cp.rank == 2);  // [experts, expert elements]
      CHECK(cp.extent(1) == 32);
    }
  }
}

TEST_CASE("coalescing: copies are collapsed to the fewest dims") {
  SUBCASE("rows -> columns") {
    const auto s = plan(dp_tp(1, 2, 0, {32, 64}), tp_only(4, 1, {32, 64}, 2));
    require_collapsed(s);
    for (const auto& c : s.copies) CHECK(c.rank == 2);
    CHECK(s.copies.size() == 8);
  }
  SUBCASE("4-D tensor cut on its last dim -> cut on its first: two dims per copy") {
    LayoutSpec src_spec = mesh_layout({{"tp", 2}});
    add_tensor(src_spec, "w", {4, 3, 5, 8}, {{}, {}, {}, cut({AxisRef{0, 1, 2}})});
    Layout src(std::move(src_spec));
    LayoutSpec dst_spec = mesh_layout({{"tp", 2}}, 2);
    add_tensor(dst_spec, "w", {4, 3, 5, 8}, {cut({AxisRef{0, 1, 2}}), {}, {}, {}});
    Layout dst(std::move(dst_spec));
    const auto c = plan_and_check(src, dst);
    REQUIRE_MESSAGE(c.result.ok, c.result.fault);
    require_collapsed(c.schedule);
    CHECK(c.schedule.copies.size() == 4);
    for (const auto& cp : c.schedule.copies) {
      CHECK(cp.rank == 2);  // [2*3*5 rows, 4 elements]
      CHECK(cp.extent(0) == 30);
      CHECK(cp.extent(1) == 4);
    }
  }
  SUBCASE("identical layouts: every copy is one contiguous run") {
    LayoutSpec L_spec = mesh_layout({{"dp", 2}, {"tp", 2}});
    add_tensor(L_spec, "a", {6, 10, 4}, {{}, cut({AxisRef{1, 1, 2}}), {}});
    add_tensor(L_spec, "b", {12, 7}, {cut({AxisRef{0, 1, 2}, AxisRef{1, 1, 2}}), {}});
    Layout L(std::move(L_spec));
    LayoutSpec D_spec = L;
    D_spec.mesh.first_rank = 4;
    Layout D(std::move(D_spec));
    const auto s = plan(L, D);
    require_collapsed(s);
    for (const auto& c : s.copies) CHECK(c.contiguous());
    CHECK(s.copies.size() == 8);
  }
  SUBCASE("rows <-> columns over several world ratios") {
    for (std::int64_t tp : {2, 3, 4})
      for (int dim : {0, 1}) require_collapsed(plan(dp_tp(2, tp, dim, {24, 36}), tp_only(6, 1 - dim, {24, 36}, 6)));
  }
}
