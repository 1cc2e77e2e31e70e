// Compile-time layouts (static_layout.hpp): lowering gives exactly the
// descriptors one builds by hand or the JSON reader builds, with static and
// dynamic sizes, and plans from lowered layouts equal plans from hand-built ones.
#include <doctest/doctest.h>

#include <string>
#include <type_traits>
#include <vector>

#include "reshard/json_io.hpp"
#include "reshard/layout/static_layout.hpp"
#include "reshard/plan/plan.hpp"

using namespace reshard;
namespace st = reshard::st;
using st::Dim;
using st::dynamic;
using st::Replicate;
using st::Shard;
using st::sub_axis;

namespace {

/// The same value of each named field in x and y.
template <class T, class... F>
void expect_same_fields(const T& x, const T& y, F T::*... field) {
  ([&] { CHECK(x.*field == y.*field); }(), ...);
}

void expect_same_dim(const DimSpec& a, const DimSpec& b, const std::string& where) {
  INFO(where);
  REQUIRE(a.axes.size() == b.axes.size());
  for (std::size_t i = 0; i < a.axes.size(); ++i)
    expect_same_fields(a.axes[i], b.axes[i], &AxisRef::axis, &AxisRef::stride, &AxisRef::size);
  expect_same_fields(a, b, &DimSpec::split, &DimSpec::sizes, &DimSpec::block, &DimSpec::pad_to);
}

/// Every descriptor field of two validated layouts.
void expect_same_layout(const Layout& a, const Layout& b) {
  REQUIRE(a.validated());
  REQUIRE(b.validated());
  REQUIRE(a.mesh.axes.size() == b.mesh.axes.size());
  for (std::size_t i = 0; i < a.mesh.axes.size(); ++i)
    expect_same_fields(a.mesh.axes[i], b.mesh.axes[i], &Axis::name, &Axis::size);
  expect_same_fields(a.mesh, b.mesh, &Mesh::first_rank, &Mesh::ranks);
  REQUIRE(a.tensors.size() == b.tensors.size());
  for (std::size_t t = 0; t < a.tensors.size(); ++t) {
    const auto &x = a.tensors[t], &y = b.tensors[t];
    INFO("tensor " << x.name);
    expect_same_fields(x, y, &TensorSpec::name, &TensorSpec::shape, &TensorSpec::dtype, &TensorSpec::buffer);
    REQUIRE(x.dims.size() == y.dims.size());
    for (std::size_t d = 0; d < x.dims.size(); ++d)
      expect_same_dim(x.dims[d], y.dims[d], x.name + " dim " + std::to_string(d));
    REQUIRE(x.stage.size() == y.stage.size());
    for (std::size_t s = 0; s < x.stage.size(); ++s)
      expect_same_fields(x.stage[s], y.stage[s], &StageCoord::axis, &StageCoord::coord);
  }
  REQUIRE(a.buffers.size() == b.buffers.size());
  for (std::size_t i = 0; i < a.buffers.size(); ++i) {
    const auto &x = a.buffers[i], &y = b.buffers[i];
    INFO("buffer " << x.name);
    expect_same_fields(x, y, &BufferSpec::name, &BufferSpec::parts, &BufferSpec::kind);
    if (x.kind == BufferKind::concat) {
      expect_same_fields(x, y, &BufferSpec::dim, &BufferSpec::interleave);
    } else {
      expect_same_dim(x.flat, y.flat, x.name + " flat");
    }
  }
  REQUIRE(a.local_buffers().size() == b.local_buffers().size());
  for (std::size_t i = 0; i < a.local_buffers().size(); ++i)
    CHECK(a.local_buffers()[i].name == b.local_buffers()[i].name);
}

void expect_same_plan(const Schedule& a, const Schedule& b) {
  CHECK(a.src_buffers == b.src_buffers);
  CHECK(a.dst_buffers == b.dst_buffers);
  REQUIRE(a.copies.size() == b.copies.size());
  for (std::size_t i = 0; i < a.copies.size(); ++i) {
    const auto &x = a.copies[i], &y = b.copies[i];
    INFO("copy " << i);
    CHECK(x.src_rank == y.src_rank);
    CHECK(x.dst_rank == y.dst_rank);
    CHECK(x.src_buffer == y.src_buffer);
    CHECK(x.dst_buffer == y.dst_buffer);
    CHECK(x.tensor == y.tensor);
    CHECK(x.element_bytes == y.element_bytes);
    CHECK(x.src_offset == y.src_offset);
    CHECK(x.dst_offset == y.dst_offset);
    REQUIRE(x.rank == y.rank);
    for (int d = 0; d < x.rank; ++d) {
      CHECK(x.extent(d) == y.extent(d));
      CHECK(x.src_stride(d) == y.src_stride(d));
      CHECK(x.dst_stride(d) == y.dst_stride(d));
    }
  }
  CHECK(a.stats.bytes == b.stats.bytes);
  CHECK(a.stats.local_bytes == b.stats.local_bytes);
}

AxisRef whole(int axis, std::int64_t size) { return AxisRef{axis, 1, size}; }
DimSpec cut(std::vector<AxisRef> axes, Split split = Split::even) {
  DimSpec d;
  d.axes = std::move(axes);
  d.split = split;
  return d;
}
TensorSpec tensor(std::string name, std::vector<std::int64_t> shape, DType dt, std::vector<DimSpec> dims,
                  std::vector<StageCoord> stage = {}) {
  return tensor_spec(std::move(name), std::move(shape), dt, std::move(dims), std::move(stage));
}

}  // namespace

// ---------------------------------------------------------- compile time

using TrainMesh = st::MeshOf<st::Axis<"pp", 2>, st::Axis<"dp">, st::Axis<"tp", 2>>;
static_assert(TrainMesh::axis_count == 3);
static_assert(TrainMesh::dynamic_count == 1);
static_assert(TrainMesh::index_of<"tp"> == 2 && TrainMesh::index_of<"ep"> == -1);
static_assert(TrainMesh::has<"dp"> && !TrainMesh::has<"cp">);
static_assert(std::is_same_v<decltype(std::declval<TrainMesh>().size<"tp">()), st::Int<2>>);
static_assert(std::is_same_v<decltype(std::declval<TrainMesh>().size<"dp">()), std::int64_t>);
static_assert(std::is_same_v<
              decltype(std::declval<st::MeshOf<st::Axis<"tp", 4>, st::Axis<"ep", 2>>>().size()), st::Int<8>>);
static_assert(st::Int<4>{} * 2 == 8);  // static sizes flow into runtime arithmetic

// Sub-axes of one axis that do not overlap may cut two dims; a cut dim's facts are types.
using TwoDigits = st::ShardSpec<Shard<sub_axis("tp", 1, 2)>, Shard<sub_axis("tp", 2, 2)>>;
static_assert(TwoDigits::valid && TwoDigits::static_rank == 2);
static_assert(Dim<Shard<"tp">, st::Cyclic<4>>::split == Split::cyclic &&
              Dim<Shard<"tp">, st::Cyclic<4>>::block == 4);
static_assert(Dim<st::Padded<12>, Shard<"tp">, st::Balanced>::pad_value == 12);  // any order
static_assert(st::ColumnParallel<"tp">::min_rank == 1 && st::RowParallel<"tp">::min_rank == 2);
static_assert(st::fits<TrainMesh, st::Tensor<st::ColumnParallel<"tp">, st::Shape<dynamic, 64>>>);
static_assert(st::Tensor<st::Replicated, st::Shape<4, dynamic>>::static_rank == 2);

// ------------------------------------------------------------- lowering

TEST_CASE("a mesh lowers with its static and runtime sizes in mesh order") {
  TrainMesh m(3);
  CHECK(m.size<"tp">() == 2);
  CHECK(m.size<"dp">() == 3);
  CHECK(m.size() == 12);
  m.first_rank = 16;
  const Mesh lo = m.lower();
  REQUIRE(lo.axes.size() == 3);
  CHECK(lo.axes[0].name == "pp");
  CHECK(lo.axes[0].size == 2);
  CHECK(lo.axes[1].name == "dp");
  CHECK(lo.axes[1].size == 3);
  CHECK(lo.axes[2].name == "tp");
  CHECK(lo.axes[2].size == 2);
  CHECK(lo.first_rank == 16);

  st::MeshOf<st::Axis<"dp">, st::Axis<"ep", 2>, st::Axis<"tp">> two(5, 7);
  CHECK(two.size<"dp">() == 5);
  CHECK(two.size<"tp">() == 7);
  CHECK(two.size() == 70);
}

TEST_CASE("every dim spec lowers to the DimSpec one writes by hand") {
  using M = st::MeshOf<st::Axis<"ep", 2>, st::Axis<"tp">>;
  st::LayoutOf<M> L{M(4)};
  const DType bf = DType::bf16;
  L.add(st::Tensor<st::ColumnParallel<"tp">>("col", {16, 8}, bf));
  L.add(st::Tensor<st::RowParallel<"tp">>("row", {8, 16}, bf));
  L.add(st::Tensor<st::ShardSpec<Dim<Shard<"tp">, st::Chunk>, Replicate>>("chunk", {10, 3}, bf));
  L.add(st::Tensor<st::ShardSpec<Dim<Shard<"ep", "tp">, st::Balanced>>>("balanced", {11}, bf));
  L.add(st::Tensor<st::ShardOn<0, Dim<Shard<"ep">, st::Cyclic<1>>>>("experts", {6, 4, 4}, bf));
  L.add(st::Tensor<st::ShardSpec<Dim<Shard<"tp">, st::Sizes<1, 2, 3, 4>>>>("sizes", {10}, bf));
  L.add(st::Tensor<st::ShardOn<0, Dim<Shard<"tp">, st::Padded<12>>>>("padded", {10, 2}, bf));
  L.add(st::Tensor<st::ShardOn<0, Dim<Shard<"tp">, st::RoundUp<64>>>>("vocab_vllm", {1100, 2}, bf));
  L.add(
      st::Tensor<st::ShardOn<0, Dim<Shard<"tp">, st::RoundUpPerPart<128>>>>("vocab_megatron", {1100, 2}, bf));
  L.add(
      st::Tensor<st::ShardSpec<Shard<sub_axis("tp", 2)>, Shard<sub_axis("tp", 1, 2)>>>("digits", {4, 4}, bf));
  L.add(st::Tensor<st::ShardDims<st::On<2, Shard<"tp">>, st::On<0, Shard<"ep">>>>("two_on", {4, 3, 8}, bf));
  L.add(st::Tensor<st::Replicated>("norm", {8}, bf));
  const Layout lo = L.lower();

  LayoutSpec hand_spec;
  hand_spec.origin = "<static layout>";
  hand_spec.mesh.axes = {{"ep", 2}, {"tp", 4}};
  const AxisRef ep = whole(0, 2), tp = whole(1, 4);
  auto with = [](DimSpec d, auto&& f) {
    f(d);
    return d;
  };
  hand_spec.tensors = {
      tensor("col", {16, 8}, bf, {cut({tp}), {}}),
      tensor("row", {8, 16}, bf, {{}, cut({tp})}),
      tensor("chunk", {10, 3}, bf, {cut({tp}, Split::chunk), {}}),
      tensor("balanced", {11}, bf, {cut({ep, tp}, Split::balanced)}),
      tensor("experts", {6, 4, 4}, bf,
             {with(cut({ep}, Split::cyclic), [](DimSpec& d) { d.block = 1; }), {}, {}}),
      tensor("sizes", {10}, bf,
             {with(cut({tp}, Split::sizes),
                   [](DimSpec& d) {
                     d.sizes = {1, 2, 3, 4};
                   })}),
      tensor("padded", {10, 2}, bf, {with(cut({tp}), [](DimSpec& d) { d.pad_to = 12; }), {}}),
      tensor("vocab_vllm", {1100, 2}, bf, {with(cut({tp}), [](DimSpec& d) { d.pad_to = 1152; }), {}}),
      tensor("vocab_megatron", {1100, 2}, bf, {with(cut({tp}), [](DimSpec& d) { d.pad_to = 1536; }), {}}),
      tensor("digits", {4, 4}, bf, {cut({AxisRef{1, 2, 2}}), cut({AxisRef{1, 1, 2}})}),
      tensor("two_on", {4, 3, 8}, bf, {cut({ep}), {}, cut({tp})}),
      tensor("norm", {8}, bf, {{}}),
  };
  Layout hand(std::move(hand_spec));
  expect_same_layout(lo, hand);
}

TEST_CASE("static extents and runtime extents make one shape; stages lower to coordinates") {
  using M = st::MeshOf<st::Axis<"pp", 2>, st::Axis<"tp", 2>>;
  st::LayoutOf<M> L{M{}};
  const std::int64_t hidden = 24;
  auto q = L.add(
      st::Tensor<st::ColumnParallel<"tp">, st::Shape<dynamic, 16>>("q", {hidden}, DType::f16).stage<"pp">(1));
  CHECK(L.tensors()[static_cast<std::size_t>(q.index)].shape == std::vector<std::int64_t>{24, 16});
  L.add(st::Tensor<st::Replicated, st::Shape<16>>("n", {}, DType::f32).stage<"pp">(0));
  const Layout lo = L.lower();
  LayoutSpec hand_spec;
  hand_spec.origin = "<static layout>";
  hand_spec.mesh.axes = {{"pp", 2}, {"tp", 2}};
  hand_spec.tensors = {tensor("q", {24, 16}, DType::f16, {cut({whole(1, 2)}), {}}, {StageCoord{0, 1}}),
                       tensor("n", {16}, DType::f32, {{}}, {StageCoord{0, 0}})};
  Layout hand(std::move(hand_spec));
  expect_same_layout(lo, hand);
  // The stage is real: the tensors live only on their pipeline stage.
  CHECK(lo.holds(3, 0));   // pp=1, tp=1
  CHECK(!lo.holds(1, 0));  // pp=0
  CHECK(lo.holds(0, 1));
  CHECK(!lo.holds(2, 1));
}

TEST_CASE("concat and flat buffers lower like the JSON reader reads them") {
  using M = st::MeshOf<st::Axis<"pp", 2>, st::Axis<"dp">, st::Axis<"tp", 2>>;
  st::LayoutOf<M> L{M(2)};
  L.mesh.first_rank = 4;
  const DType bf = DType::bf16;
  auto q = L.add(st::Tensor<st::ColumnParallel<"tp">>("q", {64, 64}, bf).stage<"pp">(0));
  auto k = L.add(st::Tensor<st::ColumnParallel<"tp">>("k", {32, 64}, bf).stage<"pp">(0));
  auto v = L.add(st::Tensor<st::ColumnParallel<"tp">>("v", {32, 64}, bf).stage<"pp">(0));
  L.concat<0>("qkv", st::Interleave{2}, q, k, v);
  auto gate = L.add(st::Tensor<st::ColumnParallel<"tp">>("gate", {128, 64}, bf).stage<"pp">(1));
  auto up = L.add(st::Tensor<st::ColumnParallel<"tp">>("up", {128, 64}, bf).stage<"pp">(1));
  L.concat("fc1", gate, up);
  auto n1 = L.add(st::Tensor<st::Replicated>("n1", {64}, bf).stage<"pp">(1));
  auto n2 = L.add(st::Tensor<st::RowParallel<"tp">>("o", {64, 64}, bf).stage<"pp">(1));
  L.flat<Dim<Shard<"dp">, st::Chunk>>("bucket", n1, n2);
  const Layout lo = L.lower();

  const auto parsed = parse_layout(nlohmann::json::parse(R"({
    "mesh": {"axes": [["pp", 2], ["dp", 2], ["tp", 2]], "first_rank": 4},
    "tensors": [
      {"name": "q", "shape": [64, 64], "dtype": "bf16", "dims": ["tp", null], "stage": {"pp": 0}},
      {"name": "k", "shape": [32, 64], "dtype": "bf16", "dims": ["tp", null], "stage": {"pp": 0}},
      {"name": "v", "shape": [32, 64], "dtype": "bf16", "dims": ["tp", null], "stage": {"pp": 0}},
      {"name": "gate", "shape": [128, 64], "dtype": "bf16", "dims": ["tp", null], "stage": {"pp": 1}},
      {"name": "up", "shape": [128, 64], "dtype": "bf16", "dims": ["tp", null], "stage": {"pp": 1}},
      {"name": "n1", "shape": [64], "dtype": "bf16", "stage": {"pp": 1}},
      {"name": "o", "shape": [64, 64], "dtype": "bf16", "dims": [null, "tp"], "stage": {"pp": 1}}
    ],
    "buffers": [
      {"name": "qkv", "parts": ["q", "k", "v"], "dim": 0, "interleave": 2},
      {"name": "fc1", "parts": ["gate", "up"]},
      {"name": "bucket", "parts": ["n1", "o"], "flat": {"axes": ["dp"], "split": "chunk"}}
    ]})"),
                                   "<static layout>");
  expect_same_layout(lo, parsed);
}

TEST_CASE(
    "a JSON layout with sub-axes, cyclic experts, padding and explicit sizes equals its static spelling") {
  using M = st::MeshOf<st::Axis<"dp">, st::Axis<"ep", 2>, st::Axis<"tp", 4>>;
  st::LayoutOf<M> L{M(1)};
  L.mesh.ranks = {7, 6, 5, 4, 3, 2, 1, 0};
  L.add(st::Tensor<st::ShardOn<0, Dim<Shard<"ep">, st::Cyclic<1>>>>("w13", {6, 16, 8}, DType::bf16));
  L.add(st::Tensor<st::ShardSpec<Shard<"ep", sub_axis("tp", 2)>, Shard<sub_axis("tp", 1, 2)>>>("w2", {8, 8},
                                                                                               DType::bf16));
  L.add(st::Tensor<st::ShardOn<0, Dim<Shard<"tp">, st::RoundUpPerPart<16>>>>("embed", {100, 4}, DType::f32));
  L.add(st::Tensor<st::ShardOn<0, Dim<Shard<"tp">, st::Sizes<3, 3, 2, 0>>>>("uneven", {8}, DType::i32));
  const Layout lo = L.lower();
  const auto parsed = parse_layout(nlohmann::json::parse(R"({
    "mesh": {"axes": [["dp", 1], ["ep", 2], ["tp", 4]], "ranks": [7, 6, 5, 4, 3, 2, 1, 0]},
    "tensors": [
      {"name": "w13", "shape": [6, 16, 8], "dtype": "bf16", "dims": [{"axes": ["ep"], "cyclic": 1}, null, null]},
      {"name": "w2", "shape": [8, 8], "dtype": "bf16",
       "dims": [["ep", {"axis": "tp", "stride": 2}], {"axes": [{"axis": "tp", "stride": 1, "size": 2}]}]},
      {"name": "embed", "shape": [100, 4], "dtype": "f32", "dims": [{"axes": ["tp"], "pad_to": 128}, null]},
      {"name": "uneven", "shape": [8], "dtype": "i32", "dims": [{"axes": ["tp"], "split": [3, 3, 2, 0]}]}
    ]})"),
                                   "<static layout>");
  expect_same_layout(lo, parsed);
}

// --------------------------------------------------------------- plans

namespace {
// A two-layer decoder on a Megatron-like training mesh (pp, dp, tp; fused
// per-group qkv, [gate; up], vocabulary padded to 128 * tp) and a vLLM-like
// inference mesh (dp, tp; [q; k; v], vocabulary padded to 64), spelled with
// types and by hand.
constexpr std::int64_t kHidden = 64, kQ = 64, kKV = 32, kFfn = 128, kVocab = 1100;

Layout static_train(std::int64_t dp) {
  using M = st::MeshOf<st::Axis<"pp", 2>, st::Axis<"dp">, st::Axis<"tp", 2>>;
  using Col = st::ColumnParallel<"tp">;
  using Row = st::RowParallel<"tp">;
  using Vocab = st::ShardOn<0, Dim<Shard<"tp">, st::RoundUpPerPart<128>>>;
  st::LayoutOf<M> L{M(dp), "train"};
  const DType bf = DType::bf16;
  L.add(st::Tensor<Vocab, st::Shape<dynamic, kHidden>>("embed", {kVocab}, bf).stage<"pp">(0));
  for (int layer = 0; layer < 2; ++layer) {
    const std::string p = "layers." + std::to_string(layer) + ".";
    const std::int64_t s = layer;  // one layer per stage
    L.add(st::Tensor<st::Replicated>(p + "norm", {kHidden}, bf).stage<"pp">(s));
    auto q = L.add(st::Tensor<Col>(p + "q", {kQ, kHidden}, bf).stage<"pp">(s));
    auto k = L.add(st::Tensor<Col>(p + "k", {kKV, kHidden}, bf).stage<"pp">(s));
    auto v = L.add(st::Tensor<Col>(p + "v", {kKV, kHidden}, bf).stage<"pp">(s));
    L.concat<0>(p + "linear_qkv", st::Interleave{2}, q, k, v);
    L.add(st::Tensor<Row>(p + "o", {kHidden, kQ}, bf).stage<"pp">(s));
    auto gate = L.add(st::Tensor<Col>(p + "gate", {kFfn, kHidden}, bf).stage<"pp">(s));
    auto up = L.add(st::Tensor<Col>(p + "up", {kFfn, kHidden}, bf).stage<"pp">(s));
    L.concat(p + "linear_fc1", gate, up);
    L.add(st::Tensor<Row>(p + "down", {kHidden, kFfn}, bf).stage<"pp">(s));
  }
  L.add(st::Tensor<Vocab, st::Shape<dynamic, kHidden>>("lm_head", {kVocab}, bf).stage<"pp">(1));
  return L.lower();
}

Layout hand_train(std::int64_t dp) {
  LayoutSpec L;
  L.origin = "train";
  L.mesh.axes = {{"pp", 2}, {"dp", dp}, {"tp", 2}};
  const DType bf = DType::bf16;
  const DimSpec tp = cut({whole(2, 2)});
  DimSpec vocab = tp;
  vocab.pad_to = 1280;  // 1100 up to a multiple of 128 * 2
  L.tensors.push_back(tensor("embed", {kVocab, kHidden}, bf, {vocab, {}}, {StageCoord{0, 0}}));
  for (int layer = 0; layer < 2; ++layer) {
    const std::string p = "layers." + std::to_string(layer) + ".";
    const std::vector<StageCoord> s = {StageCoord{0, layer}};
    L.tensors.push_back(tensor(p + "norm", {kHidden}, bf, {{}}, s));
    L.tensors.push_back(tensor(p + "q", {kQ, kHidden}, bf, {tp, {}}, s));
    L.tensors.push_back(tensor(p + "k", {kKV, kHidden}, bf, {tp, {}}, s));
    L.tensors.push_back(tensor(p + "v", {kKV, kHidden}, bf, {tp, {}}, s));
    BufferSpec qkv;
    qkv.name = p + "linear_qkv";
    qkv.parts = {p + "q", p + "k", p + "v"};
    qkv.interleave = 2;
    L.buffers.push_back(qkv);
    L.tensors.push_back(tensor(p + "o", {kHidden, kQ}, bf, {{}, tp}, s));
    L.tensors.push_back(tensor(p + "gate", {kFfn, kHidden}, bf, {tp, {}}, s));
    L.tensors.push_back(tensor(p + "up", {kFfn, kHidden}, bf, {tp, {}}, s));
    BufferSpec fc1;
    fc1.name = p + "linear_fc1";
    fc1.parts = {p + "gate", p + "up"};
    L.buffers.push_back(fc1);
    L.tensors.push_back(tensor(p + "down", {kHidden, kFfn}, bf, {{}, tp}, s));
  }
  L.tensors.push_back(tensor("lm_head", {kVocab, kHidden}, bf, {vocab, {}}, {StageCoord{0, 1}}));
  return Layout(std::move(L));
}

Layout static_infer(std::int64_t first_rank) {
  using M = st::MeshOf<st::Axis<"dp">, st::Axis<"tp", 4>>;
  using Col = st::ColumnParallel<"tp">;
  using Row = st::RowParallel<"tp">;
  using Vocab = st::ShardOn<0, Dim<Shard<"tp">, st::RoundUp<64>>>;
  M mesh(1);
  mesh.first_rank = first_rank;
  st::LayoutOf<M> L{mesh, "infer"};
  const DType bf = DType::bf16;
  L.add(st::Tensor<Vocab>("embed", {kVocab, kHidden}, bf));
  for (int layer = 0; layer < 2; ++layer) {
    const std::string p = "layers." + std::to_string(layer) + ".";
    L.add(st::Tensor<st::Replicated>(p + "norm", {kHidden}, bf));
    auto q = L.add(st::Tensor<Col>(p + "q", {kQ, kHidden}, bf));
    auto k = L.add(st::Tensor<Col>(p + "k", {kKV, kHidden}, bf));
    auto v = L.add(st::Tensor<Col>(p + "v", {kKV, kHidden}, bf));
    L.concat(p + "qkv_proj", q, k, v);
    L.add(st::Tensor<Row>(p + "o", {kHidden, kQ}, bf));
    auto gate = L.add(st::Tensor<Col>(p + "gate", {kFfn, kHidden}, bf));
    auto up = L.add(st::Tensor<Col>(p + "up", {kFfn, kHidden}, bf));
    L.concat(p + "gate_up_proj", gate, up);
    L.add(st::Tensor<Row>(p + "down", {kHidden, kFfn}, bf));
  }
  L.add(st::Tensor<Vocab>("lm_head", {kVocab, kHidden}, bf));
  return L.lower();
}

Layout hand_infer(std::int64_t first_rank) {
  LayoutSpec L;
  L.origin = "infer";
  L.mesh.axes = {{"dp", 1}, {"tp", 4}};
  L.mesh.first_rank = first_rank;
  const DType bf = DType::bf16;
  const DimSpec tp = cut({whole(1, 4)});
  DimSpec vocab = tp;
  vocab.pad_to = 1152;  // 1100 up to a multiple of 64
  L.tensors.push_back(tensor("embed", {kVocab, kHidden}, bf, {vocab, {}}));
  for (int layer = 0; layer < 2; ++layer) {
    const std::string p = "layers." + std::to_string(layer) + ".";
    L.tensors.push_back(tensor(p + "norm", {kHidden}, bf, {{}}));
    L.tensors.push_back(tensor(p + "q", {kQ, kHidden}, bf, {tp, {}}));
    L.tensors.push_back(tensor(p + "k", {kKV, kHidden}, bf, {tp, {}}));
    L.tensors.push_back(tensor(p + "v", {kKV, kHidden}, bf, {tp, {}}));
    BufferSpec qkv;
    qkv.name = p + "qkv_proj";
    qkv.parts = {p + "q", p + "k", p + "v"};
    L.buffers.push_back(qkv);
    L.tensors.push_back(tensor(p + "o", {kHidden, kQ}, bf, {{}, tp}));
    L.tensors.push_back(tensor(p + "gate", {kFfn, kHidden}, bf, {tp, {}}));
    L.tensors.push_back(tensor(p + "up", {kFfn, kHidden}, bf, {tp, {}}));
    BufferSpec gu;
    gu.name = p + "gate_up_proj";
    gu.parts = {p + "gate", p + "up"};
    L.buffers.push_back(gu);
    L.tensors.push_back(tensor(p + "down", {kHidden, kFfn}, bf, {{}, tp}));
  }
  L.tensors.push_back(tensor("lm_head", {kVocab, kHidden}, bf, {vocab, {}}));
  return Layout(std::move(L));
}
}  // namespace

TEST_CASE("plans from lowered layouts equal plans from hand-built ones") {
  for (std::int64_t dp : {1, 2}) {
    CAPTURE(dp);
    const Layout src = static_train(dp), dst = static_infer(4 * dp);
    const Layout hsrc = hand_train(dp), hdst = hand_infer(4 * dp);
    expect_same_layout(src, hsrc);
    expect_same_layout(dst, hdst);
    const Schedule a = plan(src, dst), b = plan(hsrc, hdst);
    CHECK(a.copies.size() > 0);
    CHECK(a.stats.bytes > 0);
    expect_same_plan(a, b);
    // One receiving rank's view, as a real job computes it.
    expect_same_plan(plan(src, dst, PlanOptions{4 * dp + 1, 64 * 1024, true}),
                     plan(hsrc, hdst, PlanOptions{4 * dp + 1, 64 * 1024, true}));
    // Colocated (inference on the training ranks): only local and NVLink moves differ.
    expect_same_plan(plan(src, static_infer(0)), plan(hsrc, hand_infer(0)));
  }
}

TEST_CASE("a static layout and a different hand-built one do not compare equal") {
  // Guards the comparisons above: a vocabulary padded differently is a different plan.
  const Layout src = static_train(1), dst = static_infer(4);
  LayoutSpec other_spec = hand_infer(4);
  other_spec.tensors[0].dims[0].pad_to = 1280;
  Layout other(std::move(other_spec));
  const Schedule a = plan(src, dst), b = plan(src, other);
  bool differs = a.copies.size() != b.copies.size();
  for (std::size_t i = 0; !differs && i < a.copies.size(); ++i)
    differs = a.copies[i].src_offset != b.copies[i].src_offset ||
              a.copies[i].dst_offset != b.copies[i].dst_offset || !same_dims(a.copies[i], 0, b.copies[i], 0) ||
              a.copies[i].dst_rank != b.copies[i].dst_rank;
  CHECK(differs);
}

// --------------------------------------------------------- runtime faults

TEST_CASE("what only runtime values show is a LayoutError naming the tensor and field") {
  using M = st::MeshOf<st::Axis<"dp">, st::Axis<"tp", 4>>;
  SUBCASE("a ShardOn dim beyond a runtime rank") {
    st::LayoutOf<M> L{M(2), "side"};
    try {
      L.add(st::Tensor<st::RowParallel<"tp">>("bias", {64}, DType::f32));
      FAIL("expected a LayoutError");
    } catch (const LayoutError& e) {
      CHECK(e.context.file == "side");
      CHECK(e.context.tensor == "bias");
      CHECK(e.context.field == "dims");
      CHECK(std::string(e.what()).find("cuts dim 1 but the tensor has 1 dims") != std::string::npos);
    }
  }
  SUBCASE("a ShardSpec whose rank differs from a runtime shape") {
    st::LayoutOf<M> L{M(2)};
    L.add(st::Tensor<st::ShardSpec<Shard<"tp">, Replicate>>("w", {8, 8, 8}, DType::f32));
    CHECK_THROWS_AS(L.lower(), LayoutError);
  }
  SUBCASE("an even split of a runtime extent that does not divide") {
    st::LayoutOf<M> L{M(2)};
    L.add(st::Tensor<st::ColumnParallel<"tp">>("w", {10, 8}, DType::f32));
    try {
      (void)L.lower();
      FAIL("expected a LayoutError");
    } catch (const LayoutError& e) {
      CHECK(e.context.tensor == "w");
      CHECK(e.context.field == "dims[0]");
    }
  }
  SUBCASE("a dynamic axis size of zero") {
    st::LayoutOf<M> L{M(0)};
    L.add(st::Tensor<st::Replicated>("w", {8}, DType::f32));
    CHECK_THROWS_AS(L.lower(), LayoutError);
  }
  SUBCASE("a sub-axis stride that does not divide a dynamic axis") {
    using D = st::MeshOf<st::Axis<"tp">>;
    st::LayoutOf<D> L{D(6)};
    L.add(st::Tensor<st::ShardSpec<Shard<sub_axis("tp", 4)>>>("w", {8}, DType::f32));
    CHECK_THROWS_AS(L.lower(), LayoutError);
  }
  SUBCASE("a stage coordinate outside its axis") {
    using P = st::MeshOf<st::Axis<"pp", 2>, st::Axis<"tp", 2>>;
    st::LayoutOf<P> L{P{}};
    L.add(st::Tensor<st::Replicated>("w", {8}, DType::f32).stage<"pp">(2));
    CHECK_THROWS_AS(L.lower(), LayoutError);
  }
  SUBCASE("a tensor handle from another layout") {
    st::LayoutOf<M> A{M(1)}, B{M(1)};
    auto a = A.add(st::Tensor<st::ColumnParallel<"tp">>("a", {8, 8}, DType::f32));
    B.add(st::Tensor<st::ColumnParallel<"tp">>("b", {8, 8}, DType::f32));
    CHECK_THROWS_AS(B.concat("ab", a), Error);
  }
}
