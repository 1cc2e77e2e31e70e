#pragma once
// Host quantization kernels for FP8 destinations (CONTRACT.md §1 "Quantized
// destination tensors", docs/fp8.md): float8_e4m3fn encoding (round to
// nearest even, no infinities, magnitudes past 448 saturate to 448) and the
// two tile recipes:
//  * block (DeepSeek-V3 / vLLM block FP8): amax = max(max |x|, 1e-4),
//    q = e4m3(x * (448 / amax)) with the quotient in f32 first, scale entry
//    amax / 448 (f32);
//  * mx (MXFP8, OCP Microscaling v1.0): shared exponent
//    e = floor(log2(amax)) - 8 clamped to [-127, 127], q = e4m3(x / 2^e),
//    scale byte e + 127 (E8M0); an all-zero tile has scale byte 0.
// A tile is given as rows of contiguous elements (the trailing tiled dim);
// the caller walks the rows (quant_plan.hpp maps them into local buffers).
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <span>
#include <type_traits>
#include <utility>

#include "../base/dtype.hpp"
#include "../base/error.hpp"
#include "../base/float_convert.hpp"  // the exact widenings of the sources
#include "../base/hd.hpp"  // the pure bit functions below are also the CUDA kernels' (cuda/quantize_kernels.cuh)

namespace reshard {

enum class QuantScheme : std::uint8_t { block, mx };

inline constexpr float kE4M3Max = 448.0f;
inline constexpr float kBlockAmaxFloor = 1e-4f;
inline constexpr std::int64_t kMxTile = 32;

/// f32 -> float8_e4m3fn, round to nearest even; |x| >= 448 gives +-448 (the
/// format has no infinity; 464 and up would otherwise round to NaN); NaN stays NaN.
/// Branch-free (selects), so the quantize loops vectorize.
RESHARD_HD inline std::uint8_t e4m3_from_f32(float x) {
  // Signed 32-bit lanes throughout (the magnitude fits), so the compares are
  // plain SIMD compares and the choices masks: the loops vectorize.
  const std::int32_t bits = std::bit_cast<std::int32_t>(x);
  const std::int32_t sign = (bits >> 24) & 0x80;
  const std::int32_t a = bits & 0x7FFFFFFF;
  // Normal codes (|x| >= 2^-6): the f32 pattern's top bits are the code plus
  // 120 << 3 (exponent bias 127 vs 7); round the 20 dropped bits to nearest
  // even by adding 0x7FFFF + the kept lsb (a carry moves to the next binade).
  const std::int32_t normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - (120 << 3);
  // Subnormal codes m * 2^-9 (m = 0..8): |x| * 512 rounded to an integer,
  // nearest even, by adding 2^23 in f32 (exact: a power of two scaling).
  const float q = std::bit_cast<float>(a) * 512.0f + 8388608.0f;
  const std::int32_t sub = std::bit_cast<std::int32_t>(q) - 0x4B000000;
  const std::int32_t is_sub = -static_cast<std::int32_t>(a < 0x3C800000);
  const std::int32_t is_sat = -static_cast<std::int32_t>(a >= 0x43E00000);  // 448 and past it: saturate
  const std::int32_t is_nan = -static_cast<std::int32_t>(a > 0x7F800000);
  std::int32_t code = (sub & is_sub) | (normal & ~is_sub);
  code = (code & ~is_sat) | (0x7E & is_sat);
  code |= 0x7F & is_nan;  // 0x7E | 0x7F = 0x7F: NaN wins over the saturation
  return static_cast<std::uint8_t>(sign | code);
}

/// float8_e4m3fn -> f32 (exact).
inline float f32_from_e4m3(std::uint8_t c) {
  const float s = (c & 0x80) ? -1.0f : 1.0f;
  const int e = (c >> 3) & 15, m = c & 7;
  if (e == 15 && m == 7) return std::nanf("");
  if (e == 0) return s * std::ldexp(static_cast<float>(m), -9);
  return s * std::ldexp(1.0f + static_cast<float>(m) / 8.0f, e - 7);
}

/// A tile in a compiled run: (end row, scale byte offset), see quantize_tiles.
using TileEnd = std::pair<std::size_t, std::int64_t>;

/// The dtype a scheme's scale entries have.
constexpr DType scale_dtype(QuantScheme s) { return s == QuantScheme::block ? DType::f32 : DType::u8; }

/// MXFP8 shared exponent of a tile with amax > 0 (floor(log2) read off the
/// exponent bits of a normal amax: no libm call per 32-element tile).
/// A subnormal amax clamps to -127, an infinite (or NaN) one to 127.
RESHARD_HD inline int mx_exponent(float amax) {
  const int biased = static_cast<int>((std::bit_cast<std::uint32_t>(amax) >> 23) & 0xFFu);
  if (biased == 0) return -127;   // floor(log2) <= -127
  if (biased == 0xFF) return 127;  // past every finite exponent
  const int e = biased - 127 - 8;
  return e < -127 ? -127 : e > 127 ? 127 : e;
}

/// 2^k for k in [-127, 127], exact (2^-127 is an f32 subnormal).
RESHARD_HD inline float exp2_int(int k) {
  return std::bit_cast<float>(k >= -126 ? static_cast<std::uint32_t>(k + 127) << 23 : 0x00400000u >> (-127 - k));
}

/// Quantizes one tile whose rows are given by rows(f): f(const std::byte*
/// src_row, std::uint8_t* dst_row, count) is called for each row (source in
/// dtype `dt`, destination FP8 bytes). Two passes over the rows: amax, then
/// encode. Writes the scale entry (f32 for block, E8M0 byte for mx) to `scale`.
template <class Rows>
inline void quantize_tile(QuantScheme scheme, DType dt, Rows&& rows, std::byte* scale) {
  float amax = 0.0f;
  rows([&](const std::byte* s, std::uint8_t*, std::int64_t n) {
    for (std::int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(load_f32(dt, s, i)));
  });
  if (scheme == QuantScheme::block) {
    amax = std::max(amax, kBlockAmaxFloor);
    const float mul = kE4M3Max / amax;  // the quotient in f32 first (the contract's formula)
    rows([&](const std::byte* s, std::uint8_t* d, std::int64_t n) {
      for (std::int64_t i = 0; i < n; ++i) d[i] = e4m3_from_f32(load_f32(dt, s, i) * mul);
    });
    const float inv = amax / kE4M3Max;
    std::memcpy(scale, &inv, 4);
    return;
  }
  if (amax == 0.0f) {  // all zero: codes 0, scale byte 0
    rows([&](const std::byte*, std::uint8_t* d, std::int64_t n) { std::memset(d, 0, static_cast<std::size_t>(n)); });
    *scale = std::byte{0};
    return;
  }
  const int e = mx_exponent(amax);
  rows([&](const std::byte* s, std::uint8_t* d, std::int64_t n) {
    for (std::int64_t i = 0; i < n; ++i) d[i] = e4m3_from_f32(std::ldexp(load_f32(dt, s, i), -e));
  });
  *scale = static_cast<std::byte>(e + 127);
}

namespace detail {
/// quantize_rows for one source dtype, every row `Fixed` elements long when
/// Fixed > 0 (a constant trip count, which the compiler unrolls), else as
/// `rows` says.
template <DType D, std::int64_t Fixed>
[[gnu::always_inline]] inline void quantize_rows_as(QuantScheme scheme, const std::byte* from, std::uint8_t* to, const std::int64_t* rows, std::size_t n,
                             std::byte* scale) {
  constexpr std::int64_t E = element_bytes(D);
  // amax on the magnitude bits: for finite floats their order is the values'.
  // Signed lanes (a magnitude fits): SSE2 has a signed 16-bit max, no unsigned one.
  using Bits = std::conditional_t<E == 2, std::int16_t, std::int32_t>;
  constexpr Bits kMag = static_cast<Bits>(E == 2 ? 0x7FFF : 0x7FFFFFFF);
  const auto count = [rows](std::size_t r) { return Fixed > 0 ? Fixed : rows[2 * r + 1]; };
  Bits m = 0;
  for (std::size_t r = 0; r < n; ++r) {
    const std::byte* s = from + rows[2 * r] * E;
    for (std::int64_t i = 0, k = count(r); i < k; ++i) {
      Bits v;
      std::memcpy(&v, s + i * E, E);
      m = std::max<Bits>(m, v & kMag);
    }
  }
  float amax;
  {
    std::byte mb[4];
    std::memcpy(mb, &m, sizeof(m));
    amax = load_as<D>(mb, 0);
  }
  if (scheme == QuantScheme::block) {
    amax = std::max(amax, kBlockAmaxFloor);
    const float mul = kE4M3Max / amax;  // the quotient in f32 first
    for (std::size_t r = 0; r < n; ++r) {
      const std::byte* s = from + rows[2 * r] * E;
      std::uint8_t* d = to + rows[2 * r];
      for (std::int64_t i = 0, k = count(r); i < k; ++i) d[i] = e4m3_from_f32(load_as<D>(s, i) * mul);
    }
    const float inv = amax / kE4M3Max;
    std::memcpy(scale, &inv, 4);
    return;
  }
  if (amax == 0.0f) {
    for (std::size_t r = 0; r < n; ++r) std::memset(to + rows[2 * r], 0, static_cast<std::size_t>(count(r)));
    *scale = std::byte{0};
    return;
  }
  const int e = mx_exponent(amax);
  const float mul = exp2_int(-e);  // 2^-e, exact in f32 for e in [-127, 127]: x * mul rounds like x / 2^e
  for (std::size_t r = 0; r < n; ++r) {
    const std::byte* s = from + rows[2 * r] * E;
    std::uint8_t* d = to + rows[2 * r];
    for (std::int64_t i = 0, k = count(r); i < k; ++i) d[i] = e4m3_from_f32(load_as<D>(s, i) * mul);
  }
  *scale = static_cast<std::byte>(e + 127);
}

/// quantize_rows for one source dtype: the loops the executor replays
/// (always inlined into the per-ISA entry points below).
template <DType D>
[[gnu::always_inline]] inline void quantize_rows_body(QuantScheme scheme, const std::byte* from, std::uint8_t* to, const std::int64_t* rows, std::size_t n,
                                                      std::byte* scale) {
  // The common MX tile, one row of 32, with constant trip counts: the
  // general loops pay their per-row overhead for 32 elements.
  if (scheme == QuantScheme::mx && n == 1 && rows[1] == kMxTile) return quantize_rows_as<D, kMxTile>(scheme, from, to, rows, n, scale);
  quantize_rows_as<D, 0>(scheme, from, to, rows, n, scale);
}

/// Tiles one after another: tile k is rows [end of k-1, end of k) of
/// `rows`, its scale entry at byte offset tiles[k].second of `scales`.
template <DType D>
[[gnu::always_inline]] inline void quantize_tiles_body(QuantScheme scheme, const std::byte* from, std::uint8_t* to, const std::int64_t* rows,
                                                       const TileEnd* tiles, std::size_t n, std::byte* scales) {
  std::size_t row = 0;
  for (std::size_t k = 0; k < n; ++k) {
    quantize_rows_body<D>(scheme, from, to, rows + 2 * row, tiles[k].first - row, scales + tiles[k].second);
    row = tiles[k].first;
  }
}

// The entry points ask for -O3's vectorizer (GCC): a user of this header
// may build at -O2, where GCC 12 leaves these loops scalar (about 5x slower).
#if defined(__GNUC__) && !defined(__clang__) && !defined(__CUDACC__)
#define RESHARD_QUANTIZE_ENTRY(...) __attribute__((__VA_ARGS__ __VA_OPT__(, ) optimize("O3")))
#else
#define RESHARD_QUANTIZE_ENTRY(...) __VA_OPT__(__attribute__((__VA_ARGS__)))
#endif

template <DType D>
RESHARD_QUANTIZE_ENTRY() inline void quantize_tiles_as(QuantScheme scheme, const std::byte* from, std::uint8_t* to, const std::int64_t* rows,
                                                         const TileEnd* tiles, std::size_t n, std::byte* scales) {
  quantize_tiles_body<D>(scheme, from, to, rows, tiles, n, scales);
}

// x86-64 builds target SSE2 by default; the same loops compiled for AVX2 (8
// lanes, unsigned and 32-bit min/max) or AVX-512 (16 lanes; BW for the 16-bit
// amax) run 2-4x as fast, so the kernel picks the widest the CPU has at run
// time. The same operations (IEEE f32 multiply, integer ops): the same bits.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(__CUDACC__)
#define RESHARD_QUANTIZE_X86_DISPATCH 1
template <DType D>
RESHARD_QUANTIZE_ENTRY(target("avx2")) inline void quantize_tiles_as_avx2(QuantScheme scheme, const std::byte* from, std::uint8_t* to,
                                                                           const std::int64_t* rows, const TileEnd* tiles, std::size_t n,
                                                                           std::byte* scales) {
  quantize_tiles_body<D>(scheme, from, to, rows, tiles, n, scales);
}
template <DType D>
RESHARD_QUANTIZE_ENTRY(target("avx512f,avx512bw,avx512vl,avx512dq"))
inline void quantize_tiles_as_avx512(QuantScheme scheme, const std::byte* from, std::uint8_t* to, const std::int64_t* rows,
                                     const TileEnd* tiles, std::size_t n, std::byte* scales) {
  quantize_tiles_body<D>(scheme, from, to, rows, tiles, n, scales);
}
inline bool cpu_has_avx2() {
  static const bool has = __builtin_cpu_supports("avx2");
  return has;
}
inline bool cpu_has_avx512() {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
                          __builtin_cpu_supports("avx512dq");
  return has;
}
#endif

template <DType D>
inline void quantize_tiles_dispatch(QuantScheme scheme, const std::byte* from, std::uint8_t* to, const std::int64_t* rows, const TileEnd* tiles,
                                    std::size_t n, std::byte* scales) {
#ifdef RESHARD_QUANTIZE_X86_DISPATCH
  if (cpu_has_avx512()) return quantize_tiles_as_avx512<D>(scheme, from, to, rows, tiles, n, scales);
  if (cpu_has_avx2()) return quantize_tiles_as_avx2<D>(scheme, from, to, rows, tiles, n, scales);
#endif
  quantize_tiles_as<D>(scheme, from, to, rows, tiles, n, scales);
}
}  // namespace detail

/// Quantizes a run of tiles with one dispatch (the replay of a rank's
/// compiled tiles): rows are (element offset, count) pairs, source elements
/// at from + offset (dtype dt), FP8 codes to to + offset (the same offsets:
/// a shadow or staging copy of one buffer); tile k is rows
/// [tiles[k-1].first, tiles[k].first) with its scale entry at byte
/// tiles[k].second of `scales`. The same recipe as quantize_tile.
inline void quantize_tiles(QuantScheme scheme, DType dt, const std::byte* from, std::uint8_t* to, const std::int64_t* rows, const TileEnd* tiles,
                           std::size_t n, std::byte* scales) {
  switch (dt) {
    case DType::bf16: return detail::quantize_tiles_dispatch<DType::bf16>(scheme, from, to, rows, tiles, n, scales);
    case DType::f16: return detail::quantize_tiles_dispatch<DType::f16>(scheme, from, to, rows, tiles, n, scales);
    case DType::f32: return detail::quantize_tiles_dispatch<DType::f32>(scheme, from, to, rows, tiles, n, scales);
    default: fail("quantize: source dtype {} is not bf16, f16 or f32", to_string(dt));
  }
}

/// One tile given as n rows: quantize_tiles of that one tile, its scale
/// entry to `scale`.
inline void quantize_rows(QuantScheme scheme, DType dt, const std::byte* from, std::uint8_t* to, const std::int64_t* rows, std::size_t n,
                          std::byte* scale) {
  const TileEnd one{n, 0};
  quantize_tiles(scheme, dt, from, to, rows, &one, 1, scale);
}

}  // namespace reshard
