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
};

/// Refits src -> dst `refits` times on the local transport with cast on (and
/// `opt`'s other options), source values from source_value(), and checks
/// every destination element.
CastRun cast_refits(const Layout& src, const Layout& dst, int refits, ResharderOptions opt = {}) {
  CastRun out;
  DenseWorld mem(src, dst);
  opt.plan.cast = true;
  std::mutex m;
  LocalWorld world(mem.ranks);
  world.run([&](LocalTransport& t) {
    const std::size_t i = index_of(mem.ranks, t.rank());
    LocalBuffers bufs;
    bufs.src = views(src, mem.src_mem[i]);
    bufs.dst = views(dst, mem.dst_mem[i]);
    try {
      Resharder<Layout, LocalTransport> r(src, dst, bufs, t, opt);
      for (int k = 0; k < refits; ++k) {
        const auto salt = static_cast<std::uint64_t>(k);
        for_each_held_slot(mem.src_mem[i], [&](std::size_t, std::size_t, const oracle::Slot& s, std::byte* p, std::size_t) {
          if (!s.padding()) store(p, src.tensors[static_cast<std::size_t>(s.tensor)].dtype,
                                  source_value(src.tensors[static_cast<std::size_t>(s.tensor)].name, s.index, salt));
        });
        const RefitReport rep = r.refit();
        std::lock_guard lk(m);
        out.wire_bytes += rep.bytes_sent;
        for_each_held_slot(mem.dst_mem[i], [&](std::size_t, std::size_t, const oracle::Slot& s, const std::byte* p, std::size_t E) {
          if (s.padding()) return;
          const auto& dt = dst.tensors[static_cast<std::size_t>(s.tensor)];
          const auto& st = src.tensors[static_cast<std::size_t>(src.find_tensor(dt.name))];
          const auto want = expected(st.dtype, dt.dtype, source_value(dt.name, s.index, salt));
          ++out.checked;
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

TEST_CASE("a cast refit with delta or double buffering is refused on every rank, naming why") {
  const Layout src = one_axis("tp", 2, 0, {tensor("w", {8, 8}, {cut(2), DimSpec{}}, DType::f32)});
  const Layout dst = one_axis("tp", 2, 2, {tensor("w", {8, 8}, {cut(2), DimSpec{}}, DType::bf16)});
  for (const char* which : {"delta", "double_buffered"}) {
    CAPTURE(which);
    ResharderOptions opt;
    opt.delta.enabled = std::string(which) == "delta";
    opt.double_buffered = !opt.delta.enabled;
    const CastRun r = cast_refits(src, dst, 1, opt);
    REQUIRE(r.errors.size() == 4);
    CHECK(std::any_of(r.errors.begin(), r.errors.end(), [&](const std::string& e) {
      return e.find(std::string("ResharderOptions::") + which) != std::string::npos;
    }));
    CHECK(r.checked == 0);
  }
}
