// The delta refit's host kernels in isolation (delta.hpp), beside memcpy of
// the same bytes: diff-and-compact of a 256 MiB BF16 stream against its
// shadow (chunk by chunk, as the sender does) and the scatter of the changes
// into a 256 MiB destination, at a changed fraction spread at random.
//
//   delta-kernels-bench [--density 0.025] [--repeats 3]
//
// Each repeat prints memcpy GB/s, diff GB/s (of weight bytes; it also reads
// the shadow) with the kernel the sender picks (AVX-512 where the CPU has
// it) and with the portable one, and scatter GB/s (of destination bytes). Built against another
// commit's include/ (g++ -O3 -std=c++20 -I<that>/include ... -lfmt) it gives
// an A/B of the kernels on the same machine.
#include <chrono>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "reshard/exec/delta.hpp"
#include "reshard_support/clocks.hpp"

int main(int argc, char** argv) {
  using namespace reshard;
  double density = 0.025;
  int repeats = 3;
  CLI::App app{"delta-kernels-bench: the delta refit's diff and scatter kernels against memcpy"};
  app.add_option("--density", density, "changed fraction")->check(CLI::Range(0.0, 1.0));
  app.add_option("--repeats", repeats, "timed repeats")->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);
  const std::int64_t n = std::int64_t{128} << 20;  // BF16 elements: 256 MiB
  const auto bytes = static_cast<double>(n * 2);
  std::vector<std::uint16_t> cur(static_cast<std::size_t>(n)), shadow, dst;
  std::mt19937_64 g(1);
  for (auto& x : cur) x = static_cast<std::uint16_t>(g());
  shadow = cur;
  dst = cur;
  const auto threshold = static_cast<std::uint64_t>(density * 18446744073709551615.0);
  for (auto& x : cur)
    if (g() < threshold) x ^= 1;
  std::vector<std::byte> copy(static_cast<std::size_t>(n) * 2);
  std::vector<std::uint16_t> idx(static_cast<std::size_t>(n));  // every chunk's changes, for the scatter
  std::vector<std::byte> vals(static_cast<std::size_t>(n) * 2);
  std::vector<std::int64_t> first(static_cast<std::size_t>(n / delta::kChunk) + 1);
  delta::StreamSegment seg;
  seg.base = reinterpret_cast<std::byte*>(dst.data());
  const std::int64_t one = 1, none = 0;
  seg.assign(1, &n, &one, &none);
  seg.count = n;
  seg.contiguous = true;
  const std::vector<delta::StreamSegment> segs{seg};
  for (int r = 0; r < repeats; ++r) {
    std::vector<std::uint16_t> base = shadow;
    auto t0 = std::chrono::steady_clock::now();
    std::memcpy(copy.data(), cur.data(), copy.size());
    const double mc = reshard::clocks::seconds_since(t0);
    t0 = std::chrono::steady_clock::now();
    std::int64_t k = 0;
    for (std::int64_t c = 0, i = 0; c < n; c += delta::kChunk, ++i) {
      first[static_cast<std::size_t>(i)] = k;
      k += delta::diff_compact_bytes(2, reinterpret_cast<const std::byte*>(cur.data() + c), reinterpret_cast<std::byte*>(base.data() + c),
                                  delta::kChunk, idx.data() + k, vals.data() + 2 * k);
    }
    first.back() = k;
    const double df = reshard::clocks::seconds_since(t0);
    // The portable kernel on the same data (what CPUs without AVX-512 run).
    std::vector<std::uint16_t> base2 = shadow;
    t0 = std::chrono::steady_clock::now();
    std::int64_t k2 = 0;
    for (std::int64_t c = 0; c < n; c += delta::kChunk)
      k2 += delta::diff_compact<2>(reinterpret_cast<const std::byte*>(cur.data() + c), reinterpret_cast<std::byte*>(base2.data() + c),
                                   delta::kChunk, idx.data() + k2, vals.data() + 2 * k2);
    const double dp = reshard::clocks::seconds_since(t0);
    t0 = std::chrono::steady_clock::now();
    std::size_t cursor = 0;
    for (std::size_t i = 0; i + 1 < first.size(); ++i)
      delta::scatter<2>(segs, cursor, static_cast<std::int64_t>(i) * delta::kChunk, idx.data() + first[i], first[i + 1] - first[i],
                        vals.data() + 2 * first[i]);
    const double sc = reshard::clocks::seconds_since(t0);
    const bool exact = std::memcmp(base.data(), cur.data(), copy.size()) == 0 && std::memcmp(dst.data(), cur.data(), copy.size()) == 0 &&
                       k2 == k && std::memcmp(base2.data(), cur.data(), copy.size()) == 0;
    fmt::print("density {:.4f}: {} changed; memcpy {:.2f} GB/s, diff {:.2f} GB/s ({:.2f}x memcpy's time; portable kernel {:.2f} GB/s), "
               "scatter {:.2f} GB/s; {}\n",
               density, k, bytes / mc / 1e9, bytes / df / 1e9, df / mc, bytes / dp / 1e9, bytes / sc / 1e9,
               exact ? "shadows and destination exact" : "NOT EXACT");
    if (!exact) return 1;
  }
  return 0;
}
