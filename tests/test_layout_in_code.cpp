// Layouts written in code (issue 39): an axis reference without a size cuts
// over the whole axis (never a silent replication), LayoutBuilder reads like
// the layout file and builds the same layout as the file, and errors name
// what is wrong, with the default origin said plainly.
#include <doctest/doctest.h>

#include <nlohmann/json.hpp>

#include "error_of.hpp"
#include "reshard/json_io.hpp"
#include "reshard/layout/layout_builder.hpp"
#include "reshard/layout/rank_buffers.hpp"

using namespace reshard;

namespace {

/// The global rows each rank holds of a [6, 4] tensor: (rank, first row, row count), from its slot runs.
std::vector<std::tuple<std::int64_t, std::int64_t, std::int64_t>> rows_held(const Layout& L) {
  std::vector<std::tuple<std::int64_t, std::int64_t, std::int64_t>> out;
  for (auto r : L.mesh.global_ranks())
    for (const auto& b : rank_buffers(L, r)) {
      std::int64_t first = -1, n = 0;
      for_each_slot_run(L, b, [&](std::int64_t, std::int64_t len, int, std::int64_t g) {
        if (first < 0) first = g / 4;
        n += len;
      });
      out.emplace_back(r, first, n / 4);
    }
  return out;
}

DimSpec cut_over(AxisRef r) {
  DimSpec d;
  d.axes = {r};
  return d;
}

}  // namespace

TEST_CASE("an AxisRef without a size cuts over the whole axis: tp=3 written in code holds a third per rank, not everything") {
  LayoutSpec s;
  s.mesh.axes = {{"tp", 3}};
  s.tensors.push_back(tensor_spec("w", {6, 4}, DType::f32, {cut_over(AxisRef{0}), {}}));
  const Layout L(s);
  CHECK(L.tensors[0].dims[0].axes[0].size == 3);
  CHECK(L.tensors[0].cuts[0].k == 3);
  // Rank r holds rows 2r and 2r+1 (8 elements), by hand.
  using R = std::tuple<std::int64_t, std::int64_t, std::int64_t>;
  CHECK(rows_held(L) == std::vector<R>{R{0, 0, 2}, R{1, 2, 2}, R{2, 4, 2}});
  // The same as the file says it.
  const Layout F = parse_layout(nlohmann::json::parse(R"({"mesh": {"axes": [["tp", 3]]},
    "tensors": [{"name": "w", "shape": [6, 4], "dtype": "f32", "dims": ["tp", null]}]})"), "f");
  CHECK(layout_to_json(L) == layout_to_json(F));
}

TEST_CASE("an AxisRef with a stride and no size is the rest of the axis; a stride that does not divide it is named") {
  LayoutSpec s;
  s.mesh.axes = {{"dp", 2}, {"tp", 4}};
  s.tensors.push_back(tensor_spec("w", {8}, DType::f32, {cut_over(AxisRef{1, 2})}));
  CHECK(Layout(s).tensors[0].dims[0].axes[0].size == 2);
  s.tensors[0].dims[0].axes[0].stride = 3;
  CHECK(test_util::error_of([&] { Layout{s}; }) ==
        "layout written in code: tensor 'w': dims[0].axes[0]: sub-axis of 'tp' without a size: stride 3 does not divide the axis size 4");
  // An explicit size 1 is still a cut into one part (every rank holds it all).
  s.tensors[0].dims[0].axes[0] = AxisRef{1, 1, 1};
  CHECK(Layout(s).tensors[0].cuts[0].k == 1);
}

TEST_CASE("LayoutBuilder: a layout written like its file is the file's layout") {
  const Layout b = LayoutBuilder({{"pp", 2}, {"ep", 2}, {"tp", 2}}, 8, "built")
                       .tensor("q", {8, 6}, "bf16", {"tp", nullptr}, {{"pp", 0}})
                       .tensor("k", {4, 6}, "bf16", {"tp", {}}, {{"pp", 0}})
                       .tensor("experts", {4, 6, 8}, DType::f32, {{"ep", "tp"}, nullptr, nullptr}, {{"pp", 1}})
                       .tensor("norm", {6}, "f32")
                       .concat("qk", {"q", "k"}, 0)
                       .build();
  const Layout f = parse_layout(nlohmann::json::parse(R"({
    "mesh": {"axes": [["pp", 2], ["ep", 2], ["tp", 2]], "first_rank": 8},
    "tensors": [{"name": "q", "shape": [8, 6], "dtype": "bf16", "dims": ["tp", null], "stage": {"pp": 0}},
                {"name": "k", "shape": [4, 6], "dtype": "bf16", "dims": ["tp", null], "stage": {"pp": 0}},
                {"name": "experts", "shape": [4, 6, 8], "dtype": "f32", "dims": [["ep", "tp"], null, null], "stage": {"pp": 1}},
                {"name": "norm", "shape": [6], "dtype": "f32"}],
    "buffers": [{"name": "qk", "parts": ["q", "k"], "dim": 0}]})"), "file");
  CHECK(layout_to_json(b) == layout_to_json(f));
  CHECK(b.origin == "built");
}

TEST_CASE("LayoutBuilder: an unknown axis or dtype is a LayoutError naming the tensor, the field and what exists") {
  CHECK(test_util::error_of([] { LayoutBuilder({{"tp", 2}}).tensor("w", {4}, "f32", {"mp"}); }) ==
        "layout written in code: tensor 'w': dims[0]: no axis named 'mp' in the mesh (its axes: tp)");
  CHECK(test_util::error_of([] { LayoutBuilder({{"tp", 2}}, 0, "mine").tensor("w", {4}, "f32", {}, {{"pp", 0}}); }) ==
        "mine: tensor 'w': stage[0]: no axis named 'pp' in the mesh (its axes: tp)");
  CHECK(test_util::error_of([] { LayoutBuilder({{"tp", 2}}).tensor("w", {4}, "float32"); }) ==
        "layout written in code: tensor 'w': dtype: unknown dtype 'float32' (expected one of f64 f32 bf16 f16 fp8e4m3 fp8e5m2 i64 i32 u32 i8 u8)");
  // Validation errors name the default origin plainly too.
  CHECK(test_util::error_of([] { LayoutBuilder({{"tp", 2}}).tensor("w", {3}, "f32", {"tp"}).build(); }).rfind("layout written in code: tensor 'w': dims[0]", 0) == 0);
}

TEST_CASE("LayoutBuilder: a flat bucket written like its file is the file's layout") {
  const Layout b = LayoutBuilder({{"dp", 2}}).tensor("a", {6}, "f32").tensor("b", {3, 2}, "f32").flat("bucket", {"a", "b"}, "dp").build();
  const Layout f = parse_layout(nlohmann::json::parse(R"({"mesh": {"axes": [["dp", 2]]},
    "tensors": [{"name": "a", "shape": [6], "dtype": "f32"}, {"name": "b", "shape": [3, 2], "dtype": "f32"}],
    "buffers": [{"name": "bucket", "parts": ["a", "b"], "flat": {"axes": ["dp"]}}]})"), "file");
  CHECK(layout_to_json(b) == layout_to_json(f));
  CHECK(rank_buffers(b, 1).at(0).elements == 6);
}
