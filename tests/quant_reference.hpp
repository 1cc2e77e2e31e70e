#pragma once
// A reference quantizer written from CONTRACT.md §1 "Quantized destination
// tensors" alone, sharing no code with include/reshard/layout/quantize.hpp: E4M3 by
// search over the format's value table (nearest, ties to the even code),
// tiles over whole global tensors.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace quant_ref {

/// The value of e4m3fn code c (c < 0x80), from the format's definition:
/// bias 7, 3 mantissa bits, exponent 0 subnormal.
inline double e4m3_value(int c) {
  const int e = c >> 3, m = c & 7;
  if (e == 0) return m / 8.0 * std::pow(2.0, -6);
  return (1.0 + m / 8.0) * std::pow(2.0, e - 7);
}

/// Nearest code to x (finite), ties to the even code, |x| past 448 -> 448.
inline std::uint8_t e4m3(float x) {
  const double a = std::fabs(static_cast<double>(x));
  const std::uint8_t sign = std::signbit(x) ? 0x80 : 0;
  if (a >= 448.0) return sign | 0x7E;
  int best = 0;
  for (int c = 1; c <= 0x7E; ++c) {
    const double dc = std::fabs(e4m3_value(c) - a), db = std::fabs(e4m3_value(best) - a);
    if (dc < db || (dc == db && (c % 2 == 0))) best = c;
  }
  return static_cast<std::uint8_t>(sign | best);
}

/// Block scheme over a whole tensor (row-major values): codes per element,
/// one f32 scale per tile (scale shape: leading dims, then tile counts).
struct Quantized {
  std::vector<std::uint8_t> codes;
  std::vector<std::uint8_t> scale_bytes;  ///< scale entries as raw bytes (f32 or E8M0)
};

inline Quantized quantize(const std::vector<float>& x, const std::vector<std::int64_t>& shape, const std::vector<std::int64_t>& block,
                          bool mx) {
  const int n = static_cast<int>(shape.size()), nb = static_cast<int>(block.size());
  std::vector<std::int64_t> tile(n, 1), tiles(n);
  for (int d = 0; d < nb; ++d) tile[n - nb + d] = block[d];
  std::int64_t ntiles = 1;
  for (int d = 0; d < n; ++d) {
    tiles[d] = (shape[d] + tile[d] - 1) / tile[d];
    ntiles *= tiles[d];
  }
  // Tile id of every element.
  std::vector<std::int64_t> tid(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) {
    std::int64_t r = static_cast<std::int64_t>(i), id = 0, mul = 1;
    for (int d = n - 1; d >= 0; --d) {
      const std::int64_t g = r % shape[d];
      r /= shape[d];
      id += g / tile[d] * mul;
      mul *= tiles[d];
    }
    tid[i] = id;
  }
  std::vector<float> amax(ntiles, 0.0f);
  for (std::size_t i = 0; i < x.size(); ++i) amax[tid[i]] = std::max(amax[tid[i]], std::fabs(x[i]));
  Quantized q;
  q.codes.resize(x.size());
  q.scale_bytes.resize(static_cast<std::size_t>(ntiles) * (mx ? 1 : 4));
  for (std::int64_t t = 0; t < ntiles; ++t) {
    if (mx) {
      if (amax[t] == 0) q.scale_bytes[t] = 0;
      else {
        int e = static_cast<int>(std::floor(std::log2(static_cast<double>(amax[t])))) - 8;
        e = std::max(-127, std::min(127, e));
        q.scale_bytes[t] = static_cast<std::uint8_t>(e + 127);
      }
    } else {
      const float a = std::max(amax[t], 1e-4f);
      const float s = a / 448.0f;
      std::memcpy(&q.scale_bytes[t * 4], &s, 4);
    }
  }
  for (std::size_t i = 0; i < x.size(); ++i) {
    const std::int64_t t = tid[i];
    if (mx) {
      if (amax[t] == 0) q.codes[i] = 0;
      else q.codes[i] = e4m3(static_cast<float>(static_cast<double>(x[i]) / std::pow(2.0, q.scale_bytes[t] - 127)));
    } else {
      const float a = std::max(amax[t], 1e-4f);
      const float mul = 448.0f / a;
      q.codes[i] = e4m3(x[i] * mul);
    }
  }
  return q;
}

}  // namespace quant_ref
