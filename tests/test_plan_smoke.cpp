// Hand-checked plans: the copies a few small layout pairs must produce.
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
  LayoutSpec L;
  L.mesh.axes = {{axis, size}};
  L.mesh.first_rank = first;
  L.tensors.push_back(tensor_spec("w", std::move(shape), DType::bf16, std::move(dims)));
  return Layout(std::move(L));
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

// Each kind of field a caller writes, as a concept: true for a LayoutSpec,
// and it must be false for a Layout (a validated one is read-only).
template <class L>
concept writes_shape = requires(L& l) { l.tensors[0].shape[0] = 16; };
template <class L>
concept writes_tensor_list = requires(L& l) { l.tensors.push_back(TensorSpec{}); };
template <class L>
concept writes_cut = requires(L& l) { l.tensors[0].dims[0].split = Split::cyclic; };
template <class L>
concept writes_mesh = requires(L& l) {
  l.mesh.axes[0].size = 4;
  l.mesh.first_rank = 2;
};
template <class L>
concept writes_buffer = requires(L& l) { l.buffers[0].parts.push_back("w"); };
template <class L>
concept writes_quant = requires(L& l) { l.tensors[0].quant->block = {4, 4}; };
template <class L>
concept writes_origin = requires(L& l) { l.origin = "elsewhere.json"; };
template <class L>
concept writes_any = writes_shape<L> || writes_tensor_list<L> || writes_cut<L> || writes_mesh<L> || writes_buffer<L> ||
                     writes_quant<L> || writes_origin<L>;
static_assert(writes_shape<LayoutSpec> && writes_tensor_list<LayoutSpec> && writes_cut<LayoutSpec> && writes_mesh<LayoutSpec> &&
                  writes_buffer<LayoutSpec> && writes_quant<LayoutSpec> && writes_origin<LayoutSpec>,
              "the concepts below must be able to hold");
static_assert(!writes_any<Layout>, "a validated Layout's fields must not be writable");

TEST_CASE("a validated layout is read-only: copies keep their own state, a changed spec is validated anew, an empty one is refused") {
  const auto src = one_axis("tp", 2, 0, {8, 4}, {cut(2), {}});
  const auto dst = one_axis("tp", 4, 0, {8, 4}, {{}, cut(4)});
  REQUIRE(src.validated());
  // The field views of a copy, an assigned and a moved layout are their own.
  Layout copied = src;
  Layout assigned;
  assigned = src;
  Layout moved = std::move(copied);
  for (const Layout* L : {&assigned, &moved}) {
    CHECK(&L->tensors == &L->spec().tensors);
    CHECK(&L->mesh == &L->spec().mesh);
    CHECK(&L->tensors != &src.tensors);
    CHECK(L->validated());
    CHECK(L->tensors[0].shape == std::vector<std::int64_t>{8, 4});
    CHECK(plan(*L, dst).copies.size() == plan(src, dst).copies.size());
  }
  // A change is a copy of the spec, validated: the original stays as it was.
  LayoutSpec grown_spec = src.spec();
  grown_spec.tensors[0].shape[0] = 16;
  const Layout grown(std::move(grown_spec));
  CHECK(src.tensors[0].shape[0] == 8);
  CHECK(grown.tensors[0].shape[0] == 16);
  CHECK(plan(grown, one_axis("tp", 4, 0, {16, 4}, {{}, cut(4)})).copies.size() > 0);
  // plan() takes a LayoutSpec too, validating it (as the Resharder does).
  CHECK(plan(src.spec(), LayoutSpec(dst)).copies.size() == plan(src, dst).copies.size());
  LayoutSpec bad = src.spec();
  bad.tensors[0].dims[0].axes[0].axis = 3;
  CHECK_THROWS_AS(Layout{bad}, LayoutError);
  // Moved-from and default-constructed layouts are empty: plan() names the side.
  CHECK_FALSE(copied.validated());  // NOLINT(bugprone-use-after-move): what a move leaves is the point
  const std::string e = test_util::error_of([&] { (void)plan(src, copied); });
  CHECK(e.find("the destination layout is empty") != std::string::npos);
  const std::string f = test_util::error_of([&] { (void)plan(Layout{}, dst); });
  CHECK(f.find("the source layout is empty") != std::string::npos);
}
