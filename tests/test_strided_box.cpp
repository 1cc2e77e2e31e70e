// StridedBox, the one box type: its variable-rank storage (inline up to two
// dims, on the heap beyond) against plain arrays, and collapse / merge_into
// against a reference that lists a box's elements one by one.
#include <doctest/doctest.h>

#include <array>
#include <random>
#include <utility>
#include <vector>

#include "reshard/schedule/strided_box.hpp"

using namespace reshard;

namespace {

/// A box as plain arrays: the reference the StridedBox is checked against.
struct PlainBox {
  int rank = 0;
  std::int64_t src_offset = 0, dst_offset = 0;
  std::array<std::int64_t, kMaxBoxRank> extent{}, src_stride{}, dst_stride{};
};

/// The (source, destination) offset of every element in row-major order.
std::vector<std::pair<std::int64_t, std::int64_t>> elements_of(const PlainBox& b) {
  std::vector<std::pair<std::int64_t, std::int64_t>> out;
  std::array<std::int64_t, kMaxBoxRank> i{};
  for (int d = 0; d < b.rank; ++d)
    if (b.extent[static_cast<std::size_t>(d)] <= 0) return out;
  while (true) {
    std::int64_t s = b.src_offset, t = b.dst_offset;
    for (int d = 0; d < b.rank; ++d) {
      const auto u = static_cast<std::size_t>(d);
      s += i[u] * b.src_stride[u];
      t += i[u] * b.dst_stride[u];
    }
    out.emplace_back(s, t);
    int d = b.rank - 1;
    for (; d >= 0; --d) {
      const auto u = static_cast<std::size_t>(d);
      if (++i[u] < b.extent[u]) break;
      i[u] = 0;
    }
    if (d < 0) return out;
  }
}

/// Read back through the box's accessors only.
PlainBox plain(const StridedBox& b) {
  PlainBox p;
  p.rank = b.rank;
  p.src_offset = b.src_offset;
  p.dst_offset = b.dst_offset;
  for (int d = 0; d < b.rank; ++d) {
    const auto u = static_cast<std::size_t>(d);
    p.extent[u] = b.extent(d);
    p.src_stride[u] = b.src_stride(d);
    p.dst_stride[u] = b.dst_stride(d);
  }
  return p;
}

StridedBox box_of(const PlainBox& p) {
  StridedBox b;
  b.src_offset = p.src_offset;
  b.dst_offset = p.dst_offset;
  b.rank = p.rank;
  for (int d = p.rank - 1; d >= 0; --d) {  // highest dim first: the first write makes room for all
    const auto u = static_cast<std::size_t>(d);
    b.extent(d) = p.extent[u];
    b.src_stride(d) = p.src_stride[u];
    b.dst_stride(d) = p.dst_stride[u];
  }
  return b;
}

/// Random boxes whose dims are often contiguous with each other (so collapse
/// has work), with unit dims, negative strides and small offsets.
PlainBox random_box(std::mt19937_64& g, int rank) {
  PlainBox p;
  p.rank = rank;
  p.src_offset = static_cast<std::int64_t>(g() % 50);
  p.dst_offset = static_cast<std::int64_t>(g() % 50);
  std::int64_t ss = 1, ds = 1;
  for (int d = rank - 1; d >= 0; --d) {
    const auto u = static_cast<std::size_t>(d);
    p.extent[u] = 1 + static_cast<std::int64_t>(g() % 3);
    const bool dense = g() % 2 == 0;
    p.src_stride[u] = dense ? ss : ss + static_cast<std::int64_t>(g() % 3);
    p.dst_stride[u] = dense ? ds : ds + static_cast<std::int64_t>(g() % 3);
    if (g() % 8 == 0) p.src_stride[u] = -p.src_stride[u];
    ss = std::abs(p.src_stride[u]) * p.extent[u];
    ds = std::abs(p.dst_stride[u]) * p.extent[u];
  }
  return p;
}

}  // namespace

TEST_CASE("a strided box stores any rank up to kMaxBoxRank; copies and moves keep every dim") {
  std::mt19937_64 g(11);
  for (int rank = 0; rank <= kMaxBoxRank; ++rank)
    for (int trial = 0; trial < 20; ++trial) {
      const PlainBox p = random_box(g, rank);
      const StridedBox b = box_of(p);
      CHECK(elements_of(plain(b)) == elements_of(p));
      CHECK(b.capacity() == (rank <= StridedBox::kInlineRank ? StridedBox::kInlineRank : kMaxBoxRank));
      for (int d = rank; d < kMaxBoxRank + 2; ++d) CHECK(b.extent(d) == 0);  // past the rank reads 0
      StridedBox copy = b;
      CHECK(copy == b);
      StridedBox moved = std::move(copy);
      CHECK(moved == b);
      StridedBox assigned = box_of(random_box(g, kMaxBoxRank));
      assigned = moved;
      CHECK(assigned == b);
      if (rank > 0) {
        assigned.extent(0) += 1;  // a copy owns its dims
        CHECK(!(assigned == b));
        CHECK(moved == b);
      }
      StridedBox one_sided;  // b's destination side as side 0, the other side 0
      one_sided.assign_side(b, 1);
      PlainBox want = p;
      want.src_offset = p.dst_offset;
      want.src_stride = p.dst_stride;
      want.dst_offset = 0;
      want.dst_stride = {};
      CHECK(elements_of(plain(one_sided)) == elements_of(want));
      StridedBox raw;
      raw.assign(rank, p.extent.data(), p.src_stride.data(), p.dst_stride.data());
      raw.src_offset = p.src_offset;
      raw.dst_offset = p.dst_offset;
      CHECK(raw == b);
      if (rank > 0) {
        CHECK(std::vector<std::int64_t>(raw.extents(), raw.extents() + rank) ==
              std::vector<std::int64_t>(p.extent.begin(), p.extent.begin() + rank));
        CHECK(std::vector<std::int64_t>(raw.strides(1), raw.strides(1) + rank) ==
              std::vector<std::int64_t>(p.dst_stride.begin(), p.dst_stride.begin() + rank));
      }
    }
}

TEST_CASE("a strided box refuses more than kMaxBoxRank dims with a clear error") {
  StridedBox b;
  CHECK_THROWS_WITH(b.extent(kMaxBoxRank) = 1, doctest::Contains("at most 8"));
  const std::array<std::int64_t, kMaxBoxRank> ones{1, 1, 1, 1, 1, 1, 1, 1};
  b.assign(kMaxBoxRank, ones.data(), ones.data(), ones.data());
  CHECK_THROWS_WITH(b.push_outer(2, 1, 1), doctest::Contains("at most 8 dims"));
  StridedBox unset;
  unset.rank = 5;  // a rank with no dims written behind it
  CHECK_THROWS_WITH((void)unset.extents(), doctest::Contains("rank 5 set without its dims"));
}

TEST_CASE("collapse keeps a box's elements in order and moves a box that fits back inline") {
  std::mt19937_64 g(12);
  int shrank = 0, back_inline = 0;
  for (int trial = 0; trial < 3000; ++trial) {
    const int rank = 1 + static_cast<int>(g() % kMaxBoxRank);
    const PlainBox p = random_box(g, rank);
    StridedBox b = box_of(p);
    b.collapse();
    CHECK(elements_of(plain(b)) == elements_of(p));
    CHECK(b.rank >= 1);
    CHECK(b.rank <= rank);
    shrank += b.rank < rank;
    if (rank > StridedBox::kInlineRank && b.rank <= StridedBox::kInlineRank) {
      CHECK(b.capacity() == StridedBox::kInlineRank);
      ++back_inline;
    }
    for (int d = b.rank; d < kMaxBoxRank; ++d) CHECK(b.extent(d) == 0);
  }
  CHECK(shrank > 500);  // the generator gives collapse work
  CHECK(back_inline > 50);
}

TEST_CASE("merge_into joins two boxes exactly when their elements are one box, a's then b's") {
  std::mt19937_64 g(13);
  int merged = 0, refused = 0;
  for (int trial = 0; trial < 6000; ++trial) {
    const int rank = 1 + static_cast<int>(g() % 3);
    PlainBox pa = random_box(g, rank);
    PlainBox pb = pa;  // b: a's shape shifted (one more step, a slice, or elsewhere) or a different box
    switch (g() % 6) {
      case 0:  // continues a along dim 0
        pb.src_offset = pa.src_offset + pa.extent[0] * pa.src_stride[0];
        pb.dst_offset = pa.dst_offset + pa.extent[0] * pa.dst_stride[0];
        pb.extent[0] = 1 + static_cast<std::int64_t>(g() % 3);
        break;
      case 1: {  // one more slice of dim 0: a's inner box
        pb.rank = rank - 1;
        pb.src_offset = pa.src_offset + pa.extent[0] * pa.src_stride[0];
        pb.dst_offset = pa.dst_offset + pa.extent[0] * pa.dst_stride[0];
        for (int d = 0; d + 1 < rank; ++d) {
          const auto u = static_cast<std::size_t>(d);
          pb.extent[u] = pa.extent[u + 1];
          pb.src_stride[u] = pa.src_stride[u + 1];
          pb.dst_stride[u] = pa.dst_stride[u + 1];
        }
        if (pb.rank == 0) pb = pa;
        break;
      }
      case 2:  // an equal box at some distance
        pb.src_offset += 100 + static_cast<std::int64_t>(g() % 50);
        pb.dst_offset += 100 + static_cast<std::int64_t>(g() % 50);
        break;
      case 3:  // starts where a's next step would, with another outer stride: not one box
        pb.src_offset = pa.src_offset + pa.extent[0] * pa.src_stride[0];
        pb.dst_offset = pa.dst_offset + pa.extent[0] * pa.dst_stride[0];
        pb.extent[0] = 2 + static_cast<std::int64_t>(g() % 2);
        pb.src_stride[0] += 1 + static_cast<std::int64_t>(g() % 3);
        break;
      case 4:  // overlapping: never one box
        pb.src_offset += static_cast<std::int64_t>(g() % 2);
        break;
      default:
        pb = random_box(g, rank);
        pb.src_offset += 200;
        pb.dst_offset += 200;
    }
    StridedBox a = box_of(pa);
    const StridedBox b = box_of(pb);
    auto want = elements_of(pa);
    const auto tail = elements_of(pb);
    want.insert(want.end(), tail.begin(), tail.end());
    if (detail::merge_into(a, b)) {
      ++merged;
      CHECK(elements_of(plain(a)) == want);
    } else {
      ++refused;
      CHECK(a == box_of(pa));  // a refused merge leaves a as it was
    }
  }
  CHECK(merged > 1200);
  CHECK(refused > 1000);
}

TEST_CASE("merge_into on one-sided boxes (a part's destination side is all 0) stacks by the source side") {
  StridedBox a, b;
  const std::int64_t e[] = {4}, s[] = {1}, zero[] = {0};
  a.assign(1, e, s, zero);
  b.assign(1, e, s, zero);
  b.src_offset = 10;  // the same run 10 elements on
  CHECK(!detail::merge_into(a, b));  // two sides: the destination would be written twice
  CHECK(detail::merge_into(a, b, 1));
  CHECK(a.rank == 2);
  CHECK(a.extent(0) == 2);
  CHECK(a.src_stride(0) == 10);
  CHECK(a.extent(1) == 4);
}
