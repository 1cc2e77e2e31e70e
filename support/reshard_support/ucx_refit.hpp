#pragma once
// A measured refit over the UCX transport, run by every process of the job
// (reshard-refit --transport ucx under mpirun). Mirrors the in-process
// harness: the same tagged weights (verify.hpp), the reshard refit and the
// traditional gather + broadcast + slice refit (traditional.hpp) on the same
// transport, alternating iterations, every one of each checked element by
// element from all-wrong destination memory. Then the raw UCX bandwidth
// between the two ranks that exchange the most bytes is measured in the same
// run, so the report says what fraction of the transport the refit reached.
//
//   reshard::MpiSession mpi(argc, argv);
//   reshard::UcxTransport t(reshard::mpi_bootstrap(), ucx_options);
//   auto r = reshard::ucx_refit(src, dst, t, options);   // collective
//   if (t.rank() == 0) std::cout << reshard::to_json(r).dump() << "\n";
//
// Every rank returns the same result. A failure on any rank throws on every
// rank (the transport is aborted); each destination buffer then holds what the
// error says (RefitNotCommitted::writes(): written, partial, untouched).
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "reshard/commit.hpp"
#include "reshard/plan/plan.hpp"
#include "reshard/resharder.hpp"
#include "reshard/transport/ucx.hpp"
#include "measured_refit.hpp"

namespace reshard {

struct UcxRefitOptions : MeasuredRefitOptions {
  /// Raw bandwidth probe: bytes per transfer (0: the busiest pair's bytes,
  /// clamped to [1 MiB, probe_max_bytes]) and timed transfers.
  bool probe = true;
  std::size_t probe_bytes = 0, probe_max_bytes = std::size_t{256} << 20;
  int probe_iterations = 3;
};

using UcxRefitMethod = MethodFigures;

struct UcxRefitResult {
  std::int64_t world = 0, src_ranks = 0, dst_ranks = 0;
  std::int64_t plan_bytes = 0, plan_local_bytes = 0;
  double plan_seconds = 0;
  bool same_host = true;  ///< seconds are first start to last finish (else the slowest rank's own time)
  std::string protocol;
  UcxRefitMethod reshard, baseline;
  bool has_baseline = false;
  /// Raw bandwidth between the busiest pair, both protocols.
  std::int64_t pair_from = -1, pair_to = -1, pair_bytes = 0;
  UcxBandwidth raw_put, raw_tag;
  bool has_probe = false;
  double refit_gb_per_s = 0;       ///< bytes_moved / median
  double bottleneck_gb_per_s = 0;  ///< max_rank_bytes / median: the busiest rank's link
  double fraction_of_raw = 0;      ///< bottleneck vs the raw bandwidth of the protocol in use
  double fraction_of_raw_put = 0;  ///< bottleneck vs raw one-sided puts
  double speedup = 0;              ///< baseline median / reshard median
  std::vector<std::int64_t> connected_peers_max;  ///< the reshard program's endpoints on the rank with the most
};

/// Runs the measured refit on every rank of `t`'s world (collective).
inline UcxRefitResult ucx_refit(const Layout& src, const Layout& dst, UcxTransport& t, const UcxRefitOptions& opt = {}) {
  UcxRefitResult res;
  const auto world = t.world_ranks();
  res.world = static_cast<std::int64_t>(world.size());
  res.src_ranks = src.mesh.size();
  res.dst_ranks = dst.mesh.size();
  res.protocol = std::string(to_string(t.protocol()));
  res.has_baseline = opt.baseline;
  require_world(src, dst, world, "ucx refit");
  const auto far = [&] { return Clock::now() + opt.executor.timeout; };

  std::vector<std::int64_t> peers;  // the reshard program's endpoints, before the baseline opens its own
  RankFigures me = measure_refit_on_rank(src, dst, t, opt, [&](const auto&) { peers = t.connected_peers(); });
  me.peers = std::move(peers);
  const std::vector<RankFigures> all = gather_figures(t, me, far());
  for (std::size_t i = 0; i < all.size(); ++i) {
    const RankFigures& f = all[i];
    res.same_host &= f.host == all[0].host;
    res.plan_bytes += f.main.plan_bytes_sent;
    res.plan_local_bytes += f.main.plan_local_bytes;
    res.plan_seconds = std::max(res.plan_seconds, f.plan_seconds);
    if (f.peers.size() > res.connected_peers_max.size()) res.connected_peers_max = f.peers;
    for (const auto& [p, b] : f.sends)
      if (b > res.pair_bytes) {
        res.pair_bytes = b;
        res.pair_from = world[i];
        res.pair_to = p;
      }
  }

  res.reshard = summarize_method(all, false, res.same_host);
  if (opt.baseline) {
    res.baseline = summarize_method(all, true, res.same_host);
    res.speedup = res.reshard.median > 0 ? res.baseline.median / res.reshard.median : 0;
  }
  if (res.reshard.median > 0) {
    res.refit_gb_per_s = static_cast<double>(res.reshard.bytes_moved) / res.reshard.median / 1e9;
    res.bottleneck_gb_per_s = static_cast<double>(res.reshard.max_rank_bytes) / res.reshard.median / 1e9;
  }

  // Raw bandwidth between the busiest pair, in the same run.
  if (opt.probe && res.pair_from >= 0) {
    std::size_t bytes = opt.probe_bytes;
    if (bytes == 0) bytes = std::clamp<std::size_t>(static_cast<std::size_t>(res.pair_bytes), std::size_t{1} << 20, opt.probe_max_bytes);
    const int it = std::max(1, opt.probe_iterations);
    res.raw_put = t.measure_bandwidth(res.pair_from, res.pair_to, bytes, it, far(), UcxProtocol::put);
    res.raw_tag = t.measure_bandwidth(res.pair_from, res.pair_to, bytes, it, far(), UcxProtocol::tag);
    res.has_probe = true;
    const double raw = t.protocol() == UcxProtocol::put ? res.raw_put.gb_per_s : res.raw_tag.gb_per_s;
    if (raw > 0) res.fraction_of_raw = res.bottleneck_gb_per_s / raw;
    if (res.raw_put.gb_per_s > 0) res.fraction_of_raw_put = res.bottleneck_gb_per_s / res.raw_put.gb_per_s;
  }
  t.all_gather({}, far());
  return res;
}

inline nlohmann::json to_json(const UcxBandwidth& b) {
  return {{"from", b.from}, {"to", b.to}, {"bytes", b.bytes}, {"iterations", b.iterations}, {"seconds", b.seconds}, {"gb_per_s", b.gb_per_s}};
}

/// The contract's reshard-refit --json object (CONTRACT.md §3) without
/// "model", which the caller adds, plus what this run measured.
inline nlohmann::json to_json(const UcxRefitResult& r) {
  // reshard's own figures at the top level (the contract's fields), the
  // baseline's below.
  nlohmann::json j = to_json(r.reshard);
  j.update({{"transport", "ucx"},
            {"protocol", r.protocol},
            {"src_ranks", r.src_ranks},
            {"dst_ranks", r.dst_ranks},
            {"world", r.world},
            {"validated", r.reshard.validated && (!r.has_baseline || r.baseline.validated)},
            {"plan_bytes", r.plan_bytes},
            {"plan_seconds", r.plan_seconds},
            {"timing", r.same_host ? "first start to last finish (one host)" : "slowest rank (several hosts)"},
            {"refit_gb_per_s", r.refit_gb_per_s},
            {"bottleneck_gb_per_s", r.bottleneck_gb_per_s},
            {"max_endpoints_per_rank", r.connected_peers_max.size()}});
  if (r.has_baseline) {
    j["baseline"] = to_json(r.baseline);
    j["speedup"] = r.speedup;
  }
  if (r.has_probe) {
    j["raw"] = {{"pair", {r.pair_from, r.pair_to}},
                {"pair_bytes", r.pair_bytes},
                {"put", to_json(r.raw_put)},
                {"tag", to_json(r.raw_tag)}};
    j["raw_put_gb_per_s"] = r.raw_put.gb_per_s;
    j["fraction_of_raw"] = r.fraction_of_raw;
    j["fraction_of_raw_put"] = r.fraction_of_raw_put;
  }
  return j;
}

}  // namespace reshard
