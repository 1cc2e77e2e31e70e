#pragma once
// A tile to quantize, as the device engine takes it: the descriptor of the
// CUDA quantize kernel (quantize_kernels.cuh) and of its host emulation here,
// so that plain C++ (the executor's engine interface, QuantRefit, CPU tests
// of the device path) can build and run tiles without nvcc.
#include <cstdint>
#include <span>
#include <vector>

#include "../base/error.hpp"
#include "../layout/quantize.hpp"

namespace reshard::cuda {

/// One tile: `rows` rows of `cols` contiguous elements (the tile's extent
/// along the trailing dim), row r's source at src + r * src_stride elements
/// and its FP8 codes at dst + r * dst_stride bytes. A block tile over one
/// dim is one row; over two dims, rows along the second-last. (Tiles over
/// three or more dims are not described by one stride: not supported.)
struct QuantTile {
  std::uint64_t src = 0;    ///< address of the tile's first source element
  std::uint64_t dst = 0;    ///< address of its first FP8 code
  std::uint64_t scale = 0;  ///< address of its scale entry (f32 for block, E8M0 byte for mx)
  std::int64_t src_stride = 0, dst_stride = 0;  ///< between rows: source elements, FP8 bytes
  std::int32_t rows = 0, cols = 0;
  DType dtype = DType::bf16;  ///< source dtype: bf16, f16 or f32
};

/// Checks what the kernel cannot report: source dtypes, and non-negative extents.
inline void check_quant_tiles(std::span<const QuantTile> tiles) {
  for (const QuantTile& t : tiles) {
    if (t.dtype != DType::bf16 && t.dtype != DType::f16 && t.dtype != DType::f32)
      fail("quantize: source dtype {} is not bf16, f16 or f32", to_string(t.dtype));
    if (t.rows < 0 || t.cols < 0) fail("quantize: a tile of {} x {} elements", t.rows, t.cols);
  }
}

/// The kernel's work on the host, tile by tile, through the host kernel
/// (quantize_rows): for engines whose "device" memory is host memory (CPU
/// tests of the device path). Rows of one tile share one stride on both sides.
inline void emulate_quant_tiles(QuantScheme scheme, std::span<const QuantTile> tiles) {
  check_quant_tiles(tiles);
  std::vector<std::int64_t> rows;
  for (const QuantTile& t : tiles) {
    if (t.rows > 1 && t.src_stride != t.dst_stride)
      fail("quantize (host emulation): a tile's source and FP8 row strides differ ({} and {})", t.src_stride, t.dst_stride);
    rows.clear();
    for (std::int64_t r = 0; r < t.rows; ++r) rows.insert(rows.end(), {r * t.src_stride, t.cols});
    quantize_rows(scheme, t.dtype, reinterpret_cast<const std::byte*>(t.src), reinterpret_cast<std::uint8_t*>(t.dst), rows.data(),
                  static_cast<std::size_t>(t.rows), reinterpret_cast<std::byte*>(t.scale));
  }
}

}  // namespace reshard::cuda
