#pragma once
// Seeded random VALID layout pairs for property tests (planner, executors).
//
//   auto pair = testgen::random_layout_pair(seed);      // two validated Layouts
//   plan(pair.src, pair.dst) ...; pair.describe() for messages
//
// One seed always gives the same pair (own integer arithmetic over
// std::mt19937_64, no std distributions). Every contract feature appears:
// 1-4 mesh axes, sub-axes, even / chunk / balanced / explicit sizes / cyclic
// splits, pad_to, stages, concat buffers with interleave, flat buffers over
// axes, first_rank and explicit permuted rank lists, disjoint / colocated /
// partly overlapping rank sets, 1-D to 4-D tensors, several per layout.
// Tensors stay small (a few thousand elements) so an element oracle is fast.
#include <algorithm>
#include <cstdint>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "oracle.hpp"
#include "reshard/layout/layout.hpp"

namespace testgen {

struct RandomOptions {
  int max_axes = 4;                ///< mesh axes per side, 1..4
  std::int64_t max_world = 24;     ///< positions per mesh
  int max_tensors = 5;             ///< global tensors (the destination may take fewer)
  std::int64_t max_elements = 3000;  ///< per tensor
  int max_tensor_rank = 4;
  bool buffers = true;   ///< concat and flat buffers
  bool stages = true;
  bool cyclic = true;
  bool padding = true;   ///< pad_to
};

struct RandomLayoutPair {
  reshard::Layout src, dst;
  std::uint64_t seed = 0;
  int rejected = 0;       ///< drafts the validator refused (a generator bug when > 0)
  std::string ranks;      ///< "disjoint", "colocated" or "overlap"
  std::string describe() const {
    return fmt::format("seed {} ({} ranks)\nsrc: {}\ndst: {}", seed, ranks, oracle::describe(src), oracle::describe(dst));
  }
};

/// between, pick and shuffle from a decision source's below(n): shared by
/// Rng and the fuzzers' Bytes, so both drive the generator alike.
template <class Source>
class Decisions {
 public:
  std::int64_t between(std::int64_t a, std::int64_t b) { return a + self().below(b - a + 1); }
  template <class T>
  const T& pick(const std::vector<T>& v) {
    return v[static_cast<std::size_t>(self().below(static_cast<std::int64_t>(v.size())))];
  }
  template <class T>
  void shuffle(std::vector<T>& v) {
    for (std::size_t i = v.size(); i > 1; --i)
      std::swap(v[i - 1], v[static_cast<std::size_t>(self().below(static_cast<std::int64_t>(i)))]);
  }

 private:
  Source& self() { return static_cast<Source&>(*this); }
};

/// Deterministic integers from a seed.
class Rng : public Decisions<Rng> {
 public:
  explicit Rng(std::uint64_t seed) : g_(seed) {}
  std::int64_t below(std::int64_t n) {
    return n <= 1 ? 0 : static_cast<std::int64_t>(g_() % static_cast<std::uint64_t>(n));
  }
  bool chance(double p) { return static_cast<double>(g_() >> 11) * 0x1.0p-53 < p; }

 private:
  std::mt19937_64 g_;
};

namespace detail {

using reshard::AxisRef;
using reshard::DimSpec;
using reshard::DType;
using reshard::Layout;
using reshard::Split;

inline std::int64_t round_up(std::int64_t n, std::int64_t m) { return (n + m - 1) / m * m; }

struct GlobalTensor {
  std::string name;
  std::vector<std::int64_t> shape;
  DType dtype = DType::f32;
};

/// Tensors of one rank and dtype whose shapes agree except along `dim`:
/// candidates for a concat buffer on either side.
struct Family {
  std::vector<int> members;
  int dim = 0;
};

template <class R>
std::int64_t pick_extent(R& r, std::int64_t cap) {
  if (r.chance(0.1)) return 1;
  if (r.chance(0.5)) {
    std::vector<std::int64_t> nice;
    for (std::int64_t v : {2, 3, 4, 6, 8, 12, 16, 24, 32, 48})
      if (v <= cap) nice.push_back(v);
    if (!nice.empty()) return r.pick(nice);
  }
  return r.between(1, cap);
}

/// The mesh's axes split into digits: a random factorization of each axis,
/// least significant digit first, as sub-axis references.
template <class R>
std::vector<AxisRef> axis_digits(R& r, const reshard::Mesh& m, int axis) {
  const std::int64_t s = m.axes[static_cast<std::size_t>(axis)].size;
  std::vector<AxisRef> out;
  std::int64_t stride = 1, left = s;
  while (left > 1) {
    std::vector<std::int64_t> divs;
    for (std::int64_t d = 2; d < left; ++d)
      if (left % d == 0) divs.push_back(d);
    const std::int64_t f = divs.empty() || r.chance(0.5) ? left : r.pick(divs);
    out.push_back(AxisRef{axis, stride, f});
    stride *= f;
    left /= f;
  }
  if (out.empty()) out.push_back(AxisRef{axis, 1, 1});
  return out;
}

/// Sizes of every part of a contiguous or cyclic cut (own arithmetic).
inline std::vector<std::int64_t> part_sizes(const DimSpec& s, std::int64_t n) {
  std::vector<std::int64_t> v;
  for (std::int64_t p = 0; p < oracle::part_count(s); ++p)
    v.push_back(static_cast<std::int64_t>(oracle::held_indices(s, n, p).size()));
  return v;
}

template <class R>
class SideBuilder {
 public:
  SideBuilder(R& r, const RandomOptions& o) : r_(r), o_(o) {}

  void make_mesh() {
    static const std::vector<std::string> pool = {"pp", "dp", "cp", "tp", "ep", "x", "y", "z"};
    auto names = pool;
    r_.shuffle(names);
    const int n = static_cast<int>(r_.between(1, o_.max_axes));
    std::vector<std::int64_t> sizes;
    for (int a = 0; a < n; ++a) sizes.push_back(r_.pick(std::vector<std::int64_t>{1, 2, 2, 2, 3, 4, 4, 6, 8}));
    auto world = [&] { return std::accumulate(sizes.begin(), sizes.end(), std::int64_t{1}, std::multiplies<>()); };
    // Shrink random axes; a source that keeps naming axes of size 1 (fuzz
    // bytes run out and read zeros) falls back to the first axis left to shrink.
    for (int idle = 0; world() > o_.max_world;) {
      std::size_t a = static_cast<std::size_t>(r_.below(n));
      if (sizes[a] == 1 && ++idle > 64)
        a = static_cast<std::size_t>(std::find_if(sizes.begin(), sizes.end(), [](std::int64_t v) { return v > 1; }) - sizes.begin());
      sizes[a] = sizes[a] % 2 == 0 ? sizes[a] / 2 : 1;
    }
    for (int a = 0; a < n; ++a) L.mesh.axes.push_back({names[static_cast<std::size_t>(a)], sizes[static_cast<std::size_t>(a)]});
  }
  std::int64_t world() const { return oracle::mesh_positions(L.mesh); }

  /// Digit references of all axes but `excluded`.
  std::vector<AxisRef> ref_pool(const std::vector<int>& excluded) {
    std::vector<AxisRef> pool;
    for (int a = 0; a < static_cast<int>(L.mesh.axes.size()); ++a) {
      if (std::find(excluded.begin(), excluded.end(), a) != excluded.end()) continue;
      if (r_.chance(0.5)) {  // the whole axis
        pool.push_back(AxisRef{a, 1, L.mesh.axes[static_cast<std::size_t>(a)].size});
        continue;
      }
      for (const auto& d : axis_digits(r_, L.mesh, a)) pool.push_back(d);
    }
    r_.shuffle(pool);
    return pool;
  }

  std::vector<reshard::StageCoord> make_stage(std::vector<int>& excluded) {
    std::vector<reshard::StageCoord> st;
    if (!o_.stages || !r_.chance(0.2)) return st;
    const int a = static_cast<int>(r_.below(static_cast<std::int64_t>(L.mesh.axes.size())));
    st.push_back({a, r_.below(L.mesh.axes[static_cast<std::size_t>(a)].size)});
    excluded.push_back(a);
    return st;
  }

  /// Cuts `pool` refs (each used with some chance) over the dims in `dims`;
  /// returns the refs left unused.
  std::vector<AxisRef> assign(std::vector<DimSpec>& specs, const std::vector<int>& dims, std::vector<AxisRef> pool) {
    std::vector<AxisRef> left;
    for (const auto& ref : pool) {
      if (!dims.empty() && r_.chance(0.6))
        specs[static_cast<std::size_t>(r_.pick(dims))].axes.push_back(ref);
      else
        left.push_back(ref);
    }
    return left;
  }

  /// Chooses split and pad_to for a dim of extent n already given its axes,
  /// so that every part's local extent is a multiple of G.
  void choose_split(DimSpec& s, std::int64_t n, std::int64_t G) {
    const std::int64_t k = oracle::part_count(s);
    std::int64_t P0 = n;
    if (o_.padding && r_.chance(k > 1 ? 0.2 : 0.05)) P0 = n + r_.between(1, 5);
    if (!o_.padding) G = 1;  // callers pick G = 1 then, see make_concat
    std::vector<Split> kinds = {Split::even, Split::even, Split::chunk, Split::balanced, Split::sizes};
    if (o_.cyclic) {
      kinds.push_back(Split::cyclic);
      kinds.push_back(Split::cyclic);
    }
    s.split = r_.pick(kinds);
    std::int64_t P = P0;
    switch (s.split) {
      case Split::even:
        P = round_up(P0, k * G);
        if (!o_.padding && P != n) {
          s.split = Split::balanced;
          P = n;
        }
        break;
      case Split::cyclic:
        s.block = G * r_.between(1, 3);
        P = round_up(P0, G);
        break;
      case Split::sizes: {
        P = round_up(P0, G);
        std::vector<std::int64_t> cuts{0, P / G};
        for (std::int64_t i = 1; i < k; ++i) cuts.push_back(r_.between(0, P / G));
        std::sort(cuts.begin(), cuts.end());
        s.sizes.clear();
        for (std::size_t i = 0; i + 1 < cuts.size(); ++i) s.sizes.push_back((cuts[i + 1] - cuts[i]) * G);
        break;
      }
      case Split::chunk:
      case Split::balanced:
        for (P = P0;; ++P) {
          s.pad_to = P;
          bool ok = true;
          for (auto e : part_sizes(s, n)) ok &= e % G == 0;
          if (ok) break;
        }
        break;
    }
    s.pad_to = P != n ? P : 0;
  }

  /// Random dimspecs of a tensor over the refs of `pool`.
  std::vector<DimSpec> make_dims(const GlobalTensor& t, const std::vector<AxisRef>& pool) {
    std::vector<DimSpec> specs(t.shape.size());
    std::vector<int> dims(t.shape.size());
    std::iota(dims.begin(), dims.end(), 0);
    assign(specs, dims, pool);
    for (std::size_t d = 0; d < specs.size(); ++d) choose_split(specs[d], t.shape[d], 1);
    return specs;
  }

  void add_tensor(const GlobalTensor& g, std::vector<DimSpec> dims, std::vector<reshard::StageCoord> stage) {
    reshard::TensorSpec t;
    t.name = g.name;
    t.shape = g.shape;
    t.dtype = g.dtype;
    t.stage = std::move(stage);
    // An all-uncut tensor may leave dims empty (the contract's default).
    bool any = false;
    for (const auto& d : dims) any |= d.is_cut() || d.pad_to || d.split != Split::even;
    if (any || r_.chance(0.5)) t.dims = std::move(dims);
    L.tensors.push_back(std::move(t));
  }

  void make_alone(const GlobalTensor& g) {
    std::vector<int> excluded;
    auto stage = make_stage(excluded);
    add_tensor(g, make_dims(g, ref_pool(excluded)), stage);
  }

  void make_concat(const std::vector<GlobalTensor>& parts, int dim) {
    std::vector<int> excluded;
    auto stage = make_stage(excluded);
    const std::int64_t G = o_.padding ? r_.pick(std::vector<std::int64_t>{1, 1, 2, 2, 3, 4}) : 1;
    const auto& first = parts[0];
    // Dims other than `dim` share one spec so local extents agree everywhere.
    std::vector<DimSpec> shared(first.shape.size());
    std::vector<int> others;
    for (int d = 0; d < static_cast<int>(first.shape.size()); ++d)
      if (d != dim) others.push_back(d);
    const auto rest = assign(shared, others, ref_pool(excluded));
    for (int d : others) choose_split(shared[static_cast<std::size_t>(d)], first.shape[static_cast<std::size_t>(d)], 1);
    reshard::BufferSpec b;
    b.name = fmt::format("buf{}", L.buffers.size());
    b.kind = reshard::BufferKind::concat;
    b.dim = dim;
    b.interleave = G;
    for (const auto& p : parts) {
      auto dims = shared;
      auto& ds = dims[static_cast<std::size_t>(dim)];
      ds = DimSpec{};
      for (const auto& ref : rest)
        if (r_.chance(0.5)) ds.axes.push_back(ref);
      choose_split(ds, p.shape[static_cast<std::size_t>(dim)], G);
      add_tensor(p, std::move(dims), stage);
      b.parts.push_back(p.name);
    }
    L.buffers.push_back(std::move(b));
  }

  void make_flat(const std::vector<GlobalTensor>& parts) {
    std::vector<int> excluded;
    auto stage = make_stage(excluded);
    reshard::BufferSpec b;
    b.name = fmt::format("buf{}", L.buffers.size());
    b.kind = reshard::BufferKind::flat;
    auto pool = ref_pool(excluded);
    const std::size_t nflat = std::min<std::size_t>(pool.size(), static_cast<std::size_t>(r_.between(1, 2)));
    b.flat.axes.assign(pool.begin(), pool.begin() + static_cast<std::ptrdiff_t>(nflat));
    pool.erase(pool.begin(), pool.begin() + static_cast<std::ptrdiff_t>(nflat));
    const std::size_t first = L.tensors.size();
    for (const auto& p : parts) {
      auto sub = pool;
      r_.shuffle(sub);
      add_tensor(p, make_dims(p, sub), stage);
      b.parts.push_back(p.name);
    }
    // The flattened sequence length on every rank holding a part decides
    // which cuts of it are valid.
    std::vector<std::int64_t> lengths;
    for (std::int64_t pos = 0; pos < world(); ++pos) {
      std::int64_t len = 0;
      bool any = false;
      for (std::size_t t = first; t < L.tensors.size(); ++t) {
        const auto h = oracle::held_sets(L, pos, static_cast<int>(t));
        if (!oracle::holds_any(h)) continue;
        any = true;
        std::int64_t n = 1;
        for (const auto& v : h) n *= static_cast<std::int64_t>(v.size());
        len += n;
      }
      if (any) lengths.push_back(len);
    }
    const std::int64_t k = oracle::part_count(b.flat);
    bool divisible = true, same = true;
    for (auto l : lengths) {
      divisible &= l % k == 0;
      same &= l == lengths[0];
    }
    std::vector<Split> kinds = {Split::chunk, Split::balanced};
    if (divisible) kinds.push_back(Split::even);
    if (same && !lengths.empty()) kinds.push_back(Split::sizes);
    b.flat.split = r_.pick(kinds);
    if (b.flat.split == Split::sizes) {
      std::vector<std::int64_t> cuts{0, lengths[0]};
      for (std::int64_t i = 1; i < k; ++i) cuts.push_back(r_.between(0, lengths[0]));
      std::sort(cuts.begin(), cuts.end());
      for (std::size_t i = 0; i + 1 < cuts.size(); ++i) b.flat.sizes.push_back(cuts[i + 1] - cuts[i]);
    } else if (b.flat.split != Split::even && o_.padding && !lengths.empty() && r_.chance(0.1)) {
      b.flat.pad_to = *std::max_element(lengths.begin(), lengths.end()) + r_.between(0, 3);
    }
    L.buffers.push_back(std::move(b));
  }

  reshard::LayoutSpec L;

 private:
  R& r_;
  const RandomOptions& o_;
};

/// Assigns global ranks to both meshes; returns the mode's name.
template <class R>
std::string place_ranks(R& r, reshard::Mesh& a, reshard::Mesh& b) {
  const std::int64_t wa = oracle::mesh_positions(a), wb = oracle::mesh_positions(b);
  std::vector<std::int64_t> ra, rb;
  auto take = [&](std::int64_t universe, std::int64_t n) {
    std::vector<std::int64_t> all(static_cast<std::size_t>(universe));
    std::iota(all.begin(), all.end(), 0);
    r.shuffle(all);
    all.resize(static_cast<std::size_t>(n));
    return all;
  };
  std::string mode;
  const auto m = r.below(3);
  if (m == 0) {  // disjoint, either side first
    mode = "disjoint";
    const std::int64_t lo = r.below(3), gap = r.below(3);
    std::vector<std::int64_t> first(static_cast<std::size_t>(wa)), second(static_cast<std::size_t>(wb));
    const bool src_first = r.chance(0.7);
    std::iota(first.begin(), first.end(), src_first ? lo : lo + wb + gap);
    std::iota(second.begin(), second.end(), src_first ? lo + wa + gap : lo);
    ra = first;
    rb = second;
  } else if (m == 1) {  // colocated: the smaller rank set inside the larger
    mode = "colocated";
    const std::int64_t u = std::max(wa, wb);
    auto all = take(u, u);
    std::sort(all.begin(), all.end());
    ra = all;
    rb = all;
    r.shuffle(ra);
    r.shuffle(rb);
    ra.resize(static_cast<std::size_t>(wa));
    rb.resize(static_cast<std::size_t>(wb));
  } else {
    mode = "overlap";
    const std::int64_t u = r.between(std::max(wa, wb), wa + wb);
    ra = take(u, wa);
    rb = take(u, wb);
  }
  auto set = [&](reshard::Mesh& mesh, std::vector<std::int64_t> ranks) {
    if (r.chance(0.5)) std::sort(ranks.begin(), ranks.end());
    const bool contiguous = std::is_sorted(ranks.begin(), ranks.end()) &&
                            (ranks.empty() || ranks.back() - ranks.front() + 1 == static_cast<std::int64_t>(ranks.size()));
    if (contiguous && r.chance(0.7)) {
      mesh.first_rank = ranks.front();
      mesh.ranks.clear();
    } else {
      mesh.ranks = std::move(ranks);
    }
  };
  set(a, ra);
  set(b, rb);
  return mode;
}

}  // namespace detail

/// One draft of a layout pair over the same tensors (the destination may
/// take a subset; the source may hold extra tensors), every decision drawn
/// from `r`: an Rng, or any source of decisions with the same calls
/// (below, between, chance(probability), pick, shuffle), e.g. the fuzzers'
/// bytes. nullopt when the draft is not a valid pair.
template <class R>
std::optional<RandomLayoutPair> draft_layout_pair(R& r, const RandomOptions& o = {}) {
  using namespace detail;
  RandomLayoutPair out;
  {
    // Global tensors, in families that may share a concat buffer.
    std::vector<GlobalTensor> tensors;
    std::vector<Family> families;
    const int want = static_cast<int>(r.between(1, std::max(1, o.max_tensors)));
    const std::vector<DType> dtypes = {DType::f32, DType::bf16, DType::bf16, DType::f16, DType::u8, DType::f64};
    while (static_cast<int>(tensors.size()) < want) {
      const int rank = static_cast<int>(r.between(1, std::max(1, o.max_tensor_rank)));
      // Extents up to the rank-th root of the element budget (a tenth of it
      // for 1-D), so shapes of every rank fill it alike.
      std::int64_t cap = std::max<std::int64_t>(1, o.max_elements / 10);
      if (rank > 1) {
        cap = 1;
        auto fits = [&](std::int64_t c) {
          std::int64_t p = 1;
          for (int i = 0; i < rank; ++i) p *= c;
          return p <= o.max_elements;
        };
        while (fits(cap + 1)) ++cap;
      }
      std::vector<std::int64_t> base;
      for (int d = 0; d < rank; ++d) base.push_back(pick_extent(r, cap));
      Family f;
      f.dim = static_cast<int>(r.below(rank));
      const DType dt = r.pick(dtypes);
      const int m = static_cast<int>(std::min<std::int64_t>(r.between(1, 3), want - static_cast<int>(tensors.size())));
      for (int i = 0; i < m; ++i) {
        GlobalTensor g;
        g.name = fmt::format("t{}", tensors.size());
        g.shape = base;
        g.shape[static_cast<std::size_t>(f.dim)] = pick_extent(r, cap);
        g.dtype = dt;
        auto elems = [&] { return std::accumulate(g.shape.begin(), g.shape.end(), std::int64_t{1}, std::multiplies<>()); };
        if (f.members.empty()) {
          while (elems() > o.max_elements) {
            auto big = std::max_element(g.shape.begin(), g.shape.end());
            *big = (*big + 1) / 2;
          }
        } else {  // the family's other extents are the first member's
          const auto& g0 = tensors[static_cast<std::size_t>(f.members[0])];
          for (int d = 0; d < rank; ++d)
            if (d != f.dim) g.shape[static_cast<std::size_t>(d)] = g0.shape[static_cast<std::size_t>(d)];
          while (elems() > o.max_elements) {
            auto& e = g.shape[static_cast<std::size_t>(f.dim)];
            e = (e + 1) / 2;
          }
        }
        f.members.push_back(static_cast<int>(tensors.size()));
        tensors.push_back(g);
      }
      families.push_back(f);
    }
    // The destination takes a subset (never empty); the source takes all.
    std::vector<bool> in_dst(tensors.size());
    bool any = false;
    for (std::size_t t = 0; t < tensors.size(); ++t) any |= (in_dst[t] = r.chance(0.9));
    if (!any) in_dst[static_cast<std::size_t>(r.below(static_cast<std::int64_t>(tensors.size())))] = true;

    auto build_side = [&](bool dst_side) {
      SideBuilder sb(r, o);
      sb.make_mesh();
      std::vector<std::vector<GlobalTensor>> flat_groups;
      for (const auto& f : families) {
        std::vector<GlobalTensor> members;
        for (int t : f.members)
          if (!dst_side || in_dst[static_cast<std::size_t>(t)]) members.push_back(tensors[static_cast<std::size_t>(t)]);
        if (members.empty()) continue;
        const double u = static_cast<double>(r.below(1000)) / 1000.0;
        if (!o.buffers || u < 0.45) {
          for (const auto& g : members) sb.make_alone(g);
        } else if (u < 0.75) {
          r.shuffle(members);
          sb.make_concat(members, f.dim);
        } else {
          // Flat: join the previous flat group of this dtype now and then.
          if (!flat_groups.empty() && flat_groups.back()[0].dtype == members[0].dtype && r.chance(0.5))
            flat_groups.back().insert(flat_groups.back().end(), members.begin(), members.end());
          else
            flat_groups.push_back(members);
        }
      }
      for (const auto& g : flat_groups) sb.make_flat(g);
      return std::move(sb.L);
    };
    reshard::LayoutSpec src = build_side(false);
    reshard::LayoutSpec dst = build_side(true);
    src.origin = "src.json";
    dst.origin = "dst.json";
    out.ranks = place_ranks(r, src.mesh, dst.mesh);
    try {
      out.src = reshard::Layout(std::move(src));
      out.dst = reshard::Layout(std::move(dst));
    } catch (const reshard::LayoutError&) {
      return std::nullopt;
    }
    return out;
  }
}

/// A random pair of valid layouts from a seed (drafts until one is valid).
inline RandomLayoutPair random_layout_pair(std::uint64_t seed, const RandomOptions& o = {}) {
  Rng r(seed * 0x9E3779B97F4A7C15ull + 0x2545F4914F6CDD1Dull);
  for (int rejected = 0;; ++rejected)
    if (auto p = draft_layout_pair(r, o)) {
      p->seed = seed;
      p->rejected = rejected;
      return std::move(*p);
    }
}

}  // namespace testgen
