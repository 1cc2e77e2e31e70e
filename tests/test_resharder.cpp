// Resharder end to end on the in-process transport, checked element by
// element with the plan oracle: named layout pairs (fused, flat, padded,
// uneven, cyclic, staged, colocated, permuted), the random layout families of
// the planner tests, repeated refits with new weights, strided views, and
// misuse errors.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

#include "error_of.hpp"
#include "random_layouts.hpp"
#include "refit_util.hpp"
#include "reshard/layout/static_layout.hpp"
#include "reshard_support/verify.hpp"

using namespace reshard;
using refit_test::run_refits;

namespace {

Layout make_layout(std::vector<Axis> axes, std::int64_t first, std::vector<TensorSpec> tensors, std::vector<BufferSpec> buffers = {},
                   std::vector<std::int64_t> ranks = {}) {
  LayoutSpec L;
  L.mesh.axes = std::move(axes);
  L.mesh.first_rank = first;
  L.mesh.ranks = std::move(ranks);
  L.tensors = std::move(tensors);
  L.buffers = std::move(buffers);
  return Layout(std::move(L));
}
DimSpec on(int axis, std::int64_t size, Split split = Split::even) {
  DimSpec d;
  d.axes = {AxisRef{axis, 1, size}};
  d.split = split;
  return d;
}
TensorSpec tensor(std::string name, std::vector<std::int64_t> shape, std::vector<DimSpec> dims = {}, DType dt = DType::bf16,
                  std::vector<StageCoord> stage = {}) {
  return tensor_spec(std::move(name), std::move(shape), dt, std::move(dims), std::move(stage));
}
BufferSpec concat(std::string name, std::vector<std::string> parts, int dim = 0, std::int64_t interleave = 1) {
  return concat_buffer(std::move(name), std::move(parts), dim, interleave);
}

/// A Llama block: Megatron dp=2 x tp=2 (per-group interleaved qkv, [gate; up])
/// to vLLM tp=4 ([q; k; v]), disaggregated.
std::pair<Layout, Layout> llama_block() {
  const DimSpec t0 = on(1, 2), none{};
  Layout src = make_layout({{"dp", 2}, {"tp", 2}}, 0,
                           {tensor("q", {64, 64}, {t0, none}), tensor("k", {32, 64}, {t0, none}), tensor("v", {32, 64}, {t0, none}),
                            tensor("o", {64, 64}, {none, t0}), tensor("gate", {96, 64}, {t0, none}), tensor("up", {96, 64}, {t0, none}),
                            tensor("down", {64, 96}, {none, t0}), tensor("norm", {64})},
                           {concat("linear_qkv", {"q", "k", "v"}, 0, 2), concat("linear_fc1", {"gate", "up"})});
  const DimSpec r0 = on(0, 4);
  Layout dst = make_layout({{"tp", 4}}, 4,
                           {tensor("q", {64, 64}, {r0, none}), tensor("k", {32, 64}, {r0, none}), tensor("v", {32, 64}, {r0, none}),
                            tensor("o", {64, 64}, {none, r0}), tensor("gate", {96, 64}, {r0, none}), tensor("up", {96, 64}, {r0, none}),
                            tensor("down", {64, 96}, {none, r0}), tensor("norm", {64})},
                           {concat("qkv_proj", {"q", "k", "v"}), concat("gate_up_proj", {"gate", "up"})});
  return {src, dst};
}

void check_outcome(const refit_test::Outcome& o) {
  INFO(o.first_wrong);
  CHECK(o.wrong == 0);
  // Bytes moved equal the plan's bytes, counted by the executor and by the transport.
  CHECK(o.sum(&RefitReport::bytes_sent) == o.plan_bytes);
  CHECK(o.sum(&RefitReport::bytes_received) == o.plan_bytes);
  CHECK(o.sum(&RefitReport::plan_bytes_sent) == o.plan_bytes);
  CHECK(o.sum(&RefitReport::local_bytes) == o.plan_local_bytes);
  for (const auto& r : o.last) {
    CHECK(r.peak_staging_bytes <= r.staging_budget);
    CHECK(r.peak_staging_bytes <= r.staging_bytes);
  }
}

using test_util::error_of;

}  // namespace

TEST_CASE("named layout pairs refit element by element") {
  SUBCASE("llama block: Megatron interleaved qkv dp2 x tp2 -> vLLM tp4") {
    auto [src, dst] = llama_block();
    auto o = run_refits(src, dst);
    check_outcome(o);
    CHECK(o.traffic.bytes_sent == o.plan_bytes);
  }
  SUBCASE("colocated tp4 -> tp2, cut dim moves from 0 to 1, padded") {
    DimSpec p0 = on(0, 4);
    p0.pad_to = 40;
    Layout src = make_layout({{"tp", 4}}, 0, {tensor("w", {37, 12}, {p0, {}}, DType::f32), tensor("b", {37}, {on(0, 4, Split::chunk)})});
    Layout dst = make_layout({{"tp", 2}}, 0, {tensor("w", {37, 12}, {{}, on(0, 2)}, DType::f32), tensor("b", {37}, {on(0, 2, Split::balanced)})});
    auto o = run_refits(src, dst);
    check_outcome(o);
    CHECK(o.plan_local_bytes > 0);
  }
  SUBCASE("flat ZeRO bucket over dp4 -> tp2") {
    BufferSpec flat;
    flat.name = "bucket0";
    flat.parts = {"a", "b"};
    flat.kind = BufferKind::flat;
    flat.flat = on(0, 4, Split::chunk);
    Layout src = make_layout({{"dp", 4}}, 0, {tensor("a", {30, 7}), tensor("b", {50})}, {flat});
    Layout dst = make_layout({{"tp", 2}}, 4, {tensor("a", {30, 7}, {on(0, 2), {}}), tensor("b", {50})});
    check_outcome(run_refits(src, dst));
  }
  SUBCASE("uneven 3:1 gather and 1:3 scatter") {
    Layout three = make_layout({{"tp", 3}}, 0, {tensor("w", {10, 5}, {on(0, 3, Split::chunk), {}}, DType::f64)});
    Layout one = make_layout({{"tp", 1}}, 3, {tensor("w", {10, 5}, {}, DType::f64)});
    check_outcome(run_refits(three, one));
    check_outcome(run_refits(one, three));
  }
  SUBCASE("round-robin experts ep4 -> contiguous ep2") {
    DimSpec cyc = on(0, 4);
    cyc.split = Split::cyclic;
    cyc.block = 1;
    Layout src = make_layout({{"ep", 4}}, 0, {tensor("experts", {8, 6, 4}, {cyc, {}, {}}, DType::u8)});
    Layout dst = make_layout({{"ep", 2}}, 4, {tensor("experts", {8, 6, 4}, {on(0, 2), {}, {}}, DType::u8)});
    check_outcome(run_refits(src, dst));
  }
  SUBCASE("pipeline stages to a permuted rank list") {
    Layout src = make_layout({{"pp", 2}, {"tp", 2}}, 0,
                             {tensor("l0", {16, 8}, {on(1, 2), {}}, DType::f16, {StageCoord{0, 0}}),
                              tensor("l1", {16, 8}, {{}, on(1, 2)}, DType::f16, {StageCoord{0, 1}})});
    Layout dst = make_layout({{"tp", 2}}, 0, {tensor("l0", {16, 8}, {{}, on(0, 2)}, DType::f16), tensor("l1", {16, 8}, {on(0, 2), {}}, DType::f16)},
                             {}, {7, 5});
    check_outcome(run_refits(src, dst));
  }
  SUBCASE("full replication to full sharding") {
    Layout src = make_layout({{"dp", 4}}, 0, {tensor("w", {64, 32}, {}, DType::f32)});
    Layout dst = make_layout({{"tp", 4}}, 4, {tensor("w", {64, 32}, {{}, on(0, 4)}, DType::f32)});
    auto o = run_refits(src, dst);
    check_outcome(o);
    // The four replicas share the sending.
    int senders = 0;
    for (std::size_t i = 0; i < 4; ++i) senders += o.last[i].bytes_sent > 0;
    CHECK(senders > 1);
  }
}

TEST_CASE("random layout pairs refit element by element") {
  int cases = 0;
  for (std::uint64_t seed = 1; seed <= 300; ++seed) {
    const auto pair = testgen::random_layout_pair(seed);
    INFO(pair.describe());
    ResharderOptions opt;
    // Vary the executor: tiny budgets force many waves and split messages;
    // zero_copy_min 0 sends every contiguous run in place; now and then only
    // one or three per pair, the rest bucketed (max_direct_messages).
    opt.executor.staging_budget = seed % 3 == 0 ? 2048 : seed % 3 == 1 ? 8192 : (64 << 20);
    opt.executor.zero_copy_min = seed % 2 ? 0 : 1024;
    opt.executor.max_direct_messages = seed % 7 == 0 ? 1 : seed % 7 == 3 ? 3 : 0;
    opt.executor.pipeline = seed % 5 == 0 ? 1 : 2;
    opt.executor.timeout = std::chrono::seconds(60);
    auto o = run_refits(pair.src, pair.dst, opt);
    check_outcome(o);
    CHECK(o.traffic.bytes_sent == o.plan_bytes);
    ++cases;
  }
  CHECK(cases == 300);
}

TEST_CASE("repeated refits reuse the compiled program and move the new weights") {
  auto [src, dst] = llama_block();
  ResharderOptions opt;
  opt.executor.staging_budget = 2048;  // many waves
  auto o = run_refits(src, dst, opt, 4);
  check_outcome(o);
  for (auto c : o.compiles) CHECK(c == 1);
  for (const auto& r : o.last) CHECK(r.refit_index == 3);
  // Four refits moved four times the plan.
  CHECK(o.traffic.bytes_sent == 4 * o.plan_bytes);
  CHECK(o.max(&RefitReport::peak_staging_bytes) <= 2048);
}

TEST_CASE("a staging budget smaller than one message splits it across waves") {
  // One 32 KiB strided piece per pair (row-parallel: packed on the sender).
  Layout src = make_layout({{"tp", 2}}, 0, {tensor("o", {128, 256}, {{}, on(0, 2)}, DType::bf16)});
  Layout dst = make_layout({{"tp", 4}}, 2, {tensor("o", {128, 256}, {{}, on(0, 4)}, DType::bf16)});
  ResharderOptions opt;
  opt.executor.staging_budget = 1024;
  auto o = run_refits(src, dst, opt);
  check_outcome(o);
  CHECK(o.max(&RefitReport::peak_staging_bytes) <= 1024);
  CHECK(o.max(&RefitReport::peak_staging_bytes) > 0);
  int most_waves = 0;
  for (const auto& r : o.last) most_waves = std::max(most_waves, r.waves);
  CHECK(most_waves >= 32);  // 16 KiB per pair through at most 512 bytes per wave
}

TEST_CASE("strided views: weights inside larger allocations") {
  auto [src, dst] = llama_block();
  const auto ranks = refit_test::world_of(src, dst);
  std::vector<refit_test::SideMemory> smem, dmem;
  for (auto r : ranks) {
    smem.push_back(refit_test::make_side(src, r, true, 9));
    dmem.push_back(refit_test::make_side(dst, r, false, 9));
  }
  // Each destination buffer lives in a bigger allocation (outer dims
  // pitched, 1-d buffers every other element), starting from the poisoned
  // contents so that padding checks still hold; copied back out to check.
  std::vector<std::unique_ptr<refit_test::StridedSide>> strided;
  for (std::size_t i = 0; i < ranks.size(); ++i) strided.push_back(std::make_unique<refit_test::StridedSide>(dst, ranks[i], dmem[i]));
  std::int64_t wrong = 0;
  std::string first;
  std::mutex m;
  LocalWorld world(ranks);
  world.run([&](LocalTransport& t) {
    const std::size_t i = refit_test::index_of(ranks, t.rank());
    LocalBuffers bufs;
    bufs.src = refit_test::views(src, smem[i]);
    bufs.dst = strided[i]->views(dst);
    ResharderOptions opt;
    opt.executor.zero_copy_min = 0;
    Resharder<Layout, LocalTransport> r(src, dst, bufs, t, opt);
    r.refit();
    strided[i]->load(dmem[i]);
    std::string f;
    const auto w = refit_test::count_wrong(dst, dmem[i], t.rank(), 9, &f);
    std::lock_guard lk(m);
    if (w && first.empty()) first = f;
    wrong += w;
    CHECK(strided[i]->gaps_intact());  // nothing between the views' elements was written
  });
  INFO(first);
  CHECK(wrong == 0);
}

TEST_CASE("misuse is a clear error naming the buffer") {
  auto [src, dst] = llama_block();
  const auto ranks = refit_test::world_of(src, dst);
  // Runs a setup where `edit` changes rank 5's buffers; returns the error.
  auto setup_error = [&](const std::function<void(LocalBuffers&)>& edit) {
    std::vector<refit_test::SideMemory> smem, dmem;
    for (auto r : ranks) {
      smem.push_back(refit_test::make_side(src, r, true, 0));
      dmem.push_back(refit_test::make_side(dst, r, false, 0));
    }
    LocalWorld world(ranks);
    return error_of([&] {
      world.run([&](LocalTransport& t) {
        const std::size_t i = refit_test::index_of(ranks, t.rank());
        LocalBuffers bufs{refit_test::views(src, smem[i]), refit_test::views(dst, dmem[i])};
        if (t.rank() == 5) edit(bufs);
        Resharder<Layout, LocalTransport> r(src, dst, bufs, t);
        r.refit();
      });
    });
  };
  CHECK(setup_error([](LocalBuffers&) {}) == "(no error)");
  auto e = setup_error([](LocalBuffers& b) { b.dst.erase("qkv_proj"); });
  CHECK(e.find("destination buffer 'qkv_proj' is missing") != std::string::npos);
  CHECK(e.find("rank 5") != std::string::npos);
  // A misspelt name: the missing buffer and the unknown key given instead, both named.
  e = setup_error([](LocalBuffers& b) {
    b.dst["qkv_prj"] = b.dst.at("qkv_proj");
    b.dst.erase("qkv_proj");
  });
  CHECK(e.find("destination buffer 'qkv_proj' is missing") != std::string::npos);
  CHECK(e.find("given but not buffers of") != std::string::npos);
  CHECK(e.find("'qkv_prj'") != std::string::npos);
  e = setup_error([](LocalBuffers& b) { b.dst["gate_up_proj"].elements -= 1; });
  CHECK(e.find("'gate_up_proj' is too small") != std::string::npos);
  e = setup_error([](LocalBuffers& b) {
    auto& v = b.dst["o"];
    v.element_bytes = 4;
    v.elements /= 2;
  });
  CHECK(e.find("'o' has 4-byte elements but the layout stores bf16") != std::string::npos);
  e = setup_error([](LocalBuffers& b) { b.dst["qkv"] = b.dst["qkv_proj"]; });
  CHECK(e.find("'qkv' is not a buffer of") != std::string::npos);
  e = setup_error([](LocalBuffers& b) { b.dst["down"].data = b.dst["o"].data; });
  CHECK(e.find("overlap in memory") != std::string::npos);
  e = setup_error([](LocalBuffers& b) {
    auto& v = b.dst["o"];
    v.shape = {64, 32};
    v.strides = {32, 1};
  });
  CHECK(e.find("the view has shape [64, 32] but the layout gives this rank shape [64, 16]") != std::string::npos);
  e = setup_error([](LocalBuffers& b) {
    auto& v = b.dst["o"];
    v.shape = {64, 16};
    v.strides = {8, 1};
  });
  CHECK(e.find("map two elements to one place") != std::string::npos);
  e = setup_error([](LocalBuffers& b) { b.src["linear_qkv"] = b.dst["o"]; });
  CHECK(e.find("source buffer 'linear_qkv' was given but") != std::string::npos);
}

TEST_CASE("refit before setup, and a failed refit, are errors") {
  auto [src, dst] = llama_block();
  Resharder<Layout, LocalTransport> unready(src, dst);
  auto e = error_of([&] { unready.refit(); });
  CHECK(e.find("setup() has not completed") != std::string::npos);

  // Rank 4 never calls refit: every rank that exchanges data with it must
  // fail at its deadline (or by abort), never return a report.
  const auto ranks = refit_test::world_of(src, dst);
  std::vector<refit_test::SideMemory> smem, dmem;
  for (auto r : ranks) {
    smem.push_back(refit_test::make_side(src, r, true, 0));
    dmem.push_back(refit_test::make_side(dst, r, false, 0));
  }
  std::atomic<int> reports{0}, depends{0};
  LocalWorld world(ranks);
  ResharderOptions opt;
  opt.executor.timeout = std::chrono::milliseconds(300);
  e = error_of([&] {
    world.run([&](LocalTransport& t) {
      const std::size_t i = refit_test::index_of(ranks, t.rank());
      LocalBuffers bufs{refit_test::views(src, smem[i]), refit_test::views(dst, dmem[i])};
      Resharder<Layout, LocalTransport> r(src, dst, bufs, t, opt);
      if (t.rank() == 4) {
        std::this_thread::sleep_for(std::chrono::milliseconds(800));
        return;
      }
      bool needs4 = false;
      for (const auto& c : r.schedule().copies) needs4 |= c.src_rank == 4 || c.dst_rank == 4;
      depends += needs4;
      try {
        r.refit();
        reports += needs4;
      } catch (const Error&) {
        // A second refit after a failure is refused.
        auto again = error_of([&] { r.refit(); });
        CHECK(again.find("an earlier run failed") != std::string::npos);
        throw;
      }
    });
  });
  CHECK(depends > 0);
  CHECK(reports == 0);
  CHECK((e.find("timed out") != std::string::npos || e.find("aborted") != std::string::npos));
}

TEST_CASE("layouts of different tensors are refused before any setup") {
  auto [src, dst] = llama_block();
  Layout other = make_layout({{"tp", 1}}, 0, {tensor("q", {64, 32})});
  auto e = error_of([&] { Resharder<Layout, LocalTransport> r(src, other); });
  CHECK(e.find("tensor 'q': shape: shape [64, 32] differs from [64, 64]") != std::string::npos);
}

namespace {
/// Stands for a compile-time layout type: anything with .lower() works.
struct LowersToLayout {
  Layout runtime;
  Layout lower() const { return runtime; }
};
}  // namespace

TEST_CASE("layouts given as types that lower to reshard::Layout") {
  auto [src, dst] = llama_block();
  static_assert(LayoutDescription<LowersToLayout>);
  static_assert(!LayoutDescription<int>);
  const LowersToLayout typed{src}, typed_dst{dst};
  refit_test::DenseWorld memory(src, dst, 4);
  const auto& ranks = memory.ranks;
  auto& smem = memory.src_mem;
  auto& dmem = memory.dst_mem;
  std::atomic<std::int64_t> wrong{0};
  LocalWorld world(ranks);
  world.run([&](LocalTransport& t) {
    const std::size_t i = refit_test::index_of(ranks, t.rank());
    LocalBuffers bufs{refit_test::views(src, smem[i]), refit_test::views(dst, dmem[i])};
    // Resharder<L, T> keeps the two layouts as the L given; Resharder<Layout, T> lowers mixed forms.
    Resharder<LowersToLayout, LocalTransport> r(typed, typed_dst, bufs, t);
    static_assert(std::is_same_v<decltype(r.source_layout()), const LowersToLayout&>);
    static_assert(!std::is_constructible_v<Resharder<LowersToLayout, LocalTransport>, const LowersToLayout&, const Layout&>);
    static_assert(std::is_constructible_v<Resharder<Layout, LocalTransport>, const LowersToLayout&, const Layout&>);
    static_assert(std::is_constructible_v<Resharder<Layout, LocalTransport>, const LayoutSpec&, const Layout&>);
    if (&r.source_layout() == &typed || r.source_layout().runtime.tensors.size() != src.tensors.size()) wrong += 1000;
    r.refit();
    wrong += refit_test::count_wrong(dst, dmem[i], t.rank(), 4, nullptr);
  });
  CHECK(wrong == 0);
}

TEST_CASE("make_resharder and deduction take any layout form; a Resharder moves and refits after the move") {
  auto [src, dst] = llama_block();
  const LowersToLayout typed{src};
  // plan() takes the same forms as Resharder: a lowered type plans like the Layout it lowers to.
  CHECK(reshard::plan(typed, dst).copies.size() == reshard::plan(src, dst).copies.size());
  refit_test::DenseWorld memory(src, dst, 5);
  const auto& ranks = memory.ranks;
  auto& smem = memory.src_mem;
  auto& dmem = memory.dst_mem;
  std::atomic<std::int64_t> wrong{0}, deduced{0};
  LocalWorld world(ranks);
  world.run([&](LocalTransport& t) {
    const std::size_t i = refit_test::index_of(ranks, t.rank());
    LocalBuffers bufs{refit_test::views(src, smem[i]), refit_test::views(dst, dmem[i])};
    Resharder deduced_type(typed, dst, bufs, t);  // deduction: Resharder<Layout, LocalTransport>
    static_assert(std::is_same_v<decltype(deduced_type), Resharder<Layout, LocalTransport>>);
    deduced += deduced_type.state() == RefitState::empty;
    std::vector<Resharder<Layout, LocalTransport>> held;
    held.push_back(make_resharder(typed, dst, bufs, t));
    held.reserve(8);  // moves the Resharder to new storage
    auto moved = std::move(held.front());
    moved.refit();
    wrong += refit_test::count_wrong(dst, dmem[i], t.rank(), 5, nullptr);
  });
  CHECK(deduced == static_cast<std::int64_t>(ranks.size()));
  CHECK(wrong == 0);
}

namespace {
namespace st = reshard::st;
/// One mesh type for both sides (axes sized at runtime), so both layouts are
/// of one static type: Resharder<st::LayoutOf<Grid>, T>.
using Grid = st::MeshOf<st::Axis<"dp">, st::Axis<"tp">>;
using Col = st::ColumnParallel<"tp">;
using Row = st::RowParallel<"tp">;

/// A static pair: training dp=2 x tp=2 (ranks 0-3), inference tp=4 (ranks
/// 4-7). "w", "b" and "e" are stored alone and added with their element
/// types; "q" and "k" are fused into "qk", bound by name.
struct StaticPair {
  st::LayoutOf<Grid> train{Grid(2, 2), "static train"}, infer{[] {
                                                              Grid g(1, 4);
                                                              g.first_rank = 4;
                                                              return g;
                                                            }(),
                                                            "static infer"};
  st::TensorHandle<st::Tensor<Col>, float> w_train, w_infer;
  st::TensorHandle<st::Tensor<st::Replicated>, bf16_t> b_train;
  st::TensorHandle<st::Tensor<st::ShardOn<0, st::Shard<"tp">>>, bf16_t> b_infer;
  st::TensorHandle<st::Tensor<Col>, float> e_train;
  st::TensorHandle<st::Tensor<Row>, float> e_infer;
  StaticPair() {
    w_train = train.add<float>(st::Tensor<Col>("w", {64, 32}, DType::f32));
    w_infer = infer.add<float>(st::Tensor<Col>("w", {64, 32}, DType::f32));
    b_train = train.add<bf16_t>(st::Tensor<st::Replicated>("b", {96}, DType::bf16));
    b_infer = infer.add<bf16_t>(st::Tensor<st::ShardOn<0, st::Shard<"tp">>>("b", {96}, DType::bf16));
    e_train = train.add<float>(st::Tensor<Col>("e", {16, 8}, DType::f32));
    e_infer = infer.add<float>(st::Tensor<Row>("e", {16, 8}, DType::f32));
    for (auto* L : {&train, &infer}) {
      auto q = L->add(st::Tensor<Col>("q", {32, 32}, DType::f32));
      auto k = L->add(st::Tensor<Col>("k", {16, 32}, DType::f32));
      L->concat("qk", q, k);
    }
  }
};

/// The bytes make_side gave local buffer `name`, as elements of E.
template <class E>
std::span<E> memory_of(const Layout& L, refit_test::SideMemory& m, const std::string& name) {
  for (std::size_t b = 0; b < L.local_buffers().size(); ++b)
    if (L.local_buffers()[b].name == name) return {reinterpret_cast<E*>(m.data[b].data()), m.data[b].size() / sizeof(E)};
  return {};
}
}  // namespace

TEST_CASE("Resharder<st::LayoutOf<M>, T>: two static layouts kept as given, memory bound through typed tensor handles") {
  StaticPair p;
  const Layout src = p.train.lower(), dst = p.infer.lower();
  refit_test::DenseWorld m(src, dst, 6);
  std::atomic<std::int64_t> wrong{0}, refits{0};
  LocalWorld world(m.ranks);
  world.run([&](LocalTransport& t) {
    const std::size_t i = refit_test::index_of(m.ranks, t.rank());
    auto &smem = m.src_mem, &dmem = m.dst_mem;
    LocalBuffers bufs;
    if (t.rank() < 4) {
      bind_tensor(bufs.src, p.w_train, memory_of<const float>(src, smem[i], "w"));
      bind_tensor(bufs.src, p.b_train, memory_of<bf16_t>(src, smem[i], "b"));
      bind_tensor(bufs.src, p.e_train, memory_of<float>(src, smem[i], "e").data(), std::array<std::int64_t, 2>{8, 8},
           std::array<std::int64_t, 2>{8, 1});
      bufs.src["qk"] = view_of(memory_of<float>(src, smem[i], "qk"));
    } else {
      bind_tensor(bufs.dst, p.w_infer, memory_of<float>(dst, dmem[i], "w"));
      bind_tensor(bufs.dst, p.b_infer, memory_of<bf16_t>(dst, dmem[i], "b"));
      bind_tensor(bufs.dst, p.e_infer, memory_of<float>(dst, dmem[i], "e").data(), std::array<std::int64_t, 2>{16, 2},
           std::array<std::int64_t, 2>{2, 1});
      bufs.dst["qk"] = view_of(memory_of<float>(dst, dmem[i], "qk"));
    }
    Resharder r(p.train, p.infer, bufs, t);  // deduced: Resharder<st::LayoutOf<Grid>, LocalTransport>
    static_assert(std::is_same_v<decltype(r), Resharder<st::LayoutOf<Grid>, LocalTransport>>);
    static_assert(std::is_same_v<decltype(r.source_layout()), const st::LayoutOf<Grid>&>);
    // Kept as given: the static objects, with their meshes' runtime sizes.
    if (r.source_layout().mesh.size<"tp">() != 2 || r.destination_layout().mesh.size<"tp">() != 4 ||
        r.destination_layout().mesh.first_rank != 4 || r.dst_layout().tensors.size() != 5)
      wrong += 1000;
    refits += r.refit().version == 1;
    wrong += refit_test::count_wrong(dst, dmem[i], t.rank(), 6, nullptr);
  });
  CHECK(refits == static_cast<std::int64_t>(m.ranks.size()));
  CHECK(wrong == 0);

  // What only runtime values show, named: a dtype that is not the element type
  // add<E> gives, a tensor bound twice, a part of a fused buffer bound alone,
  // a typed view whose extents are not this rank's shard.
  st::LayoutOf<Grid> other{Grid(1, 2), "other"};
  CHECK(error_of([&] { other.add<float>(st::Tensor<Col>("h", {4, 4}, DType::bf16)); }) ==
        "other: tensor 'h': dtype: the tensor is bf16 but add<E> gives its element type as f32");
  // add<const E> gives the handle of E: the memory's constness is the binding's business.
  auto c = other.add<const float>(st::Tensor<Col>("c", {4, 4}, DType::f32));
  static_assert(std::is_same_v<decltype(c)::element_type, float>);
  std::vector<float> four(4);
  std::map<std::string, BufferView> side;
  bind_tensor(side, c, std::span<const float>(four));
  bind_tensor(side, p.w_train, std::span<float>(four));
  CHECK(error_of([&] { bind_tensor(side, p.w_train, std::span<float>(four)); }) == "bind_tensor: tensor 'w' is already bound in this buffer set");
  std::vector<float> qk(48 * 16), w(32 * 32), e(8 * 8);
  std::vector<bf16_t> b(96);
  std::map<std::string, BufferView> parts{{"qk", view_of(qk.data(), qk.size())}, {"q", view_of(qk.data(), 16u)}};
  bind_tensor(parts, p.w_train, std::span<float>(w));
  bind_tensor(parts, p.b_train, std::span<bf16_t>(b));
  bind_tensor(parts, p.e_train, std::span<float>(e));
  CHECK(error_of([&] { bind_buffers(src, 0, parts, "source"); }) ==
        "rank 0: source buffer 'q': tensor 'q' of static train is a part of buffer 'qk', which is bound by its own name "
        "(this rank has: qk, w, b, e)");
  parts.erase("q");
  parts.erase("e");
  bind_tensor(parts, p.e_train, e.data(), std::array<std::int64_t, 2>{8, 4}, std::array<std::int64_t, 2>{4, 1});
  CHECK(error_of([&] { bind_buffers(src, 0, parts, "source"); }) ==
        "rank 0: source buffer 'e': the view has shape [8, 4] but the layout gives this rank shape [8, 8]");
}
