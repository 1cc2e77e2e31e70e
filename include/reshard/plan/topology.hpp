#pragma once
// Topology: the cluster a refit runs on, and where each global rank sits.
//
//   GPUs are numbered 0.. in launch order: GPU g is on node g / gpus_per_node
//   and in NVLink domain g / nvlink_domain (nvlink_domain is a multiple of
//   gpus_per_node: 8 on an H100/H200 node, 72 on a GB200 NVL72 rack).
//   Each GPU has its own NIC (nic_gbps each way) and NVLink port
//   (nvlink_gbps each way). All bandwidths are per GPU, per direction, in
//   gigabits per second (400 = 50 GB/s), like `--nic-gbps`.
//
// Rank numbering -> GPUs (RankPlacement):
//   "launch"   (default) GPU = global rank. The presets number the training
//              ranks 0..S-1 and the inference ranks S..S+D-1, so the two sides
//              are different GPUs packed one after the other (they may share a
//              node or domain at the seam); with --colocate the inference
//              ranks are 0..D-1, i.e. the same GPUs as the training ranks.
//   "separate" each side packed from the start of its own NVLink domain: the
//              source ranks (sorted) on GPUs 0..S-1, the destination-only
//              ranks from the first domain boundary after them. Two jobs on
//              different racks/nodes, as in the published disaggregated
//              refits. A rank on both sides stays on its source GPU.
//   "gpus"     an explicit list: rank r runs on GPU rank_gpus[r].
//
// JSON form (every field optional; "base" starts from a named preset):
//   {"name": "my-cluster", "base": "h100-8x400g", "gpus_per_node": 8,
//    "nvlink_domain": 8, "nic_gbps": 400, "nvlink_gbps": 3600,
//    "memcpy_gbps": 0, "fabric_gbps": 0, "latency_us": 5, "nvlink_latency_us": 2,
//    "stage_latency_us": 10, "staging_budget": 268435456, "zero_copy_min": 65536,
//    "host_cores": 0, "staging_copy_gbps": 0, "staging_run_ns": 0, "quantize_gbps": 0, "messages_in_flight": 1,
//    "placement": "launch" | "separate", "rank_gpus": [0, 1, ...]}
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <iterator>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "../base/error.hpp"
#include "../base/json_text.hpp"
#include "../layout/layout.hpp"
#include "../schedule/message_rule.hpp"

namespace reshard {

enum class PlacementKind : std::uint8_t { launch, separate, explicit_gpus };

struct Topology {
  std::string name = "custom";
  std::int64_t gpus_per_node = 8;
  std::int64_t nvlink_domain = 8;   ///< GPUs per NVLink domain (a multiple of gpus_per_node)
  double nic_gbps = 400;            ///< per GPU, each direction
  double nvlink_gbps = 3600;        ///< per GPU, each direction (450 GB/s)
  double memcpy_gbps = 0;           ///< a GPU's local copy rate; 0 = local copies cost nothing
  /// Total network throughput of the whole cluster, shared by every network
  /// flow (a fabric that is not full bisection; one host's loopback); 0 = none.
  double fabric_gbps = 0;
  double latency_us = 5;            ///< per network message
  double nvlink_latency_us = 2;     ///< per NVLink message
  double stage_latency_us = 10;     ///< per stage barrier of a staged schedule
  /// The executor's options that decide how a pair's copies become messages
  /// (message_rule.hpp; ExecutorOptions): staging bytes per rank, and the
  /// smallest contiguous piece sent zero-copy. Each message pays the latency.
  std::int64_t staging_budget = kDefaultStagingBudget;
  std::int64_t zero_copy_min = kDefaultZeroCopyMin;
  /// CPU cores that all the refit's processes share (one host: loopback);
  /// 0 = every process has its own core(s), the case on a cluster. With more
  /// processes than cores, each message (and stage barrier) costs
  /// processes / cores times its latency: a message's handshake runs on both
  /// its ends' CPUs (UCX progresses by polling), and each process gets only
  /// cores / processes of a core.
  double host_cores = 0;
  /// What copying staged bytes into and out of staging costs a GPU's host
  /// (packing at the source, unpacking at the destination): bytes at
  /// staging_copy_gbps plus staging_run_ns per unit-stride run, added to the
  /// stage (the packers first, then the unpackers; on a shared host, the
  /// GPUs doing it at once share host_cores). 0 and 0 = free: on a cluster
  /// GPU kernels pack at HBM speed while earlier waves move (executor
  /// pipeline); on loopback the same cores that move the bytes copy them, so
  /// the loopback preset has them fitted (bench/calibration/README.md).
  double staging_copy_gbps = 0;
  double staging_run_ns = 0;
  /// FP8 quantizing on the senders (copies into quantized destinations
  /// that the sender quantizes, docs/fp8.md): FP8 bytes a GPU's host
  /// produces per second (Gb/s), charged to each sender before its transfer
  /// (QuantRefit quantizes every tile before the executor runs; on a shared
  /// host the senders share host_cores). 0 = free: on a cluster a GPU kernel
  /// at HBM speed; the loopback preset has it measured (docs/measurements.md).
  double quantize_gbps = 0;
  /// Messages a GPU keeps in flight at once, so that n messages cost
  /// n x latency / messages_in_flight (Little's law), still added to the
  /// transfer time rather than overlapped with it. 1 = one after another,
  /// the case the loopback fit measures (the CPU moves the bytes and runs
  /// the handshakes). The executor posts all of a wave's messages before it
  /// waits (executor.hpp), and an RDMA NIC works on many work requests at
  /// once (`ucx_info -c`, UCX 1.13: UCX_RC_MLX5_TX_QUEUE_LEN=256 and
  /// UCX_DC_MLX5_TX_QUEUE_LEN=128 per endpoint), so the cluster presets
  /// assume 16: 0.31 us a message at 5 us latency, about a put's CPU posting
  /// cost. Not measured here (no RDMA NIC); the README shows the anchors at
  /// 1, 4 and 16.
  std::int64_t messages_in_flight = 1;
  PlacementKind placement = PlacementKind::launch;
  std::vector<std::int64_t> rank_gpus;  ///< placement "gpus": GPU of each global rank

  double nic_bytes_per_s() const { return nic_gbps * 1e9 / 8; }
  double nvlink_bytes_per_s() const { return nvlink_gbps * 1e9 / 8; }
  double memcpy_bytes_per_s() const { return memcpy_gbps * 1e9 / 8; }
  double staging_copy_bytes_per_s() const { return staging_copy_gbps * 1e9 / 8; }
  double quantize_bytes_per_s() const { return quantize_gbps * 1e9 / 8; }
  double fabric_bytes_per_s() const { return fabric_gbps * 1e9 / 8; }
  std::int64_t node_of_gpu(std::int64_t g) const { return g / gpus_per_node; }
  std::int64_t domain_of_gpu(std::int64_t g) const { return g / nvlink_domain; }

  /// Throws naming the field at fault.
  void validate(const std::string& origin = "<topology>") const {
    auto bad = [&](const char* field, const std::string& what) {
      throw LayoutError(ErrorContext{origin, "", field}, what);
    };
    if (gpus_per_node < 1) bad("gpus_per_node", fmt::format("{} GPUs per node; must be >= 1", gpus_per_node));
    if (nvlink_domain < 1) bad("nvlink_domain", fmt::format("{} GPUs per NVLink domain; must be >= 1", nvlink_domain));
    if (nvlink_domain % gpus_per_node != 0)
      bad("nvlink_domain", fmt::format("an NVLink domain of {} GPUs is not a whole number of {}-GPU nodes",
                                       nvlink_domain, gpus_per_node));
    if (!(nic_gbps > 0) || !std::isfinite(nic_gbps)) bad("nic_gbps", fmt::format("{} must be a positive number", nic_gbps));
    if (!(nvlink_gbps > 0) || !std::isfinite(nvlink_gbps))
      bad("nvlink_gbps", fmt::format("{} must be a positive number", nvlink_gbps));
    if (!(memcpy_gbps >= 0) || !std::isfinite(memcpy_gbps))
      bad("memcpy_gbps", fmt::format("{} must be >= 0 (0: local copies are free)", memcpy_gbps));
    if (!(fabric_gbps >= 0) || !std::isfinite(fabric_gbps))
      bad("fabric_gbps", fmt::format("{} must be >= 0 (0: no shared fabric limit)", fabric_gbps));
    for (auto [v, f] : {std::pair{latency_us, "latency_us"}, std::pair{nvlink_latency_us, "nvlink_latency_us"},
                        std::pair{stage_latency_us, "stage_latency_us"}})
      if (!(v >= 0) || !std::isfinite(v)) bad(f, fmt::format("{} must be >= 0", v));
    if (staging_budget < 64) bad("staging_budget", fmt::format("{} must be >= 64 (the executor's minimum)", staging_budget));
    if (zero_copy_min < 0) bad("zero_copy_min", fmt::format("{} must be >= 0", zero_copy_min));
    if (!(staging_copy_gbps >= 0) || !std::isfinite(staging_copy_gbps))
      bad("staging_copy_gbps", fmt::format("{} must be >= 0 (0: staging copies are free)", staging_copy_gbps));
    if (!(staging_run_ns >= 0) || !std::isfinite(staging_run_ns))
      bad("staging_run_ns", fmt::format("{} must be >= 0", staging_run_ns));
    if (messages_in_flight < 1)
      bad("messages_in_flight", fmt::format("{} must be >= 1 (1: messages one after another)", messages_in_flight));
    if (!(quantize_gbps >= 0) || !std::isfinite(quantize_gbps))
      bad("quantize_gbps", fmt::format("{} must be >= 0 (0: quantizing is free)", quantize_gbps));
    if (!(host_cores >= 0) || !std::isfinite(host_cores))
      bad("host_cores", fmt::format("{} must be >= 0 (0: no shared host)", host_cores));
    if (placement == PlacementKind::explicit_gpus && rank_gpus.empty())
      bad("rank_gpus", "placement \"gpus\" needs the list of GPUs, one per global rank");
    std::set<std::int64_t> seen;
    for (std::size_t r = 0; r < rank_gpus.size(); ++r) {
      if (rank_gpus[r] < 0) bad("rank_gpus", fmt::format("rank {} is placed on GPU {}; GPUs are >= 0", r, rank_gpus[r]));
      if (!seen.insert(rank_gpus[r]).second)
        bad("rank_gpus", fmt::format("GPU {} is given to two ranks (rank {} and an earlier one)", rank_gpus[r], r));
    }
  }
};

/// Messages in flight per GPU on the cluster presets (Topology::messages_in_flight).
inline constexpr std::int64_t kRdmaMessagesInFlight = 16;

/// The named presets. Nominal line rates; the lower bound and the
/// prediction use the same numbers, so their ratio does not depend on them.
inline std::vector<std::string> topology_preset_names() {
  return {"h100-8x400g", "h200-8x400g", "gb200-nvl72", "loopback"};
}

inline std::optional<Topology> topology_preset(const std::string& name) {
  Topology t;
  t.name = name;
  if (name == "h100-8x400g" || name == "h200-8x400g") {
    // DGX/HGX H100 and H200: 8 GPUs per node on NVSwitch (NVLink 4: 900 GB/s
    // both ways = 450 GB/s each way per GPU), one 400 Gb/s NIC per GPU.
    t.gpus_per_node = 8;
    t.nvlink_domain = 8;
    t.nic_gbps = 400;
    t.nvlink_gbps = 3600;
    t.memcpy_gbps = name == "h100-8x400g" ? 8 * 1500 : 8 * 2200;  // ~half of HBM bandwidth: read + write
    t.messages_in_flight = kRdmaMessagesInFlight;
    return t;
  }
  if (name == "gb200-nvl72") {
    // GB200 NVL72: 18 trays of 4 GPUs in one NVLink domain (NVLink 5:
    // 1.8 TB/s both ways = 900 GB/s each way per GPU), 400 Gb/s per GPU.
    t.gpus_per_node = 4;
    t.nvlink_domain = 72;
    t.nic_gbps = 400;
    t.nvlink_gbps = 7200;
    t.memcpy_gbps = 8 * 3000;
    t.messages_in_flight = kRdmaMessagesInFlight;
    return t;
  }
  if (name == "loopback") {
    // UCX over TCP loopback on this 2-core machine (sim/simulate.hpp,
    // "Calibration"; bench/calibration/compare.py refits these numbers from
    // a fresh measurement): every process is its own node, so every copy is
    // a network flow, and all flows share the host (fabric): one pair of
    // processes already fills both cores. Fitted 2026-12-03 from two quiet
    // measurements pooled (fuzzers stopped; bench/calibration/runs/):
    // 2.89 GB/s, 13.0 us per message (64 KiB zero-copy), 127 us per refit
    // (its barrier and agreement, as the stage latency), and staging copies
    // on the same cores at 11.1 GB/s plus 75 ns per run.
    t.gpus_per_node = 1;
    t.nvlink_domain = 1;
    t.nic_gbps = 8 * 2.89;
    t.nvlink_gbps = 8 * 2.89;
    t.fabric_gbps = 8 * 2.89;
    t.memcpy_gbps = 0;
    t.latency_us = 13.0;
    t.nvlink_latency_us = 13.0;
    t.stage_latency_us = 127;
    t.staging_copy_gbps = 8 * 11.1;
    t.staging_run_ns = 75;
    // FP8 quantizing (block, 128x128 BF16 tiles) as two senders get it at
    // once: bench/quantize_bench.cpp, two processes together, 5.2-5.7 Gb/s of
    // FP8 bytes each (one alone: 10.3-10.7), docs/measurements.md (netbed).
    t.quantize_gbps = 5.4;
    t.host_cores = 2;  // this machine's cores, shared by every process of a refit
    return t;
  }
  return std::nullopt;
}

/// Parses the JSON form (see the top of this file); `origin` names the file in errors.
inline Topology parse_topology(const nlohmann::json& j, const std::string& origin) {
  auto bad = [&](const std::string& field, const std::string& what) -> void {
    throw LayoutError(ErrorContext{origin, "", field}, what);
  };
  if (!j.is_object()) bad("", fmt::format("a topology is a JSON object, not {}", j.type_name()));
  static const std::set<std::string> known = {"name",        "base",          "gpus_per_node",    "nvlink_domain",
                                              "nic_gbps",    "nvlink_gbps",   "memcpy_gbps",      "fabric_gbps", "latency_us",
                                              "nvlink_latency_us", "stage_latency_us", "staging_budget", "zero_copy_min",
                                              "host_cores", "staging_copy_gbps", "staging_run_ns", "quantize_gbps",
                                              "messages_in_flight", "placement", "rank_gpus"};
  for (const auto& [k, v] : j.items())
    if (!known.count(k))
      bad(k, fmt::format("unknown field (known: name base gpus_per_node nvlink_domain nic_gbps nvlink_gbps "
                         "memcpy_gbps fabric_gbps latency_us nvlink_latency_us stage_latency_us staging_budget zero_copy_min host_cores "
                         "staging_copy_gbps staging_run_ns quantize_gbps messages_in_flight placement rank_gpus)"));
  Topology t;
  if (auto it = j.find("base"); it != j.end()) {
    if (!it->is_string()) bad("base", fmt::format("expected a preset name (a string), got {}", it->type_name()));
    auto p = topology_preset(it->get<std::string>());
    if (!p)
      bad("base", fmt::format("unknown preset '{}' (presets: {})", it->get<std::string>(),
                              fmt::join(topology_preset_names(), ", ")));
    t = *p;
  }
  t.name = origin;
  if (auto it = j.find("name"); it != j.end()) {
    if (!it->is_string()) bad("name", fmt::format("expected a string, got {}", it->type_name()));
    t.name = it->get<std::string>();
  }
  auto integer = [&](const char* f, std::int64_t& out) {
    auto it = j.find(f);
    if (it == j.end()) return;
    if (!it->is_number_integer()) bad(f, fmt::format("expected an integer, got {}", it->dump()));
    out = it->get<std::int64_t>();
  };
  auto number = [&](const char* f, double& out) {
    auto it = j.find(f);
    if (it == j.end()) return;
    if (!it->is_number()) bad(f, fmt::format("expected a number, got {}", it->dump()));
    out = it->get<double>();
  };
  integer("gpus_per_node", t.gpus_per_node);
  integer("nvlink_domain", t.nvlink_domain);
  number("nic_gbps", t.nic_gbps);
  number("nvlink_gbps", t.nvlink_gbps);
  number("memcpy_gbps", t.memcpy_gbps);
  number("fabric_gbps", t.fabric_gbps);
  number("latency_us", t.latency_us);
  number("nvlink_latency_us", t.nvlink_latency_us);
  number("stage_latency_us", t.stage_latency_us);
  integer("staging_budget", t.staging_budget);
  integer("zero_copy_min", t.zero_copy_min);
  number("host_cores", t.host_cores);
  number("staging_copy_gbps", t.staging_copy_gbps);
  number("staging_run_ns", t.staging_run_ns);
  number("quantize_gbps", t.quantize_gbps);
  integer("messages_in_flight", t.messages_in_flight);
  if (auto it = j.find("rank_gpus"); it != j.end()) {
    if (!it->is_array()) bad("rank_gpus", fmt::format("expected an array of GPU numbers, got {}", it->type_name()));
    t.rank_gpus.clear();
    for (std::size_t i = 0; i < it->size(); ++i) {
      if (!(*it)[i].is_number_integer())
        bad(fmt::format("rank_gpus[{}]", i), fmt::format("expected an integer GPU number, got {}", (*it)[i].dump()));
      t.rank_gpus.push_back((*it)[i].get<std::int64_t>());
    }
    t.placement = PlacementKind::explicit_gpus;
  }
  if (auto it = j.find("placement"); it != j.end()) {
    if (!it->is_string()) bad("placement", fmt::format("expected \"launch\", \"separate\" or \"gpus\", got {}", it->dump()));
    const auto p = it->get<std::string>();
    if (p == "launch") t.placement = PlacementKind::launch;
    else if (p == "separate") t.placement = PlacementKind::separate;
    else if (p == "gpus") t.placement = PlacementKind::explicit_gpus;
    else bad("placement", fmt::format("'{}' is not one of launch, separate, gpus", p));
    if (t.placement != PlacementKind::explicit_gpus && j.contains("rank_gpus"))
      bad("placement", fmt::format("placement '{}' and an explicit rank_gpus list contradict each other", p));
  }
  t.validate(origin);
  return t;
}

/// A preset name, or a JSON file.
inline Topology load_topology(const std::string& name_or_file) {
  if (auto p = topology_preset(name_or_file)) return *p;
  std::ifstream f(name_or_file);
  if (!f)
    fail("topology '{}': neither a preset ({}) nor a readable file", name_or_file,
         fmt::join(topology_preset_names(), ", "));
  const std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  return parse_topology(parse_json_text(text, name_or_file), name_or_file);
}

/// Where every global rank of a refit runs: GPU, node, NVLink domain.
class RankPlacement {
 public:
  RankPlacement() = default;
  /// Places the ranks of both layouts (see the placement kinds at the top).
  RankPlacement(const Topology& topo, const Layout& src, const Layout& dst) : topo_(topo) {
    topo.validate(topo.name);
    std::set<std::int64_t> src_ranks, all;
    for (auto r : src.mesh.global_ranks()) src_ranks.insert(r);
    for (auto r : dst.mesh.global_ranks()) all.insert(r);
    all.insert(src_ranks.begin(), src_ranks.end());
    switch (topo.placement) {
      case PlacementKind::launch:
        for (auto r : all) gpu_[r] = r;
        break;
      case PlacementKind::explicit_gpus:
        for (auto r : all) {
          if (r >= static_cast<std::int64_t>(topo.rank_gpus.size()))
            throw LayoutError(ErrorContext{topo.name, "", "rank_gpus"},
                              fmt::format("lists {} ranks but the layouts use rank {}", topo.rank_gpus.size(), r));
          gpu_[r] = topo.rank_gpus[static_cast<std::size_t>(r)];
        }
        break;
      case PlacementKind::separate: {
        std::int64_t g = 0;
        for (auto r : src_ranks) gpu_[r] = g++;
        g = (g + topo.nvlink_domain - 1) / topo.nvlink_domain * topo.nvlink_domain;
        for (auto r : all)
          if (!src_ranks.count(r)) gpu_[r] = g++;
        break;
      }
    }
    index();
  }
  const Topology& topology() const { return topo_; }
  std::int64_t gpu(std::int64_t rank) const {
    if (rank >= 0 && rank < static_cast<std::int64_t>(fast_.size())) {
      const std::int64_t g = fast_[static_cast<std::size_t>(rank)];
      if (g >= 0) return g;
    }
    fail("topology: rank {} is in neither layout", rank);
  }
  std::int64_t node(std::int64_t rank) const { return topo_.node_of_gpu(gpu(rank)); }
  std::int64_t domain(std::int64_t rank) const { return topo_.domain_of_gpu(gpu(rank)); }
  bool same_domain(std::int64_t a, std::int64_t b) const { return domain(a) == domain(b); }
  /// rank -> GPU for every rank of the two layouts.
  const std::map<std::int64_t, std::int64_t>& gpus() const { return gpu_; }

 private:
  void index() {
    // Dense lookup by rank: the simulator asks once per copy.
    const std::int64_t top = gpu_.empty() ? 0 : gpu_.rbegin()->first + 1;
    if (top > (std::int64_t{1} << 26)) fail("topology: rank numbers up to {} are too large to place", top - 1);
    fast_.assign(static_cast<std::size_t>(top), -1);
    for (auto [r, g] : gpu_) fast_[static_cast<std::size_t>(r)] = g;
  }
  Topology topo_;
  std::map<std::int64_t, std::int64_t> gpu_;
  std::vector<std::int64_t> fast_;
};

}  // namespace reshard
