#pragma once
// CUDA quantize kernels for FP8 destinations: the device counterpart of the
// host kernel quantize_tiles (quantize.hpp, docs/fp8.md), bit for bit.
//
//  * One launch quantizes a batch of tiles (QuantTile descriptors: source
//    rows, FP8 rows, scale entry), so a wave of tiles is one launch. The
//    scheme is the launch's; each tile has its own source dtype (bf16, f16
//    or f32).
//  * block: one thread block of 256 threads per tile (128x128 = 64 elements
//    per thread); mx: one warp per tile (32 elements), 8 tiles per block.
//  * Same recipe and same operations as the host's quantize_rows_body: amax
//    on the magnitude bits (an integer max: no order of float compares to
//    get wrong), the quotient 448 / amax and the scale amax / 448 as IEEE
//    f32 divisions, x * mul as one f32 multiply, and the one E4M3 encoder
//    (e4m3_from_f32, shared with the host through RESHARD_HD). Exact only
//    without --use_fast_math / -prec-div=false / -ftz=true (nvcc's defaults
//    are exact; the fused multiply-add nvcc may form inside e4m3_from_f32
//    adds to a product that is exact, so it rounds alike).
//  * NaN: a code is NaN (0x7F / 0xFF) where the host's is, but its sign bit
//    may differ: the GPU's NaN results are the canonical positive NaN, x86's
//    are negative (e.g. inf * 0 in a block tile holding an infinity).
//  * Everything runs on the caller's stream; nothing synchronizes.
//
//   reshard::cuda::TileQuantizer q(stream);
//   std::vector<reshard::cuda::QuantTile> tiles = ...;   // device addresses
//   q.run(reshard::QuantScheme::block, tiles);           // one upload + one launch
//
// Compile with nvcc (-std=c++20); link CUDA::cudart.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <span>

#include "../base/error.hpp"
#include "../layout/quantize.hpp"
#include "descriptor_upload.hpp"
#include "quant_tile.hpp"
#include "runtime.hpp"

namespace reshard::cuda {

namespace quant_detail {

inline constexpr int kThreads = 256;
inline constexpr int kMxTilesPerBlock = kThreads / 32;

/// Magnitude bits of source element i (an integer whose order is the magnitudes').
template <DType D>
__device__ inline std::uint32_t magnitude(const unsigned char* p, std::int64_t i) {
  if constexpr (D == DType::f32)
    return reinterpret_cast<const std::uint32_t*>(p)[i] & 0x7FFFFFFFu;
  else
    return reinterpret_cast<const std::uint16_t*>(p)[i] & 0x7FFFu;
}

/// The f32 value of magnitude bits m (as the host's load of its max).
template <DType D>
__device__ inline float from_bits(std::uint32_t m) {
  if constexpr (D == DType::f32)
    return std::bit_cast<float>(m);
  else if constexpr (D == DType::bf16)
    return f32_from_bf16(static_cast<std::uint16_t>(m));
  else
    return f32_from_f16(static_cast<std::uint16_t>(m));
}

template <DType D>
__device__ inline float load(const unsigned char* p, std::int64_t i) {
  if constexpr (D == DType::f32)
    return reinterpret_cast<const float*>(p)[i];
  else
    return from_bits<D>(reinterpret_cast<const std::uint16_t*>(p)[i]);
}

/// Quantizes tile t with a group of G threads (lane 0..G-1): G = 32 is one
/// warp; G > 32 is the whole thread block, with `warp_max` (G / 32 entries
/// of shared memory) for the cross-warp max. Every thread of the group calls it.
template <QuantScheme S, int G, DType D>
__device__ inline void quantize_tile(const QuantTile& t, int lane, std::uint32_t* warp_max) {
  const auto* src = reinterpret_cast<const unsigned char*>(t.src);
  auto* dst = reinterpret_cast<std::uint8_t*>(t.dst);
  const std::int64_t cols = t.cols, n = static_cast<std::int64_t>(t.rows) * cols;
  std::uint32_t m = 0;
  for (std::int64_t e = lane; e < n; e += G) {
    const std::int64_t r = e / cols, c = e - r * cols;
    m = max(m, magnitude<D>(src, r * t.src_stride + c));
  }
  m = __reduce_max_sync(0xFFFFFFFFu, m);
  if constexpr (G > 32) {
    if (lane % 32 == 0) warp_max[lane / 32] = m;
    __syncthreads();
    for (int w = 0; w < G / 32; ++w) m = max(m, warp_max[w]);
    __syncthreads();  // warp_max is free for the next tile
  }
  float amax = from_bits<D>(m);
  float mul;
  if constexpr (S == QuantScheme::block) {
    amax = amax < kBlockAmaxFloor ? kBlockAmaxFloor : amax;  // std::max(amax, floor), NaN included
    mul = kE4M3Max / amax;
  } else {
    if (m == 0) {  // all zero (either sign): codes 0, scale byte 0
      for (std::int64_t e = lane; e < n; e += G) {
        const std::int64_t r = e / cols, c = e - r * cols;
        dst[r * t.dst_stride + c] = 0;
      }
      if (lane == 0) *reinterpret_cast<std::uint8_t*>(t.scale) = 0;
      return;
    }
    mul = exp2_int(-mx_exponent(amax));  // 2^-e, exact
  }
  for (std::int64_t e = lane; e < n; e += G) {
    const std::int64_t r = e / cols, c = e - r * cols;
    dst[r * t.dst_stride + c] = e4m3_from_f32(load<D>(src, r * t.src_stride + c) * mul);
  }
  if (lane == 0) {
    if constexpr (S == QuantScheme::block) {
      const float inv = amax / kE4M3Max;
      std::memcpy(reinterpret_cast<void*>(t.scale), &inv, 4);  // the scale entry may sit at any byte offset
    } else {
      *reinterpret_cast<std::uint8_t*>(t.scale) = static_cast<std::uint8_t>(mx_exponent(amax) + 127);
    }
  }
}

template <QuantScheme S, int G>
__device__ inline void quantize_tile_any(const QuantTile& t, int lane, std::uint32_t* warp_max) {
  switch (t.dtype) {
    case DType::bf16: quantize_tile<S, G, DType::bf16>(t, lane, warp_max); break;
    case DType::f16: quantize_tile<S, G, DType::f16>(t, lane, warp_max); break;
    default: quantize_tile<S, G, DType::f32>(t, lane, warp_max); break;  // checked on the host: f32
  }
}

}  // namespace quant_detail

/// block: thread block b quantizes tiles b, b + gridDim.x, ...; mx: warp w
/// of thread block b quantizes tiles 8b + w, then 8 gridDim.x further, ...
/// (A template, as every kernel of a header: a plain __global__ function
/// would be defined again in each translation unit that includes it.)
template <QuantScheme S>
__global__ void __launch_bounds__(quant_detail::kThreads) quantize_tiles_kernel(const QuantTile* tiles, std::int64_t n) {
  using namespace quant_detail;
  if constexpr (S == QuantScheme::block) {
    __shared__ std::uint32_t warp_max[kThreads / 32];
    for (std::int64_t i = blockIdx.x; i < n; i += gridDim.x) quantize_tile_any<S, kThreads>(tiles[i], static_cast<int>(threadIdx.x), warp_max);
  } else {
    const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * kMxTilesPerBlock;
    for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * kMxTilesPerBlock + threadIdx.x / 32; i < n; i += stride)
      quantize_tile_any<S, 32>(tiles[i], static_cast<int>(threadIdx.x % 32), nullptr);
  }
}

/// Launches the quantizing of n tiles whose descriptors are in device memory.
inline void launch_quantize_tiles(QuantScheme scheme, const QuantTile* device_tiles, std::int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  constexpr std::int64_t kMaxGrid = 1 << 20;  // more tiles: the blocks loop
  const dim3 block(quant_detail::kThreads);
  if (scheme == QuantScheme::block) {
    const dim3 grid(static_cast<unsigned>(std::min(kMaxGrid, n)));
    quantize_tiles_kernel<QuantScheme::block><<<grid, block, 0, stream>>>(device_tiles, n);
  } else {
    const dim3 grid(static_cast<unsigned>(std::min(kMaxGrid, (n + quant_detail::kMxTilesPerBlock - 1) / quant_detail::kMxTilesPerBlock)));
    quantize_tiles_kernel<QuantScheme::mx><<<grid, block, 0, stream>>>(device_tiles, n);
  }
  check_cuda(cudaGetLastError(), "launching the quantize kernel");
}

/// Uploads tile descriptors and launches them on one stream (one launch per
/// run). Not thread-safe; one per stream.
class TileQuantizer {
 public:
  explicit TileQuantizer(cudaStream_t stream = nullptr) : upload_(stream) {}
  cudaStream_t stream() const { return upload_.stream(); }
  void run(QuantScheme scheme, std::span<const QuantTile> tiles) {
    check_quant_tiles(tiles);
    if (tiles.empty()) return;
    launch_quantize_tiles(scheme, upload_.upload(tiles), static_cast<std::int64_t>(tiles.size()), upload_.stream());
  }
  void synchronize() { check_cuda(cudaStreamSynchronize(upload_.stream()), "cudaStreamSynchronize after quantizing"); }

 private:
  DescriptorUpload<QuantTile> upload_;
};

}  // namespace reshard::cuda
