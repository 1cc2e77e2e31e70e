#pragma once
// Conversions between the float dtypes a refit casts in flight (f32, bf16,
// f16; PlanOptions::cast) and the exact widenings the FP8 quantizer reads
// its sources with. Narrowing rounds to nearest even, as torch's
// Tensor.to() does: overflow gives infinity, a NaN stays a (quiet) NaN.
// On the bits, no libm for the widenings: CUDA device code shares them.
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "dtype.hpp"
#include "error.hpp"
#include "hd.hpp"

namespace reshard {

/// bf16 -> f32 (exact).
RESHARD_HD inline float f32_from_bf16(std::uint16_t b) { return std::bit_cast<float>(static_cast<std::uint32_t>(b) << 16); }

/// f16 -> f32 (exact; a NaN becomes the quiet NaN 0x7FC00000 with its sign).
RESHARD_HD inline float f32_from_f16(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t e = (h >> 10) & 31u, m = h & 0x3FFu;
  std::uint32_t v;
  if (e == 0) v = std::bit_cast<std::uint32_t>(static_cast<float>(m) * 0x1p-24f);  // m * 2^-24, exact
  else if (e == 31) v = m ? 0x7FC00000u : 0x7F800000u;
  else v = (e + 112u) << 23 | m << 13;  // exponent bias 15 -> 127
  return std::bit_cast<float>(v | sign);
}

/// f32 -> bf16, round to nearest even; a NaN becomes 0x7FC0 (torch's).
inline std::uint16_t bf16_from_f32(float x) {
  const std::uint32_t u = std::bit_cast<std::uint32_t>(x);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0u;
  return static_cast<std::uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);  // a carry into the exponent is right
}

/// f32 -> f16, round to nearest even; past the largest f16 (65504) rounds to
/// infinity; a NaN becomes the quiet NaN 0x7E00 with its sign.
inline std::uint16_t f16_from_f32(float x) {
  const std::uint32_t u = std::bit_cast<std::uint32_t>(x);
  const auto sign = static_cast<std::uint16_t>((u >> 16) & 0x8000u);
  const std::uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return static_cast<std::uint16_t>(sign | 0x7E00u);
  if (a >= 0x38800000u) {  // |x| >= 2^-14: an f16 normal, or overflow
    std::uint32_t r = a - (112u << 23);  // rebias 127 -> 15; the 13 low mantissa bits are rounded off
    r += 0x0FFFu + ((r >> 13) & 1u);
    const std::uint32_t h = r >> 13;
    return static_cast<std::uint16_t>(sign | (h >= 0x7C00u ? 0x7C00u : h));
  }
  // An f16 subnormal (or zero): units of 2^-24, rounded to nearest even (the
  // default rounding mode); scaling by a power of two is exact. 0x400 is the
  // smallest normal, which the same bits encode.
  const auto m = static_cast<std::uint32_t>(std::nearbyint(std::fabs(x) * 0x1p24f));
  return static_cast<std::uint16_t>(sign | m);
}

/// Element `i` of a row of dtype `dt` (bf16, f16 or f32) as f32 (exact).
inline float load_f32(DType dt, const std::byte* row, std::int64_t i) {
  std::uint16_t b;
  switch (dt) {
    case DType::bf16:
      std::memcpy(&b, row + 2 * i, 2);
      return f32_from_bf16(b);
    case DType::f16:
      std::memcpy(&b, row + 2 * i, 2);
      return f32_from_f16(b);
    case DType::f32: {
      float f;
      std::memcpy(&f, row + 4 * i, 4);
      return f;
    }
    default:
      fail("float conversion: dtype {} is not bf16, f16 or f32", to_string(dt));
  }
}

/// The float dtypes a cast in flight converts between.
inline bool castable(DType d) { return d == DType::f32 || d == DType::bf16 || d == DType::f16; }

namespace detail {
/// Element `i` of a row of dtype D (bf16, f16 or f32) as f32 (exact): load_f32 for a dtype known at compile time.
template <DType D>
inline float load_as(const std::byte* p, std::int64_t i) {
  if constexpr (D == DType::f32) {
    float f;
    std::memcpy(&f, p + 4 * i, 4);
    return f;
  } else {
    std::uint16_t b;
    std::memcpy(&b, p + 2 * i, 2);
    return D == DType::bf16 ? f32_from_bf16(b) : f32_from_f16(b);
  }
}

template <DType From, DType To>
void convert_run(const std::byte* s, std::byte* d, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) {
    const float f = load_as<From>(s, i);  // exact: every source dtype widens to f32
    if constexpr (To == DType::f32) {
      std::memcpy(d + 4 * i, &f, 4);
    } else {
      const std::uint16_t h = To == DType::bf16 ? bf16_from_f32(f) : f16_from_f32(f);
      std::memcpy(d + 2 * i, &h, 2);
    }
  }
}
template <DType From>
void convert_from(DType to, const std::byte* s, std::byte* d, std::int64_t n) {
  switch (to) {
    case DType::f32: return convert_run<From, DType::f32>(s, d, n);
    case DType::bf16: return convert_run<From, DType::bf16>(s, d, n);
    case DType::f16: return convert_run<From, DType::f16>(s, d, n);
    default: fail("float conversion: dtype {} is not bf16, f16 or f32", to_string(to));
  }
}
}  // namespace detail

/// Converts n contiguous elements from dtype `from` to dtype `to` (each bf16,
/// f16 or f32); `s` and `d` do not overlap.
inline void convert_elements(DType from, DType to, const std::byte* s, std::byte* d, std::int64_t n) {
  switch (from) {
    case DType::f32: return detail::convert_from<DType::f32>(to, s, d, n);
    case DType::bf16: return detail::convert_from<DType::bf16>(to, s, d, n);
    case DType::f16: return detail::convert_from<DType::f16>(to, s, d, n);
    default: fail("float conversion: dtype {} is not bf16, f16 or f32", to_string(from));
  }
}

}  // namespace reshard
