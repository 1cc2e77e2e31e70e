// libFuzzer target: the planner. The bytes draw a valid layout pair
// (fuzz_layouts.hpp) and plan options; the plan must pass the element
// oracle (tests/oracle.hpp: complete, each element written once with the
// right value, no padding, in bounds, minimal), also when planned for one
// rank only.
#include <cstdint>
#include <string>

#include "fuzz_common.hpp"
#include "fuzz_layouts.hpp"
#include "oracle.hpp"
#include "reshard/plan/plan.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  fuzzgen::Bytes in(data, size);
  const auto pair = fuzzgen::layout_pair(in);
  if (!pair) return -1;  // not a valid pair: keep it out of the corpus
  reshard::PlanOptions opt;
  opt.split_bytes = in.pick(std::vector<std::int64_t>{64 * 1024, 1, 64, 512});
  opt.coalesce = !in.chance(64);
  oracle::CheckOptions co;
  if (in.chance(64)) {
    // One rank's plan: a rank of either mesh, or one in neither.
    auto ranks = pair->src.mesh.global_ranks();
    for (auto r : pair->dst.mesh.global_ranks()) ranks.push_back(r);
    ranks.push_back(*std::max_element(ranks.begin(), ranks.end()) + 1);
    opt.only_rank = co.only_rank = in.pick(ranks);
  }
  const std::string what = fmt::format("split_bytes {} coalesce {} only_rank {}\n{}", opt.split_bytes, opt.coalesce, opt.only_rank,
                                       pair->describe());
  reshard::Schedule s;
  try {
    s = reshard::plan(pair->src, pair->dst, opt);
  } catch (const std::exception& e) {
    fuzzgen::finding(fmt::format("plan threw on a valid pair: {}\n{}", e.what(), what));
  }
  const auto r = oracle::check_schedule(pair->src, pair->dst, s, co);
  if (!r.ok) fuzzgen::finding(fmt::format("the plan fails the oracle: {}\n{}", r.fault, what));
  return 0;
}
