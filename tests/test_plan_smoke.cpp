// Hand-checked plans: the copies a few small layout pairs must produce.
#include <functional>
#include <map>
#include <random>

#include <doctest/doctest.h>

#include "error_of.hpp"
#include "plan_test_util.hpp"
#include "reshard/reshard.hpp"

using namespace reshard;

namespace {
Layout one_axis(const std::string& axis, std::int64_t size, std::int64_t first, std::vector<std::int64_t> shape,
                std::vector<DimSpec> dims) {
  Layout L;
  L.mesh.axes = {{axis, size}};
  L.mesh.first_rank = first;
  L.tensors.push_back(tensor_spec("w", std::move(shape), DType::bf16, std::move(dims)));
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
    CHECK(c.extent(0) == 8);
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

TEST_CASE("CopyLog gives back every copy as pushed, in push order, across blocks") {
  std::mt19937_64 rng(7);
  auto any = [&](std::int64_t lo, std::int64_t hi) { return std::uniform_int_distribution<std::int64_t>(lo, hi)(rng); };
  std::vector<Copy> pushed;
  detail::CopyLog log;
  for (int i = 0; i < 5000; ++i) {  // ~50 words each: several 8192-word blocks
    Copy c;
    c.src_rank = any(0, std::int64_t{1} << 40);
    c.dst_rank = any(-1, 1000);
    c.src_buffer = static_cast<std::int32_t>(any(0, INT32_MAX));
    c.dst_buffer = static_cast<std::int32_t>(any(0, 100));
    c.tensor = static_cast<std::int32_t>(any(0, 5000));
    c.element_bytes = static_cast<std::int32_t>(any(1, 8));
    c.src_offset = any(0, INT64_MAX);
    c.dst_offset = any(0, 1 << 30);
    c.rank = static_cast<std::int32_t>(any(1, kMaxBoxRank));
    for (int d = 0; d < c.rank; ++d) {
      c.extent(d) = any(1, 1 << 20);
      c.src_stride(d) = any(-5, INT64_MAX / 2);
      c.dst_stride(d) = any(1, 1 << 20);
    }
    log.push(c);
    pushed.push_back(c);
  }
  REQUIRE(log.size() == pushed.size());
  std::vector<detail::CopyLog::Handle> handles;
  std::size_t at = 0;
  log.for_each_header([&](detail::CopyLog::Handle h, const Copy& c) {
    REQUIRE(at < pushed.size());
    CHECK(c.dst_rank == pushed[at].dst_rank);
    CHECK(c.src_offset == pushed[at].src_offset);
    CHECK(c.rank == pushed[at].rank);
    if (!handles.empty()) CHECK(h > handles.back());  // handles ascend: they break sort ties
    handles.push_back(h);
    ++at;
  });
  REQUIRE(handles.size() == pushed.size());
  Copy back;  // reused, as finish does: dims past a shorter rank must read 0 again
  for (std::size_t i = pushed.size(); i-- > 0;) {
    log.read(handles[i], back);
    CHECK(plantest::copy_key(back) == plantest::copy_key(pushed[i]));
    const Copy& read_back = back;
    for (int d = back.rank; d < kMaxBoxRank; ++d) {
      CHECK(read_back.extent(d) == 0);
      CHECK(read_back.src_stride(d) == 0);
      CHECK(read_back.dst_stride(d) == 0);
    }
  }
}

TEST_CASE("FlatIndex keeps every key's value through growth, with keys alike in their low bits") {
  detail::FlatIndex index;
  std::map<std::uint64_t, std::uint32_t> want;
  std::uint32_t next = 0;
  auto put = [&](std::uint64_t key) {
    auto& v = index.slot(key);
    if (want.count(key)) {
      CHECK(v == want[key]);
      return;
    }
    CHECK(v == detail::FlatIndex::kNone);
    v = next;
    want[key] = next++;
  };
  // The planner's two key forms: tensor << 32 | part, and position * tensors + tensor.
  for (std::uint64_t t = 0; t < 300; ++t)
    for (std::uint64_t part = 0; part < 40; part += 3) put(t << 32 | part);
  for (std::uint64_t pos = 0; pos < 256; pos += 5)
    for (std::uint64_t t = 0; t < 1035; t += 7) put(pos * 1035 + t);
  put(0);
  put(UINT64_MAX - 1);
  for (const auto& [key, value] : want) CHECK(index.slot(key) == value);
  index.clear();  // every key gone, and usable again
  for (std::uint64_t t = 0; t < 300; ++t) CHECK(index.slot(t << 32) == detail::FlatIndex::kNone);
  index.slot(7 << 3) = 5;
  CHECK(index.slot(7 << 3) == 5);
}

TEST_CASE("a layout written after validate() reads as not validated, and plan() refuses it naming the side") {
  auto src = one_axis("tp", 2, 0, {8, 4}, {cut(2), {}});
  auto dst = one_axis("tp", 4, 0, {8, 4}, {{}, cut(4)});
  REQUIRE(src.validated());
  const std::uint64_t before = src.description_hash();
  // Each kind of field the caller writes: any one change makes the resolved state stale.
  std::vector<std::function<void(Layout&)>> writes = {
      [](Layout& L) { L.tensors[0].shape[0] = 16; },
      [](Layout& L) { L.tensors[0].dims[0].axes[0].size = 1; },
      [](Layout& L) { L.tensors[0].dtype = DType::f32; },
      [](Layout& L) { L.tensors[0].name.push_back('2'); },
      [](Layout& L) { L.tensors[0].stage.push_back(StageCoord{0, 1}); },
      [](Layout& L) { L.mesh.axes[0].size = 4; },
      [](Layout& L) { L.tensors[0].dims[0].split = Split::cyclic; },
      [](Layout& L) { L.tensors[0].dims[0].block = 2; },
      [](Layout& L) { L.tensors[0].dims[0].pad_to = 10; },
      [](Layout& L) { L.tensors[0].dims[0].sizes = {3, 5}; },
      [](Layout& L) { L.mesh.first_rank = 2; },
      [](Layout& L) { L.mesh.ranks = {5, 7}; },
      [](Layout& L) { L.buffers.push_back(concat_buffer("wb", {"w"})); },
      [](Layout& L) { L.tensors[0].quant = QuantSpec{}; },
  };
  for (std::size_t k = 0; k < writes.size(); ++k) {
    CAPTURE(k);
    Layout changed = src;
    CHECK(changed.validated());
    writes[k](changed);
    CHECK(changed.description_hash() != before);
    CHECK_FALSE(changed.validated());
    CHECK(changed.changed_since_validation());
    const std::string e = test_util::error_of([&] { (void)plan(changed, dst); });
    CHECK(e.find("the source layout") != std::string::npos);
    CHECK(e.find("changed after validate()") != std::string::npos);
  }
  // The fields of a buffer and of a quantized tensor, on a layout that has them.
  Layout with_buffer = src;
  with_buffer.buffers.push_back(concat_buffer("wb", {"w"}));
  with_buffer.tensors[0].quant = QuantSpec{QuantScheme::block, {2, 2}, "w_scale"};
  const std::uint64_t base = with_buffer.description_hash();
  std::vector<std::function<void(Layout&)>> deeper = {
      [](Layout& L) { L.buffers[0].name.push_back('2'); },
      [](Layout& L) { L.buffers[0].parts.push_back("w"); },
      [](Layout& L) { L.buffers[0].interleave = 2; },
      [](Layout& L) { L.buffers[0].dim = 1; },
      [](Layout& L) { L.buffers[0].kind = BufferKind::flat; },
      [](Layout& L) { L.buffers[0].flat = cut(2); },
      [](Layout& L) { L.tensors[0].quant->block = {4, 4}; },
      [](Layout& L) { L.tensors[0].quant->scale.push_back('2'); },
      [](Layout& L) { L.tensors[0].quant->scheme = QuantScheme::mx; },
  };
  for (std::size_t k = 0; k < deeper.size(); ++k) {
    CAPTURE(k);
    Layout changed = with_buffer;
    deeper[k](changed);
    CHECK(changed.description_hash() != base);
  }
  // Validating again makes it plannable (where the change is itself valid).
  Layout grown = src;
  grown.tensors[0].shape[0] = 16;
  grown.validate();
  CHECK(grown.validated());
  auto grown_dst = one_axis("tp", 4, 0, {16, 4}, {{}, cut(4)});
  CHECK(plan(grown, grown_dst).copies.size() > 0);
  // Resolved fields and the origin are not the caller's description.
  Layout renamed = src;
  renamed.origin = "elsewhere.json";
  CHECK(renamed.validated());
  // A layout never validated is told apart from a changed one.
  Layout fresh;
  fresh.mesh.axes = {{"tp", 2}};
  fresh.tensors.push_back(tensor_spec("w", {8, 4}, DType::bf16));
  const std::string e = test_util::error_of([&] { (void)plan(src, fresh); });
  CHECK(e.find("the destination layout") != std::string::npos);
  CHECK(e.find("not validated") != std::string::npos);
}
