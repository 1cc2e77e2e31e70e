// Topology-aware and hierarchical plans: the staged oracle on random layouts
// under several topologies and placements, the inter-domain bytes against
// the unique bytes per domain (by element sets), replica choice, and the
// staged oracle catching planted faults.
#include <doctest/doctest.h>

#include <map>
#include <tuple>

#include "plan_test_util.hpp"
#include "random_layouts.hpp"
#include "reshard/plan/hierarchical.hpp"
#include "staged_oracle.hpp"

using namespace reshard;
using staged_oracle::small_topology;
using namespace plantest;

namespace {

bool disjoint(const Layout& a, const Layout& b) {
  for (auto r : a.mesh.global_ranks())
    if (b.mesh.position_of(r)) return false;
  return true;
}

StagedSchedule plain_staged(Schedule s) {
  StagedSchedule out;
  out.schedule = std::move(s);
  return out;
}

}  // namespace

TEST_CASE("hierarchical plans pass the staged oracle and cross into each domain once per unique byte") {
  const std::vector<Topology> topos = {small_topology(2, 4, PlacementKind::separate),
                                       small_topology(1, 3, PlacementKind::launch),
                                       small_topology(4, 8, PlacementKind::separate),
                                       small_topology(2, 2, PlacementKind::launch)};
  int checked = 0, exact_domains = 0, cut_domains = 0;
  double unique_total = 0, hier_total = 0, direct_total = 0;
  for (std::uint64_t seed = 1; seed <= 120; ++seed) {
    const auto pair = testgen::random_layout_pair(seed);
    const Topology& topo = topos[seed % topos.size()];
    const RankPlacement place(topo, pair.src, pair.dst);
    for (int pipeline : {1, 3}) {
      HierarchicalOptions ho;
      ho.pipeline = pipeline;
      HierarchicalReport rep;
      const StagedSchedule h = plan_hierarchical(pair.src, pair.dst, place, ho, &rep);
      const auto res = staged_oracle::check_staged(pair.src, pair.dst, h);
      REQUIRE_MESSAGE(res.ok, res.fault << "\n" << topo.name << " pipeline " << pipeline << "\n" << pair.describe());
      CHECK(h.stages <= pipeline + 1);
      if (pipeline != 3) continue;
      ++checked;
      // The direct plan, for comparison: never fewer bytes into a domain.
      const auto direct = staged_oracle::domain_traffic(pair.src, pair.dst, plain_staged(plan(pair.src, pair.dst)), place);
      const auto hier = staged_oracle::domain_traffic(pair.src, pair.dst, h, place);
      bool has_flat_dst = false;
      for (const auto& b : pair.dst.buffers) has_flat_dst |= b.kind == BufferKind::flat;
      for (const auto& [dom, t] : hier) {
        INFO(pair.describe() << "\ndomain " << dom << " unique " << t.unique << " incoming " << t.incoming
                             << " direct " << direct.at(dom).incoming);
        CHECK(t.incoming >= t.unique);  // the oracle's count is a floor
        CHECK(t.incoming <= direct.at(dom).incoming);
        unique_total += t.unique;
        hier_total += t.incoming;
        direct_total += direct.at(dom).incoming;
        if (t.incoming < direct.at(dom).incoming) ++cut_domains;
        // Exactly the unique bytes when the two sides are different GPUs and
        // the destination stores tensors whole or in concat buffers (a flat
        // destination buffer may hold a piece in ranges that differ between
        // replicas: those ranks are fed directly).
        if (disjoint(pair.src, pair.dst) && topo.placement == PlacementKind::separate && !has_flat_dst) {
          CHECK(t.incoming == t.unique);
          ++exact_domains;
        }
      }
    }
  }
  MESSAGE("random pairs " << checked << ": bytes into destination domains, unique " << unique_total << ", hierarchical "
                          << hier_total << ", direct " << direct_total << "; exact domains " << exact_domains
                          << ", domains cut " << cut_domains);
  CHECK(exact_domains > 20);
  CHECK(cut_domains > 10);
  CHECK(hier_total < direct_total);
}

TEST_CASE("dp replicas in one NVLink domain: the network carries each byte once, spread over the replicas") {
  // Source: tp=2 on ranks 0-1. Destination: dp=4 x tp=2 on ranks 2-9; with
  // 4-GPU domains and separate placement, the destination is on GPUs 4-11:
  // domains 1 and 2, two dp replicas each.
  LayoutSpec src_spec = mesh_layout({{"tp", 2}});
  add_tensor(src_spec, "w", {64, 32}, {cut({ax(src_spec, "tp")}), {}});
  add_tensor(src_spec, "b", {64}, {cut({ax(src_spec, "tp")})});
  add_tensor(src_spec, "n", {32}, {{}});
  Layout src(std::move(src_spec));
  LayoutSpec dst_spec = mesh_layout({{"dp", 4}, {"tp", 2}}, 2);
  add_tensor(dst_spec, "w", {64, 32}, {{}, cut({ax(dst_spec, "tp")})});
  add_tensor(dst_spec, "b", {64}, {cut({ax(dst_spec, "tp")})});
  add_tensor(dst_spec, "n", {32}, {{}});
  add_concat(dst_spec, "wb", {"b", "n"});
  Layout dst(std::move(dst_spec));
  const Topology topo = small_topology(2, 4, PlacementKind::separate);
  const RankPlacement place(topo, src, dst);
  CHECK(place.gpu(2) == 4);
  CHECK(place.domain(9) == 2);
  HierarchicalReport rep;
  const StagedSchedule h = plan_hierarchical(src, dst, place, {}, &rep);
  const auto res = staged_oracle::check_staged(src, dst, h);
  REQUIRE_MESSAGE(res.ok, res.fault);
  const auto t = staged_oracle::domain_traffic(src, dst, h, place);
  // Each destination domain needs all of w, b, n once: (64*32 + 64 + 32) * 2 bytes.
  const double unique = (64.0 * 32 + 64 + 32) * 2;
  CHECK(t.at(1).unique == unique);
  CHECK(t.at(1).incoming == unique);
  CHECK(t.at(2).incoming == unique);
  const auto direct = staged_oracle::domain_traffic(src, dst, plain_staged(plan(src, dst)), place);
  // Direct: both dp replicas take w and b; all four ranks take n.
  CHECK(direct.at(1).incoming == (2 * (64.0 * 32 + 64) + 4 * 32) * 2);
  CHECK(rep.groups == 2 * 5);  // per domain: w and b per tp part, and n
  // Fan-out per domain: the other replica of each w and b piece, 3 more n.
  CHECK(rep.fan_out_bytes == 2 * (64 * 32 + 64 + 3 * 32) * 2);
  // The network ingress of a domain is spread over its ranks (owners).
  std::map<std::int64_t, std::int64_t> in;
  for (std::size_t i = 0; i < h.schedule.copies.size(); ++i) {
    const auto& c = h.schedule.copies[i];
    if (!h.reads_dst(i) && place.domain(c.src_rank) != place.domain(c.dst_rank)) in[c.dst_rank] += c.bytes();
  }
  for (std::int64_t r = 2; r < 6; ++r) CHECK(in[r] > 0);
}

TEST_CASE("prefer_near hands copies to a replica in the destination's domain, and spreads them") {
  // Source dp=2 x tp=2: ranks 0-1 and 2-3 are replicas. Destination tp=2 on
  // ranks 4-5. Placement: ranks 2,3,4,5 share domain 1.
  LayoutSpec src_spec = mesh_layout({{"dp", 2}, {"tp", 2}});
  add_tensor(src_spec, "w", {8, 64}, {cut({ax(src_spec, "tp")}), {}});
  Layout src(std::move(src_spec));
  LayoutSpec dst_spec = mesh_layout({{"tp", 2}}, 4);
  add_tensor(dst_spec, "w", {8, 64}, {{}, cut({ax(dst_spec, "tp")})});
  Layout dst(std::move(dst_spec));
  Topology topo = small_topology(2, 4, PlacementKind::explicit_gpus);
  topo.rank_gpus = {0, 1, 4, 5, 6, 7};
  const RankPlacement place(topo, src, dst);
  PlanOptions po;
  po.split_bytes = 1 << 30;  // whole pieces, by rotation: some from the far replicas
  Schedule s = plan(src, dst, po);
  std::int64_t far_before = 0;
  for (const auto& c : s.copies) far_before += place.domain(c.src_rank) != place.domain(c.dst_rank) ? c.bytes() : 0;
  REQUIRE(far_before > 0);
  const std::int64_t moved = prefer_near(s, src, dst, place);
  CHECK(moved >= far_before);
  std::map<std::int64_t, std::int64_t> sent;
  for (const auto& c : s.copies) {
    CHECK(place.domain(c.src_rank) == place.domain(c.dst_rank));
    sent[c.src_rank] += c.bytes();
  }
  CHECK(sent.size() == 2);                    // ranks 2 and 3 (one per source part)
  CHECK(sent[2] == sent[3]);
  const auto res = oracle::check_schedule(src, dst, s);
  CHECK_MESSAGE(res.ok, res.fault);
}

// The contract of SenderChoice, against a plain reference: every replica
// found by scanning all source positions (same part, identical storage),
// then the nearest, least busy one per stage, the current sender on a tie,
// copies taken largest first. (The library finds replicas by part digits,
// shares lists between replicas and answers far copies from a tree.)
namespace {
std::vector<std::int64_t> reference_senders(const std::vector<Copy>& copies, const std::vector<std::int32_t>& stage,
                                            const std::vector<std::uint8_t>& from_dst, const Layout& src, const Layout& dst,
                                            const RankPlacement& place) {
  const auto src_of = match_tensors(src, dst);
  const double inv[2] = {1 / place.topology().nic_bytes_per_s(), 1 / place.topology().nvlink_bytes_per_s()};
  std::map<std::tuple<std::int32_t, std::int64_t, int>, double> busy;  // (stage, rank, port)
  auto stage_of = [&](std::size_t i) { return stage.empty() ? 0 : stage[i]; };
  auto distance = [&](std::int64_t a, std::int64_t b) {
    return place.node(a) == place.node(b) ? 0 : place.domain(a) == place.domain(b) ? 1 : 2;
  };
  std::vector<std::int64_t> sender(copies.size());
  std::vector<std::pair<std::int64_t, std::size_t>> movable;
  for (std::size_t i = 0; i < copies.size(); ++i) {
    const Copy& c = copies[i];
    sender[i] = c.src_rank;
    if (c.is_local()) continue;
    if ((!from_dst.empty() && from_dst[i]) || !src.mesh.position_of(c.src_rank)) {
      const int port = place.domain(c.src_rank) == place.domain(c.dst_rank) ? 1 : 0;
      busy[{stage_of(i), c.src_rank, port}] += static_cast<double>(c.bytes()) * inv[port];
    } else {
      movable.emplace_back(-c.bytes(), i);
    }
  }
  std::stable_sort(movable.begin(), movable.end(), [](auto& a, auto& b) { return a.first < b.first; });
  for (auto [nb, i] : movable) {
    const Copy& c = copies[i];
    const int st = src_of[static_cast<std::size_t>(c.tensor)];
    const auto& ts = src.tensors[static_cast<std::size_t>(st)];
    const std::int64_t spos = *src.mesh.position_of(c.src_rank);
    const TensorStorage mine = tensor_storage(src, spos, st);
    std::vector<std::int64_t> cand;
    for (std::int64_t h = 0; h < src.mesh.size(); ++h) {
      if (!src.holds(h, st)) continue;
      bool same_part = true;
      for (int d = 0; d < ts.rank(); ++d)
        same_part &= ts.dims[static_cast<std::size_t>(d)].part_of(src.mesh, h) == ts.dims[static_cast<std::size_t>(d)].part_of(src.mesh, spos);
      if (same_part && (h == spos || ts.buffer < 0 || hier_detail::same_storage(tensor_storage(src, h, st), mine)))
        cand.push_back(src.mesh.global_rank(h));
    }
    int near = 3;
    for (auto r : cand)
      if (r != c.dst_rank) near = std::min(near, distance(r, c.dst_rank));
    const int port = near == 2 ? 0 : 1;
    std::int64_t best = -1;
    double best_busy = 0;
    for (auto r : cand) {
      if (r == c.dst_rank || distance(r, c.dst_rank) != near) continue;
      const double b = busy[{stage_of(i), r, port}];
      if (best < 0 || b < best_busy || (b == best_busy && r == c.src_rank)) {
        best = r;
        best_busy = b;
      }
    }
    REQUIRE(best >= 0);
    busy[{stage_of(i), best, port}] += static_cast<double>(c.bytes()) * inv[port];
    sender[i] = best;
  }
  return sender;
}
}  // namespace

TEST_CASE("choose_senders picks the senders of a plain scan over all replicas (plain and staged plans)") {
  const std::vector<Topology> topos = {small_topology(2, 4, PlacementKind::separate), small_topology(1, 3, PlacementKind::launch),
                                       small_topology(4, 8, PlacementKind::separate), small_topology(2, 2, PlacementKind::launch)};
  int changed = 0, far_choices = 0;
  for (std::uint64_t seed = 1; seed <= 80; ++seed) {
    const auto pair = testgen::random_layout_pair(seed + 500);
    const Topology& topo = topos[seed % topos.size()];
    const RankPlacement place(topo, pair.src, pair.dst);
    PlanOptions po;
    po.split_bytes = seed % 2 ? std::int64_t{1} << 30 : 64;  // whole pieces, or slabs over the replicas
    StagedSchedule plans[2] = {plain_staged(plan(pair.src, pair.dst, po)), {}};
    HierarchicalOptions ho;
    ho.plan = po;
    ho.pipeline = 2;
    ho.prefer_near = false;
    plans[1] = plan_hierarchical(pair.src, pair.dst, place, ho);
    for (auto& h : plans) {
      const auto want = reference_senders(h.schedule.copies, h.stage, h.from_dst, pair.src, pair.dst, place);
      auto copies = h.schedule.copies;
      const std::int64_t moved = choose_senders(copies, &h.stage, &h.from_dst, pair.src, pair.dst, place);
      std::int64_t want_moved = 0;
      for (std::size_t i = 0; i < copies.size(); ++i) {
        REQUIRE_MESSAGE(copies[i].src_rank == want[i], "copy " << i << " of " << copies.size() << ", staged " << (&h == &plans[1])
                                                               << "\n" << topo.name << "\n" << pair.describe());
        if (want[i] != h.schedule.copies[i].src_rank) want_moved += copies[i].bytes();
        if (!copies[i].is_local() && place.domain(want[i]) != place.domain(copies[i].dst_rank)) ++far_choices;
      }
      CHECK(moved == want_moved);
      changed += moved > 0;
    }
  }
  MESSAGE("plans whose senders changed: " << changed << "; copies sent across domains: " << far_choices);
  CHECK(changed > 10);
  CHECK(far_choices > 100);
}

TEST_CASE("the staged oracle catches reads before writes, wrong layouts and duplicate fan-out") {
  LayoutSpec src_spec = mesh_layout({{"tp", 2}});
  add_tensor(src_spec, "w", {16, 8}, {cut({ax(src_spec, "tp")}), {}});
  Layout src(std::move(src_spec));
  LayoutSpec dst_spec = mesh_layout({{"dp", 4}, {"tp", 2}}, 2);
  add_tensor(dst_spec, "w", {16, 8}, {cut({ax(dst_spec, "tp")}), {}});
  Layout dst(std::move(dst_spec));
  const RankPlacement place(small_topology(4, 4, PlacementKind::separate), src, dst);
  HierarchicalOptions ho;
  ho.pipeline = 1;
  const StagedSchedule h = plan_hierarchical(src, dst, place, ho);
  REQUIRE(staged_oracle::check_staged(src, dst, h).ok);
  std::size_t fan = h.schedule.copies.size();
  for (std::size_t i = 0; i < h.schedule.copies.size(); ++i)
    if (h.reads_dst(i)) fan = i;
  REQUIRE(fan < h.schedule.copies.size());
  {
    StagedSchedule bad = h;
    bad.stage[fan] = 0;  // reads the owner's buffer in the stage that fills it
    const auto r = staged_oracle::check_staged(src, dst, bad);
    CHECK_FALSE(r.ok);
    CHECK(r.fault.find("before an earlier stage wrote it") != std::string::npos);
  }
  {
    StagedSchedule bad = h;
    bad.from_dst[fan] = 0;  // the same offsets read in the source layout: wrong elements or no buffer
    CHECK_FALSE(staged_oracle::check_staged(src, dst, bad).ok);
  }
  {
    StagedSchedule bad = h;  // the fan-out copy twice
    bad.schedule.copies.push_back(bad.schedule.copies[fan]);
    bad.stage.push_back(bad.stage[fan]);
    bad.from_dst.push_back(1);
    bad.schedule.compute_stats(bad.schedule.stats.ranks);
    const auto r = staged_oracle::check_staged(src, dst, bad);
    CHECK_FALSE(r.ok);
    CHECK(r.fault.find("written again") != std::string::npos);
  }
  {
    StagedSchedule bad = h;  // a fan-out copy lost
    bad.schedule.copies.erase(bad.schedule.copies.begin() + static_cast<std::ptrdiff_t>(fan));
    bad.stage.erase(bad.stage.begin() + static_cast<std::ptrdiff_t>(fan));
    bad.from_dst.erase(bad.from_dst.begin() + static_cast<std::ptrdiff_t>(fan));
    bad.schedule.compute_stats(bad.schedule.stats.ranks);
    const auto r = staged_oracle::check_staged(src, dst, bad);
    CHECK_FALSE(r.ok);
    CHECK(r.fault.find("never written") != std::string::npos);
  }
}
