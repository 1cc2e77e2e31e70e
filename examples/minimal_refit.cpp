// The smallest real refit: a training side tp=2 x dp=2 (ranks 0-3) to an
// inference side tp=4 (ranks 4-7), every rank a thread of this process on the
// in-process transport. Each rank allocates the buffers its layout lists,
// sources hold value(tensor, global index); after refit() every destination
// element is checked against that same formula.
#include <cstdio>
#include <vector>

#include <nlohmann/json.hpp>

#include "reshard/reshard.hpp"

int main() {
  // The layout file format (docs/layout-format.md): one f32 tensor, cut on dim 0 for training, on dim 1 for inference.
  const reshard::Layout train = reshard::parse_layout(nlohmann::json::parse(R"({
    "mesh": {"axes": [["dp", 2], ["tp", 2]], "first_rank": 0},
    "tensors": [{"name": "w", "shape": [1024, 512], "dtype": "f32", "dims": ["tp", null]}]})"), "train");
  const reshard::Layout infer = reshard::parse_layout(nlohmann::json::parse(R"({
    "mesh": {"axes": [["tp", 4]], "first_rank": 4},
    "tensors": [{"name": "w", "shape": [1024, 512], "dtype": "f32", "dims": [null, "tp"]}]})"), "infer");
  auto value = [](int tensor, std::int64_t g) { return static_cast<float>(tensor * 1'000'000 + g); };

  reshard::LocalWorld world({0, 1, 2, 3, 4, 5, 6, 7});
  std::vector<long> wrong(8, 0);
  world.run([&](reshard::LocalTransport& t) {
    const std::int64_t rank = t.rank();
    std::vector<std::vector<float>> src_memory, dst_memory;  // this rank's buffers
    reshard::LocalBuffers buffers;
    for (const auto& b : reshard::rank_buffers(train, rank)) {  // sources: each slot holds its element's value
      auto& m = src_memory.emplace_back(static_cast<std::size_t>(b.elements));
      reshard::for_each_slot_run(train, b, [&](std::int64_t at, std::int64_t n, int tensor, std::int64_t g) {
        for (std::int64_t i = 0; i < n; ++i) m[static_cast<std::size_t>(at + i)] = tensor < 0 ? 0.f : value(tensor, g + i);
      });
      buffers.src[b.name] = reshard::view_of(m.data(), m.size());
    }
    for (const auto& b : reshard::rank_buffers(infer, rank))
      buffers.dst[b.name] = reshard::view_of(dst_memory.emplace_back(static_cast<std::size_t>(b.elements), -1.f).data(), b.elements);

    auto resharder = reshard::make_resharder(train, infer, buffers, t);  // plans this rank's part, once
    const reshard::RefitReport report = resharder.refit();               // every RL step (collective)

    std::size_t k = 0;
    for (const auto& b : reshard::rank_buffers(infer, rank)) {
      const auto& m = dst_memory[k++];
      reshard::for_each_slot_run(infer, b, [&](std::int64_t at, std::int64_t n, int tensor, std::int64_t g) {
        for (std::int64_t i = 0; i < n; ++i)
          if (tensor >= 0 && m[static_cast<std::size_t>(at + i)] != value(tensor, g + i)) ++wrong[static_cast<std::size_t>(rank)];
      });
    }
    if (rank == 4)
      std::printf("rank 4 received %lld bytes in %.3f ms\n", static_cast<long long>(report.bytes_received), report.seconds * 1e3);
  });
  long total = 0;
  for (long x : wrong) total += x;
  std::printf("%s: %ld wrong elements\n", total == 0 ? "ok" : "FAILED", total);
  return total == 0 ? 0 : 1;
}
