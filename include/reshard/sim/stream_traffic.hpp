#pragma once
// The traffic of a direct plan without the plan: plan_each_destination()
// streams each destination's copies, and only what the simulator needs is
// kept (bytes per GPU pair), so a refit of 10,000 GPUs whose schedule would
// not fit in memory can still be simulated.
//
// With `prefer_near` the sender choice of prefer_near() (hierarchical.hpp:
// SenderChoice) is applied, and exactly: that choice is one greedy pass
// over all copies largest first, with the busy time of every sender port
// shared by all destinations, so it cannot be made per destination. What it
// reads of a copy is kept instead, in a 24-byte record (bytes, ranks,
// tensor) rather than the whole strided box, and the same SenderChoice runs
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
#include <vector>

#include "../plan/hierarchical.hpp"
#include "../plan/plan.hpp"
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
  CopyShape shape;  ///< Traffic::shape_of the planned copy
};

/// prefer_near()'s choose_senders() for a plain (one-stage) plan, over
/// records (per destination position); changes src_rank. Returns the bytes moved.
inline std::int64_t choose_senders(std::vector<std::vector<CopyRecord>>& per_dst, const Layout& src, const Layout& dst,
                                   const RankPlacement& place) {
  std::int64_t top_rank = 0;
  for (const auto& v : per_dst)
    for (const auto& c : v) top_rank = std::max<std::int64_t>({top_rank, c.src_rank, c.dst_rank});
  SenderChoice choice(src, dst, place, top_rank, 1);
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
      if (!src.mesh.position_of(c.src_rank)) {
        choice.load(0, c.src_rank, c.dst_rank, c.bytes);
        continue;
      }
      order.emplace_back(-c.bytes, static_cast<std::int64_t>(at.size()));
      at.push_back(&c);
    }
  std::sort(order.begin(), order.end());
  std::int64_t moved = 0;
  for (auto [neg_bytes, i] : order) {
    CopyRecord& c = *at[static_cast<std::size_t>(i)];
    const std::int64_t best = choice.choose(0, c.src_rank, c.dst_rank, c.tensor, c.bytes);
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
/// The result equals add_traffic() of the materialized plan (FP8
/// quantizing included, counted once per piece across the threads'
/// accumulators; with prefer_near, quantized destinations are refused).
inline Traffic streamed_traffic(const Layout& src, const Layout& dst, const RankPlacement& place, const PlanOptions& opt,
                                bool prefer_near, const std::vector<double>* wire = nullptr, StreamReport* report = nullptr) {
  if (opt.only_rank >= 0) fail("streamed_traffic: needs the whole plan, not one rank's (only_rank)");
  if (prefer_near)
    for (const auto& t : dst.tensors)
      if (t.quant)
        fail("streamed_traffic: the near sender choice over quantized destinations ('{}' is FP8) is not supported: its records keep "
             "no box, so a piece quantized once for two replicas would be charged twice; use add_traffic() of the plan", t.name);
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
        tr->add_copy(0, c, static_cast<double>(c.bytes()) * scale(c.tensor));
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
                                              static_cast<std::int32_t>(c.dst_rank), c.tensor, out.shape_of(c)});
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
      for (const auto& c : v) out.add(0, c.src_rank, c.dst_rank, static_cast<double>(c.bytes) * scale(c.tensor), c.shape);
      std::vector<stream_detail::CopyRecord>().swap(v);
    }
    rep.traffic_seconds = since(t0);
  }
  if (report) *report = rep;
  return out;
}

}  // namespace reshard
