#pragma once
// Valid layout pairs drawn from fuzz bytes, for the planner and replay
// fuzzers.
//
//   fuzzgen::Bytes in(data, size);
//   auto pair = fuzzgen::layout_pair(in);   // std::nullopt: the bytes drew an invalid draft
//
// Two ways, chosen by the first byte:
// - structured: every decision (mesh axes, which axis digit cuts which dim,
//   split kind, padding, stage, concat / flat buffers, rank placement) takes
//   its own byte, so a mutation of one byte changes one decision and
//   libFuzzer's coverage feedback can steer the structure;
// - seeded: a seed and generator options from the bytes, handed to the
//   property tests' generator (tests/random_layouts.hpp), which always
//   drafts a valid pair with every contract feature.
// Running out of bytes reads zeros, so every input draws something.
#include <algorithm>
#include <cstdint>
#include <numeric>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "oracle.hpp"
#include "random_layouts.hpp"
#include "reshard/layout.hpp"

namespace fuzzgen {

using reshard::AxisRef;
using reshard::BufferKind;
using reshard::BufferSpec;
using reshard::DimSpec;
using reshard::DType;
using reshard::Layout;
using reshard::Split;
using reshard::StageCoord;
using reshard::TensorSpec;

/// Fuzz bytes read front to back as small decisions.
class Bytes {
 public:
  Bytes(const std::uint8_t* d, std::size_t n) : d_(d), n_(n) {}
  std::uint8_t byte() { return i_ < n_ ? d_[i_++] : 0; }
  /// 0 .. n-1 (one byte, two when n > 256).
  std::int64_t below(std::int64_t n) {
    if (n <= 1) return 0;
    std::uint64_t v = byte();
    if (n > 256) v = v << 8 | byte();
    return static_cast<std::int64_t>(v % static_cast<std::uint64_t>(n));
  }
  std::int64_t between(std::int64_t a, std::int64_t b) { return a + below(b - a + 1); }
  /// True with probability about p/256.
  bool chance(int p) { return byte() < p; }
  std::uint64_t u64() {
    std::uint64_t v = 0;
    for (int k = 0; k < 8; ++k) v = v << 8 | byte();
    return v;
  }
  template <class T>
  const T& pick(const std::vector<T>& v) {
    return v[static_cast<std::size_t>(below(static_cast<std::int64_t>(v.size())))];
  }
  template <class T>
  void shuffle(std::vector<T>& v) {
    for (std::size_t i = v.size(); i > 1; --i)
      std::swap(v[i - 1], v[static_cast<std::size_t>(below(static_cast<std::int64_t>(i)))]);
  }
  std::size_t used() const { return i_; }

 private:
  const std::uint8_t* d_;
  std::size_t n_, i_ = 0;
};

struct Pair {
  Layout src, dst;
  std::string how;  ///< "structured" / "seeded <seed>", and the rank placement
  std::string describe() const {
    return fmt::format("{}\nsrc: {}\ndst: {}", how, oracle::describe(src), oracle::describe(dst));
  }
};

namespace detail {

inline std::int64_t round_up(std::int64_t n, std::int64_t m) { return (n + m - 1) / m * m; }

struct Global {
  std::string name;
  std::vector<std::int64_t> shape;
  DType dtype = DType::f32;
};
/// Tensors that agree on every extent but `dim`: one may concat them.
struct Family {
  std::vector<int> members;
  int dim = 0;
};

class Side {
 public:
  Side(Bytes& in, std::int64_t max_world) : in_(in), max_world_(max_world) {}

  void make_mesh() {
    static const std::vector<std::string> names = {"pp", "dp", "tp", "ep"};
    const int n = static_cast<int>(in_.between(1, 3));
    const int rot = static_cast<int>(in_.below(4));
    std::vector<std::int64_t> sizes;
    for (int a = 0; a < n; ++a) sizes.push_back(in_.pick(std::vector<std::int64_t>{2, 1, 2, 3, 4, 4, 6, 8}));
    auto world = [&] { return std::accumulate(sizes.begin(), sizes.end(), std::int64_t{1}, std::multiplies<>()); };
    for (int a = 0; world() > max_world_; a = (a + 1) % n) sizes[static_cast<std::size_t>(a)] = std::max<std::int64_t>(1, sizes[static_cast<std::size_t>(a)] / 2);
    for (int a = 0; a < n; ++a) L.mesh.axes.push_back({names[static_cast<std::size_t>((a + rot) % 4)], sizes[static_cast<std::size_t>(a)]});
  }
  std::int64_t world() const { return oracle::mesh_positions(L.mesh); }

  /// A stage on one axis now and then; the axis leaves the pool.
  std::vector<StageCoord> make_stage(std::vector<int>& excluded) {
    if (!in_.chance(48)) return {};
    const int a = static_cast<int>(in_.below(static_cast<std::int64_t>(L.mesh.axes.size())));
    excluded.push_back(a);
    return {StageCoord{a, in_.below(L.mesh.axes[static_cast<std::size_t>(a)].size)}};
  }

  /// References of the axes not excluded: whole axes, or two digits of an
  /// axis (sub-axes), or nothing (the axis replicates).
  std::vector<AxisRef> ref_pool(const std::vector<int>& excluded) {
    std::vector<AxisRef> pool;
    for (int a = 0; a < static_cast<int>(L.mesh.axes.size()); ++a) {
      if (std::find(excluded.begin(), excluded.end(), a) != excluded.end()) continue;
      const std::int64_t s = L.mesh.axes[static_cast<std::size_t>(a)].size;
      std::vector<std::int64_t> divs;
      for (std::int64_t d = 2; d < s; ++d)
        if (s % d == 0) divs.push_back(d);
      const auto how = in_.below(4);
      if (how == 0) continue;
      if (how == 1 || divs.empty()) {
        pool.push_back(AxisRef{a, 1, s});
        continue;
      }
      const std::int64_t f = in_.pick(divs);
      pool.push_back(AxisRef{a, 1, f});
      pool.push_back(AxisRef{a, f, s / f});
    }
    return pool;
  }

  /// Hands each reference of `pool` to one of `dims` (or to none: the digit
  /// replicates); returns those handed to none.
  std::vector<AxisRef> assign(std::vector<DimSpec>& specs, const std::vector<int>& dims, const std::vector<AxisRef>& pool) {
    std::vector<AxisRef> left;
    for (const auto& r : pool) {
      const auto t = in_.below(static_cast<std::int64_t>(dims.size()) + 1);
      if (t == static_cast<std::int64_t>(dims.size())) {
        left.push_back(r);
        continue;
      }
      auto& axes = specs[static_cast<std::size_t>(dims[static_cast<std::size_t>(t)])].axes;
      axes.insert(axes.begin() + in_.below(static_cast<std::int64_t>(axes.size()) + 1), r);
    }
    return left;
  }

  /// Split and padding of a dim of extent n over its axes, so that every
  /// part's local extent is a multiple of G where the split kind allows it.
  void choose_split(DimSpec& s, std::int64_t n, std::int64_t G) {
    const std::int64_t k = oracle::part_count(s);
    std::int64_t P = in_.chance(40) ? n + in_.between(1, 4) : n;
    switch (in_.below(5)) {
      case 0: s.split = Split::even; P = round_up(P, k * G); break;
      case 1: s.split = Split::chunk; break;
      case 2: s.split = Split::balanced; break;
      case 3: {
        s.split = Split::sizes;
        P = round_up(P, G);
        std::vector<std::int64_t> cuts{0, P / G};
        for (std::int64_t i = 1; i < k; ++i) cuts.push_back(in_.between(0, P / G));
        std::sort(cuts.begin(), cuts.end());
        for (std::size_t i = 0; i + 1 < cuts.size(); ++i) s.sizes.push_back((cuts[i + 1] - cuts[i]) * G);
        break;
      }
      default:
        s.split = Split::cyclic;
        s.block = G * in_.between(1, 3);
        P = round_up(P, G);
        break;
    }
    s.pad_to = P != n ? P : 0;
  }

  void add(const Global& g, std::vector<DimSpec> dims, const std::vector<StageCoord>& stage) {
    TensorSpec t;
    t.name = g.name;
    t.shape = g.shape;
    t.dtype = g.dtype;
    t.stage = stage;
    bool any = false;
    for (const auto& d : dims) any |= d.is_cut() || d.pad_to || d.split != Split::even;
    if (any || in_.chance(128)) t.dims = std::move(dims);  // all uncut: dims may be left out
    L.tensors.push_back(std::move(t));
  }

  std::vector<DimSpec> cut_all(const Global& g, const std::vector<AxisRef>& pool) {
    std::vector<DimSpec> dims(g.shape.size());
    std::vector<int> all(g.shape.size());
    std::iota(all.begin(), all.end(), 0);
    assign(dims, all, pool);
    for (std::size_t d = 0; d < dims.size(); ++d) choose_split(dims[d], g.shape[d], 1);
    return dims;
  }

  void alone(const Global& g) {
    std::vector<int> excluded;
    const auto stage = make_stage(excluded);
    add(g, cut_all(g, ref_pool(excluded)), stage);
  }

  /// A concat buffer: the dims but `dim` share one spec so that the local
  /// extents agree on every rank; `dim` is cut per part.
  void concat(const std::vector<Global>& parts, int dim) {
    std::vector<int> excluded;
    const auto stage = make_stage(excluded);
    const std::int64_t G = in_.pick(std::vector<std::int64_t>{1, 1, 2, 3});
    const auto rank = parts[0].shape.size();
    std::vector<DimSpec> shared(rank);
    std::vector<int> others;
    for (int d = 0; d < static_cast<int>(rank); ++d)
      if (d != dim) others.push_back(d);
    const auto rest = assign(shared, others, ref_pool(excluded));
    for (int d : others) choose_split(shared[static_cast<std::size_t>(d)], parts[0].shape[static_cast<std::size_t>(d)], 1);
    BufferSpec b;
    b.name = fmt::format("buf{}", L.buffers.size());
    b.kind = BufferKind::concat;
    b.dim = dim;
    b.interleave = G;
    for (const auto& p : parts) {
      auto dims = shared;
      auto& ds = dims[static_cast<std::size_t>(dim)];
      for (const auto& r : rest)
        if (in_.chance(128)) ds.axes.push_back(r);
      choose_split(ds, p.shape[static_cast<std::size_t>(dim)], G);
      add(p, std::move(dims), stage);
      b.parts.push_back(p.name);
    }
    L.buffers.push_back(std::move(b));
  }

  /// A flat buffer cut over one or two references the parts do not use.
  void flat(const std::vector<Global>& parts) {
    std::vector<int> excluded;
    const auto stage = make_stage(excluded);
    auto pool = ref_pool(excluded);
    BufferSpec b;
    b.name = fmt::format("buf{}", L.buffers.size());
    b.kind = BufferKind::flat;
    const auto nflat = std::min<std::size_t>(pool.size(), static_cast<std::size_t>(in_.between(1, 2)));
    b.flat.axes.assign(pool.begin(), pool.begin() + static_cast<std::ptrdiff_t>(nflat));
    pool.erase(pool.begin(), pool.begin() + static_cast<std::ptrdiff_t>(nflat));
    const std::size_t first = L.tensors.size();
    for (const auto& p : parts) {
      add(p, cut_all(p, pool), stage);
      b.parts.push_back(p.name);
    }
    // The flattened length on each rank holding a part decides which cuts are valid.
    std::vector<std::int64_t> lengths;
    for (std::int64_t pos = 0; pos < world(); ++pos) {
      std::int64_t len = 0;
      bool any = false;
      for (std::size_t t = first; t < L.tensors.size(); ++t) {
        const auto [all, real] = oracle::held_elements(L, pos, static_cast<int>(t));
        (void)real;
        any |= all > 0;
        len += all;
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
    b.flat.split = in_.pick(kinds);
    if (b.flat.split == Split::sizes) {
      std::vector<std::int64_t> cuts{0, lengths[0]};
      for (std::int64_t i = 1; i < k; ++i) cuts.push_back(in_.between(0, lengths[0]));
      std::sort(cuts.begin(), cuts.end());
      for (std::size_t i = 0; i + 1 < cuts.size(); ++i) b.flat.sizes.push_back(cuts[i + 1] - cuts[i]);
    } else if (b.flat.split != Split::even && !lengths.empty() && in_.chance(32)) {
      b.flat.pad_to = *std::max_element(lengths.begin(), lengths.end()) + in_.between(0, 3);
    }
    L.buffers.push_back(std::move(b));
  }

  Layout L;

 private:
  Bytes& in_;
  std::int64_t max_world_;
};

/// Global ranks for both meshes: disjoint, colocated or partly overlapping.
inline std::string place_ranks(Bytes& in, reshard::Mesh& a, reshard::Mesh& b) {
  const std::int64_t wa = oracle::mesh_positions(a), wb = oracle::mesh_positions(b);
  auto draw = [&](std::int64_t universe, std::int64_t n) {
    std::vector<std::int64_t> all(static_cast<std::size_t>(universe));
    std::iota(all.begin(), all.end(), 0);
    in.shuffle(all);
    all.resize(static_cast<std::size_t>(n));
    return all;
  };
  std::vector<std::int64_t> ra, rb;
  std::string mode;
  switch (in.below(3)) {
    case 0: {
      mode = "disjoint";
      const std::int64_t lo = in.below(3), gap = in.below(3);
      const bool src_first = !in.chance(64);
      ra.resize(static_cast<std::size_t>(wa));
      rb.resize(static_cast<std::size_t>(wb));
      std::iota(ra.begin(), ra.end(), src_first ? lo : lo + wb + gap);
      std::iota(rb.begin(), rb.end(), src_first ? lo + wa + gap : lo);
      break;
    }
    case 1: {
      mode = "colocated";
      const std::int64_t u = std::max(wa, wb);
      ra = draw(u, wa);
      rb = draw(u, wb);
      break;
    }
    default: {
      mode = "overlap";
      const std::int64_t u = in.between(std::max(wa, wb), wa + wb);
      ra = draw(u, wa);
      rb = draw(u, wb);
      break;
    }
  }
  auto set = [&](reshard::Mesh& m, std::vector<std::int64_t> r) {
    if (in.chance(128)) std::sort(r.begin(), r.end());
    const bool contiguous = std::is_sorted(r.begin(), r.end()) && r.back() - r.front() + 1 == static_cast<std::int64_t>(r.size());
    if (contiguous && in.chance(160)) {
      m.first_rank = r.front();
      m.ranks.clear();
    } else {
      m.ranks = std::move(r);
    }
  };
  set(a, ra);
  set(b, rb);
  return mode;
}

inline std::optional<Pair> structured(Bytes& in, std::int64_t max_world) {
  // Global tensors in families (1-3 dims, extents 1..8, 1-6 tensors).
  static const std::vector<DType> dtypes = {DType::f32, DType::bf16, DType::u8, DType::f64, DType::i32, DType::fp8e4m3};
  std::vector<Global> globals;
  std::vector<Family> families;
  const int nfam = static_cast<int>(in.between(1, 3));
  for (int f = 0; f < nfam; ++f) {
    const int rank = static_cast<int>(in.between(1, 3));
    std::vector<std::int64_t> base;
    for (int d = 0; d < rank; ++d) base.push_back(in.between(1, 8));
    Family fam;
    fam.dim = static_cast<int>(in.below(rank));
    const DType dt = in.pick(dtypes);
    const int m = static_cast<int>(in.between(1, 2));
    for (int i = 0; i < m; ++i) {
      Global g;
      g.name = fmt::format("t{}", globals.size());
      g.shape = base;
      g.shape[static_cast<std::size_t>(fam.dim)] = in.between(1, 8);
      g.dtype = dt;
      fam.members.push_back(static_cast<int>(globals.size()));
      globals.push_back(std::move(g));
    }
    families.push_back(std::move(fam));
  }
  // The destination takes a non-empty subset; the source takes all.
  std::vector<bool> in_dst(globals.size());
  bool any = false;
  for (std::size_t t = 0; t < globals.size(); ++t) any |= (in_dst[t] = !in.chance(24));
  if (!any) in_dst[static_cast<std::size_t>(in.below(static_cast<std::int64_t>(globals.size())))] = true;

  auto build = [&](bool dst_side) {
    Side s(in, max_world);
    s.make_mesh();
    for (const auto& fam : families) {
      std::vector<Global> members;
      for (int t : fam.members)
        if (!dst_side || in_dst[static_cast<std::size_t>(t)]) members.push_back(globals[static_cast<std::size_t>(t)]);
      if (members.empty()) continue;
      switch (in.below(4)) {
        case 0:
        case 1:
          for (const auto& g : members) s.alone(g);
          break;
        case 2: s.concat(members, fam.dim); break;
        default: s.flat(members); break;
      }
    }
    return std::move(s.L);
  };
  Pair p;
  p.src = build(false);
  p.dst = build(true);
  p.src.origin = "src.json";
  p.dst.origin = "dst.json";
  p.how = "structured, " + place_ranks(in, p.src.mesh, p.dst.mesh);
  try {
    p.src.validate();
    p.dst.validate();
  } catch (const reshard::LayoutError&) {
    return std::nullopt;  // e.g. an interleave the cut does not divide: not a valid pair
  }
  return p;
}

}  // namespace detail

/// Options for the property tests' generator, drawn from bytes.
inline testgen::RandomOptions seeded_options(Bytes& in, std::int64_t max_world) {
  testgen::RandomOptions o;
  o.max_axes = static_cast<int>(in.between(1, 4));
  // Small: a fuzzer's strength is many different structures per second;
  // the property tests cover the large sizes.
  o.max_world = std::min(max_world, in.pick(std::vector<std::int64_t>{4, 8, 12, 16}));
  o.max_tensors = static_cast<int>(in.between(1, 4));
  o.max_elements = in.pick(std::vector<std::int64_t>{16, 64, 256});
  o.max_tensor_rank = static_cast<int>(in.between(1, 4));
  const auto f = in.byte();
  o.buffers = !(f & 1);
  o.stages = !(f & 2);
  o.cyclic = !(f & 4);
  o.padding = !(f & 8);
  return o;
}

/// A valid layout pair from fuzz bytes, or nullopt when the structured draft
/// is not a valid pair. `max_world`: mesh positions per side at most.
inline std::optional<Pair> layout_pair(Bytes& in, std::int64_t max_world = 12) {
  if (in.byte() & 1) {
    const std::uint64_t seed = in.u64();
    const auto o = seeded_options(in, max_world);
    auto g = testgen::random_layout_pair(seed, o);
    Pair p;
    p.src = std::move(g.src);
    p.dst = std::move(g.dst);
    p.how = fmt::format("seeded {} (max_axes {} max_world {} max_tensors {} max_elements {} max_rank {} buffers {} stages {} cyclic {} padding {}), {}",
                        seed, o.max_axes, o.max_world, o.max_tensors, o.max_elements, o.max_tensor_rank, o.buffers, o.stages, o.cyclic,
                        o.padding, g.ranks);
    return p;
  }
  return detail::structured(in, max_world);
}

}  // namespace fuzzgen
