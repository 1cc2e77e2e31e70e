#pragma once
// CUDA kernels for delta refits (delta.hpp, docs/delta.md): the device
// counterparts of the sender's diff-and-compact + chunk encoding and of the
// receiver's decode + scatter, in the host's wire format.
//
// Diff (DeltaDiffer::run): a batch of chunks (DiffChunk: the chunk's current
// elements, contiguous, and its shadow), in stream order, becomes the chunk
// table (one u32 entry per chunk, table_entry(mode, k)) and the chunk bodies
// one after another, byte for byte what DeltaExecutor::encode writes after
// the payload header: the same mode per chunk (best_mode over the changed
// count k and the gap escapes, ties alike), the same bodies (index, gap,
// mask, dense). The shadow becomes the current elements. Three steps on the
// caller's stream, no host synchronization:
//   1. count: one thread block per chunk; each of its 8 warps takes a
//      contiguous segment (a multiple of 32 elements), compares 32 elements
//      per step (one ballot), and keeps its changed count, first and last
//      position and its gap escapes; thread 0 combines the 8 segments into
//      k, escapes, mode and body bytes;
//   2. an inclusive scan of the body bytes (one thread block, 1024 chunks
//      a step): each chunk's body end, and the total (total_device());
//   3. write: the same comparison again, each warp starting from the
//      earlier segments' counts, writes positions, gaps, mask bytes and
//      values at their offsets, and the changed elements into the shadow.
// Like the host, a body that does not fit in `capacity` bytes is not written
// (nor any after it), but the shadow is still brought to this version: the
// caller sees total > capacity and refits dense. The payload header (version,
// base version, bytes, CRC32C) stays the caller's.
//
// Scatter (DeltaScatterer::run): a batch of chunks (ScatterChunk: the
// chunk's contiguous destination), a chunk table and bodies as the host (or
// the device diff) writes them. Two steps:
//   1. layout: one thread walks the table in order, as the host decoder
//      does, checking every entry, and finds each body's offset. Gap chunks
//      make this sequential: a gap body's length depends on its escapes, so
//      the walk reads each gap list (and writes its positions to a scratch
//      list for step 2). Its cost is one byte step per changed element of
//      the gap chunks, serial (the wire format has no per-chunk offsets; a
//      table of them, which the sender's diff has, would make it parallel);
//   2. scatter: one thread block per chunk writes the changed values
//      (index, gap: one per thread; mask: the ranks of the set bits by a
//      ballot per 32 elements; dense: every element).
// A malformed payload (a bad entry, a malformed gap list, a body past the
// end, a mask whose count is not its entry's, an index past its chunk) sets
// the status word (status_device(), 0 = good: reason << 32 | chunk + 1);
// nothing is scattered when the walk found it, a mask or index chunk found
// bad in step 2 is not written, others may already be.
//
// Element sizes 1, 2, 4 and 8 bytes (every dtype); elements aligned to their
// size. Chunks of up to kChunk elements. One launch of each step per batch,
// whatever its chunks' element sizes.
//
// Compile with nvcc (-std=c++20); link CUDA::cudart.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <span>
#include <string>

#include "../base/error.hpp"
#include "../exec/delta.hpp"
#include "box_batch.hpp"
#include "descriptor_upload.hpp"
#include "runtime.hpp"

namespace reshard::cuda {

/// A chunk to diff: n contiguous elements of E bytes at `cur`, and their shadow at `base`.
struct DiffChunk {
  std::uint64_t cur = 0, base = 0;
  std::int32_t n = 0, E = 0;
};

/// A chunk to scatter into: its n contiguous destination elements of E bytes.
struct ScatterChunk {
  std::uint64_t dst = 0;
  std::int32_t n = 0, E = 0;
};

namespace delta_detail {

inline constexpr int kThreads = 256;
inline constexpr int kWarps = kThreads / 32;

/// One warp's segment of a chunk: its changed elements, the gap escapes
/// among them but its first, and its first and last changed position (-1: none).
struct WarpSum {
  std::int32_t count = 0, esc = 0, first = -1, last = -1;
};
/// A chunk's changed count, escapes and mode (the diff's count step).
struct ChunkSum {
  std::int32_t k = 0, esc = 0, mode = 0, reserved = 0;
};
/// Where a chunk's body and values are in the bodies (the scatter's layout step).
struct ChunkLayout {
  std::int64_t body = 0, vals = 0, idx = 0;  ///< byte offsets; idx: first entry in the gap position scratch
  std::int32_t mode = 0, k = 0;
};

/// Status reasons (the high half of the status word).
enum Reason : unsigned { kBadEntry = 1, kBadGaps = 2, kShort = 3, kMaskCount = 4, kIndexPast = 5 };

template <int E>
using Word = typename word_of<static_cast<std::size_t>(E)>::type;  // box_batch.hpp

/// Bodies are byte streams: values and positions sit at any byte offset
/// (little-endian, as the host's memcpy of its words writes them).
template <class W>
__device__ inline void store_bytes(unsigned char* p, W v) {
#pragma unroll
  for (int q = 0; q < static_cast<int>(sizeof(W)); ++q) p[q] = static_cast<unsigned char>(static_cast<std::uint64_t>(v) >> (8 * q));
}
template <class W>
__device__ inline W load_bytes(const unsigned char* p) {
  std::uint64_t v = 0;
#pragma unroll
  for (int q = 0; q < static_cast<int>(sizeof(W)); ++q) v |= static_cast<std::uint64_t>(p[q]) << (8 * q);
  return static_cast<W>(v);
}

/// Warp w's segment [lo, hi) of a chunk of n elements; lo is a multiple of
/// 32, so a step of 32 elements is 4 whole mask bytes.
__device__ inline void segment(int n, int w, int& lo, int& hi) {
  const int per = ((n + kWarps - 1) / kWarps + 31) / 32 * 32;
  lo = min(n, w * per);
  hi = min(n, lo + per);
}

/// Highest set bit of a nonzero ballot.
__device__ inline int top_bit(unsigned b) { return 31 - __clz(b); }

template <int E>
__device__ inline void count_warp(const DiffChunk& c, int w, int lane, WarpSum& out) {
  const auto* cur = reinterpret_cast<const Word<E>*>(c.cur);
  const auto* base = reinterpret_cast<const Word<E>*>(c.base);
  int lo, hi;
  segment(c.n, w, lo, hi);
  const unsigned lt = (1u << lane) - 1u;  // lanes below this one
  int count = 0, esc = 0, first = -1, prev = -1;
  for (int r0 = lo; r0 < hi; r0 += 32) {
    const int i = r0 + lane;
    const bool changed = i < hi && cur[i] != base[i];
    const unsigned b = __ballot_sync(0xFFFFFFFFu, changed);
    if (b == 0) continue;
    const unsigned below = b & lt;
    const int p = below ? r0 + top_bit(below) : prev;  // the previous change in this segment
    esc += __popc(__ballot_sync(0xFFFFFFFFu, changed && p >= 0 && i - p - 1 >= 255));
    count += __popc(b);
    if (first < 0) first = r0 + __ffs(static_cast<int>(b)) - 1;
    prev = r0 + top_bit(b);
  }
  if (lane == 0) out = WarpSum{count, esc, first, prev};
}

/// The changed count, escapes and last position of the segments before warp w.
__device__ inline void before_warp(const WarpSum* sums, int w, int& count, int& esc, int& prev) {
  count = 0;
  esc = 0;
  prev = -1;
  for (int v = 0; v < w; ++v) {
    const WarpSum s = sums[v];
    if (s.count == 0) continue;
    esc += (s.first - prev - 1 >= 255) + s.esc;  // the segment's first change: its gap from the earlier segments' last
    prev = s.last;
    count += s.count;
  }
}

template <int E>
__device__ inline void write_warp(const DiffChunk& c, const WarpSum* sums, const ChunkSum& cs, std::int64_t end, std::int64_t capacity,
                                  unsigned char* bodies, int w, int lane) {
  using W = Word<E>;
  const auto* cur = reinterpret_cast<const W*>(c.cur);
  auto* base = reinterpret_cast<W*>(c.base);
  const auto m = static_cast<delta::ChunkMode>(cs.mode);
  const std::int64_t n = c.n, k = cs.k, esc = cs.esc;
  const std::int64_t size = delta::body_bytes(m, n, k, E, esc);
  const bool fits = end <= capacity;
  unsigned char* body = bodies + (end - size);
  const std::int64_t mask_bytes = (n + 7) / 8;
  unsigned char* vals = body + (m == delta::ChunkMode::index ? 2 * k : m == delta::ChunkMode::gap ? k + 2 * esc : m == delta::ChunkMode::mask ? mask_bytes : 0);
  int j0, esc0, prev;
  before_warp(sums, w, j0, esc0, prev);
  int lo, hi;
  segment(c.n, w, lo, hi);
  const unsigned lt = (1u << lane) - 1u;
  for (int r0 = lo; r0 < hi; r0 += 32) {
    const int i = r0 + lane;
    const W v = i < hi ? cur[i] : W{0};
    const bool changed = i < hi && v != base[i];
    const unsigned b = __ballot_sync(0xFFFFFFFFu, changed);
    if (fits && m == delta::ChunkMode::dense && i < hi) store_bytes(body + static_cast<std::int64_t>(i) * E, v);
    if (fits && m == delta::ChunkMode::mask && lane < 4 && r0 / 8 + lane < mask_bytes)
      body[r0 / 8 + lane] = static_cast<unsigned char>(b >> (8 * lane));  // every mask byte, clean ones too
    if (b == 0) continue;
    const unsigned below = b & lt;
    const int p = below ? r0 + top_bit(below) : prev;  // -1 for the chunk's first change, as the host's gap list
    const int gap = i - p - 1;
    const bool escaped = changed && gap >= 255;
    const unsigned eb = __ballot_sync(0xFFFFFFFFu, escaped);
    if (changed) {
      base[i] = v;
      if (fits) {
        const std::int64_t j = j0 + __popc(below);
        if (m == delta::ChunkMode::index) {
          store_bytes(body + 2 * j, static_cast<std::uint16_t>(i));
        } else if (m == delta::ChunkMode::gap) {
          unsigned char* g = body + j + 2 * (esc0 + __popc(eb & lt));
          if (escaped) {
            g[0] = 255;
            store_bytes(g + 1, static_cast<std::uint16_t>(i));
          } else {
            g[0] = static_cast<unsigned char>(gap);
          }
        }
        if (m != delta::ChunkMode::dense) store_bytes(vals + j * E, v);
      }
    }
    j0 += __popc(b);
    esc0 += __popc(eb);
    prev = r0 + top_bit(b);
  }
}

/// A payload fault: the first one reported wins.
__device__ inline void report(unsigned long long* status, unsigned reason, int chunk) {
  atomicCAS(status, 0ull, static_cast<unsigned long long>(reason) << 32 | static_cast<unsigned long long>(chunk + 1));
}

template <int E>
__device__ inline void scatter_chunk(const ScatterChunk& c, int chunk, const ChunkLayout& L, const unsigned char* bodies, const std::uint16_t* gap_idx,
                                     int* warp_count, unsigned long long* status) {
  using W = Word<E>;
  auto* dst = reinterpret_cast<W*>(c.dst);
  const auto m = static_cast<delta::ChunkMode>(L.mode);
  const int tid = static_cast<int>(threadIdx.x), n = c.n, k = L.k;
  const unsigned char* body = bodies + L.body;
  const unsigned char* vals = bodies + L.vals;
  if (m == delta::ChunkMode::dense) {
    for (int i = tid; i < n; i += kThreads) dst[i] = load_bytes<W>(vals + static_cast<std::int64_t>(i) * E);
  } else if (m == delta::ChunkMode::index) {
    for (int j = tid; j < k; j += kThreads) {
      const int p = load_bytes<std::uint16_t>(body + 2 * j);
      if (p >= n) report(status, kIndexPast, chunk);
    }
    __syncthreads();  // a bad position anywhere: nothing of this chunk is written
    if (*reinterpret_cast<volatile unsigned long long*>(status) == 0)
      for (int j = tid; j < k; j += kThreads) dst[load_bytes<std::uint16_t>(body + 2 * j)] = load_bytes<W>(vals + static_cast<std::int64_t>(j) * E);
    __syncthreads();
  } else if (m == delta::ChunkMode::gap) {
    for (int j = tid; j < k; j += kThreads) dst[gap_idx[L.idx + j]] = load_bytes<W>(vals + static_cast<std::int64_t>(j) * E);
  } else if (m == delta::ChunkMode::mask) {
    // Ranks of the set bits: each warp counts its segment's, then writes
    // its values from the earlier segments' total.
    const int w = tid / 32, lane = tid % 32;
    const unsigned lt = (1u << lane) - 1u;
    int lo, hi;
    segment(n, w, lo, hi);
    int count = 0;
    for (int r0 = lo; r0 < hi; r0 += 32) {
      const int i = r0 + lane;
      count += __popc(__ballot_sync(0xFFFFFFFFu, i < hi && (body[i >> 3] >> (i & 7) & 1)));
    }
    if (lane == 0) warp_count[w] = count;
    __syncthreads();
    int j0 = 0, total = 0;
    for (int v = 0; v < kWarps; ++v) {
      j0 += v < w ? warp_count[v] : 0;
      total += warp_count[v];
    }
    if (total != k) {
      if (tid == 0) report(status, kMaskCount, chunk);
    } else {
      for (int r0 = lo; r0 < hi; r0 += 32) {
        const int i = r0 + lane;
        const bool set = i < hi && (body[i >> 3] >> (i & 7) & 1);
        const unsigned b = __ballot_sync(0xFFFFFFFFu, set);
        if (set) dst[i] = load_bytes<W>(vals + static_cast<std::int64_t>(j0 + __popc(b & lt)) * E);
        j0 += __popc(b);
      }
    }
    __syncthreads();  // warp_count is free for the next chunk
  }
}

}  // namespace delta_detail

// The kernels are templates on their thread count (which the segments
// assume: kThreads) so that this header can be included by several
// translation units: a plain __global__ function would be defined in each.

/// Diff step 1: per chunk, the segments' sums, the chunk's k / escapes / mode and its body bytes.
template <int Threads>
__global__ void __launch_bounds__(Threads)
    delta_count_kernel(const DiffChunk* chunks, int nchunks, delta_detail::WarpSum* warp_sums, delta_detail::ChunkSum* chunk_sums, std::int64_t* sizes) {
  static_assert(Threads == delta_detail::kThreads, "the kernel's thread arithmetic");
  using namespace delta_detail;
  __shared__ WarpSum sums[kWarps];
  const int w = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  for (int c = static_cast<int>(blockIdx.x); c < nchunks; c += static_cast<int>(gridDim.x)) {
    const DiffChunk ch = chunks[c];
    switch (ch.E) {
      case 1: count_warp<1>(ch, w, lane, sums[w]); break;
      case 2: count_warp<2>(ch, w, lane, sums[w]); break;
      case 4: count_warp<4>(ch, w, lane, sums[w]); break;
      default: count_warp<8>(ch, w, lane, sums[w]); break;  // checked on the host: 8
    }
    __syncthreads();
    if (lane == 0) warp_sums[static_cast<std::int64_t>(c) * kWarps + w] = sums[w];
    if (threadIdx.x == 0) {
      int k, esc, last;
      before_warp(sums, kWarps, k, esc, last);
      const delta::ChunkMode m = delta::best_mode(ch.n, k, ch.E, esc);
      chunk_sums[c] = ChunkSum{k, esc, static_cast<std::int32_t>(m), 0};
      sizes[c] = delta::body_bytes(m, ch.n, k, ch.E, esc);
    }
    __syncthreads();  // sums is free for the next chunk
  }
}

/// Diff step 3: table entries, bodies (where they fit) and the shadow.
template <int Threads>
__global__ void __launch_bounds__(Threads)
    delta_write_kernel(const DiffChunk* chunks, int nchunks, const delta_detail::WarpSum* warp_sums, const delta_detail::ChunkSum* chunk_sums,
                       const std::int64_t* ends, unsigned char* table, unsigned char* bodies, std::int64_t capacity) {
  static_assert(Threads == delta_detail::kThreads, "the kernel's thread arithmetic");
  using namespace delta_detail;
  const int w = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  for (int c = static_cast<int>(blockIdx.x); c < nchunks; c += static_cast<int>(gridDim.x)) {
    const DiffChunk ch = chunks[c];
    const ChunkSum cs = chunk_sums[c];
    if (threadIdx.x == 0) store_bytes(table + 4 * static_cast<std::int64_t>(c), delta::table_entry(static_cast<delta::ChunkMode>(cs.mode), cs.k));
    if (cs.k == 0) continue;  // "same": nothing to write anywhere
    const WarpSum* sums = warp_sums + static_cast<std::int64_t>(c) * kWarps;
    switch (ch.E) {
      case 1: write_warp<1>(ch, sums, cs, ends[c], capacity, bodies, w, lane); break;
      case 2: write_warp<2>(ch, sums, cs, ends[c], capacity, bodies, w, lane); break;
      case 4: write_warp<4>(ch, sums, cs, ends[c], capacity, bodies, w, lane); break;
      default: write_warp<8>(ch, sums, cs, ends[c], capacity, bodies, w, lane); break;
    }
  }
}

/// Diff step 2 (one thread block of 1024 threads): ends[i] = sizes[0] + ... + sizes[i].
template <int Threads>
__global__ void __launch_bounds__(Threads) delta_inclusive_sum_kernel(const std::int64_t* sizes, std::int64_t* ends, int n) {
  static_assert(Threads == 1024, "the kernel's thread arithmetic");
  __shared__ std::int64_t warp_total[32];
  const int tid = static_cast<int>(threadIdx.x), w = tid / 32, lane = tid % 32;
  std::int64_t carry = 0;
  for (int first = 0; first < n; first += 1024) {
    const int i = first + tid;
    std::int64_t v = i < n ? sizes[i] : 0;
    for (int o = 1; o < 32; o <<= 1) {
      const std::int64_t t = __shfl_up_sync(0xFFFFFFFFu, v, o);
      if (lane >= o) v += t;
    }
    if (lane == 31) warp_total[w] = v;
    __syncthreads();
    if (w == 0) {
      std::int64_t x = warp_total[lane];
      for (int o = 1; o < 32; o <<= 1) {
        const std::int64_t t = __shfl_up_sync(0xFFFFFFFFu, x, o);
        if (lane >= o) x += t;
      }
      warp_total[lane] = x;
    }
    __syncthreads();
    if (i < n) ends[i] = carry + (w > 0 ? warp_total[w - 1] : 0) + v;
    carry += warp_total[31];
    __syncthreads();  // warp_total is rewritten next step
  }
}

/// Scatter step 1 (one thread): the host decoder's walk over the table,
/// checking each entry; body offsets, and the positions of the gap chunks.
template <int Threads>
__global__ void delta_layout_kernel(const ScatterChunk* chunks, int nchunks, const unsigned char* table, const unsigned char* bodies, std::int64_t limit,
                                    delta_detail::ChunkLayout* layout, std::uint16_t* gap_idx, unsigned long long* status) {
  static_assert(Threads == 1, "the kernel's thread arithmetic");
  using namespace delta_detail;
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  std::int64_t at = 0, idx_at = 0;
  for (int c = 0; c < nchunks; ++c) {
    const std::int64_t n = chunks[c].n, E = chunks[c].E;
    const auto entry = load_bytes<std::uint32_t>(table + 4 * static_cast<std::int64_t>(c));
    const auto m = static_cast<delta::ChunkMode>(entry >> 24);
    const std::int64_t k = entry & 0xFFFFFF;
    if (entry >> 24 >= delta::kChunkModes || k > n || (m == delta::ChunkMode::same) != (k == 0)) return report(status, kBadEntry, c);
    std::int64_t esc = 0;
    if (m == delta::ChunkMode::gap) {
      std::int64_t a = at, prev = -1;
      for (std::int64_t j = 0; j < k; ++j) {
        if (a >= limit) return report(status, kBadGaps, c);
        const std::int64_t g = bodies[a++];
        std::int64_t p;
        if (g < 255) {
          p = prev + 1 + g;
        } else {
          if (a + 2 > limit) return report(status, kBadGaps, c);
          p = load_bytes<std::uint16_t>(bodies + a);
          a += 2;
        }
        if (p <= prev || p >= n) return report(status, kBadGaps, c);
        gap_idx[idx_at + j] = static_cast<std::uint16_t>(p);
        prev = p;
      }
      esc = (a - at - k) / 2;
    }
    const std::int64_t need = delta::body_bytes(m, n, k, E, esc);
    if (at + need > limit) return report(status, kShort, c);
    const std::int64_t vals =
        at + (m == delta::ChunkMode::index ? 2 * k : m == delta::ChunkMode::gap ? k + 2 * esc : m == delta::ChunkMode::mask ? (n + 7) / 8 : 0);
    layout[c] = ChunkLayout{at, vals, idx_at, static_cast<std::int32_t>(m), static_cast<std::int32_t>(k)};
    if (m == delta::ChunkMode::gap) idx_at += k;
    at += need;
  }
}

/// Scatter step 2: one thread block per chunk, unless the walk found a fault.
template <int Threads>
__global__ void __launch_bounds__(Threads)
    delta_scatter_kernel(const ScatterChunk* chunks, int nchunks, const delta_detail::ChunkLayout* layout, const unsigned char* bodies,
                         const std::uint16_t* gap_idx, unsigned long long* status) {
  static_assert(Threads == delta_detail::kThreads, "the kernel's thread arithmetic");
  using namespace delta_detail;
  __shared__ int warp_count[kWarps];
  __shared__ unsigned long long walked;
  if (threadIdx.x == 0) walked = *status;
  __syncthreads();
  if (walked != 0) return;
  for (int c = static_cast<int>(blockIdx.x); c < nchunks; c += static_cast<int>(gridDim.x)) {
    const ScatterChunk ch = chunks[c];
    const ChunkLayout L = layout[c];
    switch (ch.E) {
      case 1: scatter_chunk<1>(ch, c, L, bodies, gap_idx, warp_count, status); break;
      case 2: scatter_chunk<2>(ch, c, L, bodies, gap_idx, warp_count, status); break;
      case 4: scatter_chunk<4>(ch, c, L, bodies, gap_idx, warp_count, status); break;
      default: scatter_chunk<8>(ch, c, L, bodies, gap_idx, warp_count, status); break;
    }
  }
}

namespace delta_detail {
/// A device array that grows (after the stream's work that may read it).
template <class T>
struct Scratch {
  T* p = nullptr;
  std::size_t cap = 0;
  ~Scratch() {
    if (p) (void)cudaFree(p);
  }
  T* reserve(std::size_t n, cudaStream_t s) {
    n = std::max<std::size_t>(n, 1);
    if (n <= cap) return p;
    check_cuda(cudaStreamSynchronize(s), "cudaStreamSynchronize before growing delta scratch");
    if (p) check_cuda(cudaFree(p), "cudaFree");
    p = nullptr;
    cap = 0;
    check_cuda(cudaMalloc(reinterpret_cast<void**>(&p), n * sizeof(T)), "cudaMalloc of delta scratch");
    cap = n;
    return p;
  }
};

template <class C>
inline void check_chunks(std::span<const C> chunks) {
  if (chunks.size() > 0x7FFFFFFF) fail("delta kernels: {} chunks in one batch", chunks.size());
  for (const C& c : chunks) {
    if (c.E != 1 && c.E != 2 && c.E != 4 && c.E != 8) fail("delta kernels: element size {} (the kernels take 1, 2, 4 or 8 bytes)", c.E);
    if (c.n < 1 || c.n > delta::kChunk) fail("delta kernels: a chunk of {} elements (1..{})", c.n, delta::kChunk);
  }
}

inline unsigned grid_for(std::size_t chunks) { return static_cast<unsigned>(std::min<std::size_t>(chunks, std::size_t{1} << 20)); }
}  // namespace delta_detail

/// The device diff-and-encode of batches of chunks on one stream. Not
/// thread-safe; one per stream.
class DeltaDiffer {
 public:
  explicit DeltaDiffer(cudaStream_t stream = nullptr) : upload_(stream) {}
  cudaStream_t stream() const { return upload_.stream(); }

  /// Enqueues the diff of `chunks` (in stream order): table entries to
  /// `table` (4 bytes per chunk), bodies to `bodies` (those that fit in
  /// `capacity` bytes), shadows updated. Afterwards total_device() holds the
  /// bodies' bytes (more than capacity: overflow).
  void run(std::span<const DiffChunk> chunks, std::byte* table, std::byte* bodies, std::int64_t capacity) {
    using namespace delta_detail;
    check_chunks(chunks);
    if (chunks.empty()) {
      total_ = nullptr;
      return;
    }
    const cudaStream_t s = upload_.stream();
    const auto n = static_cast<int>(chunks.size());
    const DiffChunk* d = upload_.upload(chunks);
    WarpSum* warp_sums = warp_sums_.reserve(chunks.size() * kWarps, s);
    ChunkSum* chunk_sums = chunk_sums_.reserve(chunks.size(), s);
    std::int64_t* sizes = sizes_.reserve(chunks.size(), s);
    std::int64_t* ends = ends_.reserve(chunks.size(), s);
    delta_count_kernel<kThreads><<<grid_for(chunks.size()), kThreads, 0, s>>>(d, n, warp_sums, chunk_sums, sizes);
    check_cuda(cudaGetLastError(), "launching the delta count kernel");
    delta_inclusive_sum_kernel<1024><<<1, 1024, 0, s>>>(sizes, ends, n);
    check_cuda(cudaGetLastError(), "launching the body offset scan");
    delta_write_kernel<kThreads><<<grid_for(chunks.size()), kThreads, 0, s>>>(d, n, warp_sums, chunk_sums, ends, reinterpret_cast<unsigned char*>(table),
                                                                    reinterpret_cast<unsigned char*>(bodies), capacity);
    check_cuda(cudaGetLastError(), "launching the delta write kernel");
    total_ = ends + (n - 1);
  }
  /// Device address of the last run's body bytes (an int64), valid until the next run.
  const std::int64_t* total_device() const { return total_; }
  void synchronize() { check_cuda(cudaStreamSynchronize(upload_.stream()), "cudaStreamSynchronize after the delta diff"); }

 private:
  DescriptorUpload<DiffChunk> upload_;
  delta_detail::Scratch<delta_detail::WarpSum> warp_sums_;
  delta_detail::Scratch<delta_detail::ChunkSum> chunk_sums_;
  delta_detail::Scratch<std::int64_t> sizes_, ends_;
  const std::int64_t* total_ = nullptr;
};

/// The device decode-and-scatter of batches of chunks on one stream. Not
/// thread-safe; one per stream.
class DeltaScatterer {
 public:
  explicit DeltaScatterer(cudaStream_t stream = nullptr) : upload_(stream) {}
  cudaStream_t stream() const { return upload_.stream(); }

  /// Enqueues the scatter of a table (4 bytes per chunk of `chunks`) and
  /// the bodies after it (`body_bytes` of them) into the chunks' destinations.
  void run(std::span<const ScatterChunk> chunks, const std::byte* table, const std::byte* bodies, std::int64_t body_bytes) {
    using namespace delta_detail;
    check_chunks(chunks);
    const cudaStream_t s = upload_.stream();
    unsigned long long* status = status_.reserve(1, s);
    check_cuda(cudaMemsetAsync(status, 0, sizeof *status, s), "clearing the delta status");
    if (chunks.empty()) return;
    const auto n = static_cast<int>(chunks.size());
    const ScatterChunk* d = upload_.upload(chunks);
    ChunkLayout* layout = layout_.reserve(chunks.size(), s);
    // Each gap position takes at least one body byte.
    std::uint16_t* gap_idx = gap_idx_.reserve(static_cast<std::size_t>(std::max<std::int64_t>(body_bytes, 1)), s);
    delta_layout_kernel<1><<<1, 1, 0, s>>>(d, n, reinterpret_cast<const unsigned char*>(table), reinterpret_cast<const unsigned char*>(bodies), body_bytes,
                                        layout, gap_idx, status);
    check_cuda(cudaGetLastError(), "launching the delta layout kernel");
    delta_scatter_kernel<kThreads><<<grid_for(chunks.size()), kThreads, 0, s>>>(d, n, layout, reinterpret_cast<const unsigned char*>(bodies), gap_idx, status);
    check_cuda(cudaGetLastError(), "launching the delta scatter kernel");
  }
  /// Device address of the last run's status word: 0, or reason << 32 | (chunk + 1).
  const unsigned long long* status_device() {
    return status_.reserve(1, upload_.stream());
  }
  void synchronize() { check_cuda(cudaStreamSynchronize(upload_.stream()), "cudaStreamSynchronize after the delta scatter"); }

 private:
  DescriptorUpload<ScatterChunk> upload_;
  delta_detail::Scratch<delta_detail::ChunkLayout> layout_;
  delta_detail::Scratch<std::uint16_t> gap_idx_;
  delta_detail::Scratch<unsigned long long> status_;
};

/// A status word in words (for errors and test messages).
inline std::string describe_delta_status(unsigned long long status) {
  if (status == 0) return "good";
  static const char* const why[] = {"?", "a bad chunk entry", "a malformed gap list", "a body past the end", "a bitmask whose count is not its entry's",
                                    "a position past its chunk"};
  const auto r = static_cast<unsigned>(status >> 32);
  return fmt::format("chunk {} has {}", (status & 0xFFFFFFFFu) - 1, r < 6 ? why[r] : "?");
}

}  // namespace reshard::cuda
