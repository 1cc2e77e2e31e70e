#pragma once
// The planner: two validated layouts -> Schedule. Destination-driven: for each
// destination rank and each piece it holds, the overlapping source parts are
// found by search over cut points (never all source x destination ranks), a
// holder is chosen among the replicas (the rank itself when it holds the data,
// else spread evenly), and the common boxes become strided copies.
//
// Every choice is a pure function of (destination rank, tensor, piece) and of
// the piece's replica group (the holders of one source part and every piece
// they serve, found from the layouts alone), so a process that plans only its
// own rank (`only_rank`) computes exactly the copies a full plan gives it.
#include <algorithm>
#include <array>
#include <bit>
#include <chrono>
#include <cstdint>
#include <deque>
#include <exception>
#include <iterator>
#include <limits>
#include <map>
#include <memory>
#include <set>
#include <span>
#include <thread>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include "../base/flat_index.hpp"
#include "../base/multi_index.hpp"
#include "../layout/layout.hpp"
#include "../layout/storage.hpp"
#include "../schedule/schedule.hpp"
#include "box.hpp"
#include "copy_log.hpp"
#include "copy_order.hpp"

namespace reshard {

struct PlanOptions {
  /// >= 0: plan only the copies this global rank sends or receives.
  std::int64_t only_rank = -1;
  /// Pieces with R > 1 replicas and at least this many bytes are cut into R
  /// slabs of equal needed element counts (along one dim; for flat sources,
  /// along the row-major order), one per replica, so every replica sends its
  /// even share. Smaller pieces go whole to one replica: by rotation, or
  /// as balance_limit below reassigns them.
  std::int64_t split_bytes = 64 * 1024;
  /// Replica balance of the pieces that go whole (below split_bytes, or all
  /// of them when split_bytes is never reached). A replica group is the R
  /// holders of one source part; its even share is the network bytes it
  /// sends / R. When the rotation would leave a replica over balance_limit x
  /// that share (few pieces of unequal size), the group's whole pieces are
  /// reassigned, largest first onto the least loaded replica, or, when that
  /// is not enough, laid end to end and cut into R runs of equal bytes
  /// (McNaughton's wrap-around): a piece then splits into slabs along one
  /// dim, none under min_slab_bytes, so small tensors keep one message per
  /// piece. balance_limit <= 0: rotation only (as before issue 17).
  double balance_limit = 1.10;
  std::int64_t min_slab_bytes = 256 * 1024;
  bool coalesce = true;
  /// Threads for a full plan (only_rank < 0): destinations are cut into this
  /// many contiguous ranges, planned independently (every choice is a pure
  /// function of the destination) and joined in order, so the schedule is the
  /// same for any count. 0: std::thread::hardware_concurrency().
  int threads = 1;
  /// A tensor whose float dtype differs between the sides (f32, bf16, f16:
  /// an f32 master copy into a bf16 engine) is converted in flight: the
  /// sender converts what it sends, rounding to nearest even as torch's
  /// Tensor.to() does, and the destination's dtype crosses the wire
  /// (CopyQuant::cast). Off: such a tensor is an error naming it.
  bool cast = false;
};

/// Checks that two layouts describe the same tensors; returns, for each
/// destination tensor, the id of the source tensor with the same name.
/// `cast`: float dtypes may differ (PlanOptions::cast).
inline std::vector<int> match_tensors(const Layout& src, const Layout& dst, bool cast = false) {
  std::vector<int> map(dst.tensors.size(), -1);
  for (std::size_t t = 0; t < dst.tensors.size(); ++t) {
    const auto& d = dst.tensors[t];
    if (d.scale_of >= 0) continue;  // a scale tensor has no source: the quantizer writes it
    const int s = src.find_tensor(d.name);
    if (s < 0) layout_fail(ErrorContext{dst.origin, d.name, "name"}, "no tensor of this name in {}", src.origin);
    const auto& st = src.tensors[static_cast<std::size_t>(s)];
    if (st.shape != d.shape)
      layout_fail(ErrorContext{dst.origin, d.name, "shape"}, "shape [{}] differs from [{}] in {}",
                  fmt::join(d.shape, ", "), fmt::join(st.shape, ", "), src.origin);
    if (d.quant) {
      if (st.dtype != DType::bf16 && st.dtype != DType::f16 && st.dtype != DType::f32)
        layout_fail(ErrorContext{dst.origin, d.name, "dtype"},
                    "a quantized tensor's source must be bf16, f16 or f32, but it is {} in {}", to_string(st.dtype),
                    src.origin);
    } else if (st.dtype != d.dtype && !(cast && castable(st.dtype) && castable(d.dtype))) {
      layout_fail(ErrorContext{dst.origin, d.name, "dtype"}, "dtype {} differs from {} in {}{}", to_string(d.dtype),
                  to_string(st.dtype), src.origin,
                  castable(st.dtype) && castable(d.dtype)
                      ? " (float dtypes convert in flight with PlanOptions::cast: Python cast=True, reshard-plan --cast)"
                      : "");
    }
    map[t] = s;
  }
  return map;
}

/// Scratch for positions_of_part: a plan calls it thousands of times.
struct PartHolderScratch {
  struct Need {  // an axis coordinate c must have digit (c / stride) % size == want
    int axis;
    std::int64_t stride, size, want;
  };
  std::vector<Need> needs;
  std::vector<std::int64_t> allowed, next;
};

/// Mesh positions that hold part `parts` (one part index per dim) of tensor
/// t, ascending, into `out`: per axis the coordinates whose read digits
/// match, crossed.
inline void positions_of_part(const Layout& L, int t, std::span<const std::int64_t> parts, std::vector<std::int64_t>& out,
                              PartHolderScratch& s) {
  const auto& ts = L.tensors[static_cast<std::size_t>(t)];
  const auto& axes = L.mesh.axes;
  s.needs.clear();
  for (std::size_t d = 0; d < ts.dims.size(); ++d) {
    std::int64_t p = parts[d];
    const auto& refs = ts.dims[d].axes;
    for (auto r = refs.rbegin(); r != refs.rend(); ++r) {
      s.needs.push_back(PartHolderScratch::Need{r->axis, r->stride, r->size, p % r->size});
      p /= r->size;
    }
  }
  for (const auto& st : ts.stage)
    s.needs.push_back(PartHolderScratch::Need{st.axis, 1, axes[static_cast<std::size_t>(st.axis)].size, st.coord});
  // By axis, so each axis checks only its own needs.
  std::sort(s.needs.begin(), s.needs.end(),
            [](const PartHolderScratch::Need& x, const PartHolderScratch::Need& y) { return x.axis < y.axis; });
  out.assign(1, 0);
  std::size_t k0 = 0;
  for (std::size_t a = 0; a < axes.size(); ++a) {
    const std::int64_t stride = L.mesh.axis_stride(static_cast<int>(a));
    std::size_t k1 = k0;
    while (k1 < s.needs.size() && s.needs[k1].axis == static_cast<int>(a)) ++k1;
    s.allowed.clear();
    for (std::int64_t c = 0; c < axes[a].size; ++c) {
      bool ok = true;
      for (std::size_t k = k0; k < k1 && ok; ++k) {
        const auto& n = s.needs[k];
        ok = (c / n.stride) % n.size == n.want;
      }
      if (ok) s.allowed.push_back(c * stride);
    }
    k0 = k1;
    if (s.allowed.size() == 1) {  // common: one coordinate, shift in place
      for (auto& base : out) base += s.allowed[0];
      continue;
    }
    s.next.clear();
    for (auto base : out)
      for (auto c : s.allowed) s.next.push_back(base + c);
    out.swap(s.next);
  }
  // Row-major meshes give ascending positions already; sort only otherwise.
  if (!std::is_sorted(out.begin(), out.end())) std::sort(out.begin(), out.end());
}

inline std::vector<std::int64_t> positions_of_part(const Layout& L, int t, std::span<const std::int64_t> parts) {
  PartHolderScratch s;
  std::vector<std::int64_t> out;
  positions_of_part(L, t, parts, out, s);
  return out;
}

namespace detail {
/// positions_of_part of each (tensor, part) of one layout, computed once per
/// plan and kept in one pool (replica groups meet the same parts again and
/// again).
struct PartHolderMemo {
  FlatIndex index;                                        // (tensor << 32 | part) -> spans index
  std::vector<std::pair<std::size_t, std::size_t>> spans;  // (first, count) in pool
  std::vector<std::int64_t> pool;

  /// The holders of `parts` of tensor t of L; `list` and `scratch` are
  /// positions_of_part's. Valid until the next call.
  std::span<const std::int64_t> get(const Layout& L, int t, std::span<const std::int64_t> parts, std::vector<std::int64_t>& list,
                                    PartHolderScratch& scratch) {
    const auto& cuts = L.tensors[static_cast<std::size_t>(t)].cuts;
    std::uint64_t lin = 0;  // < mesh size: each axis digit is referenced once
    for (std::size_t d = 0; d < parts.size(); ++d)
      lin = lin * static_cast<std::uint64_t>(cuts[d].k) + static_cast<std::uint64_t>(parts[d]);
    auto& i = index.slot((static_cast<std::uint64_t>(t) << 32) | lin);
    if (i == FlatIndex::kNone) {
      positions_of_part(L, t, parts, list, scratch);
      i = static_cast<std::uint32_t>(spans.size());
      spans.emplace_back(pool.size(), list.size());
      pool.insert(pool.end(), list.begin(), list.end());
    }
    const auto [first, count] = spans[i];
    return std::span<const std::int64_t>(pool.data() + first, count);
  }
};

}  // namespace detail

class Planner {
 public:
  Planner(const Layout& src, const Layout& dst, PlanOptions opt = {}) : src_(src), dst_(dst), opt_(opt) {
    for (const Layout* L : {&src, &dst}) {
      const char* side = L == &src ? "source" : "destination";
      if (!L->validated())
        fail("plan: the {} layout is empty (default-constructed or moved from): build it from a LayoutSpec", side);
    }
    src_of_dst_ = match_tensors(src, dst, opt.cast);
    for (auto r : dst.mesh.global_ranks()) sides_meet_ = sides_meet_ || src.mesh.position_of(r).has_value();
  }

  Schedule run() {
    const auto t0 = std::chrono::steady_clock::now();
    Schedule s;
    for (const auto& b : src_.local_buffers()) s.src_buffers.push_back(b.name);
    for (const auto& b : dst_.local_buffers()) s.dst_buffers.push_back(b.name);
    s.only_rank = opt_.only_rank;
    if (opt_.only_rank < 0) {
      const std::int64_t P = dst_.mesh.size();
      int T = opt_.threads > 0 ? opt_.threads : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
      T = static_cast<int>(std::min<std::int64_t>(T, std::max<std::int64_t>(P, 1)));
      // Range k of T: [P*k/T, P*(k+1)/T). Range 0 runs here, the others in
      // their own Planners (their caches are not shared). Each range's copies
      // come in chunks, moved into the plan one at a time and freed, so the
      // peak is the plan and one chunk, not the plan twice.
      std::vector<CopyChunks> parts(static_cast<std::size_t>(T));
      std::vector<std::exception_ptr> errors(parts.size());
      std::vector<std::thread> workers;
      for (int k = 1; k < T; ++k)
        workers.emplace_back([&, k] {
          try {
            PlanOptions o = opt_;
            o.threads = 1;
            Planner(src_, dst_, o).plan_range(P * k / T, P * (k + 1) / T, parts[static_cast<std::size_t>(k)]);
          } catch (...) {
            errors[static_cast<std::size_t>(k)] = std::current_exception();
          }
        });
      try {
        plan_range(0, P / T, parts[0]);
      } catch (...) {
        errors[0] = std::current_exception();
      }
      for (auto& w : workers) w.join();
      for (auto& e : errors)
        if (e) std::rethrow_exception(e);
      std::size_t total = 0;
      for (const auto& part : parts)
        for (const auto& chunk : part) total += chunk.size();
      s.copies.reserve(total);
      for (auto& part : parts)
        for (auto& chunk : part) {
          detail::prefault(s.copies, chunk.size());
          s.copies.insert(s.copies.end(), chunk.begin(), chunk.end());
          std::vector<Copy>().swap(chunk);
        }
      bool ordered = true;
      for (std::int64_t p = 1; p < P && ordered; ++p)
        ordered = dst_.mesh.global_rank(p) >= dst_.mesh.global_rank(p - 1);
      if (!ordered)
        std::stable_sort(s.copies.begin(), s.copies.end(),
                         [](const Copy& a, const Copy& b) { return a.dst_rank < b.dst_rank; });
    } else {
      detail::CopyLog log;
      detail::CopySink sink{nullptr, &log};
      plan_rank(opt_.only_rank, sink);
      finish_log(log, s.copies);
    }
    std::set<std::int64_t> ranks;
    for (auto r : src_.mesh.global_ranks()) ranks.insert(r);
    for (auto r : dst_.mesh.global_ranks()) ranks.insert(r);
    s.compute_stats(static_cast<std::int64_t>(ranks.size()));
    s.stats.plan_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return s;
  }

  /// Plans destination positions [p0, p1) one at a time and hands each one's
  /// copies (sorted and coalesced as in run()) to sink(position, span<const
  /// Copy>), keeping no more than one destination's copies: for consumers
  /// that only sum them (traffic, simulation) where the whole plan would not
  /// fit in memory. Ignores only_rank and threads.
  template <class Sink>
  void for_each_destination(std::int64_t p0, std::int64_t p1, Sink&& sink) {
    std::vector<Copy> batch, done;
    for (std::int64_t p = p0; p < p1; ++p) {
      batch.clear();
      detail::CopySink into{&batch, nullptr};
      for (int t = 0; t < static_cast<int>(dst_.tensors.size()); ++t) plan_dst_tensor(p, t, -1, into);
      done.clear();
      finish(batch, done);
      sink(p, std::span<const Copy>(done.data(), done.size()));
    }
  }

 private:
  /// A range's copies in order, in chunks that never reallocate: at least
  /// 64 MiB each, so the allocator maps and unmaps each one by itself (glibc
  /// serves blocks over 32 MiB from their own mapping) and freeing a chunk
  /// gives its memory back at once.
  using CopyChunks = std::vector<std::vector<Copy>>;
  static constexpr std::size_t kChunkCopies = (std::size_t{64} << 20) / sizeof(Copy);

  /// Every copy into destination positions [p0, p1), appended to out in
  /// destination order. One destination at a time: its copies are sorted and
  /// coalesced in a small batch (no copy ever merges across destination
  /// ranks), so the big output is written once, in order.
  void plan_range(std::int64_t p0, std::int64_t p1, CopyChunks& out) {
    std::vector<Copy> batch;
    for (std::int64_t p = p0; p < p1; ++p) {
      batch.clear();
      detail::CopySink into{&batch, nullptr};
      for (int t = 0; t < static_cast<int>(dst_.tensors.size()); ++t) plan_dst_tensor(p, t, -1, into);
      if (batch.empty()) continue;
      // finish() writes at most batch.size() copies: a chunk with that room
      // never grows (growing would hold it twice).
      if (out.empty() || out.back().capacity() - out.back().size() < batch.size()) {
        out.emplace_back();
        out.back().reserve(std::max(kChunkCopies, batch.size()));
      }
      detail::prefault(out.back(), batch.size());
      finish(batch, out.back());
    }
  }

  using Window = std::array<std::int64_t, 2 * kMaxTensorRank>;  // lo,hi per dim

  const FlatRange* flat_of(const Layout& L, std::int64_t pos, int t, std::map<std::pair<std::int64_t, int>, FlatRange>& cache) {
    const int b = L.tensors[static_cast<std::size_t>(t)].buffer;
    if (b < 0 || L.buffers[static_cast<std::size_t>(b)].kind != BufferKind::flat) return nullptr;
    auto key = std::make_pair(pos, b);
    auto it = cache.find(key);
    if (it == cache.end()) it = cache.emplace(key, flat_range(L, pos, L.buffers[static_cast<std::size_t>(b)])).first;
    return &it->second;
  }
  const ConcatRange* concat_of(const Layout& L, std::int64_t pos, int t,
                               std::unordered_map<std::uint64_t, ConcatRange>& cache) {
    const int b = L.tensors[static_cast<std::size_t>(t)].buffer;
    if (b < 0 || L.buffers[static_cast<std::size_t>(b)].kind != BufferKind::concat) return nullptr;
    const auto key = static_cast<std::uint64_t>(pos) * L.buffers.size() + static_cast<std::uint64_t>(b);
    auto it = cache.find(key);
    if (it == cache.end()) it = cache.emplace(key, concat_range(L, pos, L.buffers[static_cast<std::size_t>(b)])).first;
    return &it->second;
  }
  /// A held box of a source storage as the planner keeps it: only its
  /// tensor's n dims, as words [base, (lo, hi, stride) per dim] (a HeldBox
  /// has room for kMaxTensorRank dims, and thousands are kept).
  struct HeldWords {
    const std::int64_t* w;
    std::int64_t base() const { return w[0]; }
    std::int64_t lo(std::size_t d) const { return w[1 + 3 * d]; }
    std::int64_t hi(std::size_t d) const { return w[2 + 3 * d]; }
    std::int64_t stride(std::size_t d) const { return w[3 + 3 * d]; }
  };
  /// What a source position holds of a tensor, as emit() reads it: its
  /// boxes and held interval. Valid until the next src_storage call.
  struct HeldView {
    const std::int64_t* first;
    std::size_t count, words;  // boxes, words per box
    std::int64_t lin_lo, lin_hi;
    HeldWords box(std::size_t i) const { return HeldWords{first + i * words}; }
  };
  /// Source storages are met by many destinations: kept for the whole plan,
  /// one per storage class (replicas share theirs), their boxes in one pool.
  HeldView src_storage(std::int64_t pos, int t) {
    pos = src_classes_.canonical(pos, t);
    auto& i = src_store_index_.slot(static_cast<std::uint64_t>(pos) * src_.tensors.size() + static_cast<std::uint64_t>(t));
    if (i == detail::FlatIndex::kNone) {
      i = static_cast<std::uint32_t>(src_store_.size());
      tensor_storage_into(src_, pos, t, flat_of(src_, pos, t, src_flat_), concat_of(src_, pos, t, src_concat_),
                          storage_scratch_);
      src_store_.push_back(SrcStorage{src_words_.size(), storage_scratch_.boxes.size(), storage_scratch_.lin_lo,
                                      storage_scratch_.lin_hi});
      for (const HeldBox& b : storage_scratch_.boxes) {
        src_words_.push_back(b.base);
        for (std::size_t d = 0; d < static_cast<std::size_t>(b.rank); ++d) {
          src_words_.push_back(b.lo[d]);
          src_words_.push_back(b.hi[d]);
          src_words_.push_back(b.stride[d]);
        }
      }
    }
    const SrcStorage& k = src_store_[i];
    const auto n = static_cast<std::size_t>(src_.tensors[static_cast<std::size_t>(t)].rank());
    return HeldView{src_words_.data() + k.first, k.count, 1 + 3 * n, k.lin_lo, k.lin_hi};
  }
  /// Destination storage of (pos, t) into s (its vectors reused).
  void dst_storage(std::int64_t pos, int t, TensorStorage& s) {
    if (!dst_.holds(pos, t)) {
      s.parts.clear();
      s.extents.clear();
      s.boxes.clear();
      s.buffer = dst_.buffer_of(t);
      s.lin_lo = s.lin_hi = 0;
      return;
    }
    tensor_storage_into(dst_, pos, t, flat_of(dst_, pos, t, dst_flat_), concat_of(dst_, pos, t, dst_concat_), s);
  }
  /// positions_of_part(src_, st, parts), computed once per part in a plan.
  /// Valid until the next src_holders call.
  std::span<const std::int64_t> src_holders(int st, std::span<const std::int64_t> parts) {
    return src_holders_.get(src_, st, parts, holder_list_, holder_scratch_);
  }
  /// positions_of_part(dst_, dt, parts), computed once per part in a plan
  /// (replica groups meet the same destination parts again and again).
  /// Valid until the next dst_holders call.
  std::span<const std::int64_t> dst_holders(int dt, std::span<const std::int64_t> parts) {
    return dst_holders_.get(dst_, dt, parts, group_list_, group_scratch_);
  }

  /// What one rank sends or receives: its own receives in full, plus, for each
  /// destination whose pieces meet what the rank holds, the copies from it.
  void plan_rank(std::int64_t rank, detail::CopySink& out) {
    const auto dpos = dst_.mesh.position_of(rank);
    if (dpos)
      for (int t = 0; t < static_cast<int>(dst_.tensors.size()); ++t) plan_dst_tensor(*dpos, t, -1, out);
    const auto spos = src_.mesh.position_of(rank);
    if (!spos) return;
    for (int dt = 0; dt < static_cast<int>(dst_.tensors.size()); ++dt) {
      const int st = src_of_dst_[static_cast<std::size_t>(dt)];
      if (st < 0 || !src_.holds(*spos, st)) continue;
      const auto& dts = dst_.tensors[static_cast<std::size_t>(dt)];
      const int n = dts.rank();
      std::vector<std::vector<std::int64_t>> cand(static_cast<std::size_t>(n));
      for (int d = 0; d < n; ++d) {
        const DimPart sp = src_.dim_part(*spos, st, d);
        const auto [glo, ghi] = detail::global_window(sp, 0, sp.local_extent);
        dts.cuts[static_cast<std::size_t>(d)].for_parts_meeting(
            glo, std::min(ghi, dts.shape[static_cast<std::size_t>(d)]),
            [&](std::int64_t p) { cand[static_cast<std::size_t>(d)].push_back(p); });
      }
      auto& dsts = dst_list_;
      dsts.clear();
      for_each_combination(cand, [&](std::span<const std::int64_t> parts) {
        positions_of_part(dst_, dt, parts, holder_list_, holder_scratch_);
        dsts.insert(dsts.end(), holder_list_.begin(), holder_list_.end());
      });
      std::sort(dsts.begin(), dsts.end());
      dsts.erase(std::unique(dsts.begin(), dsts.end()), dsts.end());
      // Replicas of a destination (dp, say) share one storage: computed once per class.
      // (The storages are kept from tensor to tensor and refilled: no allocation once warm.)
      dst_class_index_.clear();
      std::size_t used = 0;
      for (auto p : dsts) {
        if (dpos && p == *dpos) continue;
        const std::int64_t k = dst_classes_.canonical(p, dt);
        auto& i = dst_class_index_.slot(static_cast<std::uint64_t>(k));
        if (i == detail::FlatIndex::kNone) {
          i = static_cast<std::uint32_t>(used++);
          if (dst_class_store_.size() < used) dst_class_store_.emplace_back();
          dst_storage(p, dt, dst_class_store_[i]);
        }
        plan_dst_tensor(p, dt, rank, out, &dst_class_store_[i]);
      }
    }
  }

  template <class F>
  static void for_each_combination(const std::vector<std::vector<std::int64_t>>& choices, F&& f) {
    for (const auto& c : choices)
      if (c.empty()) return;
    std::array<std::size_t, kMaxTensorRank> idx{};
    std::array<std::int64_t, kMaxTensorRank> cur{};
    while (true) {
      for (std::size_t d = 0; d < choices.size(); ++d) cur[d] = choices[d][idx[d]];
      f(std::span<const std::int64_t>(cur.data(), choices.size()));
      std::size_t d = choices.size();
      while (d > 0) {
        --d;
        if (++idx[d] < choices[d].size()) break;
        idx[d] = 0;
        if (d == 0) return;
      }
      if (choices.empty()) return;
    }
  }

  /// All copies into destination position dpos for tensor dt (only those from
  /// global rank keep_src when keep_src >= 0). `known`: dpos's storage of dt
  /// when the caller has it.
  void plan_dst_tensor(std::int64_t dpos, int dt, std::int64_t keep_src, detail::CopySink& out,
                       const TensorStorage* known = nullptr) {
    const int st = src_of_dst_[static_cast<std::size_t>(dt)];
    if (st < 0) return;  // a scale tensor: written with its tiles' copies
    const auto& sts = src_.tensors[static_cast<std::size_t>(st)];
    const int n = sts.rank();
    // Copies from keep_src come only from the one part it holds: the other
    // parts need not be planned (their holders never include it).
    std::array<std::int64_t, kMaxTensorRank> own{};
    const bool only_own = keep_src >= 0;
    std::int64_t keep_pos = -1;
    if (only_own) {
      const auto kpos = src_.mesh.position_of(keep_src);
      if (!kpos || !src_.holds(*kpos, st)) return;
      keep_pos = *kpos;
      for (int d = 0; d < n; ++d)
        own[static_cast<std::size_t>(d)] = sts.dims[static_cast<std::size_t>(d)].part_of(src_.mesh, *kpos);
    }
    if (!known) dst_storage(dpos, dt, dst_scratch_);  // plan_dst_tensor does not nest
    const TensorStorage& ds = known ? *known : dst_scratch_;
    if (ds.empty()) return;
    const std::int64_t drank = dst_.mesh.global_rank(dpos);
    const auto local_pos = src_.mesh.position_of(drank);
    Ctx c{dpos, dt, st, drank, keep_src, keep_pos, &ds, nullptr, &out};
    for (const auto& D : ds.boxes) {
      c.D = &D;
      c.box = static_cast<std::int32_t>(&D - ds.boxes.data());
      auto& cand = dst_cand_;  // scratch, reused: this runs millions of times
      cand.resize(static_cast<std::size_t>(n));
      bool empty = false;
      for (int d = 0; d < n && !empty; ++d) {
        const auto ud = static_cast<std::size_t>(d);
        cand[ud].clear();
        auto [glo, ghi] = detail::global_window(ds.parts[ud], D.lo[ud], D.hi[ud]);
        ghi = std::min(ghi, sts.shape[ud]);
        sts.cuts[ud].for_parts_meeting(glo, ghi, [&](std::int64_t p) {
          if (!only_own || p == own[ud]) cand[ud].push_back(p);
        });
        empty = cand[ud].empty();
      }
      if (empty) continue;
      for_each_combination(cand, [&](std::span<const std::int64_t> parts) { plan_part(c, parts, local_pos); });
    }
  }

  struct Ctx {
    std::int64_t dpos;
    int dt, st;
    std::int64_t drank, keep_src, keep_pos;  // keep_pos: keep_src's source position (-1: all)
    const TensorStorage* ds;
    const HeldBox* D;
    detail::CopySink* out;
    std::int32_t box = 0;  // D's index in ds->boxes
  };

  /// The pieces of source part `parts` that destination box c.D needs.
  void plan_part(Ctx& c, std::span<const std::int64_t> parts, std::optional<std::int64_t> local_pos) {
    const auto& sts = src_.tensors[static_cast<std::size_t>(c.st)];
    const int n = sts.rank();
    auto& sp = part_dims_;  // scratch, reused (plan_part does not nest)
    sp.resize(static_cast<std::size_t>(n));
    // Unsigned: the key only feeds the replica rotation, wrapping is fine.
    std::uint64_t part_key = 0;
    for (int d = 0; d < n; ++d) {
      const auto ud = static_cast<std::size_t>(d);
      sp[ud] = sts.cuts[ud].part(parts[ud]);
      part_key = part_key * 1000003u + static_cast<std::uint64_t>(parts[ud]);
    }
    // Needed region in the part's local coordinates: per dim the run groups,
    // their bounding window, and the element counts.
    Window need{};
    auto& groups = part_groups_;
    if (groups.size() < static_cast<std::size_t>(n)) groups.resize(static_cast<std::size_t>(n));
    std::array<std::int64_t, kMaxTensorRank> ext{};
    std::int64_t needed_elements = 1;
    for (int d = 0; d < n; ++d) {
      const auto ud = static_cast<std::size_t>(d);
      auto& g = groups[ud];
      g.clear();
      intersect_dim(sp[ud], 0, sp[ud].local_extent, c.ds->parts[ud], c.D->lo[ud], c.D->hi[ud], sts.shape[ud], g);
      if (g.empty()) return;
      std::int64_t lo = INT64_MAX, hi = 0, count = 0;
      for (const auto& r : g) {
        lo = std::min(lo, r.s0);
        hi = std::max(hi, r.s0 + (r.count - 1) * r.sper + r.len);
        count += r.elements();
      }
      need[2 * ud] = lo;
      need[2 * ud + 1] = hi;
      ext[ud] = sp[ud].local_extent;
      needed_elements *= count;
    }
    // The exact needed set is only consulted to cut slabs among replicas.
    auto needed_box = [&] {
      return NeededBox(std::span<const std::vector<RunGroup>>(groups.data(), static_cast<std::size_t>(n)),
                       std::span<const std::int64_t>(ext.data(), static_cast<std::size_t>(n)));
    };
    const std::int64_t ebytes = element_bytes(sts.dtype);
    const std::span<const std::int64_t> holders = src_holders(c.st, parts);
    if (holders.empty()) fail("plan: no source rank holds a part of tensor '{}'", sts.name);
    const bool flat = flat_of(src_, holders[0], c.st, src_flat_) != nullptr;
    // Slabs among replicas and balanced reassignment may cut tiles, which the
    // sender then could not quantize: a quantized destination's pieces are
    // cut along untiled dims only, else go whole to one replica.
    const auto& quant = dst_.tensors[static_cast<std::size_t>(c.dt)].quant;
    const int cut_dims = quant ? n - static_cast<int>(quant->block.size()) : n;
    const auto rot = static_cast<std::uint64_t>(c.dpos) + static_cast<std::uint64_t>(c.dt) + part_key;
    // Replica i of R for slab j (a rotation, so each replica starts elsewhere).
    auto replica = [&](std::uint64_t j, std::size_t R) { return static_cast<std::size_t>((rot + j) % R); };
    if (!flat) {
      std::optional<std::int64_t> local;
      if (local_pos && std::binary_search(holders.begin(), holders.end(), *local_pos)) local = local_pos;
      const auto R = static_cast<std::int64_t>(holders.size());
      // A piece that goes whole: to the group's balanced assignment when the
      // rotation would overload a replica, else by rotation.
      auto whole = [&] {
        if (!quant && opt_.balance_limit > 0 && emit_balanced(c, parts, holders, part_key, sp, need)) return;
        emit(c, holders[replica(0, holders.size())], sp, need);
      };
      if (local) {
        emit(c, *local, sp, need);
        return;
      }
      if (R == 1 || needed_elements * ebytes < opt_.split_bytes) {
        if (R == 1)
          emit(c, holders[0], sp, need);
        else
          whole();
        return;
      }
      // Cut the needed window into one slab per replica with equal needed
      // counts (not equal windows: a strided need has gaps), so each replica
      // sends an even share. The dim: the outermost whose needed count R
      // divides, else the outermost with at least 8 per replica (slabs
      // within 1/8 of each other), else the one with the most.
      const NeededBox needed = needed_box();
      int cut = -1;
      for (int d = 0; d < cut_dims && cut < 0; ++d)
        if (needed.total(d) >= R && needed.total(d) % R == 0) cut = d;
      for (int d = 0; d < cut_dims && cut < 0; ++d)
        if (needed.total(d) >= 8 * R) cut = d;
      for (int d = 0; d < cut_dims && cut < 0; ++d)
        if (needed.total(d) >= R) cut = d;
      for (int d = cut + 1; cut >= 0 && needed.total(cut) < 8 * R && d < cut_dims; ++d)
        if (needed.total(d) > needed.total(cut)) cut = d;
      if (cut < 0) {
        whole();
        return;
      }
      const auto uc = static_cast<std::size_t>(cut);
      const std::int64_t T = needed.total(cut);
      // Slab i ends where the needed count first reaches (i+1)*T/R. When only
      // one source's copies are wanted, plan only its slab.
      auto slab_end = [&](std::int64_t i) {
        if (i <= 0) return need[2 * uc];
        if (i >= R) return need[2 * uc + 1];
        return needed.first_reaching_on(cut, need[2 * uc], need[2 * uc + 1], i * T / R);
      };
      std::int64_t i0 = 0, i1 = R;
      if (c.keep_pos >= 0) {
        const auto at = std::lower_bound(holders.begin(), holders.end(), c.keep_pos);
        if (at == holders.end() || *at != c.keep_pos) return;
        const auto k = static_cast<std::uint64_t>(at - holders.begin());
        const auto uR = static_cast<std::uint64_t>(R);
        i0 = static_cast<std::int64_t>((k + uR - rot % uR) % uR);  // replica(i0, R) == k
        i1 = i0 + 1;
      }
      std::int64_t lo = slab_end(i0);
      for (std::int64_t i = i0; i < i1; ++i) {
        const std::int64_t hi = slab_end(i + 1);
        Window w = need;
        w[2 * uc] = lo;
        w[2 * uc + 1] = hi;
        emit(c, holders[replica(static_cast<std::uint64_t>(i), holders.size())], sp, w);
        lo = hi;
      }
      return;
    }
    // Flat sources: each holder has an interval of the part's row-major local
    // array. Cut [0, size) at every interval end; give each segment to one
    // holder covering it (the destination itself when it can), and a large
    // segment with R holders to all of them in R pieces of equal needed size.
    const NeededBox needed = needed_box();
    const std::vector<std::int64_t> extents(ext.begin(), ext.begin() + n);
    std::vector<std::pair<std::int64_t, std::int64_t>> cover;  // per holder
    std::vector<std::int64_t> cuts;
    for (auto h : holders) {
      const HeldView hs = src_storage(h, c.st);
      cover.emplace_back(hs.lin_lo, hs.lin_hi);
      if (hs.lin_lo < hs.lin_hi) {
        cuts.push_back(hs.lin_lo);
        cuts.push_back(hs.lin_hi);
      }
    }
    std::sort(cuts.begin(), cuts.end());
    cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
    std::int64_t run_holder = -1, run_lo = 0, run_hi = 0;
    auto flush = [&]() {
      if (run_holder < 0) return;
      std::vector<std::array<std::int64_t, 2 * kMaxTensorRank>> tiles;
      linear_to_boxes(extents, run_lo, run_hi, tiles);
      for (const auto& t : tiles) {
        Window w{};
        bool ok = true;
        for (int d = 0; d < n; ++d) {
          const auto ud = static_cast<std::size_t>(d);
          w[2 * ud] = std::max(t[2 * ud], need[2 * ud]);
          w[2 * ud + 1] = std::min(t[2 * ud + 1], need[2 * ud + 1]);
          ok &= w[2 * ud] < w[2 * ud + 1];
        }
        if (ok) emit(c, run_holder, sp, w);
      }
    };
    auto take = [&](std::int64_t holder, std::int64_t a, std::int64_t b) {
      if (a >= b) return;
      if (holder == run_holder && a == run_hi) {
        run_hi = b;
        return;
      }
      flush();
      run_holder = holder;
      run_lo = a;
      run_hi = b;
    };
    auto linear_count = [&](std::int64_t x) { return needed.linear_below(x); };
    for (std::size_t i = 0; i + 1 < cuts.size(); ++i) {
      const std::int64_t a = cuts[i], b = cuts[i + 1];
      std::vector<std::int64_t> covering;
      std::int64_t chosen = -1;
      for (std::size_t h = 0; h < holders.size(); ++h)
        if (cover[h].first <= a && cover[h].second >= b) {
          covering.push_back(holders[h]);
          if (local_pos && holders[h] == *local_pos) chosen = holders[h];
        }
      if (covering.empty()) continue;
      const auto R = static_cast<std::int64_t>(covering.size());
      const std::int64_t c0 = linear_count(a), cnt = linear_count(b) - c0;
      if (cnt == 0) {  // nothing needed here: let a run pass through
        if (run_holder >= 0 && a == run_hi) run_hi = b;
        continue;
      }
      if (chosen >= 0 || R == 1 || cnt < R || cnt * ebytes < opt_.split_bytes) {
        take(chosen >= 0 ? chosen : covering[replica(i, covering.size())], a, b);
        continue;
      }
      std::int64_t lo = a;
      for (std::int64_t j = 0; j < R; ++j) {
        const std::int64_t hi = j + 1 == R ? b : NeededBox::first_reaching(lo, b, c0 + (j + 1) * cnt / R, linear_count);
        take(covering[replica(i + static_cast<std::uint64_t>(j), covering.size())], lo, hi);
        lo = hi;
      }
    }
    flush();
  }

  /// What one destination storage class needs of a group's part: its
  /// pieces (group_class_list_ [first, first + count)) and their elements.
  struct GroupClass {
    std::size_t first, count;
    std::int64_t even, whole;  // elements in pieces cut into R even slabs / going whole
  };
  /// One piece of a replica group: what destination dpos's box `box` needs
  /// of the part, `elements` of it; `cls`: its storage in group_store_.
  struct GroupPiece {
    std::int64_t dpos, elements;
    std::int32_t box, cls;
    bool even;  // cut into R even slabs by plan_part (large enough, and a dim has >= R needed indices)
  };
  /// Where a group's whole pieces go once balanced: replica `replica` (an
  /// index into the holders) sends the piece of (dpos, box), or with dim >=
  /// 0 its slab [lo, hi) along that dim (local coordinates of the part).
  struct ReplicaSlab {
    std::int64_t dpos;
    std::int32_t box, replica, dim;
    std::int64_t lo, hi;
  };
  struct ReplicaGroup {
    bool balanced = false;  // false: the rotation stays (it is within the limit, or nothing does better)
    std::size_t first = 0, count = 0;  // its slabs in group_slabs_, by (dpos, box)
  };

  /// Emits the piece c.D needs of part `parts` as its replica group's
  /// balanced assignment gives it; false when the group keeps the rotation.
  bool emit_balanced(Ctx& c, std::span<const std::int64_t> parts, std::span<const std::int64_t> holders,
                     std::uint64_t part_key, const std::vector<DimPart>& sp, const Window& need) {
    const ReplicaGroup& g = replica_group(c, parts, holders, part_key, sp);
    if (!g.balanced) return false;
    const auto first = group_slabs_.begin() + static_cast<std::ptrdiff_t>(g.first);
    const auto [a, b] = std::equal_range(first, first + static_cast<std::ptrdiff_t>(g.count), ReplicaSlab{c.dpos, c.box, 0, 0, 0, 0},
                                         [](const ReplicaSlab& x, const ReplicaSlab& y) {
                                           return std::pair(x.dpos, x.box) < std::pair(y.dpos, y.box);
                                         });
    if (a == b) return false;  // not among the group's pieces: cannot happen, the rotation is safe
    // Copy the slabs out: emit() may not touch group_slabs_, but stay safe.
    for (auto it = a; it != b; ++it) {
      const ReplicaSlab r = *it;
      Window w = need;
      if (r.dim >= 0) {
        w[2 * static_cast<std::size_t>(r.dim)] = r.lo;
        w[2 * static_cast<std::size_t>(r.dim) + 1] = r.hi;
      }
      emit(c, holders[static_cast<std::size_t>(r.replica)], sp, w);
    }
    return true;
  }

  /// The replica group of source part `parts` (its holders), computed once
  /// per plan: every destination piece that meets the part (as plan_rank
  /// finds them), the rotation's load per replica, and, when that is over
  /// the limit, a better assignment. A pure function of the part, so a
  /// one-rank plan finds the same as the full plan.
  const ReplicaGroup& replica_group(const Ctx& c, std::span<const std::int64_t> parts, std::span<const std::int64_t> holders,
                                    std::uint64_t part_key, const std::vector<DimPart>& sp) {
    const auto& sts = src_.tensors[static_cast<std::size_t>(c.st)];
    const auto& dts = dst_.tensors[static_cast<std::size_t>(c.dt)];
    const int n = sts.rank();
    std::uint64_t lin = 0;  // as src_holders keys it
    for (std::size_t d = 0; d < parts.size(); ++d)
      lin = lin * static_cast<std::uint64_t>(sts.cuts[d].k) + static_cast<std::uint64_t>(parts[d]);
    const std::uint64_t key = (static_cast<std::uint64_t>(c.st) << 32) | lin;
    if (const std::uint32_t i = group_index_.slot(key); i != detail::FlatIndex::kNone) return groups_[i];
    ReplicaGroup g;
    g.first = group_slabs_.size();
    const auto R = static_cast<std::int64_t>(holders.size());
    const std::int64_t ebytes = element_bytes(sts.dtype);
    // The destinations whose pieces meet the part (as plan_rank finds them):
    // the holders of each destination part met. A position holds one part,
    // so no position comes twice.
    auto& cand = group_cand_;
    cand.resize(static_cast<std::size_t>(n));
    for (int d = 0; d < n; ++d) {
      const auto ud = static_cast<std::size_t>(d);
      cand[ud].clear();
      const auto [glo, ghi] = detail::global_window(sp[ud], 0, sp[ud].local_extent);
      dts.cuts[ud].for_parts_meeting(glo, std::min(ghi, dts.shape[ud]), [&](std::int64_t p) { cand[ud].push_back(p); });
    }
    // Destination storages are kept for the whole plan, one per storage
    // class (replicas share theirs); what a class needs of this part is
    // computed once per group: its pieces (one per box met) and their sums.
    const bool alone = dts.buffer < 0;  // holders of one destination part store it alike
    auto& runs = group_runs_;
    if (runs.size() < static_cast<std::size_t>(n)) runs.resize(static_cast<std::size_t>(n));
    auto& classes = group_classes_;
    auto& class_list = group_class_list_;
    classes.clear();
    class_list.clear();
    group_class_index_.clear();
    // A whole plan meets each destination part in many groups: it keeps
    // their holders and each position's storage (per destination tensor);
    // a one-rank plan meets few groups, and new memory costs it more than
    // computing again.
    const bool keep = opt_.only_rank < 0;
    std::vector<std::uint32_t>* store_of = nullptr;
    std::size_t stores = group_store_.size();  // a one-rank plan refills its storages from 0 each group
    if (keep) {
      store_of = &group_store_of_[c.dt];
      if (store_of->empty()) store_of->assign(static_cast<std::size_t>(dst_.mesh.size()), detail::FlatIndex::kNone);
    } else {
      group_store_index_.clear();
      stores = 0;
    }
    auto class_of = [&](std::int64_t p) {
      std::uint32_t none = detail::FlatIndex::kNone;
      auto& known = store_of ? (*store_of)[static_cast<std::size_t>(p)] : none;
      if (known == detail::FlatIndex::kNone) {
        const std::int64_t k = dst_classes_.canonical(p, c.dt);
        auto& si = group_store_index_.slot(static_cast<std::uint64_t>(k) * dst_.tensors.size() + static_cast<std::uint64_t>(c.dt));
        if (si == detail::FlatIndex::kNone) {
          si = static_cast<std::uint32_t>(stores++);
          if (group_store_.size() < stores) group_store_.emplace_back();
          dst_storage(p, c.dt, group_store_[si]);
        }
        known = si;
      }
      const std::uint32_t store = known;
      auto& ci = group_class_index_.slot(store);
      if (ci != detail::FlatIndex::kNone) return ci;
      ci = static_cast<std::uint32_t>(classes.size());
      const TensorStorage& ds = group_store_[store];
      GroupClass gc{class_list.size(), 0, 0, 0};
      for (std::size_t b = 0; b < ds.boxes.size(); ++b) {
        const HeldBox& D = ds.boxes[b];
        std::int64_t elements = 1;
        bool even = false;
        for (int d = 0; d < n && elements > 0; ++d) {
          const auto ud = static_cast<std::size_t>(d);
          runs[ud].clear();
          intersect_dim(sp[ud], 0, sp[ud].local_extent, ds.parts[ud], D.lo[ud], D.hi[ud], sts.shape[ud], runs[ud]);
          std::int64_t count = 0;
          for (const auto& r : runs[ud]) count += r.elements();
          elements *= count;
          even |= count >= R;
        }
        if (elements <= 0) continue;
        even &= elements * ebytes >= opt_.split_bytes;
        (even ? gc.even : gc.whole) += elements;
        class_list.push_back(GroupPiece{0, elements, static_cast<std::int32_t>(b), static_cast<std::int32_t>(store), even});
      }
      gc.count = class_list.size() - gc.first;
      classes.push_back(gc);
      return ci;
    };
    // f(dpos, class) for each destination that needs the part over the
    // network (one holding the part copies locally).
    // range(first, count, class), when given, takes a run of consecutive
    // positions of one class at once (a replicated tensor: every position).
    auto each_destination = [&](auto&& f, auto&& range) {
      for_each_combination(cand, [&](std::span<const std::int64_t> dparts) {
        std::span<const std::int64_t> ps;
        if (keep) {
          ps = dst_holders(c.dt, dparts);
        } else {
          positions_of_part(dst_, c.dt, dparts, group_list_, group_scratch_);
          ps = std::span<const std::int64_t>(group_list_.data(), group_list_.size());
        }
        if (ps.empty()) return;
        if constexpr (!std::is_same_v<std::decay_t<decltype(range)>, std::nullptr_t>) {
          if (alone && !sides_meet_ && ps.back() - ps.front() + 1 == static_cast<std::int64_t>(ps.size())) {
            range(ps.front(), static_cast<std::int64_t>(ps.size()), classes[class_of(ps.front())]);
            return;
          }
        }
        std::uint32_t part_class = detail::FlatIndex::kNone;
        for (const std::int64_t p : ps) {
          if (sides_meet_) {
            const auto lp = src_.mesh.position_of(dst_.mesh.global_rank(p));
            if (lp && std::binary_search(holders.begin(), holders.end(), *lp)) continue;
          }
          if (!alone) {
            f(p, classes[class_of(p)]);
            continue;
          }
          if (part_class == detail::FlatIndex::kNone) part_class = class_of(p);
          f(p, classes[part_class]);
        }
      });
    };
    // The rotation's load (plan_part: replica (dpos + dt + part key) mod R) and the even share.
    auto& load = group_load_;
    load.assign(static_cast<std::size_t>(R), 0);
    std::int64_t even_total = 0, whole_total = 0;
    const auto uR = static_cast<std::uint64_t>(R);
    each_destination(
        [&](std::int64_t p, const GroupClass& gc) {
          even_total += gc.even;
          if (gc.whole == 0) return;
          whole_total += gc.whole;
          const auto rot = static_cast<std::uint64_t>(p) + static_cast<std::uint64_t>(c.dt) + part_key;
          load[static_cast<std::size_t>(rot % uR)] += gc.whole;
        },
        [&](std::int64_t first, std::int64_t m, const GroupClass& gc) {  // positions [first, first + m)
          even_total += gc.even * m;
          if (gc.whole == 0) return;
          whole_total += gc.whole * m;
          const auto um = static_cast<std::uint64_t>(m);
          for (auto& l : load) l += static_cast<std::int64_t>(um / uR) * gc.whole;
          const auto r0 = (static_cast<std::uint64_t>(first) + static_cast<std::uint64_t>(c.dt) + part_key) % uR;
          for (std::uint64_t k = 0; k < um % uR; ++k) load[static_cast<std::size_t>((r0 + k) % uR)] += gc.whole;
        });
    const double share = static_cast<double>(even_total + whole_total) / static_cast<double>(R);
    const double even_each = static_cast<double>(even_total) / static_cast<double>(R);
    auto worst = [&](const std::vector<std::int64_t>& l) {
      return even_each + static_cast<double>(*std::max_element(l.begin(), l.end()));
    };
    const double limit = opt_.balance_limit * share;
    const double rotation = worst(load);
    if (whole_total > 0 && rotation > limit) {
      // Rare: the pieces themselves, in (dpos, box) order (slabs are looked up so).
      auto& pieces = group_pieces_;
      pieces.clear();
      each_destination(
          [&](std::int64_t p, const GroupClass& gc) {
            for (std::size_t k = gc.first; k < gc.first + gc.count; ++k) {
              pieces.push_back(class_list[k]);
              pieces.back().dpos = p;
            }
          },
          nullptr);
      std::stable_sort(pieces.begin(), pieces.end(), [](const GroupPiece& x, const GroupPiece& y) {
        return std::pair(x.dpos, x.box) < std::pair(y.dpos, y.box);
      });
      balance_group(c, g, R, ebytes, part_key, sp, rotation, limit, even_each);
    }
    g.count = group_slabs_.size() - g.first;
    const auto idx = static_cast<std::uint32_t>(groups_.size());
    groups_.push_back(g);
    group_index_.slot(key) = idx;
    return groups_.back();
  }

  /// group_pieces_'s whole pieces reassigned (into group_slabs_, g.balanced
  /// set) when that beats the rotation's worst replica load `rotation`.
  void balance_group(const Ctx& c, ReplicaGroup& g, std::int64_t R, std::int64_t ebytes, std::uint64_t part_key,
                     const std::vector<DimPart>& sp, double rotation, double limit, double even_each) {
    const auto& pieces = group_pieces_;
    const auto uR = static_cast<std::size_t>(R);
    // 1. Whole pieces, largest first onto the least loaded replica (ties:
    //    the first after the part's own rotation start, so parts spread).
    std::vector<std::size_t> order;
    for (std::size_t i = 0; i < pieces.size(); ++i)
      if (!pieces[i].even) order.push_back(i);
    std::stable_sort(order.begin(), order.end(),
                     [&](std::size_t a, std::size_t b) { return pieces[a].elements > pieces[b].elements; });
    std::vector<std::int64_t> lpt_load(uR, 0);
    std::vector<std::int32_t> lpt(pieces.size(), -1);
    const std::size_t start = static_cast<std::size_t>((static_cast<std::uint64_t>(c.dt) + part_key) % uR);
    for (const std::size_t i : order) {
      std::size_t best = start;
      for (std::size_t k = 1; k < uR; ++k) {
        const std::size_t j = (start + k) % uR;
        if (lpt_load[j] < lpt_load[best]) best = j;
      }
      lpt_load[best] += pieces[i].elements;
      lpt[i] = static_cast<std::int32_t>(best);
    }
    const double lpt_worst = even_each + static_cast<double>(*std::max_element(lpt_load.begin(), lpt_load.end()));
    // 2. Wrap-around: the whole pieces end to end in (dpos, box) order, cut
    //    where the running total reaches j/R of it; a cut leaving a slab
    //    under min_slab_bytes moves to the nearer end of its piece.
    std::vector<ReplicaSlab> wrap;
    double wrap_worst = std::numeric_limits<double>::infinity();
    if (lpt_worst > limit) {
      std::int64_t total = 0;
      for (const auto& q : pieces)
        if (!q.even) total += q.elements;
      const std::int64_t min_slab = (std::max<std::int64_t>(opt_.min_slab_bytes, 1) + ebytes - 1) / ebytes;
      std::vector<std::int64_t> wrap_load(uR, 0);
      std::int64_t done = 0;  // elements assigned so far
      std::size_t j = 0;
      auto bound = [&](std::size_t r) {  // floor(total * (r + 1) / R) without overflow
        const auto m = static_cast<std::int64_t>(r + 1);
        return total / R * m + total % R * m / R;
      };
      const int n = src_.tensors[static_cast<std::size_t>(c.st)].rank();
      for (const auto& q : pieces) {
        if (q.even) continue;
        // The piece's needed indices per dim, to cut it into slabs.
        const TensorStorage& ds = group_store_[static_cast<std::size_t>(q.cls)];
        const HeldBox& D = ds.boxes[static_cast<std::size_t>(q.box)];
        auto& runs = group_runs_;
        std::array<std::int64_t, kMaxTensorRank> ext{};
        Window need{};
        for (int d = 0; d < n; ++d) {
          const auto ud = static_cast<std::size_t>(d);
          runs[ud].clear();
          intersect_dim(sp[ud], 0, sp[ud].local_extent, ds.parts[ud], D.lo[ud], D.hi[ud],
                        src_.tensors[static_cast<std::size_t>(c.st)].shape[ud], runs[ud]);
          std::int64_t lo = INT64_MAX, hi = 0;
          for (const auto& r : runs[ud]) {
            lo = std::min(lo, r.s0);
            hi = std::max(hi, r.s0 + (r.count - 1) * r.sper + r.len);
          }
          need[2 * ud] = lo;
          need[2 * ud + 1] = hi;
          ext[ud] = sp[ud].local_extent;
        }
        const NeededBox needed(std::span<const std::vector<RunGroup>>(runs.data(), static_cast<std::size_t>(n)),
                               std::span<const std::int64_t>(ext.data(), static_cast<std::size_t>(n)));
        // Slabs along the outermost dim whose index is at most 1/16 of a
        // replica's share (a cut then lands within 1/32 of its target), else
        // along the one with the finest index.
        int dim = -1;
        for (int d = 0; d < n && dim < 0; ++d)
          if (needed.total(d) >= 2 && q.elements / needed.total(d) * 16 <= total / R) dim = d;
        for (int d = 0; d < n && dim < 0; ++d)
          if (needed.total(d) >= 2 && (dim < 0 || needed.total(d) > needed.total(dim))) dim = d;
        const std::int64_t per = dim >= 0 ? q.elements / needed.total(dim) : q.elements;  // elements per index
        const std::int64_t count = dim >= 0 ? needed.total(dim) : 1;
        std::int64_t at = 0;  // indices of this piece assigned
        auto give = [&](std::size_t r, std::int64_t a, std::int64_t b) {  // indices [a, b) to replica r
          ReplicaSlab s{q.dpos, q.box, static_cast<std::int32_t>(r), -1, 0, 0};
          if (dim >= 0 && (a > 0 || b < count)) {
            const auto ud = static_cast<std::size_t>(dim);
            s.dim = dim;
            s.lo = a == 0 ? need[2 * ud] : needed.first_reaching_on(dim, need[2 * ud], need[2 * ud + 1], a);
            s.hi = b == count ? need[2 * ud + 1] : needed.first_reaching_on(dim, need[2 * ud], need[2 * ud + 1], b);
          }
          wrap.push_back(s);
          wrap_load[r] += (b - a) * per;
          done += (b - a) * per;
        };
        while (at < count) {
          const std::int64_t left = (count - at) * per;
          const std::int64_t room = bound(j) - done;
          if (j + 1 == uR || left <= room) {
            give(j, at, count);
            break;
          }
          if (room <= 0) {
            ++j;
            continue;
          }
          const std::int64_t k = (room + per / 2) / per;  // the cut nearest the boundary
          if (k > 0 && at + k < count && k * per >= min_slab && (count - at - k) * per >= min_slab) {
            give(j, at, at + k);
            at += k;
            ++j;
            continue;
          }
          // No slab cut here: the rest of the piece goes to the side it overlaps most.
          if (room >= left - room) {
            give(j, at, count);
            ++j;
            break;
          }
          ++j;
        }
      }
      wrap_worst = even_each + static_cast<double>(*std::max_element(wrap_load.begin(), wrap_load.end()));
    }
    // Keep the rotation unless an assignment beats it; whole pieces before slabs.
    const bool use_lpt = lpt_worst <= limit || (lpt_worst < rotation && lpt_worst <= wrap_worst);
    const bool use_wrap = !use_lpt && wrap_worst < rotation;
    if (!use_lpt && !use_wrap) return;
    g.balanced = true;
    if (use_wrap) {
      group_slabs_.insert(group_slabs_.end(), wrap.begin(), wrap.end());
      return;
    }
    for (std::size_t i = 0; i < pieces.size(); ++i)
      if (!pieces[i].even) group_slabs_.push_back(ReplicaSlab{pieces[i].dpos, pieces[i].box, lpt[i], -1, 0, 0});
  }

  /// A piece's box before it is cut to kMaxBoxRank dims.
  using WideDims = std::array<std::int64_t, 2 * kMaxTensorRank>;

  /// Appends the collapsed box (rank r) as copies: one, or, when it has more
  /// than kMaxBoxRank dims, one per index of its outer r - kMaxBoxRank dims.
  static void emit_box(Copy& cp, std::int64_t so, std::int64_t doff, int r, const WideDims& ext, const WideDims& sst,
                       const WideDims& dst, detail::CopySink& out) {
    const int outer = std::max(0, r - kMaxBoxRank);
    cp.assign(r - outer, ext.data() + outer, sst.data() + outer, dst.data() + outer);  // cp is reused: assign clears past the rank
    std::array<std::int64_t, 2 * kMaxTensorRank> i{};
    while (true) {
      cp.src_offset = so;
      cp.dst_offset = doff;
      for (int k = 0; k < outer; ++k) {
        const auto uk = static_cast<std::size_t>(k);
        cp.src_offset += i[uk] * sst[uk];
        cp.dst_offset += i[uk] * dst[uk];
      }
      out.push(cp);
      int k = outer - 1;
      for (; k >= 0; --k) {
        const auto uk = static_cast<std::size_t>(k);
        if (++i[uk] < ext[uk]) break;
        i[uk] = 0;
      }
      if (k < 0) break;
    }
  }

  /// Copies from holder position h: the part's local window w, met with each
  /// of the holder's held boxes and with the destination box.
  void emit(Ctx& c, std::int64_t h, const std::vector<DimPart>& sp, const Window& w) {
    const std::int64_t srank = src_.mesh.global_rank(h);
    if (c.keep_src >= 0 && srank != c.keep_src) return;
    const auto& sts = src_.tensors[static_cast<std::size_t>(c.st)];
    const int n = sts.rank();
    const HeldView hs = src_storage(h, c.st);
    const HeldBox& D = *c.D;
    auto& groups = emit_groups_;
    if (groups.size() < static_cast<std::size_t>(n)) groups.resize(static_cast<std::size_t>(n));
    for (std::size_t b = 0; b < hs.count; ++b) {
      const HeldWords S = hs.box(b);
      bool empty = false;
      for (int d = 0; d < n && !empty; ++d) {
        const auto ud = static_cast<std::size_t>(d);
        groups[ud].clear();
        intersect_dim(sp[ud], std::max(S.lo(ud), w[2 * ud]), std::min(S.hi(ud), w[2 * ud + 1]), c.ds->parts[ud],
                      D.lo[ud], D.hi[ud], sts.shape[ud], groups[ud]);
        empty = groups[ud].empty();
      }
      if (empty) continue;
      const std::int32_t src_buffer = src_.buffer_of(c.st), dst_buffer = dst_.buffer_of(c.dt);
      const auto ebytes = static_cast<std::int32_t>(element_bytes(sts.dtype));
      std::array<std::size_t, kMaxTensorRank> idx{};
      Copy cp;  // built here (hot in cache), then copied out once
      cp.src_rank = srank;
      cp.dst_rank = c.drank;
      cp.src_buffer = src_buffer;
      cp.dst_buffer = dst_buffer;
      cp.tensor = c.dt;
      cp.element_bytes = ebytes;
      WideDims ext, sst, dst;  // dims [0, r) set per copy
      const auto& dts = dst_.tensors[static_cast<std::size_t>(c.dt)];
      const auto& quant = dts.quant;
      if (!quant && dts.dtype != sts.dtype) {  // a cast (PlanOptions::cast): the destination's dtype crosses
        cp.quant = CopyQuant::cast;
        cp.element_bytes = static_cast<std::int32_t>(element_bytes(dts.dtype));
      }
      while (true) {
        if (quant) {
          const CopyQuant at = quant_side(*quant, c, groups, idx, n);
          if (at == CopyQuant::sender) emit_scales(*quant, c, groups, idx, n, S, cp);  // reuses cp
          cp.quant = at;
          cp.tensor = c.dt;
          cp.dst_buffer = dst_buffer;
          cp.element_bytes = at == CopyQuant::sender ? 1 : ebytes;
        }
        std::int64_t so = S.base(), doff = D.base;
        int r = 0;
        for (int d = 0; d < n; ++d) {
          const auto ud = static_cast<std::size_t>(d);
          const RunGroup& g = groups[ud][idx[ud]];
          so += g.s0 * S.stride(ud);
          doff += g.d0 * D.stride[ud];
          if (g.count > 1) {
            ext[static_cast<std::size_t>(r)] = g.count;
            sst[static_cast<std::size_t>(r)] = g.sper * S.stride(ud);
            dst[static_cast<std::size_t>(r)] = g.dper * D.stride[ud];
            ++r;
          }
          ext[static_cast<std::size_t>(r)] = g.len;
          sst[static_cast<std::size_t>(r)] = S.stride(ud);
          dst[static_cast<std::size_t>(r)] = D.stride[ud];
          ++r;
        }
        r = collapse_dims(r, ext, sst, dst);
        emit_box(cp, so, doff, r, ext, sst, dst, *c.out);
        if (!next_index(idx, n, [&](std::size_t d) { return groups[d].size(); })) break;
      }
    }
  }

  /// Where the box of run groups `idx` into a quantized tensor is quantized:
  /// on the sender when it is whole tiles (then the sender holds every
  /// element of them: it reads them all), else on the receiver. Local
  /// indices of the destination piece are tile-aligned (Layout validation).
  template <class Groups>
  CopyQuant quant_side(const QuantSpec& q, const Ctx& c, const Groups& groups, const std::array<std::size_t, kMaxTensorRank>& idx,
                       int n) const {
    for (int d = n - static_cast<int>(q.block.size()); d < n; ++d) {
      const auto ud = static_cast<std::size_t>(d);
      const std::int64_t b = q.tile(d, n), L = c.ds->parts[ud].local_extent;
      const RunGroup& g = groups[ud][idx[ud]];
      const bool whole = g.d0 % b == 0 && (g.count == 1 || g.dper % b == 0) &&
                         (g.len % b == 0 || (g.count == 1 && g.d0 + g.len == L));
      if (!whole) return CopyQuant::receiver;
    }
    return CopyQuant::sender;
  }

  /// The scale copy of a sender-quantized box: one entry per tile, read at the
  /// tile's first element on the sender (where its quantizer leaves the
  /// scale), written into the destination's scale tensor (stored alone: a
  /// dense array of the rank's tiles).
  template <class Groups>
  void emit_scales(const QuantSpec& q, Ctx& c, const Groups& groups, const std::array<std::size_t, kMaxTensorRank>& idx, int n,
                   const HeldWords& S, Copy& cp) {
    const int sc = q.scale_tensor;
    std::array<std::int64_t, kMaxTensorRank> sstride{};
    std::int64_t acc = 1;
    for (int d = n - 1; d >= 0; --d) {
      sstride[static_cast<std::size_t>(d)] = acc;
      acc *= dst_.dim_part(c.dpos, sc, d).local_extent;
    }
    WideDims ext, sst, dst;
    std::int64_t so = S.base(), doff = 0;
    int r = 0;
    for (int d = 0; d < n; ++d) {
      const auto ud = static_cast<std::size_t>(d);
      const RunGroup& g = groups[ud][idx[ud]];
      const std::int64_t b = q.tile(d, n);
      so += g.s0 * S.stride(ud);
      doff += g.d0 / b * sstride[ud];
      if (g.count > 1) {
        ext[static_cast<std::size_t>(r)] = g.count;
        sst[static_cast<std::size_t>(r)] = g.sper * S.stride(ud);
        dst[static_cast<std::size_t>(r)] = g.dper / b * sstride[ud];
        ++r;
      }
      ext[static_cast<std::size_t>(r)] = (g.len + b - 1) / b;
      sst[static_cast<std::size_t>(r)] = b * S.stride(ud);
      dst[static_cast<std::size_t>(r)] = sstride[ud];
      ++r;
    }
    r = collapse_dims(r, ext, sst, dst);
    cp.quant = CopyQuant::scale;
    cp.tensor = sc;
    cp.dst_buffer = dst_.buffer_of(sc);
    cp.element_bytes = static_cast<std::int32_t>(element_bytes(scale_dtype(q.scheme)));
    emit_box(cp, so, doff, r, ext, sst, dst, *c.out);
  }

  /// Sorts `copies` in plan order (detail::CopyOrder), coalesces them (see
  /// coalesce()) and appends the result to `out`.
  void finish(std::vector<Copy>& copies, std::vector<Copy>& out) {
    order_.sort(copies.size(), [&](auto&& f) {
      for (std::size_t i = 0; i < copies.size(); ++i) f(static_cast<std::uint32_t>(i), copies[i]);
    });
    const std::size_t start = out.size();
    order_.for_each([&](std::uint32_t idx) {
      // emit() made every copy collapsed already (what coalesce() would do first).
      if (opt_.coalesce) detail::push_coalesced(out, start, copies[idx]);
      else out.push_back(copies[idx]);
    });
  }
  /// finish() for a one-rank plan's log: the same order and merges, written
  /// once into `out`, whose pages are touched only as far as copies land
  /// (reserved for all of them; coalescing may leave the tail unused).
  void finish_log(const detail::CopyLog& log, std::vector<Copy>& out) {
    order_.sort(log.size(), [&](auto&& f) { log.for_each_header(f); });
    out.clear();
    out.reserve(log.size());
    constexpr std::size_t ahead = 1024;  // copies prefaulted per step
    std::size_t ready = 0;
    Copy c;
    order_.for_each([&](std::uint32_t idx) {
      if (out.size() >= ready) {
        detail::prefault(out, ahead);
        ready = out.size() + ahead;
      }
      log.read(idx, c);
      if (opt_.coalesce) detail::push_coalesced(out, 0, c);
      else out.push_back(c);
    });
  }

  const Layout& src_;
  const Layout& dst_;
  PlanOptions opt_;
  std::vector<int> src_of_dst_;
  bool sides_meet_ = false;  // some rank is on both sides (then pieces may be local)
  std::map<std::pair<std::int64_t, int>, FlatRange> src_flat_, dst_flat_;
  std::unordered_map<std::uint64_t, ConcatRange> src_concat_, dst_concat_;
  StorageClasses src_classes_{src_}, dst_classes_{dst_};
  std::deque<TensorStorage> dst_class_store_;  // plan_rank: one tensor's destination storages (stable references)
  detail::FlatIndex dst_class_index_;          // class position -> dst_class_store_ index
  TensorStorage dst_scratch_;                  // plan_dst_tensor's own storage when not given
  struct SrcStorage {
    std::size_t first, count;  // first word in src_words_, boxes
    std::int64_t lin_lo, lin_hi;
  };
  std::vector<SrcStorage> src_store_;
  std::vector<std::int64_t> src_words_;  // held boxes (HeldWords)
  detail::FlatIndex src_store_index_;  // canonical position * tensors + tensor -> src_store_ index
  TensorStorage storage_scratch_;
  detail::PartHolderMemo src_holders_, dst_holders_;
  std::vector<std::int64_t> holder_list_, dst_list_;  // scratch for positions_of_part, plan_rank
  PartHolderScratch holder_scratch_;
  std::vector<std::vector<RunGroup>> emit_groups_, part_groups_;
  std::vector<DimPart> part_dims_;
  std::vector<std::vector<std::int64_t>> dst_cand_;
  // Replica groups (replica_group): per source (tensor, part), and scratch.
  detail::FlatIndex group_index_;  // (source tensor << 32 | part) -> groups_ index
  std::vector<ReplicaGroup> groups_;
  std::vector<ReplicaSlab> group_slabs_;
  std::vector<GroupPiece> group_pieces_, group_class_list_;
  std::vector<GroupClass> group_classes_;
  detail::FlatIndex group_class_index_;  // group_store_ index -> group_classes_ index (one group)
  std::deque<TensorStorage> group_store_;  // destination storages by class, kept for the whole plan
  detail::FlatIndex group_store_index_;    // class position * tensors + tensor -> group_store_ index
  std::unordered_map<int, std::vector<std::uint32_t>> group_store_of_;  // tensor -> position -> group_store_ index
  std::vector<std::vector<std::int64_t>> group_cand_;
  std::vector<std::int64_t> group_list_, group_load_;
  PartHolderScratch group_scratch_;
  std::vector<std::vector<RunGroup>> group_runs_;
  detail::CopyOrder order_;  // finish(), finish_log(): one batch at a time
};

/// Plans the refit from `src` to `dst` (both validated).
inline Schedule plan(const Layout& src, const Layout& dst, const PlanOptions& opt = {}) {
  return Planner(src, dst, opt).run();
}
/// The same from any layout form Resharder takes (a static LayoutOf, say):
/// each side is lowered and validated first.
template <class Src, class Dst>
  requires LayoutDescription<Src> && LayoutDescription<Dst> &&
           (!std::same_as<std::remove_cvref_t<Src>, Layout> || !std::same_as<std::remove_cvref_t<Dst>, Layout>)
Schedule plan(const Src& src, const Dst& dst, const PlanOptions& opt = {}) {
  return plan(lower_layout(src), lower_layout(dst), opt);
}

/// What each source rank sends against its even share. A replica group is
/// the source ranks that could send a copy: those holding its part (for a
/// flat buffer, those holding the same range of it: its storage class). A
/// group's even share is the network bytes it sends / its size; a rank's,
/// the sum over the groups it is in. A whole plan only (a one-rank plan
/// lacks the other ranks' bytes).
struct ReplicaShares {
  std::vector<std::int64_t> ranks;  ///< source ranks, by position
  std::vector<double> sent, share;  ///< network bytes sent, even share
  double worst_ratio = 0;           ///< max sent / share over ranks with share > 0 (0: nothing sent)
  std::int64_t worst_rank = -1;
};

inline ReplicaShares replica_shares(const Schedule& s, const Layout& src, const Layout& dst) {
  ReplicaShares out;
  const std::vector<int> src_of = match_tensors(src, dst, true);  // names only: the plan checked the dtypes
  const std::int64_t P = src.mesh.size();
  const auto T = static_cast<std::int64_t>(src.tensors.size());
  StorageClasses classes(src);
  // group_of[pos * T + st]: the group of (pos, st), -1 when pos holds nothing of st.
  std::vector<std::int32_t> group_of(static_cast<std::size_t>(P * T), -1);
  std::unordered_map<std::uint64_t, std::int32_t> index;
  std::vector<std::int64_t> members;
  std::vector<double> bytes;
  for (std::int64_t p = 0; p < P; ++p)
    for (int st = 0; st < T; ++st) {
      if (!src.holds(p, st)) continue;
      const auto& ts = src.tensors[static_cast<std::size_t>(st)];
      const bool flat = ts.buffer >= 0 && src.buffers[static_cast<std::size_t>(ts.buffer)].kind == BufferKind::flat;
      std::uint64_t v = 0;
      if (flat) {
        v = static_cast<std::uint64_t>(classes.canonical(p, st));
      } else {
        for (int d = 0; d < ts.rank(); ++d)
          v = v * static_cast<std::uint64_t>(ts.cuts[static_cast<std::size_t>(d)].k) +
              static_cast<std::uint64_t>(ts.dims[static_cast<std::size_t>(d)].part_of(src.mesh, p));
      }
      const std::uint64_t key = (static_cast<std::uint64_t>(st) << 33) | (std::uint64_t{flat} << 32) | v;
      auto [it, fresh] = index.emplace(key, static_cast<std::int32_t>(members.size()));
      if (fresh) {
        members.push_back(0);
        bytes.push_back(0);
      }
      ++members[static_cast<std::size_t>(it->second)];
      group_of[static_cast<std::size_t>(p * T + st)] = it->second;
    }
  out.sent.assign(static_cast<std::size_t>(P), 0);
  out.share.assign(static_cast<std::size_t>(P), 0);
  for (std::int64_t p = 0; p < P; ++p) out.ranks.push_back(src.mesh.global_rank(p));
  for (const auto& c : s.copies) {
    if (c.is_local()) continue;
    const auto p = src.mesh.position_of(c.src_rank);
    if (!p || c.tensor < 0 || static_cast<std::size_t>(c.tensor) >= src_of.size()) continue;
    // A scale copy counts with its weight's source (the scale tensor has none).
    const int dt = dst.tensors[static_cast<std::size_t>(c.tensor)].scale_of >= 0
                       ? dst.tensors[static_cast<std::size_t>(c.tensor)].scale_of
                       : c.tensor;
    const std::int32_t g = group_of[static_cast<std::size_t>(*p * T + src_of[static_cast<std::size_t>(dt)])];
    if (g < 0) continue;
    out.sent[static_cast<std::size_t>(*p)] += static_cast<double>(c.bytes());
    bytes[static_cast<std::size_t>(g)] += static_cast<double>(c.bytes());
  }
  for (std::int64_t p = 0; p < P; ++p)
    for (std::int64_t st = 0; st < T; ++st)
      if (const std::int32_t g = group_of[static_cast<std::size_t>(p * T + st)]; g >= 0)
        out.share[static_cast<std::size_t>(p)] +=
            bytes[static_cast<std::size_t>(g)] / static_cast<double>(members[static_cast<std::size_t>(g)]);
  for (std::int64_t p = 0; p < P; ++p) {
    const auto up = static_cast<std::size_t>(p);
    if (out.share[up] <= 0) continue;
    const double r = out.sent[up] / out.share[up];
    if (r > out.worst_ratio) {
      out.worst_ratio = r;
      out.worst_rank = out.ranks[up];
    }
  }
  return out;
}

/// The whole plan, streamed: every destination position's copies (exactly
/// those plan() would give it, in the same order) handed to
/// sink(position, span<const Copy>), one destination at a time and never all
/// at once, in position order (plan() lists them by global rank, which is
/// the same order unless the mesh lists its ranks out of order). With opt.threads != 1 the destinations are cut into contiguous
/// ranges planned in parallel, and sink is called from several threads at
/// once (for different positions): it must be thread-safe then.
template <class Sink>
void plan_each_destination(const Layout& src, const Layout& dst, const PlanOptions& opt, Sink&& sink) {
  const std::int64_t P = dst.mesh.size();
  int T = opt.threads > 0 ? opt.threads : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  T = static_cast<int>(std::min<std::int64_t>(T, std::max<std::int64_t>(P, 1)));
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(T));
  auto range = [&](int k) {
    try {
      Planner(src, dst, opt).for_each_destination(P * k / T, P * (k + 1) / T, sink);
    } catch (...) {
      errors[static_cast<std::size_t>(k)] = std::current_exception();
    }
  };
  std::vector<std::thread> workers;
  for (int k = 1; k < T; ++k) workers.emplace_back(range, k);
  range(0);
  for (auto& w : workers) w.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

}  // namespace reshard
