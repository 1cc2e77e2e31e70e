// Quantized (FP8) destinations, checked against tests/quant_reference.hpp (a
// quantizer written from the contract text, sharing no code with the library):
// the E4M3 encoder on edge values and random floats, and random layout pairs
// refit end to end on the local transport, every FP8 value and every scale
// entry bitwise; bad quant specs each give one clear error.
#include <doctest/doctest.h>

#include <filesystem>
#include <fstream>
#include <random>

#include "host_stream.hpp"
#include "quant_cases.hpp"
#include "quant_reference.hpp"
#include "refit_util.hpp"
#include "reshard/json_io.hpp"
#include "reshard/layout/quantize.hpp"
#include "reshard/presets/presets.hpp"

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
/// One instruction-set variant of the host quantize kernel.
using QuantizeKernel = void (*)(QuantScheme, const std::byte*, std::uint8_t*, const std::int64_t*, const TileEnd*, std::size_t, std::byte*);

/// The kernel's variants this CPU runs (the dispatcher picks the widest).
template <DType D>
std::vector<std::pair<const char*, QuantizeKernel>> quantize_variants() {
  std::vector<std::pair<const char*, QuantizeKernel>> v = {{"portable", &detail::quantize_tiles_as<D>}};
#ifdef RESHARD_QUANTIZE_X86_DISPATCH
  if (detail::cpu_has_avx2()) v.emplace_back("avx2", &detail::quantize_tiles_as_avx2<D>);
  if (detail::cpu_has_avx512()) v.emplace_back("avx512", &detail::quantize_tiles_as_avx512<D>);
#endif
  return v;
}

/// A rows x cols tensor of dtype D (bf16 or f32) quantized whole by every
/// variant, tile by tile in row-major tile order, against the reference:
/// values of mixed magnitudes, some tiles all zero or all -0, some with a
/// value past 448 after scaling (a subnormal amax).
template <DType D>
void check_kernel_variants(QuantScheme scheme, std::int64_t rows, std::int64_t cols, std::int64_t th, std::int64_t tw, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<float> x(static_cast<std::size_t>(rows * cols));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (auto& v : x) v = normal(rng) * std::ldexp(1.0f, static_cast<int>(rng() % 24) - 12);
  const std::int64_t trows = (rows + th - 1) / th, tcols = (cols + tw - 1) / tw;
  for (std::int64_t t = 0; t < trows * tcols; t += 7)  // every 7th tile: zeros, -0s or tiny values
    for (std::int64_t r = t / tcols * th; r < std::min(rows, (t / tcols + 1) * th); ++r)
      for (std::int64_t c = t % tcols * tw; c < std::min(cols, (t % tcols + 1) * tw); ++c)
        x[static_cast<std::size_t>(r * cols + c)] = t % 3 == 0 ? 0.0f : t % 3 == 1 ? -0.0f : std::ldexp(normal(rng), -140);
  // The source bytes, and the values the reference sees (bf16: rounded down to it).
  constexpr std::int64_t E = element_bytes(D);
  std::vector<std::byte> src(x.size() * E);
  for (std::size_t i = 0; i < x.size(); ++i) {
    std::uint32_t u;
    std::memcpy(&u, &x[i], 4);
    if constexpr (D == DType::bf16) {
      const auto b = static_cast<std::uint16_t>(u >> 16);
      std::memcpy(&src[i * 2], &b, 2);
      u = static_cast<std::uint32_t>(b) << 16;
      std::memcpy(&x[i], &u, 4);
    } else {
      std::memcpy(&src[i * 4], &u, 4);
    }
  }
  const bool mx = scheme == QuantScheme::mx;
  const auto want = quant_ref::quantize(x, {rows, cols}, {th, tw}, mx);
  const std::int64_t SE = mx ? 1 : 4;
  std::vector<std::int64_t> row_list;
  std::vector<TileEnd> tiles;
  for (std::int64_t t = 0; t < trows * tcols; ++t) {
    for (std::int64_t r = t / tcols * th; r < std::min(rows, (t / tcols + 1) * th); ++r) {
      row_list.push_back(r * cols + t % tcols * tw);
      row_list.push_back(std::min(tw, cols - t % tcols * tw));
    }
    tiles.emplace_back(row_list.size() / 2, t * SE);
  }
  for (const auto& [name, kernel] : quantize_variants<D>()) {
    INFO("variant " << std::string(name) << ", dtype " << to_string(D) << ", " << std::string(mx ? "mx" : "block") << " " << th << "x" << tw << " tiles of a " << rows
                    << "x" << cols << " tensor");
    std::vector<std::uint8_t> codes(x.size(), 0xEE);
    std::vector<std::byte> scales(want.scale_bytes.size(), std::byte{0xEE});
    kernel(scheme, src.data(), codes.data(), row_list.data(), tiles.data(), tiles.size(), scales.data());
    std::size_t wrong = 0, first = 0;
    for (std::size_t i = 0; i < codes.size(); ++i)
      if (codes[i] != want.codes[i] && wrong++ == 0) first = i;
    INFO("first wrong code at element " << first);
    CHECK(wrong == 0);
    CHECK(std::memcmp(scales.data(), want.scale_bytes.data(), scales.size()) == 0);
  }
}
}  // namespace

TEST_CASE("the quantize kernel's instruction-set variants (portable, AVX2, AVX-512 where the CPU has them) match the reference") {
  for (std::uint64_t seed : {1u, 2u}) {
    check_kernel_variants<DType::bf16>(QuantScheme::block, 300, 200, 128, 128, seed);  // partial tiles on both dims
    check_kernel_variants<DType::f32>(QuantScheme::block, 256, 256, 128, 128, seed);
    check_kernel_variants<DType::bf16>(QuantScheme::mx, 96, 200, 1, 32, seed);  // 32-element tiles and a partial one per row
    check_kernel_variants<DType::f32>(QuantScheme::mx, 40, 96, 1, 32, seed);
  }
}

using namespace quant_cases;
using reshard::test::DeviceStreamLocalTransport;
using reshard::test::HostAsDevice;
using reshard::test::HostStream;
using reshard::test::HostStreamEngine;

namespace {

/// The host refit of every rank (ranks as threads, host buffers).
void host_refit(const Case& k, const std::vector<std::int64_t>& ranks, std::vector<SideMemory>& smem, std::vector<SideMemory>& dmem) {
  LocalWorld world(ranks);
  world.run([&](LocalTransport& t) {
    const std::size_t i = refit_test::index_of(ranks, t.rank());
    LocalBuffers bufs;
    bufs.src = views(k.src, smem[i]);
    bufs.dst = views(k.dst, dmem[i]);
    Resharder<Layout, LocalTransport> rs(k.src, k.dst, bufs, t);
    rs.refit();
  });
}

/// The device path on emulated streams (host_stream.hpp): buffers bound as
/// device memory, the tiles quantized and the boxes copied on an emulated
/// copy stream with random delays. The trainer writes the sources late on
/// its own stream (the bound sources hold other bytes until then), the
/// refit gets its event and returns without waiting, and the check reads
/// the destination after `done`: quantizing before the sources are final,
/// a transport reading a shadow before its tiles ran, or a `done` before
/// the receivers' tiles, shows up as wrong codes or scales.
template <class T>
void emulated_device_refit(const Case& k, const std::vector<std::int64_t>& ranks, std::vector<SideMemory>& smem,
                           std::vector<SideMemory>& dmem) {
  LocalWorld world(ranks);
  world.run([&](LocalTransport& lt) {
    const std::size_t i = refit_test::index_of(ranks, lt.rank());
    // What the inference side reads after `done`, kept apart from what the
    // copy stream writes later (it drains when the engine goes).
    std::vector<std::vector<std::byte>> seen;
    {
    auto engine = std::make_shared<HostStreamEngine>(std::chrono::microseconds(300), static_cast<std::uint64_t>(lt.rank()) + 5);
    T t = [&] {
      if constexpr (std::is_same_v<T, DeviceStreamLocalTransport>)
        return T(lt, std::chrono::microseconds(300), static_cast<std::uint64_t>(lt.rank()) + 9);
      else
        return T(lt);
    }();
    SideMemory live = smem[i];
    for (auto& b : live.data) std::fill(b.begin(), b.end(), std::byte{0x5A});
    LocalBuffers bufs;
    bufs.src = views(k.src, live);
    bufs.dst = views(k.dst, dmem[i]);
    for (auto* side : {&bufs.src, &bufs.dst})
      for (auto& [name, v] : *side) v.memory = MemoryKind::device;
    ResharderOptions o;
    o.executor.device = engine;
    o.executor.zero_copy_min = 1;  // every contiguous run sent straight from the shadow, as large pieces are
    HostStream trainer;
    Resharder<Layout, T> r(k.src, k.dst, bufs, t, o);
    trainer.enqueue([&] {
      std::this_thread::sleep_for(std::chrono::milliseconds(3));
      for (std::size_t b = 0; b < live.data.size(); ++b) std::copy(smem[i].data[b].begin(), smem[i].data[b].end(), live.data[b].begin());
    });
    StreamOrder order;
    order.sources_final = engine->adopt(trainer.record());
    order.wait = false;
    const RefitReport rep = r.refit(order);
    if (!rep.done) throw std::runtime_error("a refit with wait = false gave no `done` event");
    engine->host_wait(rep.done);
    seen = dmem[i].data;
    }
    dmem[i].data = std::move(seen);
  });
}

}  // namespace

TEST_CASE("quantized refits of random layout pairs match the reference bitwise (values and scales)") {
  const auto o = check_random_cases(300, host_refit);
  // Both places of quantizing were exercised.
  CHECK(o.sender > 0);
  CHECK(o.receiver > 0);
}

TEST_CASE("quantized refits on the device path (emulated streams, both kinds of transport) match the reference bitwise") {
  for (const auto& o : {check_random_cases(40, emulated_device_refit<HostAsDevice>),
                        check_random_cases(40, emulated_device_refit<DeviceStreamLocalTransport>)}) {
    CHECK(o.sender > 0);
    CHECK(o.receiver > 0);
  }
}

TEST_CASE("sender-side quantization sends FP8: 1 byte per element plus the scales") {
  LayoutSpec src_spec;
  LayoutSpec dst_spec;
  src_spec.mesh.axes = {{"tp", 2}};
  dst_spec.mesh.axes = {{"tp", 4}};
  dst_spec.mesh.first_rank = 2;
  TensorSpec s = tensor("w", {256, 256}, {cut(2), DimSpec{}}, DType::bf16);
  src_spec.tensors = {s};
  TensorSpec d = tensor("w", {256, 256}, {cut(4), DimSpec{}}, DType::fp8e4m3);
  d.quant = QuantSpec{QuantScheme::block, {128, 128}, "w_scale_inv"};
  DimSpec chunk = cut(4);
  chunk.split = Split::chunk;
  dst_spec.tensors = {d, tensor("w_scale_inv", {2, 2}, {chunk, DimSpec{}}, DType::f32)};
  CHECK_THROWS_WITH_AS(Layout{dst_spec}, doctest::Contains("cuts tiles of 128 along dim 0"), LayoutError);
  dst_spec.mesh.axes = {{"tp", 2}};
  dst_spec.tensors[0].dims = {cut(2), DimSpec{}};
  dst_spec.tensors[1].dims = {cut(2), DimSpec{}};
  Layout src(std::move(src_spec));
  Layout dst(std::move(dst_spec));
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
    const auto o = refit_and_check(Case{m.train, m.infer, run.infer}, host_refit, 1);
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
