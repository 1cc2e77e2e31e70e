// Quantized (FP8) destinations, checked against tests/quant_reference.hpp (a
// quantizer written from the contract text, sharing no code with the library):
// the E4M3 encoder on edge values and random floats, and random layout pairs
// refit end to end on the local transport, every FP8 value and every scale
// entry bitwise; bad quant specs each give one clear error.
#include <doctest/doctest.h>

#include <filesystem>
#include <fstream>
#include <random>

#include "quant_reference.hpp"
#include "refit_util.hpp"
#include "reshard/json_io.hpp"
#include "reshard/presets/presets.hpp"
#include "reshard/quantize.hpp"

using namespace reshard;
using namespace refit_test;

namespace {
float from_bits(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
}  // namespace

TEST_CASE("e4m3: every code's value, its midpoints and random floats match the reference") {
  std::vector<float> xs = {0.0f, -0.0f, 448.0f, 449.0f, 464.0f, 465.0f, 1e30f, -1e30f, 1e-30f, 240.0f, 0.001953125f, 0.0009765625f};
  for (int c = 0; c < 0x7F; ++c) {
    const double v = quant_ref::e4m3_value(c), w = quant_ref::e4m3_value(c + 1 > 0x7E ? 0x7E : c + 1);
    xs.push_back(static_cast<float>(v));
    xs.push_back(-static_cast<float>(v));
    xs.push_back(static_cast<float>((v + w) / 2));  // ties to even
    xs.push_back(std::nextafter(static_cast<float>((v + w) / 2), 0.0f));
    xs.push_back(std::nextafter(static_cast<float>((v + w) / 2), 1e9f));
  }
  std::mt19937_64 rng(7);
  for (int i = 0; i < 200000; ++i) {
    // Finite floats of all exponents near the E4M3 range.
    const std::uint32_t e = 100 + static_cast<std::uint32_t>(rng() % 40);
    xs.push_back(from_bits(static_cast<std::uint32_t>(rng() & 0x807FFFFFu) | (e << 23)));
  }
  for (float x : xs) {
    INFO("x = " << x);
    REQUIRE(int(e4m3_from_f32(x)) == int(quant_ref::e4m3(x)));
  }
}

namespace {

/// A finite source value of global index i of tensor `name` (all exponents
/// from tiny to large, zeros now and then), as the bytes of dtype dt.
void source_value(DType dt, const std::string& name, std::int64_t i, std::uint64_t salt, std::byte* out) {
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
float as_float(DType dt, const std::byte* p) {
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

DimSpec sizes_over(int axis, std::int64_t parts, std::vector<std::int64_t> sizes) {
  DimSpec d;
  d.axes = {AxisRef{axis, 1, parts}};
  d.split = Split::sizes;
  d.sizes = std::move(sizes);
  return d;
}
DimSpec cyclic_over(int axis, std::int64_t parts, std::int64_t B) {
  DimSpec d;
  d.axes = {AxisRef{axis, 1, parts}};
  d.split = Split::cyclic;
  d.block = B;
  return d;
}
/// k sizes summing to n, each a multiple of b except possibly the last (which takes the partial tile).
std::vector<std::int64_t> tile_cuts(std::mt19937_64& r, std::int64_t n, std::int64_t b, std::int64_t k) {
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
std::vector<std::int64_t> any_cuts(std::mt19937_64& r, std::int64_t n, std::int64_t k) {
  std::vector<std::int64_t> s(static_cast<std::size_t>(k), 0);
  for (std::int64_t i = 0; i < n; ++i) ++s[r() % static_cast<std::size_t>(k)];
  return s;
}

/// A random pair: source meshes [dp, tp] with uneven (tile-blind) or
/// tile-aligned TP cuts and DP replicas; destination [dp, tp] with
/// tile-aligned uneven cuts, experts (a leading dim) cyclic or contiguous,
/// a fused [gate; up] buffer, trailing partial tiles, block or mx.
Case random_case(std::uint64_t seed) {
  std::mt19937_64 r(seed);
  const bool mx = r() % 3 == 0;
  const std::int64_t br = mx ? 1 : 1 + static_cast<std::int64_t>(r() % 6), bc = mx ? 32 : 1 + static_cast<std::int64_t>(r() % 9);
  const std::int64_t sdp = 1 + static_cast<std::int64_t>(r() % 2), stp = 1 + static_cast<std::int64_t>(r() % 3);
  const std::int64_t ddp = 1 + static_cast<std::int64_t>(r() % 2), dtp = 1 + static_cast<std::int64_t>(r() % 3);
  const bool colocate = r() % 3 == 0;
  const DType sdt = std::array{DType::bf16, DType::f16, DType::f32}[r() % 3];
  Layout src, dst;
  src.mesh.axes = {{"dp", sdp}, {"tp", stp}};
  dst.mesh.axes = {{"dp", ddp}, {"tp", dtp}};
  dst.mesh.first_rank = colocate ? 0 : sdp * stp;
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
    src.tensors.push_back(s);
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
    dst.tensors.push_back(d);
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
    dst.tensors.push_back(sc);
    return d.dims;
  };
  const auto gate_dims = add("gate");
  if (fused) {
    // up: same cuts as gate on the destination so the two fuse.
    const std::size_t before = dst.tensors.size();
    add("up");
    dst.tensors[before].dims = gate_dims;
    auto& sc = dst.tensors[before + 1];
    sc.dims = gate_dims;
    const auto& q = *dst.tensors[before].quant;
    const int n = static_cast<int>(sc.shape.size()), nb = static_cast<int>(q.block.size());
    for (int k = 0; k < nb; ++k)
      for (auto& z : sc.dims[static_cast<std::size_t>(n - nb + k)].sizes) z = (z + q.block[static_cast<std::size_t>(k)] - 1) / q.block[static_cast<std::size_t>(k)];
    BufferSpec b;
    b.name = "gate_up";
    b.parts = {"gate", "up"};
    b.dim = experts && gate_dims[0].is_cut() ? 1 : 0;
    dst.buffers.push_back(b);
  }
  // A plain tensor beside them.
  src.tensors.push_back(tensor("norm", {R}, {}, sdt));
  dst.tensors.push_back(tensor("norm", {R}, {}, sdt));
  src.validate();
  dst.validate();
  return {std::move(src), std::move(dst), what};
}

struct QuantOutcome {
  std::int64_t checked = 0, wrong = 0, sender = 0, receiver = 0;
  std::string first;
};

QuantOutcome refit_and_check(const Case& k, int refits = 2) {
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
    LocalWorld world(ranks);
    world.run([&](LocalTransport& t) {
      const std::size_t i = refit_test::index_of(ranks, t.rank());
      LocalBuffers bufs;
      bufs.src = views(k.src, smem[i]);
      bufs.dst = views(k.dst, dmem[i]);
      Resharder<Layout, LocalTransport> rs(k.src, k.dst, bufs, t);
      rs.refit();
    });
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

}  // namespace

TEST_CASE("quantized refits of random layout pairs match the reference bitwise (values and scales)") {
  constexpr int kSeeds = 300;
  std::int64_t sender = 0, receiver = 0, checked = 0;
  for (std::uint64_t seed = 1; seed <= kSeeds; ++seed) {
    const Case k = random_case(seed);
    INFO(k.what);
    const auto o = refit_and_check(k);
    INFO(o.first);
    REQUIRE(o.wrong == 0);
    CHECK(o.checked > 0);
    sender += o.sender;
    receiver += o.receiver;
    checked += o.checked;
  }
  // Both places of quantizing were exercised.
  CHECK(sender > 0);
  CHECK(receiver > 0);
  MESSAGE(kSeeds << " seeds, " << checked << " destination slots checked, " << sender << " sender / " << receiver << " receiver copies");
}

TEST_CASE("sender-side quantization sends FP8: 1 byte per element plus the scales") {
  Layout src, dst;
  src.mesh.axes = {{"tp", 2}};
  dst.mesh.axes = {{"tp", 4}};
  dst.mesh.first_rank = 2;
  TensorSpec s = tensor("w", {256, 256}, {cut(2), DimSpec{}}, DType::bf16);
  src.tensors = {s};
  TensorSpec d = tensor("w", {256, 256}, {cut(4), DimSpec{}}, DType::fp8e4m3);
  d.quant = QuantSpec{QuantScheme::block, {128, 128}, "w_scale_inv"};
  DimSpec chunk = cut(4);
  chunk.split = Split::chunk;
  dst.tensors = {d, tensor("w_scale_inv", {2, 2}, {chunk, DimSpec{}}, DType::f32)};
  CHECK_THROWS_WITH_AS(dst.validate(), doctest::Contains("cuts tiles of 128 along dim 0"), LayoutError);
  dst.mesh.axes = {{"tp", 2}};
  dst.tensors[0].dims = {cut(2), DimSpec{}};
  dst.tensors[1].dims = {cut(2), DimSpec{}};
  src.validate();
  dst.validate();
  const Schedule p = plan(src, dst);
  CHECK(p.stats.bytes == 256 * 256 + 4 * 4);
  for (const auto& c : p.copies) CHECK(c.quant != CopyQuant::receiver);
}

TEST_CASE("bad quant specs: one clear error each, naming the tensor and the field") {
  const std::string head = R"({"mesh": {"axes": [["tp", 2]]}, "tensors": [)";
  struct Bad {
    std::string tensors, phrase;
  };
  const std::vector<Bad> bad = {
      {R"({"name": "w", "shape": [256, 256], "dtype": "bf16", "dims": ["tp", null], "quant": {"scheme": "block", "block": [128, 128], "scale": "s"}},
          {"name": "s", "shape": [2, 2], "dtype": "f32", "dims": ["tp", null]})",
       "tensor 'w': dtype: a tensor with quant must be fp8e4m3"},
      {R"({"name": "w", "shape": [256, 256], "dtype": "fp8e4m3", "quant": {"scheme": "nvfp4", "block": [16], "scale": "s"}})",
       "tensor 'w': quant.scheme: unknown scheme 'nvfp4'"},
      {R"({"name": "w", "shape": [256, 256], "dtype": "fp8e4m3", "quant": {"scheme": "block", "scale": "s"}})",
       "tensor 'w': quant: scheme block needs \"block\""},
      {R"({"name": "w", "shape": [256, 256], "dtype": "fp8e4m3", "quant": {"scheme": "block", "block": [128, 128], "scale": "nope"}})",
       "tensor 'w': quant.scale: no tensor named 'nope'"},
      {R"({"name": "w", "shape": [256, 256], "dtype": "fp8e4m3", "quant": {"scheme": "block", "block": [128, 128], "scale": "s"}},
          {"name": "s", "shape": [2, 3], "dtype": "f32"})",
       "tensor 's': shape: scale tensor of 'w' must have shape [2, 2]"},
      {R"({"name": "w", "shape": [256, 256], "dtype": "fp8e4m3", "quant": {"scheme": "block", "block": [128, 128], "scale": "s"}},
          {"name": "s", "shape": [2, 2], "dtype": "bf16"})",
       "tensor 's': dtype: scale tensor of 'w' (scheme block) must be f32"},
      {R"({"name": "w", "shape": [256, 64], "dtype": "fp8e4m3", "quant": {"scheme": "mx", "scale": "s"}},
          {"name": "s", "shape": [256, 2], "dtype": "f32"})",
       "tensor 's': dtype: scale tensor of 'w' (scheme mx) must be u8"},
      {R"({"name": "w", "shape": [256, 64], "dtype": "fp8e4m3", "quant": {"scheme": "mx", "block": [16], "scale": "s"}},
          {"name": "s", "shape": [256, 4], "dtype": "u8"})",
       "tensor 'w': quant.block: scheme mx tiles the last dim by 32"},
      {R"({"name": "w", "shape": [200, 256], "dtype": "fp8e4m3", "dims": ["tp", null], "quant": {"scheme": "block", "block": [128, 128], "scale": "s"}},
          {"name": "s", "shape": [2, 2], "dtype": "f32", "dims": ["tp", null]})",
       "tensor 'w': dims[0]: rank 0 holds a piece that cuts tiles of 128"},
      {R"({"name": "w", "shape": [256, 256], "dtype": "fp8e4m3", "dims": ["tp", null], "quant": {"scheme": "block", "block": [128, 128], "scale": "s"}},
          {"name": "s", "shape": [2, 2], "dtype": "f32"})",
       "tensor 's': dims[0]: rank 0 holds other tiles of scale tensor 's'"},
      {R"({"name": "w", "shape": [256, 256], "dtype": "fp8e4m3", "quant": {"scheme": "block", "block": [128, 128, 2], "scale": "s"}},
          {"name": "s", "shape": [2, 2], "dtype": "f32"})",
       "tensor 'w': quant.block: block has 3 extents for a tensor of 2 dims"},
      {R"({"name": "w", "shape": [256, 256], "dtype": "fp8e4m3", "quant": {"scheme": "block", "block": [128, 128], "scale": "s", "dtype": "x"}},
          {"name": "s", "shape": [2, 2], "dtype": "f32"})",
       "quant"},
  };
  for (const auto& b : bad) {
    INFO(b.tensors);
    const std::string text = head + b.tensors + "]}";
    std::string msg;
    try {
      parse_layout(nlohmann::json::parse(text), "bad.json");
    } catch (const Error& e) {
      msg = e.what();
    }
    CHECK(msg.find(b.phrase) != std::string::npos);
    CHECK(msg.find("bad.json") != std::string::npos);
    CHECK(msg.find('\n') == std::string::npos);
  }
  // A quantized tensor's source must be a float type.
  Layout src = parse_layout(nlohmann::json::parse(head + R"({"name": "w", "shape": [256, 256], "dtype": "i32"}]})"), "src.json");
  Layout dst = parse_layout(nlohmann::json::parse(head + R"({"name": "w", "shape": [256, 256], "dtype": "fp8e4m3", "quant": {"scheme": "block", "block": [128, 128], "scale": "s"}},
          {"name": "s", "shape": [2, 2], "dtype": "f32"}]})"), "dst.json");
  CHECK_THROWS_WITH_AS(plan(src, dst), doctest::Contains("tensor 'w': dtype: a quantized tensor's source must be bf16, f16 or f32"), LayoutError);
}

TEST_CASE("presets: FP8 vLLM layouts of tiny-moe refit bitwise; embedding, lm_head, norms and router stay BF16") {
  struct Run {
    const char* infer;
    QuantScheme scheme;
    const char* scale_suffix;
  };
  for (const Run& run : {Run{"tp=1,dp=2,ep=2,quant=fp8", QuantScheme::block, ".weight_scale_inv"},
                         Run{"tp=2,quant=mxfp8", QuantScheme::mx, ".weight_scale"}}) {
    INFO(run.infer);
    auto m = presets::model_layouts(RESHARD_TEST_MODELS "/tiny-moe.json", "tp=2,dp=1,ep=2", run.infer, {});
    int quantized = 0;
    for (const auto& t : m.infer.tensors) {
      INFO(t.name);
      const bool bf16 = t.name.find("embed_tokens") != std::string::npos || t.name.find("lm_head") != std::string::npos ||
                        t.name.find("norm") != std::string::npos || t.name.find("mlp.gate.") != std::string::npos;
      if (t.scale_of >= 0) continue;
      CHECK(t.quant.has_value() == !bf16);
      if (!t.quant) continue;
      ++quantized;
      CHECK(t.quant->scheme == run.scheme);
      CHECK(t.quant->scale == t.name.substr(0, t.name.size() - 7) + run.scale_suffix);
    }
    CHECK(quantized > 10);
    const auto o = refit_and_check(Case{m.train, m.infer, run.infer}, 1);
    INFO(o.first);
    CHECK(o.wrong == 0);
    CHECK(o.sender > 0);
  }
}

TEST_CASE("presets: quantization_config fp8 gives block FP8 with its block size; quant=none keeps BF16") {
  auto j = nlohmann::json::parse(std::ifstream(RESHARD_TEST_MODELS "/tiny-moe.json"));
  j["quantization_config"] = {{"quant_method", "fp8"}, {"fmt", "e4m3"}, {"activation_scheme", "dynamic"}, {"weight_block_size", {64, 32}}};
  const auto path = std::filesystem::temp_directory_path() / "reshard_test_quant_config.json";
  std::ofstream(path) << j.dump();
  auto m = presets::model_layouts(path.string(), "tp=2", "tp=2", {});
  const auto& w = m.infer.tensors[static_cast<std::size_t>(m.infer.find_tensor("model.layers.0.self_attn.o_proj.weight"))];
  REQUIRE(w.quant);
  CHECK(w.quant->block == std::vector<std::int64_t>{64, 32});
  CHECK(m.infer.find_tensor("model.layers.0.self_attn.o_proj.weight_scale_inv") >= 0);
  CHECK(m.train.tensors[static_cast<std::size_t>(m.train.find_tensor("model.layers.0.self_attn.o_proj.weight"))].dtype == DType::bf16);
  auto none = presets::model_layouts(path.string(), "tp=2", "tp=2,quant=none", {});
  for (const auto& t : none.infer.tensors) CHECK(!t.quant);
  CHECK_THROWS_WITH(presets::model_layouts(path.string(), "tp=2,quant=fp8", "tp=2", {}), doctest::Contains("quant"));
  j["quantization_config"]["quant_method"] = "awq";
  std::ofstream(path) << j.dump();
  CHECK_THROWS_WITH(presets::model_layouts(path.string(), "tp=2", "tp=2", {}), doctest::Contains("quantization_config.quant_method"));
  CHECK_THROWS_WITH(presets::parse_parallel_spec("tp=2,quant=int4", "infer spec"), doctest::Contains("quant='int4' is not one of fp8, mxfp8, none"));
  std::filesystem::remove(path);
}
