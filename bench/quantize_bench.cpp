// The host FP8 quantize kernel's rate (quantize_tiles, block scheme, 128x128
// tiles of BF16), the figure behind the loopback preset's quantize_gbps
// (include/reshard/plan/topology.hpp; docs/measurements.md, netbed).
//
//   quantize-bench [--mib 400] [--cols 2048] [--repeats 5]
//
// Prints per repeat the FP8 bytes produced per second (= elements/s), in
// GB/s and Gb/s. Run two at once to see what two senders sharing the cores
// and the memory get (the netbed fp8 case).
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "reshard/base/float_convert.hpp"
#include "reshard/layout/quantize.hpp"

int main(int argc, char** argv) {
  std::int64_t mib = 400, cols = 2048;
  int repeats = 5;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--mib")
      mib = std::stoll(argv[i + 1]);
    else if (a == "--cols")
      cols = std::stoll(argv[i + 1]);
    else if (a == "--repeats")
      repeats = std::stoi(argv[i + 1]);
    else {
      std::fprintf(stderr, "quantize-bench: unknown option %s (--mib N --cols N --repeats N)\n", a.c_str());
      return 2;
    }
  }
  constexpr std::int64_t T = 128;
  if (cols % T != 0 || mib < 1 || repeats < 1) {
    std::fprintf(stderr, "quantize-bench: --cols must be a multiple of 128, --mib and --repeats positive\n");
    return 2;
  }
  const std::int64_t rows = ((mib << 20) / 2 / cols) / T * T, n = rows * cols;
  std::vector<std::uint16_t> src(static_cast<std::size_t>(n));
  std::mt19937_64 rng(1);
  std::normal_distribution<float> normal(0.0f, 0.02f);  // the Llama init's spread
  for (auto& v : src) {
    const float x = normal(rng);
    std::uint32_t b;
    std::memcpy(&b, &x, 4);
    v = static_cast<std::uint16_t>(b >> 16);
  }
  std::vector<std::uint8_t> dst(static_cast<std::size_t>(n));
  // The compiled tiles, as QuantRefit replays them: (offset, count) per row of each tile.
  std::vector<std::int64_t> runs;
  std::vector<reshard::TileEnd> tiles;
  for (std::int64_t ti = 0; ti < rows / T; ++ti)
    for (std::int64_t tj = 0; tj < cols / T; ++tj) {
      for (std::int64_t r = 0; r < T; ++r) {
        runs.push_back((ti * T + r) * cols + tj * T);
        runs.push_back(T);
      }
      tiles.push_back({runs.size() / 2, static_cast<std::int64_t>(tiles.size()) * 4});
    }
  std::vector<std::byte> scales(tiles.size() * 4);
  for (int k = 0; k <= repeats; ++k) {  // k = 0: warm-up (first touch of dst)
    const auto t0 = std::chrono::steady_clock::now();
    reshard::quantize_tiles(reshard::QuantScheme::block, reshard::DType::bf16, reinterpret_cast<const std::byte*>(src.data()), dst.data(),
                            runs.data(), tiles.data(), tiles.size(), scales.data());
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (k > 0)
      std::printf("repeat %d: %lld FP8 bytes from %lld MiB of BF16 in %.4f s: %.2f GB/s = %.1f Gb/s\n", k, static_cast<long long>(n),
                  static_cast<long long>(n * 2 >> 20), s, static_cast<double>(n) / s / 1e9, static_cast<double>(n) * 8 / s / 1e9);
  }
  return 0;
}
