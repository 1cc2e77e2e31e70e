// Delta refits (delta.hpp): after any sequence of versions, with densities
// from 0 to 100%, single- and double-buffered, with a failed refit in the
// middle, every destination element equals its expected value, computed
// here from (tensor, global index, version) alone: an element changes at
// version u with probability density[u], by a hash of (tensor, index, u), so
// its value at version v is the tag of the last u <= v at which it changed.
// Nothing is compared with the library's own output.
#include <doctest/doctest.h>

#include <cstring>
#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "random_layouts.hpp"
#include "refit_util.hpp"
#include "reshard/exec/delta.hpp"
#include "reshard/presets/presets.hpp"

using namespace reshard;
using refit_test::SideMemory;

namespace {

using FT = FaultInjectingTransport<LocalTransport>;
using R = Resharder<Layout, FT>;

/// Per version (index = version - 1), the fraction of elements that change.
using Densities = std::vector<double>;

/// The version at which element (name, index) last changed, at version v.
std::uint64_t last_change(std::uint64_t name, std::int64_t index, std::uint64_t v, const Densities& d) {
  for (std::uint64_t u = v; u > 1; --u) {
    const double p = d[u - 1];
    const std::uint64_t h = refit_test::tag(name ^ 0x5bd1e995u, index, u * 7919);
    if (static_cast<double>(h >> 11) * 0x1.0p-53 < p) return u;
  }
  return 1;
}

/// Source (values at version v) or check of a destination (count wrong).
std::int64_t visit(const Layout& L, SideMemory& m, bool source, std::uint64_t v, const Densities& d, std::int64_t rank, std::string* first) {
  std::int64_t wrong = 0;
  refit_test::for_each_held_slot(m, [&](std::size_t b, std::size_t i, const oracle::Slot& s, std::byte* p, std::size_t E) {
    std::byte want[8];
    if (s.padding()) {
      std::memset(want, static_cast<int>(source ? refit_test::kSrcPad : refit_test::kDstPad), 8);
    } else {
      const auto name = refit_test::name_hash(L.tensors[static_cast<std::size_t>(s.tensor)].name);
      const std::uint64_t x = refit_test::tag(name, s.index, last_change(name, s.index, v, d));
      std::memcpy(want, &x, 8);
    }
    if (source) {
      std::memcpy(p, want, E);
    } else if (std::memcmp(p, want, E) != 0 && wrong++ == 0 && first) {
      *first = fmt::format("version {}: rank {} buffer '{}' element {} is wrong", v, rank, L.local_buffers()[b].name, i);
    }
  });
  return wrong;
}

struct Result {
  std::int64_t wrong = 0;
  std::string first_wrong;
  std::vector<std::string> modes;  ///< rank 0's mode per committed version
  std::vector<double> fraction;    ///< measured changed fraction per version
  std::vector<std::int64_t> sent;  ///< bytes sent (all ranks) per version
  int failures = 0;
  std::int64_t chunks[delta::kChunkModes] = {};  ///< chunks sent per ChunkMode, all ranks and versions
};

/// Something other than the refit writes one rank's destination (both sets)
/// just before version `at`; with `request` that rank alone then calls
/// Resharder::invalidate_delta_base().
struct Overwrite {
  std::uint64_t at = 0;
  bool request = true;
};

/// Refits versions 1..densities.size() (source values evolved as above),
/// checking every destination element of the served set after each. With
/// `fail_at` > 0, that version's refit fails (a corrupted delta payload, or
/// a corrupted dense message when the version goes dense): the job then sets
/// up again on a fresh transport and refits the same version again.
/// With `strided`, every buffer is a strided view (refit_test::StridedSide).
Result run_versions(const Layout& src, const Layout& dst, const Densities& d, ResharderOptions opt, std::uint64_t fail_at = 0,
                    Overwrite overwrite = {}, bool strided = false) {
  Result res;
  const auto ranks = refit_test::world_of(src, dst);
  const std::size_t n = ranks.size();
  std::vector<SideMemory> smem(n), dmem(n), back(n);
  for (std::size_t i = 0; i < n; ++i) {
    smem[i] = refit_test::make_side(src, ranks[i], true, 0);
    dmem[i] = refit_test::make_side(dst, ranks[i], false, 0);
    back[i] = refit_test::make_side(dst, ranks[i], false, 0);
  }
  std::vector<std::unique_ptr<refit_test::StridedSide>> sview(n), dview(n), bview(n);
  for (std::size_t i = 0; strided && i < n; ++i) {
    sview[i] = std::make_unique<refit_test::StridedSide>(src, ranks[i], smem[i]);
    dview[i] = std::make_unique<refit_test::StridedSide>(dst, ranks[i], dmem[i]);
    bview[i] = std::make_unique<refit_test::StridedSide>(dst, ranks[i], back[i]);
  }
  opt.executor.checksum = opt.executor.checksum || fail_at > 0;
  std::vector<std::unique_ptr<R>> rs(n);
  std::vector<std::unique_ptr<LocalWorld>> worlds;
  std::vector<std::vector<LocalTransport>> endpoints;
  std::vector<std::vector<std::unique_ptr<FT>>> transports;
  // The fault: from the moment a rank starts version fail_at (all messages
  // of earlier versions have arrived by then: each refit ends in an
  // all-gather of verdicts), the next data message from the lowest rank is
  // corrupted on arrival at its first byte (a payload header, or a dense
  // message's data), which its checksum catches.
  std::atomic<bool> armed{false};
  FaultPlan plan;
  FaultRule rule = FaultRule::when(FaultKind::corrupt_arrived, [&armed, first = ranks.front()](const MessageInfo& m) {
    return armed.load() && m.from == first && (m.tag & (std::uint64_t{1} << 47)) == 0;
  });
  rule.byte = 0;
  plan.add(rule);
  std::mutex mu;
  std::uint64_t v = 1;
  for (int attempt = 0; attempt < 2 && v <= d.size(); ++attempt) {
    worlds.push_back(std::make_unique<LocalWorld>(ranks));
    endpoints.emplace_back();
    transports.emplace_back();
    for (auto r : ranks) endpoints.back().push_back(worlds.back()->endpoint(r));
    const bool faulty = attempt == 0 && fail_at > 0;
    FaultPlan none;
    for (auto& e : endpoints.back()) transports.back().push_back(std::make_unique<FT>(e, faulty ? plan : none));
    std::uint64_t next = v;
    worlds.back()->run([&](LocalTransport& t) {
      const std::size_t i = refit_test::index_of(ranks, t.rank());
      FT& ft = *transports.back()[i];
      LocalBuffers b;
      b.src = strided ? sview[i]->views(src) : refit_test::views(src, smem[i]);
      b.dst = strided ? dview[i]->views(dst) : refit_test::views(dst, dmem[i]);
      if (opt.double_buffered) b.dst_back = strided ? bview[i]->views(dst) : refit_test::views(dst, back[i]);
      if (!rs[i])
        rs[i] = std::make_unique<R>(src, dst, b, ft, opt);
      else
        rs[i]->setup(b, ft);
      for (std::uint64_t u = v; u <= d.size(); ++u) {
        visit(src, smem[i], true, u, d, ranks[i], nullptr);
        if (strided) sview[i]->store(smem[i]);
        if (faulty && u == fail_at) armed = true;
        if (u == overwrite.at && ranks[i] == dst.mesh.global_ranks().back()) {
          refit_test::write_side(dst, dmem[i], false, 0xbad);
          refit_test::write_side(dst, back[i], false, 0xbad);
          if (strided) dview[i]->store(dmem[i]), bview[i]->store(back[i]);
          if (overwrite.request) rs[i]->invalidate_delta_base();
        }
        RefitReport rep;
        try {
          rep = rs[i]->refit(u);
        } catch (const RefitNotCommitted& e) {
          if (!opt.double_buffered && rs[i]->last_good_version() > 0) {
            // What the failure says each buffer holds is what it holds: the payloads scattered so far,
            // and a dense refit's pieces over them.
            if (strided) dview[i]->load(dmem[i]);
            auto value = [&](std::uint64_t h, std::int64_t k, std::uint64_t ver) { return refit_test::tag(h, k, last_change(h, k, ver, d)); };
            const auto bad = refit_test::check_writes(dst, dmem[i], e.writes(), u, rs[i]->last_good_version(), value);
            std::lock_guard lk(mu);
            if (!bad.empty() && res.first_wrong.empty()) res.first_wrong = fmt::format("version {} failed: rank {}: {}", u, ranks[i], bad);
            res.wrong += bad.empty() ? 0 : 1;
          }
          std::lock_guard lk(mu);
          if (i == 0) ++res.failures;
          next = u + 1;  // versions only increase: go on with the next one
          return;
        }
        const int set = rs[i]->serving_set();
        std::string first;
        bool gaps = true;
        if (strided) {
          auto& view = set == 0 ? dview[i] : bview[i];
          view->load(set == 0 ? dmem[i] : back[i]);
          gaps = view->gaps_intact() && sview[i]->gaps_intact();
        }
        const auto wrong = visit(dst, set == 0 ? dmem[i] : back[i], false, u, d, ranks[i], &first) + (gaps ? 0 : 1);
        if (!gaps) first = fmt::format("version {}: rank {}: a gap between the strided views' elements was written", u, ranks[i]);
        const auto& ds = rs[i]->delta_executor(opt.double_buffered ? set : 0).last_delta();
        std::lock_guard lk(mu);
        res.wrong += wrong;
        if (wrong && res.first_wrong.empty()) res.first_wrong = first + " (mode " + ds.mode + ")";
        if (res.sent.size() < u) res.sent.resize(u), res.modes.resize(u), res.fraction.resize(u);
        res.sent[u - 1] += rep.bytes_sent;
        for (int c = 0; c < delta::kChunkModes; ++c) res.chunks[c] += ds.chunks[c];
        if (i == 0) {
          res.modes[u - 1] = ds.mode;
          res.fraction[u - 1] = ds.changed_fraction();
        }
        next = u + 1;
      }
    });
    v = next;
  }
  rs.clear();
  return res;
}

ResharderOptions delta_options(bool double_buffered, double dense_above = 0.25, int streak = 1, double capacity = 0.375) {
  ResharderOptions o;
  o.double_buffered = double_buffered;
  o.delta.enabled = true;
  o.delta.dense_above = dense_above;
  o.delta.dense_streak = streak;
  o.delta.capacity = capacity;
  o.delta.block_bytes = 1024;
  o.executor.timeout = std::chrono::seconds(20);
  return o;
}

/// Densities 0..100%, with sparse runs between the dense ones.
Densities sweep() { return {1.0, 0.0, 0.001, 0.01, 0.05, 0.2, 0.0, 0.5, 0.002, 1.0, 0.03, 0.0, 0.7, 0.01}; }

}  // namespace

TEST_CASE("kernels: diff-and-compact, masks and scatter agree with plain loops") {
  std::mt19937_64 g(7);
  for (std::size_t E : {1u, 2u, 4u, 8u, 3u}) {
    for (double p : {0.0, 0.01, 0.3, 1.0}) {
      CAPTURE(E);
      CAPTURE(p);
      const std::int64_t n = 1000 + static_cast<std::int64_t>(g() % 3000);
      std::vector<std::byte> base(static_cast<std::size_t>(n) * E), cur;
      for (auto& x : base) x = static_cast<std::byte>(g());
      cur = base;
      std::vector<std::int64_t> want;
      for (std::int64_t j = 0; j < n; ++j)
        if (static_cast<double>(g() >> 11) * 0x1.0p-53 < p) {
          // any bit of any byte of the element (the word compares see every lane)
          cur[static_cast<std::size_t>(j) * E + g() % E] ^= static_cast<std::byte>(1u << (g() % 8));
          want.push_back(j);
        }
      std::vector<std::uint16_t> idx(static_cast<std::size_t>(n));
      std::vector<std::byte> vals(cur.size()), shadow = base;
      CHECK(delta::count_changed_bytes(E, cur.data(), base.data(), n) == static_cast<std::int64_t>(want.size()));
      const auto k = delta::diff_compact_bytes(E, cur.data(), shadow.data(), n, idx.data(), vals.data());
      REQUIRE(k == static_cast<std::int64_t>(want.size()));
      CHECK(shadow == cur);
      for (std::int64_t j = 0; j < k; ++j) {
        CHECK(idx[static_cast<std::size_t>(j)] == want[static_cast<std::size_t>(j)]);
        CHECK(std::memcmp(vals.data() + j * static_cast<std::int64_t>(E), cur.data() + want[static_cast<std::size_t>(j)] * static_cast<std::int64_t>(E), E) == 0);
      }
      std::vector<std::byte> mask(static_cast<std::size_t>((n + 7) / 8));
      delta::mask_from_indices(idx.data(), k, n, mask.data());
      std::vector<std::uint16_t> back(static_cast<std::size_t>(n));
      REQUIRE(delta::indices_from_mask(mask.data(), n, back.data()) == k);
      CHECK(std::equal(back.begin(), back.begin() + k, idx.begin()));
      const auto esc = delta::gap_escapes(idx.data(), k);
      std::vector<std::byte> gaps(static_cast<std::size_t>(k + 2 * esc) + 1);
      delta::gaps_from_indices(idx.data(), k, gaps.data());
      std::fill(back.begin(), back.end(), 0);
      CHECK(delta::indices_from_gaps(gaps.data(), k, n, k + 2 * esc, back.data()) == k + 2 * esc);
      CHECK(std::equal(back.begin(), back.begin() + k, idx.begin()));
      if (k > 0) CHECK(delta::indices_from_gaps(gaps.data(), k, n, k + 2 * esc - 1, back.data()) == -1);  // truncated
      // Scatter into a strided 2-D destination (every other column of a [rows, 2*cols] array).
      const std::int64_t cols = 50, rows = (n + cols - 1) / cols;
      std::vector<std::byte> dst(static_cast<std::size_t>(rows * 2 * cols) * E, std::byte{0});
      delta::StreamSegment seg;
      seg.base = dst.data();
      const std::int64_t extent[] = {rows, cols}, stride[] = {2 * cols, 2}, none[] = {0, 0};
      seg.assign(2, extent, stride, none);
      seg.count = rows * cols;
      std::vector<delta::StreamSegment> segs{seg};
      std::size_t cursor = 0;
      delta::scatter_bytes(E, segs, cursor, 0, idx.data(), k, vals.data());
      for (std::int64_t j = 0; j < k; ++j) {
        const std::int64_t e = want[static_cast<std::size_t>(j)], at = (e / cols) * 2 * cols + (e % cols) * 2;
        CHECK(std::memcmp(dst.data() + at * static_cast<std::int64_t>(E), cur.data() + e * static_cast<std::int64_t>(E), E) == 0);
      }
    }
  }
  CHECK(delta::best_mode(65536, 0, 2) == delta::ChunkMode::same);
  CHECK(delta::best_mode(65536, 100, 2) == delta::ChunkMode::index);   // (gaps all escaped)
  CHECK(delta::best_mode(65536, 1000, 2, 10) == delta::ChunkMode::gap);
  CHECK(delta::best_mode(65536, 20000, 2) == delta::ChunkMode::mask);
  CHECK(delta::best_mode(65536, 65000, 2) == delta::ChunkMode::dense);
  // The simulator's wire bytes per dense byte (bf16, chunks of 65,536): a
  // 4-byte table entry plus, by hand, nothing / 3277 gaps of 1 byte + 2-byte
  // values (no gap past 255 at 5%) / an 8 KiB mask + 13107 values / dense.
  CHECK(delta::expected_wire_fraction(2, 0.0) == doctest::Approx(4.0 / 131072));
  CHECK(delta::expected_wire_fraction(2, 0.05) == doctest::Approx((4.0 + 3277 * 3) / 131072));
  CHECK(delta::expected_wire_fraction(2, 0.2) == doctest::Approx((4.0 + 8192 + 13107 * 2) / 131072));
  CHECK(delta::expected_wire_fraction(2, 1.0) == doctest::Approx((4.0 + 131072) / 131072));
}

TEST_CASE("kernels: every diff-and-compact variant agrees with a scalar loop and writes no output past its bound") {
  // The reference: an element changed iff any of its bytes differs.
  auto reference = [](std::size_t E, const std::vector<std::byte>& cur, const std::vector<std::byte>& base, std::int64_t n) {
    std::vector<std::int64_t> pos;
    for (std::int64_t j = 0; j < n; ++j) {
      bool differs = false;
      for (std::size_t b = 0; b < E; ++b) differs |= cur[static_cast<std::size_t>(j) * E + b] != base[static_cast<std::size_t>(j) * E + b];
      if (differs) pos.push_back(j);
    }
    return pos;
  };
  using Kernel = std::function<std::int64_t(const std::byte*, std::byte*, std::int64_t, std::uint16_t*, std::byte*)>;
  std::vector<std::pair<std::string, std::pair<std::size_t, Kernel>>> kernels = {
      {"portable 2", {2, [](auto... a) { return delta::diff_compact<2>(a...); }}},
      {"portable 4", {4, [](auto... a) { return delta::diff_compact<4>(a...); }}},
      {"dispatched 2", {2, [](auto... a) { return delta::diff_compact_bytes(2, a...); }}},
      {"dispatched 4", {4, [](auto... a) { return delta::diff_compact_bytes(4, a...); }}},
  };
#ifdef RESHARD_DELTA_AVX512_DISPATCH
  if (delta::detail::cpu_has_avx512_compress()) {
    kernels.push_back({"avx512 2", {2, [](auto... a) { return delta::diff_compact_avx512<2>(a...); }}});
    kernels.push_back({"avx512 4", {4, [](auto... a) { return delta::diff_compact_avx512<4>(a...); }}});
  } else {
    MESSAGE("this CPU lacks AVX-512 BW/VL/VBMI2: the AVX-512 diff kernel is not exercised");
  }
#endif
  std::mt19937_64 g(11);
  const std::byte guard{0xA5};
  for (const auto& [name, kernel] : kernels) {
    const auto [E, run] = kernel;
    // Lengths around the vector (16/32 lanes) and group (64/128 lanes) edges, and a whole chunk.
    for (std::int64_t n : {std::int64_t{1}, std::int64_t{15}, std::int64_t{31}, std::int64_t{33}, std::int64_t{127}, std::int64_t{129},
                           std::int64_t{1000}, delta::kChunk}) {
      for (double p : {0.0, 0.001, 0.03, 0.5, 1.0}) {
        CAPTURE(name);
        CAPTURE(n);
        CAPTURE(p);
        std::vector<std::byte> base(static_cast<std::size_t>(n) * E), cur;
        for (auto& x : base) x = static_cast<std::byte>(g());
        cur = base;
        for (std::int64_t j = 0; j < n; ++j)
          if (static_cast<double>(g() >> 11) * 0x1.0p-53 < p) cur[static_cast<std::size_t>(j) * E + g() % E] ^= static_cast<std::byte>(1u << (g() % 8));
        if (n == delta::kChunk && p == 0.001) cur[static_cast<std::size_t>(n - 1) * E] ^= std::byte{0x80};  // the last position, 65535
        const std::vector<std::int64_t> want = reference(E, cur, base, n);
        // Outputs with guard bytes after them: a kernel may write k entries, no more.
        std::vector<std::uint16_t> idx(static_cast<std::size_t>(n) + 64, 0xA5A5);
        std::vector<std::byte> vals(static_cast<std::size_t>(n + 64) * E, guard), shadow = base;
        const std::int64_t k = run(cur.data(), shadow.data(), n, idx.data(), vals.data());
        REQUIRE(k == static_cast<std::int64_t>(want.size()));
        CHECK(std::memcmp(shadow.data(), cur.data(), cur.size()) == 0);
        bool positions = true, values = true, guards = true;
        for (std::int64_t j = 0; j < k; ++j) {
          positions &= idx[static_cast<std::size_t>(j)] == want[static_cast<std::size_t>(j)];
          values &= std::memcmp(vals.data() + j * static_cast<std::int64_t>(E), cur.data() + want[static_cast<std::size_t>(j)] * static_cast<std::int64_t>(E), E) == 0;
        }
        // The portable kernel may use up to n entries as scratch (it writes a dirty block's first four
        // changes unconditionally); the AVX-512 one writes exactly k.
        const auto from = static_cast<std::size_t>(name.rfind("avx512", 0) == 0 ? k : n);
        for (std::size_t j = from; j < idx.size(); ++j) guards &= idx[j] == 0xA5A5;
        for (std::size_t j = from * E; j < vals.size(); ++j) guards &= vals[j] == guard;
        CHECK(positions);
        CHECK(values);
        CHECK(guards);
      }
    }
  }
}

TEST_CASE("kernels: the in-place diff of a chunk's rows agrees with a scalar loop; short or strided rows are refused untouched") {
  // A stream of three segments: 300 contiguous elements, a [rows, cols] box
  // in a pitched buffer (a column slice of a row-parallel weight), 500
  // contiguous elements. Element e's address is worked out by hand here.
  std::mt19937_64 g(13);
  for (std::size_t E : {2u, 4u}) {
    for (std::int64_t cols : {std::int64_t{64}, std::int64_t{100}, std::int64_t{40}}) {
      const std::int64_t rows = 37, pitch = 2 * cols + 3, na = 300, nb = rows * cols, nc = 500, total = na + nb + nc;
      const auto e_sz = static_cast<std::int64_t>(E);
      std::vector<std::byte> a(static_cast<std::size_t>(na * e_sz)), b(static_cast<std::size_t>(rows * pitch * e_sz)),
          c(static_cast<std::size_t>(nc * e_sz));
      for (auto* v : {&a, &b, &c})
        for (auto& x : *v) x = static_cast<std::byte>(g());
      auto element = [&](std::int64_t e) -> std::byte* {
        if (e < na) return a.data() + e * e_sz;
        if (e < na + nb) return b.data() + (((e - na) / cols) * pitch + (e - na) % cols) * e_sz;
        return c.data() + (e - na - nb) * e_sz;
      };
      std::vector<delta::StreamSegment> segs(3);
      const std::int64_t one = 1, none[] = {0, 0}, ext_b[] = {rows, cols}, str_b[] = {pitch, 1};
      segs[0].base = a.data();
      segs[0].assign(1, &na, &one, none);
      segs[0].count = na;
      segs[0].contiguous = true;
      segs[1].base = b.data();
      segs[1].assign(2, ext_b, str_b, none);
      segs[1].first = na;
      segs[1].count = nb;
      segs[2].base = c.data();
      segs[2].assign(1, &nc, &one, none);
      segs[2].first = na + nb;
      segs[2].count = nc;
      segs[2].contiguous = true;
      // Chunks starting and ending inside a row, spanning all three segments, and inside the box alone.
      for (auto [first, n] : {std::pair<std::int64_t, std::int64_t>{250, total - 250 - 120}, {na + cols / 2, 5 * cols + 7}, {0, total}}) {
        for (double p : {0.0, 0.03, 1.0}) {
          CAPTURE(E);
          CAPTURE(cols);
          CAPTURE(first);
          CAPTURE(p);
          std::vector<std::byte> base(static_cast<std::size_t>(n * e_sz)), packed(base.size());
          for (std::int64_t j = 0; j < n; ++j) {
            std::byte* x = element(first + j);
            std::memcpy(base.data() + j * e_sz, x, E);
            if (static_cast<double>(g() >> 11) * 0x1.0p-53 < p) x[g() % E] ^= static_cast<std::byte>(1u << (g() % 8));
            std::memcpy(packed.data() + j * e_sz, x, E);
          }
          std::vector<std::int64_t> want;
          for (std::int64_t j = 0; j < n; ++j)
            if (std::memcmp(packed.data() + j * e_sz, base.data() + j * e_sz, E) != 0) want.push_back(j);
          std::vector<std::uint16_t> idx(static_cast<std::size_t>(n) + 8);
          std::vector<std::byte> vals(static_cast<std::size_t>((n + 8) * e_sz)), shadow = base;
          const std::int64_t k = delta::diff_in_place(E, segs, 0, first, n, shadow.data(), idx.data(), vals.data());
          if (cols < delta::kMinInPlaceRow) {
            CHECK(k == -1);  // rows too short to diff one by one: the caller packs
            CHECK(shadow == base);
            continue;
          }
          REQUIRE(k == static_cast<std::int64_t>(want.size()));
          CHECK(shadow == packed);
          bool positions = true, values = true;
          for (std::int64_t j = 0; j < k; ++j) {
            positions &= idx[static_cast<std::size_t>(j)] == want[static_cast<std::size_t>(j)];
            values &= std::memcmp(vals.data() + j * e_sz, packed.data() + want[static_cast<std::size_t>(j)] * e_sz, E) == 0;
          }
          CHECK(positions);
          CHECK(values);
        }
      }
    }
  }
  // Rows of stride 2 (every other element of a 1-d buffer): refused, nothing written.
  std::vector<std::byte> buf(4096 * 2, std::byte{1}), shadow(2048 * 2, std::byte{2});
  delta::StreamSegment s;
  const std::int64_t n = 2048, two = 2, zero = 0;
  s.base = buf.data();
  s.assign(1, &n, &two, &zero);
  s.count = n;
  std::vector<std::uint16_t> idx(2048);
  std::vector<std::byte> vals(4096);
  CHECK(delta::diff_in_place(2, {s}, 0, 0, n, shadow.data(), idx.data(), vals.data()) == -1);
  CHECK(std::all_of(shadow.begin(), shadow.end(), [](std::byte x) { return x == std::byte{2}; }));
}

TEST_CASE("kernels: the streaming copy of a prime copies every byte at any alignment and length, and nothing else") {
  std::mt19937_64 g(13);
  std::vector<std::byte> from(5000);
  for (auto& x : from) x = static_cast<std::byte>(g());
  for (std::size_t at : {0u, 1u, 7u, 15u, 16u, 33u})
    for (std::size_t from_at : {0u, 3u})
      for (std::size_t n : {0u, 1u, 15u, 63u, 64u, 65u, 200u, 4000u}) {
        CAPTURE(at);
        CAPTURE(from_at);
        CAPTURE(n);
        std::vector<std::byte> to(4100 + 64, std::byte{0x5A});
        delta::copy_streaming(to.data() + at, from.data() + from_at, n);
        bool ok = true;
        for (std::size_t j = 0; j < to.size(); ++j) ok &= to[j] == (j >= at && j < at + n ? from[from_at + j - at] : std::byte{0x5A});
        CHECK(ok);
      }
}

TEST_CASE("delta refits are bit-exact over every message kind, densities 0..100%, single and double-buffered") {
  const Layout& src = refit_test::message_kinds_src();
  const Layout& dst = refit_test::message_kinds_dst();
  std::int64_t chunks[delta::kChunkModes] = {};
  for (bool dbl : {false, true})
    for (double above : {0.25, 1.0}) {
      CAPTURE(dbl);
      CAPTURE(above);
      const auto r = run_versions(src, dst, sweep(), delta_options(dbl, above, 1, above > 0.5 ? 1.2 : 0.375));
      CHECK_MESSAGE(r.wrong == 0, r.first_wrong);
      REQUIRE(r.modes.size() == sweep().size());
      CHECK(r.modes[0] == "prime");
      if (!dbl) CHECK(r.modes[1] == "delta");
      for (int c = 0; c < delta::kChunkModes; ++c) chunks[c] += r.chunks[c];
      if (above > 0.5) {
        // Never dense once primed: every version (100% ones included) went as payloads.
        for (std::size_t k = dbl ? 2 : 1; k < r.modes.size(); ++k) CHECK(r.modes[k] == "delta");
      }
    }
  for (int c = 0; c < delta::kChunkModes; ++c) {
    CAPTURE(delta::to_string(static_cast<delta::ChunkMode>(c)));
    CHECK(chunks[c] > 0);  // every encoding was exercised
  }
}

TEST_CASE("a delta refit at density 0 moves almost nothing; the measured fraction follows the density") {
  const Layout& src = refit_test::message_kinds_src();
  const Layout& dst = refit_test::message_kinds_dst();
  const Densities d{1.0, 0.0, 0.01, 0.0};
  auto o = delta_options(false);
  o.delta.block_bytes = 128;  // (a payload moves in whole blocks; this model is tiny)
  const auto r = run_versions(src, dst, d, o);
  CHECK_MESSAGE(r.wrong == 0, r.first_wrong);
  REQUIRE(r.sent.size() == 4);
  CHECK(r.modes == std::vector<std::string>{"prime", "delta", "delta", "delta"});
  CHECK(r.sent[1] * 20 < r.sent[0]);
  CHECK(r.fraction[1] == 0.0);
  CHECK(r.fraction[2] < 0.05);
}

TEST_CASE("a refit the density sample sends dense skips the full diff and the base stays exact") {
  const Layout& src = refit_test::message_kinds_src();
  const Layout& dst = refit_test::message_kinds_dst();
  const Densities d{1.0, 0.6, 0.01, 0.0, 0.7, 0.8, 0.02, 0.0};
  // No streak: a sampled-dense refit keeps only the sampled positions of the
  // shadows; when the next sample finds the density low, that refit primes
  // the shadows whole (dense) and the one after is a delta.
  auto r = run_versions(src, dst, d, delta_options(false, 0.25, 0));
  CHECK_MESSAGE(r.wrong == 0, r.first_wrong);
  CHECK(r.modes == std::vector<std::string>{"prime", "sampled", "prime", "delta", "dense", "sampled", "prime", "delta"});
  CHECK(r.fraction[1] > 0.4);  // (the sample's estimate of 60%)
  CHECK(r.fraction[1] < 0.8);
  // A streak: the streak's last refit keeps the sampled positions; the next
  // refit samples and primes, as the density is low again.
  r = run_versions(src, dst, d, delta_options(false, 0.25, 1));
  CHECK_MESSAGE(r.wrong == 0, r.first_wrong);
  CHECK(r.modes == std::vector<std::string>{"prime", "sampled", "streak", "prime", "dense", "streak", "prime", "delta"});
  // Double-buffered: each set's own sample and base.
  r = run_versions(src, dst, d, delta_options(true, 0.25, 0));
  CHECK_MESSAGE(r.wrong == 0, r.first_wrong);
}

TEST_CASE("while the density stays high, no refit after the first primes the shadows") {
  // Only the sampled positions are kept between samples (about 1/256 of a
  // prime's copy); the full prime waits until a sample finds the density low.
  const Layout& src = refit_test::message_kinds_src();
  const Layout& dst = refit_test::message_kinds_dst();
  const Densities d{1.0, 0.6, 0.7, 0.8, 0.9, 0.5, 0.6, 0.01, 0.0, 0.02};
  auto r = run_versions(src, dst, d, delta_options(false, 0.25, 1));
  CHECK_MESSAGE(r.wrong == 0, r.first_wrong);
  CHECK(r.modes ==
        std::vector<std::string>{"prime", "sampled", "streak", "sampled", "streak", "sampled", "streak", "prime", "delta", "delta"});
  r = run_versions(src, dst, d, delta_options(false, 0.25, 0));
  CHECK_MESSAGE(r.wrong == 0, r.first_wrong);
  CHECK(r.modes ==
        std::vector<std::string>{"prime", "sampled", "sampled", "sampled", "sampled", "sampled", "sampled", "prime", "delta", "delta"});
  for (std::size_t k = 1; k < 7; ++k) CHECK(r.fraction[k] > 0.3);  // each sample measured against the version before
  // Without sampling nothing can measure the density but a full diff: a
  // streak ends in a full prime, as before.
  auto o = delta_options(false, 0.25, 1);
  o.delta.sample_every = 0;
  r = run_versions(src, dst, d, o);
  CHECK_MESSAGE(r.wrong == 0, r.first_wrong);
  CHECK(r.modes == std::vector<std::string>{"prime", "dense", "streak", "prime", "dense", "streak", "prime", "delta", "delta", "delta"});
  for (bool dbl : {false, true}) {
    r = run_versions(src, dst, d, delta_options(dbl, 0.25, 2));
    CHECK_MESSAGE(r.wrong == 0, r.first_wrong);
  }
}

TEST_CASE("delta refits are bit-exact over random layout pairs and a preset model") {
  for (std::uint64_t seed = 1; seed <= 12; ++seed) {
    testgen::RandomOptions ro;
    ro.max_world = 8;
    const auto pair = testgen::random_layout_pair(seed * 1009, ro);
    CAPTURE(pair.describe());
    const bool dbl = seed % 2 == 0;
    const auto r = run_versions(pair.src, pair.dst, sweep(), delta_options(dbl, seed % 3 == 0 ? 1.0 : 0.25, 1, 1.2));
    CHECK_MESSAGE(r.wrong == 0, r.first_wrong);
  }
  // tiny-llama: Megatron tp=2 -> vLLM tp=4 (fused qkv / gate_up, padded vocabulary).
  using namespace reshard::presets;
  const auto m = model_manifest(std::string(RESHARD_TEST_MODELS) + "/tiny-llama.json", true);
  const Layout src = megatron_layout(m, parse_parallel_spec("tp=2", "train"));
  const Layout dst = vllm_layout(m, parse_parallel_spec("tp=4", "infer"), 2, VllmOptions{});
  for (bool dbl : {false, true}) {
    CAPTURE(dbl);
    const auto r = run_versions(src, dst, {1.0, 0.003, 0.0, 0.02, 0.6, 0.001, 1.0, 0.004}, delta_options(dbl, 0.25, 1));
    CHECK_MESSAGE(r.wrong == 0, r.first_wrong);
  }
}

TEST_CASE("delta refits in slices of one chunk: bit-exact, and a slice past the capacity mid-pair sends the refit dense") {
  // tiny-llama Megatron tp=2 -> vLLM tp=4: about 13 chunks per pair, so each
  // pair's payload is a chain of slices, each found by the receiver from the
  // previous slice's header. At 100% and 50% changed the payload outgrows
  // the capacity after a few slices: the pair stops there and the refit
  // goes dense (dense_above 1 keeps the decision to the overflow).
  using namespace reshard::presets;
  const auto m = model_manifest(std::string(RESHARD_TEST_MODELS) + "/tiny-llama.json", true);
  const Layout src = megatron_layout(m, parse_parallel_spec("tp=2", "train"));
  const Layout dst = vllm_layout(m, parse_parallel_spec("tp=4", "infer"), 2, VllmOptions{});
  const Densities d{1.0, 0.01, 0.0, 1.0, 0.02, 0.5, 0.005, 0.001};
  for (bool dbl : {false, true})
    for (std::int64_t slice : {std::int64_t{1}, std::int64_t{3} * 2 * delta::kChunk}) {
      CAPTURE(dbl);
      CAPTURE(slice);
      auto o = delta_options(dbl, 1.0, 0);
      o.delta.slice_bytes = slice;
      o.executor.checksum = slice == 1;
      const auto r = run_versions(src, dst, d, o);
      CHECK_MESSAGE(r.wrong == 0, r.first_wrong);
      REQUIRE(r.modes.size() == d.size());
      const std::vector<std::string> want{"prime", "delta", "delta", "dense", "delta", "dense", "delta", "delta"};
      if (!dbl) CHECK_MESSAGE(r.modes == want, fmt::format("{}", fmt::join(r.modes, " ")));
      if (!dbl) CHECK(r.chunks[static_cast<int>(delta::ChunkMode::same)] > 0);
      CHECK(r.chunks[static_cast<int>(delta::ChunkMode::gap)] > 0);
    }
  // Streams of three element sizes in one pair, several slices each: every
  // slice diffs against its own part of the shadow (density 0 finds nothing).
  {
    const Layout ms = parse_layout(nlohmann::json::parse(R"({"mesh": {"axes": [["tp", 2]]}, "tensors": [
        {"name": "a", "shape": [400000], "dtype": "bf16", "dims": ["tp"]},
        {"name": "b", "shape": [300000], "dtype": "f32", "dims": ["tp"]},
        {"name": "c", "shape": [512, 600], "dtype": "i8", "dims": [null, "tp"]}]})"), "src");
    const Layout md = parse_layout(nlohmann::json::parse(R"({"mesh": {"axes": [["tp", 2]], "first_rank": 2}, "tensors": [
        {"name": "a", "shape": [400000], "dtype": "bf16", "dims": [null]},
        {"name": "b", "shape": [300000], "dtype": "f32", "dims": [null]},
        {"name": "c", "shape": [512, 600], "dtype": "i8", "dims": ["tp", null]}]})"), "dst");
    auto mo = delta_options(false, 0.25, 0);
    mo.delta.slice_bytes = 1;
    const auto r = run_versions(ms, md, {1.0, 0.0, 0.01, 0.0, 0.002}, mo);
    CHECK_MESSAGE(r.wrong == 0, r.first_wrong);
    CHECK(r.modes == std::vector<std::string>{"prime", "delta", "delta", "delta", "delta"});
    CHECK(r.fraction[1] == 0.0);
    CHECK(r.fraction[2] > 0.005);
    CHECK(r.fraction[2] < 0.015);
    CHECK(r.fraction[3] == 0.0);
  }
  // A corrupted first slice: the refit fails on every rank, the next is dense, and every version stays exact.
  auto o = delta_options(false, 0.25, 0);
  o.delta.slice_bytes = 1;
  const auto r = run_versions(src, dst, {1.0, 0.01, 0.02, 0.01, 0.02, 0.01}, o, 4);
  CHECK(r.failures == 1);
  CHECK_MESSAGE(r.wrong == 0, r.first_wrong);
  CHECK(r.modes[4] == "prime");
  CHECK(r.modes[5] == "delta");
}

TEST_CASE("delta refits through strided views (weights inside larger allocations) are bit-exact and touch nothing between elements") {
  // Every buffer of both sides a strided view: outer dims with a pitch, 1-d
  // buffers every other element (refit_test::StridedSide).
  const Layout& src = refit_test::message_kinds_src();
  const Layout& dst = refit_test::message_kinds_dst();
  for (bool dbl : {false, true})
    for (double above : {0.25, 1.0}) {
      CAPTURE(dbl);
      CAPTURE(above);
      const auto r = run_versions(src, dst, sweep(), delta_options(dbl, above, 1, above > 0.5 ? 1.2 : 0.375), 0, {}, true);
      CHECK_MESSAGE(r.wrong == 0, r.first_wrong);
      CHECK(std::count(r.modes.begin(), r.modes.end(), "delta") >= 4);
    }
  for (std::uint64_t seed = 1; seed <= 6; ++seed) {
    testgen::RandomOptions ro;
    ro.max_world = 8;
    const auto pair = testgen::random_layout_pair(seed * 7919, ro);
    CAPTURE(pair.describe());
    const auto r = run_versions(pair.src, pair.dst, sweep(), delta_options(seed % 2 == 0, 0.25, 1, 1.2), 0, {}, true);
    CHECK_MESSAGE(r.wrong == 0, r.first_wrong);
  }
  // A fault mid-sequence, through the views: the next refit is dense and exact.
  const Densities d{1.0, 0.01, 0.02, 0.01, 0.5, 0.01, 0.0};
  const auto r = run_versions(src, dst, d, delta_options(false, 0.25, 0), 4, {}, true);
  CHECK(r.failures == 1);
  CHECK_MESSAGE(r.wrong == 0, r.first_wrong);
}

TEST_CASE("a failed refit in the middle of a sequence: the next one is dense and every version stays exact") {
  const Layout& src = refit_test::message_kinds_src();
  const Layout& dst = refit_test::message_kinds_dst();
  for (bool dbl : {false, true})
    for (std::uint64_t at : {4u, 5u}) {
      CAPTURE(dbl);
      CAPTURE(at);
      // Version 4 is sparse (a delta payload is corrupted), version 5 dense at
      // 50% > dense_above (a dense message is corrupted).
      const Densities d{1.0, 0.01, 0.02, 0.01, 0.5, 0.01, 0.0, 0.03, 0.001};
      const auto r = run_versions(src, dst, d, delta_options(dbl, 0.25, 0), at);
      CHECK(r.failures == 1);
      CHECK_MESSAGE(r.wrong == 0, r.first_wrong);
      REQUIRE(r.modes.size() == d.size());
      // After setup() on a fresh transport every set starts dense (primed), then deltas again.
      CHECK(r.modes[at - 1].empty());  // not committed
      CHECK(r.modes[at] == "prime");
      if (dbl) CHECK(r.modes[at + 1] == "prime");
      CHECK(r.modes[dbl ? at + 2 : at + 1] == "delta");
    }
}

TEST_CASE("a destination written by someone else: the one rank that asks makes every rank's next refit dense") {
  const Layout& src = refit_test::message_kinds_src();
  const Layout& dst = refit_test::message_kinds_dst();
  const Densities d{1.0, 0.01, 0.02, 0.01, 0.03, 0.0, 0.02, 0.01};
  for (bool dbl : {false, true})
    for (std::uint64_t at : {2u, 5u}) {
      CAPTURE(dbl);
      CAPTURE(at);
      // Version 2 samples the density first (the first refit over a fresh
      // base): the request rides in the sample's all-gather and the refit
      // primes. Version 5 diffs at once: it rides in the counts' all-gather.
      const auto o = delta_options(dbl, 0.25, 0);
      auto r = run_versions(src, dst, d, o, 0, Overwrite{at, true});
      CHECK_MESSAGE(r.wrong == 0, r.first_wrong);
      REQUIRE(r.modes.size() == d.size());
      // Rank 0 reports every rank's decision (the overwritten rank is the last one).
      if (!dbl) {
        CHECK(r.modes[at - 1] == (at == 2 ? "prime" : "dense"));
        CHECK(r.modes[at] == "delta");
      } else {  // each set had its request: both refits after the write are dense
        CHECK(r.modes[at - 1] != "delta");
        CHECK(r.modes[at] != "delta");
        CHECK(r.modes[at + 1] == "delta");
      }
      // Without the request the next delta goes onto the overwritten base: the check sees it.
      r = run_versions(src, dst, d, o, 0, Overwrite{at, false});
      CHECK(r.wrong > 0);
    }
}

TEST_CASE("bad delta options are a clear error on every rank") {
  auto o = delta_options(false);
  o.delta.capacity = 0;
  std::string e;
  try {
    run_versions(refit_test::message_kinds_src(), refit_test::message_kinds_dst(), {1.0}, o);
  } catch (const std::exception& x) {
    e = x.what();
  }
  CHECK(e.find("DeltaOptions::capacity 0 is outside (0, 2]") != std::string::npos);
  o = delta_options(false);
  o.delta.slice_bytes = 0;
  e.clear();
  try {
    run_versions(refit_test::message_kinds_src(), refit_test::message_kinds_dst(), {1.0}, o);
  } catch (const std::exception& x) {
    e = x.what();
  }
  CHECK(e.find("DeltaOptions::slice_bytes 0 is below 1") != std::string::npos);
}
