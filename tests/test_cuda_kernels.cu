// The CUDA box copy kernels against the host reference (cuda/box_batch.hpp),
// on device memory: element sizes 1..16 (and 3, 6: lowered), ranks 1..6,
// partial ranges, misaligned bases, mixed batches, f32 <-> bf16 casts, and
// batches of many small copies. The cases are in the suite "gpu": without a
// visible GPU CTest reports them skipped (tests/cuda_test_main.cpp); the
// kernels are still compiled.
#include <doctest/doctest.h>

#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "reshard/cuda/copy_kernels.cuh"

using namespace reshard;
using namespace reshard::cuda;

namespace {

/// One copy described by offsets into a source and a destination arena.
struct Spec {
  bool pack = true;
  std::int64_t E = 4, out_E = 4;
  int rank = 1;
  std::int64_t extent[8]{}, stride[8]{};
  std::int64_t offset = 0, first = 0, count = 0;
  std::size_t box_at = 0, stream_at = 0;  ///< box in src (pack) or dst (unpack); stream in the other
};

BoxCopy make(const Spec& s, std::byte* src, std::byte* dst) {
  return s.pack ? pack_copy(src + s.box_at, s.offset, s.rank, s.extent, s.stride, s.first, s.count, dst + s.stream_at, s.E, s.out_E)
                : unpack_copy(dst + s.box_at, s.offset, s.rank, s.extent, s.stride, s.first, s.count, src + s.stream_at, s.E, s.out_E);
}

struct Arenas {
  std::size_t bytes;
  std::vector<std::byte> src, ref, out;
  std::byte *dsrc = nullptr, *ddst = nullptr;
  explicit Arenas(std::size_t n, unsigned seed) : bytes(n), src(n), ref(n), out(n) {
    std::mt19937 g(seed);
    for (auto& b : src) b = static_cast<std::byte>(g());
    for (std::size_t i = 0; i < n; ++i) ref[i] = static_cast<std::byte>(i * 7 + 3);
    check_cuda(cudaMalloc(reinterpret_cast<void**>(&dsrc), n), "cudaMalloc");
    check_cuda(cudaMalloc(reinterpret_cast<void**>(&ddst), n), "cudaMalloc");
    check_cuda(cudaMemcpy(dsrc, src.data(), n, cudaMemcpyHostToDevice), "cudaMemcpy");
    check_cuda(cudaMemcpy(ddst, ref.data(), n, cudaMemcpyHostToDevice), "cudaMemcpy");
  }
  ~Arenas() {
    cudaFree(dsrc);
    cudaFree(ddst);
  }
  void fetch() { check_cuda(cudaMemcpy(out.data(), ddst, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy"); }
};

/// Random specs packed one after another into the arenas.
std::vector<Spec> random_specs(std::mt19937& g, int copies, bool aligned, int max_rank, std::int64_t max_extent, std::size_t arena,
                               std::vector<std::int64_t> sizes) {
  std::vector<Spec> out;
  std::size_t src_at = 0, dst_at = 0;
  for (int i = 0; i < copies; ++i) {
    Spec s;
    s.pack = g() % 2 == 0;
    s.E = s.out_E = sizes[g() % sizes.size()];
    s.rank = 1 + static_cast<int>(g() % static_cast<unsigned>(max_rank));
    std::vector<std::int64_t> full(static_cast<std::size_t>(s.rank));
    for (int k = 0; k < s.rank; ++k) {
      s.extent[k] = 1 + static_cast<std::int64_t>(g() % static_cast<unsigned>(max_extent));
      if (aligned && k == s.rank - 1) s.extent[k] = (s.extent[k] + 15) / 16 * 16;
      full[static_cast<std::size_t>(k)] = s.extent[k] + (aligned ? 16 * static_cast<std::int64_t>(g() % 2) : static_cast<std::int64_t>(g() % 3));
    }
    std::vector<int> order(static_cast<std::size_t>(s.rank));
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end() - (aligned ? 1 : 0), g);
    std::int64_t st = 1;
    for (int j = s.rank - 1; j >= 0; --j) {
      const int k = order[static_cast<std::size_t>(j)];
      s.stride[k] = st;
      st *= full[static_cast<std::size_t>(k)];
    }
    s.offset = aligned ? 0 : static_cast<std::int64_t>(g() % 5);
    std::int64_t n = 1;
    for (int k = 0; k < s.rank; ++k) n *= s.extent[k];
    s.first = aligned ? 0 : static_cast<std::int64_t>(g() % static_cast<unsigned>(n));
    s.count = aligned ? n : static_cast<std::int64_t>(g() % static_cast<unsigned>(n - s.first + 1));
    const std::size_t box_bytes = static_cast<std::size_t>((s.offset + st) * s.E), stream_bytes = static_cast<std::size_t>(s.count * s.E);
    auto bump = [&](std::size_t& at, std::size_t b) {
      at = aligned ? (at + 255) / 256 * 256 : at + g() % 5;
      const std::size_t here = at;
      at += b;
      return here;
    };
    s.box_at = bump(s.pack ? src_at : dst_at, box_bytes);
    s.stream_at = bump(s.pack ? dst_at : src_at, stream_bytes);
    if (src_at >= arena || dst_at >= arena) break;
    out.push_back(s);
  }
  return out;
}

/// Reference on the host arenas, the kernel on the device ones; compares the destinations.
void check_identity(const std::vector<Spec>& specs, Arenas& a, BoxCopier& copier) {
  for (const Spec& s : specs) {
    BoxCopy c = make(s, a.src.data(), a.ref.data());
    copy_boxes_reference(std::span<const BoxCopy>(&c, 1), s.E);
  }
  BoxBatch batch;
  for (const Spec& s : specs) batch.add(make(s, a.dsrc, a.ddst), s.E);
  copier.run(batch);
  copier.synchronize();
  a.fetch();
  std::size_t bad = 0;
  while (bad < a.bytes && a.out[bad] == a.ref[bad]) ++bad;
  INFO("first differing byte at arena offset ", bad);
  REQUIRE(bad == a.bytes);
}

}  // namespace

TEST_CASE("kernels match the reference: element sizes, ranks, partial ranges, misalignment" * doctest::test_suite("gpu")) {
  BoxCopier copier;
  std::mt19937 g(1);
  for (int trial = 0; trial < 40; ++trial) {
    Arenas a(std::size_t{1} << 22, static_cast<unsigned>(trial));
    const bool aligned = trial % 3 == 0;
    const int max_rank = 1 + trial % 6;
    const std::int64_t ext = max_rank <= 2 ? 200 : max_rank <= 3 ? 24 : 7;
    auto specs = random_specs(g, 1 + trial % 9, aligned, max_rank, ext, a.bytes,
                              trial % 4 == 0 ? std::vector<std::int64_t>{1, 2, 3, 4, 6, 8, 16} : std::vector<std::int64_t>{std::int64_t{1} << (trial % 5)});
    CAPTURE(trial);
    check_identity(specs, a, copier);
  }
}

TEST_CASE("kernels match the reference: large boxes, vector path with tails" * doctest::test_suite("gpu")) {
  BoxCopier copier;
  for (std::int64_t inner : {16, 4096, 40000, 1 << 20}) {
    for (std::int64_t tail : {0, 3}) {
      Arenas a(std::size_t{64} << 20, 5);
      Spec s;
      s.pack = tail == 0;
      s.E = s.out_E = 2;
      s.rank = 2;
      s.extent[0] = std::max<std::int64_t>(1, (std::int64_t{4} << 20) / inner);
      s.extent[1] = inner;
      s.stride[0] = inner + 16;
      s.stride[1] = 1;
      s.count = s.extent[0] * s.extent[1] - tail;
      s.stream_at = 0;
      s.box_at = std::size_t{24} << 20;
      CAPTURE(inner);
      check_identity({s}, a, copier);
    }
  }
}

TEST_CASE("kernels match the reference: thousands of small copies in one launch" * doctest::test_suite("gpu")) {
  BoxCopier copier;
  std::mt19937 g(3);
  Arenas a(std::size_t{16} << 20, 9);
  auto specs = random_specs(g, 3000, false, 3, 6, a.bytes, {2, 4});
  CHECK(specs.size() > 1000);
  check_identity(specs, a, copier);
}

TEST_CASE("kernels cast in flight like the reference: f32 -> bf16 pack, bf16 -> f32 unpack" * doctest::test_suite("gpu")) {
  BoxCopier copier;
  std::mt19937 g(4);
  for (int trial = 0; trial < 12; ++trial) {
    Arenas a(std::size_t{1} << 22, static_cast<unsigned>(100 + trial));
    const bool aligned = trial % 2 == 0;
    auto specs = random_specs(g, 1 + trial % 4, aligned, 1 + trial % 4, aligned ? 64 : 9, a.bytes / 2, {4});
    for (auto& s : specs) {
      s.pack = true;
      s.out_E = 2;
      s.box_at = s.box_at / 4 * 4;
      s.stream_at = s.stream_at / 2 * 2 + a.bytes / 2;  // keep the f32 sources and the bf16 stream apart
    }
    for (const Spec& s : specs) {
      BoxCopy c = make(s, a.src.data(), a.ref.data());
      copy_boxes_reference<F32ToBF16>(std::span<const BoxCopy>(&c, 1));
    }
    BoxBatch batch;
    for (const Spec& s : specs) batch.add(make(s, a.dsrc, a.ddst), 4);
    copier.run_cast<F32ToBF16>(batch);
    copier.synchronize();
    a.fetch();
    CAPTURE(trial);
    REQUIRE(std::memcmp(a.out.data(), a.ref.data(), a.bytes) == 0);
  }
  // bf16 stream -> f32 box.
  Arenas a(std::size_t{1} << 20, 7);
  const std::int64_t ext[2] = {64, 96}, st[2] = {128, 1};
  BoxCopy h = unpack_copy(a.ref.data() + 4096, 0, 2, ext, st, 0, 64 * 96, a.src.data(), 2, 4);
  copy_boxes_reference<BF16ToF32>(std::span<const BoxCopy>(&h, 1));
  BoxBatch batch;
  batch.add(unpack_copy(a.ddst + 4096, 0, 2, ext, st, 0, 64 * 96, a.dsrc, 2, 4), 2);
  copier.run_cast<BF16ToF32>(batch);
  copier.synchronize();
  a.fetch();
  REQUIRE(std::memcmp(a.out.data(), a.ref.data(), a.bytes) == 0);
}

TEST_CASE("visible_devices() reports no GPU without one, and never throws") {
  const int n = visible_devices();
  CHECK(n >= 0);
  if (n == 0) MESSAGE("visible_devices() = 0 on this machine");
}
