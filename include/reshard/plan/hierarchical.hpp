#pragma once
// Topology-aware plans, built on plan() (plan.hpp) without changing it.
//
// choose_senders() / prefer_near(): replica choice that prefers a source in
//   the destination's node, then its NVLink domain, and among the nearest
//   the least busy sender port per stage. A copy may move to any replica of
//   the same source part whose storage of the tensor is identical (same
//   buffer, boxes, offsets: then it reads the same elements there). The
//   schedule stays minimal (only the sending rank changes).
//
// plan_hierarchical(): a staged schedule (CONTRACT.md §2 "Staged schedules")
//   in which each unique byte a destination NVLink domain needs crosses the
//   network once into the domain, then fans out inside it:
//   - the destination ranks of a domain that hold the same piece of a tensor
//     (the same part, and for flat buffers the same range) and hold nothing
//     of it in the source layout form a group; one of them, the owner,
//     receives the piece (the direct plan's copies into it); the owners are
//     chosen largest piece first onto the least loaded rank, so the domain's
//     network ingress is spread over its ranks and NICs;
//   - the other members copy the piece from the owner's destination buffer
//     over NVLink ("src_layout": "dst"), in a later stage;
//   - pipelining: each rank's network copies are cut into `pipeline` chunks
//     (whole tensors, equal bytes, largest first); stage s holds chunk s's network copies
//     and the fan-out of chunk s-1, so the NVLink fan-out overlaps the
//     network (stages = pipeline + 1).
//   Ranks not in any group (a piece only one rank of the domain holds, or a
//   rank that holds some of the tensor in the source layout) keep their
//   direct copies.
#include <algorithm>
#include <array>
#include <cstdint>
#include <deque>
#include <limits>
#include <map>
#include <numeric>
#include <set>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "../layout/storage.hpp"
#include "plan.hpp"
#include "topology.hpp"

namespace reshard {

/// A schedule whose copies carry a stage and a source layout (parallel
/// vectors, so Copy stays as plan.hpp has it). `from_dst[i]`: copy i reads
/// its source buffer as a buffer of the destination layout on src_rank
/// (src_buffer is then an id into the destination's local_buffers()).
struct StagedSchedule {
  Schedule schedule;
  std::vector<std::int32_t> stage;     ///< per copy; empty = all stage 0
  std::vector<std::uint8_t> from_dst;  ///< per copy; empty = none
  std::int32_t stages = 1;
  std::int32_t stage_of(std::size_t i) const { return stage.empty() ? 0 : stage[i]; }
  bool reads_dst(std::size_t i) const { return !from_dst.empty() && from_dst[i] != 0; }
};

struct HierarchicalOptions {
  PlanOptions plan;      ///< options of the direct plan underneath (whole plan: only_rank must be -1)
  int pipeline = 4;      ///< network chunks per rank (>= 1); stages = pipeline + 1
  bool prefer_near = true;
};

/// What the hierarchical plan did, for reports and tests.
struct HierarchicalReport {
  std::int64_t groups = 0;          ///< (tensor, piece, domain) groups with >= 2 ranks
  std::int64_t fan_out_copies = 0;  ///< copies that read the destination layout
  std::int64_t fan_out_bytes = 0;
  std::int64_t dropped_bytes = 0;   ///< direct-plan bytes the fan-out replaced
  std::int64_t near_bytes = 0;      ///< bytes whose sender choose_senders() changed
};

namespace hier_detail {

inline bool same_storage(const TensorStorage& a, const TensorStorage& b) {
  if (a.buffer != b.buffer || a.boxes.size() != b.boxes.size() || a.lin_lo != b.lin_lo || a.lin_hi != b.lin_hi)
    return false;
  for (std::size_t i = 0; i < a.boxes.size(); ++i) {
    const HeldBox &x = a.boxes[i], &y = b.boxes[i];
    if (x.rank != y.rank || x.base != y.base) return false;
    for (int d = 0; d < x.rank; ++d) {
      const auto ud = static_cast<std::size_t>(d);
      if (x.lo[ud] != y.lo[ud] || x.hi[ud] != y.hi[ud] || x.stride[ud] != y.stride[ud]) return false;
    }
  }
  return true;
}

/// Local indices of a part below the tensor extent n (real elements, not
/// padding) form a prefix [0, m) of the local dim: m.
inline std::int64_t real_prefix(const DimPart& p, std::int64_t n) {
  const std::int64_t nh = p.next_held(n);
  return nh >= p.padded ? p.local_extent : p.local(nh);
}

/// Row-major indices below x of a local array of extents e whose every
/// coordinate j_d < m_d (the real elements).
inline std::int64_t real_below(const std::vector<std::int64_t>& e, const std::vector<std::int64_t>& m, std::int64_t x) {
  const std::size_t n = e.size();
  // On the stack for the usual ranks (this runs per rank and tensor).
  constexpr std::size_t kSmall = 8;
  std::array<std::int64_t, kSmall + 1> inner_a{};
  std::array<std::int64_t, kSmall> stride_a{};
  std::vector<std::int64_t> inner_v, stride_v;
  if (n > kSmall) {
    inner_v.resize(n + 1);
    stride_v.resize(n);
  }
  std::int64_t* inner = n > kSmall ? inner_v.data() : inner_a.data();  // product of m over dims > d
  std::int64_t* stride = n > kSmall ? stride_v.data() : stride_a.data();
  inner[n] = 1;
  for (std::size_t d = n; d-- > 0;) inner[d] = inner[d + 1] * m[d];
  for (std::size_t d = 0; d < n; ++d) stride[d] = 1;
  for (std::size_t d = n; d-- > 1;) stride[d - 1] = stride[d] * e[d];
  if (n == 0) return 0;
  if (x >= stride[0] * e[0]) return inner[0];
  std::int64_t count = 0;
  for (std::size_t d = 0; d < n; ++d) {
    const std::int64_t digit = x / stride[d];
    x %= stride[d];
    count += std::min(digit, m[d]) * inner[d + 1];
    if (digit >= m[d]) return count;
  }
  return count;
}

/// Real elements of what a storage holds of a tensor of shape `shape`.
inline std::int64_t real_elements(const TensorStorage& s, const std::vector<std::int64_t>& shape) {
  std::vector<std::int64_t> m(shape.size());
  for (std::size_t d = 0; d < shape.size(); ++d) m[d] = real_prefix(s.parts[d], shape[d]);
  return real_below(s.extents, m, s.lin_hi) - real_below(s.extents, m, s.lin_lo);
}

}  // namespace hier_detail

/// Topology-aware sender choice, one copy at a time (choose_senders() below
/// runs it over a schedule, streamed_traffic() over records). A copy that
/// reads the source layout across ranks may be sent by any replica of its
/// source part whose storage of the tensor is identical (then the same
/// offsets read the same elements). The nearest replicas win (same node as
/// the destination, then same NVLink domain, then any); among those, the one
/// whose port (NIC or NVLink egress) is least busy in that stage, in
/// seconds, the current sender on a tie. Callers hand it the copies whose
/// sender is fixed first (load), then the movable ones largest first
/// (choose): a greedy pass with every port's busy time shared by all copies.
class SenderChoice {
 public:
  /// top_rank: the largest rank any copy names; stages: how many there are.
  SenderChoice(const Layout& src, const Layout& dst, const RankPlacement& place, std::int64_t top_rank, std::int32_t stages)
      : src_(src), place_(place), src_of_(match_tensors(src, dst)), stages_(std::max(stages, 1)) {
    for (auto r : src.mesh.global_ranks()) top_rank = std::max(top_rank, r);
    R_ = static_cast<std::size_t>(top_rank + 1);
    inv_[0] = 1 / place.topology().nic_bytes_per_s();
    inv_[1] = 1 / place.topology().nvlink_bytes_per_s();
    busy_.assign(static_cast<std::size_t>(stages_) * R_ * 2, 0);
    member_of_.resize(static_cast<std::size_t>(stages_) * R_);
    // Replica lists by (position, tensor) in a flat array up to 2^26
    // entries (256 MB; a hash map of millions of such keys costs more and
    // is slower), else in a hash map.
    const auto cells = static_cast<std::uint64_t>(src.mesh.size()) * src.tensors.size();
    if (cells <= (std::uint64_t{1} << 26)) flat_list_.assign(static_cast<std::size_t>(cells), -1);
  }

  /// A copy whose sender stays (it reads the destination layout, or comes
  /// from a rank outside the source mesh): its port's load only.
  void load(std::int32_t stage, std::int64_t from, std::int64_t to, std::int64_t bytes) {
    const int port = place_.domain(from) == place_.domain(to) ? 1 : 0;
    add_busy(stage, from, port, static_cast<double>(bytes) * inv_[port]);
  }

  /// The sender for a copy of destination tensor dt that `from` (a source
  /// rank) would send to `to`; its port is loaded.
  std::int64_t choose(std::int32_t stage, std::int64_t from, std::int64_t to, int dt, std::int64_t bytes) {
    const auto spos = src_.mesh.position_of(from);
    if (!spos) fail("choose_senders: rank {} is not in the source mesh", from);
    const std::int32_t l = replicas_of(*spos, src_of_[static_cast<std::size_t>(dt)]);
    const auto& cand = lists_[static_cast<std::size_t>(l)].ranks;
    std::int64_t best = -1;
    int port = 0;
    if (!lists_[static_cast<std::size_t>(l)].near(place_.node(to), place_.domain(to))) {
      // No replica near the destination (nor the destination itself: the
      // common case of separate training and inference GPUs): the least busy
      // NIC, found by the list's tree, the current sender on a tie.
      const Tree& t = tree_of(stage, l);
      best = cand[static_cast<std::size_t>(t.win[1])];
      if (busy(stage, from, 0) == busy(stage, best, 0)) best = from;
    } else {
      int near = 3;
      for (auto r : cand)
        if (r != to) near = std::min(near, distance(r, to));
      port = near == 2 ? 0 : 1;
      double best_busy = 0;
      for (auto r : cand) {
        if (r == to || distance(r, to) != near) continue;
        const double b = busy(stage, r, port);
        if (best < 0 || b < best_busy || (b == best_busy && r == from)) {
          best = r;
          best_busy = b;
        }
      }
      if (best < 0) best = from;  // cannot happen: the sender is its own replica
    }
    add_busy(stage, best, port, static_cast<double>(bytes) * inv_[port]);
    return best;
  }

 private:
  /// The ranks of identical replicas, with their nodes and domains sorted.
  struct Replicas {
    std::vector<std::int64_t> ranks;
    std::vector<std::int64_t> nodes, domains;
    bool near(std::int64_t node, std::int64_t domain) const {
      return std::binary_search(nodes.begin(), nodes.end(), node) || std::binary_search(domains.begin(), domains.end(), domain);
    }
  };
  /// A tournament tree over a list's NIC busy time in one stage: the first
  /// minimum in list order (as a scan finds it) in O(log n) per update.
  struct Tree {
    std::int32_t stage = 0, list = 0;
    std::size_t leaves = 0;
    std::vector<std::int32_t> win;  ///< per node: the list position of its minimum
  };

  double& busy(std::int32_t stage, std::int64_t rank, int port) {
    return busy_[(static_cast<std::size_t>(stage) * R_ + static_cast<std::size_t>(rank)) * 2 + static_cast<std::size_t>(port)];
  }
  int distance(std::int64_t from, std::int64_t to) const {
    if (place_.node(from) == place_.node(to)) return 0;
    return place_.domain(from) == place_.domain(to) ? 1 : 2;
  }

  /// (source position, source tensor) -> its replica list. Identical
  /// storage is an equivalence: a list is found once per replica group and
  /// shared by its members, and tensors held by the same replicas share one
  /// list (a 10,000-GPU refit has thousands of replicas per part: one list
  /// per position would cost gigabytes).
  std::int32_t replicas_of(std::int64_t spos, int st) {
    const auto T = static_cast<std::int64_t>(src_.tensors.size());
    const std::int64_t key = spos * T + st;
    if (!flat_list_.empty()) {
      if (const std::int32_t l = flat_list_[static_cast<std::size_t>(key)]; l >= 0) return l;
    } else if (auto it = replica_list_.find(key); it != replica_list_.end()) {
      return it->second;
    }
    const auto& sts = src_.tensors[static_cast<std::size_t>(st)];
    std::vector<std::int64_t> parts;
    for (int d = 0; d < sts.rank(); ++d) parts.push_back(sts.dims[static_cast<std::size_t>(d)].part_of(src_.mesh, spos));
    const bool alone = sts.buffer < 0;  // stored alone: the same part is the same storage
    TensorStorage mine;
    if (!alone) mine = tensor_storage(src_, spos, st);
    std::vector<std::int64_t> ranks, members;
    for (auto h : positions_of_part(src_, st, parts))
      if (h == spos || alone || hier_detail::same_storage(tensor_storage(src_, h, st), mine)) {
        ranks.push_back(src_.mesh.global_rank(h));
        members.push_back(h);
      }
    auto [known, fresh] = by_content_.emplace(ranks, static_cast<std::int32_t>(lists_.size()));
    if (fresh) {
      Replicas rep;
      for (auto r : ranks) {
        rep.nodes.push_back(place_.node(r));
        rep.domains.push_back(place_.domain(r));
      }
      std::sort(rep.nodes.begin(), rep.nodes.end());
      std::sort(rep.domains.begin(), rep.domains.end());
      rep.ranks = std::move(ranks);
      lists_.push_back(std::move(rep));
    }
    for (auto h : members) {
      if (!flat_list_.empty())
        flat_list_[static_cast<std::size_t>(h * T + st)] = known->second;
      else
        replica_list_.emplace(h * T + st, known->second);
    }
    return known->second;
  }

  double nic_busy(const Tree& t, std::int32_t pos) {
    const auto& L = lists_[static_cast<std::size_t>(t.list)].ranks;
    return pos < static_cast<std::int32_t>(L.size()) ? busy(t.stage, L[static_cast<std::size_t>(pos)], 0)
                                                       : std::numeric_limits<double>::infinity();
  }
  std::int32_t winner(Tree& t, std::size_t node) {  // of its two children: smaller busy, then earlier
    const std::int32_t a = t.win[2 * node], b = t.win[2 * node + 1];
    const double x = nic_busy(t, a), y = nic_busy(t, b);
    return x < y || (x == y && a < b) ? a : b;
  }
  Tree& tree_of(std::int32_t stage, std::int32_t l) {
    const auto key = (static_cast<std::uint64_t>(stage) << 32) | static_cast<std::uint32_t>(l);
    auto [it, fresh] = tree_index_.emplace(key, static_cast<std::int32_t>(trees_.size()));
    if (!fresh) return trees_[static_cast<std::size_t>(it->second)];
    const auto& L = lists_[static_cast<std::size_t>(l)].ranks;
    Tree t;
    t.stage = stage;
    t.list = l;
    t.leaves = 1;
    while (t.leaves < L.size()) t.leaves *= 2;
    t.win.assign(2 * t.leaves, 0);
    for (std::size_t i = 0; i < t.leaves; ++i) t.win[t.leaves + i] = static_cast<std::int32_t>(i);
    for (std::size_t n = t.leaves - 1; n >= 1; --n) t.win[n] = winner(t, n);
    for (std::size_t i = 0; i < L.size(); ++i)
      member_of_[static_cast<std::size_t>(stage) * R_ + static_cast<std::size_t>(L[i])].emplace_back(it->second,
                                                                                                static_cast<std::int32_t>(i));
    trees_.push_back(std::move(t));
    return trees_.back();
  }
  void add_busy(std::int32_t stage, std::int64_t rank, int port, double seconds) {
    busy(stage, rank, port) += seconds;
    if (port != 0) return;
    // A rank is in a few lists only: keeping their trees current is cheap.
    for (auto [tree, pos] : member_of_[static_cast<std::size_t>(stage) * R_ + static_cast<std::size_t>(rank)]) {
      Tree& t = trees_[static_cast<std::size_t>(tree)];
      for (std::size_t node = (t.leaves + static_cast<std::size_t>(pos)) / 2; node >= 1; node /= 2) t.win[node] = winner(t, node);
    }
  }

  const Layout& src_;
  const RankPlacement& place_;
  std::vector<int> src_of_;
  std::int32_t stages_;
  std::size_t R_ = 0;
  std::array<double, 2> inv_{};  ///< seconds per byte: NIC, NVLink
  std::vector<double> busy_;     ///< (stage, rank, port: 0 NIC, 1 NVLink) seconds
  std::unordered_map<std::int64_t, std::int32_t> replica_list_;  ///< (position x T + tensor) -> list
  std::vector<std::int32_t> flat_list_;  ///< the same as a flat array (-1: not yet), when it is small enough
  std::vector<Replicas> lists_;
  std::map<std::vector<std::int64_t>, std::int32_t> by_content_;
  std::vector<Tree> trees_;
  std::unordered_map<std::uint64_t, std::int32_t> tree_index_;
  std::vector<std::vector<std::pair<std::int32_t, std::int32_t>>> member_of_;  ///< (stage, rank) -> (tree, position)
};

/// SenderChoice over a list of copies (stage[i] and from_dst[i] optional).
/// Returns the bytes whose sender changed.
inline std::int64_t choose_senders(std::vector<Copy>& copies, const std::vector<std::int32_t>* stage,
                                   const std::vector<std::uint8_t>* from_dst, const Layout& src, const Layout& dst,
                                   const RankPlacement& place) {
  auto stage_of = [&](std::size_t i) { return stage && !stage->empty() ? (*stage)[i] : 0; };
  auto reads_dst = [&](std::size_t i) { return from_dst && !from_dst->empty() && (*from_dst)[i] != 0; };
  std::int32_t stages = 1;
  std::int64_t top_rank = 0;
  for (std::size_t i = 0; i < copies.size(); ++i) {
    stages = std::max(stages, stage_of(i) + 1);
    top_rank = std::max({top_rank, copies[i].src_rank, copies[i].dst_rank});
  }
  SenderChoice choice(src, dst, place, top_rank, stages);
  std::vector<std::pair<std::int64_t, std::size_t>> movable;  // (-bytes, index): largest first, stable
  for (std::size_t i = 0; i < copies.size(); ++i) {
    const Copy& c = copies[i];
    if (c.is_local()) continue;
    // Copies into quantized (FP8) tensors keep the planner's sender: a
    // sender quantizes the tiles its scale copies name, so a weight copy
    // and its tile's scale copy must leave the same replica.
    if (reads_dst(i) || !src.mesh.position_of(c.src_rank) || c.quant != CopyQuant::none)
      choice.load(stage_of(i), c.src_rank, c.dst_rank, c.bytes());
    else
      movable.emplace_back(-c.bytes(), i);
  }
  std::sort(movable.begin(), movable.end());
  std::int64_t moved = 0;
  for (auto [neg_bytes, i] : movable) {
    Copy& c = copies[i];
    const std::int64_t best = choice.choose(stage_of(i), c.src_rank, c.dst_rank, c.tensor, c.bytes());
    if (best != c.src_rank) {
      moved += c.bytes();
      c.src_rank = best;
    }
  }
  return moved;
}

/// The plain plan made topology-aware: choose_senders() on its copies (the
/// schedule stays minimal: only senders change). Returns the bytes moved.
inline std::int64_t prefer_near(Schedule& s, const Layout& src, const Layout& dst, const RankPlacement& place) {
  const std::int64_t moved = choose_senders(s.copies, nullptr, nullptr, src, dst, place);
  if (moved) s.compute_stats(s.stats.ranks);
  return moved;
}

/// Turns a direct schedule (plan() of the whole refit, optionally after
/// prefer_near) into the hierarchical staged schedule (see the top).
inline StagedSchedule stage_hierarchical(Schedule direct, const Layout& src, const Layout& dst,
                                         const RankPlacement& place, const HierarchicalOptions& opt = {},
                                         HierarchicalReport* report = nullptr) {
  if (direct.only_rank >= 0) fail("plan_hierarchical: needs the whole plan, not one rank's (only_rank)");
  if (opt.pipeline < 1) fail("plan_hierarchical: pipeline must be >= 1, not {}", opt.pipeline);
  HierarchicalReport rep;
  for (const auto& t : dst.tensors)
    if (t.quant) fail("plan_hierarchical: tensor '{}' is quantized (FP8); two-hop plans of FP8 destinations are not supported yet", t.name);
  const std::vector<int> src_of = match_tensors(src, dst);
  const auto T = static_cast<std::int64_t>(dst.tensors.size());
  const std::int64_t D = dst.mesh.size();
  // role[pos*T + t]: -1 direct copies, -2 owner of its group, >= 0 member
  // fed by that owner position.
  std::vector<std::int32_t> role(static_cast<std::size_t>(D * T), -1);
  std::vector<double> load(static_cast<std::size_t>(D), 0);
  struct Group {
    int t;
    std::int64_t bytes;
    std::vector<std::int64_t> members;  // positions
  };
  std::vector<Group> groups;
  for (int t = 0; t < T; ++t) {
    const auto& ts = dst.tensors[static_cast<std::size_t>(t)];
    const int st = src_of[static_cast<std::size_t>(t)];
    const bool flat = ts.buffer >= 0 && dst.buffers[static_cast<std::size_t>(ts.buffer)].kind == BufferKind::flat;
    std::map<std::tuple<std::int64_t, std::uint64_t, std::int64_t, std::int64_t>, std::vector<std::int64_t>> by_piece;
    std::map<std::tuple<std::int64_t, std::uint64_t, std::int64_t, std::int64_t>, std::int64_t> piece_bytes;
    for (std::int64_t pos = 0; pos < D; ++pos) {
      if (!dst.holds(pos, t)) continue;
      const std::int64_t rank = dst.mesh.global_rank(pos);
      const auto spos = src.mesh.position_of(rank);
      const bool holds_src = spos && src.holds(*spos, st);
      std::uint64_t lin = 0;
      std::vector<std::int64_t> m(static_cast<std::size_t>(ts.rank()));
      std::int64_t real = 1;
      for (int d = 0; d < ts.rank(); ++d) {
        const auto ud = static_cast<std::size_t>(d);
        lin = lin * static_cast<std::uint64_t>(ts.cuts[ud].k) +
              static_cast<std::uint64_t>(ts.dims[ud].part_of(dst.mesh, pos));
        real *= hier_detail::real_prefix(dst.dim_part(pos, t, d), ts.shape[ud]);
      }
      std::int64_t lo = 0, hi = 0;
      if (flat) {
        const TensorStorage s = tensor_storage(dst, pos, t);
        if (s.empty()) continue;
        lo = s.lin_lo;
        hi = s.lin_hi;
        real = hier_detail::real_elements(s, ts.shape);
      }
      const std::int64_t bytes = real * element_bytes(ts.dtype);
      if (holds_src) {
        load[static_cast<std::size_t>(pos)] += static_cast<double>(bytes);
        continue;
      }
      const auto key = std::make_tuple(place.domain(rank), lin, lo, hi);
      by_piece[key].push_back(pos);
      piece_bytes[key] = bytes;
    }
    for (auto& [key, members] : by_piece) {
      const std::int64_t bytes = piece_bytes[key];
      if (members.size() == 1) {
        load[static_cast<std::size_t>(members[0])] += static_cast<double>(bytes);
        continue;
      }
      groups.push_back(Group{t, bytes, std::move(members)});
    }
  }
  // Largest pieces first, each onto the least loaded member.
  std::stable_sort(groups.begin(), groups.end(), [](const Group& a, const Group& b) { return a.bytes > b.bytes; });
  for (const auto& g : groups) {
    std::int64_t owner = g.members[0];
    for (auto p : g.members)
      if (load[static_cast<std::size_t>(p)] < load[static_cast<std::size_t>(owner)]) owner = p;
    load[static_cast<std::size_t>(owner)] += static_cast<double>(g.bytes);
    for (auto p : g.members)
      role[static_cast<std::size_t>(p * T + g.t)] = p == owner ? -2 : static_cast<std::int32_t>(owner);
  }
  rep.groups = static_cast<std::int64_t>(groups.size());

  // Keep the direct copies of owners and ungrouped ranks; per (rank, tensor)
  // their bytes, for the pipeline chunks.
  // (Kept in place: a second copy of a plan of millions of copies would
  // double the peak memory.)
  std::vector<Copy> kept = std::move(direct.copies);
  std::unordered_map<std::int64_t, std::vector<double>> bytes_of;  // dst pos -> per tensor
  std::size_t n_kept = 0;
  for (std::size_t i = 0; i < kept.size(); ++i) {
    const Copy& c = kept[i];
    const auto pos = *dst.mesh.position_of(c.dst_rank);
    if (role[static_cast<std::size_t>(pos * T + c.tensor)] >= 0) {
      rep.dropped_bytes += c.bytes();
      continue;
    }
    auto& v = bytes_of[pos];
    if (v.empty()) v.assign(static_cast<std::size_t>(T), 0);
    if (!c.is_local()) v[static_cast<std::size_t>(c.tensor)] += static_cast<double>(c.bytes());
    if (n_kept != i) kept[n_kept] = c;
    ++n_kept;
  }
  kept.resize(n_kept);
  // chunk[(pos, t)]: which pipeline chunk the rank's copies of t go in.
  const int K = opt.pipeline;
  std::unordered_map<std::int64_t, std::vector<std::int32_t>> chunk;
  for (auto& entry : bytes_of) {
    // (No structured binding: clang 14 cannot capture one in the lambda below.)
    const std::int64_t pos = entry.first;
    const auto& v = entry.second;
    // Largest tensor first into the emptiest chunk: the chunks of a rank
    // carry equal bytes, and each mixes tensors from all over the model, so
    // every chunk draws on every source group (pipeline stages) at once
    // rather than one stage's ranks sending while the others wait.
    std::vector<int> order(v.size());
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return v[static_cast<std::size_t>(a)] > v[static_cast<std::size_t>(b)]; });
    std::vector<double> fill(static_cast<std::size_t>(K), 0);
    auto& ch = chunk[pos];
    ch.assign(static_cast<std::size_t>(T), 0);
    for (int t : order) {
      if (v[static_cast<std::size_t>(t)] <= 0) break;
      const auto k = static_cast<std::size_t>(std::min_element(fill.begin(), fill.end()) - fill.begin());
      ch[static_cast<std::size_t>(t)] = static_cast<std::int32_t>(k);
      fill[k] += v[static_cast<std::size_t>(t)];
    }
  }
  auto chunk_of = [&](std::int64_t pos, int t) -> std::int32_t {
    auto it = chunk.find(pos);
    return it == chunk.end() ? 0 : it->second[static_cast<std::size_t>(t)];
  };

  StagedSchedule out;
  out.schedule.src_buffers = std::move(direct.src_buffers);
  out.schedule.dst_buffers = std::move(direct.dst_buffers);
  out.schedule.stats = direct.stats;
  std::vector<std::tuple<std::int32_t, std::int64_t, std::size_t>> order;  // (stage, dst rank, index)
  std::vector<Copy> all = std::move(kept);
  std::vector<std::int32_t> stage(all.size());
  std::vector<std::uint8_t> from(all.size(), 0);
  for (std::size_t i = 0; i < all.size(); ++i)
    stage[i] = chunk_of(*dst.mesh.position_of(all[i].dst_rank), all[i].tensor);

  // Fan-out copies: member <- owner, over the real prefix of the piece.
  for (std::int64_t pos = 0; pos < D; ++pos)
    for (int t = 0; t < T; ++t) {
      const std::int32_t owner = role[static_cast<std::size_t>(pos * T + t)];
      if (owner < 0) continue;
      const auto& ts = dst.tensors[static_cast<std::size_t>(t)];
      const TensorStorage so = tensor_storage(dst, owner, t), sq = tensor_storage(dst, pos, t);
      std::vector<std::int64_t> m(static_cast<std::size_t>(ts.rank()));
      for (int d = 0; d < ts.rank(); ++d)
        m[static_cast<std::size_t>(d)] = hier_detail::real_prefix(sq.parts[static_cast<std::size_t>(d)], ts.shape[static_cast<std::size_t>(d)]);
      const std::int32_t st = chunk_of(owner, t) + 1;
      std::vector<Copy> piece;
      for (const auto& ob : so.boxes)
        for (const auto& qb : sq.boxes) {
          Copy c;
          c.src_rank = dst.mesh.global_rank(owner);
          c.dst_rank = dst.mesh.global_rank(pos);
          c.src_buffer = c.dst_buffer = so.buffer;
          c.tensor = t;
          c.element_bytes = static_cast<std::int32_t>(element_bytes(ts.dtype));
          c.src_offset = ob.base;
          c.dst_offset = qb.base;
          bool empty = false;
          for (int d = 0; d < ts.rank() && !empty; ++d) {
            const auto ud = static_cast<std::size_t>(d);
            const std::int64_t lo = std::max(ob.lo[ud], qb.lo[ud]), hi = std::min({ob.hi[ud], qb.hi[ud], m[ud]});
            empty = lo >= hi;
            c.extent(ud) = hi - lo;
            c.src_stride(ud) = ob.stride[ud];
            c.dst_stride(ud) = qb.stride[ud];
            c.src_offset += lo * ob.stride[ud];
            c.dst_offset += lo * qb.stride[ud];
          }
          if (empty) continue;
          c.rank = ts.rank();
          c.collapse();
          piece.push_back(c);
        }
      std::sort(piece.begin(), piece.end(), [](const Copy& a, const Copy& b) { return a.dst_offset < b.dst_offset; });
      coalesce(piece);
      for (auto& c : piece) {
        rep.fan_out_bytes += c.bytes();
        all.push_back(c);
        stage.push_back(st);
        from.push_back(1);
      }
    }
  // Order: by stage, then destination rank (stable within): sorted keys
  // (stage, rank, index), then the permutation applied in place, cycle by
  // cycle (no second copy of the plan).
  std::vector<std::tuple<std::int32_t, std::int64_t, std::size_t>> keys(all.size());
  for (std::size_t i = 0; i < all.size(); ++i) keys[i] = {stage[i], all[i].dst_rank, i};
  std::sort(keys.begin(), keys.end());
  std::vector<std::size_t> idx(all.size());
  for (std::size_t i = 0; i < all.size(); ++i) idx[i] = std::get<2>(keys[i]);
  std::vector<std::tuple<std::int32_t, std::int64_t, std::size_t>>().swap(keys);
  for (std::size_t i = 0; i < idx.size(); ++i) {
    if (idx[i] == i) continue;
    const Copy c = all[i];
    const std::int32_t st = stage[i];
    const std::uint8_t fr = from[i];
    std::size_t j = i;
    for (;;) {
      const std::size_t k = idx[j];
      idx[j] = j;
      if (k == i) {
        all[j] = c;
        stage[j] = st;
        from[j] = fr;
        break;
      }
      all[j] = all[k];
      stage[j] = stage[k];
      from[j] = from[k];
      j = k;
    }
  }
  std::int32_t top = 0;
  for (std::size_t i = 0; i < all.size(); ++i) {
    top = std::max(top, stage[i]);
    rep.fan_out_copies += from[i];
  }
  out.schedule.copies = std::move(all);
  out.stage = std::move(stage);
  out.from_dst = std::move(from);
  out.stages = top + 1;
  out.schedule.compute_stats(direct.stats.ranks);
  out.schedule.stats.plan_seconds = direct.stats.plan_seconds;
  if (report) {
    rep.near_bytes = report->near_bytes;
    *report = rep;
  }
  return out;
}

/// The direct plan, topology-aware (prefer_near), then staged (see the top).
inline StagedSchedule plan_hierarchical(const Layout& src, const Layout& dst, const RankPlacement& place,
                                        const HierarchicalOptions& opt = {}, HierarchicalReport* report = nullptr) {
  const auto t0 = std::chrono::steady_clock::now();
  PlanOptions po = opt.plan;
  po.only_rank = -1;
  const std::vector<int> src_of = match_tensors(src, dst, po.cast);
  for (std::size_t t = 0; t < src_of.size(); ++t)
    if (src_of[t] >= 0 && !dst.tensors[t].quant && src.tensors[static_cast<std::size_t>(src_of[t])].dtype != dst.tensors[t].dtype)
      layout_fail(ErrorContext{dst.origin, dst.tensors[t].name, "dtype"},
                  "staged (hierarchical) plans do not cast in flight yet ({} in {}); plan it directly",
                  to_string(src.tensors[static_cast<std::size_t>(src_of[t])].dtype), src.origin);
  Schedule direct = plan(src, dst, po);
  HierarchicalReport rep;
  StagedSchedule s = stage_hierarchical(std::move(direct), src, dst, place, opt, &rep);
  if (opt.prefer_near) {
    rep.near_bytes = choose_senders(s.schedule.copies, &s.stage, &s.from_dst, src, dst, place);
    s.schedule.compute_stats(s.schedule.stats.ranks);
  }
  s.schedule.stats.plan_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (report) *report = rep;
  return s;
}

}  // namespace reshard
