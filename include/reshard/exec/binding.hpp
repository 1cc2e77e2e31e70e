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
#include <array>
#include <concepts>
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

/// A handle to a tensor whose element type its layout fixes (st::LayoutOf::
/// add<E>): it names the tensor and gives its element type and, where its
/// type knows it, its number of dims.
template <class H>
concept TypedTensorHandle = requires(const H& h) {
  typename H::element_type;
  { h.name } -> std::convertible_to<std::string>;
  { H::static_rank() } -> std::convertible_to<int>;
} && !std::is_void_v<typename H::element_type>;

// Typed binding misuse: one function per kind, its template arguments name
// the types at fault, its message says what (as in static_layout.hpp).
namespace diagnostic {
template <class H>
constexpr void bind_takes_a_typed_tensor_handle() {
  static_assert(!std::is_same_v<H, H>,
                "reshard::bind_tensor takes the handle st::LayoutOf::add<E>(...) returned, which fixes the tensor's element type E; "
                "a handle from add(...) without <E> is untyped: bind that tensor's memory by buffer name (view_of)");
}
template <class Tensor, class Given>
constexpr void bound_memory_is_not_of_the_tensors_element_type() {
  static_assert(!std::is_same_v<Tensor, Tensor>,
                "the memory bound to a tensor must be of its element type (the E of add<E>): a bf16 tensor takes "
                "reshard::bf16_t, an f32 one float");
}
template <int tensor_dims, std::size_t view_dims>
constexpr void strided_view_rank_is_not_the_tensors() {
  static_assert(tensor_dims < 0,
                "a strided view bound to a tensor has one extent and one stride per dim of the tensor");
}
}  // namespace diagnostic

namespace detail {
/// The compile-time checks of bind_tensor(): a typed handle, memory of its element
/// type, and (N >= 0: a strided view of N dims) its number of dims.
template <class H, class U, int N>
constexpr bool check_typed_binding() {
  if constexpr (!TypedTensorHandle<H>) {
    diagnostic::bind_takes_a_typed_tensor_handle<H>();
    return false;
  } else if constexpr (!std::is_same_v<std::remove_const_t<U>, typename H::element_type>) {
    diagnostic::bound_memory_is_not_of_the_tensors_element_type<typename H::element_type, U>();
    return false;
  } else if constexpr (N >= 0 && H::static_rank() >= 0 && N != H::static_rank()) {
    diagnostic::strided_view_rank_is_not_the_tensors<H::static_rank(), static_cast<std::size_t>(N)>();
    return false;
  } else {
    return true;
  }
}
inline void put_typed_binding(std::map<std::string, BufferView>& side, const std::string& tensor, BufferView v) {
  if (tensor.empty()) fail("bind_tensor: the tensor handle is empty (not one that st::LayoutOf::add<E> returned)");
  if (!side.emplace(tensor, std::move(v)).second) fail("bind_tensor: tensor '{}' is already bound in this buffer set", tensor);
}
}  // namespace detail

/// Binds memory to a tensor stored alone (its own local buffer), through the
/// handle st::LayoutOf::add<E>() gave it, into one side of LocalBuffers:
///   reshard::bind_tensor(bufs.src, q, std::span<const reshard::bf16_t>(q_memory));
/// Memory of another element type, or an untyped handle, does not compile;
/// the extents (this rank's shard of the tensor) are checked at setup like
/// any view's (bind_buffers), and a tensor that is a part of a fused buffer
/// is refused there (bind the buffer by its name).
template <class H, class U>
void bind_tensor(std::map<std::string, BufferView>& side, const H& tensor, std::span<U> memory, MemoryKind kind = MemoryKind::host) {
  if constexpr (detail::check_typed_binding<H, U, -1>()) {
    BufferView v = view_of(memory);
    v.memory = kind;
    detail::put_typed_binding(side, tensor.name, std::move(v));
  }
}
/// The same with a strided view (std::layout_stride) of N dims: N must be
/// the tensor's number of dims where its type knows it.
template <class H, class U, std::size_t N>
void bind_tensor(std::map<std::string, BufferView>& side, const H& tensor, U* memory, const std::array<std::int64_t, N>& shape,
                 const std::array<std::int64_t, N>& strides, MemoryKind kind = MemoryKind::host) {
  if constexpr (detail::check_typed_binding<H, U, static_cast<int>(N)>()) {
    BufferView v = strided_view(memory, {shape.begin(), shape.end()}, {strides.begin(), strides.end()});
    v.memory = kind;
    detail::put_typed_binding(side, tensor.name, std::move(v));
  }
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
    if (const int t = b < 0 ? L.find_tensor(name) : -1; t >= 0)
      fail("rank {}: {} buffer '{}': tensor '{}' of {} is a part of buffer '{}', which is bound by its own name (this rank has: {})", rank,
           side, name, name, L.origin, lbs[static_cast<std::size_t>(L.buffer_of(t))].name, has);
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
