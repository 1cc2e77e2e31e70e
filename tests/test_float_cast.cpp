// Casts in flight (PlanOptions::cast): a tensor whose float dtype differs
// between the sides is converted by its sender. Checked against a reference
// written here from the definition (the nearest representable value by
// exact arithmetic on decoded values, ties to the even code; past the
// largest finite value, infinity), sharing no code with base/float_convert.hpp;
// then refits between layouts that also reshard, every destination element
// equal to the reference conversion of its source element.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <random>

#include "refit_util.hpp"
#include "reshard/base/float_convert.hpp"
#include "reshard/json_io.hpp"

using namespace reshard;
using namespace refit_test;

namespace {

// --- the reference ----------------------------------------------------------

/// The value of a 16-bit float code with `mant` mantissa bits and exponent
/// bias `bias` (bf16: 7, 127; f16: 10, 15), decoded from its fields.
double decode16(std::uint16_t code, int mant, int bias) {
  const int ebits = 15 - mant;
  const int e = (code >> mant) & ((1 << ebits) - 1);
  const int m = code & ((1 << mant) - 1);
  const double sign = (code & 0x8000) ? -1.0 : 1.0;
  if (e == (1 << ebits) - 1) return m ? std::numeric_limits<double>::quiet_NaN() : sign * std::numeric_limits<double>::infinity();
  if (e == 0) return sign * std::ldexp(static_cast<double>(m), 1 - bias - mant);
  return sign * std::ldexp(1.0 + std::ldexp(static_cast<double>(m), -mant), e - bias);
}

/// Nearest 16-bit code to x (finite or not), ties to the even code; a value
/// at or past the midpoint between the largest finite value and the next
/// power of two (the "next value" an unbounded exponent would give) becomes
/// infinity. NaN: any NaN code is accepted by the caller.
std::uint16_t nearest16(float x, int mant, int bias) {
  const std::uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  const double a = std::fabs(static_cast<double>(x));
  const int ebits = 15 - mant;
  const auto inf = static_cast<std::uint16_t>(((1 << ebits) - 1) << mant);
  if (std::isinf(a)) return sign | inf;
  // Positive codes 0 .. inf-1 are increasing in value; the code past the
  // largest finite one stands for 2^(emax+1) = its value with an unbounded exponent.
  std::uint16_t lo = 0, hi = inf;  // find the last code with value <= a
  auto value = [&](std::uint16_t c) { return c == inf ? std::ldexp(1.0, (1 << ebits) - 1 - bias) : decode16(c, mant, bias); };
  while (hi - lo > 1) {
    const auto mid = static_cast<std::uint16_t>((lo + hi) / 2);
    (value(mid) <= a ? lo : hi) = mid;
  }
  if (value(hi) <= a) lo = hi;
  if (lo == inf) return sign | inf;
  const std::uint16_t up = lo + 1;
  const double dl = a - value(lo), du = value(up) - a;
  const std::uint16_t pick = dl < du ? lo : du < dl ? up : ((lo & 1) ? up : lo);
  return sign | pick;
}

std::uint16_t ref_bf16(float x) { return nearest16(x, 7, 127); }
std::uint16_t ref_f16(float x) { return nearest16(x, 10, 15); }

float from_bits(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

/// Edge values of both formats (their midpoints and neighbours) and random
/// floats over the exponents that matter (f16 subnormals to past f32's bf16 range).
std::vector<float> probe_values(int randoms) {
  std::vector<float> xs = {0.0f, -0.0f, 1.0f, -1.0f, 65504.0f, 65519.0f, 65520.0f, 65536.0f, 1e30f, -3e38f, 3.4028235e38f,
                           std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                           std::numeric_limits<float>::denorm_min(), 1e-45f, 5.96e-8f, 2.98e-8f, 6.1e-5f, 6.103515625e-05f};
  for (int mant : {7, 10}) {
    const int bias = mant == 7 ? 127 : 15;
    const std::uint32_t finite_end = mant == 7 ? 0x7F80u : 0x7C00u;
    for (std::uint32_t c = 0; c < finite_end; c += (mant == 7 ? 37 : 13)) {
      const auto code = static_cast<std::uint16_t>(c);
      const double v = decode16(code, mant, bias), w = decode16(static_cast<std::uint16_t>(code + 1), mant, bias);
      if (!std::isfinite(v) || !std::isfinite(w)) continue;
      const auto mid = static_cast<float>((v + w) / 2);
      for (float f : {static_cast<float>(v), mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e38f)}) {
        xs.push_back(f);
        xs.push_back(-f);
      }
    }
  }
  std::mt19937 rng(7);
  std::uniform_int_distribution<std::uint32_t> bits;
  std::uniform_int_distribution<int> exp(127 - 30, 127 + 20);
  for (int i = 0; i < randoms; ++i) {
    const std::uint32_t u = bits(rng);
    xs.push_back(from_bits((u & 0x807FFFFFu) | static_cast<std::uint32_t>(exp(rng)) << 23));
    xs.push_back(from_bits(u));  // anything, NaNs and huge ones included
  }
  return xs;
}

bool nan16(std::uint16_t c, int mant) {
  const int ebits = 15 - mant;
  return ((c >> mant) & ((1 << ebits) - 1)) == (1 << ebits) - 1 && (c & ((1 << mant) - 1)) != 0;
}

}  // namespace

TEST_CASE("f32 -> bf16 and f32 -> f16 round to nearest even as the reference does, on edge values and random floats") {
  int checked = 0;
  for (float x : probe_values(200000)) {
    CAPTURE(x);
    if (std::isnan(x)) {
      CHECK(nan16(bf16_from_f32(x), 7));
      CHECK(nan16(f16_from_f32(x), 10));
      continue;
    }
    REQUIRE(bf16_from_f32(x) == ref_bf16(x));
    REQUIRE(f16_from_f32(x) == ref_f16(x));
    ++checked;
  }
  CHECK(checked > 400000);
}

TEST_CASE("the widenings are exact: every bf16 and f16 code decodes to its reference value") {
  for (std::uint32_t c = 0; c < 0x10000u; ++c) {
    const auto code = static_cast<std::uint16_t>(c);
    const double b = decode16(code, 7, 127), h = decode16(code, 10, 15);
    if (std::isnan(b)) CHECK(std::isnan(f32_from_bf16(code)));
    else REQUIRE(static_cast<double>(f32_from_bf16(code)) == b);
    if (std::isnan(h)) CHECK(std::isnan(f32_from_f16(code)));
    else REQUIRE(static_cast<double>(f32_from_f16(code)) == h);
  }
}

namespace {

/// The source value of element `index` of tensor `name` (f32 bits, or a
/// bf16 / f16 code widened), salted per refit: specials first, then random.
float source_value(const std::string& name, std::int64_t index, std::uint64_t salt) {
  static const float special[] = {0.0f, -0.0f, 65520.0f, 1e-7f, -3e38f, std::numeric_limits<float>::infinity(), 1.00390625f, 1.01171875f};
  if (index < 8 && salt == 0) return special[index];
  std::uint64_t h = tag(name_hash(name), index, salt);
  const auto u = static_cast<std::uint32_t>(h);
  const auto e = static_cast<std::uint32_t>(127 - 26 + (h >> 40) % 44);  // 2^-26 .. 2^17
  return from_bits((u & 0x807FFFFFu) | e << 23);
}

void store(std::byte* p, DType dt, float v) {
  if (dt == DType::f32) {
    std::memcpy(p, &v, 4);
    return;
  }
  const std::uint16_t c = dt == DType::bf16 ? ref_bf16(v) : ref_f16(v);
  std::memcpy(p, &c, 2);
}

/// What a destination element of dtype `to` must hold for a source element
/// of dtype `from` whose value before storing was v.
std::vector<std::byte> expected(DType from, DType to, float v) {
  std::vector<std::byte> src(4), out(element_bytes(to));
  store(src.data(), from, v);
  float exact = v;  // the stored source value, decoded by the reference
  if (from != DType::f32) {
    std::uint16_t c;
    std::memcpy(&c, src.data(), 2);
    exact = static_cast<float>(decode16(c, from == DType::bf16 ? 7 : 10, from == DType::bf16 ? 127 : 15));
  }
  store(out.data(), to, exact);
  return out;
}

struct CastRun {
  std::int64_t wrong = 0, checked = 0;
  std::string first;
  std::int64_t wire_bytes = 0;
  std::vector<std::string> errors;  ///< per rank whose setup or refit threw
  std::vector<std::int64_t> step_bytes;  ///< per refit: what every rank sent (delta: whole payload blocks)
  std::vector<std::string> modes;        ///< per refit: the delta mode (every rank alike, else "differ")
  std::int64_t shadow_bytes = 0;         ///< delta: every rank's shadows, after the last refit
  std::vector<std::int64_t> world_changed;  ///< delta: per refit, the changed elements the refit measured (all ranks)
  std::vector<std::int64_t> ref_changed;    ///< per refit: destination elements whose expected bits differ from the refit before
};

/// The value of element `index` of tensor `name` before storing, at refit k.
using SourceValue = std::function<float(const std::string& name, std::int64_t index, int k)>;

/// Before refit k on rank `rank`, with its Resharder and destination memory
/// (the set written next: double-buffered, the one not served).
using BeforeRefit = std::function<void(int k, std::int64_t rank, Resharder<Layout, LocalTransport>& r, SideMemory& next)>;

/// Refits src -> dst `refits` times on the local transport with cast on (and
/// `opt`'s other options), source values from `value` (default:
/// source_value(), salted per refit), and checks every destination element
/// (double-buffered: of the set served after each refit).
CastRun cast_refits(const Layout& src, const Layout& dst, int refits, ResharderOptions opt = {}, SourceValue value = {},
                    BeforeRefit before = {}) {
  if (!value) value = [](const std::string& n, std::int64_t i, int k) { return source_value(n, i, static_cast<std::uint64_t>(k)); };
  CastRun out;
  out.step_bytes.assign(static_cast<std::size_t>(refits), 0);
  out.modes.assign(static_cast<std::size_t>(refits), "");
  out.world_changed.assign(static_cast<std::size_t>(refits), -1);
  out.ref_changed.assign(static_cast<std::size_t>(refits), 0);
  DenseWorld mem(src, dst);
  std::vector<SideMemory> back(mem.ranks.size());
  for (std::size_t i = 0; i < mem.ranks.size(); ++i) back[i] = make_side(dst, mem.ranks[i], false, 0);
  opt.plan.cast = true;
  std::mutex m;
  LocalWorld world(mem.ranks);
  world.run([&](LocalTransport& t) {
    const std::size_t i = index_of(mem.ranks, t.rank());
    LocalBuffers bufs;
    bufs.src = views(src, mem.src_mem[i]);
    bufs.dst = views(dst, mem.dst_mem[i]);
    if (opt.double_buffered) bufs.dst_back = views(dst, back[i]);
    try {
      Resharder<Layout, LocalTransport> r(src, dst, bufs, t, opt);
      for (int k = 0; k < refits; ++k) {
        for_each_held_slot(mem.src_mem[i], [&](std::size_t, std::size_t, const oracle::Slot& s, std::byte* p, std::size_t) {
          if (!s.padding()) store(p, src.tensors[static_cast<std::size_t>(s.tensor)].dtype,
                                  value(src.tensors[static_cast<std::size_t>(s.tensor)].name, s.index, k));
        });
        if (before) before(k, t.rank(), r, opt.double_buffered && r.serving_set() == 0 ? back[i] : mem.dst_mem[i]);
        const RefitReport rep = r.refit();
        const auto ku = static_cast<std::size_t>(k);
        std::lock_guard lk(m);
        out.wire_bytes += rep.bytes_sent;
        out.step_bytes[ku] += rep.bytes_sent;
        if (opt.delta.enabled) {
          const std::string& mode = r.delta_executor(opt.double_buffered ? r.serving_set() : 0).last_delta().mode;
          out.modes[ku] = out.modes[ku].empty() || out.modes[ku] == mode ? mode : "differ";
          out.world_changed[ku] = r.delta_executor(opt.double_buffered ? r.serving_set() : 0).last_delta().world_changed;
          if (k + 1 == refits)
            for (int set = 0; set < (opt.double_buffered ? 2 : 1); ++set) out.shadow_bytes += r.delta_executor(set).shadow_bytes();
        }
        const SideMemory& served = opt.double_buffered && r.serving_set() == 1 ? back[i] : mem.dst_mem[i];
        for_each_held_slot(served, [&](std::size_t, std::size_t, const oracle::Slot& s, const std::byte* p, std::size_t E) {
          if (s.padding()) return;
          const auto& dt = dst.tensors[static_cast<std::size_t>(s.tensor)];
          const auto& st = src.tensors[static_cast<std::size_t>(src.find_tensor(dt.name))];
          const auto want = expected(st.dtype, dt.dtype, value(dt.name, s.index, k));
          ++out.checked;
          if (k > 0 && want != expected(st.dtype, dt.dtype, value(dt.name, s.index, k - 1))) ++out.ref_changed[ku];
          if (std::memcmp(p, want.data(), E) != 0 && out.wrong++ == 0)
            out.first = fmt::format("refit {}: rank {} {}[{}] ({} -> {})", k, t.rank(), dt.name, s.index, to_string(st.dtype),
                                    to_string(dt.dtype));
        });
      }
    } catch (const Error& e) {
      std::lock_guard lk(m);
      out.errors.push_back(e.what());
    }
  });
  return out;
}

/// An f32 master weight as Adam moves it (beta1 0.9, beta2 0.999, eps 1e-8,
/// bias-corrected; f32 arithmetic, as a trainer's master copy): N(0, 0.02)-
/// like initial values (the Llama init), then at each refit k >= 1 one step
/// at learning rate lr(k) with a fresh gradient per element (independent
/// between steps, as RL's sampling noise makes them). Each step moves a
/// weight by about lr. The same for every replica (a hash of name, index
/// and step).
float master_value(const std::string& name, std::int64_t index, int k, const std::function<double(int)>& lr) {
  auto normal = [&](std::uint64_t salt) {  // the sum of 4 uniforms, scaled to unit variance
    const std::uint64_t h = tag(name_hash(name), index, salt);
    double u = 0;
    for (int j = 0; j < 4; ++j) u += static_cast<double>((h >> (16 * j)) & 0xFFFF) / 65536.0;
    return static_cast<float>((u - 2.0) * std::sqrt(3.0));
  };
  const float b1 = 0.9f, b2 = 0.999f, eps = 1e-8f;
  float w = 0.02f * normal(0x5eed), m = 0, v = 0;
  for (int j = 1; j <= k; ++j) {
    const float g = 1e-3f * normal(static_cast<std::uint64_t>(j));
    m = b1 * m + (1 - b1) * g;
    v = b2 * v + (1 - b2) * g * g;
    const float c1 = 1 - std::pow(b1, static_cast<float>(j)), c2 = 1 - std::pow(b2, static_cast<float>(j));
    w -= static_cast<float>(lr(j)) * (m / c1) / (std::sqrt(v / c2) + eps);
  }
  return w;
}

}  // namespace

TEST_CASE("a refit casts f32 -> bf16, f32 -> f16, bf16 -> f32 and f16 -> bf16 in flight, resharding tp=2 -> tp=4") {
  // Source: two ranks, dim 0 cut; destination: four ranks, dim 1 cut, with
  // one tensor left as it is (same dtype) beside the cast ones.
  const Layout src = one_axis("tp", 2, 0,
                              {tensor("a", {64, 96}, {cut(2), DimSpec{}}, DType::f32), tensor("b", {64, 96}, {cut(2), DimSpec{}}, DType::f32),
                               tensor("c", {32, 40}, {DimSpec{}, cut(2)}, DType::bf16), tensor("d", {48}, {cut(2)}, DType::f16),
                               tensor("same", {16, 8}, {cut(2), DimSpec{}}, DType::f32)});
  const Layout dst = one_axis("tp", 4, 2,
                              {tensor("a", {64, 96}, {DimSpec{}, cut(4)}, DType::bf16), tensor("b", {64, 96}, {DimSpec{}, cut(4)}, DType::f16),
                               tensor("c", {32, 40}, {cut(4), DimSpec{}}, DType::f32), tensor("d", {48}, {cut(4)}, DType::bf16),
                               tensor("same", {16, 8}, {DimSpec{}, cut(4)}, DType::f32)});
  const CastRun r = cast_refits(src, dst, 3);
  INFO(r.first);
  REQUIRE(r.errors.empty());
  CHECK(r.wrong == 0);
  CHECK(r.checked == 3 * (64 * 96 * 2 + 32 * 40 + 48 + 16 * 8));
  // The destination's dtype crosses the wire: every element once (no rank
  // shares one between the sides), at its destination size.
  CHECK(r.wire_bytes == 3 * (64 * 96 * 2 + 64 * 96 * 2 + 32 * 40 * 4 + 48 * 2 + 16 * 8 * 4));
}

TEST_CASE("a double-buffered cast refit writes the set not served, every element cast, and serves it") {
  const Layout src = one_axis("tp", 2, 0, {tensor("w", {64, 96}, {cut(2), DimSpec{}}, DType::f32), tensor("h", {32, 40}, {DimSpec{}, cut(2)}, DType::bf16)});
  const Layout dst = one_axis("tp", 4, 2, {tensor("w", {64, 96}, {DimSpec{}, cut(4)}, DType::bf16), tensor("h", {32, 40}, {cut(4), DimSpec{}}, DType::f32)});
  ResharderOptions opt;
  opt.double_buffered = true;
  const CastRun r = cast_refits(src, dst, 3, opt);
  INFO(r.first);
  REQUIRE(r.errors.empty());
  CHECK(r.wrong == 0);
  CHECK(r.checked == 3 * (64 * 96 + 32 * 40));
  CHECK(r.wire_bytes == 3 * (64 * 96 * 2 + 32 * 40 * 4));
}

TEST_CASE("a cast refit where ranks are on both sides (colocated) converts the local copies too") {
  const Layout src = one_axis("tp", 2, 0, {tensor("w", {8, 130}, {DimSpec{}, cut(2)}, DType::f32)});
  const Layout dst = one_axis("tp", 2, 0, {tensor("w", {8, 130}, {cut(2), DimSpec{}}, DType::bf16)});
  const CastRun r = cast_refits(src, dst, 2);
  INFO(r.first);
  REQUIRE(r.errors.empty());
  CHECK(r.wrong == 0);
  CHECK(r.checked == 2 * 8 * 130);
}

TEST_CASE("without cast a float dtype mismatch names the tensor and says how to cast; other dtypes never cast") {
  const Layout src = one_axis("tp", 2, 0, {tensor("w", {8, 8}, {cut(2), DimSpec{}}, DType::f32)});
  const Layout dst = one_axis("tp", 2, 2, {tensor("w", {8, 8}, {cut(2), DimSpec{}}, DType::bf16)});
  try {
    plan(src, dst);
    FAIL("no error for bf16 from f32 without cast");
  } catch (const LayoutError& e) {
    CHECK(e.context.tensor == "w");
    CHECK(e.context.field == "dtype");
    CHECK(std::string(e.what()).find("PlanOptions::cast") != std::string::npos);
  }
  PlanOptions po;
  po.cast = true;
  const Schedule s = plan(src, dst, po);
  for (const auto& c : s.copies) {
    CHECK(c.quant == CopyQuant::cast);
    CHECK(c.element_bytes == 2);
  }
  std::ostringstream js;
  write_schedule_json(js, s);
  CHECK(js.str().find("\"quantize\":\"cast\"") != std::string::npos);
  const Layout ints = one_axis("tp", 2, 2, {tensor("w", {8, 8}, {cut(2), DimSpec{}}, DType::i32)});
  CHECK_THROWS_WITH_AS(plan(src, ints, po), doctest::Contains("dtype i32 differs from f32"), LayoutError);
}

// --- casts with delta refits --------------------------------------------------

namespace {

/// Delta options for these small tensors: 256-byte blocks, so what a delta
/// refit sends (whole blocks) is close to its payload.
ResharderOptions delta_options(bool double_buffered) {
  ResharderOptions opt;
  opt.delta.enabled = true;
  opt.delta.block_bytes = 256;
  opt.double_buffered = double_buffered;
  return opt;
}

/// tp=2 (rows cut) -> tp=4 (columns cut): an f32 master cast to bf16, a bf16
/// tensor widened to f32, a bf16 tensor and f32 norms as they are.
std::pair<Layout, Layout> master_layouts() {
  const Layout src = one_axis("tp", 2, 0,
                              {tensor("w", {256, 512}, {cut(2), DimSpec{}}, DType::f32), tensor("wide", {128, 256}, {cut(2), DimSpec{}}, DType::bf16),
                               tensor("same", {64, 128}, {cut(2), DimSpec{}}, DType::bf16), tensor("norm", {512}, {cut(2)}, DType::f32)});
  const Layout dst = one_axis("tp", 4, 2,
                              {tensor("w", {256, 512}, {DimSpec{}, cut(4)}, DType::bf16), tensor("wide", {128, 256}, {DimSpec{}, cut(4)}, DType::f32),
                               tensor("same", {64, 128}, {DimSpec{}, cut(4)}, DType::bf16), tensor("norm", {512}, {cut(4)}, DType::f32)});
  return {src, dst};
}

}  // namespace

TEST_CASE("a cast delta refit of an f32 master at lr 1e-6 sends only the elements whose bf16 value changed, bit-exact every step") {
  const auto [src, dst] = master_layouts();
  const SourceValue value = [](const std::string& n, std::int64_t i, int k) { return master_value(n, i, k, [](int) { return 1e-6; }); };
  for (bool dbl : {false, true}) {
    CAPTURE(dbl);
    const int refits = 6;
    const CastRun r = cast_refits(src, dst, refits, delta_options(dbl), value);
    INFO(r.first);
    REQUIRE(r.errors.empty());
    CHECK(r.wrong == 0);
    CHECK(r.checked == refits * (256 * 512 + 128 * 256 + 64 * 128 + 512));
    // The first refit of each set is dense: the destination's dtype, every element once.
    const std::int64_t dense = 256 * 512 * 2 + 128 * 256 * 4 + 64 * 128 * 2 + 512 * 4;
    CHECK(r.step_bytes[0] == dense);
    // The shadows hold what the receivers hold, in the destination's dtype:
    // the f32 master's shadow is half its f32 bytes (one shadow per set).
    CHECK(r.shadow_bytes == (dbl ? 2 : 1) * dense);
    for (int k = 1; k < refits; ++k) {
      const auto ku = static_cast<std::size_t>(k);
      CAPTURE(k);
      CHECK(r.modes[ku] == (dbl && k == 1 ? "prime" : "delta"));
      if (r.modes[ku] != "delta") continue;
      // Compared as the receiver holds them: the changed elements are exactly
      // those whose destination bits changed (double-buffered: since the
      // version before last, which that set holds), counted here from the reference.
      if (!dbl) CHECK(r.world_changed[ku] == r.ref_changed[ku]);
      CHECK(r.world_changed[ku] > 0);
      CHECK(r.world_changed[ku] * 10 < 256 * 512 + 128 * 256 + 64 * 128 + 512);
      MESSAGE("double_buffered " << dbl << " refit " << k << ": " << r.step_bytes[ku] << " of " << dense << " dense bytes ("
                                 << static_cast<double>(r.step_bytes[ku]) / static_cast<double>(dense) << "), " << r.world_changed[ku]
                                 << " elements changed");
      // At most 1/10 of the dense bytes (these small tensors weigh their
      // chunk tables, headers, blocks and the f32 norms' every-step change
      // more than a model does; docs/delta.md gives the model's figures:
      // 0.029-0.066). A diff of the f32 master would send them all.
      CHECK(r.step_bytes[ku] * 10 <= dense);
    }
  }
}

TEST_CASE("casts to f16 and from f16 under delta refits, with a step past dense_above, stay bit-exact") {
  const Layout src = one_axis("tp", 2, 0,
                              {tensor("h", {128, 256}, {cut(2), DimSpec{}}, DType::f32), tensor("g", {64, 256}, {cut(2), DimSpec{}}, DType::f16)});
  const Layout dst = one_axis("tp", 4, 2,
                              {tensor("h", {128, 256}, {DimSpec{}, cut(4)}, DType::f16), tensor("g", {64, 256}, {DimSpec{}, cut(4)}, DType::bf16)});
  // lr 1e-7, but 1e-2 at refit 3: every element changes, the refit goes dense.
  const SourceValue value = [](const std::string& n, std::int64_t i, int k) {
    return master_value(n, i, k, [](int j) { return j == 3 ? 1e-2 : 1e-7; });
  };
  ResharderOptions opt = delta_options(false);
  opt.delta.dense_streak = 1;
  const int refits = 8;
  const CastRun r = cast_refits(src, dst, refits, opt, value);
  INFO(r.first);
  REQUIRE(r.errors.empty());
  CHECK(r.wrong == 0);
  CHECK(r.checked == refits * (128 * 256 + 64 * 256));
  const std::vector<std::string> modes{"prime", "delta", "delta", "dense", "streak", "prime", "delta", "delta"};
  CHECK(r.modes == modes);
  const std::int64_t dense = (128 * 256 + 64 * 256) * 2;
  for (std::size_t k = 0; k < modes.size(); ++k) {
    CAPTURE(k);
    if (modes[k] == "delta") {
      CHECK(r.world_changed[k] == r.ref_changed[k]);
      CHECK(r.step_bytes[k] < dense / 4);
    } else if (modes[k] != "dense") {  // (the dense one also sent its payloads first)
      CHECK(r.step_bytes[k] == dense);
    }
  }
}

TEST_CASE("a cast delta refit after invalidate_delta_base() on a destination written by someone else is dense and exact") {
  const auto [src, dst] = master_layouts();
  const SourceValue value = [](const std::string& n, std::int64_t i, int k) { return master_value(n, i, k, [](int) { return 1e-6; }); };
  for (bool dbl : {false, true}) {
    for (bool ask : {true, false}) {
      CAPTURE(dbl);
      CAPTURE(ask);
      // Before refit 3 the last destination rank overwrites the set written
      // next (as inference post-processing would) and, with `ask`, says so alone.
      const BeforeRefit junk = [&](int k, std::int64_t rank, Resharder<Layout, LocalTransport>& r, SideMemory& next) {
        if (k != 3 || rank != dst.mesh.global_ranks().back()) return;
        write_side(dst, next, false, 0xbad);
        if (ask) r.invalidate_delta_base();
      };
      const CastRun r = cast_refits(src, dst, 5, delta_options(dbl), value, junk);
      REQUIRE(r.errors.empty());
      if (!ask) {  // the check sees the junk a delta refit leaves in place
        CHECK(r.wrong > 0);
        continue;
      }
      INFO(r.first);
      CHECK(r.wrong == 0);
      // Dense either way: single-buffered after a full diff (the shadows are
      // current); double-buffered this set's first diff over its base takes
      // the density sample first, so the request primes it again.
      CHECK(r.modes[3] == (dbl ? "prime" : "dense"));
      CHECK(r.modes[4] == (dbl ? "dense" : "delta"));  // double-buffered: the other set's next refit is dense too
    }
  }
}

TEST_CASE("FP8 destinations with delta or double buffering stay refused on every rank, naming why (casts no longer are)") {
  LayoutSpec src_spec, dst_spec;
  src_spec.mesh.axes = {{"tp", 2}};
  dst_spec.mesh.axes = {{"tp", 2}};
  dst_spec.mesh.first_rank = 2;
  src_spec.tensors = {tensor("w", {256, 256}, {cut(2), DimSpec{}}, DType::bf16)};
  TensorSpec d = tensor("w", {256, 256}, {cut(2), DimSpec{}}, DType::fp8e4m3);
  d.quant = QuantSpec{QuantScheme::block, {128, 128}, "w_scale_inv"};
  dst_spec.tensors = {d, tensor("w_scale_inv", {2, 2}, {cut(2), DimSpec{}}, DType::f32)};
  const Layout src(std::move(src_spec)), dst(std::move(dst_spec));
  for (const char* which : {"delta", "double_buffered"}) {
    CAPTURE(which);
    ResharderOptions opt;
    opt.delta.enabled = std::string(which) == "delta";
    opt.double_buffered = !opt.delta.enabled;
    const CastRun r = cast_refits(src, dst, 1, opt);
    REQUIRE(r.errors.size() == 4);
    CHECK(std::any_of(r.errors.begin(), r.errors.end(), [&](const std::string& e) {
      return e.find("quantized (FP8) destinations") != std::string::npos && e.find(std::string("ResharderOptions::") + which) != std::string::npos;
    }));
    CHECK(r.checked == 0);
  }
}
