// StagedExecutor (staged_executor.hpp): hierarchical plans run on the
// in-process transport, every destination element checked against the
// oracle's slots after each of two runs, and the bytes moved equal to the
// plan's (network stage bytes plus the NVLink fan-out). Then the same through
// Resharder (ResharderOptions::staged): versioned commits over several
// versions, single- and double-buffered, failed refits reported stale (never
// success), and staged schedules of other layouts refused.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <set>

#include "random_layouts.hpp"
#include "refit_util.hpp"
#include "reshard/exec/staged_executor.hpp"
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
  refit_test::DenseWorld w(src, dst);
  auto& smem = w.src_mem;
  auto& dmem = w.dst_mem;
  std::mutex m;
  w.run(src, dst, [&](LocalTransport& t, std::size_t i, auto sb, auto db) {
    StagedExecutor<LocalTransport> ex;
    ex.setup(h, sb, db, t, opt);
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

const std::vector<Topology>& topologies() {
  static const std::vector<Topology> t = {small_topology(2, 4, PlacementKind::separate), small_topology(1, 3, PlacementKind::launch),
                                          small_topology(4, 8, PlacementKind::separate), small_topology(2, 2, PlacementKind::launch)};
  return t;
}

/// A random layout pair (seed + 900) planned hierarchically on one of the
/// topologies (seed mod 4) with `pipeline` network chunks.
struct StagedCase {
  testgen::RandomLayoutPair pair;
  const Topology* topo;
  int pipeline;
  StagedSchedule h;
  std::string label() const { return fmt::format("{} pipeline {} stages {}", topo->name, pipeline, h.stages); }
  /// Whether a copy reads a destination that an earlier stage wrote (fans it
  /// out); network_only: a copy between two ranks.
  bool fans_out(bool network_only = false) const {
    for (std::size_t i = 0; i < h.schedule.copies.size(); ++i)
      if (h.reads_dst(i) && !(network_only && h.schedule.copies[i].is_local())) return true;
    return false;
  }
};
StagedCase staged_case(std::uint64_t seed, int pipeline) {
  auto pair = testgen::random_layout_pair(seed + 900);
  const Topology& topo = topologies()[seed % topologies().size()];
  HierarchicalOptions ho;
  ho.pipeline = pipeline;
  auto h = plan_hierarchical(pair.src, pair.dst, RankPlacement(topo, pair.src, pair.dst), ho);
  return StagedCase{std::move(pair), &topo, pipeline, std::move(h)};
}

std::int64_t remote_bytes(const StagedSchedule& h) {
  std::int64_t b = 0;
  for (const auto& c : h.schedule.copies) b += c.is_local() ? 0 : c.bytes();
  return b;
}

}  // namespace

TEST_CASE("hierarchical plans run stage by stage and write every destination element") {
  constexpr int kRuns = 60;
  int with_fan_out = 0;
  for (std::uint64_t seed = 1; seed <= kRuns; ++seed) {
    const auto sc = staged_case(seed, 1 + static_cast<int>(seed % 3));
    const auto& pair = sc.pair;
    const StagedSchedule& h = sc.h;
    with_fan_out += sc.fans_out();
    ExecutorOptions opt;
    opt.staging_budget = seed % 2 ? std::int64_t{256} << 20 : 4096;  // one wave, or many
    opt.zero_copy_min = seed % 3 ? 64 * 1024 : 1;
    const StagedRun r = run_staged(pair.src, pair.dst, h, opt);
    INFO(sc.label() << "\n" << pair.describe());
    CHECK_MESSAGE(r.wrong == 0, r.first_wrong);
    CHECK(r.sent == r.planned);
    CHECK(r.sent == 2 * remote_bytes(h));
  }
  MESSAGE("staged runs: " << kRuns << ", with fan-out copies: " << with_fan_out);
  CHECK(with_fan_out > 10);
}

TEST_CASE("a staged refit holds one staging budget in all, as the transport sees it") {
  // Every stage's Executor keeps its staging while the StagedExecutor lives,
  // so the budget bounds what all stages allocate together: measured as the
  // memory the ranks registered beyond their buffers, and equal to the
  // staging the run reports.
  constexpr std::int64_t kBudget = 4096;
  int cases = 0, staged_in_two = 0;
  for (std::uint64_t seed = 1; seed <= 40; ++seed) {
    const auto sc = staged_case(seed, 2);
    if (sc.h.stages < 2) continue;
    ExecutorOptions opt;
    opt.staging_budget = kBudget;
    opt.zero_copy_min = 64 * 1024;  // most pieces packed: every stage stages
    refit_test::DenseWorld w(sc.pair.src, sc.pair.dst);
    std::mutex m;
    std::int64_t most = 0, wrong = 0, disagree = 0, two = 0;
    std::string first;
    w.run(sc.pair.src, sc.pair.dst, [&](LocalTransport& t, std::size_t i, auto sb, auto db) {
      StagedExecutor<LocalTransport> ex;
      ex.setup(sc.h, sb, db, t, opt);
      const std::int64_t held = refit_test::registered_outside(t, {&w.src_mem[i], &w.dst_mem[i]});
      const ExecutorStats st = ex.run(1);
      std::string f;
      const auto bad = refit_test::count_wrong(sc.pair.dst, w.dst_mem[i], t.rank(), 0, &f);
      int staging_stages = 0;
      for (int k = 0; k < ex.stages(); ++k) staging_stages += ex.stage(k).staging_bytes() > 0;
      std::lock_guard lk(m);
      most = std::max(most, held);
      wrong += bad;
      if (first.empty()) first = f;
      disagree += held != st.staging_bytes;
      two += staging_stages >= 2;
    });
    INFO(sc.label() << "\n" << sc.pair.describe());
    CHECK_MESSAGE(wrong == 0, first);
    CHECK(most <= kBudget);
    CHECK(disagree == 0);
    ++cases;
    staged_in_two += two > 0;
  }
  MESSAGE("staged cases: " << cases << ", with a rank staging in two stages or more: " << staged_in_two);
  CHECK(cases >= 10);
  CHECK(staged_in_two >= 5);
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

// --- staged schedules through Resharder (ResharderOptions::staged) -----------

namespace {

using FT = FaultInjectingTransport<LocalTransport>;
using StagedResharder = Resharder<Layout, FT>;

/// One rank's history over a run of versioned staged refits.
struct StagedRank {
  std::int64_t rank = -1;
  std::vector<std::string> errors;   ///< per refit attempted: "" when it committed
  std::vector<std::int64_t> wrong;   ///< per committed refit: wrong elements of the set it published
  std::vector<RefitReport> reports;  ///< per committed refit
  std::string first_wrong;
  RefitState state = RefitState::empty;
  std::uint64_t last_good = 0;
  int serving = 0;
  std::vector<std::string> stale;
  std::optional<StaleReport> failure;
  std::set<std::string> wrong_tensors;  ///< after a failure: tensors of the written set not at the failed version
  std::string writes_wrong;             ///< after a failure: where its DestinationWrites misname the written set
  std::int64_t served_wrong = 0;        ///< at the end: served set elements not at last_good
  std::int64_t compiles = 0, stages = 0;
};

/// Destination tensors of `m` with an element that is not its tag at `salt`.
std::set<std::string> wrong_tensors(const Layout& L, const refit_test::SideMemory& m, std::uint64_t salt) {
  std::set<std::string> out;
  refit_test::for_each_held_slot(m, [&](std::size_t, std::size_t, const oracle::Slot& s, const std::byte* p, std::size_t E) {
    if (s.padding()) return;
    const auto& name = L.tensors[static_cast<std::size_t>(s.tensor)].name;
    const std::uint64_t v = refit_test::tag(refit_test::name_hash(name), s.index, salt);
    if (std::memcmp(p, &v, E) != 0) out.insert(name);
  });
  return out;
}

/// Every rank refits `refits` versions of src -> dst through a Resharder
/// running `h` (new source values each time: salt = refit number, the set
/// being written poisoned first), stopping at its first failure.
std::vector<StagedRank> staged_refits(const Layout& src, const Layout& dst, const StagedSchedule& h, ResharderOptions opt, int refits,
                                      FaultPlan& faults) {
  opt.staged = std::make_shared<const StagedSchedule>(h);
  const auto ranks = refit_test::world_of(src, dst);
  const auto n = ranks.size();
  std::vector<refit_test::SideMemory> smem(n), dmem(n), bmem(n);
  for (std::size_t i = 0; i < n; ++i) {
    smem[i] = refit_test::make_side(src, ranks[i], true, 0);
    dmem[i] = refit_test::make_side(dst, ranks[i], false, 0);
    bmem[i] = refit_test::make_side(dst, ranks[i], false, 0);
  }
  std::vector<StagedRank> out(n);
  LocalWorld world(ranks);
  world.run([&](LocalTransport& inner) {
    std::size_t i = 0;
    while (ranks[i] != inner.rank()) ++i;
    StagedRank& me = out[i];
    me.rank = inner.rank();
    FT t(inner, faults);
    LocalBuffers bufs;
    bufs.src = refit_test::views(src, smem[i]);
    bufs.dst = refit_test::views(dst, dmem[i]);
    if (opt.double_buffered) bufs.dst_back = refit_test::views(dst, bmem[i]);
    auto set = [&](int s) -> refit_test::SideMemory& { return s == 0 ? dmem[i] : bmem[i]; };
    StagedResharder r(src, dst, bufs, t, opt);
    for (int k = 0; k < refits; ++k) {
      const auto salt = static_cast<std::uint64_t>(k);
      const int target = opt.double_buffered ? 1 - r.serving_set() : 0;
      refit_test::write_side(src, smem[i], true, salt);
      refit_test::write_side(dst, set(target), false, salt);
      try {
        me.reports.push_back(r.refit());
        me.errors.emplace_back();
        std::string first;
        me.wrong.push_back(refit_test::count_wrong(dst, set(r.serving_set()), me.rank, salt, &first));
        if (me.first_wrong.empty()) me.first_wrong = first;
      } catch (const RefitNotCommitted& e) {
        me.errors.emplace_back(e.what());
        me.wrong_tensors = wrong_tensors(dst, set(target), salt);
        // The set being written held its poison (write_side above) before this refit.
        auto value = [salt](std::uint64_t h, std::int64_t x, std::uint64_t v) {
          return v == salt ? refit_test::tag(h, x, salt) : ~refit_test::tag(h, x, salt);
        };
        me.writes_wrong = refit_test::check_writes(dst, set(target), e.writes(), salt, salt + 1, value);
        break;
      }
    }
    me.state = r.state();
    me.last_good = r.last_good_version();
    me.serving = r.serving_set();
    me.stale = r.stale_tensors();
    me.failure = r.last_failure();
    if (me.last_good > 0) me.served_wrong = refit_test::count_wrong(dst, set(me.serving), me.rank, me.last_good - 1, nullptr);
    me.compiles = r.staged_executor(0).compiles();
    me.stages = r.staged_executor(0).stages();
  });
  return out;
}

ResharderOptions staged_options(bool double_buffered, bool checksum = false) {
  ResharderOptions o;
  o.double_buffered = double_buffered;
  o.executor.checksum = checksum;
  o.executor.timeout = std::chrono::milliseconds(3000);  // refits here must commit, also under a sanitizer on a loaded machine
  return o;
}

/// A fault that fails a fan-out: every data message into a fan-out owner
/// carrying a piece it later copies on to a member of its domain (the
/// earliest such stage), corrupted in refit `replay` (checksums catch it).
struct FanOutFault {
  std::int64_t from = -1, owner = -1, member = -1;
  std::int32_t stage = 0;  ///< the owner's receive (channel = base + stage)
  std::string tensor;
};
std::optional<FanOutFault> fan_out_fault(const StagedSchedule& h, const Layout& dst) {
  std::optional<FanOutFault> best;
  const auto& cs = h.schedule.copies;
  for (std::size_t f = 0; f < cs.size(); ++f) {
    if (!h.reads_dst(f) || cs[f].is_local()) continue;
    for (std::size_t j = 0; j < cs.size(); ++j) {
      const Copy& c = cs[j];
      if (h.reads_dst(j) || c.is_local() || c.dst_rank != cs[f].src_rank || c.tensor != cs[f].tensor || h.stage_of(j) >= h.stage_of(f))
        continue;
      if (best && best->stage <= h.stage_of(j)) continue;
      best = FanOutFault{c.src_rank, c.dst_rank, cs[f].dst_rank, h.stage_of(j), dst.tensors[static_cast<std::size_t>(c.tensor)].name};
    }
  }
  return best;
}
FaultRule corrupt_into_owner(const FanOutFault& f, std::uint64_t channel, std::int64_t replay) {
  return FaultRule::when(
      FaultKind::corrupt_arrived,
      [f, channel, replay](const MessageInfo& m) {
        return m.from == f.from && m.to == f.owner && m.replay == replay && !(m.tag & kChecksumTagBit) && (m.tag >> 48) == channel;
      },
      -1);
}

bool contains(const std::vector<std::string>& v, const std::string& s) { return std::find(v.begin(), v.end(), s) != v.end(); }

/// On this rank refit 1 committed, exact, and refit 2 failed with an error
/// that says `what`, leaving the last good version at 1.
void check_second_refit_failed(const StagedRank& r, const std::string& what) {
  REQUIRE(r.errors.size() == 2);  // version 1 commits, version 2 fails on every rank, none goes on
  CHECK(r.errors[0].empty());
  CHECK(r.wrong[0] == 0);
  CAPTURE(r.errors[1]);
  CHECK(r.errors[1].find(what) != std::string::npos);
  CHECK(r.last_good == 1);
  REQUIRE(r.failure.has_value());
  CHECK_MESSAGE(r.writes_wrong.empty(), r.writes_wrong);  // what the failure says each buffer holds, it holds
}

}  // namespace

TEST_CASE("Resharder runs staged schedules: every element over each version, single- and double-buffered") {
  int runs = 0, with_fan_out = 0;
  for (std::uint64_t seed = 1; seed <= 30; ++seed) {
    const auto sc = staged_case(seed, 1 + static_cast<int>(seed % 3));
    const auto& pair = sc.pair;
    const StagedSchedule& h = sc.h;
    with_fan_out += sc.fans_out(/*network_only=*/true);
    for (bool double_buffered : {false, true}) {
      ResharderOptions opt = staged_options(double_buffered, seed % 4 == 0);
      opt.executor.staging_budget = seed % 2 ? std::int64_t{256} << 20 : 4096;  // one wave, or many
      opt.executor.zero_copy_min = seed % 3 ? 64 * 1024 : 1;
      // Double-buffered: back, front, back again (each set written and read by its fan-out).
      const int refits = double_buffered ? 3 : 2;
      FaultPlan none;
      const auto out = staged_refits(pair.src, pair.dst, h, opt, refits, none);
      INFO(sc.label() << " double_buffered " << double_buffered << "\n" << pair.describe());
      std::int64_t sent = 0;
      for (const auto& r : out) {
        CAPTURE(r.rank);
        REQUIRE(r.errors.size() == static_cast<std::size_t>(refits));
        for (const auto& e : r.errors) CHECK_MESSAGE(e.empty(), e);
        for (auto w : r.wrong) CHECK_MESSAGE(w == 0, r.first_wrong);
        for (std::size_t k = 0; k < r.reports.size(); ++k) {
          CHECK(r.reports[k].version == k + 1);
          CHECK(r.reports[k].bytes_sent == r.reports[k].plan_bytes_sent);
          if (!opt.executor.checksum) CHECK(r.reports[k].bytes_received == r.reports[k].plan_bytes_received);  // (+ control messages)
          CHECK(r.reports[k].serving_set == (double_buffered ? static_cast<int>(k % 2 == 0) : 0));
          sent += r.reports[k].bytes_sent;
        }
        CHECK(r.state == RefitState::current);
        CHECK(r.last_good == static_cast<std::uint64_t>(refits));
        CHECK(r.served_wrong == 0);
        CHECK(r.compiles == r.stages);  // compiled once at setup, replayed
        CHECK(r.stages == std::max(h.stages, 1));
      }
      CHECK(sent == refits * remote_bytes(h));
      ++runs;
    }
  }
  MESSAGE("staged Resharder runs: " << runs << ", pairs with network fan-out copies: " << with_fan_out);
  CHECK(with_fan_out > 5);
}

TEST_CASE("a failed staged refit is not committed: the destination is stale and names what is missing") {
  int cases = 0, later_stage = 0;
  for (std::uint64_t seed = 1; seed <= 80 && cases < 8; ++seed) {
    const auto sc = staged_case(seed, 2 + static_cast<int>(seed % 3));
    const auto& pair = sc.pair;
    const StagedSchedule& h = sc.h;
    const auto fault = fan_out_fault(h, pair.dst);
    if (!fault) continue;
    ++cases;
    later_stage += fault->stage + 1 < h.stages;
    FaultPlan plan;
    plan.add(corrupt_into_owner(*fault, static_cast<std::uint64_t>(fault->stage), 1));  // refit 2 (version 2)
    const auto out = staged_refits(pair.src, pair.dst, h, staged_options(false, true), 3, plan);
    INFO(sc.label() << ": rank " << fault->from << " -> owner " << fault->owner
                   << " stage " << fault->stage << ", member " << fault->member << ", tensor " << fault->tensor << "\n"
                   << pair.describe());
    CHECK_FALSE(plan.injected().empty());
    for (const auto& r : out) {
      CAPTURE(r.rank);
      check_second_refit_failed(r, "refit version 2 not committed: ");
      CHECK(r.state == RefitState::stale);
      CHECK(r.failure->version == 2);
      CHECK(r.failure->destination_touched);
      // Every tensor not at version 2 here is named stale (the stages after
      // the failed one count as missing).
      for (const auto& w : r.wrong_tensors) CHECK_MESSAGE(contains(r.stale, w), w << " is not at version 2 but not named stale");
      if (r.rank == fault->owner || r.rank == fault->member) CHECK(contains(r.stale, fault->tensor));
    }
  }
  MESSAGE("failed staged refits: " << cases << ", failing before the last stage: " << later_stage);
  CHECK(cases >= 4);
}

TEST_CASE("double-buffered staged refits: a failed refit keeps the served set current and intact") {
  int cases = 0;
  for (std::uint64_t seed = 1; seed <= 80 && cases < 4; ++seed) {
    const auto sc = staged_case(seed, 2);
    const auto& pair = sc.pair;
    const StagedSchedule& h = sc.h;
    const auto fault = fan_out_fault(h, pair.dst);
    if (!fault) continue;
    ++cases;
    FaultPlan plan;
    // Version 1 goes to the back set (channels | 0x8000), version 2 to the
    // front set, whose channels carry it for the first time (replay 0).
    plan.add(corrupt_into_owner(*fault, static_cast<std::uint64_t>(fault->stage), 0));
    const auto out = staged_refits(pair.src, pair.dst, h, staged_options(true, true), 3, plan);
    INFO(sc.label() << "\n" << pair.describe());
    CHECK_FALSE(plan.injected().empty());
    for (const auto& r : out) {
      CAPTURE(r.rank);
      check_second_refit_failed(r, "refit version 2 not committed; the served destination keeps version 1");
      CHECK(r.state == RefitState::current);
      CHECK(r.serving == 1);
      CHECK(r.served_wrong == 0);  // the back set, all of version 1
      CHECK_FALSE(r.failure->destination_touched);
      CHECK(r.stale.empty());
    }
  }
  CHECK(cases >= 2);
}

TEST_CASE("a staged schedule of other layouts is refused on every rank, naming why") {
  const auto pair = testgen::random_layout_pair(901);
  auto names = [](const Layout& L) {
    std::vector<std::string> v;
    for (const auto& b : L.local_buffers()) v.push_back(b.name);
    return v;
  };
  // Another pair whose destination buffers are not these.
  std::uint64_t other_seed = 902;
  while (names(testgen::random_layout_pair(other_seed).dst) == names(pair.dst)) ++other_seed;
  const auto other = testgen::random_layout_pair(other_seed);
  const RankPlacement place(small_topology(2, 4, PlacementKind::separate), pair.src, pair.dst);
  const StagedSchedule h = plan_hierarchical(pair.src, pair.dst, place, HierarchicalOptions{});
  REQUIRE(!h.schedule.copies.empty());
  const auto ranks = refit_test::world_of(pair.src, pair.dst);
  auto errors_with = [&](const std::function<void(ResharderOptions&)>& edit) {
    std::vector<std::string> errors(ranks.size());
    std::vector<refit_test::SideMemory> s, d;
    for (auto r : ranks) {
      s.push_back(refit_test::make_side(pair.src, r, true, 0));
      d.push_back(refit_test::make_side(pair.dst, r, false, 0));
    }
    LocalWorld world(ranks);
    std::mutex m;
    world.run([&](LocalTransport& t) {
      const std::size_t i = refit_test::index_of(ranks, t.rank());
      LocalBuffers b;
      b.src = refit_test::views(pair.src, s[i]);
      b.dst = refit_test::views(pair.dst, d[i]);
      ResharderOptions o = staged_options(false);
      o.staged = std::make_shared<const StagedSchedule>(h);
      edit(o);
      std::string e = "(no error)";
      try {
        Resharder<Layout, LocalTransport> r(pair.src, pair.dst, b, t, o);
      } catch (const std::exception& ex) {
        e = ex.what();
      }
      std::lock_guard lk(m);
      errors[i] = e;
    });
    return errors;
  };
  auto all_say = [&](const std::vector<std::string>& errors, const std::string& what) {
    for (const auto& e : errors) {
      CAPTURE(e);
      CHECK(e.find(what) != std::string::npos);
    }
  };
  {  // the schedule of another pair's layouts
    const RankPlacement p2(small_topology(2, 4, PlacementKind::separate), other.src, other.dst);
    const auto h2 = std::make_shared<const StagedSchedule>(plan_hierarchical(other.src, other.dst, p2, HierarchicalOptions{}));
    all_say(errors_with([&](ResharderOptions& o) { o.staged = h2; }), "the staged schedule is not of these layouts");
  }
  all_say(errors_with([&](ResharderOptions& o) {
            auto e = std::make_shared<StagedSchedule>(h);
            e->schedule.dst_buffers.back() += ".renamed";
            o.staged = e;
          }),
          "destination buffer #");
  all_say(errors_with([&](ResharderOptions& o) {
            auto e = std::make_shared<StagedSchedule>(h);
            e->schedule.copies[0].dst_buffer = 999;
            o.staged = e;
          }),
          "copy 0 (stage");
  all_say(errors_with([&](ResharderOptions& o) {
            auto e = std::make_shared<StagedSchedule>(h);
            e->stage.assign(e->schedule.copies.size() + 1, 0);
            o.staged = e;
          }),
          "stage and");
  all_say(errors_with([&](ResharderOptions& o) { o.schedule = std::make_shared<const Schedule>(h.schedule); }),
          "ResharderOptions::schedule and ResharderOptions::staged are both set");
}

TEST_CASE("after a failed staged refit, setup() on a fresh transport lets the next version commit") {
  std::optional<testgen::RandomLayoutPair> pair;
  std::optional<StagedSchedule> h;
  std::optional<FanOutFault> fault;
  for (std::uint64_t seed = 1; seed <= 80 && !fault; ++seed) {
    auto sc = staged_case(seed, HierarchicalOptions{}.pipeline);
    fault = fan_out_fault(sc.h, sc.pair.dst);
    pair = std::move(sc.pair);
    h = std::move(sc.h);
  }
  REQUIRE(fault.has_value());
  const Layout &src = pair->src, &dst = pair->dst;
  ResharderOptions opt = staged_options(false, true);
  opt.staged = std::make_shared<const StagedSchedule>(*h);
  const auto ranks = refit_test::world_of(src, dst);
  const auto n = ranks.size();
  std::vector<refit_test::SideMemory> smem(n), dmem(n);
  for (std::size_t i = 0; i < n; ++i) {
    smem[i] = refit_test::make_side(src, ranks[i], true, 0);
    dmem[i] = refit_test::make_side(dst, ranks[i], false, 0);
  }
  auto buffers = [&](std::size_t i) {
    LocalBuffers b;
    b.src = refit_test::views(src, smem[i]);
    b.dst = refit_test::views(dst, dmem[i]);
    return b;
  };
  // Worlds and their endpoints outlive the Resharders (declared after them).
  FaultPlan faulty, none;
  faulty.add(corrupt_into_owner(*fault, static_cast<std::uint64_t>(fault->stage), 1));
  LocalWorld w1(ranks), w2(ranks);
  std::vector<LocalTransport> e1, e2;
  std::vector<std::unique_ptr<FT>> t1, t2;
  for (auto r : ranks) {
    e1.push_back(w1.endpoint(r));
    e2.push_back(w2.endpoint(r));
  }
  for (std::size_t i = 0; i < n; ++i) {
    t1.push_back(std::make_unique<FT>(e1[i], faulty));
    t2.push_back(std::make_unique<FT>(e2[i], none));
  }
  std::vector<std::unique_ptr<StagedResharder>> rs(n);
  std::vector<std::string> failed(n);
  auto index_of = [&](std::int64_t rank) {
    std::size_t i = 0;
    while (ranks[i] != rank) ++i;
    return i;
  };
  w1.run([&](LocalTransport& t) {
    const std::size_t i = index_of(t.rank());
    rs[i] = std::make_unique<StagedResharder>(src, dst, buffers(i), *t1[i], opt);
    rs[i]->refit();  // version 1
    refit_test::write_side(src, smem[i], true, 1);
    try {
      rs[i]->refit();  // version 2: the fan-out's source is corrupted
    } catch (const RefitNotCommitted& e) {
      failed[i] = e.what();
    }
  });
  std::mutex m;
  std::vector<std::int64_t> wrong(n, -1);
  w2.run([&](LocalTransport& t) {
    const std::size_t i = index_of(t.rank());
    StagedResharder& r = *rs[i];
    CHECK(r.state() == RefitState::stale);  // setup alone does not make it current
    r.setup(buffers(i), *t2[i]);
    refit_test::write_side(src, smem[i], true, 2);
    refit_test::write_side(dst, dmem[i], false, 2);
    const auto rep = r.refit();
    std::lock_guard lk(m);
    CHECK(rep.version == 3);
    CHECK(r.state() == RefitState::current);
    CHECK(r.last_good_version() == 3);
    CHECK_FALSE(r.last_failure().has_value());
    CHECK(r.stale_tensors().empty());
    wrong[i] = refit_test::count_wrong(dst, dmem[i], t.rank(), 2, nullptr);
  });
  for (std::size_t i = 0; i < n; ++i) {
    CAPTURE(ranks[i]);
    CHECK_MESSAGE(!failed[i].empty(), "version 2 was reported committed");
    CHECK(wrong[i] == 0);
  }
  rs.clear();  // before the transports they last set up on
}
