// Balance and coalescing: with replicated sources every replica sends close
// to its even share (worst <= 1.10x), and copies come out as few and as
// low-dimensional as the layouts allow.
#include <doctest/doctest.h>

#include "plan_test_util.hpp"

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
  Layout L = mesh_layout({{"dp", dp}, {"tp", tp}}, first);
  std::vector<DimSpec> dims(shape.size());
  dims[static_cast<std::size_t>(dim)] = cut({AxisRef{1, 1, tp}});
  add_tensor(L, "w", shape, dims);
  L.validate();
  return L;
}

Layout tp_only(std::int64_t tp, int dim, std::vector<std::int64_t> shape, std::int64_t first) {
  Layout L = mesh_layout({{"tp", tp}}, first);
  std::vector<DimSpec> dims(shape.size());
  dims[static_cast<std::size_t>(dim)] = cut({AxisRef{0, 1, tp}});
  add_tensor(L, "w", shape, dims);
  L.validate();
  return L;
}

/// No copy can lose a dim: collapse() finds nothing to merge or drop.
void require_collapsed(const Schedule& s) {
  for (const auto& c : s.copies) {
    Copy m = c;
    collapse(m);
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
  Layout src = mesh_layout({{"dp", 8}});
  add_tensor(src, "w", {1024, 256});
  src.validate();
  const auto dst = tp_only(4, 0, {1024, 256}, 8);
  check_balanced(src, dst);
}

TEST_CASE("balance: replicated dp=4 -> replicated dp=4 (every receiver needs everything)") {
  Layout src = mesh_layout({{"dp", 4}});
  add_tensor(src, "w", {512, 512});
  src.validate();
  Layout dst = mesh_layout({{"dp", 4}}, 4);
  add_tensor(dst, "w", {512, 512});
  dst.validate();
  check_balanced(src, dst);
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
  Layout src = mesh_layout({{"pp", 2}, {"dp", 2}, {"tp", 2}});
  Layout dst = mesh_layout({{"tp", 4}}, 8);
  const AxisRef s_tp{2, 1, 2}, d_tp{0, 1, 4};
  for (int layer = 0; layer < 4; ++layer) {
    const std::int64_t stage = layer / 2;
    auto name = [&](const char* w) { return fmt::format("layers.{}.{}", layer, w); };
    add_tensor(src, name("qkv"), {768, 256}, {cut({s_tp}), {}}).stage = {{0, stage}};
    add_tensor(src, name("o"), {256, 512}, {{}, cut({s_tp})}).stage = {{0, stage}};
    add_tensor(src, name("norm"), {256}, {}).stage = {{0, stage}};
    add_tensor(dst, name("qkv"), {768, 256}, {cut({d_tp}), {}});
    add_tensor(dst, name("o"), {256, 512}, {{}, cut({d_tp})});
    add_tensor(dst, name("norm"), {256}, {});
  }
  src.validate();
  dst.validate();
  check_balanced(src, dst);
}

TEST_CASE("balance: cyclic experts replicated over dp=2 -> linear experts over ep=4") {
  Layout src = mesh_layout({{"dp", 2}, {"ep", 4}});
  add_tensor(src, "experts.w1", {16, 128, 64}, {cyclic({AxisRef{1, 1, 4}}, 1), {}, {}});
  src.validate();
  Layout dst = mesh_layout({{"ep", 4}}, 8);
  add_tensor(dst, "experts.w1", {16, 128, 64}, {cut({AxisRef{0, 1, 4}}), {}, {}});
  dst.validate();
  check_balanced(src, dst);
}

TEST_CASE("balance: linear experts on dp=3 replicas -> cyclic experts over ep=4 (slabs by needed rows)") {
  // Each receiver needs every 4th expert: the bounding window of its piece
  // has gaps, so slabs must be cut by the rows needed, not by the window.
  Layout src = mesh_layout({{"dp", 3}});
  add_tensor(src, "experts.w1", {16, 128, 64});
  src.validate();
  Layout dst = mesh_layout({{"ep", 4}}, 3);
  add_tensor(dst, "experts.w1", {16, 128, 64}, {cyclic({AxisRef{0, 1, 4}}, 1), {}, {}});
  dst.validate();
  check_balanced(src, dst);
}

TEST_CASE("balance: a flat parameter buffer replicated over dp=4 (Megatron's param buffer) -> tp=2") {
  Layout src = mesh_layout({{"dp", 4}, {"tp", 2}});
  add_tensor(src, "w1", {512, 512}, {cut({AxisRef{1, 1, 2}}), {}});
  add_tensor(src, "w2", {512, 256}, {{}, cut({AxisRef{1, 1, 2}})});
  add_flat(src, "params", {"w1", "w2"}, DimSpec{});
  src.validate();
  Layout dst = mesh_layout({{"tp", 2}}, 8);
  add_tensor(dst, "w1", {512, 512}, {{}, cut({AxisRef{0, 1, 2}})});
  add_tensor(dst, "w2", {512, 256}, {cut({AxisRef{0, 1, 2}}), {}});
  dst.validate();
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
              Layout src = mesh_layout({{"dp", dp}, {"tp", tp}});
              std::vector<DimSpec> sd(2), dd(2);
              sd[static_cast<std::size_t>(sdim)] = cut({AxisRef{1, 1, tp}});
              add_tensor(src, "w", {240, 192}, sd, DType::f32);
              src.validate();
              Layout dst = mesh_layout({{"tp", tp2}}, colocated ? 0 : dp * tp);
              dd[static_cast<std::size_t>(ddim)] = cut({AxisRef{0, 1, tp2}});
              add_tensor(dst, "w", {240, 192}, dd, DType::f32);
              dst.validate();
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
    Layout src = mesh_layout({{"tp", 3}});
    add_tensor(src, "w", {29, 6, 5}, {cut({AxisRef{0, 1, 3}}, Split::balanced), {}, {}});
    src.validate();
    Layout dst = mesh_layout({{"tp", 2}}, 3);
    add_tensor(dst, "w", {29, 6, 5}, {cut({AxisRef{0, 1, 2}}, Split::chunk), {}, {}});
    dst.validate();
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
      CHECK(cp.extent[0] == 16);
      CHECK(cp.extent[1] == 16);
    }
  }
  SUBCASE("cyclic experts -> linear experts: one strided copy per peer pair") {
    Layout src = mesh_layout({{"ep", 4}});
    add_tensor(src, "w", {16, 8, 4}, {cyclic({AxisRef{0, 1, 4}}, 1), {}, {}});
    src.validate();
    Layout dst = mesh_layout({{"ep", 2}}, 4);
    add_tensor(dst, "w", {16, 8, 4}, {cut({AxisRef{0, 1, 2}}), {}, {}});
    dst.validate();
    const auto c = plan_and_check(src, dst);
    REQUIRE_MESSAGE(c.result.ok, c.result.fault);
    CHECK(c.schedule.copies.size() == 8);
    CHECK(peer_pairs(c.schedule) == 8);
    for (const auto& cp : c.schedule.copies) {
      CHECK(cp.rank == 2);  // [experts, expert elements]
      CHECK(cp.extent[1] == 32);
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
    Layout src = mesh_layout({{"tp", 2}});
    add_tensor(src, "w", {4, 3, 5, 8}, {{}, {}, {}, cut({AxisRef{0, 1, 2}})});
    src.validate();
    Layout dst = mesh_layout({{"tp", 2}}, 2);
    add_tensor(dst, "w", {4, 3, 5, 8}, {cut({AxisRef{0, 1, 2}}), {}, {}, {}});
    dst.validate();
    const auto c = plan_and_check(src, dst);
    REQUIRE_MESSAGE(c.result.ok, c.result.fault);
    require_collapsed(c.schedule);
    CHECK(c.schedule.copies.size() == 4);
    for (const auto& cp : c.schedule.copies) {
      CHECK(cp.rank == 2);  // [2*3*5 rows, 4 elements]
      CHECK(cp.extent[0] == 30);
      CHECK(cp.extent[1] == 4);
    }
  }
  SUBCASE("identical layouts: every copy is one contiguous run") {
    Layout L = mesh_layout({{"dp", 2}, {"tp", 2}});
    add_tensor(L, "a", {6, 10, 4}, {{}, cut({AxisRef{1, 1, 2}}), {}});
    add_tensor(L, "b", {12, 7}, {cut({AxisRef{0, 1, 2}, AxisRef{1, 1, 2}}), {}});
    L.validate();
    Layout D = L;
    D.mesh.first_rank = 4;
    D.validate();
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
