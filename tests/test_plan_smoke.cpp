// Hand-checked plans: the copies a few small layout pairs must produce.
#include <doctest/doctest.h>

#include "reshard/reshard.hpp"

using namespace reshard;

namespace {
Layout one_axis(const std::string& axis, std::int64_t size, std::int64_t first, std::vector<std::int64_t> shape,
                std::vector<DimSpec> dims) {
  Layout L;
  L.mesh.axes = {{axis, size}};
  L.mesh.first_rank = first;
  TensorSpec t;
  t.name = "w";
  t.shape = std::move(shape);
  t.dtype = DType::bf16;
  t.dims = std::move(dims);
  L.tensors.push_back(t);
  L.validate();
  return L;
}
DimSpec cut(std::int64_t size) {
  DimSpec d;
  d.axes = {AxisRef{0, 1, size}};
  return d;
}
}  // namespace

TEST_CASE("same-dim contiguous reshard is one copy per peer pair") {
  auto src = one_axis("tp", 2, 0, {8, 4}, {cut(2), {}});
  auto dst = one_axis("tp", 4, 2, {8, 4}, {cut(4), {}});
  auto s = plan(src, dst);
  REQUIRE(s.copies.size() == 4);
  for (const auto& c : s.copies) {
    CHECK(c.rank == 1);
    CHECK(c.extent[0] == 8);
    CHECK(c.src_rank == (c.dst_rank - 2) / 2);
    CHECK(c.src_offset == ((c.dst_rank - 2) % 2) * 8);
    CHECK(c.dst_offset == 0);
  }
  CHECK(s.stats.bytes == 8 * 4 * 2);
}

TEST_CASE("colocated identical layouts copy locally only") {
  auto src = one_axis("tp", 4, 0, {8, 4}, {cut(4), {}});
  auto dst = one_axis("tp", 4, 0, {8, 4}, {cut(4), {}});
  auto s = plan(src, dst);
  CHECK(s.stats.bytes == 0);
  CHECK(s.stats.local_bytes == 8 * 4 * 2);
}
