#pragma once
// QuantRefit: runs a schedule with copies into quantized (FP8) destination
// tensors (docs/fp8.md), or copies that cast between float dtypes
// (PlanOptions::cast), on one rank, around a plain Executor:
//  * before the run, the sender quantizes every tile it holds whole of the
//    tensors it sends quantized, into an FP8 shadow of its source buffer (the
//    same element offsets) and the tiles' scales into a scale shadow (at the
//    offset of each tile's first element): sender copies then move FP8 bytes
//    from the shadow, scale copies the scales;
//  * receiver copies land source-dtype elements in a staging copy of the
//    destination buffer (the same element offsets); after the run the
//    receiver quantizes those tiles into the FP8 buffer and its scale tensor;
//  * before the run, the sender converts its elements of every tensor it
//    sends cast into a shadow of the destination's dtype (the same element
//    offsets; one per element size), which its cast copies read (host
//    memory only, yet).
// expanded() is the schedule the Executor runs: plain copies, with the shadow
// and staging buffers appended to the buffer lists (ids computed from the
// schedule alone, so every rank agrees). Dense buffers only.
//
// On the host the tiles are quantized by the host kernel (quantize_tiles).
// With device buffers (a DeviceCopyEngine) the shadows and staging are
// engine memory and the tiles are compiled once into two uploaded batches
// per scheme, enqueued on the copy stream: the senders' after the caller's
// `sources_final` and before the executor touches anything (the executor
// gets the event after them as its `sources_final`, so a transport that
// reads the shadow waits for them too), the receivers' after the run's
// last copy; RefitReport::done is the event after them.
#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <unordered_set>
#include <utility>
#include <vector>

#include "../base/float_convert.hpp"
#include "../base/multi_index.hpp"
#include "../cuda/device_engine.hpp"
#include "../layout/layout.hpp"
#include "../layout/quantize.hpp"
#include "../layout/rank_buffers.hpp"
#include "../layout/storage.hpp"
#include "../schedule/schedule.hpp"
#include "executor.hpp"

namespace reshard {

/// One rank's piece of a tensor in its local buffer, by runs of the global
/// row-major index: global g0.. g0+count-1 at buffer elements b0...
struct PieceRuns {
  struct Run {
    std::int64_t g0, b0, count;
  };
  std::vector<Run> runs;  ///< sorted by g0

  static PieceRuns of(const Layout& L, std::int64_t pos, int t) {
    PieceRuns p;
    const int buf = L.buffer_of(t);
    for_each_slot_run(L, pos, buf, [&](std::int64_t b0, std::int64_t count, int tt, std::int64_t g0) {
      if (tt == t) p.runs.push_back(Run{g0, b0, count});
    });
    std::sort(p.runs.begin(), p.runs.end(), [](const Run& a, const Run& b) { return a.g0 < b.g0; });
    return p;
  }
  /// Calls f(buffer element, count) for the held elements g .. g+n-1 in order.
  template <class F>
  void pieces(std::int64_t g, std::int64_t n, F&& f) const {
    while (n > 0) {
      auto it = std::upper_bound(runs.begin(), runs.end(), g, [](std::int64_t x, const Run& r) { return x < r.g0; });
      if (it == runs.begin()) fail("quantize: global index {} is not held here", g);
      --it;
      if (g >= it->g0 + it->count) fail("quantize: global index {} is not held here", g);
      const std::int64_t k = std::min(n, it->g0 + it->count - g);
      f(it->b0 + (g - it->g0), k);
      g += k;
      n -= k;
    }
  }
};

/// Calls f(origin, extent) (global multi-indices, rank n) for every tile of a
/// tensor with tiling `q` that position pos holds whole (per dim, every index
/// of the tile is held) under layout L, tensor t.
template <class F>
void for_each_whole_tile(const Layout& L, std::int64_t pos, int t, const QuantSpec& q, F&& f) {
  const auto& ts = L.tensors[static_cast<std::size_t>(t)];
  const int n = ts.rank();
  std::vector<std::vector<std::int64_t>> starts(static_cast<std::size_t>(n));
  for (int d = 0; d < n; ++d) {
    const DimPart p = L.dim_part(pos, t, d);
    const std::int64_t b = q.tile(d, n), ext = ts.shape[static_cast<std::size_t>(d)];
    for (std::int64_t g0 = 0; g0 < ext; g0 += b) {
      const std::int64_t end = std::min(ext, g0 + b);
      const std::int64_t h = p.next_held(g0);
      if (h == g0 && p.run_end(g0) >= end) starts[static_cast<std::size_t>(d)].push_back(g0);
      else if (h > g0) g0 = std::max(g0 + b, std::min(h, ext) / b * b) - b;  // on to the tile of the next held index
    }
    if (starts[static_cast<std::size_t>(d)].empty()) return;
  }
  std::vector<std::size_t> i(static_cast<std::size_t>(n), 0);
  std::array<std::int64_t, kMaxTensorRank> origin{}, extent{};
  while (true) {
    for (int d = 0; d < n; ++d) {
      const auto ud = static_cast<std::size_t>(d);
      origin[ud] = starts[ud][i[ud]];
      extent[ud] = std::min(ts.shape[ud], origin[ud] + q.tile(d, n)) - origin[ud];
    }
    f(origin, extent);
    if (!next_index(i, n, [&](std::size_t d) { return starts[d].size(); })) break;
  }
}

/// Calls f(global row-major index, length) for the rows (along the last dim)
/// of the tile at origin/extent of a tensor of shape `shape`.
template <class F>
void for_each_tile_row(const std::vector<std::int64_t>& shape, const std::array<std::int64_t, kMaxTensorRank>& origin,
                       const std::array<std::int64_t, kMaxTensorRank>& extent, F&& f) {
  const int n = static_cast<int>(shape.size());
  std::array<std::int64_t, kMaxTensorRank> j{};
  while (true) {
    std::int64_t g = 0;
    for (int d = 0; d < n; ++d) g = g * shape[static_cast<std::size_t>(d)] + origin[static_cast<std::size_t>(d)] + j[static_cast<std::size_t>(d)];
    f(g, extent[static_cast<std::size_t>(n - 1)]);
    if (!next_index(j, n - 1, [&](std::size_t d) { return extent[d]; })) break;  // the rows: all dims but the last
  }
}

/// Appends (buffer element, count) pairs for the rows of a tile held in `runs`.
inline void tile_rows(const PieceRuns& runs, const std::vector<std::int64_t>& shape, const std::array<std::int64_t, kMaxTensorRank>& origin,
                      const std::array<std::int64_t, kMaxTensorRank>& extent, std::vector<std::int64_t>& rows) {
  for_each_tile_row(shape, origin, extent, [&](std::int64_t g, std::int64_t len) {
    runs.pieces(g, len, [&](std::int64_t at, std::int64_t k) {
      rows.push_back(at);
      rows.push_back(k);
    });
  });
}

/// Element index, in the rank's scale tensor of quantized tensor t (stored
/// alone: dense), of the tile at global `origin`.
inline std::int64_t scale_index(const Layout& L, std::int64_t pos, int t, const std::array<std::int64_t, kMaxTensorRank>& origin) {
  const auto& ts = L.tensors[static_cast<std::size_t>(t)];
  const auto& q = *ts.quant;
  const int n = ts.rank();
  std::int64_t index = 0;
  for (int d = 0; d < n; ++d)
    index = index * L.dim_part(pos, q.scale_tensor, d).local_extent +
            L.dim_part(pos, t, d).local(origin[static_cast<std::size_t>(d)]) / q.tile(d, n);
  return index;
}

class QuantRefit {
 public:
  /// Does the schedule quantize or cast anything?
  static bool needed(const Schedule& s) {
    return std::any_of(s.copies.begin(), s.copies.end(), [](const Copy& c) { return c.quant != CopyQuant::none; });
  }
  /// Does it quantize (FP8: sender, receiver or scale copies), not only cast?
  static bool quantizes(const Schedule& s) {
    return std::any_of(s.copies.begin(), s.copies.end(), [](const Copy& c) { return c.quant != CopyQuant::none && c.quant != CopyQuant::cast; });
  }

  /// Prepares rank `me`: allocates its shadows and staging and builds the
  /// expanded schedule. `src` / `dst` are the rank's bound buffers, indexed
  /// like the schedule's buffer ids (nullptr where it has none).
  /// With `engine`, the bound buffers are device memory (see the top).
  QuantRefit(const Layout& src, const Layout& dst, const Schedule& s, std::int64_t me, const std::vector<const BoundBuffer*>& srcb,
             const std::vector<const BoundBuffer*>& dstb, std::shared_ptr<DeviceCopyEngine> engine = nullptr)
      : src_(src), dst_(dst), me_(me), srcb_(srcb), dstb_(dstb), engine_(std::move(engine)) {
    try {
      prepare(s);
    } catch (...) {
      release_device();  // no destructor runs for a constructor that throws
      throw;
    }
  }
  ~QuantRefit() { release_device(); }
  QuantRefit(const QuantRefit&) = delete;
  QuantRefit& operator=(const QuantRefit&) = delete;

  const Schedule& expanded() const { return expanded_; }
  const std::vector<const BoundBuffer*>& src_buffers() const { return src_ptrs_; }
  const std::vector<const BoundBuffer*>& dst_buffers() const { return dst_ptrs_; }

  /// Before each run: quantize the tiles this rank sends quantized. Returns
  /// the order the executor runs under (device: after these tiles, and it
  /// returns without waiting; after_run() keeps the caller's `wait`).
  StreamOrder before_run(const StreamOrder& order = {}) {
    if (!engine_) {
      replay(sender_jobs_);
      for (const auto& j : cast_jobs_)
        for (std::size_t k = 0; k + 1 < j.runs.size(); k += 2)
          convert_elements(j.from_dtype, j.to_dtype, j.from + j.runs[k] * element_bytes(j.from_dtype),
                           j.to + j.runs[k] * element_bytes(j.to_dtype), j.runs[k + 1]);
      return order;
    }
    engine_->stream_wait(order.sources_final);
    for (std::size_t id : sender_batches_) engine_->enqueue(id);
    StreamOrder o = order;
    o.sources_final = engine_->record(exec_detail::kQuantSourcesSlot);
    o.wait = false;
    return o;
  }
  /// After each run: quantize the tiles that arrived in source dtype
  /// (device: enqueued after the run's copies; st.done then marks them).
  void after_run(ExecutorStats& st, const StreamOrder& order = {}) {
    if (!engine_) {
      replay(receiver_jobs_);
      return;
    }
    for (std::size_t id : receiver_batches_) engine_->enqueue(id);
    st.done = engine_->record(exec_detail::kQuantDoneSlot);
    if (order.wait) engine_->synchronize();
  }

 private:
  /// The constructor's work (it frees what a failure leaves).
  void prepare(const Schedule& s) {
    const auto S = s.src_buffers.size(), D = s.dst_buffers.size();
    expanded_.src_buffers = s.src_buffers;
    for (const auto& b : s.src_buffers) expanded_.src_buffers.push_back(b + "#fp8");
    for (const auto& b : s.src_buffers) expanded_.src_buffers.push_back(b + "#scale");
    for (const auto& b : s.src_buffers) expanded_.src_buffers.push_back(b + "#cast2");  // 2-byte destinations
    for (const auto& b : s.src_buffers) expanded_.src_buffers.push_back(b + "#cast4");  // 4-byte (f32)
    expanded_.dst_buffers = s.dst_buffers;
    for (const auto& b : s.dst_buffers) expanded_.dst_buffers.push_back(b + "#staged");
    expanded_.only_rank = s.only_rank;
    expanded_.stats = s.stats;
    shadow_.resize(S);
    scale_shadow_.resize(S);
    cast_shadow_[0].resize(S);
    cast_shadow_[1].resize(S);
    staged_.resize(D);
    src_ptrs_ = srcb_;
    src_ptrs_.resize(5 * S, nullptr);
    dst_ptrs_ = dstb_;
    dst_ptrs_.resize(2 * D, nullptr);
    const auto spos = src_.mesh.position_of(me_), dpos = dst_.mesh.position_of(me_);
    expanded_.copies.reserve(s.copies.size());
    for (Copy c : s.copies) {
      const CopyQuant q = c.quant;
      c.quant = CopyQuant::none;
      if (q == CopyQuant::cast) {
        const auto b = static_cast<std::size_t>(c.src_buffer);
        const std::size_t k = c.element_bytes == 2 ? 0 : 1;
        c.src_buffer = static_cast<std::int32_t>((3 + k) * S + b);
        if (c.src_rank == me_) {
          if (engine_)
            fail("rank {}: tensor '{}' is cast in flight, which runs on host memory only yet (ExecutorOptions::device is set)", me_,
                 dst_.tensors[static_cast<std::size_t>(c.tensor)].name);
          need_bound(srcb_, b, "source", s.src_buffers);
          add_tensor(cast_tensors_, c.tensor);
          ensure(cast_shadow_[k][b], src_ptrs_[(3 + k) * S + b], *srcb_[b], c.element_bytes, expanded_.src_buffers[(3 + k) * S + b]);
        }
        expanded_.copies.push_back(c);
        continue;
      }
      const int qt = q == CopyQuant::scale ? dst_.tensors[static_cast<std::size_t>(c.tensor)].scale_of : c.tensor;
      if (q == CopyQuant::sender || q == CopyQuant::scale) {
        const auto b = static_cast<std::size_t>(c.src_buffer);
        c.src_buffer = static_cast<std::int32_t>((q == CopyQuant::sender ? S : 2 * S) + b);
        if (c.src_rank == me_) {
          need_bound(srcb_, b, "source", s.src_buffers);
          add_tensor(sender_tensors_, qt);
          const auto& qs = *dst_.tensors[static_cast<std::size_t>(qt)].quant;
          if (q == CopyQuant::sender) ensure(shadow_[b], src_ptrs_[S + b], *srcb_[b], 1, s.src_buffers[b] + "#fp8");
          else ensure(scale_shadow_[b], src_ptrs_[2 * S + b], *srcb_[b], element_bytes(scale_dtype(qs.scheme)), s.src_buffers[b] + "#scale");
        }
      } else if (q == CopyQuant::receiver) {
        const auto b = static_cast<std::size_t>(c.dst_buffer);
        c.dst_buffer = static_cast<std::int32_t>(D + b);
        if (c.dst_rank == me_) {
          need_bound(dstb_, b, "destination", s.dst_buffers);
          add_tensor(receiver_tensors_, qt);
          const int st = src_.find_tensor(dst_.tensors[static_cast<std::size_t>(qt)].name);
          ensure(staged_[b], dst_ptrs_[D + b], *dstb_[b], element_bytes(src_.tensors[static_cast<std::size_t>(st)].dtype),
                 s.dst_buffers[b] + "#staged");
          receiver_copies_.push_back(c);
        }
      }
      expanded_.copies.push_back(c);
    }
    if ((!sender_tensors_.empty() || !cast_tensors_.empty()) && !spos)
      fail("rank {} sends quantized or cast elements but is not in the source layout", me_);
    if (!receiver_tensors_.empty() && !dpos) fail("rank {} receives quantized tiles but is not in the destination layout", me_);
    spos_ = spos.value_or(-1);
    dpos_ = dpos.value_or(-1);
    // Scale buffers the receiver writes must be bound too.
    for (int t : receiver_tensors_) need_bound(dstb_, static_cast<std::size_t>(dst_.buffer_of(dst_.tensors[static_cast<std::size_t>(t)].quant->scale_tensor)), "destination", s.dst_buffers);
    compile_sender(s);
    compile_receiver();
    compile_casts();
    if (engine_) {
      sender_batches_ = upload(sender_jobs_);
      receiver_batches_ = upload(receiver_jobs_);
    }
  }
  void release_device() noexcept {
    if (!engine_) return;
    for (std::size_t id : sender_batches_) engine_->release(id);
    for (std::size_t id : receiver_batches_) engine_->release(id);
    for (std::byte* p : device_memory_) engine_->free_staging(p);
    sender_batches_.clear();
    receiver_batches_.clear();
    device_memory_.clear();
  }

  /// Tiles of one tensor to quantize, compiled once: rows as (element
  /// offset, count) pairs into `from` (source dtype) and `to` (FP8), the
  /// same offsets on both; per tile its last row and its scale's byte offset.
  struct TileJobs {
    DType dtype = DType::bf16;
    QuantScheme scheme = QuantScheme::block;
    const std::byte* from = nullptr;
    std::uint8_t* to = nullptr;
    std::byte* scales = nullptr;
    std::vector<std::int64_t> rows;
    std::vector<TileEnd> tiles;  ///< (end row, scale byte offset)
  };

  static void replay(const std::vector<TileJobs>& jobs) {
    for (const auto& j : jobs) quantize_tiles(j.scheme, j.dtype, j.from, j.to, j.rows.data(), j.tiles.data(), j.tiles.size(), j.scales);
  }

  /// The jobs as the device kernel's tiles, one uploaded batch per scheme.
  /// A tile's rows are evenly spaced in its buffer (a box of a dense piece).
  std::vector<std::size_t> upload(const std::vector<TileJobs>& jobs) {
    std::map<QuantScheme, std::vector<cuda::QuantTile>> by_scheme;
    for (const auto& j : jobs) {
      auto& out = by_scheme[j.scheme];
      const auto E = element_bytes(j.dtype);
      std::size_t row = 0;
      for (const auto& [end, scale_at] : j.tiles) {
        const std::int64_t* r = j.rows.data() + 2 * row;
        const auto n = static_cast<std::int64_t>(end - row);
        cuda::QuantTile t;
        t.src = reinterpret_cast<std::uintptr_t>(j.from + r[0] * E);
        t.dst = reinterpret_cast<std::uintptr_t>(j.to + r[0]);
        t.scale = reinterpret_cast<std::uintptr_t>(j.scales + scale_at);
        t.src_stride = t.dst_stride = n > 1 ? r[2] - r[0] : 0;
        t.rows = static_cast<std::int32_t>(n);
        t.cols = static_cast<std::int32_t>(r[1]);
        t.dtype = j.dtype;
        for (std::int64_t k = 0; k < n; ++k)
          if (r[2 * k] != r[0] + k * t.src_stride || r[2 * k + 1] != r[1])
            fail("rank {}: a quantized tile's rows are not evenly spaced in its buffer (row {} at element {}, {} elements): the device "
                 "quantizer takes tiles as strided rows", me_, k, r[2 * k], r[2 * k + 1]);
        out.push_back(t);
        row = end;
      }
    }
    std::vector<std::size_t> ids;
    for (const auto& [scheme, tiles] : by_scheme)
      if (!tiles.empty()) ids.push_back(engine_->upload(scheme, tiles));
    return ids;
  }

  /// Element offsets (in `buffer` of the copy's side) of every element of a
  /// copy's box on one side.
  template <class F>
  static void for_each_offset(const Copy& c, bool src_side, F&& f) {
    const int side = src_side ? 0 : 1;
    std::array<std::int64_t, kMaxBoxRank> i{};
    while (true) {
      std::int64_t o = c.offset(side);
      for (int k = 0; k < c.rank; ++k) o += i[static_cast<std::size_t>(k)] * c.stride(side, k);
      f(o);
      int k = c.rank - 1;
      for (; k >= 0; --k) {
        const auto uk = static_cast<std::size_t>(k);
        if (++i[uk] < c.extent(k)) break;
        i[uk] = 0;
      }
      if (k < 0) break;
    }
  }

  /// The sender's jobs: the tiles its scale copies name (by their first element).
  void compile_sender(const Schedule& s) {
    for (int t : sender_tensors_) {
      const auto& ts = dst_.tensors[static_cast<std::size_t>(t)];
      const auto& q = *ts.quant;
      const int st = src_.find_tensor(ts.name);
      const auto& sts = src_.tensors[static_cast<std::size_t>(st)];
      const auto b = static_cast<std::size_t>(src_.buffer_of(st));
      std::unordered_set<std::int64_t> wanted;
      for (const Copy& c : s.copies)
        if (c.quant == CopyQuant::scale && c.src_rank == me_ && dst_.tensors[static_cast<std::size_t>(c.tensor)].scale_of == t)
          for_each_offset(c, true, [&](std::int64_t o) { wanted.insert(o); });
      TileJobs j;
      j.dtype = sts.dtype;
      j.scheme = q.scheme;
      j.from = srcb_[b]->data;
      j.to = reinterpret_cast<std::uint8_t*>(shadow_[b]);
      j.scales = scale_shadow_[b];
      const auto SE = element_bytes(scale_dtype(q.scheme));
      const PieceRuns runs = PieceRuns::of(src_, spos_, st);
      for_each_whole_tile(src_, spos_, st, q, [&](const auto& origin, const auto& extent) {
        const std::size_t mark = j.rows.size();
        tile_rows(runs, sts.shape, origin, extent, j.rows);
        if (!wanted.count(j.rows[mark])) {
          j.rows.resize(mark);
          return;
        }
        j.tiles.emplace_back(j.rows.size() / 2, j.rows[mark] * SE);
      });
      sender_jobs_.push_back(std::move(j));
    }
  }

  /// The receiver's jobs: the tiles its receiver copies write (a tile is
  /// never shared between a sender copy and a receiver copy).
  void compile_receiver() {
    for (int t : receiver_tensors_) {
      const auto& ts = dst_.tensors[static_cast<std::size_t>(t)];
      const auto& q = *ts.quant;
      const int st = src_.find_tensor(ts.name);
      const auto b = static_cast<std::size_t>(dst_.buffer_of(t));
      const auto sb = static_cast<std::size_t>(dst_.buffer_of(q.scale_tensor));
      std::vector<bool> mark(static_cast<std::size_t>(dstb_[b]->elements()), false);
      for (const Copy& c : receiver_copies_)
        if (c.tensor == t) for_each_offset(c, false, [&](std::int64_t o) { mark[static_cast<std::size_t>(o)] = true; });
      TileJobs j;
      j.dtype = src_.tensors[static_cast<std::size_t>(st)].dtype;
      j.scheme = q.scheme;
      j.from = staged_[b];
      j.to = reinterpret_cast<std::uint8_t*>(dstb_[b]->data);
      j.scales = dstb_[sb]->data;
      const auto SE = element_bytes(scale_dtype(q.scheme));
      const PieceRuns runs = PieceRuns::of(dst_, dpos_, t);
      for_each_whole_tile(dst_, dpos_, t, q, [&](const auto& origin, const auto& extent) {
        const std::size_t first = j.rows.size();
        tile_rows(runs, ts.shape, origin, extent, j.rows);
        if (!mark[static_cast<std::size_t>(j.rows[first])]) {
          j.rows.resize(first);
          return;
        }
        j.tiles.emplace_back(j.rows.size() / 2, scale_index(dst_, dpos_, t, origin) * SE);
      });
      receiver_jobs_.push_back(std::move(j));
    }
  }

  /// A tensor this rank sends cast: every element it holds, as runs of its
  /// source buffer, converted into the shadow at the same element offsets.
  struct CastJob {
    DType from_dtype = DType::f32, to_dtype = DType::bf16;
    const std::byte* from = nullptr;
    std::byte* to = nullptr;
    std::vector<std::int64_t> runs;  ///< (element offset, count) pairs
  };

  void compile_casts() {
    for (int t : cast_tensors_) {
      const auto& ts = dst_.tensors[static_cast<std::size_t>(t)];
      const int st = src_.find_tensor(ts.name);
      const auto b = static_cast<std::size_t>(src_.buffer_of(st));
      CastJob j;
      j.from_dtype = src_.tensors[static_cast<std::size_t>(st)].dtype;
      j.to_dtype = ts.dtype;
      j.from = srcb_[b]->data;
      j.to = cast_shadow_[element_bytes(ts.dtype) == 2 ? 0 : 1][b];
      for (const auto& r : PieceRuns::of(src_, spos_, st).runs) {
        j.runs.push_back(r.b0);
        j.runs.push_back(r.count);
      }
      cast_jobs_.push_back(std::move(j));
    }
  }

  static void add_tensor(std::vector<int>& v, int t) {
    if (std::find(v.begin(), v.end(), t) == v.end()) v.push_back(t);
  }
  void need_bound(const std::vector<const BoundBuffer*>& v, std::size_t b, const char* side, const std::vector<std::string>& names) const {
    if (b >= v.size() || !v[b]) fail("rank {}: quantized refit needs {} buffer '{}', which is not bound", me_, side, b < names.size() ? names[b] : "?");
    const MemoryKind want = engine_ ? MemoryKind::device : MemoryKind::host;
    if (v[b]->memory != want || !v[b]->dense())
      fail("rank {}: {} buffer '{}': quantized refits run on dense buffers, all in {} memory here ({})", me_, side, names[b],
           engine_ ? "device" : "host", engine_ ? "ExecutorOptions::device is set" : "no ExecutorOptions::device");
  }
  /// A shadow or staging buffer like `like` with E-byte elements: host
  /// memory, or the engine's (device) memory.
  void ensure(std::byte*& mem, const BoundBuffer*& ptr, const BoundBuffer& like, std::int64_t E, const std::string& name) {
    if (mem) return;
    const std::int64_t n = like.elements();
    const auto bytes = static_cast<std::size_t>(std::max<std::int64_t>(n * E, 1));
    if (engine_) {
      mem = engine_->allocate_staging(bytes);
      device_memory_.push_back(mem);
    } else {
      host_memory_.push_back(std::make_unique<std::byte[]>(bytes));
      mem = host_memory_.back().get();
    }
    auto bb = std::make_unique<BoundBuffer>();
    bb->name = name;
    bb->data = mem;
    bb->element_bytes = E;
    bb->shape = {n};
    bb->memory = engine_ ? MemoryKind::device : MemoryKind::host;
    ptr = bb.get();
    owned_.push_back(std::move(bb));
  }

  const Layout& src_;
  const Layout& dst_;
  std::int64_t me_, spos_ = -1, dpos_ = -1;
  std::vector<const BoundBuffer*> srcb_, dstb_, src_ptrs_, dst_ptrs_;
  Schedule expanded_;
  std::shared_ptr<DeviceCopyEngine> engine_;  ///< device buffers: the engine that quantizes; null on the host
  std::vector<std::byte*> shadow_, scale_shadow_, staged_;  ///< per buffer id (null where none)
  std::array<std::vector<std::byte*>, 2> cast_shadow_;        ///< per buffer id: 2-byte and 4-byte destination dtypes
  std::vector<std::unique_ptr<std::byte[]>> host_memory_;
  std::vector<std::byte*> device_memory_;  ///< from engine_->allocate_staging
  std::vector<std::size_t> sender_batches_, receiver_batches_;  ///< device: uploaded tile batches
  std::vector<std::unique_ptr<BoundBuffer>> owned_;
  std::vector<int> sender_tensors_, receiver_tensors_, cast_tensors_;
  std::vector<Copy> receiver_copies_;  ///< into this rank, expanded
  std::vector<TileJobs> sender_jobs_, receiver_jobs_;
  std::vector<CastJob> cast_jobs_;
};


}  // namespace reshard
