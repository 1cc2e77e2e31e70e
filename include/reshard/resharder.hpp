#pragma once
// Resharder<Layout, Transport>: the object a training engine holds on each
// rank. Built once from the two layouts (training and inference), this rank's
// local buffers and a transport endpoint; refit() moves the weights every RL
// step by replaying the schedule the executor compiled at setup.
//
//   reshard::LocalBuffers bufs;
//   bufs.src["qkv"] = reshard::view_of(qkv_ptr, qkv_elements);      // pointer + size
//   bufs.dst["qkv_proj"] = reshard::strided_view(p, {rows, cols}, {pitch, 1});
//   reshard::Resharder<reshard::Layout, reshard::LocalTransport> r(train, infer, bufs, transport);
//   auto report = r.refit();   // collective: every rank of the world calls it
//
// Misuse is a reshard::Error naming the rank and the buffer: a missing or
// unknown buffer, one too small for its layout, a wrong element size, a view
// whose shape is not the layout's, overlapping destination memory, refit()
// before setup(). A failed refit throws (and aborts the transport so the
// peers fail too); it never returns a report.
#include <algorithm>
#include <concepts>
#include <cstdint>
#include <map>
#include <numeric>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include <fmt/format.h>

#include "error.hpp"
#include "executor.hpp"
#include "layout.hpp"
#include "plan.hpp"
#include "schedule.hpp"
#include "storage.hpp"
#include "transport.hpp"

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

/// This rank's buffers, by local buffer name under each layout (a fused
/// buffer's name, or a tensor's name when it is stored alone).
struct LocalBuffers {
  std::map<std::string, BufferView> src, dst;
};

struct ResharderOptions {
  ExecutorOptions executor;
  PlanOptions plan;  ///< only_rank is set to the transport's rank unless a schedule is given
  /// A schedule planned elsewhere (e.g. once for every thread of a process);
  /// it must hold every copy this rank sends or receives.
  std::shared_ptr<const Schedule> schedule;
};

/// What one refit did on this rank.
struct RefitReport {
  std::int64_t bytes_sent = 0, bytes_received = 0, local_bytes = 0;
  std::int64_t messages_sent = 0, messages_received = 0;
  std::int64_t zero_copy_bytes = 0, packed_bytes = 0, unpacked_bytes = 0;
  int waves = 0;
  std::int64_t staging_bytes = 0, peak_staging_bytes = 0, staging_budget = 0;
  double seconds = 0;
  /// The plan's bytes for this rank (what bytes_sent/received must equal).
  std::int64_t plan_bytes_sent = 0, plan_bytes_received = 0, plan_local_bytes = 0;
  std::int64_t refit_index = 0;  ///< 0 for the first refit of this Resharder
};

/// Anything that is, converts to, or lowers (`.lower()` / `.to_runtime()`)
/// to a runtime reshard::Layout.
template <class L>
concept LayoutDescription = std::same_as<std::remove_cvref_t<L>, Layout> || std::convertible_to<const L&, Layout> ||
                            requires(const L& l) {
                              { l.lower() } -> std::convertible_to<Layout>;
                            } || requires(const L& l) {
                              { l.to_runtime() } -> std::convertible_to<Layout>;
                            };

template <class L>
Layout lower_layout(const L& l) {
  static_assert(LayoutDescription<L>,
                "reshard::Resharder: the layout type must be reshard::Layout, convert to it, or have .lower() / .to_runtime() "
                "returning one");
  Layout out;
  if constexpr (std::same_as<std::remove_cvref_t<L>, Layout> || std::convertible_to<const L&, Layout>)
    out = l;
  else if constexpr (requires { l.lower(); })
    out = l.lower();
  else
    out = l.to_runtime();
  if (!out.validated()) out.validate();
  return out;
}

template <class LayoutT, class TransportT>
class Resharder {
  static_assert(LayoutDescription<LayoutT>,
                "reshard::Resharder<Layout, Transport>: Layout must be reshard::Layout, convert to it, or have .lower() / "
                ".to_runtime() returning one");
  static_assert(check_transport<TransportT>(), "reshard::Resharder<Layout, Transport>: Transport must model reshard::Transport");

 public:
  /// Plans and sets up in one step (collective over the transport's world).
  /// The two layouts may be of any types that lower to reshard::Layout (a
  /// compile-time training layout and a runtime inference layout, say).
  template <class Src, class Dst>
    requires LayoutDescription<Src> && LayoutDescription<Dst>
  Resharder(const Src& src, const Dst& dst, const LocalBuffers& buffers, TransportT& transport, ResharderOptions opt = {})
      : Resharder(src, dst, std::move(opt)) {
    setup(buffers, transport);
  }
  /// Keeps the layouts; setup() binds buffers and compiles later.
  template <class Src, class Dst>
    requires LayoutDescription<Src> && LayoutDescription<Dst>
  Resharder(const Src& src, const Dst& dst, ResharderOptions opt = {})
      : src_(lower_layout(src)), dst_(lower_layout(dst)), opt_(std::move(opt)) {
    src_of_dst_ = match_tensors(src_, dst_);  // same tensors on both sides, else a clear error now
  }

  /// Binds this rank's buffers, plans (this rank only, unless a schedule was
  /// given) and compiles the program. Collective. Errors on any rank make
  /// every rank's setup throw.
  void setup(const LocalBuffers& buffers, TransportT& transport) {
    ready_ = false;
    t_ = &transport;
    me_ = transport.rank();
    std::string error;
    try {
      if (opt_.schedule) {
        schedule_ = opt_.schedule;
      } else {
        PlanOptions po = opt_.plan;
        po.only_rank = me_;
        schedule_ = std::make_shared<const Schedule>(plan(src_, dst_, po));
      }
      bind(buffers);
    } catch (const std::exception& e) {
      error = e.what();
      if (!schedule_) schedule_ = std::make_shared<const Schedule>();
    }
    std::vector<const BoundBuffer*> s, d;
    for (const auto& b : src_bound_) s.push_back(b.data ? &b : nullptr);
    for (const auto& b : dst_bound_) d.push_back(b.data ? &b : nullptr);
    if (!error.empty()) {
      s.clear();
      d.clear();
    }
    executor_.setup(*schedule_, s, d, transport, opt_.executor, error);
    ready_ = true;
  }

  /// Moves every weight this rank sends or receives. Collective.
  RefitReport refit() {
    if (!ready_) fail("Resharder::refit on rank {}: setup() has not completed (bind the buffers and set up first)", me_);
    const ExecutorStats st = executor_.run();
    RefitReport r;
    r.bytes_sent = st.bytes_sent;
    r.bytes_received = st.bytes_received;
    r.local_bytes = st.local_bytes;
    r.messages_sent = st.messages_sent;
    r.messages_received = st.messages_received;
    r.zero_copy_bytes = st.zero_copy_bytes;
    r.packed_bytes = st.packed_bytes;
    r.unpacked_bytes = st.unpacked_bytes;
    r.waves = st.waves;
    r.staging_bytes = st.staging_bytes;
    r.peak_staging_bytes = st.peak_staging_bytes;
    r.staging_budget = opt_.executor.staging_budget;
    r.seconds = st.seconds;
    r.plan_bytes_sent = executor_.planned_bytes_sent();
    r.plan_bytes_received = executor_.planned_bytes_received();
    r.plan_local_bytes = executor_.planned_local_bytes();
    r.refit_index = executor_.runs() - 1;
    return r;
  }

  bool ready() const { return ready_; }
  const Layout& src_layout() const { return src_; }
  const Layout& dst_layout() const { return dst_; }
  const Schedule& schedule() const {
    if (!schedule_) fail("Resharder::schedule: setup() has not run");
    return *schedule_;
  }
  const Executor<TransportT>& executor() const { return executor_; }

 private:
  /// Checks the caller's views against what each layout gives this rank.
  void bind(const LocalBuffers& buffers) {
    src_bound_.clear();
    dst_bound_.clear();
    bind_side(src_, buffers.src, "source", src_bound_);
    bind_side(dst_, buffers.dst, "destination", dst_bound_);
    // Destination memory must not overlap anything: a refit would corrupt it.
    struct Range {
      const std::byte *lo, *hi;
      const BoundBuffer* b;
      bool dst;
    };
    std::vector<Range> ranges;
    for (const auto& b : src_bound_)
      if (b.data) ranges.push_back({b.data, b.data + b.span_elements() * b.element_bytes, &b, false});
    for (const auto& b : dst_bound_)
      if (b.data) ranges.push_back({b.data, b.data + b.span_elements() * b.element_bytes, &b, true});
    std::sort(ranges.begin(), ranges.end(), [](const Range& a, const Range& b) { return a.lo < b.lo; });
    for (std::size_t i = 0; i < ranges.size(); ++i)
      for (std::size_t j = i + 1; j < ranges.size() && ranges[j].lo < ranges[i].hi; ++j)
        if (ranges[i].dst || ranges[j].dst)
          fail("rank {}: {} buffer '{}' and {} buffer '{}' overlap in memory (reshard does not refit in place)", me_,
               ranges[i].dst ? "destination" : "source", ranges[i].b->name, ranges[j].dst ? "destination" : "source", ranges[j].b->name);
  }

  void bind_side(const Layout& L, const std::map<std::string, BufferView>& given, const char* side, std::vector<BoundBuffer>& out) {
    const auto& lbs = L.local_buffers();
    out.assign(lbs.size(), BoundBuffer{});
    const auto pos = L.mesh.position_of(me_);
    std::vector<std::string> expected;
    for (std::size_t b = 0; b < lbs.size(); ++b) {
      const auto shape = pos ? buffer_shape(L, *pos, static_cast<int>(b)) : std::vector<std::int64_t>{};
      if (shape.empty()) continue;
      expected.push_back(lbs[b].name);
      const std::int64_t need = product(shape);
      const std::int64_t eb = element_bytes(lbs[b].dtype);
      auto it = given.find(lbs[b].name);
      if (it == given.end())
        fail("rank {}: {} buffer '{}' is missing: {} needs it on this rank ({} elements of {}, shape [{}])", me_, side, lbs[b].name, L.origin,
             need, to_string(lbs[b].dtype), fmt::join(shape, ", "));
      const BufferView& v = it->second;
      if (v.element_bytes != eb)
        fail("rank {}: {} buffer '{}' has {}-byte elements but the layout stores {} ({} bytes)", me_, side, lbs[b].name, v.element_bytes,
             to_string(lbs[b].dtype), eb);
      if (need > 0 && !v.data) fail("rank {}: {} buffer '{}' has a null pointer", me_, side, lbs[b].name);
      if (v.memory != MemoryKind::host) fail("rank {}: {} buffer '{}' is device memory; this build moves host memory only", me_, side, lbs[b].name);
      BoundBuffer bb;
      bb.name = lbs[b].name;
      bb.data = static_cast<std::byte*>(v.data);
      bb.element_bytes = eb;
      bb.shape = shape;
      bb.memory = v.memory;
      if (!v.shape.empty() || !v.strides.empty()) {
        if (v.shape != shape)
          fail("rank {}: {} buffer '{}': the view has shape [{}] but the layout gives this rank shape [{}]", me_, side, lbs[b].name,
               fmt::join(v.shape, ", "), fmt::join(shape, ", "));
        if (v.strides.size() != shape.size())
          fail("rank {}: {} buffer '{}': the view has {} strides for {} dims", me_, side, lbs[b].name, v.strides.size(), shape.size());
        // Injective: sorted by stride, each stride passes the span of the smaller ones.
        std::vector<std::size_t> order(shape.size());
        std::iota(order.begin(), order.end(), 0);
        std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t c) { return v.strides[a] < v.strides[c]; });
        std::int64_t span = 1;
        for (auto d : order) {
          if (shape[d] == 1) continue;
          if (v.strides[d] < span)
            fail("rank {}: {} buffer '{}': view strides [{}] map two elements to one place", me_, side, lbs[b].name, fmt::join(v.strides, ", "));
          span = v.strides[d] * (shape[d] - 1) + span;
        }
        bb.strides = v.strides;
        if (v.elements > 0 && bb.span_elements() > v.elements)
          fail("rank {}: {} buffer '{}': the view reaches {} elements but only {} were given", me_, side, lbs[b].name, bb.span_elements(),
               v.elements);
      } else if (v.elements < need) {
        fail("rank {}: {} buffer '{}' is too small: {} elements given, {} needs {} (shape [{}])", me_, side, lbs[b].name, v.elements,
             L.origin, need, fmt::join(shape, ", "));
      }
      out[b] = std::move(bb);
    }
    for (const auto& [name, v] : given) {
      const int b = L.find_buffer(name);
      const std::string has = expected.empty() ? std::string("none") : fmt::format("{}", fmt::join(expected, ", "));
      if (b < 0) fail("rank {}: {} buffer '{}' is not a buffer of {} (this rank has: {})", me_, side, name, L.origin, has);
      if (std::find(expected.begin(), expected.end(), name) == expected.end())
        fail("rank {}: {} buffer '{}' was given but {} gives this rank no such buffer (it has: {})", me_, side, name, L.origin, has);
    }
  }

  Layout src_, dst_;
  ResharderOptions opt_;
  std::vector<int> src_of_dst_;
  TransportT* t_ = nullptr;
  std::int64_t me_ = -1;
  std::shared_ptr<const Schedule> schedule_;
  std::vector<BoundBuffer> src_bound_, dst_bound_;
  Executor<TransportT> executor_;
  bool ready_ = false;
};

}  // namespace reshard
