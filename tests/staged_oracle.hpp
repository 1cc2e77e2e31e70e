#pragma once
// The oracle for staged schedules (CONTRACT.md §2 "Staged schedules"), on top
// of oracle.hpp's slot arithmetic (which never calls the library's storage or
// box code):
//
//   check_staged(src, dst, s)    replays the copies stage by stage, slot by
//                                slot: a copy with src_layout = dst reads the
//                                destination buffer of its source rank, and
//                                every slot it reads must have been written,
//                                with the element it should hold, in an
//                                earlier stage; every destination slot that
//                                holds an element is written exactly once
//                                with that element; no padding; minimal (no
//                                element a rank holds in the source layout
//                                comes to it from another rank).
//   domain_traffic(src, dst, s, place)
//                                per destination NVLink domain: the unique
//                                bytes its ranks need that no source GPU of
//                                the domain holds (by element sets), and the
//                                bytes the schedule brings into it from other
//                                domains.
#include <algorithm>
#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "oracle.hpp"
#include "reshard/plan/hierarchical.hpp"
#include "reshard/plan/topology.hpp"

namespace staged_oracle {

using oracle::CheckOptions;
using oracle::CheckResult;
using oracle::SlotWorld;
using reshard::Layout;

/// A small test cluster: `node` GPUs per node, `domain` per NVLink domain.
inline reshard::Topology small_topology(std::int64_t node, std::int64_t domain, reshard::PlacementKind placement) {
  reshard::Topology t;
  t.name = fmt::format("test-{}x{}", node, domain);
  t.gpus_per_node = node;
  t.nvlink_domain = domain;
  t.placement = placement;
  return t;
}

/// A staged schedule replayed by the plan oracle's one walk (stages in order,
/// "src_layout": "dst" copies reading what an earlier stage wrote).
inline CheckResult check_staged(const Layout& src, const Layout& dst, const reshard::StagedSchedule& ss,
                                const CheckOptions& opt = {}) {
  return oracle::detail::replay(src, dst, ss.schedule, opt, ss.stage, ss.from_dst);
}

struct DomainTraffic {
  double unique = 0;    ///< bytes needed in the domain that no source GPU of the domain holds
  double incoming = 0;  ///< bytes the schedule brings in from other domains
};

inline std::map<std::int64_t, DomainTraffic> domain_traffic(const Layout& src, const Layout& dst,
                                                            const reshard::StagedSchedule& ss,
                                                            const reshard::RankPlacement& place) {
  std::map<std::int64_t, DomainTraffic> out;
  SlotWorld S(src), D(dst);
  const std::vector<int> src_of = oracle::source_of(src, dst);
  // Per domain: the set of (src tensor, index) its destination ranks need,
  // and the set its source GPUs hold.
  std::map<std::int64_t, std::set<std::pair<int, std::int64_t>>> need, have;
  for (std::int64_t p = 0; p < S.positions(); ++p) {
    const auto dom = place.domain(oracle::rank_at(src.mesh, p));
    for (const auto& buf : S.at(p).buffers)
      for (const auto& slot : buf)
        if (!slot.padding()) have[dom].insert({slot.tensor, slot.index});
  }
  std::map<int, std::int64_t> ebytes;
  for (std::int64_t q = 0; q < D.positions(); ++q) {
    const auto dom = place.domain(oracle::rank_at(dst.mesh, q));
    out[dom];
    for (const auto& buf : D.at(q).buffers)
      for (const auto& slot : buf) {
        if (slot.padding()) continue;
        const int st = src_of[static_cast<std::size_t>(slot.tensor)];
        ebytes[st] = reshard::element_bytes(dst.tensors[static_cast<std::size_t>(slot.tensor)].dtype);
        need[dom].insert({st, slot.index});
      }
  }
  for (auto& [dom, set] : need) {
    const auto& h = have[dom];
    for (const auto& e : set)
      if (!h.count(e)) out[dom].unique += static_cast<double>(ebytes[e.first]);
  }
  for (const auto& c : ss.schedule.copies)
    if (place.domain(c.src_rank) != place.domain(c.dst_rank)) out[place.domain(c.dst_rank)].incoming += static_cast<double>(c.bytes());
  return out;
}

}  // namespace staged_oracle
