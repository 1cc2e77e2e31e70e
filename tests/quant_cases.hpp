#pragma once
// Quantized (FP8) refits of random layout pairs, checked bitwise against
// tests/quant_reference.hpp (values and scales): the cases and the check,
// shared by the host refits (test_quant.cpp), the device path on emulated
// streams (test_quant.cpp) and on a GPU (cuda_refit.cpp).
#include <cmath>
#include <cstring>
#include <map>
#include <random>
#include <span>
#include <string>
#include <vector>

#include <doctest/doctest.h>
#include <fmt/format.h>

#include "quant_reference.hpp"
#include "refit_util.hpp"

namespace quant_cases {

using namespace reshard;
using namespace refit_test;

/// A finite source value of global index i of tensor `name` (all exponents
/// from tiny to large, zeros now and then), as the bytes of dtype dt.
inline void source_value(DType dt, const std::string& name, std::int64_t i, std::uint64_t salt, std::byte* out) {
  const std::uint64_t h = tag(name_hash(name), i, salt);
  float f = 0.0f;
  if (h % 17 != 0) {
    const int e = static_cast<int>((h >> 8) % 40) - 30;  // 2^-30 .. 2^9
    f = std::ldexp(1.0f + static_cast<float>((h >> 16) & 0x7F) / 128.0f, e) * ((h >> 30) & 1 ? -1.0f : 1.0f);
  }
  if (dt == DType::f32) {
    std::memcpy(out, &f, 4);
  } else if (dt == DType::bf16) {
    std::uint32_t u;
    std::memcpy(&u, &f, 4);
    const std::uint16_t b = static_cast<std::uint16_t>(u >> 16);  // exact: 7 mantissa bits
    std::memcpy(out, &b, 2);
  } else {  // f16: keep it in f16's normal range
    const float g = std::ldexp(1.0f + static_cast<float>((h >> 16) & 0x7F) / 128.0f, static_cast<int>((h >> 8) % 20) - 12);
    const std::uint32_t m = static_cast<std::uint32_t>((h >> 16) & 0x7F) << 3;
    const std::uint32_t ex = static_cast<std::uint32_t>(static_cast<int>((h >> 8) % 20) - 12 + 15);
    const std::uint16_t b = static_cast<std::uint16_t>((f == 0.0f ? 0u : (ex << 10) | m) | ((h >> 30) & 1 ? 0x8000u : 0u));
    (void)g;
    std::memcpy(out, &b, 2);
  }
}
inline float as_float(DType dt, const std::byte* p) {
  if (dt == DType::f32) {
    float f;
    std::memcpy(&f, p, 4);
    return f;
  }
  std::uint16_t b;
  std::memcpy(&b, p, 2);
  if (dt == DType::bf16) {
    const std::uint32_t u = static_cast<std::uint32_t>(b) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  const int e = (b >> 10) & 31;
  const float v = e == 0 ? std::ldexp(static_cast<float>(b & 0x3FF), -24) : std::ldexp(1.0f + static_cast<float>(b & 0x3FF) / 1024.0f, e - 15);
  return (b & 0x8000) ? -v : v;
}

struct Case {
  Layout src, dst;
  std::string what;
};

inline DimSpec sizes_over(int axis, std::int64_t parts, std::vector<std::int64_t> sizes) {
  DimSpec d;
  d.axes = {AxisRef{axis, 1, parts}};
  d.split = Split::sizes;
  d.sizes = std::move(sizes);
  return d;
}
inline DimSpec cyclic_over(int axis, std::int64_t parts, std::int64_t B) {
  DimSpec d;
  d.axes = {AxisRef{axis, 1, parts}};
  d.split = Split::cyclic;
  d.block = B;
  return d;
}
/// k sizes summing to n, each a multiple of b except possibly the last (which takes the partial tile).
inline std::vector<std::int64_t> tile_cuts(std::mt19937_64& r, std::int64_t n, std::int64_t b, std::int64_t k) {
  const std::int64_t tiles = (n + b - 1) / b;
  std::vector<std::int64_t> t(static_cast<std::size_t>(k), 0);
  for (std::int64_t i = 0; i < tiles; ++i) ++t[r() % static_cast<std::size_t>(k)];
  std::vector<std::int64_t> s;
  std::int64_t left = n;
  for (std::int64_t i = 0; i < k; ++i) {
    const std::int64_t v = std::min(left, t[static_cast<std::size_t>(i)] * b);
    s.push_back(v);
    left -= v;
  }
  s.back() += left;
  // Pieces must be whole tiles: move the partial tile to the part holding the last tile.
  std::int64_t acc = 0;
  for (auto& v : s) acc += v;
  return s;
}
inline std::vector<std::int64_t> any_cuts(std::mt19937_64& r, std::int64_t n, std::int64_t k) {
  std::vector<std::int64_t> s(static_cast<std::size_t>(k), 0);
  for (std::int64_t i = 0; i < n; ++i) ++s[r() % static_cast<std::size_t>(k)];
  return s;
}

/// A random pair: source meshes [dp, tp] with uneven (tile-blind) or
/// tile-aligned TP cuts and DP replicas; destination [dp, tp] with
/// tile-aligned uneven cuts, experts (a leading dim) cyclic or contiguous,
/// a fused [gate; up] buffer, trailing partial tiles, block or mx.
inline Case random_case(std::uint64_t seed) {
  std::mt19937_64 r(seed);
  const bool mx = r() % 3 == 0;
  const std::int64_t br = mx ? 1 : 1 + static_cast<std::int64_t>(r() % 6), bc = mx ? 32 : 1 + static_cast<std::int64_t>(r() % 9);
  const std::int64_t sdp = 1 + static_cast<std::int64_t>(r() % 2), stp = 1 + static_cast<std::int64_t>(r() % 3);
  const std::int64_t ddp = 1 + static_cast<std::int64_t>(r() % 2), dtp = 1 + static_cast<std::int64_t>(r() % 3);
  const bool colocate = r() % 3 == 0;
  const DType sdt = std::array{DType::bf16, DType::f16, DType::f32}[r() % 3];
  LayoutSpec src_spec;
  LayoutSpec dst_spec;
  src_spec.mesh.axes = {{"dp", sdp}, {"tp", stp}};
  dst_spec.mesh.axes = {{"dp", ddp}, {"tp", dtp}};
  dst_spec.mesh.first_rank = colocate ? 0 : sdp * stp;
  const std::int64_t E = 1 + static_cast<std::int64_t>(r() % 3);
  const std::int64_t R = 1 + static_cast<std::int64_t>(r() % 23), C = 1 + static_cast<std::int64_t>(r() % (mx ? 90 : 30));
  const bool experts = r() % 2 == 0, fused = r() % 2 == 0;
  std::string what = fmt::format("seed {} {} block [{},{}] src dp{} tp{} dst dp{} tp{} {} E{} R{} C{} experts {} fused {}", seed,
                                 mx ? "mx" : "block", br, bc, sdp, stp, ddp, dtp, to_string(sdt), E, R, C, experts, fused);
  auto add = [&](const std::string& name) {
    std::vector<std::int64_t> shape = experts ? std::vector<std::int64_t>{E, R, C} : std::vector<std::int64_t>{R, C};
    const int n = static_cast<int>(shape.size());
    TensorSpec s;
    s.name = name;
    s.shape = shape;
    s.dtype = sdt;
    s.dims.resize(static_cast<std::size_t>(n));
    // Source: tp cuts rows anywhere (then receivers quantize) or on tile boundaries.
    const bool aligned = r() % 2 == 0;
    s.dims[static_cast<std::size_t>(n - 2)] = sizes_over(1, stp, aligned ? tile_cuts(r, R, br, stp) : any_cuts(r, R, stp));
    src_spec.tensors.push_back(s);
    TensorSpec d;
    d.name = name;
    d.shape = shape;
    d.dtype = DType::fp8e4m3;
    d.dims.resize(static_cast<std::size_t>(n));
    const bool cut_cols = r() % 2 == 0;
    if (experts && r() % 2 == 0) d.dims[0] = cyclic_over(1, dtp, 1);
    else if (cut_cols) d.dims[static_cast<std::size_t>(n - 1)] = sizes_over(1, dtp, tile_cuts(r, C, bc, dtp));
    else d.dims[static_cast<std::size_t>(n - 2)] = sizes_over(1, dtp, tile_cuts(r, R, br, dtp));
    QuantSpec q;
    q.scheme = mx ? QuantScheme::mx : QuantScheme::block;
    q.block = mx ? std::vector<std::int64_t>{32} : std::vector<std::int64_t>{br, bc};
    q.scale = name + "_scale";
    d.quant = q;
    dst_spec.tensors.push_back(d);
    TensorSpec sc;
    sc.name = q.scale;
    sc.dtype = mx ? DType::u8 : DType::f32;
    sc.shape = shape;
    sc.dims = d.dims;
    const int nb = static_cast<int>(q.block.size());
    for (int k = 0; k < nb; ++k) {
      auto& ext = sc.shape[static_cast<std::size_t>(n - nb + k)];
      const std::int64_t b = q.block[static_cast<std::size_t>(k)];
      ext = (ext + b - 1) / b;
      auto& ds = sc.dims[static_cast<std::size_t>(n - nb + k)];
      for (auto& z : ds.sizes) z = (z + b - 1) / b;
    }
    dst_spec.tensors.push_back(sc);
    return d.dims;
  };
  const auto gate_dims = add("gate");
  if (fused) {
    // up: same cuts as gate on the destination so the two fuse.
    const std::size_t before = dst_spec.tensors.size();
    add("up");
    dst_spec.tensors[before].dims = gate_dims;
    auto& sc = dst_spec.tensors[before + 1];
    sc.dims = gate_dims;
    const auto& q = *dst_spec.tensors[before].quant;
    const int n = static_cast<int>(sc.shape.size()), nb = static_cast<int>(q.block.size());
    for (int k = 0; k < nb; ++k)
      for (auto& z : sc.dims[static_cast<std::size_t>(n - nb + k)].sizes) z = (z + q.block[static_cast<std::size_t>(k)] - 1) / q.block[static_cast<std::size_t>(k)];
    BufferSpec b;
    b.name = "gate_up";
    b.parts = {"gate", "up"};
    b.dim = experts && gate_dims[0].is_cut() ? 1 : 0;
    dst_spec.buffers.push_back(b);
  }
  // A plain tensor beside them.
  src_spec.tensors.push_back(tensor("norm", {R}, {}, sdt));
  dst_spec.tensors.push_back(tensor("norm", {R}, {}, sdt));
  Layout src(std::move(src_spec));
  Layout dst(std::move(dst_spec));
  return {std::move(src), std::move(dst), what};
}

struct QuantOutcome {
  std::int64_t checked = 0, wrong = 0, sender = 0, receiver = 0;
  std::string first;
};

/// `refits` refits of k, each from new sources (salt = the refit's number)
/// into destinations filled with other bytes: run(k, ranks, smem, dmem) refits
/// every rank's host buffers (copying them to and from wherever it keeps
/// them); then every destination slot is checked against the reference.
template <class Run>
QuantOutcome refit_and_check(const Case& k, Run&& run, int refits = 2) {
  QuantOutcome out;
  const auto ranks = world_of(k.src, k.dst);
  const std::size_t n = ranks.size();
  const Schedule full = plan(k.src, k.dst);
  for (const auto& c : full.copies) {
    out.sender += c.quant == CopyQuant::sender;
    out.receiver += c.quant == CopyQuant::receiver;
  }
  std::vector<SideMemory> smem(n), dmem(n);
  for (std::size_t i = 0; i < n; ++i) {
    smem[i] = make_side(k.src, ranks[i], true, 0);
    dmem[i] = make_side(k.dst, ranks[i], false, 0);
  }
  auto fill_sources = [&](std::uint64_t salt) {
    for (std::size_t i = 0; i < n; ++i)
      for (std::size_t b = 0; b < smem[i].slots.size(); ++b) {
        if (!smem[i].present[b]) continue;
        for (std::size_t e = 0; e < smem[i].slots[b].size(); ++e) {
          const auto& s = smem[i].slots[b][e];
          if (s.padding()) continue;
          const auto& ts = k.src.tensors[static_cast<std::size_t>(s.tensor)];
          source_value(ts.dtype, ts.name, s.index, salt, smem[i].data[b].data() + e * smem[i].element_bytes[b]);
        }
      }
  };
  std::mutex m;
  for (int it = 0; it < refits; ++it) {
    const auto salt = static_cast<std::uint64_t>(it);
    fill_sources(salt);
    for (std::size_t i = 0; i < n; ++i) write_side(k.dst, dmem[i], false, salt);
    // The reference: every quantized tensor whole, from the values written above.
    std::map<int, quant_ref::Quantized> ref;
    for (int t = 0; t < static_cast<int>(k.dst.tensors.size()); ++t) {
      const auto& ts = k.dst.tensors[static_cast<std::size_t>(t)];
      if (!ts.quant) continue;
      const auto& sts = k.src.tensors[static_cast<std::size_t>(k.src.find_tensor(ts.name))];
      std::vector<float> x(static_cast<std::size_t>(ts.elements()));
      std::byte tmp[4];
      for (std::size_t g = 0; g < x.size(); ++g) {
        source_value(sts.dtype, ts.name, static_cast<std::int64_t>(g), salt, tmp);
        x[g] = as_float(sts.dtype, tmp);
      }
      ref[t] = quant_ref::quantize(x, ts.shape, ts.quant->block, ts.quant->scheme == QuantScheme::mx);
    }
    run(k, ranks, smem, dmem);
    for (std::size_t i = 0; i < n; ++i)
      for (std::size_t b = 0; b < dmem[i].slots.size(); ++b) {
        if (!dmem[i].present[b]) continue;
        const std::size_t E = dmem[i].element_bytes[b];
        for (std::size_t e = 0; e < dmem[i].slots[b].size(); ++e) {
          const auto& s = dmem[i].slots[b][e];
          const std::byte* p = dmem[i].data[b].data() + e * E;
          bool ok = true;
          if (s.padding()) {
            for (std::size_t q = 0; q < E; ++q) ok &= p[q] == kDstPad;
          } else {
            const auto& ts = k.dst.tensors[static_cast<std::size_t>(s.tensor)];
            if (ts.quant) {
              ok = static_cast<std::uint8_t>(*p) == ref[s.tensor].codes[static_cast<std::size_t>(s.index)];
            } else if (ts.scale_of >= 0) {
              ok = std::memcmp(p, &ref[ts.scale_of].scale_bytes[static_cast<std::size_t>(s.index) * E], E) == 0;
            } else {
              std::byte want[4];
              source_value(ts.dtype, ts.name, s.index, salt, want);
              ok = std::memcmp(p, want, E) == 0;
            }
          }
          ++out.checked;
          if (!ok && out.wrong++ == 0)
            out.first = fmt::format("refit {} rank {} buffer '{}' element {} ({})", it, ranks[i], k.dst.local_buffers()[b].name, e,
                                    s.padding() ? std::string("padding") : fmt::format("{}[{}]", k.dst.tensors[static_cast<std::size_t>(s.tensor)].name, s.index));
        }
      }
  }
  return out;
}

/// refit_and_check of random_case(1 .. seeds), each required right; the
/// outcomes summed (a caller checks both places of quantizing showed up).
template <class Run>
QuantOutcome check_random_cases(int seeds, Run&& run) {
  QuantOutcome sum;
  for (std::uint64_t seed = 1; seed <= static_cast<std::uint64_t>(seeds); ++seed) {
    const Case k = random_case(seed);
    INFO(k.what);
    const auto o = refit_and_check(k, run);
    INFO(o.first);
    REQUIRE(o.wrong == 0);
    CHECK(o.checked > 0);
    sum.checked += o.checked;
    sum.sender += o.sender;
    sum.receiver += o.receiver;
  }
  MESSAGE(seeds << " seeds, " << sum.checked << " destination slots checked, " << sum.sender << " sender / " << sum.receiver << " receiver copies");
  return sum;
}

}  // namespace quant_cases
