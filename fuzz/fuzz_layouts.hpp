#pragma once
// Valid layout pairs drawn from fuzz bytes, for the planner and replay
// fuzzers, by the property tests' generator (tests/random_layouts.hpp): one
// generator for tests and fuzzers.
//
//   fuzzgen::Bytes in(data, size);
//   auto pair = fuzzgen::layout_pair(in);   // std::nullopt: the bytes drew an invalid draft
//
// Two ways, chosen by the first byte, after generator options from the bytes:
// - from bytes: the generator draws every decision (mesh axes, which axis
//   digit cuts which dim, split kind, padding, stage, concat / flat buffers,
//   rank placement) from the next byte, so a mutation of one byte changes one
//   decision and libFuzzer's coverage feedback can steer the structure;
// - seeded: a seed from the bytes, the generator's own random numbers.
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
#include "reshard/layout/layout.hpp"

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
class Bytes : public testgen::Decisions<Bytes> {
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
  /// True with probability about p/256.
  bool chance(int p) { return byte() < p; }
  /// True with probability about p (the generator's call).
  bool chance(double p) { return byte() < static_cast<int>(p * 256); }
  std::uint64_t u64() {
    std::uint64_t v = 0;
    for (int k = 0; k < 8; ++k) v = v << 8 | byte();
    return v;
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

/// A valid layout pair from fuzz bytes, or nullopt when the draft is not a
/// valid pair. `max_world`: mesh positions per side at most.
inline std::optional<Pair> layout_pair(Bytes& in, std::int64_t max_world = 12) {
  const bool seeded = in.byte() & 1;
  const std::uint64_t seed = seeded ? in.u64() : 0;
  const auto o = seeded_options(in, max_world);
  std::optional<testgen::RandomLayoutPair> g;
  if (seeded) {
    g = testgen::random_layout_pair(seed, o);
  } else {
    g = testgen::draft_layout_pair(in, o);  // every decision one byte (two for choices over 256)
    if (!g) return std::nullopt;
  }
  Pair p;
  p.src = std::move(g->src);
  p.dst = std::move(g->dst);
  p.how = fmt::format("{} (max_axes {} max_world {} max_tensors {} max_elements {} max_rank {} buffers {} stages {} cyclic {} padding {}), {}",
                      seeded ? fmt::format("seeded {}", seed) : std::string("from bytes"), o.max_axes, o.max_world, o.max_tensors,
                      o.max_elements, o.max_tensor_rank, o.buffers, o.stages, o.cyclic, o.padding, g->ranks);
  return p;
}

}  // namespace fuzzgen
