#pragma once
// The planner: two validated layouts -> Schedule. Destination-driven: for each
// destination rank and each piece it holds, the overlapping source parts are
// found by search over cut points (never all source x destination ranks), a
// holder is chosen among the replicas (the rank itself when it holds the data,
// else spread evenly), and the common boxes become strided copies.
//
// Every choice is a pure function of (destination rank, tensor, piece), so a
// process that plans only its own rank (`only_rank`) computes exactly the
// copies a full plan gives it.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <deque>
#include <exception>
#include <iterator>
#include <map>
#include <set>
#include <span>
#include <thread>
#include <unordered_map>
#include <vector>

#ifdef __linux__
#include <sys/mman.h>
#endif

#include "box.hpp"
#include "layout.hpp"
#include "schedule.hpp"
#include "storage.hpp"

namespace reshard {

struct PlanOptions {
  /// >= 0: plan only the copies this global rank sends or receives.
  std::int64_t only_rank = -1;
  /// Pieces with R > 1 replicas and at least this many bytes are cut into R
  /// slabs of equal needed element counts (along one dim; for flat sources,
  /// along the row-major order), one per replica, so every replica sends its
  /// even share. Smaller pieces go whole to one replica, by rotation.
  std::int64_t split_bytes = 64 * 1024;
  bool coalesce = true;
  /// Threads for a full plan (only_rank < 0): destinations are cut into this
  /// many contiguous ranges, planned independently (every choice is a pure
  /// function of the destination) and joined in order, so the schedule is the
  /// same for any count. 0: std::thread::hardware_concurrency().
  int threads = 1;
};

/// Checks that two layouts describe the same tensors; returns, for each
/// destination tensor, the id of the source tensor with the same name.
inline std::vector<int> match_tensors(const Layout& src, const Layout& dst) {
  std::vector<int> map(dst.tensors.size(), -1);
  for (std::size_t t = 0; t < dst.tensors.size(); ++t) {
    const auto& d = dst.tensors[t];
    const int s = src.find_tensor(d.name);
    if (s < 0) layout_fail(ErrorContext{dst.origin, d.name, "name"}, "no tensor of this name in {}", src.origin);
    const auto& st = src.tensors[static_cast<std::size_t>(s)];
    if (st.shape != d.shape)
      layout_fail(ErrorContext{dst.origin, d.name, "shape"}, "shape [{}] differs from [{}] in {}",
                  fmt::join(d.shape, ", "), fmt::join(st.shape, ", "), src.origin);
    if (st.dtype != d.dtype)
      layout_fail(ErrorContext{dst.origin, d.name, "dtype"}, "dtype {} differs from {} in {}", to_string(d.dtype),
                  to_string(st.dtype), src.origin);
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
  out.assign(1, 0);
  for (std::size_t a = 0; a < axes.size(); ++a) {
    const std::int64_t stride = L.mesh.axis_stride(static_cast<int>(a));
    s.allowed.clear();
    for (std::int64_t c = 0; c < axes[a].size; ++c) {
      bool ok = true;
      for (const auto& n : s.needs)
        if (n.axis == static_cast<int>(a) && (c / n.stride) % n.size != n.want) ok = false;
      if (ok) s.allowed.push_back(c * stride);
    }
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
/// Prefaults the storage for the next `n` elements of v (within its
/// capacity) in one call: a full plan writes gigabytes of copies, and taking
/// one page fault per 4 KiB would cost more than planning them.
template <class T>
void prefault(std::vector<T>& v, std::size_t n) {
#if defined(__linux__) && defined(MADV_POPULATE_WRITE) && !defined(RESHARD_NO_PREFAULT)
  constexpr std::uintptr_t page = 4096;
  n = std::min(n, v.capacity() - v.size());
  if (n * sizeof(T) < 16 * page) return;
  const auto at = reinterpret_cast<std::uintptr_t>(v.data() + v.size());
  const std::uintptr_t lo = at & ~(page - 1), hi = (at + n * sizeof(T) + page - 1) & ~(page - 1);
  (void)madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_POPULATE_WRITE);  // a hint only: may fail
#else
  (void)v;
  (void)n;
#endif
}
/// Doubles v's capacity and prefaults the new part: a plan's copy vectors
/// grow to megabytes, and on virtual machines one page fault per 4 KiB costs
/// as much as planning the copies in it.
template <class T>
void grow_prefaulted(std::vector<T>& v) {
  std::vector<T> bigger;
  bigger.reserve(std::max<std::size_t>(64, 2 * v.capacity()));
  prefault(bigger, bigger.capacity());  // before the copy touches it page by page
  bigger.insert(bigger.end(), std::make_move_iterator(v.begin()), std::make_move_iterator(v.end()));
  v.swap(bigger);
}
}  // namespace detail

class Planner {
 public:
  Planner(const Layout& src, const Layout& dst, PlanOptions opt = {}) : src_(src), dst_(dst), opt_(opt) {
    if (!src.validated() || !dst.validated()) fail("plan: both layouts must be validated first");
    src_of_dst_ = match_tensors(src, dst);
  }

  Schedule run() {
    const auto t0 = std::chrono::steady_clock::now();
    Schedule s;
    for (const auto& b : src_.local_buffers()) s.src_buffers.push_back(b.name);
    for (const auto& b : dst_.local_buffers()) s.dst_buffers.push_back(b.name);
    s.only_rank = opt_.only_rank;
    std::vector<Copy> batch;
    if (opt_.only_rank < 0) {
      const std::int64_t P = dst_.mesh.size();
      int T = opt_.threads > 0 ? opt_.threads : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
      T = static_cast<int>(std::min<std::int64_t>(T, std::max<std::int64_t>(P, 1)));
      // Range k of T: [P*k/T, P*(k+1)/T). Range 0 runs here, straight into the
      // output; the others in their own Planners (their caches are not shared).
      std::vector<std::vector<Copy>> parts(static_cast<std::size_t>(T > 1 ? T - 1 : 0));
      std::vector<std::exception_ptr> errors(parts.size());
      std::vector<std::thread> workers;
      for (int k = 1; k < T; ++k)
        workers.emplace_back([&, k] {
          try {
            PlanOptions o = opt_;
            o.threads = 1;
            Planner(src_, dst_, o).plan_range(P * k / T, P * (k + 1) / T, parts[static_cast<std::size_t>(k - 1)]);
          } catch (...) {
            errors[static_cast<std::size_t>(k - 1)] = std::current_exception();
          }
        });
      std::exception_ptr mine;
      try {
        plan_range(0, P / T, s.copies);
      } catch (...) {
        mine = std::current_exception();
      }
      for (auto& w : workers) w.join();
      if (mine) std::rethrow_exception(mine);
      for (auto& e : errors)
        if (e) std::rethrow_exception(e);
      std::size_t total = s.copies.size();
      for (const auto& v : parts) total += v.size();
      s.copies.reserve(total);
      for (auto& v : parts) {
        s.copies.insert(s.copies.end(), v.begin(), v.end());
        std::vector<Copy>().swap(v);
      }
      bool ordered = true;
      for (std::int64_t p = 1; p < P && ordered; ++p)
        ordered = dst_.mesh.global_rank(p) >= dst_.mesh.global_rank(p - 1);
      if (!ordered)
        std::stable_sort(s.copies.begin(), s.copies.end(),
                         [](const Copy& a, const Copy& b) { return a.dst_rank < b.dst_rank; });
    } else {
      plan_rank(opt_.only_rank, batch);
      finish_in_place(batch);
      s.copies = std::move(batch);
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
      for (int t = 0; t < static_cast<int>(dst_.tensors.size()); ++t) plan_dst_tensor(p, t, -1, batch);
      done.clear();
      finish(batch, done);
      sink(p, std::span<const Copy>(done.data(), done.size()));
    }
  }

 private:
  /// Every copy into destination positions [p0, p1), appended to out in
  /// destination order. One destination at a time: its copies are sorted and
  /// coalesced in a small batch (no copy ever merges across destination
  /// ranks), so the big output is written once, in order.
  void plan_range(std::int64_t p0, std::int64_t p1, std::vector<Copy>& out) {
    std::vector<Copy> batch;
    for (std::int64_t p = p0; p < p1; ++p) {
      batch.clear();
      for (int t = 0; t < static_cast<int>(dst_.tensors.size()); ++t) plan_dst_tensor(p, t, -1, batch);
      if (out.capacity() == 0 && !batch.empty())
        out.reserve(batch.size() * static_cast<std::size_t>(p1 - p0) * 5 / 4 + 16);
      detail::prefault(out, batch.size());
      finish(batch, out);
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
  /// Source storages are met by many destinations: kept for the whole plan,
  /// one per storage class (replicas share theirs).
  const TensorStorage& src_storage(std::int64_t pos, int t) {
    if (src_store_index_.empty())
      src_store_index_.assign(static_cast<std::size_t>(src_.mesh.size()) * src_.tensors.size(), -1);
    pos = src_classes_.canonical(pos, t);
    auto& i = src_store_index_[static_cast<std::size_t>(pos) * src_.tensors.size() + static_cast<std::size_t>(t)];
    if (i < 0) {
      i = static_cast<std::int32_t>(src_store_.size());
      src_store_.push_back(
          tensor_storage(src_, pos, t, flat_of(src_, pos, t, src_flat_), concat_of(src_, pos, t, src_concat_)));
    }
    return src_store_[static_cast<std::size_t>(i)];
  }
  TensorStorage dst_storage(std::int64_t pos, int t) {
    if (!dst_.holds(pos, t)) return TensorStorage{};
    return tensor_storage(dst_, pos, t, flat_of(dst_, pos, t, dst_flat_), concat_of(dst_, pos, t, dst_concat_));
  }
  /// positions_of_part(src_, st, parts), computed once per part in a plan.
  const std::vector<std::int64_t>& src_holders(int st, std::span<const std::int64_t> parts) {
    const auto& cuts = src_.tensors[static_cast<std::size_t>(st)].cuts;
    std::uint64_t lin = 0;  // < mesh size: each axis digit is referenced once
    for (std::size_t d = 0; d < parts.size(); ++d)
      lin = lin * static_cast<std::uint64_t>(cuts[d].k) + static_cast<std::uint64_t>(parts[d]);
    const std::uint64_t key = (static_cast<std::uint64_t>(st) << 32) | lin;
    auto it = holders_.find(key);
    if (it == holders_.end()) {
      positions_of_part(src_, st, parts, holder_list_, holder_scratch_);
      it = holders_.emplace(key, holder_list_).first;
    }
    return it->second;
  }

  /// What one rank sends or receives: its own receives in full, plus, for each
  /// destination whose pieces meet what the rank holds, the copies from it.
  void plan_rank(std::int64_t rank, std::vector<Copy>& out) {
    const auto dpos = dst_.mesh.position_of(rank);
    if (dpos)
      for (int t = 0; t < static_cast<int>(dst_.tensors.size()); ++t) plan_dst_tensor(*dpos, t, -1, out);
    const auto spos = src_.mesh.position_of(rank);
    if (!spos) return;
    for (int dt = 0; dt < static_cast<int>(dst_.tensors.size()); ++dt) {
      const int st = src_of_dst_[static_cast<std::size_t>(dt)];
      if (!src_.holds(*spos, st)) continue;
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
      dst_class_store_.clear();
      for (auto p : dsts) {
        if (dpos && p == *dpos) continue;
        const std::int64_t k = dst_classes_.canonical(p, dt);
        auto it = dst_class_store_.find(k);
        if (it == dst_class_store_.end()) it = dst_class_store_.emplace(k, dst_storage(p, dt)).first;
        plan_dst_tensor(p, dt, rank, out, &it->second);
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
  void plan_dst_tensor(std::int64_t dpos, int dt, std::int64_t keep_src, std::vector<Copy>& out,
                       const TensorStorage* known = nullptr) {
    const int st = src_of_dst_[static_cast<std::size_t>(dt)];
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
    TensorStorage computed;
    if (!known) computed = dst_storage(dpos, dt);
    const TensorStorage& ds = known ? *known : computed;
    if (ds.empty()) return;
    const std::int64_t drank = dst_.mesh.global_rank(dpos);
    const auto local_pos = src_.mesh.position_of(drank);
    Ctx c{dpos, dt, st, drank, keep_src, keep_pos, &ds, nullptr, &out};
    for (const auto& D : ds.boxes) {
      c.D = &D;
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
    std::vector<Copy>* out;
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
    const std::vector<std::int64_t>& holders = src_holders(c.st, parts);
    if (holders.empty()) fail("plan: no source rank holds a part of tensor '{}'", sts.name);
    const bool flat = flat_of(src_, holders[0], c.st, src_flat_) != nullptr;
    const auto rot = static_cast<std::uint64_t>(c.dpos) + static_cast<std::uint64_t>(c.dt) + part_key;
    // Replica i of R for slab j (a rotation, so each replica starts elsewhere).
    auto replica = [&](std::uint64_t j, std::size_t R) { return static_cast<std::size_t>((rot + j) % R); };
    if (!flat) {
      std::optional<std::int64_t> local;
      if (local_pos && std::binary_search(holders.begin(), holders.end(), *local_pos)) local = local_pos;
      const auto R = static_cast<std::int64_t>(holders.size());
      if (local || R == 1 || needed_elements * ebytes < opt_.split_bytes) {
        const std::int64_t h = local ? *local : holders[replica(0, holders.size())];
        emit(c, h, sp, need);
        return;
      }
      // Cut the needed window into one slab per replica with equal needed
      // counts (not equal windows: a strided need has gaps), so each replica
      // sends an even share. The dim: the outermost whose needed count R
      // divides, else the outermost with at least 8 per replica (slabs
      // within 1/8 of each other), else the one with the most.
      const NeededBox needed = needed_box();
      int cut = -1;
      for (int d = 0; d < n && cut < 0; ++d)
        if (needed.total(d) >= R && needed.total(d) % R == 0) cut = d;
      for (int d = 0; d < n && cut < 0; ++d)
        if (needed.total(d) >= 8 * R) cut = d;
      for (int d = 0; d < n && cut < 0; ++d)
        if (needed.total(d) >= R) cut = d;
      for (int d = cut + 1; cut >= 0 && needed.total(cut) < 8 * R && d < n; ++d)
        if (needed.total(d) > needed.total(cut)) cut = d;
      if (cut < 0) {
        emit(c, holders[replica(0, holders.size())], sp, need);
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
      const TensorStorage& hs = src_storage(h, c.st);
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

  /// A piece's box before it is cut to kMaxBoxRank dims.
  using WideDims = std::array<std::int64_t, 2 * kMaxTensorRank>;

  /// Appends the collapsed box (rank r) as copies: one, or, when it has more
  /// than kMaxBoxRank dims, one per index of its outer r - kMaxBoxRank dims.
  static void emit_box(Copy& cp, std::int64_t so, std::int64_t doff, int r, const WideDims& ext, const WideDims& sst,
                       const WideDims& dst, std::vector<Copy>& out) {
    const int outer = std::max(0, r - kMaxBoxRank);
    const int old = cp.rank;  // cp is reused: dims past the new rank must read 0
    cp.rank = r - outer;
    for (int k = 0; k < cp.rank; ++k) {
      const auto uk = static_cast<std::size_t>(k), uo = static_cast<std::size_t>(outer + k);
      cp.extent[uk] = ext[uo];
      cp.src_stride[uk] = sst[uo];
      cp.dst_stride[uk] = dst[uo];
    }
    for (auto k = static_cast<std::size_t>(cp.rank); k < static_cast<std::size_t>(old); ++k)
      cp.extent[k] = cp.src_stride[k] = cp.dst_stride[k] = 0;
    std::array<std::int64_t, 2 * kMaxTensorRank> i{};
    while (true) {
      cp.src_offset = so;
      cp.dst_offset = doff;
      for (int k = 0; k < outer; ++k) {
        const auto uk = static_cast<std::size_t>(k);
        cp.src_offset += i[uk] * sst[uk];
        cp.dst_offset += i[uk] * dst[uk];
      }
      if (out.size() == out.capacity()) detail::grow_prefaulted(out);
      out.push_back(cp);
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
    const TensorStorage& hs = src_storage(h, c.st);
    const HeldBox& D = *c.D;
    auto& groups = emit_groups_;
    if (groups.size() < static_cast<std::size_t>(n)) groups.resize(static_cast<std::size_t>(n));
    for (const auto& S : hs.boxes) {
      bool empty = false;
      for (int d = 0; d < n && !empty; ++d) {
        const auto ud = static_cast<std::size_t>(d);
        groups[ud].clear();
        intersect_dim(sp[ud], std::max(S.lo[ud], w[2 * ud]), std::min(S.hi[ud], w[2 * ud + 1]), c.ds->parts[ud],
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
      while (true) {
        std::int64_t so = S.base, doff = D.base;
        int r = 0;
        for (int d = 0; d < n; ++d) {
          const auto ud = static_cast<std::size_t>(d);
          const RunGroup& g = groups[ud][idx[ud]];
          so += g.s0 * S.stride[ud];
          doff += g.d0 * D.stride[ud];
          if (g.count > 1) {
            ext[static_cast<std::size_t>(r)] = g.count;
            sst[static_cast<std::size_t>(r)] = g.sper * S.stride[ud];
            dst[static_cast<std::size_t>(r)] = g.dper * D.stride[ud];
            ++r;
          }
          ext[static_cast<std::size_t>(r)] = g.len;
          sst[static_cast<std::size_t>(r)] = S.stride[ud];
          dst[static_cast<std::size_t>(r)] = D.stride[ud];
          ++r;
        }
        r = collapse_dims(r, ext, sst, dst);
        emit_box(cp, so, doff, r, ext, sst, dst, *c.out);
        int d = n - 1;
        for (; d >= 0; --d) {
          const auto ud = static_cast<std::size_t>(d);
          if (++idx[ud] < groups[ud].size()) break;
          idx[ud] = 0;
        }
        if (d < 0) break;
      }
    }
  }

  /// Sorts `copies` by (destination rank, destination buffer, source rank,
  /// source buffer, tensor, destination offset), coalesces them (see
  /// coalesce()) and appends the result to `out`. Sorts small keys, not the
  /// large Copy structs.
  void finish(std::vector<Copy>& copies, std::vector<Copy>& out) {
    sort_keys(copies);
    const std::size_t start = out.size();
    for (const FinishKey& k : keys_) {
      // emit() made every copy collapsed already (what coalesce() would do first).
      out.push_back(copies[k.idx]);
      if (!opt_.coalesce) continue;
      while (out.size() - start >= 2 && detail::same_route(out[out.size() - 2], out.back()) &&
             detail::merge_into(out[out.size() - 2], out.back()))
        out.pop_back();
    }
  }
  /// finish() in place: the same order and merges, without a second array of
  /// copies (a one-rank plan's copies are megabytes of fresh pages).
  void finish_in_place(std::vector<Copy>& copies) {
    sort_keys(copies);
    // Gather permutation: position k takes copies[keys_[k].idx]. Follow each
    // cycle once, marking a finished position with idx = k.
    for (std::size_t k = 0; k < keys_.size(); ++k) {
      if (keys_[k].idx == k) continue;
      Copy hold = copies[k];
      std::size_t at = k;
      while (true) {
        const std::size_t from = keys_[at].idx;
        keys_[at].idx = static_cast<std::uint32_t>(at);
        if (from == k) {
          copies[at] = hold;
          break;
        }
        copies[at] = copies[from];
        at = from;
      }
    }
    if (!opt_.coalesce) return;
    std::size_t w = 0;
    for (std::size_t r = 0; r < copies.size(); ++r) {
      if (w != r) copies[w] = copies[r];
      ++w;
      while (w >= 2 && detail::same_route(copies[w - 2], copies[w - 1]) && detail::merge_into(copies[w - 2], copies[w - 1])) --w;
    }
    copies.resize(w);
  }
  /// keys_ = the copies' sort keys, sorted by (destination rank, destination
  /// buffer, source rank, source buffer, tensor, destination offset).
  void sort_keys(const std::vector<Copy>& copies) {
    using Key = FinishKey;
    keys_.clear();
    keys_.reserve(copies.size());
    for (std::size_t i = 0; i < copies.size(); ++i) {
      const Copy& c = copies[i];
      keys_.push_back(Key{c.dst_rank, c.src_rank, c.dst_offset, c.dst_buffer, c.src_buffer, c.tensor,
                          static_cast<std::uint32_t>(i)});
    }
    std::sort(keys_.begin(), keys_.end(), [](const Key& a, const Key& b) {
      // Field by field with early exits (a tuple compare costs more here).
      if (a.dst_rank != b.dst_rank) return a.dst_rank < b.dst_rank;
      if (a.dst_buffer != b.dst_buffer) return a.dst_buffer < b.dst_buffer;
      if (a.src_rank != b.src_rank) return a.src_rank < b.src_rank;
      if (a.src_buffer != b.src_buffer) return a.src_buffer < b.src_buffer;
      if (a.tensor != b.tensor) return a.tensor < b.tensor;
      if (a.dst_offset != b.dst_offset) return a.dst_offset < b.dst_offset;
      return a.idx < b.idx;
    });
  }

  const Layout& src_;
  const Layout& dst_;
  PlanOptions opt_;
  std::vector<int> src_of_dst_;
  std::map<std::pair<std::int64_t, int>, FlatRange> src_flat_, dst_flat_;
  std::unordered_map<std::uint64_t, ConcatRange> src_concat_, dst_concat_;
  StorageClasses src_classes_{src_}, dst_classes_{dst_};
  std::unordered_map<std::int64_t, TensorStorage> dst_class_store_;  // plan_rank: one tensor's destination storages
  std::deque<TensorStorage> src_store_;        // stable references
  std::vector<std::int32_t> src_store_index_;  // (position, tensor) -> src_store_ index, -1 = not yet
  std::unordered_map<std::uint64_t, std::vector<std::int64_t>> holders_;
  std::vector<std::int64_t> holder_list_, dst_list_;  // scratch for positions_of_part, plan_rank
  PartHolderScratch holder_scratch_;
  std::vector<std::vector<RunGroup>> emit_groups_, part_groups_;
  std::vector<DimPart> part_dims_;
  std::vector<std::vector<std::int64_t>> dst_cand_;
  struct FinishKey {
    std::int64_t dst_rank, src_rank, dst_offset;
    std::int32_t dst_buffer, src_buffer, tensor;
    std::uint32_t idx;
  };
  std::vector<FinishKey> keys_;
};

/// Plans the refit from `src` to `dst` (both validated).
inline Schedule plan(const Layout& src, const Layout& dst, const PlanOptions& opt = {}) {
  return Planner(src, dst, opt).run();
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
