#pragma once
// Batched strided box copies: the descriptor the CUDA copy kernels
// (cuda/copy_kernels.cuh) read, the host code that builds a batch, the plain
// host reference of the same semantics, and the kernel's per-block body.
//
// Plain C++ (no CUDA needed): the body is written once for both compilers
// (RESHARD_HD) so that a CPU test can run every block and thread of a launch
// serially (emulate_box_copies) and check the exact index arithmetic, vector
// conditions and block assignment that the GPU runs.
//
// A BoxCopy moves elements [first, first + count) of an N-D box, taken in
// row-major order over `extent`, from src to dst. Element with multi-index i
// lives at src + sum_k i_k * src_stride[k] * in_bytes on the source side and
// dst + sum_k i_k * dst_stride[k] * out_bytes on the destination side. Pack
// is a copy whose destination is dense (the staging stream), unpack one whose
// source is dense, a local copy one with both sides strided.
//
//   BoxBatch batch;
//   batch.add(pack_copy(box_base, box_offset, rank, extent, strides, first, count, stream + at), element_bytes);
//   BatchLaunch l = batch.finish();            // one element size, one rank, blocks per copy
//   copy_boxes_reference(batch.boxes(), l);    // host memory: the definition
//   // device memory: BoxCopier::run(batch) (copy_kernels.cuh), one launch
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

#include "../base/error.hpp"
#include "../base/hd.hpp"
#include "../schedule/schedule.hpp"

#if defined(__CUDA_ARCH__)
#define RESHARD_UNROLL _Pragma("unroll")
#else
#define RESHARD_UNROLL
#endif

namespace reshard::cuda {

/// Most dims one descriptor holds (a schedule box plus the dim that lowering
/// an element size adds).
inline constexpr int kBoxCopyMaxRank = 10;

/// One strided box copy (trivially copyable: uploaded as raw bytes).
struct BoxCopy {
  std::uint64_t src = 0, dst = 0;  ///< addresses of element (0, ..., 0) on each side
  std::int64_t first = 0, count = 0;  ///< row-major element range of the box
  std::int64_t block = 0;             ///< first thread block of this copy in its launch (finish() sets it)
  std::int32_t rank = 0;
  std::int32_t reserved = 0;
  std::int64_t extent[kBoxCopyMaxRank] = {};
  std::int64_t src_stride[kBoxCopyMaxRank] = {};  ///< in source elements
  std::int64_t dst_stride[kBoxCopyMaxRank] = {};  ///< in destination elements
};

// --- element types and casts in flight ---------------------------------

struct alignas(16) Vec16 {
  std::uint32_t x, y, z, w;
};

template <std::size_t E>
struct word_of;
template <> struct word_of<1> { using type = std::uint8_t; };
template <> struct word_of<2> { using type = std::uint16_t; };
template <> struct word_of<4> { using type = std::uint32_t; };
template <> struct word_of<8> { using type = std::uint64_t; };
template <> struct word_of<16> { using type = Vec16; };

/// A cast policy: In / Out element words and apply(). Identity<E> moves E-byte
/// elements unchanged (E a power of two up to 16).
template <std::size_t E>
struct Identity {
  using In = typename word_of<E>::type;
  using Out = In;
  static constexpr bool identity = true;
  RESHARD_HD static Out apply(In x) { return x; }
};

/// f32 -> bf16, round to nearest even; NaN stays a (quiet) NaN.
struct F32ToBF16 {
  using In = std::uint32_t;
  using Out = std::uint16_t;
  static constexpr bool identity = false;
  RESHARD_HD static Out apply(In x) {
    if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<Out>((x >> 16) | 0x0040u);
    x += 0x7fffu + ((x >> 16) & 1u);
    return static_cast<Out>(x >> 16);
  }
};

/// bf16 -> f32 (exact).
struct BF16ToF32 {
  using In = std::uint16_t;
  using Out = std::uint32_t;
  static constexpr bool identity = false;
  RESHARD_HD static Out apply(In x) { return static_cast<Out>(x) << 16; }
};

namespace batch_detail {

inline constexpr int kThreads = 256;  ///< threads per block
inline constexpr int kUnroll = 8;     ///< units in flight per thread (loads issued before stores)

template <class Cast>
inline constexpr int in_bytes = static_cast<int>(sizeof(typename Cast::In));
template <class Cast>
inline constexpr int out_bytes = static_cast<int>(sizeof(typename Cast::Out));
/// Elements per vector unit: 16 bytes on the narrower side.
template <class Cast>
inline constexpr int vec_elems = 16 / (in_bytes<Cast> < out_bytes<Cast> ? in_bytes<Cast> : out_bytes<Cast>);
/// Elements one block moves.
template <class Cast>
inline constexpr std::int64_t block_elems = std::int64_t{kThreads} * kUnroll * vec_elems<Cast>;

inline std::int64_t block_elems_for(int ib, int ob) {
  const int narrow = ib < ob ? ib : ob;
  return std::int64_t{kThreads} * kUnroll * (16 / narrow);
}

RESHARD_HD inline std::int64_t min64(std::int64_t a, std::int64_t b) { return a < b ? a : b; }

template <class T>
RESHARD_HD inline T load(const unsigned char* p) {
#if defined(__CUDA_ARCH__)
  return *reinterpret_cast<const T*>(p);
#else
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
#endif
}
template <class T>
RESHARD_HD inline void store(unsigned char* p, const T& v) {
#if defined(__CUDA_ARCH__)
  *reinterpret_cast<T*>(p) = v;
#else
  std::memcpy(p, &v, sizeof(T));
#endif
}

/// Where the row-major element e of a box is: (row, col) over the inner dim
/// and both sides' offsets of the row (elements), kept incrementally.
template <int R>
struct Cursor {
  const BoxCopy* b;
  int rank;
  std::int64_t inner, row, col, row_src, row_dst;

  RESHARD_HD void place_row() {
    if constexpr (R == 1) {
      row_src = row_dst = 0;
    } else if constexpr (R == 2) {
      row_src = row * b->src_stride[0];
      row_dst = row * b->dst_stride[0];
    } else {
      std::int64_t r = row, s = 0, d = 0;
      for (int k = rank - 2; k >= 0; --k) {
        const std::int64_t digit = r % b->extent[k];
        r /= b->extent[k];
        s += digit * b->src_stride[k];
        d += digit * b->dst_stride[k];
      }
      row_src = s;
      row_dst = d;
    }
  }
  RESHARD_HD void start(const BoxCopy* box, int rk, std::int64_t e) {
    b = box;
    rank = rk;
    inner = b->extent[rank - 1];
    row = e / inner;
    col = e % inner;
    place_row();
  }
  /// Advances by step = q * inner + r elements (0 <= r < inner).
  RESHARD_HD void advance(std::int64_t q, std::int64_t r) {
    const std::int64_t before = row;
    col += r;
    row += q;
    if (col >= inner) {
      col -= inner;
      ++row;
    }
    if (row != before) place_row();
  }
  RESHARD_HD std::int64_t src() const { return row_src + col * b->src_stride[rank - 1]; }
  RESHARD_HD std::int64_t dst() const { return row_dst + col * b->dst_stride[rank - 1]; }
};

/// Moves `steps` units of W elements for one thread: unit j starts at element
/// e0 + j * step; units at or past `end` are skipped. Every unit's offsets are
/// computed before any load, and every load before any store, so a thread
/// keeps `steps` memory requests in flight.
template <int R, class Cast, int W, int STEPS>
RESHARD_HD void move_units(const BoxCopy& b, int rank, std::int64_t e0, std::int64_t step, std::int64_t end) {
  using In = typename Cast::In;
  using Out = typename Cast::Out;
  constexpr int IB = in_bytes<Cast>, OB = out_bytes<Cast>;
  constexpr bool vector = (W * IB) % 16 == 0 && (W * OB) % 16 == 0;
  constexpr int NI = vector ? W * IB / 16 : 1, NO = vector ? W * OB / 16 : 1;
  if (e0 >= end) return;
  Cursor<R> c;
  c.start(&b, rank, e0);
  const std::int64_t q = step / c.inner, r = step % c.inner;
  std::int64_t so[STEPS], dof[STEPS];
  bool ok[STEPS];
RESHARD_UNROLL
  for (int j = 0; j < STEPS; ++j) {
    ok[j] = e0 + j * step < end;
    so[j] = c.src();
    dof[j] = c.dst();
    if (j + 1 < STEPS && e0 + (j + 1) * step < end) c.advance(q, r);
  }
  auto* const sb = reinterpret_cast<const unsigned char*>(static_cast<std::uintptr_t>(b.src));
  auto* const db = reinterpret_cast<unsigned char*>(static_cast<std::uintptr_t>(b.dst));
  if constexpr (vector) {
    Vec16 in[STEPS][NI];
RESHARD_UNROLL
    for (int j = 0; j < STEPS; ++j)
      if (ok[j])
RESHARD_UNROLL
        for (int i = 0; i < NI; ++i) in[j][i] = load<Vec16>(sb + so[j] * IB + 16 * i);
RESHARD_UNROLL
    for (int j = 0; j < STEPS; ++j) {
      if (!ok[j]) continue;
      if constexpr (Cast::identity) {
RESHARD_UNROLL
        for (int i = 0; i < NO; ++i) store<Vec16>(db + dof[j] * OB + 16 * i, in[j][i]);
      } else {
        In x[W];
        Out y[W];
        std::memcpy(x, in[j], sizeof(x));
RESHARD_UNROLL
        for (int k = 0; k < W; ++k) y[k] = Cast::apply(x[k]);
        Vec16 out[NO];
        std::memcpy(out, y, sizeof(out));
RESHARD_UNROLL
        for (int i = 0; i < NO; ++i) store<Vec16>(db + dof[j] * OB + 16 * i, out[i]);
      }
    }
  } else {
    static_assert(W == 1, "reshard: a unit that is not a whole number of 16-byte vectors must be one element");
    In in[STEPS];
RESHARD_UNROLL
    for (int j = 0; j < STEPS; ++j)
      if (ok[j]) in[j] = load<In>(sb + so[j] * IB);
RESHARD_UNROLL
    for (int j = 0; j < STEPS; ++j)
      if (ok[j]) store<Out>(db + dof[j] * OB, Cast::apply(in[j]));
  }
}

/// Can the chunk move in 16-byte units? Both sides unit-stride along the
/// inner dim, rows a whole number of units, every row start 16-byte aligned.
template <class Cast>
RESHARD_HD bool vectorizable(const BoxCopy& b, int rank) {
  constexpr int V = vec_elems<Cast>, IB = in_bytes<Cast>, OB = out_bytes<Cast>;
  if (b.src_stride[rank - 1] != 1 || b.dst_stride[rank - 1] != 1) return false;
  if (b.extent[rank - 1] % V != 0 || b.first % V != 0) return false;
  if (b.src % 16 != 0 || b.dst % 16 != 0) return false;
  for (int k = 0; k < rank - 1; ++k)
    if (b.extent[k] > 1 && ((b.src_stride[k] * IB) % 16 != 0 || (b.dst_stride[k] * OB) % 16 != 0)) return false;
  return true;
}

/// What block `block` of a launch does, as thread `thread`. R is the batch's
/// box rank (every copy padded to it), or 0: read each copy's rank.
template <int R, class Cast>
RESHARD_HD void run_block(const BoxCopy* boxes, int n, std::int64_t block, int thread) {
  // The copy this block belongs to: the last one whose first block <= block.
  int lo = 0, hi = n - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (boxes[mid].block <= block) lo = mid;
    else hi = mid - 1;
  }
  const BoxCopy& b = boxes[lo];
  const int rank = R > 0 ? R : b.rank;
  constexpr int V = vec_elems<Cast>;
  constexpr std::int64_t CH = block_elems<Cast>;
  const std::int64_t c0 = (block - b.block) * CH, c1 = min64(c0 + CH, b.count);
  if (c0 >= c1) return;
  const std::int64_t begin = b.first + c0, end = b.first + c1;
  if (vectorizable<Cast>(b, rank)) {
    const std::int64_t units_end = begin + (c1 - c0) / V * V;
    move_units<R, Cast, V, kUnroll>(b, rank, begin + std::int64_t{thread} * V, std::int64_t{kThreads} * V, units_end);
    if (units_end < end) move_units<R, Cast, 1, 1>(b, rank, units_end + thread, kThreads, end);
  } else {
    // One element per unit: V rounds of kUnroll elements per thread.
    for (int round = 0; round < V; ++round) {
      const std::int64_t e0 = begin + std::int64_t{round} * kUnroll * kThreads + thread;
      move_units<R, Cast, 1, kUnroll>(b, rank, e0, kThreads, end);
    }
  }
}

inline std::int64_t low_bit(std::uint64_t v) { return v == 0 ? std::int64_t{1} << 62 : static_cast<std::int64_t>(v & (~v + 1)); }

inline std::int64_t box_size(const BoxCopy& b) {
  std::int64_t n = 1;
  for (int k = 0; k < b.rank; ++k) n *= b.extent[k];
  return n;
}

/// Merges dims that are one run on both sides and drops dims of extent 1
/// (schedule.hpp's collapse_dims, the one routine for it); the row-major
/// element order (and so first / count) is unchanged. Dims past the new rank
/// are zeroed, so that uploaded descriptors hold no stale dims.
inline void collapse(BoxCopy& b) {
  b.rank = collapse_dims(b.rank, b.extent, b.src_stride, b.dst_stride);
  for (int k = b.rank; k < kBoxCopyMaxRank; ++k) b.extent[k] = b.src_stride[k] = b.dst_stride[k] = 0;
}

/// Re-expresses E-byte elements as E/g elements of g bytes each (g | E).
inline void lower_element(BoxCopy& b, std::int64_t E, std::int64_t g) {
  const std::int64_t k = E / g;
  if (k == 1) return;
  const int in = b.rank - 1;
  if (b.src_stride[in] == 1 && b.dst_stride[in] == 1) {
    for (int d = 0; d < in; ++d) {
      b.src_stride[d] *= k;
      b.dst_stride[d] *= k;
    }
    b.extent[in] *= k;
  } else {
    if (b.rank >= kBoxCopyMaxRank) fail("box copy: a box of rank {} cannot be lowered to {}-byte elements (at most {} dims)", b.rank, g, kBoxCopyMaxRank);
    for (int d = 0; d <= in; ++d) {
      b.src_stride[d] *= k;
      b.dst_stride[d] *= k;
    }
    b.extent[b.rank] = k;
    b.src_stride[b.rank] = b.dst_stride[b.rank] = 1;
    ++b.rank;
  }
  b.first *= k;
  b.count *= k;
}

/// Prepends dims of extent 1 so the box has rank R.
inline void pad_rank(BoxCopy& b, int R) {
  const int s = R - b.rank;
  if (s <= 0) return;
  for (int k = b.rank - 1; k >= 0; --k) {
    b.extent[k + s] = b.extent[k];
    b.src_stride[k + s] = b.src_stride[k];
    b.dst_stride[k + s] = b.dst_stride[k];
  }
  for (int k = 0; k < s; ++k) {
    b.extent[k] = 1;
    b.src_stride[k] = b.dst_stride[k] = 0;
  }
  b.rank = R;
}

}  // namespace batch_detail

/// How a finished batch is launched: one element size (identity) or the
/// cast's, one box rank (0: mixed ranks above 4, read per copy), total blocks.
struct BatchLaunch {
  int in_bytes = 0, out_bytes = 0;
  bool identity = true;
  int rank = 0;
  std::int64_t blocks = 0;
  std::int64_t elements = 0;  ///< elements moved (after lowering)
  int copies = 0;
};

/// A copy of elements [first, first + count) of a box into a dense stream at
/// `stream` (pack) or from it (unpack): the stream side gets row-major dense
/// strides and an origin such that element `first` lands at `stream`.
inline BoxCopy pack_copy(const void* base, std::int64_t offset, int rank, const std::int64_t* extent, const std::int64_t* stride,
                         std::int64_t first, std::int64_t count, void* stream, std::int64_t in_bytes, std::int64_t out_bytes) {
  if (rank < 1 || rank > kBoxCopyMaxRank) fail("box copy: box rank {} is outside 1..{}", rank, kBoxCopyMaxRank);
  BoxCopy c;
  c.rank = rank;
  c.first = first;
  c.count = count;
  std::int64_t dense = 1;
  for (int k = rank - 1; k >= 0; --k) {
    c.extent[k] = extent[k];
    c.src_stride[k] = stride[k];
    c.dst_stride[k] = dense;
    dense *= extent[k];
  }
  c.src = reinterpret_cast<std::uintptr_t>(base) + static_cast<std::uint64_t>(offset * in_bytes);
  c.dst = reinterpret_cast<std::uintptr_t>(stream) - static_cast<std::uint64_t>(first * out_bytes);
  return c;
}
inline BoxCopy unpack_copy(void* base, std::int64_t offset, int rank, const std::int64_t* extent, const std::int64_t* stride,
                           std::int64_t first, std::int64_t count, const void* stream, std::int64_t in_bytes, std::int64_t out_bytes) {
  BoxCopy c = pack_copy(base, 0, rank, extent, stride, first, count, const_cast<void*>(stream), out_bytes, in_bytes);
  // Swap the sides: the stream is the source.
  for (int k = 0; k < rank; ++k) std::swap(c.src_stride[k], c.dst_stride[k]);
  c.src = reinterpret_cast<std::uintptr_t>(stream) - static_cast<std::uint64_t>(first * in_bytes);
  c.dst = reinterpret_cast<std::uintptr_t>(base) + static_cast<std::uint64_t>(offset * out_bytes);
  return c;
}
/// A full box copied between two strided sides.
inline BoxCopy box_copy(const void* src, std::int64_t src_offset, const std::int64_t* src_stride, void* dst, std::int64_t dst_offset,
                        const std::int64_t* dst_stride, int rank, const std::int64_t* extent, std::int64_t in_bytes, std::int64_t out_bytes) {
  if (rank < 1 || rank > kBoxCopyMaxRank) fail("box copy: box rank {} is outside 1..{}", rank, kBoxCopyMaxRank);
  BoxCopy c;
  c.rank = rank;
  c.count = 1;
  for (int k = 0; k < rank; ++k) {
    c.extent[k] = extent[k];
    c.src_stride[k] = src_stride[k];
    c.dst_stride[k] = dst_stride[k];
    c.count *= extent[k];
  }
  c.src = reinterpret_cast<std::uintptr_t>(src) + static_cast<std::uint64_t>(src_offset * in_bytes);
  c.dst = reinterpret_cast<std::uintptr_t>(dst) + static_cast<std::uint64_t>(dst_offset * out_bytes);
  return c;
}

/// A batch of copies for one launch. add() validates; finish() lowers every
/// copy to the batch's element size and rank and assigns blocks. After
/// finish(), boxes() is what the kernel reads (upload it as is).
class BoxBatch {
 public:
  /// A copy of elements of `element_bytes` bytes (any size >= 1) without a cast.
  void add(const BoxCopy& c, std::int64_t element_bytes) {
    check(c);
    if (element_bytes < 1) fail("box copy: element size {} is below 1 byte", element_bytes);
    if (finished_) fail("box copy: add() after finish(); clear() first");
    boxes_.push_back(c);
    bytes_.push_back(element_bytes);
  }
  void clear() {
    boxes_.clear();
    bytes_.clear();
    finished_ = false;
  }
  bool empty() const { return boxes_.empty(); }
  std::size_t size() const { return boxes_.size(); }
  std::span<const BoxCopy> boxes() const { return boxes_; }

  /// Identity copies: lowers to the largest power of two (<= 16) that divides
  /// every element size and every origin address, so each access is aligned.
  BatchLaunch finish() {
    std::int64_t g = 16;
    for (std::size_t i = 0; i < boxes_.size(); ++i) {
      g = std::min({g, batch_detail::low_bit(static_cast<std::uint64_t>(bytes_[i])), batch_detail::low_bit(boxes_[i].src),
                    batch_detail::low_bit(boxes_[i].dst)});
    }
    for (std::size_t i = 0; i < boxes_.size(); ++i) {
      batch_detail::collapse(boxes_[i]);
      batch_detail::lower_element(boxes_[i], bytes_[i], g);
    }
    return finish_common(static_cast<int>(g), static_cast<int>(g), true, batch_detail::block_elems_for(static_cast<int>(g), static_cast<int>(g)));
  }

  /// Copies with a cast in flight: every copy must have been added with
  /// element_bytes == sizeof(Cast::In), origins aligned to the element words.
  template <class Cast>
  BatchLaunch finish_cast() {
    constexpr int IB = batch_detail::in_bytes<Cast>, OB = batch_detail::out_bytes<Cast>;
    for (std::size_t i = 0; i < boxes_.size(); ++i) {
      if (bytes_[i] != IB) fail("box copy: a cast from {}-byte elements got a copy of {}-byte elements", IB, bytes_[i]);
      if (boxes_[i].src % IB != 0 || boxes_[i].dst % OB != 0)
        fail("box copy: a cast copy needs the source aligned to {} bytes and the destination to {} (got addresses {:#x}, {:#x})", IB, OB,
             boxes_[i].src, boxes_[i].dst);
      batch_detail::collapse(boxes_[i]);
    }
    return finish_common(IB, OB, Cast::identity, batch_detail::block_elems<Cast>);
  }

 private:
  static void check(const BoxCopy& c) {
    if (c.rank < 1 || c.rank > kBoxCopyMaxRank) fail("box copy: box rank {} is outside 1..{}", c.rank, kBoxCopyMaxRank);
    for (int k = 0; k < c.rank; ++k)
      if (c.extent[k] < 0) fail("box copy: extent {} of dim {} is negative", c.extent[k], k);
    const std::int64_t n = batch_detail::box_size(c);
    if (c.first < 0 || c.count < 0 || c.first + c.count > n)
      fail("box copy: element range [{}, {}) is outside a box of {} elements", c.first, c.first + c.count, n);
  }
  BatchLaunch finish_common(int ib, int ob, bool identity, std::int64_t chunk) {
    // Empty copies take no block.
    std::size_t w = 0;
    for (std::size_t i = 0; i < boxes_.size(); ++i)
      if (boxes_[i].count > 0) boxes_[w++] = boxes_[i];
    boxes_.resize(w);
    bytes_.clear();
    BatchLaunch l;
    l.in_bytes = ib;
    l.out_bytes = ob;
    l.identity = identity;
    int R = 1;
    for (const auto& b : boxes_) R = std::max(R, b.rank);
    l.rank = R <= 4 ? R : 0;
    std::int64_t blocks = 0;
    for (auto& b : boxes_) {
      if (l.rank > 0) batch_detail::pad_rank(b, l.rank);
      b.block = blocks;
      blocks += (b.count + chunk - 1) / chunk;
      l.elements += b.count;
    }
    if (boxes_.size() > static_cast<std::size_t>(INT32_MAX)) fail("box copy: {} copies in one batch", boxes_.size());
    l.blocks = blocks;
    l.copies = static_cast<int>(boxes_.size());
    finished_ = true;
    return l;
  }

  std::vector<BoxCopy> boxes_;
  std::vector<std::int64_t> bytes_;
  bool finished_ = false;
};

// --- host reference ---------------------------------------------------------

/// The definition, one element at a time by multi-index, over host memory:
/// what every kernel launch must match. Works on any batch (finished or not)
/// with the given element sizes; `apply` maps one source element's bytes to
/// the destination's.
template <class Apply>
void copy_boxes_reference_with(std::span<const BoxCopy> boxes, std::int64_t in_bytes, std::int64_t out_bytes, Apply&& apply) {
  std::int64_t idx[kBoxCopyMaxRank];
  for (const BoxCopy& b : boxes) {
    for (std::int64_t e = b.first; e < b.first + b.count; ++e) {
      std::int64_t rem = e;
      for (int k = b.rank - 1; k >= 0; --k) {
        idx[k] = rem % b.extent[k];
        rem /= b.extent[k];
      }
      std::int64_t so = 0, dof = 0;
      for (int k = 0; k < b.rank; ++k) {
        so += idx[k] * b.src_stride[k];
        dof += idx[k] * b.dst_stride[k];
      }
      const auto* s = reinterpret_cast<const std::byte*>(static_cast<std::uintptr_t>(b.src + static_cast<std::uint64_t>(so * in_bytes)));
      auto* d = reinterpret_cast<std::byte*>(static_cast<std::uintptr_t>(b.dst + static_cast<std::uint64_t>(dof * out_bytes)));
      apply(s, d);
    }
  }
}
/// Identity copies of `element_bytes`-byte elements.
inline void copy_boxes_reference(std::span<const BoxCopy> boxes, std::int64_t element_bytes) {
  copy_boxes_reference_with(boxes, element_bytes, element_bytes,
                            [&](const std::byte* s, std::byte* d) { std::memcpy(d, s, static_cast<std::size_t>(element_bytes)); });
}
/// Copies with a cast in flight.
template <class Cast>
void copy_boxes_reference(std::span<const BoxCopy> boxes) {
  copy_boxes_reference_with(boxes, sizeof(typename Cast::In), sizeof(typename Cast::Out), [](const std::byte* s, std::byte* d) {
    typename Cast::In x;
    std::memcpy(&x, s, sizeof(x));
    const typename Cast::Out y = Cast::apply(x);
    std::memcpy(d, &y, sizeof(y));
  });
}

// --- the kernel, run on the CPU ---------------------------------------------

/// Runs a finished launch's kernel body on the host, every block and every
/// thread in turn (the body has no shared state between threads).
template <int R, class Cast>
void emulate_box_copies(std::span<const BoxCopy> boxes, const BatchLaunch& l) {
  for (std::int64_t blk = 0; blk < l.blocks; ++blk)
    for (int t = 0; t < batch_detail::kThreads; ++t)
      batch_detail::run_block<R, Cast>(boxes.data(), static_cast<int>(boxes.size()), blk, t);
}

/// Picks the rank instantiation as the launcher does.
template <class Cast>
void emulate_box_copies(std::span<const BoxCopy> boxes, const BatchLaunch& l) {
  if (boxes.empty()) return;
  switch (l.rank) {
    case 1: emulate_box_copies<1, Cast>(boxes, l); return;
    case 2: emulate_box_copies<2, Cast>(boxes, l); return;
    case 3: emulate_box_copies<3, Cast>(boxes, l); return;
    case 4: emulate_box_copies<4, Cast>(boxes, l); return;
    default: emulate_box_copies<0, Cast>(boxes, l); return;
  }
}
/// Identity launch of any finished batch (element size from the launch).
inline void emulate_box_copies(std::span<const BoxCopy> boxes, const BatchLaunch& l) {
  switch (l.in_bytes) {
    case 1: emulate_box_copies<Identity<1>>(boxes, l); return;
    case 2: emulate_box_copies<Identity<2>>(boxes, l); return;
    case 4: emulate_box_copies<Identity<4>>(boxes, l); return;
    case 8: emulate_box_copies<Identity<8>>(boxes, l); return;
    case 16: emulate_box_copies<Identity<16>>(boxes, l); return;
    default: fail("box copy: a finished batch has element size {}", l.in_bytes);
  }
}

}  // namespace reshard::cuda
