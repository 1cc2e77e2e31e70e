// StagedExecutor (staged_executor.hpp): hierarchical plans run on the
// in-process transport, every destination element checked against the
// oracle's slots after each of two runs, and the bytes moved equal to the
// plan's (network stage bytes plus the NVLink fan-out).
#include <doctest/doctest.h>

#include <mutex>

#include "random_layouts.hpp"
#include "refit_util.hpp"
#include "reshard/staged_executor.hpp"
#include "staged_oracle.hpp"

using namespace reshard;
using staged_oracle::small_topology;

namespace {

struct StagedRun {
  std::int64_t wrong = 0;
  std::string first_wrong;
  std::int64_t sent = 0, planned = 0;
};

/// Every rank runs `h` twice (new source values each time) and checks its
/// destination after each run.
StagedRun run_staged(const Layout& src, const Layout& dst, const StagedSchedule& h, ExecutorOptions opt) {
  StagedRun out;
  const auto ranks = refit_test::world_of(src, dst);
  const auto n = ranks.size();
  std::vector<refit_test::SideMemory> smem(n), dmem(n);
  for (std::size_t i = 0; i < n; ++i) {
    smem[i] = refit_test::make_side(src, ranks[i], true, 0);
    dmem[i] = refit_test::make_side(dst, ranks[i], false, 0);
  }
  std::mutex m;
  LocalWorld world(ranks);
  world.run([&](LocalTransport& t) {
    std::size_t i = 0;
    while (ranks[i] != t.rank()) ++i;
    const auto sb = refit_test::bound_buffers(src, t.rank(), smem[i]);
    const auto db = refit_test::bound_buffers(dst, t.rank(), dmem[i]);
    StagedExecutor<LocalTransport> ex;
    ex.setup(h, sb.pointers(), db.pointers(), t, opt);
    std::int64_t wrong = 0, sent = 0;
    std::string first;
    for (std::uint64_t salt : {0, 1}) {
      if (salt) {  // new values on the source side, poison on the destination side
        refit_test::write_side(src, smem[i], true, salt);
        refit_test::write_side(dst, dmem[i], false, salt);
      }
      sent += ex.run(salt + 1).bytes_sent;
      wrong += refit_test::count_wrong(dst, dmem[i], t.rank(), salt, first.empty() ? &first : nullptr);
    }
    std::lock_guard lk(m);
    out.wrong += wrong;
    if (!first.empty() && out.first_wrong.empty()) out.first_wrong = first;
    out.sent += sent;
    out.planned += 2 * ex.planned_bytes_sent();
  });
  return out;
}

std::int64_t remote_bytes(const StagedSchedule& h) {
  std::int64_t b = 0;
  for (const auto& c : h.schedule.copies) b += c.is_local() ? 0 : c.bytes();
  return b;
}

}  // namespace

TEST_CASE("hierarchical plans run stage by stage and write every destination element") {
  const std::vector<Topology> topos = {small_topology(2, 4, PlacementKind::separate), small_topology(1, 3, PlacementKind::launch),
                                       small_topology(4, 8, PlacementKind::separate), small_topology(2, 2, PlacementKind::launch)};
  int runs = 0, with_fan_out = 0;
  for (std::uint64_t seed = 1; seed <= 60; ++seed) {
    const auto pair = testgen::random_layout_pair(seed + 900);
    const Topology& topo = topos[seed % topos.size()];
    const RankPlacement place(topo, pair.src, pair.dst);
    HierarchicalOptions ho;
    ho.pipeline = 1 + static_cast<int>(seed % 3);
    const StagedSchedule h = plan_hierarchical(pair.src, pair.dst, place, ho);
    bool fans = false;
    for (std::size_t i = 0; i < h.schedule.copies.size(); ++i) fans |= h.reads_dst(i);
    with_fan_out += fans;
    ExecutorOptions opt;
    opt.staging_budget = seed % 2 ? std::int64_t{256} << 20 : 4096;  // one wave, or many
    opt.zero_copy_min = seed % 3 ? 64 * 1024 : 1;
    const StagedRun r = run_staged(pair.src, pair.dst, h, opt);
    INFO(topo.name << " pipeline " << ho.pipeline << " stages " << h.stages << "\n" << pair.describe());
    CHECK_MESSAGE(r.wrong == 0, r.first_wrong);
    CHECK(r.sent == r.planned);
    CHECK(r.sent == 2 * remote_bytes(h));
    ++runs;
  }
  MESSAGE("staged runs: " << runs << ", with fan-out copies: " << with_fan_out);
  CHECK(with_fan_out > 10);
}

TEST_CASE("a staged schedule whose stage list does not match its copies is refused") {
  const auto pair = testgen::random_layout_pair(7);
  const RankPlacement place(small_topology(2, 4, PlacementKind::separate), pair.src, pair.dst);
  StagedSchedule h = plan_hierarchical(pair.src, pair.dst, place, HierarchicalOptions{});
  REQUIRE(!h.schedule.copies.empty());
  h.stage.assign(h.schedule.copies.size() + 1, 0);
  const auto ranks = refit_test::world_of(pair.src, pair.dst);
  LocalWorld world(ranks);
  std::mutex m;
  int refused = 0;
  world.run([&](LocalTransport& t) {
    StagedExecutor<LocalTransport> ex;
    try {
      ex.setup(h, {}, {}, t);
    } catch (const Error& e) {
      if (std::string(e.what()).find("stage entries") != std::string::npos) {
        std::lock_guard lk(m);
        ++refused;
      }
    }
  });
  CHECK(refused == static_cast<int>(ranks.size()));
}
