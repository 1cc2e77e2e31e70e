#pragma once
// Binding a caller's buffers: one rank's BufferViews under one layout,
// checked and turned into the executor's BoundBuffers (indexed like the
// layout's local_buffers(), so like a schedule's buffer ids).
//
//   auto src = reshard::bind_buffers(train, rank, bufs.src, "source");
//   auto dst = reshard::bind_buffers(infer, rank, bufs.dst, "destination");
//   reshard::check_no_overlap(rank, {&src}, {&dst});
//   executor.setup(schedule, reshard::bound_pointers(src), reshard::bound_pointers(dst), transport);
//
// Resharder binds this way; so do the tools and tests that drive an
// Executor or a StagedExecutor themselves, so every path checks the same:
// a missing or unknown buffer, one too small for its layout, a wrong element
// size, a null pointer, a view whose shape is not the layout's or whose
// strides map two elements to one place, device memory without a copy
// engine, destination memory overlapping anything.
#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <map>
#include <numeric>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include <fmt/format.h>

#include "../base/error.hpp"
#include "../layout/layout.hpp"
#include "../layout/storage.hpp"
#include "executor.hpp"

namespace reshard {

/// A caller's buffer: a pointer and how many elements it holds (the plain
/// case), or an mdspan-style strided view (shape + element strides) when the
/// buffer lives inside a larger allocation. Source buffers are only read.
struct BufferView {
  void* data = nullptr;
  std::int64_t elements = 0;       ///< elements reachable from data (0 with a strided view: its span)
  std::int64_t element_bytes = 0;  ///< must equal the layout's dtype size
  std::vector<std::int64_t> shape, strides;  ///< strided view: extents and element strides
  MemoryKind memory = MemoryKind::host;
};

/// A dense buffer of n elements of T at p.
template <class T>
BufferView view_of(T* p, std::size_t n) {
  return BufferView{const_cast<std::remove_const_t<T>*>(p), static_cast<std::int64_t>(n), static_cast<std::int64_t>(sizeof(T)), {}, {}, MemoryKind::host};
}
template <class T>
BufferView view_of(std::span<T> s) {
  return view_of(s.data(), s.size());
}
/// A dense buffer given as raw bytes with a runtime element size (bf16, fp8 ...).
inline BufferView bytes_view(void* p, std::size_t bytes, std::int64_t element_bytes) {
  if (element_bytes <= 0 || bytes % static_cast<std::size_t>(element_bytes) != 0)
    fail("bytes_view: {} bytes is not a whole number of {}-byte elements", bytes, element_bytes);
  return BufferView{p, static_cast<std::int64_t>(bytes) / element_bytes, element_bytes, {}, {}, MemoryKind::host};
}
/// A strided view (std::layout_stride): element (i0, i1, ...) at p[sum i_k * strides[k]].
template <class T>
BufferView strided_view(T* p, std::vector<std::int64_t> shape, std::vector<std::int64_t> strides) {
  return BufferView{const_cast<std::remove_const_t<T>*>(p), 0, static_cast<std::int64_t>(sizeof(T)), std::move(shape), std::move(strides),
                    MemoryKind::host};
}

/// Checks `given` (rank `rank`'s buffers under `L`, by local buffer name)
/// against what the layout gives that rank, and returns one BoundBuffer per
/// local buffer of `L` (data == nullptr where the rank has none). `side`
/// names the set in errors ("source", "destination" ...). Device memory is
/// refused unless `device_engine` (a DeviceCopyEngine will be set).
inline std::vector<BoundBuffer> bind_buffers(const Layout& L, std::int64_t rank, const std::map<std::string, BufferView>& given,
                                             const char* side, bool device_engine = false) {
  const auto& lbs = L.local_buffers();
  std::vector<BoundBuffer> out(lbs.size());
  const auto pos = L.mesh.position_of(rank);
  std::vector<std::string> expected;
  for (std::size_t b = 0; b < lbs.size(); ++b) {
    const auto shape = pos ? buffer_shape(L, *pos, static_cast<int>(b)) : std::vector<std::int64_t>{};
    if (shape.empty()) continue;
    expected.push_back(lbs[b].name);
    const std::int64_t need = product(shape);
    const std::int64_t eb = element_bytes(lbs[b].dtype);
    auto it = given.find(lbs[b].name);
    if (it == given.end()) {
      // A misspelt name shows up here first: name the keys given that the layout does not know.
      std::vector<std::string> unknown;
      for (const auto& g : given)
        if (L.find_buffer(g.first) < 0) unknown.push_back("'" + g.first + "'");
      fail("rank {}: {} buffer '{}' is missing: {} needs it on this rank ({} elements of {}, shape [{}]){}", rank, side, lbs[b].name, L.origin,
           need, to_string(lbs[b].dtype), fmt::join(shape, ", "),
           unknown.empty() ? std::string() : fmt::format("; given but not buffers of {}: {}", L.origin, fmt::join(unknown, ", ")));
    }
    const BufferView& v = it->second;
    if (v.element_bytes != eb)
      fail("rank {}: {} buffer '{}' has {}-byte elements but the layout stores {} ({} bytes)", rank, side, lbs[b].name, v.element_bytes,
           to_string(lbs[b].dtype), eb);
    if (need > 0 && !v.data) fail("rank {}: {} buffer '{}' has a null pointer", rank, side, lbs[b].name);
    if (v.memory != MemoryKind::host && !device_engine)
      fail("rank {}: {} buffer '{}' is device memory: set ResharderOptions::executor.device to a DeviceCopyEngine "
           "(reshard::cuda::CudaCopyEngine, cuda/device_engine.cuh) to refit GPU memory", rank, side, lbs[b].name);
    BoundBuffer bb;
    bb.name = lbs[b].name;
    bb.data = static_cast<std::byte*>(v.data);
    bb.element_bytes = eb;
    bb.shape = shape;
    bb.memory = v.memory;
    if (!v.shape.empty() || !v.strides.empty()) {
      if (v.shape != shape)
        fail("rank {}: {} buffer '{}': the view has shape [{}] but the layout gives this rank shape [{}]", rank, side, lbs[b].name,
             fmt::join(v.shape, ", "), fmt::join(shape, ", "));
      if (v.strides.size() != shape.size())
        fail("rank {}: {} buffer '{}': the view has {} strides for {} dims", rank, side, lbs[b].name, v.strides.size(), shape.size());
      // Injective: sorted by stride, each stride passes the span of the smaller ones.
      std::vector<std::size_t> order(shape.size());
      std::iota(order.begin(), order.end(), 0);
      std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t c) { return v.strides[a] < v.strides[c]; });
      std::int64_t span = 1;
      for (auto d : order) {
        if (shape[d] == 1) continue;
        if (v.strides[d] < span)
          fail("rank {}: {} buffer '{}': view strides [{}] map two elements to one place", rank, side, lbs[b].name, fmt::join(v.strides, ", "));
        span = v.strides[d] * (shape[d] - 1) + span;
      }
      bb.strides = v.strides;
      if (v.elements > 0 && bb.span_elements() > v.elements)
        fail("rank {}: {} buffer '{}': the view reaches {} elements but only {} were given", rank, side, lbs[b].name, bb.span_elements(),
             v.elements);
    } else if (v.elements < need) {
      fail("rank {}: {} buffer '{}' is too small: {} elements given, {} needs {} (shape [{}])", rank, side, lbs[b].name, v.elements,
           L.origin, need, fmt::join(shape, ", "));
    }
    out[b] = std::move(bb);
  }
  for (const auto& [name, v] : given) {
    const int b = L.find_buffer(name);
    const std::string has = expected.empty() ? std::string("none") : fmt::format("{}", fmt::join(expected, ", "));
    if (b < 0) fail("rank {}: {} buffer '{}' is not a buffer of {} (this rank has: {})", rank, side, name, L.origin, has);
    if (std::find(expected.begin(), expected.end(), name) == expected.end())
      fail("rank {}: {} buffer '{}' was given but {} gives this rank no such buffer (it has: {})", rank, side, name, L.origin, has);
  }
  return out;
}

/// Destination memory must not overlap anything (source or destination):
/// a refit would corrupt it. Sources may overlap each other (only read).
inline void check_no_overlap(std::int64_t rank, std::initializer_list<const std::vector<BoundBuffer>*> sources,
                             std::initializer_list<const std::vector<BoundBuffer>*> destinations) {
  struct Range {
    const std::byte *lo, *hi;
    const BoundBuffer* b;
    bool dst;
  };
  std::vector<Range> ranges;
  auto add = [&](const std::vector<BoundBuffer>& set, bool dst) {
    for (const auto& b : set)
      if (b.data) ranges.push_back({b.data, b.data + b.span_elements() * b.element_bytes, &b, dst});
  };
  for (const auto* s : sources) add(*s, false);
  for (const auto* d : destinations) add(*d, true);
  std::sort(ranges.begin(), ranges.end(), [](const Range& a, const Range& b) { return a.lo < b.lo; });
  for (std::size_t i = 0; i < ranges.size(); ++i)
    for (std::size_t j = i + 1; j < ranges.size() && ranges[j].lo < ranges[i].hi; ++j)
      if (ranges[i].dst || ranges[j].dst)
        fail("rank {}: {} buffer '{}' and {} buffer '{}' overlap in memory (reshard does not refit in place)", rank,
             ranges[i].dst ? "destination" : "source", ranges[i].b->name, ranges[j].dst ? "destination" : "source", ranges[j].b->name);
}

/// What Executor::setup / StagedExecutor::setup take: a pointer per buffer
/// id, nullptr where this rank has no such buffer.
inline std::vector<const BoundBuffer*> bound_pointers(const std::vector<BoundBuffer>& v) {
  std::vector<const BoundBuffer*> p;
  p.reserve(v.size());
  for (const auto& b : v) p.push_back(b.data ? &b : nullptr);
  return p;
}

}  // namespace reshard
