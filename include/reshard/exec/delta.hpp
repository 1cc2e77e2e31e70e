#pragma once
// Delta refits: after a version has reached the destination, the next refit
// sends, per peer pair, only the elements whose bits changed, exactly.
//
// At RL learning rates most BF16 weights do not change from one step to the
// next (the Adam update is below half an ulp), so a dense refit moves mostly
// bytes the receiver already holds. DeltaExecutor<T> replays the same
// schedule as the Executor, but:
//
//  * Streams. A remote peer pair's copies, in one canonical order both ends
//    compute, form one stream of elements per element size. The stream is
//    cut into chunks of kChunk elements (so an index fits in 16 bits).
//  * Shadow (the base). The sender keeps a copy of the stream it last
//    delivered to this executor's destination set: the shadow. It is exactly
//    what the receiver's target holds, because this executor is the only
//    writer of that set (double-buffered: one DeltaExecutor per set, so each
//    set's shadow is the version before last, never the last). Memory: the
//    shadowed pairs' bytes on each sender, per destination set
//    (DeltaOptions::shadow_budget bounds it; pairs past the bound are refit
//    dense every time by a plain Executor over just those copies).
//  * Encoding. The sender diffs each chunk with the shadow where it lies
//    (row by row; a chunk of short or strided rows is packed first), updating
//    the shadow (AVX-512 where the CPU has it), and
//    writes the cheapest of: nothing
//    (unchanged), byte gaps + values, 16-bit indices + values, a bitmask +
//    values, or the dense values. A payload header carries the version and the base version, and
//    with ExecutorOptions::checksum a CRC32C of the payload.
//  * Slices. Each pair's streams are cut into slices of about
//    DeltaOptions::slice_bytes dense bytes (whole chunks). A slice is diffed,
//    encoded and posted before the next is diffed, so the wire, and the
//    receiver's scatter, start after the first slice's diff instead of after
//    the whole diff.
//  * Wire. Payloads vary in size but a Transport replays prepared ops of
//    fixed sizes, so each pair's payload capacity (DeltaOptions::capacity of
//    its dense bytes, plus a header, a table and a block per slice) is
//    prepared as blocks of block_bytes. A slice's payload starts on a block
//    boundary, right after the previous slice's; its first block carries its
//    header (its size), so the receiver posts a slice's first block, learns
//    from it how many more follow and where the next slice starts, and posts
//    those: both ends the same blocks, without a collective before the data.
//  * Speculation. The payloads move before the world's decision: after all
//    of them one bootstrap all-gather carries every sender's changed count,
//    overflow and invalidation request.
//  * Fallback. All ranks decide alike from that all-gather: when the
//    changed fraction is above DeltaOptions::dense_above (the break-even,
//    measured: docs/delta.md) or a payload outgrew its capacity, the refit
//    runs the plain Executor over the whole schedule (zero-copy as usual;
//    the shadows are already current), which rewrites every destination
//    element whole, whatever payloads were scattered before it (a slice
//    past the capacity travels as a header that says so, and its pair sends
//    nothing after it). Above dense_above the next
//    dense_streak refits go dense without diffing (no shadow upkeep); the
//    streak's last refit brings only the sampled positions of the shadows
//    to its version, and the next refit samples.
//  * Sample. Until a diff over the current base has measured a density at
//    or below dense_above, or while the shadows hold only the sampled
//    positions, a refit first compares a sample of each stream
//    (DeltaOptions::sample_every / sample_elements, about 1/256, read only)
//    and sums it in one all-gather. Above dense_above it goes dense without
//    the full diff (mode "sampled"), keeping only the sampled positions (at
//    the streak's end, or at once without a streak). Where the shadows hold
//    only those and the sample finds the density at or below dense_above,
//    the refit is dense and primes the shadows whole (a pack of the sources
//    on a helper thread beside it), and deltas follow. So while the density
//    stays high no refit pays a prime, only the first one after setup().
//  * A base that is always right. The first refit after setup() is dense
//    and primes the shadows. Any failure breaks the executor (like the
//    Executor); the Resharder then needs setup() again, which drops every
//    shadow, so the next refit of every pair is dense. The receiver checks
//    each payload's base version against the version its set last got from
//    this executor: a mismatch fails the refit instead of scattering onto
//    the wrong base. Nothing else may write the destination between refits;
//    a rank whose destination was written calls invalidate_base(), alone:
//    the request rides in the next refit's first all-gather (the sample's
//    or the counts'), and every rank then goes dense (primed again).
//
// Limits: host memory, unstaged schedules. Buffers may be strided views
// (each copy's side is split into runs of the view as the Executor does).
#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include <fmt/format.h>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(__CUDACC__)
#include <immintrin.h>
#endif

#include "../base/error.hpp"
#include "../base/hd.hpp"  // chunk sizes and modes are also the CUDA kernels' (cuda/delta_kernels.cuh)
#include "../schedule/schedule.hpp"
#include "../transport/transport.hpp"
#include "checksum.hpp"
#include "copy_kernels.hpp"
#include "executor.hpp"

namespace reshard {

struct DeltaOptions {
  bool enabled = false;
  /// Shadow bytes one sender may keep per destination set; pairs past it
  /// (in peer order) are refit dense every time.
  std::int64_t shadow_budget = INT64_MAX;
  /// Changed fraction (over all ranks) above which a refit goes dense: the
  /// break-even measured with reshard-refit --delta (docs/delta.md: about
  /// 7% over UCX loopback on 2 cores, where the diff pass is CPU-bound).
  double dense_above = 0.06;
  /// Payload capacity per pair, as a fraction of its dense bytes (plus the
  /// chunk table): the staging each side holds for delta payloads.
  double capacity = 0.375;
  /// Payloads move in blocks of this many bytes (the last one of a pair shorter).
  std::int64_t block_bytes = std::int64_t{64} << 10;
  /// Dense bytes of a pair's stream diffed, sent and scattered as one slice
  /// (at least one chunk): smaller slices overlap more of the diff with the
  /// wire, each costs a header, a table and on average half a block.
  std::int64_t slice_bytes = std::int64_t{32} << 20;
  /// After a refit above dense_above: this many dense refits without diffing.
  int dense_streak = 16;
  /// The density sample taken before the first diff over a fresh base (or
  /// after a refit above dense_above): the first sample_elements of every
  /// sample_every-th chunk of each stream are compared (not encoded); when
  /// the world's sampled fraction is above dense_above the refit goes dense
  /// without the full diff. 0: no sample (a streak then ends in a full
  /// prime of the shadows, as nothing else can measure the density).
  int sample_every = 16;
  std::int64_t sample_elements = 4096;
};

namespace delta {

/// Elements per chunk: indices within a chunk fit in 16 bits.
inline constexpr std::int64_t kChunk = 65536;

/// How a chunk travels: nothing; 16-bit positions + values; a bitmask +
/// values; the dense values; byte gaps between positions (255 escapes to a
/// 16-bit position) + values, the smallest at RL densities (a few %).
enum class ChunkMode : std::uint8_t { same = 0, index = 1, mask = 2, dense = 3, gap = 4 };
inline constexpr int kChunkModes = 5;

inline const char* to_string(ChunkMode m) {
  switch (m) {
    case ChunkMode::same: return "same";
    case ChunkMode::index: return "index";
    case ChunkMode::mask: return "mask";
    case ChunkMode::gap: return "gap";
    default: return "dense";
  }
}

/// Bytes of a chunk's body: n elements of E bytes, k of them changed, `esc`
/// of the gaps escaped (gap mode).
RESHARD_HD inline std::int64_t body_bytes(ChunkMode m, std::int64_t n, std::int64_t k, std::int64_t E, std::int64_t esc = 0) {
  switch (m) {
    case ChunkMode::same: return 0;
    case ChunkMode::index: return k * (2 + E);
    case ChunkMode::mask: return (n + 7) / 8 + k * E;
    case ChunkMode::gap: return k * (1 + E) + 2 * esc;
    default: return n * E;
  }
}

/// Gaps that do not fit a byte (gap mode escapes them).
inline std::int64_t gap_escapes(const std::uint16_t* idx, std::int64_t k) {
  std::int64_t esc = 0, prev = -1;
  for (std::int64_t j = 0; j < k; ++j) {
    esc += idx[j] - prev - 1 >= 255;
    prev = idx[j];
  }
  return esc;
}

/// The smallest encoding of a chunk (ties go to the simpler one).
RESHARD_HD inline ChunkMode best_mode(std::int64_t n, std::int64_t k, std::int64_t E, std::int64_t esc = INT64_MAX / 4) {
  if (k == 0) return ChunkMode::same;
  ChunkMode best = ChunkMode::dense;
  for (ChunkMode m : {ChunkMode::mask, ChunkMode::index, ChunkMode::gap})
    if (body_bytes(m, n, k, E, esc) < body_bytes(best, n, k, E, esc)) best = m;
  return best;
}

/// Wire bytes per dense byte of a stream of E-byte elements in which a
/// fraction F changed, spread at random: a full chunk's table entry and its
/// smallest body (best_mode / body_bytes, as the sender chooses), with
/// k = F x kChunk changes and the expected number of gaps past a byte
/// (each gap is >= 255 with probability (1 - F)^255). The simulator's
/// delta prediction (sim/simulate.hpp) scales messages by it.
inline double expected_wire_fraction(std::int64_t E, double F) {
  const auto k = static_cast<std::int64_t>(std::llround(std::clamp(F, 0.0, 1.0) * static_cast<double>(kChunk)));
  const auto esc = static_cast<std::int64_t>(std::llround(static_cast<double>(k) * std::pow(1.0 - std::clamp(F, 0.0, 1.0), 255.0)));
  const std::int64_t body = body_bytes(best_mode(kChunk, k, E, esc), kChunk, k, E, esc);
  return static_cast<double>(4 + body) / static_cast<double>(kChunk * E);
}

/// Gap stream of a sorted index list: per position the distance from the
/// previous one minus one as a byte, or 255 and the position in 16 bits.
inline void gaps_from_indices(const std::uint16_t* idx, std::int64_t k, std::byte* out) {
  std::int64_t prev = -1;
  for (std::int64_t j = 0; j < k; ++j) {
    const std::int64_t g = idx[j] - prev - 1;
    if (g < 255) {
      *out++ = static_cast<std::byte>(g);
    } else {
      *out++ = std::byte{255};
      std::memcpy(out, &idx[j], 2);
      out += 2;
    }
    prev = idx[j];
  }
}

/// The index list of a gap stream of k positions within n; returns the
/// stream's bytes, or -1 if it is malformed (past `limit` bytes or n).
inline std::int64_t indices_from_gaps(const std::byte* in, std::int64_t k, std::int64_t n, std::int64_t limit, std::uint16_t* idx) {
  std::int64_t at = 0, prev = -1;
  for (std::int64_t j = 0; j < k; ++j) {
    if (at >= limit) return -1;
    const auto g = static_cast<std::int64_t>(in[at++]);
    std::int64_t p;
    if (g < 255) {
      p = prev + 1 + g;
    } else {
      if (at + 2 > limit) return -1;
      std::uint16_t x;
      std::memcpy(&x, in + at, 2);
      at += 2;
      p = x;
    }
    if (p <= prev || p >= n) return -1;
    idx[j] = static_cast<std::uint16_t>(p);
    prev = p;
  }
  return at;
}

/// A chunk table entry: mode in the top byte, the changed count below.
RESHARD_HD inline std::uint32_t table_entry(ChunkMode m, std::int64_t k) {
  return static_cast<std::uint32_t>(m) << 24 | static_cast<std::uint32_t>(k);
}

namespace detail {
/// The top bit of each E-byte lane of a 64-bit word.
template <std::size_t E>
constexpr std::uint64_t lane_tops() {
  std::uint64_t h = 0;
  for (std::size_t j = 0; j < 8 / E; ++j) h |= std::uint64_t{1} << (8 * E * (j + 1) - 1);
  return h;
}
/// Of an XOR word (little-endian lanes of E bytes): the top bit of each lane
/// that is nonzero, without a branch per lane (no carry crosses a lane).
template <std::size_t E>
inline std::uint64_t lanes_differ(std::uint64_t x) {
  constexpr std::uint64_t H = lane_tops<E>(), L = ~H;
  return (((x & L) + L) | x) & H;
}
/// lanes_differ's bits packed: bit j for lane j.
template <std::size_t E>
inline std::uint64_t lane_mask(std::uint64_t tops) {
  std::uint64_t m = 0;
  for (std::size_t j = 0; j < 8 / E; ++j) m |= (tops >> (8 * E * (j + 1) - 1) & 1) << j;
  return m;
}
template <std::size_t E>
inline constexpr bool word_lanes = E != 0 && E <= 8 && 8 % (E ? E : 1) == 0 && std::endian::native == std::endian::little;
}  // namespace detail

/// Diff-and-compact: compares n elements of E bytes of `cur` with `base`;
/// writes the positions that differ to `idx` and their new values to `vals`,
/// copies them into `base`, and returns how many. One pass: 64 bytes are
/// compared at a time (XOR of 8 words, one test: most blocks are clean at
/// RL densities); in a dirty block the changed lanes are found by bit
/// arithmetic (no branch per element), visited by the set bits of one mask,
/// and the block is written back to the base whole (its line is dirty anyway).
/// E == 0: a runtime element size `eb`.
template <std::size_t E>
inline std::int64_t diff_compact(const std::byte* cur, std::byte* base, std::int64_t n, std::uint16_t* idx, std::byte* vals,
                                 std::size_t eb = E) {
  const std::size_t esz = E ? E : eb;
  std::int64_t k = 0, i = 0;
  if constexpr (detail::word_lanes<E>) {
    constexpr std::int64_t per = 8 / static_cast<std::int64_t>(E), W = 8, B = per * W;
    for (; i + B <= n; i += B) {
      const std::byte* c = cur + i * static_cast<std::int64_t>(E);
      std::byte* b = base + i * static_cast<std::int64_t>(E);
      // The block's changed elements as one bit mask.
      std::uint64_t bits = 0;
#if defined(__SSE2__)
      if constexpr (E == 2) {
        // 16-bit compares, packed to bytes, one movemask per 16 elements.
        __m128i eq[4];
        for (int q = 0; q < 4; ++q)
          eq[q] = _mm_cmpeq_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + 16 * q)),
                                  _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 16 * q)));
        const auto lo = static_cast<std::uint32_t>(_mm_movemask_epi8(_mm_packs_epi16(eq[0], eq[1])));
        const auto hi = static_cast<std::uint32_t>(_mm_movemask_epi8(_mm_packs_epi16(eq[2], eq[3])));
        bits = ~(lo | hi << 16) & 0xFFFFFFFFu;
      } else
#endif
      {
        std::uint64_t x[W], any = 0;
        for (std::int64_t w = 0; w < W; ++w) {
          std::uint64_t a, o;
          std::memcpy(&a, c + 8 * w, 8);
          std::memcpy(&o, b + 8 * w, 8);
          x[w] = a ^ o;
          any |= x[w];
        }
        if (any)
          for (std::int64_t w = 0; w < W; ++w) bits |= detail::lane_mask<E>(detail::lanes_differ<E>(x[w])) << (w * per);
      }
      if (bits == 0) continue;
      // The first four changes are written unconditionally (k advances by
      // the count), so the common dirty block (one or two changes) takes no
      // data-dependent branch.
      const std::int64_t count = std::popcount(bits);
      constexpr std::uint64_t last = std::uint64_t{1} << (B - 1);  // keeps ctz within the block when bits run out
      for (std::int64_t r = 0; r < 4; ++r, bits &= bits - 1) {
        const std::int64_t j = std::countr_zero(bits | last);
        idx[k + r] = static_cast<std::uint16_t>(i + j);
        std::memcpy(vals + (k + r) * static_cast<std::int64_t>(E), c + j * static_cast<std::int64_t>(E), E);
      }
      for (std::int64_t r = 4; bits; ++r, bits &= bits - 1) {
        const std::int64_t j = std::countr_zero(bits);
        idx[k + r] = static_cast<std::uint16_t>(i + j);
        std::memcpy(vals + (k + r) * static_cast<std::int64_t>(E), c + j * static_cast<std::int64_t>(E), E);
      }
      k += count;
      std::memcpy(b, c, 8 * W);
    }
  }
  for (; i < n; ++i) {
    const std::byte* c = cur + i * static_cast<std::int64_t>(esz);
    std::byte* b = base + i * static_cast<std::int64_t>(esz);
    if (std::memcmp(c, b, esz) == 0) continue;
    idx[k] = static_cast<std::uint16_t>(i);
    std::memcpy(vals + k * static_cast<std::int64_t>(esz), c, esz);
    std::memcpy(b, c, esz);
    ++k;
  }
  return k;
}

/// How many of n elements of E bytes differ between `cur` and `base` (the
/// density sample: compares only, writes nothing).
template <std::size_t E>
inline std::int64_t count_changed(const std::byte* cur, const std::byte* base, std::int64_t n, std::size_t eb = E) {
  const std::size_t esz = E ? E : eb;
  std::int64_t k = 0, i = 0;
  if constexpr (detail::word_lanes<E>) {
    constexpr std::int64_t per = 8 / static_cast<std::int64_t>(E);
    for (; i + per <= n; i += per) {
      std::uint64_t a, o;
      std::memcpy(&a, cur + i * static_cast<std::int64_t>(E), 8);
      std::memcpy(&o, base + i * static_cast<std::int64_t>(E), 8);
      k += __builtin_popcountll(detail::lanes_differ<E>(a ^ o));
    }
  }
  for (; i < n; ++i) k += std::memcmp(cur + i * static_cast<std::int64_t>(esz), base + i * static_cast<std::int64_t>(esz), esz) != 0;
  return k;
}

inline std::int64_t count_changed_bytes(std::size_t E, const std::byte* cur, const std::byte* base, std::int64_t n) {
  switch (E) {
    case 1: return count_changed<1>(cur, base, n);
    case 2: return count_changed<2>(cur, base, n);
    case 4: return count_changed<4>(cur, base, n);
    case 8: return count_changed<8>(cur, base, n);
    default: return count_changed<0>(cur, base, n, E);
  }
}

// The same diff with AVX-512 (BW, VL, VBMI2), picked at run time where the
// CPU has it (x86-64 builds target SSE2 by default): one compare gives a
// vector's changed lanes as a mask, vpcompress packs their values and
// positions without a branch per element or per dirty block (the dirty
// blocks are what made the portable kernel 2-3x slower than at density 0),
// and masked stores write exactly the changed lanes: the outputs never past
// k, the base only where it changed (its clean lines stay clean). The
// register form of vpcompress is used: the memory form is microcoded on AMD.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(__CUDACC__)
#define RESHARD_DELTA_AVX512_DISPATCH 1
namespace detail {
inline bool cpu_has_avx512_compress() {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
                          __builtin_cpu_supports("avx512vbmi2") && __builtin_cpu_supports("bmi2");
  return has;
}
}  // namespace detail

#define RESHARD_DELTA_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vbmi2,bmi2,popcnt")))
namespace detail {
template <std::size_t E>
using Lanes = std::conditional_t<E == 2, __mmask32, __mmask16>;
/// The lanes of `live` where a and b differ.
template <std::size_t E>
RESHARD_DELTA_AVX512 inline Lanes<E> lanes_neq(Lanes<E> live, __m512i a, __m512i b) {
  if constexpr (E == 2)
    return _mm512_mask_cmpneq_epi16_mask(live, a, b);
  else
    return _mm512_mask_cmpneq_epi32_mask(live, a, b);
}
/// One vector at element `at`: its changed lanes m (values a) appended to
/// idx / vals at k (masked stores: nothing past the new k) and written to the base.
template <std::size_t E>
RESHARD_DELTA_AVX512 inline std::int64_t compact_lanes(std::int64_t at, Lanes<E> m, __m512i a, std::byte* base, std::uint16_t* idx,
                                                       std::byte* vals, std::int64_t k) {
  const auto cnt = static_cast<unsigned>(std::popcount(static_cast<std::uint32_t>(m)));
  const auto out = static_cast<Lanes<E>>(_bzhi_u32(0xFFFFFFFFu, cnt));
  if constexpr (E == 2) {
    const __m512i pos = _mm512_add_epi16(_mm512_set_epi16(31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16, 15, 14, 13, 12, 11, 10,
                                                          9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                         _mm512_set1_epi16(static_cast<short>(at)));
    _mm512_mask_storeu_epi16(vals + 2 * k, out, _mm512_maskz_compress_epi16(m, a));
    _mm512_mask_storeu_epi16(idx + k, out, _mm512_maskz_compress_epi16(m, pos));
    _mm512_mask_storeu_epi16(base + 2 * at, m, a);
  } else {
    const __m256i pos =
        _mm256_add_epi16(_mm256_set_epi16(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), _mm256_set1_epi16(static_cast<short>(at)));
    _mm512_mask_storeu_epi32(vals + 4 * k, out, _mm512_maskz_compress_epi32(m, a));
    _mm256_mask_storeu_epi16(idx + k, out, _mm256_maskz_compress_epi16(m, pos));
    _mm512_mask_storeu_epi32(base + 4 * at, m, a);
  }
  return k + cnt;
}
}  // namespace detail

/// diff_compact for E = 2 or 4 with AVX-512; the caller checks
/// detail::cpu_has_avx512_compress(). Same contract and output.
template <std::size_t E>
RESHARD_DELTA_AVX512 inline std::int64_t diff_compact_avx512(const std::byte* cur, std::byte* base, std::int64_t n, std::uint16_t* idx,
                                                             std::byte* vals) {
  static_assert(E == 2 || E == 4, "diff_compact_avx512: 2- or 4-byte elements");
  using Mask = detail::Lanes<E>;
  constexpr auto SE = static_cast<std::int64_t>(E);
  constexpr std::int64_t L = 64 / SE;  // lanes per vector
  constexpr std::int64_t G = 4;        // vectors per group: one branch per group
  std::int64_t k = 0, i = 0;
  for (; i + G * L <= n; i += G * L) {
    __m512i a[G], b[G], x = _mm512_setzero_si512();
    for (std::int64_t g = 0; g < G; ++g) {
      a[g] = _mm512_loadu_si512(cur + (i + g * L) * SE);
      b[g] = _mm512_loadu_si512(base + (i + g * L) * SE);
      x = _mm512_or_si512(x, _mm512_xor_si512(a[g], b[g]));
    }
    if (_mm512_test_epi64_mask(x, x) == 0) continue;  // most groups at density 0; few at RL densities (a few %)
    for (std::int64_t g = 0; g < G; ++g)
      k = detail::compact_lanes<E>(i + g * L, detail::lanes_neq<E>(static_cast<Mask>(~Mask{0}), a[g], b[g]), a[g], base, idx, vals, k);
  }
  for (; i < n; i += L) {
    const auto live = static_cast<Mask>(_bzhi_u32(0xFFFFFFFFu, static_cast<unsigned>(std::min(L, n - i))));
    __m512i a, b;
    if constexpr (E == 2) {
      a = _mm512_maskz_loadu_epi16(live, cur + 2 * i);
      b = _mm512_maskz_loadu_epi16(live, base + 2 * i);
    } else {
      a = _mm512_maskz_loadu_epi32(live, cur + 4 * i);
      b = _mm512_maskz_loadu_epi32(live, base + 4 * i);
    }
    k = detail::compact_lanes<E>(i, detail::lanes_neq<E>(live, a, b), a, base, idx, vals, k);
  }
  return k;
}
#undef RESHARD_DELTA_AVX512
#endif

/// diff_compact for any element size (runtime E), with the AVX-512 kernel
/// where the CPU has it.
inline std::int64_t diff_compact_bytes(std::size_t E, const std::byte* cur, std::byte* base, std::int64_t n, std::uint16_t* idx,
                                       std::byte* vals) {
#ifdef RESHARD_DELTA_AVX512_DISPATCH
  if ((E == 2 || E == 4) && detail::cpu_has_avx512_compress())
    return E == 2 ? diff_compact_avx512<2>(cur, base, n, idx, vals) : diff_compact_avx512<4>(cur, base, n, idx, vals);
#endif
  switch (E) {
    case 1: return diff_compact<1>(cur, base, n, idx, vals);
    case 2: return diff_compact<2>(cur, base, n, idx, vals);
    case 4: return diff_compact<4>(cur, base, n, idx, vals);
    case 8: return diff_compact<8>(cur, base, n, idx, vals);
    default: return diff_compact<0>(cur, base, n, idx, vals, E);
  }
}

/// Bitmask of n positions from a sorted index list (bit j of byte j/8).
inline void mask_from_indices(const std::uint16_t* idx, std::int64_t k, std::int64_t n, std::byte* mask) {
  std::memset(mask, 0, static_cast<std::size_t>((n + 7) / 8));
  for (std::int64_t j = 0; j < k; ++j) mask[idx[j] >> 3] |= std::byte{static_cast<unsigned char>(1u << (idx[j] & 7))};
}

/// The index list of a bitmask of n positions; returns the count.
inline std::int64_t indices_from_mask(const std::byte* mask, std::int64_t n, std::uint16_t* idx) {
  std::int64_t k = 0;
  for (std::int64_t w = 0; w < (n + 7) / 8; ++w) {
    auto bits = static_cast<unsigned>(mask[w]);
    while (bits) {
      const int b = __builtin_ctz(bits);
      const std::int64_t j = w * 8 + b;
      if (j < n) idx[k++] = static_cast<std::uint16_t>(j);
      bits &= bits - 1;
    }
  }
  return k;
}

/// One chunk's body in mode `m` (body_bytes(m, n, k, E, esc) bytes at out):
/// the k changed indices idx and their values vals in the mode's form, or,
/// dense, the chunk `cur` itself (mode none writes nothing).
inline void write_chunk_body(ChunkMode m, std::int64_t n, std::int64_t k, std::int64_t E, std::int64_t esc, const std::uint16_t* idx,
                             const std::byte* vals, const std::byte* cur, std::byte* out) {
  if (m == ChunkMode::index) {
    std::memcpy(out, idx, static_cast<std::size_t>(2 * k));
    std::memcpy(out + 2 * k, vals, static_cast<std::size_t>(k * E));
  } else if (m == ChunkMode::mask) {
    mask_from_indices(idx, k, n, out);
    std::memcpy(out + (n + 7) / 8, vals, static_cast<std::size_t>(k * E));
  } else if (m == ChunkMode::gap) {
    gaps_from_indices(idx, k, out);
    std::memcpy(out + k + 2 * esc, vals, static_cast<std::size_t>(k * E));
  } else if (m == ChunkMode::dense) {
    std::memcpy(out, cur, static_cast<std::size_t>(n * E));
  }
}

/// One copy's side as a run of a stream: a one-sided box (side 0 is this
/// side's offset and strides; side 1 stays 0) whose elements in row-major
/// order are elements [first, first + count) of the stream.
struct StreamSegment : StridedBox {
  std::byte* base = nullptr;  ///< the buffer's data
  std::int64_t first = 0, count = 0;
  bool contiguous = false;  ///< row-major dense: element e is at src_offset + e

  /// Element offset (from base) of the copy's e-th element.
  std::int64_t at(std::int64_t e) const {
    const std::int64_t *ext = extents(), *st = strides(0);
    if (rank == 1) return src_offset + e * st[0];
    std::int64_t o = src_offset;
    for (int d = rank - 1; d >= 0; --d) {
      o += (e % ext[d]) * st[d];
      e /= ext[d];
    }
    return o;
  }
};

/// Packs (or unpacks) stream elements [first, first + n) through the segments.
template <bool Pack>
inline void stream_copy(std::size_t E, const std::vector<StreamSegment>& segs, std::size_t& cursor, std::int64_t first, std::int64_t n,
                        std::byte* stream) {
  while (cursor < segs.size() && segs[cursor].first + segs[cursor].count <= first) ++cursor;
  for (std::size_t s = cursor; s < segs.size() && n > 0; ++s) {
    const StreamSegment& g = segs[s];
    const std::int64_t in = first - g.first, m = std::min(n, g.count - in);
    const BoxSide side{g.base, g.src_offset, g.strides(0)};
    if constexpr (Pack)
      pack_range(E, g.rank, g.extents(), side, in, m, stream);
    else
      unpack_range(E, g.rank, g.extents(), side, in, m, stream);
    stream += m * static_cast<std::int64_t>(E);
    first += m;
    n -= m;
  }
}

/// Rows shorter than this are packed before the diff (a kernel call per few
/// elements costs more than copying them).
inline constexpr std::int64_t kMinInPlaceRow = 64;

/// Diff-and-compact (diff_compact_bytes's contract: positions from `first`,
/// `base` the n elements' contiguous shadow) of stream elements [first,
/// first + n) read in place from the segments, row by row: the column slices
/// of row-parallel weights need no pack into a scratch chunk first. Returns
/// -1, having read and written nothing, where a segment's rows are not of unit
/// stride and at least kMinInPlaceRow long (the caller packs).
inline std::int64_t diff_in_place(std::size_t E, const std::vector<StreamSegment>& segs, std::size_t cursor, std::int64_t first,
                                  std::int64_t n, std::byte* base, std::uint16_t* idx, std::byte* vals) {
  while (cursor < segs.size() && segs[cursor].first + segs[cursor].count <= first) ++cursor;
  std::size_t last = cursor;
  for (std::int64_t covered = 0; last < segs.size() && covered < n; ++last) {
    const StreamSegment& g = segs[last];
    const int in = g.rank - 1;
    if (!g.contiguous && (g.rank < 1 || g.strides(0)[in] != 1 || g.extents()[in] < kMinInPlaceRow)) return -1;
    covered = g.first + g.count - first;
  }
  const auto esz = static_cast<std::int64_t>(E);
  std::int64_t k = 0;
  auto row = [&](const std::byte* cur, std::int64_t at, std::int64_t len) {
    const std::int64_t kr = diff_compact_bytes(E, cur, base + at * esz, len, idx + k, vals + k * esz);
    for (std::int64_t j = k; j < k + kr; ++j) idx[j] = static_cast<std::uint16_t>(idx[j] + at);
    k += kr;
  };
  for (std::size_t s = cursor; s < last; ++s) {
    const StreamSegment& g = segs[s];
    const std::int64_t in = std::max<std::int64_t>(0, first - g.first), m = std::min(first + n, g.first + g.count) - g.first - in;
    std::int64_t at = g.first + in - first;  // the chunk position of the next element
    if (g.contiguous) {
      row(g.base + (g.src_offset + in) * esz, at, m);
      continue;
    }
    kernels::for_each_row(g.rank, g.extents(), g.strides(0), in, m, [&](std::int64_t offset, std::int64_t len) {
      row(g.base + (g.src_offset + offset) * esz, at, len);
      at += len;
    });
  }
  return k;
}

/// memcpy with non-temporal stores (SSE2) for a prime's shadow: it is not
/// read again before the next refit, so its lines need neither be read
/// before being written nor kept in cache. Measured on the 2-core test
/// machine: 469 MiB in 55-88 ms against memcpy's 114-136 ms.
inline void copy_streaming(std::byte* d, const std::byte* s, std::size_t n) {
#if defined(__SSE2__)
  const std::size_t head = std::min(n, (16 - reinterpret_cast<std::uintptr_t>(d) % 16) % 16);
  std::memcpy(d, s, head);
  d += head;
  s += head;
  n -= head;
  for (; n >= 64; n -= 64, d += 64, s += 64)
    for (int q = 0; q < 4; ++q) _mm_stream_si128(reinterpret_cast<__m128i*>(d + 16 * q), _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 16 * q)));
  _mm_sfence();
#endif
  std::memcpy(d, s, n);
}

/// Scatter: writes k values (E bytes each) to stream positions chunk_first +
/// idx[j] (sorted) through the segments: per segment one tight loop (a
/// contiguous one is base + position, no division).
template <std::size_t E>
inline void scatter(const std::vector<StreamSegment>& segs, std::size_t& cursor, std::int64_t chunk_first, const std::uint16_t* idx,
                    std::int64_t k, const std::byte* vals, std::size_t eb = E) {
  const auto esz = static_cast<std::int64_t>(E ? E : eb);
  for (std::int64_t j = 0; j < k;) {
    const std::int64_t p = chunk_first + idx[j];
    while (segs[cursor].first + segs[cursor].count <= p) ++cursor;
    const StreamSegment& g = segs[cursor];
    const std::int64_t end = g.first + g.count - chunk_first;  // positions of this chunk below it are in g
    if (g.contiguous) {
      std::byte* d = g.base + (g.src_offset - g.first + chunk_first) * esz;
      for (; j < k && idx[j] < end; ++j) std::memcpy(d + idx[j] * esz, vals + j * esz, static_cast<std::size_t>(esz));
    } else {
      for (; j < k && idx[j] < end; ++j)
        std::memcpy(g.base + g.at(chunk_first + idx[j] - g.first) * esz, vals + j * esz, static_cast<std::size_t>(esz));
    }
  }
}

inline void scatter_bytes(std::size_t E, const std::vector<StreamSegment>& segs, std::size_t& cursor, std::int64_t chunk_first,
                          const std::uint16_t* idx, std::int64_t k, const std::byte* vals) {
  switch (E) {
    case 1: return scatter<1>(segs, cursor, chunk_first, idx, k, vals);
    case 2: return scatter<2>(segs, cursor, chunk_first, idx, k, vals);
    case 4: return scatter<4>(segs, cursor, chunk_first, idx, k, vals);
    case 8: return scatter<8>(segs, cursor, chunk_first, idx, k, vals);
    default: return scatter<0>(segs, cursor, chunk_first, idx, k, vals, E);
  }
}

/// Payload header (then a u32 table entry per chunk, then the chunk bodies).
struct PayloadHeader {
  std::uint32_t magic = 0x44454c54;  // "DELT"
  std::uint32_t chunks = 0;
  std::uint64_t version = 0, base_version = 0;
  std::uint64_t bytes = 0;  ///< the whole payload, header included
  std::uint32_t crc = 0;    ///< CRC32C of the table and bodies (ExecutorOptions::checksum)
  std::uint32_t flags = 0;  ///< kOverflow: the slice outgrew the capacity left (no table, no bodies)
  static constexpr std::uint32_t kOverflow = 1;
};

/// A run of whole chunks of one stream of a pair: the unit that is diffed,
/// sent (a payload with its own header and table) and scattered.
struct Slice {
  std::size_t stream = 0;
  std::int64_t first = 0, elements = 0;  ///< in the stream
  std::int64_t chunks = 0;
  std::int64_t shadow_offset = 0;  ///< bytes into the pair's shadow
  std::size_t seg = 0;             ///< the stream's first segment that holds element `first`
};

/// One element size's stream of a peer pair.
struct Stream {
  std::size_t E = 0;
  std::int64_t elements = 0;
  std::vector<StreamSegment> segs;
  std::int64_t chunks() const { return (elements + kChunk - 1) / kChunk; }
};

/// Canonical order of a pair's copies (both ends sort the same set alike).
inline bool copy_before(const Copy& a, const Copy& b) {
  auto key = [](const Copy& c) {
    return std::tie(c.element_bytes, c.tensor, c.dst_buffer, c.dst_offset, c.src_buffer, c.src_offset, c.rank);
  };
  if (key(a) != key(b)) return key(a) < key(b);
  for (int side = -1; side < 2; ++side)  // the extents, then each side's strides
    for (int d = 0; d < a.rank; ++d) {
      const std::int64_t x = side < 0 ? a.extent(d) : a.stride(side, d), y = side < 0 ? b.extent(d) : b.stride(side, d);
      if (x != y) return x < y;
    }
  return false;
}

}  // namespace delta

/// What one delta refit did on this rank (beside its ExecutorStats).
struct DeltaStats {
  /// "delta" (payloads), "dense" (decided from the densities), "sampled"
  /// (dense, decided from the density sample before the full diff; the
  /// world fields are the sample's), "prime" (dense, shadows filled: the
  /// first refit, or a sample found the density low again, or a rank asked
  /// through invalidate_base()), "streak" (dense without diffing).
  std::string mode;
  std::int64_t compared = 0, changed = 0;              ///< this rank's shadowed send elements
  std::int64_t world_compared = 0, world_changed = 0;  ///< over all ranks (delta and dense modes)
  std::int64_t payload_bytes = 0;                      ///< encoded bytes this rank sent
  std::int64_t block_bytes_sent = 0;                   ///< what those payloads moved (whole blocks)
  std::int64_t chunks[delta::kChunkModes] = {};        ///< per ChunkMode, chunks this rank sent
  double diff_seconds = 0, scatter_seconds = 0;
  double changed_fraction() const { return world_compared ? static_cast<double>(world_changed) / static_cast<double>(world_compared) : 0; }
};

template <class T>
class DeltaExecutor {
  static_assert(check_transport<T>(), "reshard::DeltaExecutor<T>: T must model reshard::Transport (see transport.hpp)");

 public:
  DeltaExecutor() = default;
  DeltaExecutor(const DeltaExecutor&) = delete;
  DeltaExecutor& operator=(const DeltaExecutor&) = delete;
  ~DeltaExecutor() { release(); }

  /// Like Executor::setup (collective); drops every shadow, so the next run is dense.
  void setup(const Schedule& schedule, std::vector<const BoundBuffer*> src, std::vector<const BoundBuffer*> dst, T& transport,
             ExecutorOptions opt = {}, DeltaOptions dopt = {}, std::string local_error = {});
  /// One refit (every rank the same version, increasing). Throws after
  /// aborting the transport on any failure, and refuses later runs.
  ExecutorStats run(std::uint64_t version);

  void set_tensor_names(std::vector<std::string> names) { names_ = std::move(names); }
  /// The next refit of every rank is dense and primes the shadows again
  /// (e.g. inference wrote this rank's destination). Any rank may call it
  /// alone between refits: the request travels in the next refit's first
  /// all-gather, so the world agrees on it.
  void invalidate_base() { invalidate_requested_ = true; }
  const DeltaStats& last_delta() const { return last_; }
  bool base_valid() const { return base_valid_; }
  std::int64_t shadow_bytes() const { return static_cast<std::int64_t>(shadow_.size()); }
  std::int64_t staging_bytes() const { return static_cast<std::int64_t>(send_stage_.size() + recv_stage_.size()); }
  bool broken() const { return broken_; }
  std::int64_t planned_bytes_sent() const { return full_.planned_bytes_sent(); }
  std::int64_t planned_bytes_received() const { return full_.planned_bytes_received(); }
  std::int64_t planned_local_bytes() const { return full_.planned_local_bytes(); }
  std::vector<MissingPieces> missing() const;
  /// What the last run did to each destination buffer (BufferWrite): the
  /// dense rest and the payloads write disjoint pieces; a dense refit after
  /// the payloads rewrites every piece with the same version.
  BufferWrites buffer_writes() const;

 private:
  struct Pair {
    std::int64_t peer = -1;
    bool send = true;
    std::vector<delta::Stream> streams;
    std::vector<std::int32_t> tensors;
    std::int64_t bytes = 0, chunks = 0;
    std::int64_t capacity = 0;      ///< payload bytes prepared
    std::int64_t stage_offset = 0;  ///< in send_stage_ or recv_stage_
    std::int64_t shadow_offset = 0;
    std::int64_t payload = 0;       ///< this run's encoded bytes (sender)
    std::vector<delta::Slice> slices;
    std::vector<TransferOp> ops;    ///< the capacity's blocks (prepared)
    std::int64_t next_block = 0;    ///< where this run's next slice starts
    bool overflow = false, done = false;
    std::size_t decoded = 0;  ///< this run's slices scattered whole (receiver)
    bool scattered = false;   ///< this run scattered into the destination (receiver)
  };
  /// A receive posted in a run: a slice's first block (`head`) or the rest of its blocks.
  struct Pending {
    typename T::request r;
    std::size_t pair = 0, slice = 0;
    std::int64_t block = 0;
    bool head = true;
  };

  void release();
  [[noreturn]] void fail_run(const std::string& what);
  std::int64_t blocks_of(std::int64_t bytes) const { return (bytes + dopt_.block_bytes - 1) / dopt_.block_bytes; }
  std::uint64_t tag(std::int64_t block) const { return static_cast<std::uint64_t>(channel_) << 48 | static_cast<std::uint64_t>(block); }
  std::vector<TransferOp> block_ops(const Pair& p, std::int64_t bytes) const;
  std::int64_t slice_room(const Pair& p, std::size_t slice, std::int64_t block) const;
  template <class Poke>
  std::int64_t encode(Pair& p, std::size_t slice, std::uint64_t version, Poke&& poke);
  delta::PayloadHeader slice_header(const Pair& p, std::size_t slice, std::int64_t block, std::uint64_t version) const;
  void decode(Pair& p, std::size_t slice, std::int64_t block, std::uint64_t version);
  template <class Sent>
  void post_blocks(Pair& p, std::int64_t first, std::int64_t n, Sent&& sent);
  void on_received(Pending& done, std::vector<Pending>& pending, std::uint64_t version, ExecutorStats& st);
  void prime();
  template <class F>
  void for_each_sample_run(F&& f);
  void prime_samples();
  double sample();
  template <class F>
  void put_send_pairs(BlobWriter& w, F&& each) const;
  std::set<std::string> tensor_names(const Pair& p) const;  ///< the pair's tensors, by name where set_tensor_names gave one

  T* t_ = nullptr;
  ExecutorOptions opt_;
  DeltaOptions dopt_;
  std::int64_t me_ = -1;
  std::uint16_t channel_ = 0;
  Executor<T> full_;  ///< the whole schedule, dense
  Executor<T> rest_;  ///< local copies and the pairs without a shadow, dense, every refit
  std::vector<Pair> pairs_;
  std::vector<std::byte> shadow_, send_stage_, recv_stage_;
  RegisteredRegion<T> send_region_, recv_region_;
  std::vector<std::byte> chunk_;        ///< one packed chunk (sender) scratch
  std::vector<std::uint16_t> idx_;      ///< one chunk's changed positions
  std::vector<std::byte> vals_;         ///< one chunk's changed values
  std::vector<std::string> names_;
  bool ready_ = false, broken_ = false, base_valid_ = false, used_full_ = true;
  bool rest_ran_ = false, full_ran_ = false;  ///< this run (buffer_writes())
  std::vector<const std::byte*> dst_data_;    ///< by destination buffer id (nullptr: not on this rank)
  bool invalidate_requested_ = false;  ///< by this rank, for the next refit
  bool samples_current_ = false;       ///< the shadows' sampled positions hold the last refit's sources
  bool world_invalidated_ = false;     ///< some rank's request, learnt in this refit's all-gather
  int streak_left_ = 0;
  double measured_ = -1;  ///< the world's changed fraction the last diff over this base measured (-1: none yet)
  std::uint64_t base_version_ = 0;  ///< the version the shadows (and the targets) hold
  DeltaStats last_;
};

// ---------------------------------------------------------------------------

template <class T>
void DeltaExecutor<T>::release() {
  send_region_.reset();
  recv_region_.reset();
}

template <class T>
void DeltaExecutor<T>::fail_run(const std::string& what) {
  broken_ = true;
  t_->abort(what);
  throw TransportError(what);
}

template <class T>
void DeltaExecutor<T>::setup(const Schedule& schedule, std::vector<const BoundBuffer*> src, std::vector<const BoundBuffer*> dst, T& transport,
                             ExecutorOptions opt, DeltaOptions dopt, std::string local_error) {
  release();
  t_ = &transport;
  opt_ = opt;
  dopt_ = dopt;
  me_ = transport.rank();
  ready_ = broken_ = base_valid_ = invalidate_requested_ = samples_current_ = false;
  streak_left_ = 0;
  measured_ = -1;
  base_version_ = 0;
  pairs_.clear();
  dst_data_.clear();
  for (const BoundBuffer* b : dst) dst_data_.push_back(b ? b->data : nullptr);
  rest_ran_ = full_ran_ = false;
  shadow_.clear();
  send_stage_.clear();
  recv_stage_.clear();
  const Deadline deadline = Clock::now() + opt_.timeout;
  channel_ = static_cast<std::uint16_t>(opt_.channel | 0x4000u);

  // 1. This rank's pairs (canonical copy order) and local checks.
  std::map<std::pair<std::int64_t, bool>, std::vector<Copy>> by_pair;
  try {
    if (!local_error.empty()) throw Error(local_error);
    if (opt_.channel & 0x6000)
      fail("rank {}: delta refits use channel | 0x2000 and channel | 0x4000; channel {:#x} has those bits set", me_, opt_.channel);
    if (opt_.device) fail("rank {}: delta refits run on host memory; ExecutorOptions::device is set", me_);
    if (dopt_.block_bytes < 64) fail("rank {}: DeltaOptions::block_bytes {} is below 64", me_, dopt_.block_bytes);
    if (!(dopt_.capacity > 0) || dopt_.capacity > 2) fail("rank {}: DeltaOptions::capacity {} is outside (0, 2]", me_, dopt_.capacity);
    if (dopt_.slice_bytes < 1) fail("rank {}: DeltaOptions::slice_bytes {} is below 1", me_, dopt_.slice_bytes);
    if (dopt_.shadow_budget < 0) fail("rank {}: DeltaOptions::shadow_budget is negative", me_);
    if (dopt_.dense_streak < 0) fail("rank {}: DeltaOptions::dense_streak is negative", me_);
    if (!(dopt_.dense_above >= 0)) fail("rank {}: DeltaOptions::dense_above {} is not a fraction >= 0", me_, dopt_.dense_above);
    if (dopt_.sample_every < 0 || (dopt_.sample_every > 0 && (dopt_.sample_elements < 1 || dopt_.sample_elements > delta::kChunk)))
      fail("rank {}: DeltaOptions::sample_every {} / sample_elements {}: sample_every must be >= 0 and sample_elements in [1, {}]", me_,
           dopt_.sample_every, dopt_.sample_elements, delta::kChunk);
    for (const auto* v : {&src, &dst})
      for (const BoundBuffer* b : *v)
        if (b && b->memory != MemoryKind::host) fail("rank {}: delta refits need host buffers, but '{}' is device memory", me_, b->name);
    for (const Copy& c : schedule.copies) {
      if (c.is_local() || (c.src_rank != me_ && c.dst_rank != me_)) continue;
      const bool send = c.src_rank == me_;
      by_pair[{send ? c.dst_rank : c.src_rank, send}].push_back(c);
    }
  } catch (const std::exception& e) {
    local_error = e.what();
    by_pair.clear();
  }
  std::int64_t budget = dopt_.shadow_budget;
  std::vector<exec_detail::Part> parts;
  for (auto& [key, copies] : by_pair) {
    std::sort(copies.begin(), copies.end(), delta::copy_before);
    Pair p;
    p.peer = key.first;
    p.send = key.second;
    std::map<std::size_t, delta::Stream> streams;
    for (const Copy& c : copies) {
      const auto E = static_cast<std::size_t>(c.element_bytes);
      delta::Stream& s = streams[E];
      s.E = E;
      delta::StreamSegment g;
      const BoundBuffer* b = p.send ? (static_cast<std::size_t>(c.src_buffer) < src.size() ? src[static_cast<std::size_t>(c.src_buffer)] : nullptr)
                                    : (static_cast<std::size_t>(c.dst_buffer) < dst.size() ? dst[static_cast<std::size_t>(c.dst_buffer)] : nullptr);
      if (!b && local_error.empty())
        local_error = fmt::format("rank {}: delta refit: copy of tensor {} needs a {} buffer #{} this rank has not bound", me_,
                                  c.tensor, p.send ? "source" : "destination", p.send ? c.src_buffer : c.dst_buffer);
      g.base = b ? b->data : nullptr;
      const int side = p.send ? 0 : 1;
      StridedBox box;  // this side's box, in the buffer's dense coordinates
      if (c.rank > 0) {
        box.assign_side(c, side);
      } else {  // a rank-0 copy is one element
        const std::int64_t one = 1, none = 0;
        box.assign(1, &one, &one, &none);
        box.src_offset = c.offset(side);
      }
      // Where the buffer is a strided view, the box as the executor sees it:
      // runs that each map to one strided box of the view (one run when dense).
      parts.clear();
      if (b) {
        const exec_detail::ViewMap map = exec_detail::ViewMap::of(*b);
        const exec_detail::ViewMap* maps[1] = {&map};
        exec_detail::split_box(box, 1, maps, 0, parts);
      }
      for (const exec_detail::Part& q : parts) {
        g.assign(q.rank, q.extents(), q.strides(0), q.strides(1));
        g.src_offset = q.src_offset;
        g.first = s.elements + q.first;
        g.count = q.count;
        std::array<std::int64_t, kMaxBoxRank> dense{};
        kernels::dense_strides(g.rank, g.extents(), dense.data());
        g.contiguous = true;
        for (int d = 0; d < g.rank; ++d)
          g.contiguous &= g.extent(d) == 1 || g.src_stride(d) == dense[static_cast<std::size_t>(d)];
        s.segs.push_back(g);
      }
      s.elements += c.elements();
      p.bytes += c.bytes();
      p.tensors.push_back(c.tensor);
    }
    std::int64_t shadow_at = 0;
    for (auto& [E, s] : streams) {
      p.chunks += s.chunks();
      // Slices of whole chunks (both ends cut alike), each with the first segment it reads.
      const std::int64_t per = std::max<std::int64_t>(1, dopt_.slice_bytes / (static_cast<std::int64_t>(E) * delta::kChunk));
      std::size_t seg = 0;
      for (std::int64_t c = 0; c < s.chunks(); c += per) {
        delta::Slice sl;
        sl.stream = p.streams.size();
        sl.first = c * delta::kChunk;
        sl.elements = std::min(per * delta::kChunk, s.elements - sl.first);
        sl.chunks = std::min(per, s.chunks() - c);
        sl.shadow_offset = shadow_at + sl.first * static_cast<std::int64_t>(E);
        while (seg < s.segs.size() && s.segs[seg].first + s.segs[seg].count <= sl.first) ++seg;
        sl.seg = seg;
        p.slices.push_back(sl);
      }
      shadow_at += s.elements * static_cast<std::int64_t>(E);
      p.streams.push_back(std::move(s));
    }
    // The sender decides which pairs get a shadow, in peer order, within the budget.
    p.done = p.send && p.bytes <= budget;  // (reused below as "shadowed" until the exchange)
    if (p.done) budget -= p.bytes;
    pairs_.push_back(std::move(p));
  }

  // 2. Exchange: status, and per send pair (receiver, bytes, shadowed), so
  //    the receivers know which pairs come as payloads and both ends check
  //    they see the same pair.
  BlobWriter w;
  w.put<std::uint8_t>(local_error.empty() ? 1 : 0);
  w.put_string(local_error);
  put_send_pairs(w, [&](const Pair& p) {
    w.put(p.bytes);
    w.put<std::uint8_t>(p.done ? 1 : 0);
  });
  std::vector<std::vector<std::byte>> blobs = transport.all_gather(w.buf, deadline);
  const auto world = transport.world_ranks();
  std::string error = local_error;
  std::set<std::pair<std::int64_t, std::int64_t>> shadowed;  // (src rank, dst rank)
  for (std::size_t r = 0; r < blobs.size() && r < world.size(); ++r) {
    BlobReader rd(blobs[r], world[r]);
    const bool ok = rd.get<std::uint8_t>() != 0;
    const std::string msg = rd.get_string();
    if (!ok) {
      if (error.empty()) error = world[r] == me_ ? msg : fmt::format("rank {}: delta setup failed on rank {}: {}", me_, world[r], msg);
      continue;
    }
    const auto n = rd.get<std::uint32_t>();
    for (std::uint32_t i = 0; i < n; ++i) {
      const auto peer = rd.get<std::int64_t>();
      const auto bytes = rd.get<std::int64_t>();
      const bool sh = rd.get<std::uint8_t>() != 0;
      if (peer != me_) continue;
      auto it = std::find_if(pairs_.begin(), pairs_.end(), [&](const Pair& p) { return !p.send && p.peer == world[r]; });
      if ((it == pairs_.end() || it->bytes != bytes) && error.empty())
        error = fmt::format("rank {}: delta setup: rank {} sends this rank {} bytes but this rank's schedule receives {} from it", me_,
                            world[r], bytes, it == pairs_.end() ? 0 : it->bytes);
      if (sh) shadowed.insert({world[r], me_});
    }
  }
  for (Pair& p : pairs_)
    if (p.send && p.done) shadowed.insert({me_, p.peer});

  // 3. The two dense executors (collective; an error above fails both on every rank).
  Schedule rest = schedule;
  rest.copies.clear();
  for (const Copy& c : schedule.copies)
    if (!shadowed.count({c.src_rank, c.dst_rank})) rest.copies.push_back(c);
  full_.set_tensor_names(names_);
  rest_.set_tensor_names(names_);
  full_.setup(schedule, src, dst, transport, opt_, error);
  ExecutorOptions ro = opt_;
  ro.channel = static_cast<std::uint16_t>(opt_.channel | 0x2000u);
  rest_.setup(rest, src, dst, transport, ro, error);

  // 4. Payload staging, shadows and the block ops (prepared once).
  std::erase_if(pairs_, [&](const Pair& p) { return !shadowed.count(p.send ? std::pair{me_, p.peer} : std::pair{p.peer, me_}); });
  std::int64_t send_bytes = 0, recv_bytes = 0, shadow_bytes = 0, most_chunk = 0;
  for (Pair& p : pairs_) {
    p.done = false;
    // Beside the encoded bytes: per slice a header and, at most, the rest of
    // its last block; and the block kept free for the next slice's header.
    const auto cap = static_cast<std::int64_t>(static_cast<double>(p.bytes) * dopt_.capacity);
    const auto slices = static_cast<std::int64_t>(p.slices.size());
    p.capacity = (static_cast<std::int64_t>(sizeof(delta::PayloadHeader)) + dopt_.block_bytes) * slices + 4 * p.chunks + cap + dopt_.block_bytes;
    std::int64_t& at = p.send ? send_bytes : recv_bytes;
    p.stage_offset = at;
    at += p.capacity;
    if (p.send) {
      p.shadow_offset = shadow_bytes;
      shadow_bytes += p.bytes;
    }
    for (const auto& s : p.streams) most_chunk = std::max<std::int64_t>(most_chunk, static_cast<std::int64_t>(s.E) * delta::kChunk);
  }
  shadow_.assign(static_cast<std::size_t>(shadow_bytes), std::byte{0});
  send_stage_.assign(static_cast<std::size_t>(send_bytes), std::byte{0});
  recv_stage_.assign(static_cast<std::size_t>(recv_bytes), std::byte{0});
  chunk_.assign(static_cast<std::size_t>(most_chunk), std::byte{0});
  vals_.assign(static_cast<std::size_t>(most_chunk), std::byte{0});
  idx_.assign(static_cast<std::size_t>(delta::kChunk), 0);
  if (send_bytes) send_region_ = RegisteredRegion<T>(transport, send_stage_.data(), send_stage_.size(), MemoryKind::host);
  if (recv_bytes) recv_region_ = RegisteredRegion<T>(transport, recv_stage_.data(), recv_stage_.size(), MemoryKind::host);
  std::vector<TransferOp> ops;
  for (Pair& p : pairs_) {
    p.ops = block_ops(p, p.capacity);
    ops.insert(ops.end(), p.ops.begin(), p.ops.end());
  }
  transport.prepare(ops, Clock::now() + opt_.timeout);
  used_full_ = true;
  ready_ = true;
}

template <class T>
std::vector<TransferOp> DeltaExecutor<T>::block_ops(const Pair& p, std::int64_t bytes) const {
  std::vector<TransferOp> ops;
  const std::int64_t n = blocks_of(bytes);
  for (std::int64_t b = 0; b < n; ++b) {
    TransferOp o;
    o.kind = p.send ? OpKind::send : OpKind::recv;
    o.peer = p.peer;
    o.tag = tag(b);
    o.region = (p.send ? send_region_ : recv_region_).handle();
    o.offset = static_cast<std::uint64_t>(p.stage_offset + b * dopt_.block_bytes);
    o.bytes = static_cast<std::uint64_t>(std::min(dopt_.block_bytes, p.capacity - b * dopt_.block_bytes));
    ops.push_back(o);
  }
  return ops;
}

template <class T>
void DeltaExecutor<T>::prime() {
  // Shadows = what the dense refit delivers: the sources, packed (run
  // beside that refit, on a helper thread; it touches only the shadows).
  for (Pair& p : pairs_) {
    if (!p.send) continue;
    std::byte* out = shadow_.data() + p.shadow_offset;
    for (const auto& s : p.streams) {
      const auto E = static_cast<std::int64_t>(s.E);
      std::size_t cursor = 0;
      for (const auto& g : s.segs) {
        if (g.contiguous)
          delta::copy_streaming(out + g.first * E, g.base + g.src_offset * E, static_cast<std::size_t>(g.count * E));
        else
          delta::stream_copy<true>(s.E, s.segs, cursor, g.first, g.count, out + g.first * E);
      }
      out += s.elements * E;
    }
  }
}

template <class T>
template <class F>
void DeltaExecutor<T>::put_send_pairs(BlobWriter& w, F&& each) const {
  std::uint32_t n = 0;
  for (const Pair& p : pairs_) n += p.send ? 1 : 0;
  w.put(n);
  for (const Pair& p : pairs_)
    if (p.send) {
      w.put(p.peer);
      each(p);
    }
}

template <class T>
template <class F>
void DeltaExecutor<T>::for_each_sample_run(F&& f) {
  // The head (sample_elements) of every sample_every-th chunk of each sent
  // stream: f(stream, cursor, first element, elements, its shadow).
  for (const Pair& p : pairs_) {
    if (!p.send) continue;
    std::byte* shadow = shadow_.data() + p.shadow_offset;
    for (const auto& s : p.streams) {
      std::size_t cursor = 0;
      const auto E = static_cast<std::int64_t>(s.E);
      for (std::int64_t c0 = 0; c0 < s.elements; c0 += delta::kChunk * dopt_.sample_every)
        f(s, cursor, c0, std::min(dopt_.sample_elements, s.elements - c0), shadow + c0 * E);
      shadow += s.elements * E;
    }
  }
}

template <class T>
void DeltaExecutor<T>::prime_samples() {
  for_each_sample_run([](const delta::Stream& s, std::size_t& cursor, std::int64_t c0, std::int64_t n, std::byte* shadow) {
    delta::stream_copy<true>(s.E, s.segs, cursor, c0, n, shadow);
  });
}

template <class T>
double DeltaExecutor<T>::sample() {
  // Compare (pack where needed) the sampled positions with the shadow:
  // about 1/256 of the elements by default, read only.
  std::int64_t compared = 0, changed = 0;
  for_each_sample_run([&](const delta::Stream& s, std::size_t& cursor, std::int64_t c0, std::int64_t n, const std::byte* shadow) {
    delta::stream_copy<true>(s.E, s.segs, cursor, c0, n, chunk_.data());
    changed += delta::count_changed_bytes(s.E, chunk_.data(), shadow, n);
    compared += n;
  });
  BlobWriter w;
  w.put(compared);
  w.put(changed);
  w.put<std::uint8_t>(invalidate_requested_ ? 1 : 0);
  std::vector<std::vector<std::byte>> blobs;
  try {
    blobs = t_->all_gather(w.buf, Clock::now() + opt_.timeout);
  } catch (...) {
    broken_ = true;
    throw;
  }
  const auto world = t_->world_ranks();
  compared = changed = 0;
  for (std::size_t r = 0; r < blobs.size() && r < world.size(); ++r) {
    BlobReader rd(blobs[r], world[r]);
    compared += rd.get<std::int64_t>();
    changed += rd.get<std::int64_t>();
    world_invalidated_ |= rd.get<std::uint8_t>() != 0;
  }
  last_.world_compared = compared;
  last_.world_changed = changed;
  return compared ? static_cast<double>(changed) / static_cast<double>(compared) : 0;
}

template <class T>
std::int64_t DeltaExecutor<T>::slice_room(const Pair& p, std::size_t slice, std::int64_t block) const {
  // A slice before the last leaves one whole block after its own for the
  // next slice's header, so that a later slice can always say it overflowed.
  const std::int64_t bb = dopt_.block_bytes;
  return slice + 1 < p.slices.size() ? (p.capacity / bb - block - 1) * bb : p.capacity - block * bb;
}

template <class T>
template <class Poke>
std::int64_t DeltaExecutor<T>::encode(Pair& p, std::size_t slice, std::uint64_t version, Poke&& poke) {
  using namespace delta;
  const Slice& sl = p.slices[slice];
  const Stream& s = p.streams[sl.stream];
  const auto E = static_cast<std::int64_t>(s.E);
  // After an overflow the pair sends nothing more, but every slice is still
  // diffed: the shadow must become this version (the refit then goes dense).
  const bool sending = !p.overflow;
  std::byte* const start = send_stage_.data() + p.stage_offset + p.next_block * dopt_.block_bytes;
  std::byte* const end = start + std::max<std::int64_t>(0, slice_room(p, slice, p.next_block));
  std::byte* table = start + sizeof(PayloadHeader);
  std::byte* body = table + 4 * sl.chunks;
  bool fits = sending && body <= end;
  std::byte* shadow = shadow_.data() + p.shadow_offset + sl.shadow_offset;
  std::size_t cursor = sl.seg;
  for (std::int64_t c0 = sl.first; c0 < sl.first + sl.elements; c0 += kChunk) {
    const std::int64_t n = std::min(kChunk, s.elements - c0);
    // Compare in place: one contiguous segment holds the whole chunk, or its
    // segments' rows are long enough; else pack the chunk first.
    while (cursor < s.segs.size() && s.segs[cursor].first + s.segs[cursor].count <= c0) ++cursor;
    const StreamSegment* g = cursor < s.segs.size() ? &s.segs[cursor] : nullptr;
    const bool direct = g && g->contiguous && g->first + g->count >= c0 + n;
    std::int64_t k = direct ? -1 : diff_in_place(s.E, s.segs, cursor, c0, n, shadow, idx_.data(), vals_.data());
    // The chunk's values, for a dense body: after the diff the shadow holds them.
    const std::byte* cur = direct ? g->base + (g->src_offset + c0 - g->first) * E : k >= 0 ? shadow : chunk_.data();
    if (k < 0) {
      if (!direct) stream_copy<true>(s.E, s.segs, cursor, c0, n, chunk_.data());
      k = diff_compact_bytes(s.E, cur, shadow, n, idx_.data(), vals_.data());
    }
    shadow += n * E;
    last_.compared += n;
    last_.changed += k;
    // A transport that progresses only inside its calls (UCX) would leave
    // the wire idle during a slice's diff once its socket buffers drained.
    if ((c0 / kChunk) % 4 == 3) poke();
    if (!fits) continue;
    const std::int64_t esc = gap_escapes(idx_.data(), k);
    const ChunkMode m = best_mode(n, k, E, esc);
    const std::int64_t need = body_bytes(m, n, k, E, esc);
    if (body + need > end) {
      fits = false;
      continue;
    }
    ++last_.chunks[static_cast<int>(m)];
    const std::uint32_t entry = table_entry(m, k);
    std::memcpy(table, &entry, 4);
    table += 4;
    write_chunk_body(m, n, k, E, esc, idx_.data(), vals_.data(), cur, body);
    body += need;
  }
  if (!sending) return 0;
  PayloadHeader h;
  h.chunks = static_cast<std::uint32_t>(sl.chunks);
  h.version = version;
  h.base_version = base_version_;
  if (!fits) {
    p.overflow = true;
    h.flags = PayloadHeader::kOverflow;
    body = start + sizeof h;
  }
  h.bytes = static_cast<std::uint64_t>(body - start);
  if (opt_.checksum && fits) h.crc = crc32c(start + sizeof h, static_cast<std::size_t>(body - start) - sizeof h);
  std::memcpy(start, &h, sizeof h);
  p.payload += body - start;
  return blocks_of(body - start);
}

template <class T>
delta::PayloadHeader DeltaExecutor<T>::slice_header(const Pair& p, std::size_t slice, std::int64_t block, std::uint64_t version) const {
  using namespace delta;
  PayloadHeader h;
  std::memcpy(&h, recv_stage_.data() + p.stage_offset + block * dopt_.block_bytes, sizeof h);
  auto bad = [&](const std::string& why) {
    throw IntegrityError(fmt::format("rank {}: delta refit version {}: the payload from rank {} (tensors {}), slice {} of {}, {}", me_, version,
                                     p.peer, fmt::join(tensor_names(p), ", "), slice + 1, p.slices.size(), why));
  };
  const auto chunks = static_cast<std::uint64_t>(p.slices[slice].chunks);
  const auto room = static_cast<std::uint64_t>(std::max<std::int64_t>(0, slice_room(p, slice, block)));
  if (h.magic != PayloadHeader{}.magic) bad("has no payload header");
  if (h.version != version) bad(fmt::format("is of version {}", h.version));
  if (h.base_version != base_version_)
    bad(fmt::format("is a delta over version {}, but this rank's destination holds version {}", h.base_version, base_version_));
  if (h.flags & ~PayloadHeader::kOverflow) bad(fmt::format("has unknown flags {:#x}", h.flags));
  const std::uint64_t least = sizeof h + (h.flags ? 0 : 4 * chunks);
  if (h.chunks != chunks || h.bytes > std::max<std::uint64_t>(room, sizeof h) || h.bytes < least || (h.flags && h.bytes != sizeof h))
    bad(fmt::format("has {} chunks and {} bytes; expected {} chunks within {} bytes", h.chunks, h.bytes, chunks, room));
  return h;
}

template <class T>
void DeltaExecutor<T>::decode(Pair& p, std::size_t slice, std::int64_t block, std::uint64_t version) {
  using namespace delta;
  const Slice& sl = p.slices[slice];
  const Stream& s = p.streams[sl.stream];
  const auto E = static_cast<std::int64_t>(s.E);
  const std::byte* const start = recv_stage_.data() + p.stage_offset + block * dopt_.block_bytes;
  const PayloadHeader h = slice_header(p, slice, block, version);  // (read again: the head's checks hold for these bytes)
  auto bad = [&](const std::string& why) {
    throw IntegrityError(fmt::format("rank {}: delta refit version {}: the payload from rank {} (tensors {}), slice {} of {}, {}", me_, version,
                                     p.peer, fmt::join(tensor_names(p), ", "), slice + 1, p.slices.size(), why));
  };
  if (opt_.checksum && crc32c(start + sizeof h, h.bytes - sizeof h) != h.crc) bad("fails its CRC32C");
  const std::byte* table = start + sizeof h;
  const std::byte* body = table + 4 * sl.chunks;
  const std::byte* const end = start + h.bytes;
  std::size_t cursor = sl.seg;
  p.scattered = true;  // from here on the destination holds some of this version
  for (std::int64_t c0 = sl.first; c0 < sl.first + sl.elements; c0 += kChunk) {
    const std::int64_t n = std::min(kChunk, s.elements - c0);
    std::uint32_t entry;
    std::memcpy(&entry, table, 4);
    table += 4;
    const auto m = static_cast<ChunkMode>(entry >> 24);
    const std::int64_t k = entry & 0xFFFFFF;
    if (entry >> 24 >= kChunkModes || k > n || (m == ChunkMode::same) != (k == 0)) bad(fmt::format("has a bad chunk entry {:#x}", entry));
    std::int64_t esc = 0;
    if (m == ChunkMode::gap) {
      const std::int64_t g = indices_from_gaps(body, k, n, end - body, idx_.data());
      if (g < 0) bad("has a malformed gap list");
      esc = (g - k) / 2;
    }
    const std::int64_t need = body_bytes(m, n, k, E, esc);
    if (body + need > end) bad("is shorter than its chunk table says");
    if (m == ChunkMode::index) {
      std::memcpy(idx_.data(), body, static_cast<std::size_t>(2 * k));
      scatter_bytes(s.E, s.segs, cursor, c0, idx_.data(), k, body + 2 * k);
    } else if (m == ChunkMode::gap) {
      scatter_bytes(s.E, s.segs, cursor, c0, idx_.data(), k, body + k + 2 * esc);
    } else if (m == ChunkMode::mask) {
      if (indices_from_mask(body, n, idx_.data()) != k) bad("has a bitmask whose count is not its table's");
      scatter_bytes(s.E, s.segs, cursor, c0, idx_.data(), k, body + (n + 7) / 8);
    } else if (m == ChunkMode::dense) {
      stream_copy<false>(s.E, s.segs, cursor, c0, n, const_cast<std::byte*>(body));
    }
    body += need;
  }
  ++p.decoded;
  if (slice + 1 == p.slices.size()) p.done = true;
}

template <class T>
template <class Sent>
void DeltaExecutor<T>::post_blocks(Pair& p, std::int64_t first, std::int64_t n, Sent&& sent) {
  if (n <= 0) return;
  const std::span<const TransferOp> ops(p.ops.data() + first, static_cast<std::size_t>(n));
  sent(t_->post(ops), ops);
}

template <class T>
void DeltaExecutor<T>::on_received(Pending& done, std::vector<Pending>& pending, std::uint64_t version, ExecutorStats& st) {
  // A slice's first block tells its size: post the rest of its blocks and
  // the next slice's first block, then scatter what is complete.
  Pair& p = pairs_[done.pair];
  auto keep = [&](bool head, std::size_t slice, std::int64_t block) {
    return [&, head, slice, block](typename T::request r, std::span<const TransferOp> ops) {
      for (const auto& o : ops) st.bytes_received += static_cast<std::int64_t>(o.bytes);
      st.messages_received += static_cast<std::int64_t>(ops.size());
      pending.push_back(Pending{std::move(r), done.pair, slice, block, head});
    };
  };
  if (done.head) {
    const delta::PayloadHeader h = slice_header(p, done.slice, done.block, version);
    if (h.flags & delta::PayloadHeader::kOverflow) {
      p.done = true;  // the sender sends nothing more; the refit goes dense
      return;
    }
    const std::int64_t used = blocks_of(static_cast<std::int64_t>(h.bytes));
    if (done.slice + 1 < p.slices.size()) post_blocks(p, done.block + used, 1, keep(true, done.slice + 1, done.block + used));
    if (used > 1) {
      post_blocks(p, done.block + 1, used - 1, keep(false, done.slice, done.block));
      return;
    }
  }
  const auto s0 = Clock::now();
  decode(p, done.slice, done.block, version);
  last_.scatter_seconds += std::chrono::duration<double>(Clock::now() - s0).count();
}

template <class T>
ExecutorStats DeltaExecutor<T>::run(std::uint64_t version) {
  if (!ready_) fail("rank {}: DeltaExecutor::run before setup()", me_);
  if (broken_) fail("rank {}: DeltaExecutor::run: an earlier run failed; set up again", me_);
  last_ = DeltaStats{};
  world_invalidated_ = false;
  rest_ran_ = full_ran_ = false;
  for (Pair& p : pairs_) {
    p.decoded = 0;
    p.scattered = false;
  }
  const auto t0 = Clock::now();
  const Deadline deadline = t0 + opt_.timeout;
  // Prime::full: the sources are also packed into the shadows, on a helper
  // thread while the dense refit moves them (the sources are read-only
  // during a refit, and the refit mostly waits on the wire), so a prime
  // costs about a dense refit instead of a dense refit plus a copy.
  // Prime::samples: only the positions sample() reads (about 1/256).
  enum class Prime { none, samples, full };
  auto dense = [&](const char* mode, Prime prime_kind = Prime::none) {
    used_full_ = true;
    last_.mode = mode;
    invalidate_requested_ = false;  // a dense refit writes every destination whole
    std::thread packer;
    std::exception_ptr packer_error;
    try {
      if (prime_kind == Prime::samples) prime_samples();
    } catch (const std::exception& e) {
      fail_run(fmt::format("rank {}: delta refit version {}: priming the sampled shadows failed: {}", me_, version, e.what()));
    }
    if (prime_kind == Prime::full && std::any_of(pairs_.begin(), pairs_.end(), [](const Pair& p) { return p.send; }))
      packer = std::thread([this, &packer_error] {
        try {
          prime();
        } catch (...) {
          packer_error = std::current_exception();
        }
      });
    ExecutorStats st;
    full_ran_ = true;
    try {
      st = full_.run(version);
    } catch (...) {
      if (packer.joinable()) packer.join();
      broken_ = true;
      throw;
    }
    if (packer.joinable()) packer.join();
    if (packer_error) {
      std::string why = "an unknown exception";
      try {
        std::rethrow_exception(packer_error);
      } catch (const std::exception& e) {
        why = e.what();
      } catch (...) {
      }
      fail_run(fmt::format("rank {}: delta refit version {}: priming the shadows failed: {}", me_, version, why));
    }
    st.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    return st;
  };
  auto primed = [&](ExecutorStats st, double measured) {
    base_valid_ = samples_current_ = true;
    base_version_ = version;
    measured_ = measured;
    return st;
  };
  const bool sampling = dopt_.sample_every > 0;
  // Every rank takes the branches below alike: base_valid_, streak_left_
  // and samples_current_ change only on the world's decisions.
  if (!base_valid_ && streak_left_ > 0) {
    // Dense without diffing. With sampling, the streak's last refit brings
    // the sampled positions of the shadows to this version, so that the
    // next refit measures the density without a full prime.
    --streak_left_;
    samples_current_ = sampling && streak_left_ == 0;
    return dense("streak", samples_current_ ? Prime::samples : Prime::none);
  }
  // The first refit after setup(), or a streak's end where nothing samples.
  if (!base_valid_ && (!samples_current_ || !sampling)) return primed(dense("prime", Prime::full), -1);

  // Sample first while no diff over this base has measured a density at or
  // below dense_above (or there is no full base, only sampled positions),
  // so that a refit that goes dense pays neither the full diff nor a prime.
  if (sampling && (!base_valid_ || !(measured_ >= 0 && measured_ <= dopt_.dense_above))) {
    const auto d0 = Clock::now();
    const double f = sample();
    last_.diff_seconds = std::chrono::duration<double>(Clock::now() - d0).count();
    // A full prime when the density fell to where deltas pay (from the next
    // refit on), or when a rank's destination was written by someone else.
    if (base_valid_ ? world_invalidated_ : f <= dopt_.dense_above) return primed(dense("prime", Prime::full), world_invalidated_ ? -1 : f);
    if (f > dopt_.dense_above) {
      // Dense, and no shadow upkeep beyond the sampled positions: the
      // streak's last refit (or, without a streak, this one) keeps those.
      const bool streak = dopt_.dense_streak > 0;
      base_valid_ = false;
      streak_left_ = dopt_.dense_streak;
      samples_current_ = !streak;
      measured_ = f;
      return dense("sampled", streak ? Prime::none : Prime::samples);
    }
  }

  // Delta, speculatively: the dense rest (local copies, pairs without a
  // shadow), then each slice diffed and posted at once while the receivers
  // scatter the slices that arrived; the world's decision comes after.
  ExecutorStats st;
  rest_ran_ = true;
  try {
    st = rest_.run(version);
  } catch (...) {
    broken_ = true;
    throw;
  }
  using request = typename T::request;
  std::vector<request> sends;
  std::vector<Pending> pending;
  std::vector<request*> rs;
  // Handles the receives that completed (any when `block`, else only those
  // already done), which may post further receives.
  auto service = [&](bool block) {
    while (!pending.empty()) {
      std::size_t j = pending.size();
      if (block) {
        rs.clear();
        for (auto& q : pending) rs.push_back(&q.r);
        j = t_->wait_any(std::span<request* const>(rs.data(), rs.size()), deadline);
      } else {
        for (std::size_t i = 0; i < pending.size() && j == pending.size(); ++i)
          if (t_->test(pending[i].r)) j = i;
        if (j == pending.size()) return;
      }
      Pending d = std::move(pending[j]);
      pending.erase(pending.begin() + static_cast<std::ptrdiff_t>(j));
      on_received(d, pending, version, st);
    }
  };
  try {
    std::size_t most = 0;
    for (Pair& p : pairs_) {
      p.done = p.send;
      p.overflow = false;
      p.payload = 0;
      p.next_block = 0;
      most = std::max(most, p.slices.size());
    }
    for (std::size_t i = 0; i < pairs_.size(); ++i)
      if (!pairs_[i].send)
        post_blocks(pairs_[i], 0, 1, [&](request r, std::span<const TransferOp> ops) {
          st.bytes_received += static_cast<std::int64_t>(ops[0].bytes);
          ++st.messages_received;
          pending.push_back(Pending{std::move(r), i, 0, 0, true});
        });
    // Slice by slice, round robin over the receivers, so that each has its
    // first slice after one slice's diff.
    for (std::size_t k = 0; k < most; ++k) {
      for (Pair& p : pairs_) {
        if (!p.send || k >= p.slices.size()) continue;
        const auto d0 = Clock::now();
        const std::int64_t used = encode(p, k, version, [&] {
          if (!sends.empty()) t_->test(sends.back());
        });
        last_.diff_seconds += std::chrono::duration<double>(Clock::now() - d0).count();
        post_blocks(p, p.next_block, used, [&](request r, std::span<const TransferOp> ops) {
          for (const auto& o : ops) st.bytes_sent += static_cast<std::int64_t>(o.bytes);
          for (const auto& o : ops) last_.block_bytes_sent += static_cast<std::int64_t>(o.bytes);
          st.messages_sent += static_cast<std::int64_t>(ops.size());
          sends.push_back(std::move(r));
        });
        p.next_block += used;
      }
      // Keep the wire moving (a transport may progress only inside its calls).
      if (pending.empty() && !sends.empty())
        t_->test(sends.back());
      else
        service(false);
    }
    service(true);
    for (auto& r : sends) t_->wait(r, deadline);
    for (const Pair& p : pairs_)
      if (p.send) last_.payload_bytes += p.payload;
  } catch (const IntegrityError& e) {
    sends.clear();
    pending.clear();
    broken_ = true;
    t_->abort(e.what());
    throw;
  } catch (const std::exception& e) {
    sends.clear();
    pending.clear();
    fail_run(fmt::format("rank {}: delta refit version {}: {}", me_, version, e.what()));
  }

  // One all-gather: every sender's counts and overflow and every rank's
  // invalidation request, so that every rank takes the same decision.
  bool overflow = false;
  for (const Pair& p : pairs_) overflow |= p.send && p.overflow;
  BlobWriter w;
  w.put(static_cast<std::int64_t>(last_.compared));
  w.put(static_cast<std::int64_t>(last_.changed));
  w.put<std::uint8_t>(overflow ? 1 : 0);
  w.put<std::uint8_t>(invalidate_requested_ ? 1 : 0);
  std::vector<std::vector<std::byte>> blobs;
  try {
    blobs = t_->all_gather(w.buf, deadline);
  } catch (...) {
    broken_ = true;
    throw;
  }
  const auto world = t_->world_ranks();
  last_.world_compared = last_.world_changed = 0;  // (the sample's, if any, are superseded)
  for (std::size_t r = 0; r < blobs.size() && r < world.size(); ++r) {
    BlobReader rd(blobs[r], world[r]);
    last_.world_compared += rd.get<std::int64_t>();
    last_.world_changed += rd.get<std::int64_t>();
    overflow |= rd.get<std::uint8_t>() != 0;
    world_invalidated_ |= rd.get<std::uint8_t>() != 0;
  }
  const double f = last_.changed_fraction();
  measured_ = f;
  if (overflow || world_invalidated_ || f > dopt_.dense_above) {
    // The dense refit rewrites every destination element whole, over
    // whatever slices were scattered. (An invalidated base needs no prime
    // here: the diff already brought the shadows to this version.)
    ExecutorStats ds = dense("dense");
    base_version_ = version;  // the shadows were brought to this version by the diff
    if (f > dopt_.dense_above && dopt_.dense_streak > 0) {
      base_valid_ = false;  // no shadow upkeep for a while (the streak's last refit keeps the sampled positions)
      streak_left_ = dopt_.dense_streak;
    }
    ds.bytes_sent += st.bytes_sent;
    ds.bytes_received += st.bytes_received;
    ds.messages_sent += st.messages_sent;
    ds.messages_received += st.messages_received;
    return ds;
  }
  used_full_ = false;
  last_.mode = "delta";
  base_version_ = version;
  st.version = version;
  st.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  return st;
}

template <class T>
std::set<std::string> DeltaExecutor<T>::tensor_names(const Pair& p) const {
  std::set<std::string> names;
  for (auto id : p.tensors)
    names.insert(id >= 0 && static_cast<std::size_t>(id) < names_.size() ? names_[static_cast<std::size_t>(id)] : fmt::format("tensor #{}", id));
  return names;
}

template <class T>
std::vector<MissingPieces> DeltaExecutor<T>::missing() const {
  if (!broken_) return {};
  if (used_full_) return full_.broken() ? full_.missing() : full_.incoming();
  std::vector<MissingPieces> out = rest_.missing();
  for (const Pair& p : pairs_) {
    if (p.send || p.done) continue;
    MissingPieces m;
    m.peer = p.peer;
    m.messages = 1;
    m.bytes = p.bytes;
    const std::set<std::string> names = tensor_names(p);
    m.tensors.assign(names.begin(), names.end());
    out.push_back(std::move(m));
  }
  return out;
}

template <class T>
BufferWrites DeltaExecutor<T>::buffer_writes() const {
  BufferWrites payloads(dst_data_.size(), BufferWrite::none);
  for (const Pair& p : pairs_) {
    if (p.send) continue;
    const BufferWrite w = p.decoded == p.slices.size() ? BufferWrite::written : p.scattered ? BufferWrite::partial : BufferWrite::untouched;
    std::set<std::size_t> bufs;
    for (const auto& s : p.streams)
      for (const auto& g : s.segs) {
        const auto it = std::find(dst_data_.begin(), dst_data_.end(), g.base);
        if (it != dst_data_.end()) bufs.insert(static_cast<std::size_t>(it - dst_data_.begin()));
      }
    for (auto b : bufs) payloads[b] = merge_disjoint(payloads[b], w);
  }
  BufferWrites out = rest_ran_ ? rest_.buffer_writes() : not_started(rest_.buffer_writes());
  // Payloads only move in a run that got past the dense rest.
  merge_into(out, rest_ran_ ? payloads : not_started(payloads), merge_disjoint);
  if (full_ran_) merge_into(out, full_.buffer_writes(), merge_overwrite);
  return out;
}

}  // namespace reshard
