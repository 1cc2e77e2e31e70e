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
#include <numeric>
#include <set>
#include <string>
#include <vector>

#include "oracle.hpp"
#include "reshard/plan/hierarchical.hpp"
#include "reshard/plan/topology.hpp"

namespace staged_oracle {

using oracle::CheckOptions;
using oracle::CheckResult;
using oracle::Slot;
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

inline CheckResult check_staged(const Layout& src, const Layout& dst, const reshard::StagedSchedule& ss,
                                const CheckOptions& opt = {}) {
  CheckResult res;
  auto fault = [&](std::string msg) {
    res.ok = false;
    res.fault = std::move(msg);
    return res;
  };
  const auto& s = ss.schedule;
  const auto& sbufs = src.local_buffers();
  const auto& dbufs = dst.local_buffers();
  if (!ss.stage.empty() && ss.stage.size() != s.copies.size())
    return fault(fmt::format("{} stages for {} copies", ss.stage.size(), s.copies.size()));
  if (!ss.from_dst.empty() && ss.from_dst.size() != s.copies.size())
    return fault(fmt::format("{} src_layout flags for {} copies", ss.from_dst.size(), s.copies.size()));
  if (s.src_buffers.size() != sbufs.size() || s.dst_buffers.size() != dbufs.size())
    return fault("schedule buffer names do not match the layouts");
  for (std::size_t b = 0; b < sbufs.size(); ++b)
    if (s.src_buffers[b] != sbufs[b].name) return fault(fmt::format("source buffer {} is misnamed", b));
  for (std::size_t b = 0; b < dbufs.size(); ++b)
    if (s.dst_buffers[b] != dbufs[b].name) return fault(fmt::format("destination buffer {} is misnamed", b));
  const std::vector<int> src_of = oracle::source_of(src, dst);
  SlotWorld S(src), D(dst);
  // Per (dst position, buffer): the stage each slot was written in (-1 = not yet).
  std::map<std::pair<std::int64_t, std::size_t>, std::vector<std::int32_t>> written;
  auto written_of = [&](std::int64_t pos, std::size_t b) -> std::vector<std::int32_t>& {
    auto& w = written[{pos, b}];
    if (w.empty()) w.assign(D.at(pos).buffers[b].size(), -1);
    return w;
  };
  std::vector<std::size_t> order(s.copies.size());
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return ss.stage_of(a) < ss.stage_of(b); });
  std::int64_t bytes = 0, local_bytes = 0;
  for (auto ci : order) {
    const auto& c = s.copies[ci];
    const std::int32_t stage = ss.stage_of(ci);
    const bool from_dst = ss.reads_dst(ci);
    const auto where = [&] {
      return fmt::format("copy {} (stage {}{}, {})", ci, stage, from_dst ? ", src_layout dst" : "", oracle::describe_copy(c));
    };
    if (stage < 0) return fault(fmt::format("{}: negative stage", where()));
    if (c.rank < 1 || c.rank > reshard::kMaxBoxRank) return fault(fmt::format("{}: box rank {}", where(), c.rank));
    for (int d = 0; d < c.rank; ++d)
      if (c.extent(d) < 1) return fault(fmt::format("{}: empty extent", where()));
    const auto dpos = D.ranks().position(c.dst_rank);
    if (!dpos) return fault(fmt::format("{}: destination rank not in the destination mesh", where()));
    const auto spos = from_dst ? D.ranks().position(c.src_rank) : S.ranks().position(c.src_rank);
    if (!spos)
      return fault(fmt::format("{}: source rank {} is not in the {} mesh", where(), c.src_rank, from_dst ? "destination" : "source"));
    const auto sb = static_cast<std::size_t>(c.src_buffer), db = static_cast<std::size_t>(c.dst_buffer);
    if (c.src_buffer < 0 || sb >= (from_dst ? dbufs.size() : sbufs.size()) || c.dst_buffer < 0 || db >= dbufs.size())
      return fault(fmt::format("{}: buffer id out of range", where()));
    if (c.tensor < 0 || static_cast<std::size_t>(c.tensor) >= dst.tensors.size())
      return fault(fmt::format("{}: tensor id out of range", where()));
    const auto& dts = dst.tensors[static_cast<std::size_t>(c.tensor)];
    if (c.element_bytes != reshard::element_bytes(dts.dtype)) return fault(fmt::format("{}: element_bytes", where()));
    const auto& from_rank = from_dst ? D.at(*spos) : S.at(*spos);
    const auto& to_rank = D.at(*dpos);
    if (!from_rank.present[sb]) return fault(fmt::format("{}: rank {} has no such source buffer", where(), c.src_rank));
    if (!to_rank.present[db]) return fault(fmt::format("{}: rank {} has no such destination buffer", where(), c.dst_rank));
    const auto& sslots = from_rank.buffers[sb];
    const auto& dslots = to_rank.buffers[db];
    auto& w = written_of(*dpos, db);
    std::vector<std::int32_t>* wsrc = from_dst ? &written_of(*spos, sb) : nullptr;
    const auto dst_in_src = S.ranks().position(c.dst_rank);
    const bool local = c.src_rank == c.dst_rank && !from_dst;
    std::string msg;
    std::int64_t visited = 0;
    const bool fine = oracle::detail::for_each_element(c, [&](const std::vector<std::int64_t>& i, std::int64_t so, std::int64_t dof) {
      const auto at = [&] { return fmt::format("{} at box index [{}]", where(), fmt::join(i, ",")); };
      if (so < 0 || so >= static_cast<std::int64_t>(sslots.size())) {
        msg = fmt::format("{}: source offset {} out of bounds", at(), so);
        return false;
      }
      if (dof < 0 || dof >= static_cast<std::int64_t>(dslots.size())) {
        msg = fmt::format("{}: destination offset {} out of bounds", at(), dof);
        return false;
      }
      const Slot& fromv = sslots[static_cast<std::size_t>(so)];
      const Slot& to = dslots[static_cast<std::size_t>(dof)];
      if (to.padding()) {
        msg = fmt::format("{}: writes padding", at());
        return false;
      }
      if (fromv.padding()) {
        msg = fmt::format("{}: reads padding", at());
        return false;
      }
      if (to.tensor != c.tensor) {
        msg = fmt::format("{}: writes {} but the copy says tensor {}", at(), oracle::describe_slot(dst, to), c.tensor);
        return false;
      }
      const bool same = from_dst ? fromv.tensor == to.tensor && fromv.index == to.index
                                 : src_of[static_cast<std::size_t>(to.tensor)] == fromv.tensor && fromv.index == to.index;
      if (!same) {
        msg = fmt::format("{}: slot holds {} but reads {}", at(), oracle::describe_slot(dst, to),
                          oracle::describe_slot(from_dst ? dst : src, fromv));
        return false;
      }
      if (wsrc) {
        const std::int32_t ws = (*wsrc)[static_cast<std::size_t>(so)];
        if (ws < 0 || ws >= stage) {
          msg = fmt::format("{}: reads {} on rank {} before an earlier stage wrote it ({})", at(),
                            oracle::describe_slot(dst, fromv), c.src_rank,
                            ws < 0 ? std::string("not written yet") : fmt::format("written in stage {}", ws));
          return false;
        }
      }
      auto& wr = w[static_cast<std::size_t>(dof)];
      if (wr >= 0) {
        msg = fmt::format("{}: {} is written again (first in stage {})", at(), oracle::describe_slot(dst, to), wr);
        return false;
      }
      wr = stage;
      if (opt.minimal && !local && dst_in_src) {
        const int st = src_of[static_cast<std::size_t>(to.tensor)];
        if (S.holds(*dst_in_src, st, to.index)) {
          msg = fmt::format("{}: not minimal: rank {} already holds {} in the source layout", at(), c.dst_rank,
                            oracle::describe_slot(dst, to));
          return false;
        }
      }
      ++res.elements;
      ++visited;
      return true;
    });
    if (!fine) return fault(msg);
    ++res.copies;
    // Counted from the elements visited (not the library's Copy::bytes()).
    (c.src_rank == c.dst_rank ? local_bytes : bytes) += visited * reshard::element_bytes(dts.dtype);
  }
  if (auto m = oracle::unwritten_slot(dst, D, written, -1, res.dst_elements)) return fault(*m);
  if (auto m = oracle::stats_fault(s, bytes, local_bytes)) return fault(*m);
  return res;
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
