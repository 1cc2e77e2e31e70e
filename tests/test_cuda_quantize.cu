// The CUDA quantize kernels (cuda/quantize_kernels.cuh) against the host
// kernel (quantize.hpp's quantize_rows), bit for bit: codes and scale
// entries, block FP8 128x128 and MXFP8, sources bf16, f16 and f32 in one
// launch, trailing partial tiles, all-zero (and all -0) tiles, subnormals,
// tiles whose amax is under the block floor, values that saturate, and
// tiles holding an infinity or a NaN (there a NaN code may differ in its
// sign bit only, and a NaN scale in its bits: see quantize_kernels.cuh).
// The cases that need a GPU are in the suite "gpu" (skipped without one,
// tests/cuda_test_main.cpp); the kernels are compiled everywhere.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "reshard/cuda/quantize_kernels.cuh"

using namespace reshard;
using namespace reshard::cuda;

namespace {

/// A rows x cols source matrix of one dtype, rows `stride` elements apart,
/// filled tile by tile with random bit patterns of a per-tile magnitude class.
struct Matrix {
  DType dt;
  std::int64_t rows, cols, stride, dst_stride;
  std::vector<std::byte> src;
  Matrix(DType d, std::int64_t r, std::int64_t c, std::int64_t pad, std::int64_t dst_pad)
      : dt(d), rows(r), cols(c), stride(c + pad), dst_stride(c + dst_pad), src(static_cast<std::size_t>(r * (c + pad) * element_bytes(d))) {}
  std::int64_t E() const { return element_bytes(dt); }
};

/// Random bits of dtype dt with a biased exponent near `center` (clamped to
/// the finite range; 0 gives subnormals), or special values.
std::uint32_t random_bits(std::mt19937& g, DType dt, int kind, int center) {
  const int ebits = dt == DType::f16 ? 5 : 8, mbits = dt == DType::f32 ? 23 : dt == DType::bf16 ? 7 : 10;
  const std::uint32_t sign = g() % 2;
  const int emax = (1 << ebits) - 2;
  auto pack = [&](std::uint32_t e, std::uint32_t m) { return sign << (ebits + mbits) | e << mbits | m; };
  const std::uint32_t mant = g() & ((1u << mbits) - 1);
  switch (kind) {
    case 1: return pack(0, 0);                          // +-0
    case 2: return pack(0, mant | 1);                   // subnormal
    case 3: return pack(static_cast<std::uint32_t>(emax + 1), 0);  // +-inf
    case 4: return pack(static_cast<std::uint32_t>(emax + 1), mant | 1);  // NaN
    default: {
      const int e = std::clamp(center + static_cast<int>(g() % 9) - 4, 1, emax);
      return pack(static_cast<std::uint32_t>(e), mant);
    }
  }
}

enum class TileKind { normal, zeros, neg_zeros, subnormal, tiny, huge, with_inf, with_nan };

void fill_tile(Matrix& m, std::mt19937& g, std::int64_t r0, std::int64_t c0, std::int64_t tr, std::int64_t tc, TileKind kind) {
  const int ebias = m.dt == DType::f16 ? 15 : 127;
  int center = ebias + static_cast<int>(g() % 13) - 6;
  if (kind == TileKind::tiny) center = m.dt == DType::f16 ? 2 : ebias - 20;  // amax under the block floor 1e-4
  if (kind == TileKind::huge) center = m.dt == DType::f16 ? 29 : ebias + 60;  // far past 448 before scaling
  for (std::int64_t r = r0; r < r0 + tr; ++r)
    for (std::int64_t c = c0; c < c0 + tc; ++c) {
      int k = 0;
      if (kind == TileKind::zeros || kind == TileKind::neg_zeros) k = 1;
      else if (kind == TileKind::subnormal) k = 2;
      else if (g() % 16 == 0) k = 1;  // zeros sprinkled everywhere
      else if (g() % 32 == 0) k = 2;  // and subnormals
      std::uint32_t b = random_bits(g, m.dt, k, center);
      if (kind == TileKind::zeros) b = 0;
      if (kind == TileKind::neg_zeros) b = m.dt == DType::f32 ? 0x80000000u : 0x8000u;
      const std::size_t at = static_cast<std::size_t>((r * m.stride + c) * m.E());
      std::memcpy(m.src.data() + at, &b, static_cast<std::size_t>(m.E()));
    }
  if (kind == TileKind::with_inf || kind == TileKind::with_nan) {
    const std::int64_t r = r0 + static_cast<std::int64_t>(g() % static_cast<unsigned>(tr)), c = c0 + static_cast<std::int64_t>(g() % static_cast<unsigned>(tc));
    const std::uint32_t b = random_bits(g, m.dt, kind == TileKind::with_inf ? 3 : 4, 0);
    std::memcpy(m.src.data() + static_cast<std::size_t>((r * m.stride + c) * m.E()), &b, static_cast<std::size_t>(m.E()));
  }
}

struct DeviceBytes {
  std::byte* p = nullptr;
  explicit DeviceBytes(std::size_t n) { check_cuda(cudaMalloc(reinterpret_cast<void**>(&p), std::max<std::size_t>(n, 1)), "cudaMalloc"); }
  ~DeviceBytes() { cudaFree(p); }
  DeviceBytes(const DeviceBytes&) = delete;
  DeviceBytes& operator=(const DeviceBytes&) = delete;
};

/// Codes equal, or both NaN (0x7F / 0xFF: the sign of a NaN may differ).
bool same_code(std::uint8_t host, std::uint8_t dev) { return host == dev || ((host & 0x7F) == 0x7F && (dev & 0x7F) == 0x7F); }

/// Quantizes the matrices with the host kernel and with one launch of the
/// device kernel (every matrix's tiles in one batch); compares codes and scales.
void check(TileQuantizer& q, QuantScheme scheme, std::int64_t tile_rows, std::int64_t tile_cols, std::vector<Matrix>& mats, std::mt19937& g, bool specials) {
  const std::int64_t sb = scheme == QuantScheme::block ? 4 : 1;
  struct Placed {
    std::size_t src_at, dst_at, scale_at;  // byte offsets in the arenas
    std::int64_t tiles_r, tiles_c;
  };
  std::vector<Placed> placed;
  std::size_t src_bytes = 0, dst_bytes = 0, scale_bytes = 0;
  for (Matrix& m : mats) {
    const std::int64_t tr = (m.rows + tile_rows - 1) / tile_rows, tc = (m.cols + tile_cols - 1) / tile_cols;
    placed.push_back({src_bytes, dst_bytes, scale_bytes, tr, tc});
    src_bytes += (m.src.size() + 255) / 256 * 256;
    dst_bytes += static_cast<std::size_t>((m.rows * m.dst_stride + 255) / 256 * 256);
    scale_bytes += static_cast<std::size_t>((tr * tc * sb + 255) / 256 * 256) + 3;  // + 3: scale entries at odd addresses too
    for (std::int64_t i = 0; i < tr; ++i)
      for (std::int64_t j = 0; j < tc; ++j) {
        TileKind kind = TileKind::normal;
        const auto pick = g() % 40;
        if (pick == 0) kind = TileKind::zeros;
        else if (pick == 1) kind = TileKind::neg_zeros;
        else if (pick == 2) kind = TileKind::subnormal;
        else if (pick == 3) kind = TileKind::tiny;
        else if (pick == 4) kind = TileKind::huge;
        else if (specials && pick == 5) kind = TileKind::with_inf;
        else if (specials && pick == 6) kind = TileKind::with_nan;
        fill_tile(m, g, i * tile_rows, j * tile_cols, std::min(tile_rows, m.rows - i * tile_rows), std::min(tile_cols, m.cols - j * tile_cols), kind);
      }
  }
  std::vector<std::byte> src(src_bytes), scale_ref(scale_bytes, std::byte{0xAB}), scale_out(scale_bytes);
  std::vector<std::uint8_t> dst_ref(dst_bytes, 0xCD), dst_out(dst_bytes);
  DeviceBytes dsrc(src_bytes), ddst(dst_bytes), dscale(scale_bytes);
  std::vector<QuantTile> tiles;
  for (std::size_t k = 0; k < mats.size(); ++k) {
    const Matrix& m = mats[k];
    const Placed& p = placed[k];
    std::memcpy(src.data() + p.src_at, m.src.data(), m.src.size());
    // The host kernel writes codes at the source's element offsets: into a
    // scratch of the source's shape, copied to the destination's rows after.
    std::vector<std::uint8_t> codes(static_cast<std::size_t>(m.rows * m.stride));
    for (std::int64_t i = 0; i < p.tiles_r; ++i)
      for (std::int64_t j = 0; j < p.tiles_c; ++j) {
        const std::int64_t r0 = i * tile_rows, c0 = j * tile_cols, nr = std::min(tile_rows, m.rows - r0), nc = std::min(tile_cols, m.cols - c0);
        std::vector<std::int64_t> rows;
        for (std::int64_t r = r0; r < r0 + nr; ++r) rows.insert(rows.end(), {r * m.stride + c0, nc});
        const std::size_t scale_at = p.scale_at + 3 * (k % 2) + static_cast<std::size_t>((i * p.tiles_c + j) * sb);
        quantize_rows(scheme, m.dt, m.src.data(), codes.data(), rows.data(), static_cast<std::size_t>(nr), scale_ref.data() + scale_at);
        QuantTile t;
        t.src = reinterpret_cast<std::uint64_t>(dsrc.p + p.src_at) + static_cast<std::uint64_t>((r0 * m.stride + c0) * m.E());
        t.dst = reinterpret_cast<std::uint64_t>(ddst.p + p.dst_at) + static_cast<std::uint64_t>(r0 * m.dst_stride + c0);
        t.scale = reinterpret_cast<std::uint64_t>(dscale.p + scale_at);
        t.src_stride = m.stride;
        t.dst_stride = m.dst_stride;
        t.rows = static_cast<std::int32_t>(nr);
        t.cols = static_cast<std::int32_t>(nc);
        t.dtype = m.dt;
        tiles.push_back(t);
      }
    for (std::int64_t r = 0; r < m.rows; ++r)
      std::memcpy(dst_ref.data() + p.dst_at + r * m.dst_stride, codes.data() + r * m.stride, static_cast<std::size_t>(m.cols));
  }
  std::shuffle(tiles.begin(), tiles.end(), g);  // the batch's order is not the memory's
  check_cuda(cudaMemcpy(dsrc.p, src.data(), src_bytes, cudaMemcpyHostToDevice), "cudaMemcpy");
  {
    // The device starts from other bytes in the tiles (each must be written)
    // and the host's bytes between rows (which must stay).
    std::vector<std::uint8_t> start = dst_ref;
    for (std::size_t k = 0; k < mats.size(); ++k)
      for (std::int64_t r = 0; r < mats[k].rows; ++r)
        std::memset(start.data() + placed[k].dst_at + r * mats[k].dst_stride, 0x5A, static_cast<std::size_t>(mats[k].cols));
    check_cuda(cudaMemcpy(ddst.p, start.data(), dst_bytes, cudaMemcpyHostToDevice), "cudaMemcpy");
    std::vector<std::byte> sstart(scale_bytes, std::byte{0xAB});
    check_cuda(cudaMemcpy(dscale.p, sstart.data(), scale_bytes, cudaMemcpyHostToDevice), "cudaMemcpy");
  }
  q.run(scheme, tiles);
  q.synchronize();
  check_cuda(cudaMemcpy(dst_out.data(), ddst.p, dst_bytes, cudaMemcpyDeviceToHost), "cudaMemcpy");
  check_cuda(cudaMemcpy(scale_out.data(), dscale.p, scale_bytes, cudaMemcpyDeviceToHost), "cudaMemcpy");
  std::size_t bad = 0, first_bad = dst_bytes, nan_codes = 0;
  for (std::size_t i = 0; i < dst_bytes; ++i) {
    nan_codes += (dst_ref[i] & 0x7F) == 0x7F;
    if (!same_code(dst_ref[i], dst_out[i])) {
      if (bad++ == 0) first_bad = i;
    }
  }
  INFO("codes: first difference at byte ", first_bad, " of ", dst_bytes, ": host ", first_bad < dst_bytes ? int(dst_ref[first_bad]) : -1,
       " device ", first_bad < dst_bytes ? int(dst_out[first_bad]) : -1);
  CHECK(bad == 0);
  if (!specials) CHECK(nan_codes == 0);
  std::size_t sbad = 0;
  if (scheme == QuantScheme::mx)
    for (std::size_t i = 0; i < scale_bytes; ++i) sbad += scale_ref[i] != scale_out[i];  // E8M0 bytes; untouched bytes stay 0xAB on both
  if (scheme == QuantScheme::block) {
    for (std::size_t k = 0; k < mats.size(); ++k)
      for (std::int64_t t = 0; t < placed[k].tiles_r * placed[k].tiles_c; ++t) {
        const std::size_t at = placed[k].scale_at + 3 * (k % 2) + static_cast<std::size_t>(4 * t);
        float h, d;
        std::memcpy(&h, scale_ref.data() + at, 4);
        std::memcpy(&d, scale_out.data() + at, 4);
        sbad += !(std::memcmp(&h, &d, 4) == 0 || (std::isnan(h) && std::isnan(d)));
      }
    // Bytes outside the entries stay untouched.
    for (std::size_t i = 0; i < scale_bytes; ++i) {
      bool inside = false;
      for (std::size_t k = 0; k < mats.size() && !inside; ++k) {
        const std::size_t a = placed[k].scale_at + 3 * (k % 2);
        inside = i >= a && i < a + static_cast<std::size_t>(4 * placed[k].tiles_r * placed[k].tiles_c);
      }
      if (!inside) sbad += scale_out[i] != std::byte{0xAB};
    }
  }
  CHECK(sbad == 0);
}

}  // namespace

TEST_CASE("quantize kernels reject what the kernel cannot report: a source dtype that is not bf16, f16 or f32") {
  QuantTile t;
  t.dtype = DType::i8;
  t.rows = t.cols = 1;
  CHECK_THROWS_WITH_AS(check_quant_tiles(std::span<const QuantTile>(&t, 1)), doctest::Contains("not bf16, f16 or f32"), Error);
  t.dtype = DType::f16;
  CHECK_NOTHROW(check_quant_tiles(std::span<const QuantTile>(&t, 1)));
  t.rows = -1;
  CHECK_THROWS_AS(check_quant_tiles(std::span<const QuantTile>(&t, 1)), Error);
}

TEST_CASE("block FP8 128x128 on the device matches the host kernel bit for bit (bf16, f16, f32; partial tiles)" * doctest::test_suite("gpu")) {
  TileQuantizer q;
  std::mt19937 g(20);
  for (int trial = 0; trial < 6; ++trial) {
    std::vector<Matrix> mats;
    mats.emplace_back(DType::bf16, 128 * 3 + (trial % 2 ? 37 : 0), 128 * 4 + (trial % 3 ? 5 : 0), trial % 2 ? 16 : 0, 3);
    mats.emplace_back(DType::f16, 128 + 1, 300, 7, 0);
    mats.emplace_back(DType::f32, 200, 128 * 2, 0, 64);
    mats.emplace_back(DType::bf16, 1, 130, 0, 0);  // one row, a partial second tile
    CAPTURE(trial);
    check(q, QuantScheme::block, 128, 128, mats, g, false);
  }
}

TEST_CASE("block FP8 over one dim (tiles of 1 x 128) and with infinities and NaNs" * doctest::test_suite("gpu")) {
  TileQuantizer q;
  std::mt19937 g(21);
  std::vector<Matrix> mats;
  mats.emplace_back(DType::bf16, 50, 1000, 0, 0);
  mats.emplace_back(DType::f32, 20, 260, 4, 0);
  check(q, QuantScheme::block, 1, 128, mats, g, false);
  for (int trial = 0; trial < 3; ++trial) {
    std::vector<Matrix> special;
    special.emplace_back(DType::bf16, 300, 400, 0, 0);
    special.emplace_back(DType::f16, 256, 256, 0, 0);
    special.emplace_back(DType::f32, 129, 257, 1, 0);
    check(q, QuantScheme::block, 128, 128, special, g, true);
  }
}

TEST_CASE("MXFP8 (tiles of 32) on the device matches the host kernel bit for bit, specials included" * doctest::test_suite("gpu")) {
  TileQuantizer q;
  std::mt19937 g(22);
  for (int trial = 0; trial < 6; ++trial) {
    std::vector<Matrix> mats;
    mats.emplace_back(DType::bf16, 64 + trial, 32 * 20 + (trial % 2 ? 7 : 0), trial % 2 ? 16 : 0, 1);
    mats.emplace_back(DType::f16, 33, 100, 3, 0);
    mats.emplace_back(DType::f32, 40, 96, 0, 32);
    mats.emplace_back(DType::bf16, 1, 5, 0, 0);  // a single partial tile
    CAPTURE(trial);
    check(q, QuantScheme::mx, 1, kMxTile, mats, g, trial >= 3);
  }
}

TEST_CASE("many small batches reuse the quantizer's descriptor buffers" * doctest::test_suite("gpu")) {
  TileQuantizer q;
  std::mt19937 g(23);
  for (int trial = 0; trial < 20; ++trial) {
    std::vector<Matrix> mats;
    mats.emplace_back(trial % 3 == 0 ? DType::f32 : trial % 3 == 1 ? DType::f16 : DType::bf16, 1 + trial, 32 + 17 * trial, trial % 4, 0);
    check(q, trial % 2 ? QuantScheme::mx : QuantScheme::block, trial % 2 ? 1 : 128, trial % 2 ? kMxTile : 128, mats, g, false);
  }
}
