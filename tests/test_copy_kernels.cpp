// Copy kernels against the element-by-element reference: random strided
// boxes of every element size and rank, full boxes and partial ranges.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <vector>

#include "reshard/exec/copy_kernels.hpp"

using namespace reshard;

namespace {

struct RandomBox {
  int rank = 1;
  std::vector<std::int64_t> extent, sstride, dstride;
  std::int64_t soff = 0, doff = 0, sspan = 0, dspan = 0;
};

/// Strides that keep the box injective on each side: a random permutation of
/// dims, each stride at least the span of the dims inside it, plus gaps.
std::vector<std::int64_t> injective_strides(std::mt19937_64& g, const std::vector<std::int64_t>& ext, bool contiguous_inner,
                                            std::int64_t& span) {
  const auto r = ext.size();
  std::vector<std::size_t> order(r);
  for (std::size_t i = 0; i < r; ++i) order[i] = r - 1 - i;  // innermost first
  if (!contiguous_inner && r > 1 && g() % 2) std::swap(order[0], order[1 + g() % (r - 1)]);
  std::vector<std::int64_t> st(r, 0);
  std::int64_t s = 1;
  for (std::size_t k = 0; k < r; ++k) {
    const std::size_t d = order[k];
    const std::int64_t gap = (k == 0 && contiguous_inner) ? 0 : static_cast<std::int64_t>(g() % 3);
    st[d] = s + gap;
    s = st[d] * ext[d];
  }
  span = s + 1;
  return st;
}

RandomBox random_box(std::mt19937_64& g) {
  RandomBox b;
  b.rank = 1 + static_cast<int>(g() % 6);
  for (int k = 0; k < b.rank; ++k) b.extent.push_back(1 + static_cast<std::int64_t>(g() % (b.rank > 3 ? 4 : 9)));
  b.sstride = injective_strides(g, b.extent, g() % 2, b.sspan);
  b.dstride = injective_strides(g, b.extent, g() % 2, b.dspan);
  b.soff = static_cast<std::int64_t>(g() % 5);
  b.doff = static_cast<std::int64_t>(g() % 5);
  b.sspan += b.soff;
  b.dspan += b.doff;
  return b;
}

std::vector<std::byte> random_bytes(std::mt19937_64& g, std::size_t n) {
  std::vector<std::byte> v(n);
  for (auto& x : v) x = static_cast<std::byte>(g());
  return v;
}

}  // namespace

TEST_CASE("copy_box equals the reference for every element size and rank") {
  std::mt19937_64 g(12345);
  for (std::size_t eb : {1, 2, 4, 8, 3, 16}) {
    for (int trial = 0; trial < 300; ++trial) {
      const RandomBox b = random_box(g);
      const auto src = random_bytes(g, static_cast<std::size_t>(b.sspan) * eb);
      auto dst_fast = random_bytes(g, static_cast<std::size_t>(b.dspan) * eb);
      auto dst_ref = dst_fast;
      BoxSide s{const_cast<std::byte*>(src.data()), b.soff, b.sstride.data()};
      BoxSide d1{dst_fast.data(), b.doff, b.dstride.data()};
      BoxSide d2{dst_ref.data(), b.doff, b.dstride.data()};
      copy_box(eb, b.rank, b.extent.data(), s, d1);
      copy_box_reference(eb, b.rank, b.extent.data(), s, d2);
      INFO("element bytes " << eb << ", rank " << b.rank << ", trial " << trial);
      REQUIRE(dst_fast == dst_ref);
    }
  }
}

TEST_CASE("pack_range then unpack_range moves exactly the chosen elements") {
  std::mt19937_64 g(777);
  for (std::size_t eb : {1, 2, 4, 8, 6}) {
    for (int trial = 0; trial < 300; ++trial) {
      const RandomBox b = random_box(g);
      std::int64_t n = 1;
      for (auto e : b.extent) n *= e;
      const std::int64_t first = static_cast<std::int64_t>(g() % static_cast<std::uint64_t>(n));
      const std::int64_t count = static_cast<std::int64_t>(g() % static_cast<std::uint64_t>(n - first + 1));
      const auto src = random_bytes(g, static_cast<std::size_t>(b.sspan) * eb);
      // Reference: the whole box packed densely, element by element.
      std::vector<std::int64_t> dense(b.extent.size());
      std::int64_t s = 1;
      for (std::size_t k = b.extent.size(); k-- > 0;) {
        dense[k] = s;
        s *= b.extent[k];
      }
      std::vector<std::byte> full(static_cast<std::size_t>(n) * eb);
      copy_box_reference(eb, b.rank, b.extent.data(), BoxSide{const_cast<std::byte*>(src.data()), b.soff, b.sstride.data()},
                         BoxSide{full.data(), 0, dense.data()});
      std::vector<std::byte> stream(static_cast<std::size_t>(count) * eb + 8, std::byte{0x77});
      pack_range(eb, b.rank, b.extent.data(), BoxSide{const_cast<std::byte*>(src.data()), b.soff, b.sstride.data()}, first, count,
                 stream.data());
      INFO("element bytes " << eb << ", rank " << b.rank << ", range " << first << "+" << count << " of " << n);
      REQUIRE(std::memcmp(stream.data(), full.data() + first * static_cast<std::int64_t>(eb), static_cast<std::size_t>(count) * eb) == 0);
      for (std::size_t i = static_cast<std::size_t>(count) * eb; i < stream.size(); ++i) REQUIRE(stream[i] == std::byte{0x77});
      // Unpack into a destination: exactly those elements change.
      auto dst = random_bytes(g, static_cast<std::size_t>(b.dspan) * eb);
      auto expect = dst;
      {
        // Reference unpack: element k of the stream to box element first + k.
        std::vector<std::int64_t> idx(b.extent.size());
        for (std::int64_t k = 0; k < count; ++k) {
          std::int64_t rem = first + k, off = b.doff;
          for (std::size_t d = b.extent.size(); d-- > 0;) {
            idx[d] = rem % b.extent[d];
            rem /= b.extent[d];
          }
          for (std::size_t d = 0; d < idx.size(); ++d) off += idx[d] * b.dstride[d];
          std::memcpy(expect.data() + off * static_cast<std::int64_t>(eb), stream.data() + k * static_cast<std::int64_t>(eb), eb);
        }
      }
      unpack_range(eb, b.rank, b.extent.data(), BoxSide{dst.data(), b.doff, b.dstride.data()}, first, count, stream.data());
      REQUIRE(dst == expect);
    }
  }
}

TEST_CASE("a contiguous box is one memcpy-equivalent and rank > 4 boxes work") {
  std::vector<std::uint16_t> src(4096), dst(4096, 0);
  for (std::size_t i = 0; i < src.size(); ++i) src[i] = static_cast<std::uint16_t>(i * 7 + 1);
  std::int64_t ext[1] = {4096}, st[1] = {1};
  copy_box(2, 1, ext, BoxSide{reinterpret_cast<std::byte*>(src.data()), 0, st}, BoxSide{reinterpret_cast<std::byte*>(dst.data()), 0, st});
  CHECK(src == dst);
  // Rank 6, dims of 2 and 4, transposed strides on the destination.
  std::int64_t e6[6] = {2, 4, 2, 4, 2, 4};
  std::int64_t s6[6] = {512, 128, 64, 16, 8, 2};  // gaps of one element in the innermost dim
  std::int64_t d6[6] = {1, 2, 8, 16, 64, 128};
  std::vector<std::uint16_t> out(1024, 0), ref(1024, 0);
  copy_box(2, 6, e6, BoxSide{reinterpret_cast<std::byte*>(src.data()), 1, s6}, BoxSide{reinterpret_cast<std::byte*>(out.data()), 0, d6});
  copy_box_reference(2, 6, e6, BoxSide{reinterpret_cast<std::byte*>(src.data()), 1, s6},
                     BoxSide{reinterpret_cast<std::byte*>(ref.data()), 0, d6});
  CHECK(out == ref);
  CHECK(std::count(out.begin(), out.end(), std::uint16_t{0}) == 1024 - 512);
}

TEST_CASE("a range outside the box is an error, not an overrun") {
  std::vector<std::byte> a(64), b(64);
  std::int64_t ext[2] = {4, 4}, st[2] = {4, 1};
  CHECK_THROWS_WITH_AS(pack_range(2, 2, ext, BoxSide{a.data(), 0, st}, 10, 7, b.data()),
                       "copy kernel: element range [10, 17) is outside a box of 16 elements", Error);
  CHECK_THROWS_WITH_AS(unpack_range(2, 2, ext, BoxSide{a.data(), 0, st}, -1, 2, b.data()),
                       "copy kernel: element range [-1, 1) is outside a box of 16 elements", Error);
  CHECK_THROWS_WITH_AS(copy_box(2, 0, ext, BoxSide{a.data(), 0, st}, BoxSide{b.data(), 0, st}),
                       "copy kernel: box rank 0 is outside 1..32", Error);
}
