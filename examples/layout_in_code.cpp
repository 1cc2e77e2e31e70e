// A layout written in code, read as the layout file would be
// (docs/layout-format.md): reshard::LayoutBuilder takes axes by name, dims as
// "tp", {"ep", "tp"} or nullptr, dtypes as "f32". Training tp=3 (ranks 0-2)
// cuts w on its rows; inference tp=2 (ranks 3-4) cuts it on its columns and
// holds [w_gate; w_up] fused in one buffer. Every rank is a thread of this
// process; after refit() every destination element is checked against a
// formula of its global row and column, written out here by hand.
#include <cstdio>
#include <vector>

#include "reshard/layout/layout_builder.hpp"
#include "reshard/reshard.hpp"

int main() {
  constexpr std::int64_t rows = 768, cols = 512;
  // {"mesh": {"axes": [["tp", 3]], "first_rank": 0},
  //  "tensors": [{"name": "w_gate", "shape": [768, 512], "dtype": "f32", "dims": ["tp", null]}, ... "w_up" ...]}
  const reshard::Layout train = reshard::LayoutBuilder({{"tp", 3}}, 0, "train (in code)")
                                    .tensor("w_gate", {rows, cols}, "f32", {"tp", nullptr})
                                    .tensor("w_up", {rows, cols}, "f32", {"tp", nullptr})
                                    .build();
  // {"mesh": {"axes": [["tp", 2]], "first_rank": 3},
  //  "tensors": [... "dims": [null, "tp"] ...], "buffers": [{"name": "w_gate_up", "kind": "concat", "parts": ["w_gate", "w_up"], "dim": 0}]}
  const reshard::Layout infer = reshard::LayoutBuilder({{"tp", 2}}, 3, "infer (in code)")
                                    .tensor("w_gate", {rows, cols}, "f32", {nullptr, "tp"})
                                    .tensor("w_up", {rows, cols}, "f32", {nullptr, "tp"})
                                    .concat("w_gate_up", {"w_gate", "w_up"}, 0)
                                    .build();
  // Element (row, col) of tensor t (0: w_gate, 1: w_up).
  auto value = [](int t, std::int64_t row, std::int64_t col) { return static_cast<float>(t * 1'000'000 + row * cols + col); };

  reshard::LocalWorld world({0, 1, 2, 3, 4});
  std::vector<long> wrong(5, 0);
  world.run([&](reshard::LocalTransport& t) {
    const std::int64_t rank = t.rank();
    std::vector<std::vector<float>> src_memory, dst_memory;
    reshard::LocalBuffers buffers;
    if (rank < 3) {  // training rank r holds rows [256 r, 256 r + 256) of each tensor, one buffer per tensor
      for (int tensor = 0; tensor < 2; ++tensor) {
        auto& m = src_memory.emplace_back(static_cast<std::size_t>(rows / 3 * cols));
        for (std::int64_t i = 0; i < rows / 3; ++i)
          for (std::int64_t c = 0; c < cols; ++c) m[static_cast<std::size_t>(i * cols + c)] = value(tensor, rank * (rows / 3) + i, c);
        buffers.src[tensor == 0 ? "w_gate" : "w_up"] = reshard::view_of(m.data(), m.size());
      }
    } else {  // inference rank 3 + q holds columns [256 q, 256 q + 256) of [w_gate; w_up], 1536 x 256
      auto& m = dst_memory.emplace_back(static_cast<std::size_t>(2 * rows * (cols / 2)), -1.f);
      buffers.dst["w_gate_up"] = reshard::view_of(m.data(), m.size());
    }

    auto resharder = reshard::make_resharder(train, infer, buffers, t);
    resharder.refit();

    if (rank >= 3) {
      const std::int64_t q = rank - 3;
      const auto& m = dst_memory[0];
      for (std::int64_t r = 0; r < 2 * rows; ++r)
        for (std::int64_t c = 0; c < cols / 2; ++c)
          if (m[static_cast<std::size_t>(r * (cols / 2) + c)] != value(r < rows ? 0 : 1, r % rows, q * (cols / 2) + c))
            ++wrong[static_cast<std::size_t>(rank)];
    }
  });
  long total = 0;
  for (long x : wrong) total += x;
  std::printf("%s: %ld wrong elements of %lld\n", total == 0 ? "ok" : "FAILED", total, static_cast<long long>(2 * 2 * rows * cols));
  return total == 0 ? 0 : 1;
}
