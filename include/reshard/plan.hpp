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
#include <chrono>
#include <cstdint>
#include <map>
#include <set>
#include <vector>

#include "box.hpp"
#include "layout.hpp"
#include "schedule.hpp"
#include "storage.hpp"

namespace reshard {

struct PlanOptions {
  /// >= 0: plan only the copies this global rank sends or receives.
  std::int64_t only_rank = -1;
  /// Pieces with several replicas and at least this many bytes are cut into
  /// one slab per replica, so every replica sends its even share.
  std::int64_t split_bytes = 64 * 1024;
  bool coalesce = true;
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

/// Mesh positions that hold part `parts` (one part index per dim) of tensor t.
inline std::vector<std::int64_t> positions_of_part(const Layout& L, int t, const std::vector<std::int64_t>& parts) {
  const auto& ts = L.tensors[static_cast<std::size_t>(t)];
  const auto& axes = L.mesh.axes;
  std::vector<std::vector<std::int64_t>> allowed(axes.size());
  for (std::size_t a = 0; a < axes.size(); ++a)
    for (std::int64_t c = 0; c < axes[a].size; ++c) allowed[a].push_back(c);
  auto restrict_to = [&](int axis, auto&& ok) {
    auto& v = allowed[static_cast<std::size_t>(axis)];
    v.erase(std::remove_if(v.begin(), v.end(), [&](std::int64_t c) { return !ok(c); }), v.end());
  };
  for (std::size_t d = 0; d < ts.dims.size(); ++d) {
    std::int64_t p = parts[d];
    const auto& refs = ts.dims[d].axes;
    for (auto r = refs.rbegin(); r != refs.rend(); ++r) {
      const std::int64_t digit = p % r->size;
      p /= r->size;
      restrict_to(r->axis, [&](std::int64_t c) { return (c / r->stride) % r->size == digit; });
    }
  }
  for (const auto& s : ts.stage) restrict_to(s.axis, [&](std::int64_t c) { return c == s.coord; });
  std::vector<std::int64_t> out{0};
  for (std::size_t a = 0; a < axes.size(); ++a) {
    std::vector<std::int64_t> next;
    next.reserve(out.size() * allowed[a].size());
    for (auto base : out)
      for (auto c : allowed[a]) next.push_back(base + c * L.mesh.axis_stride(static_cast<int>(a)));
    out.swap(next);
  }
  std::sort(out.begin(), out.end());
  return out;
}

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
    if (opt_.only_rank < 0) {
      for (std::int64_t p = 0; p < dst_.mesh.size(); ++p)
        for (int t = 0; t < static_cast<int>(dst_.tensors.size()); ++t) plan_dst_tensor(p, t, -1, s.copies);
    } else {
      plan_rank(opt_.only_rank, s.copies);
    }
    finish(s.copies);
    std::set<std::int64_t> ranks;
    for (auto r : src_.mesh.global_ranks()) ranks.insert(r);
    for (auto r : dst_.mesh.global_ranks()) ranks.insert(r);
    s.compute_stats(static_cast<std::int64_t>(ranks.size()));
    s.stats.plan_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return s;
  }

 private:
  using Window = std::array<std::int64_t, 2 * kMaxTensorRank>;  // lo,hi per dim

  const FlatRange* flat_of(const Layout& L, std::int64_t pos, int t, std::map<std::pair<std::int64_t, int>, FlatRange>& cache) {
    const int b = L.tensors[static_cast<std::size_t>(t)].buffer;
    if (b < 0 || L.buffers[static_cast<std::size_t>(b)].kind != BufferKind::flat) return nullptr;
    auto key = std::make_pair(pos, b);
    auto it = cache.find(key);
    if (it == cache.end()) it = cache.emplace(key, flat_range(L, pos, L.buffers[static_cast<std::size_t>(b)])).first;
    return &it->second;
  }
  TensorStorage src_storage(std::int64_t pos, int t) { return tensor_storage(src_, pos, t, flat_of(src_, pos, t, src_flat_)); }
  TensorStorage dst_storage(std::int64_t pos, int t) { return tensor_storage(dst_, pos, t, flat_of(dst_, pos, t, dst_flat_)); }

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
      std::set<std::int64_t> dsts;
      for_each_combination(cand, [&](const std::vector<std::int64_t>& parts) {
        for (auto p : positions_of_part(dst_, dt, parts)) dsts.insert(p);
      });
      for (auto p : dsts)
        if (!dpos || p != *dpos) plan_dst_tensor(p, dt, rank, out);
    }
  }

  template <class F>
  static void for_each_combination(const std::vector<std::vector<std::int64_t>>& choices, F&& f) {
    for (const auto& c : choices)
      if (c.empty()) return;
    std::vector<std::size_t> idx(choices.size(), 0);
    std::vector<std::int64_t> cur(choices.size());
    while (true) {
      for (std::size_t d = 0; d < choices.size(); ++d) cur[d] = choices[d][idx[d]];
      f(cur);
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
  /// global rank keep_src when keep_src >= 0).
  void plan_dst_tensor(std::int64_t dpos, int dt, std::int64_t keep_src, std::vector<Copy>& out) {
    const TensorStorage ds = dst_storage(dpos, dt);
    if (ds.empty()) return;
    const int st = src_of_dst_[static_cast<std::size_t>(dt)];
    const auto& sts = src_.tensors[static_cast<std::size_t>(st)];
    const int n = sts.rank();
    const std::int64_t drank = dst_.mesh.global_rank(dpos);
    const auto local_pos = src_.mesh.position_of(drank);
    Ctx c{dpos, dt, st, drank, keep_src, &ds, nullptr, &out};
    for (const auto& D : ds.boxes) {
      c.D = &D;
      std::vector<std::vector<std::int64_t>> cand(static_cast<std::size_t>(n));
      bool empty = false;
      for (int d = 0; d < n && !empty; ++d) {
        const auto ud = static_cast<std::size_t>(d);
        auto [glo, ghi] = detail::global_window(ds.parts[ud], D.lo[ud], D.hi[ud]);
        ghi = std::min(ghi, sts.shape[ud]);
        sts.cuts[ud].for_parts_meeting(glo, ghi, [&](std::int64_t p) { cand[ud].push_back(p); });
        empty = cand[ud].empty();
      }
      if (empty) continue;
      for_each_combination(cand, [&](const std::vector<std::int64_t>& parts) { plan_part(c, parts, local_pos); });
    }
  }

  struct Ctx {
    std::int64_t dpos;
    int dt, st;
    std::int64_t drank, keep_src;
    const TensorStorage* ds;
    const HeldBox* D;
    std::vector<Copy>* out;
  };

  /// The pieces of source part `parts` that destination box c.D needs.
  void plan_part(Ctx& c, const std::vector<std::int64_t>& parts, std::optional<std::int64_t> local_pos) {
    const auto& sts = src_.tensors[static_cast<std::size_t>(c.st)];
    const int n = sts.rank();
    std::vector<DimPart> sp(static_cast<std::size_t>(n));
    Window whole{};
    std::int64_t part_key = 0;
    for (int d = 0; d < n; ++d) {
      const auto ud = static_cast<std::size_t>(d);
      sp[ud] = sts.cuts[ud].part(parts[ud]);
      whole[2 * ud + 1] = sp[ud].local_extent;
      part_key = part_key * 1000003 + parts[ud];
    }
    // Needed region in the part's local coordinates: bounding window and size.
    Window need{};
    std::int64_t need_elems = 1;
    for (int d = 0; d < n; ++d) {
      const auto ud = static_cast<std::size_t>(d);
      std::vector<RunGroup> g;
      intersect_dim(sp[ud], 0, sp[ud].local_extent, c.ds->parts[ud], c.D->lo[ud], c.D->hi[ud], sts.shape[ud], g);
      if (g.empty()) return;
      std::int64_t lo = INT64_MAX, hi = 0, cnt = 0;
      for (const auto& r : g) {
        lo = std::min(lo, r.s0);
        hi = std::max(hi, r.s0 + (r.count - 1) * r.sper + r.len);
        cnt += r.elements();
      }
      need[2 * ud] = lo;
      need[2 * ud + 1] = hi;
      need_elems *= cnt;
    }
    const std::vector<std::int64_t> holders = positions_of_part(src_, c.st, parts);
    if (holders.empty()) fail("plan: no source rank holds a part of tensor '{}'", sts.name);
    const bool flat = flat_of(src_, holders[0], c.st, src_flat_) != nullptr;
    const std::int64_t rot = c.dpos + c.dt + part_key;
    if (!flat) {
      std::optional<std::int64_t> local;
      if (local_pos && std::binary_search(holders.begin(), holders.end(), *local_pos)) local = local_pos;
      const auto R = static_cast<std::int64_t>(holders.size());
      if (local || R == 1 || need_elems * element_bytes(sts.dtype) < opt_.split_bytes) {
        const std::int64_t h = local ? *local : holders[static_cast<std::size_t>(((rot % R) + R) % R)];
        emit(c, h, sp, need);
        return;
      }
      // Cut the needed window into one slab per replica along the outermost
      // dim long enough, so each replica sends an even share.
      int cut = -1;
      for (int d = 0; d < n && cut < 0; ++d)
        if (need[2 * static_cast<std::size_t>(d) + 1] - need[2 * static_cast<std::size_t>(d)] >= R) cut = d;
      if (cut < 0) {
        emit(c, holders[static_cast<std::size_t>(((rot % R) + R) % R)], sp, need);
        return;
      }
      const auto uc = static_cast<std::size_t>(cut);
      const std::int64_t lo = need[2 * uc], len = need[2 * uc + 1] - lo;
      for (std::int64_t i = 0; i < R; ++i) {
        Window w = need;
        w[2 * uc] = lo + i * len / R;
        w[2 * uc + 1] = lo + (i + 1) * len / R;
        emit(c, holders[static_cast<std::size_t>((i + rot % R + R) % R)], sp, w);
      }
      return;
    }
    // Flat sources: each holder has an interval of the part's row-major local
    // array. Cut [0, size) at every interval end; give each segment to one
    // holder covering it (the destination itself when it can).
    std::vector<std::pair<std::int64_t, std::int64_t>> cover;  // per holder
    std::vector<std::int64_t> cuts;
    for (auto h : holders) {
      const TensorStorage hs = src_storage(h, c.st);
      cover.emplace_back(hs.lin_lo, hs.lin_hi);
      if (hs.lin_lo < hs.lin_hi) {
        cuts.push_back(hs.lin_lo);
        cuts.push_back(hs.lin_hi);
      }
    }
    std::sort(cuts.begin(), cuts.end());
    cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
    std::vector<std::int64_t> ext(static_cast<std::size_t>(n));
    for (int d = 0; d < n; ++d) ext[static_cast<std::size_t>(d)] = sp[static_cast<std::size_t>(d)].local_extent;
    std::int64_t run_holder = -1, run_lo = 0, run_hi = 0;
    auto flush = [&]() {
      if (run_holder < 0) return;
      std::vector<std::array<std::int64_t, 2 * kMaxTensorRank>> tiles;
      linear_to_boxes(ext, run_lo, run_hi, tiles);
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
      if (chosen < 0) {
        const auto R = static_cast<std::int64_t>(covering.size());
        chosen = covering[static_cast<std::size_t>((((rot + static_cast<std::int64_t>(i)) % R) + R) % R)];
      }
      if (chosen == run_holder && a == run_hi) {
        run_hi = b;
        continue;
      }
      flush();
      run_holder = chosen;
      run_lo = a;
      run_hi = b;
    }
    flush();
  }

  /// Copies from holder position h: the part's local window w, met with each
  /// of the holder's held boxes and with the destination box.
  void emit(Ctx& c, std::int64_t h, const std::vector<DimPart>& sp, const Window& w) {
    const std::int64_t srank = src_.mesh.global_rank(h);
    if (c.keep_src >= 0 && srank != c.keep_src) return;
    const auto& sts = src_.tensors[static_cast<std::size_t>(c.st)];
    const int n = sts.rank();
    const TensorStorage hs = src_storage(h, c.st);
    const HeldBox& D = *c.D;
    std::vector<std::vector<RunGroup>> groups(static_cast<std::size_t>(n));
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
      Copy base;
      base.src_rank = srank;
      base.dst_rank = c.drank;
      base.src_buffer = src_.buffer_of(c.st);
      base.dst_buffer = dst_.buffer_of(c.dt);
      base.tensor = c.dt;
      base.element_bytes = static_cast<std::int32_t>(element_bytes(sts.dtype));
      std::vector<std::size_t> idx(static_cast<std::size_t>(n), 0);
      while (true) {
        Copy cp = base;
        cp.src_offset = S.base;
        cp.dst_offset = D.base;
        int r = 0;
        for (int d = 0; d < n; ++d) {
          const auto ud = static_cast<std::size_t>(d);
          const RunGroup& g = groups[ud][idx[ud]];
          cp.src_offset += g.s0 * S.stride[ud];
          cp.dst_offset += g.d0 * D.stride[ud];
          if (g.count > 1) {
            cp.extent[static_cast<std::size_t>(r)] = g.count;
            cp.src_stride[static_cast<std::size_t>(r)] = g.sper * S.stride[ud];
            cp.dst_stride[static_cast<std::size_t>(r)] = g.dper * D.stride[ud];
            ++r;
          }
          cp.extent[static_cast<std::size_t>(r)] = g.len;
          cp.src_stride[static_cast<std::size_t>(r)] = S.stride[ud];
          cp.dst_stride[static_cast<std::size_t>(r)] = D.stride[ud];
          ++r;
        }
        cp.rank = r;
        collapse(cp);
        c.out->push_back(cp);
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

  void finish(std::vector<Copy>& copies) {
    std::sort(copies.begin(), copies.end(), [](const Copy& a, const Copy& b) {
      return std::tie(a.dst_rank, a.dst_buffer, a.src_rank, a.src_buffer, a.tensor, a.dst_offset) <
             std::tie(b.dst_rank, b.dst_buffer, b.src_rank, b.src_buffer, b.tensor, b.dst_offset);
    });
    if (opt_.coalesce) coalesce(copies);
  }

  const Layout& src_;
  const Layout& dst_;
  PlanOptions opt_;
  std::vector<int> src_of_dst_;
  std::map<std::pair<std::int64_t, int>, FlatRange> src_flat_, dst_flat_;
};

/// Plans the refit from `src` to `dst` (both validated).
inline Schedule plan(const Layout& src, const Layout& dst, const PlanOptions& opt = {}) {
  return Planner(src, dst, opt).run();
}

}  // namespace reshard
