#pragma once
// The traffic of a direct plan without the plan: plan_each_destination()
// streams each destination's copies, and only what the simulator needs is
// kept (bytes per GPU pair), so a refit of 10,000 GPUs whose schedule would
// not fit in memory can still be simulated.
//
// With `prefer_near` the sender choice of prefer_near() (hierarchical.hpp:
// choose_senders) is applied, and exactly: that choice is one greedy pass
// over all copies largest first, with the busy time of every sender port
// shared by all destinations, so it cannot be made per destination. What it
// reads of a copy is kept instead, in a 24-byte record (bytes, ranks,
// tensor) rather than the whole strided box, and the same greedy pass runs
// over the records in plan order.
#include <chrono>
#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <span>
#include <thread>
#include <unordered_map>
#include <vector>

#include "hierarchical.hpp"
#include "plan.hpp"
#include "simulate.hpp"

namespace reshard {

struct StreamReport {
  std::int64_t copies = 0;      ///< copies the plan has (counted, not kept)
  std::int64_t bytes = 0;       ///< their bytes (before any wire scaling)
  std::int64_t near_bytes = 0;  ///< bytes whose sender the near choice changed
  double plan_seconds = 0;      ///< streaming the plan (and keeping records)
  double choose_seconds = 0;    ///< the near choice over the records
  double traffic_seconds = 0;   ///< summing pairs
  std::int64_t record_bytes = 0;  ///< memory the records took (0 without prefer_near)
};

namespace stream_detail {

/// What the sender choice and the traffic read of a copy.
struct CopyRecord {
  std::int64_t bytes;
  std::int32_t src_rank, dst_rank, tensor;
};

/// prefer_near()'s choose_senders() for a plain (one-stage) plan, over
/// records (per destination position); changes src_rank. Returns the bytes moved.
inline std::int64_t choose_senders(std::vector<std::vector<CopyRecord>>& per_dst, const Layout& src, const Layout& dst,
                                   const RankPlacement& place) {
  const std::vector<int> src_of = match_tensors(src, dst);
  const Topology& topo = place.topology();
  const double inv_nic = 1 / topo.nic_bytes_per_s(), inv_nvl = 1 / topo.nvlink_bytes_per_s();
  // (source position, source tensor) -> the ranks of its identical replicas.
  // Identical storage is an equivalence: the list is found once per replica
  // group and shared by all its members (a 10,000-GPU refit has thousands of
  // replicas per part: one list per position would cost gigabytes).
  const auto T = static_cast<std::int64_t>(src.tensors.size());
  std::unordered_map<std::int64_t, std::int32_t> replicas;  // key -> index into lists
  std::vector<std::vector<std::int64_t>> lists;
  std::map<std::vector<std::int64_t>, std::int32_t> by_content;
  auto replicas_of = [&](std::int64_t spos, int st) -> std::int32_t {
    const std::int64_t key = spos * T + st;
    auto it = replicas.find(key);
    if (it != replicas.end()) return it->second;
    std::vector<std::int64_t> out, members;
    const auto& sts = src.tensors[static_cast<std::size_t>(st)];
    std::vector<std::int64_t> parts;
    for (int d = 0; d < sts.rank(); ++d) parts.push_back(sts.dims[static_cast<std::size_t>(d)].part_of(src.mesh, spos));
    const auto holders = positions_of_part(src, st, parts);
    const bool alone = sts.buffer < 0;
    TensorStorage mine;
    if (!alone) mine = tensor_storage(src, spos, st);
    for (auto h : holders)
      if (h == spos || alone || hier_detail::same_storage(tensor_storage(src, h, st), mine)) {
        out.push_back(src.mesh.global_rank(h));
        members.push_back(h);
      }
    // Tensors held by the same replicas share one list (and one tree below).
    auto [known, fresh] = by_content.emplace(out, static_cast<std::int32_t>(lists.size()));
    const std::int32_t id = known->second;
    if (fresh) lists.push_back(std::move(out));
    for (auto h : members) replicas.emplace(h * T + st, id);
    return id;
  };
  std::int64_t top_rank = 0;
  for (const auto& v : per_dst)
    for (const auto& c : v) top_rank = std::max<std::int64_t>({top_rank, c.src_rank, c.dst_rank});
  for (auto r : src.mesh.global_ranks()) top_rank = std::max(top_rank, r);
  const auto R = static_cast<std::size_t>(top_rank + 1);
  // Node and domain per rank, dense: the choice below asks for every
  // replica of every copy (thousands each at 10,000 GPUs).
  std::vector<std::int64_t> node_of(R, -1), domain_of(R, -1);
  for (const auto& [r, g] : place.gpus())
    if (static_cast<std::size_t>(r) < R) {
      node_of[static_cast<std::size_t>(r)] = topo.node_of_gpu(g);
      domain_of[static_cast<std::size_t>(r)] = topo.domain_of_gpu(g);
    }
  auto distance = [&](std::int64_t from, std::int64_t to) {
    const auto f = static_cast<std::size_t>(from), t = static_cast<std::size_t>(to);
    if (node_of[f] == node_of[t]) return 0;
    return domain_of[f] == domain_of[t] ? 1 : 2;
  };
  std::vector<double> busy(R * 2, 0);  // (rank, port: 0 NIC, 1 NVLink) seconds
  // The choice is the least busy NIC among thousands of replicas when none
  // is near the destination (the common case: separate training and
  // inference GPUs). Per replica list a tournament tree over its ranks' NIC
  // busy time answers that in O(log n): the first minimum in list order, as
  // the scan below finds it. A rank is in a few lists only, so keeping the
  // trees current costs little.
  struct Tree {
    std::size_t leaves = 0;
    std::vector<std::int32_t> win;  // per node: the list position of its minimum
    std::vector<std::int64_t> nodes, domains;  // of the list's ranks, sorted
  };
  std::vector<Tree> trees;
  std::vector<std::vector<std::pair<std::int32_t, std::int32_t>>> member_of(R);  // rank -> (list, position)
  auto nic_busy = [&](std::int32_t l, std::int32_t pos) {
    const auto& L = lists[static_cast<std::size_t>(l)];
    return pos < static_cast<std::int32_t>(L.size()) ? busy[static_cast<std::size_t>(L[static_cast<std::size_t>(pos)]) * 2]
                                                       : std::numeric_limits<double>::infinity();
  };
  auto better = [&](std::int32_t l, std::int32_t a, std::int32_t b) {  // a before b: smaller busy, then earlier
    const double x = nic_busy(l, a), y = nic_busy(l, b);
    return x < y || (x == y && a < b);
  };
  auto fix_up = [&](std::int32_t l, std::size_t node) {
    auto& t = trees[static_cast<std::size_t>(l)];
    for (node /= 2; node >= 1; node /= 2) {
      const std::int32_t a = t.win[2 * node], b = t.win[2 * node + 1];
      t.win[node] = better(l, a, b) ? a : b;
    }
  };
  auto tree_of = [&](std::int32_t l) -> Tree& {
    if (trees.size() <= static_cast<std::size_t>(l)) trees.resize(static_cast<std::size_t>(l) + 1);
    auto& t = trees[static_cast<std::size_t>(l)];
    if (t.leaves) return t;
    const auto& L = lists[static_cast<std::size_t>(l)];
    t.leaves = 1;
    while (t.leaves < L.size()) t.leaves *= 2;
    t.win.assign(2 * t.leaves, 0);
    for (std::size_t i = 0; i < t.leaves; ++i) t.win[t.leaves + i] = static_cast<std::int32_t>(i);
    for (std::size_t n = t.leaves - 1; n >= 1; --n) {
      const std::int32_t a = t.win[2 * n], b = t.win[2 * n + 1];
      t.win[n] = better(l, a, b) ? a : b;
    }
    for (std::size_t i = 0; i < L.size(); ++i) {
      member_of[static_cast<std::size_t>(L[i])].emplace_back(l, static_cast<std::int32_t>(i));
      t.nodes.push_back(node_of[static_cast<std::size_t>(L[i])]);
      t.domains.push_back(domain_of[static_cast<std::size_t>(L[i])]);
    }
    std::sort(t.nodes.begin(), t.nodes.end());
    std::sort(t.domains.begin(), t.domains.end());
    return t;
  };
  auto add_busy = [&](std::int64_t r, int port, double cost) {
    busy[static_cast<std::size_t>(r) * 2 + static_cast<std::size_t>(port)] += cost;
    if (port == 0)
      for (auto [l, pos] : member_of[static_cast<std::size_t>(r)])
        fix_up(l, trees[static_cast<std::size_t>(l)].leaves + static_cast<std::size_t>(pos));
  };
  // (-bytes, plan index): largest first, stable, as choose_senders sorts.
  std::vector<std::pair<std::int64_t, std::int64_t>> order;
  std::vector<CopyRecord*> at;
  // plan() orders its copies by destination rank (positions, if the mesh's
  // ranks ascend; else stably sorted by rank): the same order here.
  std::vector<std::int64_t> positions(per_dst.size());
  std::iota(positions.begin(), positions.end(), std::int64_t{0});
  std::stable_sort(positions.begin(), positions.end(),
                   [&](std::int64_t a, std::int64_t b) { return dst.mesh.global_rank(a) < dst.mesh.global_rank(b); });
  for (auto pos : positions)
    for (auto& c : per_dst[static_cast<std::size_t>(pos)]) {
      if (c.src_rank == c.dst_rank) continue;
      const int port = place.domain(c.src_rank) == place.domain(c.dst_rank) ? 1 : 0;
      if (!src.mesh.position_of(c.src_rank)) {
        add_busy(c.src_rank, port, static_cast<double>(c.bytes) * (port ? inv_nvl : inv_nic));
        continue;
      }
      order.emplace_back(-c.bytes, static_cast<std::int64_t>(at.size()));
      at.push_back(&c);
    }
  std::sort(order.begin(), order.end());
  std::int64_t moved = 0;
  for (auto [neg_bytes, i] : order) {
    CopyRecord& c = *at[static_cast<std::size_t>(i)];
    const auto spos = *src.mesh.position_of(c.src_rank);
    const std::int32_t l = replicas_of(spos, src_of[static_cast<std::size_t>(c.tensor)]);
    const auto& cand = lists[static_cast<std::size_t>(l)];
    const Tree& t = tree_of(l);
    const auto d = static_cast<std::size_t>(c.dst_rank);
    std::int64_t best = -1;
    int port = 0;
    if (!std::binary_search(t.nodes.begin(), t.nodes.end(), node_of[d]) &&
        !std::binary_search(t.domains.begin(), t.domains.end(), domain_of[d])) {
      // No replica near the destination (nor the destination itself): the
      // least busy NIC, the current sender on a tie.
      best = cand[static_cast<std::size_t>(t.win[1])];
      if (busy[static_cast<std::size_t>(c.src_rank) * 2] == busy[static_cast<std::size_t>(best) * 2]) best = c.src_rank;
    } else {
      int near = 3;
      for (auto r : cand)
        if (r != c.dst_rank) near = std::min(near, distance(r, c.dst_rank));
      port = near == 2 ? 0 : 1;
      double best_busy = 0;
      for (auto r : cand) {
        if (r == c.dst_rank || distance(r, c.dst_rank) != near) continue;
        const double b = busy[static_cast<std::size_t>(r) * 2 + static_cast<std::size_t>(port)];
        if (best < 0 || b < best_busy || (b == best_busy && r == c.src_rank)) {
          best = r;
          best_busy = b;
        }
      }
      if (best < 0) best = c.src_rank;
    }
    add_busy(best, port, static_cast<double>(c.bytes) * (port ? inv_nvl : inv_nic));
    if (best != c.src_rank) {
      moved += c.bytes;
      c.src_rank = static_cast<std::int32_t>(best);
    }
  }
  return moved;
}

}  // namespace stream_detail

/// The traffic (one stage) of plan(src, dst, opt), optionally after
/// prefer_near(), built from plan_each_destination() without keeping the
/// schedule; `wire` scales each destination tensor's bytes (fp8_wire_scale).
/// The result equals add_traffic() of the materialized plan.
inline Traffic streamed_traffic(const Layout& src, const Layout& dst, const RankPlacement& place, const PlanOptions& opt,
                                bool prefer_near, const std::vector<double>* wire = nullptr, StreamReport* report = nullptr) {
  if (opt.only_rank >= 0) fail("streamed_traffic: needs the whole plan, not one rank's (only_rank)");
  auto since = [](std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  for (auto r : src.mesh.global_ranks())
    if (r > std::numeric_limits<std::int32_t>::max()) fail("streamed_traffic: rank {} is too large", r);
  for (auto r : dst.mesh.global_ranks())
    if (r > std::numeric_limits<std::int32_t>::max()) fail("streamed_traffic: rank {} is too large", r);
  StreamReport rep;
  auto scale = [&](std::int32_t t) { return wire ? (*wire)[static_cast<std::size_t>(t)] : 1.0; };
  Traffic out(place);
  auto t0 = std::chrono::steady_clock::now();
  if (!prefer_near) {
    // Per-thread accumulators (sink runs on several threads at once).
    std::mutex mu;
    std::map<std::thread::id, std::unique_ptr<Traffic>> local;
    struct Count {
      std::int64_t copies = 0, bytes = 0;
    };
    std::map<std::thread::id, Count> counts;
    plan_each_destination(src, dst, opt, [&](std::int64_t, std::span<const Copy> cs) {
      Traffic* tr;
      Count* n;
      {
        std::lock_guard<std::mutex> lock(mu);
        auto& p = local[std::this_thread::get_id()];
        if (!p) p = std::make_unique<Traffic>(place);
        tr = p.get();
        n = &counts[std::this_thread::get_id()];
      }
      for (const auto& c : cs) {
        tr->add(0, c.src_rank, c.dst_rank, static_cast<double>(c.bytes()) * scale(c.tensor));
        ++n->copies;
        n->bytes += c.bytes();
      }
    });
    rep.plan_seconds = since(t0);
    t0 = std::chrono::steady_clock::now();
    for (auto& [id, tr] : local) out.merge(*tr);
    for (auto& [id, n] : counts) {
      rep.copies += n.copies;
      rep.bytes += n.bytes;
    }
    rep.traffic_seconds = since(t0);
  } else {
    // One record list per destination position (each written by one sink
    // call only: no lock), concatenated in position order = plan order.
    std::vector<std::vector<stream_detail::CopyRecord>> per_dst(static_cast<std::size_t>(dst.mesh.size()));
    plan_each_destination(src, dst, opt, [&](std::int64_t pos, std::span<const Copy> cs) {
      auto& v = per_dst[static_cast<std::size_t>(pos)];
      v.reserve(cs.size());
      for (const auto& c : cs)
        v.push_back(stream_detail::CopyRecord{c.bytes(), static_cast<std::int32_t>(c.src_rank),
                                              static_cast<std::int32_t>(c.dst_rank), c.tensor});
    });
    rep.plan_seconds = since(t0);
    for (const auto& v : per_dst) {
      rep.copies += static_cast<std::int64_t>(v.size());
      rep.record_bytes += static_cast<std::int64_t>(v.capacity() * sizeof(stream_detail::CopyRecord));
      for (const auto& c : v) rep.bytes += c.bytes;
    }
    t0 = std::chrono::steady_clock::now();
    rep.near_bytes = stream_detail::choose_senders(per_dst, src, dst, place);
    rep.choose_seconds = since(t0);
    t0 = std::chrono::steady_clock::now();
    for (auto& v : per_dst) {
      for (const auto& c : v) out.add(0, c.src_rank, c.dst_rank, static_cast<double>(c.bytes) * scale(c.tensor));
      std::vector<stream_detail::CopyRecord>().swap(v);
    }
    rep.traffic_seconds = since(t0);
  }
  if (report) *report = rep;
  return out;
}

}  // namespace reshard
