#pragma once
// A rank's buffers under a layout, as a caller allocates and fills them:
// rank_buffers() lists each buffer (name, local shape, dtype) and the tensor
// pieces in it with the global indices each piece holds per dim;
// for_each_slot_run() walks a buffer's slots in runs with the global index of
// each, so filling a shard or checking one needs no hand arithmetic.
//
//   for (const auto& b : reshard::rank_buffers(layout, rank)) {
//     std::vector<float> mem(b.elements);
//     reshard::for_each_slot_run(layout, b, [&](std::int64_t at, std::int64_t n, int tensor, std::int64_t g) {
//       for (std::int64_t i = 0; i < n; ++i) mem[at + i] = tensor < 0 ? 0.f : value(tensor, g + i);
//     });
//   }
#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "../base/multi_index.hpp"
#include "layout.hpp"
#include "storage.hpp"

namespace reshard {

/// One tensor's piece inside a rank's buffer.
struct BufferPart {
  int tensor = -1;                    ///< tensor id in the layout
  std::string name;                   ///< tensor name
  std::vector<std::int64_t> extents;  ///< the piece's local array extents
  /// Per dim, which global indices the piece holds: [lo, hi) of the padded
  /// extent, or every B-block p of k (cyclic); DimPart::global(j) maps local
  /// index j to the global one.
  std::vector<DimPart> dims;
};

/// One buffer a rank holds under a layout: what to allocate.
struct RankBuffer {
  int id = -1;                      ///< id into Layout::local_buffers() (the schedule's buffer ids)
  std::int64_t position = 0;        ///< the rank's mesh position
  std::string name;
  DType dtype = DType::f32;
  std::vector<std::int64_t> shape;  ///< local shape (1-D for a flat bucket)
  std::int64_t elements = 0, bytes = 0;
  std::vector<BufferPart> parts;    ///< tensors with elements here, in buffer order
};

/// The buffers global rank `rank` holds under L (none when the rank is not
/// in L's mesh), in Layout::local_buffers() order.
inline std::vector<RankBuffer> rank_buffers(const Layout& L, std::int64_t rank) {
  std::vector<RankBuffer> out;
  const auto pos = L.mesh.position_of(rank);
  if (!pos) return out;
  const auto& lbs = L.local_buffers();
  for (std::size_t b = 0; b < lbs.size(); ++b) {
    auto shape = buffer_shape(L, *pos, static_cast<int>(b));
    if (shape.empty()) continue;
    RankBuffer rb;
    rb.id = static_cast<int>(b);
    rb.position = *pos;
    rb.name = lbs[b].name;
    rb.dtype = lbs[b].dtype;
    rb.elements = product(shape);
    rb.bytes = rb.elements * element_bytes(rb.dtype);
    rb.shape = std::move(shape);
    for (int t : lbs[b].tensors) {
      if (!L.holds(*pos, t)) continue;
      BufferPart p;
      p.tensor = t;
      p.name = L.tensors[static_cast<std::size_t>(t)].name;
      p.extents = L.local_extents(*pos, t);
      for (int d = 0; d < L.tensors[static_cast<std::size_t>(t)].rank(); ++d) p.dims.push_back(L.dim_part(*pos, t, d));
      rb.parts.push_back(std::move(p));
    }
    out.push_back(std::move(rb));
  }
  return out;
}

/// Visits the slots of local buffer `buf` on mesh position `pos` in runs:
/// f(first buffer element, count, tensor id or -1 for padding, global
/// row-major index of the first element; consecutive along the run).
template <class F>
void for_each_slot_run(const Layout& L, std::int64_t pos, int buf, F&& f) {
  const auto& lb = L.local_buffers()[static_cast<std::size_t>(buf)];
  if (lb.spec >= 0 && L.buffers[static_cast<std::size_t>(lb.spec)].kind == BufferKind::flat) {
    // A padded flat sequence: the rank's range may run past the real elements.
    const FlatRange fr = flat_range(L, pos, L.buffers[static_cast<std::size_t>(lb.spec)]);
    // (Ranks whose range lies wholly in the padding past the end may hold
    // nothing at all: no empty run, their buffer may have no storage.)
    const std::int64_t a = std::max(fr.lo, fr.length);
    if (fr.any && fr.hi > a) f(a - fr.lo, fr.hi - a, -1, std::int64_t{-1});
  }
  for (int t : lb.tensors) {
    const TensorStorage st = tensor_storage(L, pos, t);
    if (st.empty()) continue;
    const auto& ts = L.tensors[static_cast<std::size_t>(t)];
    const int n = ts.rank();
    std::vector<std::int64_t> gstride(static_cast<std::size_t>(n), 1);
    for (int d = n - 2; d >= 0; --d)
      gstride[static_cast<std::size_t>(d)] = gstride[static_cast<std::size_t>(d) + 1] * ts.shape[static_cast<std::size_t>(d) + 1];
    const auto in = static_cast<std::size_t>(n - 1);
    const DimPart& ip = st.parts[in];
    for (const HeldBox& hb : st.boxes) {
      bool empty = false;
      for (int d = 0; d < n; ++d) empty |= hb.lo[static_cast<std::size_t>(d)] >= hb.hi[static_cast<std::size_t>(d)];
      if (empty) continue;
      std::vector<std::int64_t> j(hb.lo.begin(), hb.lo.begin() + n);
      while (true) {
        // Outer dims: buffer offset, global offset, padding.
        std::int64_t boff = hb.base, goff = 0;
        bool pad = false;
        for (int d = 0; d < n - 1; ++d) {
          const auto u = static_cast<std::size_t>(d);
          boff += j[u] * hb.stride[u];
          const std::int64_t g = st.parts[u].global(j[u]);
          pad |= g >= ts.shape[u];
          goff += g * gstride[u];
        }
        boff += hb.lo[in] * hb.stride[in];
        // Inner dim: runs of consecutive global indices (all of it when not cyclic).
        std::int64_t k = hb.lo[in];
        while (k < hb.hi[in]) {
          const std::int64_t g = ip.global(k);
          std::int64_t end = hb.hi[in];
          if (ip.cyclic) end = std::min(end, k + (ip.run_end(g) - g));
          const std::int64_t real_end = std::min(end, k + std::max<std::int64_t>(0, ts.shape[in] - g));
          const std::int64_t b0 = boff + (k - hb.lo[in]) * hb.stride[in];
          if (hb.stride[in] != 1) {  // not expected from the contract's storage; go one by one
            for (std::int64_t q = k; q < end; ++q) {
              const std::int64_t gq = ip.global(q);
              const bool p = pad || gq >= ts.shape[in];
              f(boff + (q - hb.lo[in]) * hb.stride[in], std::int64_t{1}, p ? -1 : t, p ? -1 : goff + gq);
            }
          } else {
            if (real_end > k) f(b0, real_end - k, pad ? -1 : t, pad ? -1 : goff + g);
            if (end > real_end && real_end >= k) f(b0 + (real_end - k), end - real_end, -1, std::int64_t{-1});
          }
          k = end;
        }
        if (!next_index(j, n - 1, [&](std::size_t d) { return hb.lo[d]; }, [&](std::size_t d) { return hb.hi[d]; })) break;
      }
    }
  }
}

/// The same over a buffer rank_buffers() listed.
template <class F>
void for_each_slot_run(const Layout& L, const RankBuffer& b, F&& f) {
  for_each_slot_run(L, b.position, b.id, std::forward<F>(f));
}

}  // namespace reshard
