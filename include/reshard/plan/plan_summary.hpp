#pragma once
// A plan summarized for people, as `reshard-plan` prints it: both layouts
// (ranks, tensors, bytes held), the plan (copies, network and local bytes,
// per-rank send and receive maxima and their ranks, replica balance, plan
// time) and the time the slowest rank's bytes take at a NIC rate.
//
//   fmt::print("{}", reshard::plan_summary(schedule, src, dst));
#include <algorithm>
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "../layout/layout.hpp"
#include "../layout/storage.hpp"
#include "../schedule/schedule.hpp"
#include "plan.hpp"

namespace reshard {

/// "1.50 MiB (1572864 B)" for people.
inline std::string human_bytes(double b) {
  static const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  int u = 0;
  double v = b;
  while (v >= 1024 && u < 6) {
    v /= 1024;
    ++u;
  }
  if (u == 0) return fmt::format("{:.0f} B", b);
  return fmt::format("{:.2f} {} ({:.0f} B)", v, units[u], b);
}

inline std::string human_seconds(double s) {
  if (s < 1e-3) return fmt::format("{:.1f} us", s * 1e6);
  if (s < 1) return fmt::format("{:.2f} ms", s * 1e3);
  return fmt::format("{:.2f} s", s);
}

/// "0-7" for a contiguous mesh, else the list (shortened when long).
inline std::string rank_set(const Mesh& m) {
  if (m.ranks.empty()) {
    if (m.size() == 1) return fmt::format("{}", m.first_rank);
    return fmt::format("{}-{}", m.first_rank, m.first_rank + m.size() - 1);
  }
  if (m.ranks.size() <= 16) return fmt::format("[{}]", fmt::join(m.ranks, ", "));
  return fmt::format("[{}, ... {} more]", fmt::join(m.ranks.begin(), m.ranks.begin() + 8, ", "), m.ranks.size() - 8);
}

inline std::string mesh_shape(const Mesh& m) {
  std::vector<std::string> parts;
  for (const auto& a : m.axes) parts.push_back(fmt::format("{}={}", a.name, a.size));
  return fmt::format("{}", fmt::join(parts, " x "));
}

/// One side of the plan as people read it: ranks, tensors, bytes held.
inline std::string describe_layout(const char* role, const Layout& L) {
  double logical = 0, held = 0, max_held = 0;
  std::int64_t max_rank = L.mesh.global_rank(0);
  for (const auto& t : L.tensors) logical += static_cast<double>(t.elements()) * static_cast<double>(element_bytes(t.dtype));
  const auto& bufs = L.local_buffers();
  for (std::int64_t p = 0; p < L.mesh.size(); ++p) {
    double on_rank = 0;
    for (std::size_t b = 0; b < bufs.size(); ++b)
      on_rank += static_cast<double>(buffer_elements(L, p, static_cast<int>(b))) *
                 static_cast<double>(element_bytes(bufs[b].dtype));
    held += on_rank;
    if (on_rank > max_held) {
      max_held = on_rank;
      max_rank = L.mesh.global_rank(p);
    }
  }
  std::string s = fmt::format("{} {}\n", role, L.origin);
  s += fmt::format("  mesh         {} ({} ranks: {})\n", mesh_shape(L.mesh), L.mesh.size(), rank_set(L.mesh));
  s += fmt::format("  tensors      {} ({} of tensor data)\n", L.tensors.size(), human_bytes(logical));
  s += fmt::format("  buffers      {} names; {} held over all ranks (replicas and padding included)\n", bufs.size(),
                   human_bytes(held));
  s += fmt::format("  most held    {} on rank {}\n", human_bytes(max_held), max_rank);
  return s;
}

/// The plan as people read it: bytes, copies, per-rank maxima and their ranks.
/// `shares`: the whole plan's replica shares (max send then names the worst ratio).
inline std::string describe_plan(const Schedule& s, std::int64_t only_rank, const Layout& src, const Layout& dst,
                                 const ReplicaShares* shares = nullptr) {
  std::map<std::int64_t, double> sent, received;
  for (const auto& c : s.copies) {
    if (c.is_local()) continue;
    sent[c.src_rank] += static_cast<double>(c.bytes());
    received[c.dst_rank] += static_cast<double>(c.bytes());
  }
  auto top = [](const std::map<std::int64_t, double>& m) {
    std::pair<std::int64_t, double> best{-1, 0};
    for (const auto& [r, b] : m)
      if (b > best.second) best = {r, b};
    return best.first < 0 ? std::string("0 B") : fmt::format("{} by rank {}", human_bytes(best.second), best.first);
  };
  std::string out = "plan\n";
  if (only_rank >= 0) {
    const bool in_src = src.mesh.position_of(only_rank).has_value();
    const bool in_dst = dst.mesh.position_of(only_rank).has_value();
    out += fmt::format("  only rank    {} ({})\n", only_rank,
                       in_src && in_dst ? "on both sides"
                       : in_src         ? "source side"
                       : in_dst         ? "destination side"
                                        : "in neither layout: it sends and receives nothing");
  }
  out += fmt::format("  copies       {}\n", s.copies.size());
  out += fmt::format("  network      {}\n", human_bytes(static_cast<double>(s.stats.bytes)));
  out += fmt::format("  local        {}\n", human_bytes(static_cast<double>(s.stats.local_bytes)));
  std::map<std::pair<std::int64_t, std::int64_t>, int> pairs;
  for (const auto& c : s.copies)
    if (!c.is_local()) pairs[{c.src_rank, c.dst_rank}] = 1;
  auto mean = [](const std::map<std::int64_t, double>& m) {
    double t = 0;
    for (const auto& kv : m) t += kv.second;
    return m.empty() ? 0.0 : t / static_cast<double>(m.size());
  };
  out += fmt::format("  messages     {} peer pairs (each: a packed message per wave, and one per zero-copy or one-sided piece)\n", pairs.size());
  out += fmt::format("  max send     {}{}\n", top(sent),
                     shares && shares->worst_rank >= 0
                         ? fmt::format("; worst {:.2f}x its replica share (rank {})", shares->worst_ratio, shares->worst_rank)
                         : std::string());
  out += fmt::format("  mean send    {} over {} sending ranks\n", human_bytes(mean(sent)), sent.size());
  out += fmt::format("  max receive  {}\n", top(received));
  out += fmt::format("  mean receive {} over {} receiving ranks\n", human_bytes(mean(received)), received.size());
  out += fmt::format("  ranks        {} distinct over both sides\n", s.stats.ranks);
  out += fmt::format("  planned in   {}\n", human_seconds(s.stats.plan_seconds));
  return out;
}

/// The slowest rank's bytes over a per-GPU NIC of `gbps` gigabits per second:
/// the time a refit would take if every rank sent and received at line rate.
inline std::string describe_nic(const Schedule& s, double gbps) {
  const double worst = static_cast<double>(std::max(s.stats.max_send_bytes, s.stats.max_recv_bytes));
  return fmt::format("  at {} Gb/s  {} (slowest rank's {} / NIC bandwidth)\n", gbps,
                     human_seconds(worst / (gbps * 1e9 / 8)), human_bytes(worst));
}

/// The source x destination traffic matrix as an SVG heat map.

struct PlanSummaryOptions {
  std::int64_t only_rank = -1;            ///< the schedule is this rank's only (-1: the whole plan)
  const ReplicaShares* shares = nullptr;  ///< the whole plan's replica shares (replica_shares()), for the balance
  double nic_gbps = 400;                  ///< per-GPU NIC rate for the time line (0: no such line)
};

/// Both layouts, the plan and its time at the NIC rate.
inline std::string plan_summary(const Schedule& s, const Layout& src, const Layout& dst, const PlanSummaryOptions& o = {}) {
  std::string text = describe_layout("source     ", src) + describe_layout("destination", dst) + describe_plan(s, o.only_rank, src, dst, o.shares);
  if (o.nic_gbps > 0) text += describe_nic(s, o.nic_gbps);
  return text;
}

}  // namespace reshard
