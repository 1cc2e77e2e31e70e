#pragma once
// The refit simulator: how long a (plain or staged) schedule takes on a
// topology, the lower bound no schedule can beat, and where the time goes.
//
// Model (flow level, max-min fair, fluid):
// - The copies of a stage are summed per (source GPU, destination GPU) pair
//   into flows; a pair's bytes travel as the messages the executor forms
//   (message_rule.hpp: a zero-copy message per large contiguous copy, a
//   message per piece of a copy contiguous on one side, one packed message
//   per wave; waves cut by the staging budget, the topology's
//   staging_budget and zero_copy_min), counted from the pair's sums by form.
// - A flow between GPUs of different NVLink domains uses the source GPU's NIC
//   egress and the destination GPU's NIC ingress (nic_gbps each), and the
//   shared fabric when the topology has a fabric_gbps limit; inside a
//   domain, the two GPUs' NVLink egress/ingress (nvlink_gbps); on one GPU,
//   its local copy engine (memcpy_gbps; 0 = free).
// - All flows of a stage start together and share every resource max-min
//   fairly (progressive filling); when flows finish, the rates are
//   recomputed (flows finishing within 1% of the stage's elapsed time are
//   retired together, at the latest of their times: slightly pessimistic,
//   and it keeps the event count to a few hundred per stage).
// - Flows the fair sharing cannot tell apart (same bytes, ports alike by
//   color refinement: sim_detail::refine) run as one class with a count:
//   exact, and it makes a stage of millions of flows between thousands of
//   alike GPUs cost as much as its few hundred classes.
// - Per-message cost: each GPU pays latency_us (nvlink_latency_us inside a
//   domain) / messages_in_flight per message it sends and per message it
//   receives, added to the transfer (not overlapped with it);
//   a stage adds the slowest GPU's message cost and one stage_latency_us
//   barrier (stages run one after another, CONTRACT.md §2). On a shared host
//   (topology host_cores > 0) with more processes than cores, every message
//   and barrier costs processes / cores times as much (topology.hpp,
//   host_cores).
//
// - Staging copies (topology staging_copy_gbps, staging_run_ns; 0 = free,
//   as on a cluster's GPUs): each source GPU packs its staged bytes and
//   runs, then each destination GPU unpacks them, added to the stage.
//
// Lower bound (refit_lower_bound): the most loaded bottleneck's unavoidable
// bytes over its bandwidth, from the layouts alone (no schedule):
// - each destination NVLink domain with no source GPU in it must take in
//   every unique byte its ranks need through the NICs of its GPUs:
//   U(domain) / (GPUs of the refit in the domain x NIC);
// - those bytes leave source GPUs through their NICs: sum of U / (source
//   GPUs x NIC); and per group of source GPUs that alone hold some tensors
//   (a pipeline stage), those tensors' share of U / (group GPUs x NIC);
// - each destination-only GPU must take in what it holds through its NIC
//   and NVLink ports together: bytes / (NIC + NVLink).
// Domains that hold source GPUs are left out of the first two terms (what
// they need may be there already), so the bound stays a bound; latency is
// not in it.
//
// Calibration (loopback UCX on this machine): the "loopback" topology
// (topology.hpp) has one rank per node, so every copy is a network flow; its
// NIC rate, per-message latency, per-refit cost and staging copy cost are
// fitted from raw reshard-refit runs between 2 processes (a large
// contiguous tensor, a tiny one, 64 zero-copy messages, two packed cases),
// and its host_cores is the machine's; see bench/calibration/README.md for
// predicted vs measured on other layouts, oversubscribed ones among them.
#include <algorithm>
#include <array>
#include <tuple>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <queue>
#include <set>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include <fmt/format.h>

#include "../exec/delta.hpp"
#include "../layout/layout.hpp"
#include "../layout/storage.hpp"
#include "../plan/hierarchical.hpp"
#include "../plan/topology.hpp"
#include "../schedule/message_rule.hpp"
#include "../schedule/schedule.hpp"

namespace reshard {

enum class LinkKind : std::uint8_t { network, nvlink, local };

inline const char* to_string(LinkKind k) {
  switch (k) {
    case LinkKind::network: return "network";
    case LinkKind::nvlink: return "nvlink";
    case LinkKind::local: return "local";
  }
  return "?";
}

/// A copy as the simulator counts it: its form in the executor's messages
/// and, per side, the unit-stride runs its staging copies (0: that side is
/// read or written in place).
struct CopyShape {
  CopyForm form = CopyForm::packed;
  std::int32_t pack_runs = 1, unpack_runs = 1;
  bool sender_quantized = false;  ///< FP8 bytes its sender quantizes first (CopyQuant::sender)
  /// A bare form: one run per staged side (a half copy staged at its source).
  static CopyShape of(CopyForm f) {
    return CopyShape{f, f == CopyForm::zero_copy ? 0 : 1, f == CopyForm::packed ? 1 : 0};
  }
};

/// The staging copies of a pair's staged bytes: packed at the source,
/// unpacked at the destination (bytes and unit-stride runs per side).
struct StagingWork {
  double pack_bytes = 0, pack_runs = 0, unpack_bytes = 0, unpack_runs = 0;
  double quant_bytes = 0;       ///< FP8 bytes the source quantizes before the transfer
  double recv_quant_bytes = 0;  ///< FP8 bytes the destination quantizes after it (CopyQuant::receiver)
};

/// One stage's traffic between one pair of GPUs.
struct PairTraffic {
  std::int64_t src_gpu = 0, dst_gpu = 0;
  double bytes = 0;
  std::int64_t copies = 0;
  PairForms forms;  ///< the copies by form: the executor's messages (message_rule.hpp)
  StagingWork staging;
};

/// A schedule summed per stage and GPU pair: all the simulator needs. It can
/// be filled copy by copy (add()) so a schedule need not be kept whole.
class Traffic {
 public:
  explicit Traffic(const RankPlacement& place) : place_(&place) {}
  const RankPlacement& placement() const { return *place_; }

  /// A copy's form in the executor's messages, at the topology's
  /// zero_copy_min, and the runs its staged sides copy.
  CopyShape shape_of(const Copy& c) const {
    const std::int64_t zcm = place_->topology().zero_copy_min, b = c.bytes();
    const std::int64_t src_runs = contiguous_runs(c.rank, c.extents(), c.strides(0));
    const std::int64_t dst_runs = contiguous_runs(c.rank, c.extents(), c.strides(1));
    // One run is dense_run (message_rule.hpp): the same walk, not done twice.
    const bool src_in_place = in_place(b, src_runs == 1, zcm), dst_in_place = in_place(b, dst_runs == 1, zcm);
    auto runs = [](bool in_place_side, std::int64_t r) {
      return in_place_side ? 0 : static_cast<std::int32_t>(std::min<std::int64_t>(r, std::numeric_limits<std::int32_t>::max()));
    };
    return CopyShape{copy_form(src_in_place, dst_in_place), runs(src_in_place, src_runs), runs(dst_in_place, dst_runs),
                     c.quant == CopyQuant::sender};
  }
  /// `bytes` of one copy (after any wire-dtype scaling) from rank to rank;
  /// `form`: the copy's form (a bare copy of bytes is packed, one run a side).
  void add(std::int32_t stage, std::int64_t src_rank, std::int64_t dst_rank, double bytes, CopyForm form = CopyForm::packed) {
    add(stage, src_rank, dst_rank, bytes, CopyShape::of(form));
  }
  /// A schedule's copy, `bytes` on the wire (after any wire-dtype scaling).
  /// FP8 quantizing as QuantRefit does it: a sender quantizes each piece it
  /// holds once, however many replicas it sends it to; a receiver quantizes
  /// the FP8 elements it receives in the source dtype.
  void add_copy(std::int32_t stage, const Copy& c, double bytes) {
    CopyShape shape = shape_of(c);
    const std::int64_t a = place_->gpu(c.src_rank), b = place_->gpu(c.dst_rank);
    if (shape.sender_quantized) {
      std::vector<std::int64_t> piece{c.src_rank, c.src_buffer, c.offset(0), c.rank};
      for (int d = 0; d < c.rank; ++d) piece.insert(piece.end(), {c.extent(d), c.stride(0, d)});
      const QuantCounted at{stage, pair_key(a, b), bytes};
      shape.sender_quantized = quantized_.try_emplace(std::move(piece), at).second;  // a piece already counted is not again
    }
    PairTraffic& p = add_between_gpus(stage, a, b, bytes, shape);
    if (c.quant == CopyQuant::receiver) p.staging.recv_quant_bytes += static_cast<double>(c.elements());
  }
  /// `shape`: shape_of() the copy.
  PairTraffic& add(std::int32_t stage, std::int64_t src_rank, std::int64_t dst_rank, double bytes, CopyShape shape) {
    return add_between_gpus(stage, place_->gpu(src_rank), place_->gpu(dst_rank), bytes, shape);
  }
  /// Adds another Traffic's pairs (same placement): per-thread Traffics of
  /// a streamed plan are summed this way.
  void merge(const Traffic& o) {
    if (o.stages_.size() > stages_.size()) stages_.resize(o.stages_.size());
    for (std::size_t s = 0; s < o.stages_.size(); ++s)
      for (const auto& [key, q] : o.stages_[s]) {
        auto& p = stages_[s][key];
        p.src_gpu = q.src_gpu;
        p.dst_gpu = q.dst_gpu;
        p.bytes += q.bytes;
        p.copies += q.copies;
        p.forms.zero_copy += q.forms.zero_copy;
        p.forms.half += q.forms.half;
        p.forms.half_bytes += q.forms.half_bytes;
        p.forms.packed_bytes += q.forms.packed_bytes;
        p.staging.pack_bytes += q.staging.pack_bytes;
        p.staging.pack_runs += q.staging.pack_runs;
        p.staging.unpack_bytes += q.staging.unpack_bytes;
        p.staging.unpack_runs += q.staging.unpack_runs;
        p.staging.quant_bytes += q.staging.quant_bytes;
        p.staging.recv_quant_bytes += q.staging.recv_quant_bytes;
      }
    // A piece both quantized: counted once (where this Traffic counted it).
    for (const auto& [piece, q] : o.quantized_)
      if (!quantized_.try_emplace(piece, q).second) stages_[static_cast<std::size_t>(q.stage)][q.pair].staging.quant_bytes -= q.bytes;
  }
  std::size_t stages() const { return stages_.size(); }
  /// Per GPU, its pairs with other GPUs in each stage (a staged refit splits
  /// its staging budget by them: stage_staging_budgets).
  std::unordered_map<std::int64_t, std::vector<std::int64_t>> stage_pairs() const {
    std::unordered_map<std::int64_t, std::vector<std::int64_t>> out;
    for (std::size_t s = 0; s < stages_.size(); ++s)
      for (const auto& kv : stages_[s]) {
        if (kv.second.src_gpu == kv.second.dst_gpu || kv.second.bytes <= 0) continue;
        for (auto g : {kv.second.src_gpu, kv.second.dst_gpu}) {
          auto& v = out[g];
          v.resize(stages_.size(), 0);
          ++v[s];
        }
      }
    return out;
  }
  /// The pairs of a stage, sorted (deterministic).
  std::vector<PairTraffic> pairs(std::size_t stage) const {
    std::vector<PairTraffic> v;
    v.reserve(stages_[stage].size());
    for (const auto& kv : stages_[stage]) v.push_back(kv.second);
    std::sort(v.begin(), v.end(), [](const PairTraffic& x, const PairTraffic& y) {
      return std::tie(x.src_gpu, x.dst_gpu) < std::tie(y.src_gpu, y.dst_gpu);
    });
    return v;
  }
  LinkKind kind(const PairTraffic& p) const {
    if (p.src_gpu == p.dst_gpu) return LinkKind::local;
    const auto& t = place_->topology();
    return t.domain_of_gpu(p.src_gpu) == t.domain_of_gpu(p.dst_gpu) ? LinkKind::nvlink : LinkKind::network;
  }

 private:
  /// As add(), from GPU `a` to GPU `b` (the ranks' GPUs, looked up once).
  PairTraffic& add_between_gpus(std::int32_t stage, std::int64_t a, std::int64_t b, double bytes, CopyShape shape) {
    const CopyForm form = shape.form;
    if (stage < 0) fail("simulate: negative stage {}", stage);
    if (static_cast<std::size_t>(stage) >= stages_.size()) stages_.resize(static_cast<std::size_t>(stage) + 1);
    auto& p = stages_[static_cast<std::size_t>(stage)][pair_key(a, b)];
    p.src_gpu = a;
    p.dst_gpu = b;
    p.bytes += bytes;
    ++p.copies;
    switch (form) {
      case CopyForm::zero_copy: ++p.forms.zero_copy; break;
      case CopyForm::half:
        ++p.forms.half;
        p.forms.half_bytes += bytes;
        break;
      case CopyForm::packed: p.forms.packed_bytes += bytes; break;
    }
    if (shape.pack_runs > 0) {
      p.staging.pack_bytes += bytes;
      p.staging.pack_runs += shape.pack_runs;
    }
    if (shape.unpack_runs > 0) {
      p.staging.unpack_bytes += bytes;
      p.staging.unpack_runs += shape.unpack_runs;
    }
    if (shape.sender_quantized) p.staging.quant_bytes += bytes;
    return p;
  }
  static std::uint64_t pair_key(std::int64_t src_gpu, std::int64_t dst_gpu) {
    return static_cast<std::uint64_t>(src_gpu) << 32 ^ static_cast<std::uint64_t>(dst_gpu);
  }
  /// Where a sender-quantized piece was counted.
  struct QuantCounted {
    std::int32_t stage = 0;
    std::uint64_t pair = 0;
    double bytes = 0;
  };

  const RankPlacement* place_;
  std::vector<std::unordered_map<std::uint64_t, PairTraffic>> stages_;
  std::map<std::vector<std::int64_t>, QuantCounted> quantized_;  ///< sender-quantized pieces: source rank, buffer, box
};

/// Bytes on the wire per byte of each destination tensor (1 = as planned).
/// fp8_wire_scale(): the inference side holds FP8 (e4m3, 1 byte per element
/// plus one f32 scale per 128x128 block) for every linear weight of the
/// decoder layers (not embeddings, lm_head, norms or the MoE router), as in
/// DeepSeek-V3 / Kimi-K2 FP8 checkpoints; the training side quantizes before
/// sending, so those copies move that many bytes instead. An accounting on a
/// BF16 plan: a plan with quantized destinations (`--infer ...,quant=fp8`,
/// docs/fp8.md) already carries its real wire bytes (FP8 + scales where the
/// sender quantizes, BF16 where the receiver does) and replaces it; it stays
/// for the two-hop (hierarchical) estimate, which does not plan FP8
/// destinations.
inline std::vector<double> fp8_wire_scale(const Layout& dst) {
  std::vector<double> s(dst.tensors.size(), 1.0);
  auto ends_with = [](const std::string& a, const std::string& b) {
    return a.size() >= b.size() && a.compare(a.size() - b.size(), b.size(), b) == 0;
  };
  for (std::size_t t = 0; t < dst.tensors.size(); ++t) {
    const auto& ts = dst.tensors[t];
    const auto eb = element_bytes(ts.dtype);
    if (eb <= 1 || ts.rank() < 2 || !ends_with(ts.name, ".weight")) continue;
    if (ts.name.find(".layers.") == std::string::npos) continue;                 // embeddings, lm_head
    if (ends_with(ts.name, "mlp.gate.weight") || ts.name.find("norm") != std::string::npos) continue;  // router, norms
    s[t] = (1.0 + 4.0 / (128.0 * 128.0)) / static_cast<double>(eb);
  }
  return s;
}

inline void add_traffic(Traffic& tr, const Schedule& s, const std::vector<double>* wire = nullptr) {
  for (const auto& c : s.copies)
    tr.add_copy(0, c, static_cast<double>(c.bytes()) * (wire ? (*wire)[static_cast<std::size_t>(c.tensor)] : 1.0));
}
inline void add_traffic(Traffic& tr, const StagedSchedule& s, const std::vector<double>* wire = nullptr) {
  for (std::size_t i = 0; i < s.schedule.copies.size(); ++i) {
    const auto& c = s.schedule.copies[i];
    tr.add_copy(s.stage_of(i), c, static_cast<double>(c.bytes()) * (wire ? (*wire)[static_cast<std::size_t>(c.tensor)] : 1.0));
  }
}

enum class Port : std::uint8_t { nic_out, nic_in, nvlink_out, nvlink_in, memcpy, fabric };
inline const char* to_string(Port p) {
  switch (p) {
    case Port::nic_out: return "NIC egress";
    case Port::nic_in: return "NIC ingress";
    case Port::nvlink_out: return "NVLink egress";
    case Port::nvlink_in: return "NVLink ingress";
    case Port::memcpy: return "local copy";
    case Port::fabric: return "fabric (all network flows)";
  }
  return "?";
}

struct StageResult {
  double seconds = 0;          ///< fluid + message latency + barrier + staging copies
  double fluid_seconds = 0;    ///< the max-min fair transfer time
  double latency_seconds = 0;  ///< slowest GPU's per-message cost + barrier
  double copy_seconds = 0;     ///< the senders' quantizing, then staging copies: the slowest packer, then the slowest unpacker
  double quantize_seconds = 0;  ///< of which FP8 quantizing: the senders' before the transfer, the receivers' after (Topology::quantize_gbps)
  double bound_seconds = 0;    ///< the stage's busiest port: load / rate
  std::int64_t bound_gpu = -1;  ///< -2: the shared fabric
  Port bound_port = Port::nic_in;
  double bound_bytes = 0;
  double bytes[3] = {0, 0, 0};  ///< by LinkKind
  std::int64_t flows = 0, messages = 0, events = 0;
  std::int64_t classes = 0;       ///< classes of alike flows the fluid model ran on (<= flows)
  std::int64_t port_classes = 0;  ///< classes of alike ports
};

struct SimResult {
  std::vector<StageResult> stages;
  double seconds = 0;        ///< predicted refit time
  double bound_seconds = 0;  ///< sum of the stages' busiest-port times (this schedule's own bound)
};

namespace sim_detail {

/// A flow crosses up to 3 ports (-1 = none): source egress, destination
/// ingress, the shared fabric. Each slot is a different kind of port.
using FlowPorts = std::array<std::int32_t, 3>;

/// An equitable partition of a stage's flows and ports (color refinement):
/// flows of one class have the same bytes and their ports in the same port
/// classes; every port of a class carries the same number of flows of each
/// flow class. Max-min fair sharing cannot tell such flows apart (progressive
/// filling treats the ports of a class alike at every step), so they get
/// equal rates, finish together, and the stage can be simulated on the
/// classes with multiplicities: exact, and a cluster of thousands of alike
/// GPUs collapses to a few hundred classes.
struct Classes {
  std::vector<std::int32_t> of_flow, of_port;  // class ids; of_port is -1 for unused ports
  std::int32_t flows = 0, ports = 0;
  std::int32_t rounds = 0;
};

inline std::uint64_t mix(std::uint64_t h, std::uint64_t x) {
  // splitmix64 of the combination: a good spread for hash keys.
  std::uint64_t z = h ^ (x + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2));
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

struct Key4Hash {
  std::size_t operator()(const std::array<std::int32_t, 4>& k) const {
    std::uint64_t h = 0;
    for (auto x : k) h = mix(h, static_cast<std::uint32_t>(x));
    return static_cast<std::size_t>(h);
  }
};

/// Dense ids for 4-int keys, in order of first sight: an open-addressing
/// table (flat arrays; a node-based map of millions of keys spends its
/// time in the allocator).
class KeyIds {
 public:
  explicit KeyIds(std::size_t expected) {
    std::size_t cap = 16;
    while (cap < 2 * expected + 16) cap *= 2;
    slot_.assign(cap, -1);
    keys_.reserve(expected);
  }
  std::int32_t id(const std::array<std::int32_t, 4>& k) {
    std::size_t i = Key4Hash{}(k) & (slot_.size() - 1);
    for (;; i = (i + 1) & (slot_.size() - 1)) {
      const std::int32_t s = slot_[i];
      if (s < 0) break;
      if (keys_[static_cast<std::size_t>(s)] == k) return s;
    }
    const auto n = static_cast<std::int32_t>(keys_.size());
    slot_[i] = n;
    keys_.push_back(k);
    if (2 * keys_.size() > slot_.size()) grow();
    return n;
  }
  std::size_t size() const { return keys_.size(); }

 private:
  void grow() {
    slot_.assign(slot_.size() * 2, -1);
    for (std::size_t n = 0; n < keys_.size(); ++n) {
      std::size_t i = Key4Hash{}(keys_[n]) & (slot_.size() - 1);
      while (slot_[i] >= 0) i = (i + 1) & (slot_.size() - 1);
      slot_[i] = static_cast<std::int32_t>(n);
    }
  }
  std::vector<std::int32_t> slot_;
  std::vector<std::array<std::int32_t, 4>> keys_;
};

/// Color refinement from the initial colors (flows: bytes; ports: kind and
/// capacity) until no class splits. Exact (signatures are compared, not only
/// hashed). Ports of different kinds never share a class, so a flow class
/// meets a port class in one slot at most.
inline Classes refine(const std::vector<FlowPorts>& ports, const std::vector<double>& bytes, const std::vector<double>& cap,
                      const std::vector<std::uint8_t>& kind) {
  const std::size_t F = ports.size(), P = cap.size();
  Classes c;
  c.of_flow.assign(F, 0);
  c.of_port.assign(P, -1);
  // Flows per port (CSR).
  std::vector<std::int64_t> off(P + 1, 0);
  for (const auto& pp : ports)
    for (auto p : pp)
      if (p >= 0) ++off[static_cast<std::size_t>(p) + 1];
  for (std::size_t p = 0; p < P; ++p) off[p + 1] += off[p];
  std::vector<std::int32_t> on(static_cast<std::size_t>(off[P]));
  {
    std::vector<std::int64_t> fill(off.begin(), off.end() - 1);
    for (std::size_t f = 0; f < F; ++f)
      for (auto p : ports[f])
        if (p >= 0) on[static_cast<std::size_t>(fill[static_cast<std::size_t>(p)]++)] = static_cast<std::int32_t>(f);
  }
  {
    std::map<std::pair<std::uint8_t, std::uint64_t>, std::int32_t> by_cap;
    KeyIds by_bytes(1024);
    for (std::size_t p = 0; p < P; ++p)
      if (off[p + 1] > off[p]) {
        std::uint64_t bits;
        std::memcpy(&bits, &cap[p], sizeof bits);
        c.of_port[p] = by_cap.emplace(std::make_pair(kind[p], bits), static_cast<std::int32_t>(by_cap.size())).first->second;
      }
    for (std::size_t f = 0; f < F; ++f) {
      std::uint64_t bits;
      std::memcpy(&bits, &bytes[f], sizeof bits);
      c.of_flow[f] = by_bytes.id({static_cast<std::int32_t>(bits & 0xffffffffu), static_cast<std::int32_t>(bits >> 32), 0, 0});
    }
    c.ports = static_cast<std::int32_t>(by_cap.size());
    c.flows = static_cast<std::int32_t>(by_bytes.size());
  }
  std::vector<std::int32_t> seq(on.size());  // per port: its flows' classes, sorted
  std::vector<std::int32_t> next_port(P, -1), rep;
  for (;;) {
    ++c.rounds;
    // Flows: (own class, the classes of its ports).
    KeyIds fkeys(static_cast<std::size_t>(c.flows) * 2 + 16);
    for (std::size_t f = 0; f < F; ++f) {
      std::array<std::int32_t, 4> k{c.of_flow[f], -1, -1, -1};
      for (int s = 0; s < 3; ++s)
        if (ports[f][static_cast<std::size_t>(s)] >= 0)
          k[static_cast<std::size_t>(s) + 1] = c.of_port[static_cast<std::size_t>(ports[f][static_cast<std::size_t>(s)])];
      c.of_flow[f] = fkeys.id(k);
    }
    const auto flow_classes = static_cast<std::int32_t>(fkeys.size());
    // Ports: (own class, the multiset of its flows' classes).
    std::unordered_map<std::uint64_t, std::vector<std::int32_t>> pkeys;  // hash -> class ids
    rep.clear();
    for (std::size_t p = 0; p < P; ++p) {
      if (c.of_port[p] < 0) continue;
      const auto b = static_cast<std::size_t>(off[p]), e = static_cast<std::size_t>(off[p + 1]);
      for (std::size_t i = b; i < e; ++i) seq[i] = c.of_flow[static_cast<std::size_t>(on[i])];
      std::sort(seq.begin() + static_cast<std::ptrdiff_t>(b), seq.begin() + static_cast<std::ptrdiff_t>(e));
      std::uint64_t h = mix(static_cast<std::uint64_t>(c.of_port[p]), e - b);
      for (std::size_t i = b; i < e; ++i) h = mix(h, static_cast<std::uint32_t>(seq[i]));
      auto& ids = pkeys[h];
      std::int32_t id = -1;
      for (auto cand : ids) {
        const auto r = static_cast<std::size_t>(rep[static_cast<std::size_t>(cand)]);
        const auto rb = static_cast<std::size_t>(off[r]), re = static_cast<std::size_t>(off[r + 1]);
        if (c.of_port[r] == c.of_port[p] && re - rb == e - b &&
            std::equal(seq.begin() + static_cast<std::ptrdiff_t>(b), seq.begin() + static_cast<std::ptrdiff_t>(e),
                       seq.begin() + static_cast<std::ptrdiff_t>(rb))) {
          id = cand;
          break;
        }
      }
      if (id < 0) {
        id = static_cast<std::int32_t>(rep.size());
        rep.push_back(static_cast<std::int32_t>(p));
        ids.push_back(id);
      }
      next_port[p] = id;
    }
    const auto port_classes = static_cast<std::int32_t>(rep.size());
    // The old colors are part of the new keys, so the partitions only
    // refine: equal counts mean nothing split.
    const bool stable = flow_classes == c.flows && port_classes == c.ports;
    c.flows = flow_classes;
    c.ports = port_classes;
    for (std::size_t p = 0; p < P; ++p)
      if (c.of_port[p] >= 0) c.of_port[p] = next_port[p];
    if (stable) break;
  }
  return c;
}

/// The fluid transfer of flows (`remaining` bytes each) sharing ports
/// max-min fairly, event by event; flow k stands for `weight[k][s]` alike
/// flows on each port of its slot-s port (a plain flow: weight 1). Returns
/// the time the last flow ends and counts the rate recomputations in
/// `events`.
///
/// Each event recomputes the max-min fair rates by progressive filling: the
/// port with the smallest fair share (room left / unfrozen flows) freezes its
/// flows at that share. A port's share only grows as flows elsewhere freeze
/// (they freeze at a level no higher than its share), so the heap holds
/// stale shares as lower bounds and a port is re-queued only when it comes
/// up stale.
///
/// Nothing is written per flow while filling: a port freezes all its
/// unfrozen flows at once, so a flow is frozen exactly when one of its ports
/// has frozen in this event, and its rate is the level of the first of its
/// ports to freeze. Each port's list holds inline what freezing one of its
/// flows touches (the flow's other port and weight there), so an event reads
/// the lists in order and writes only per-port arrays, which stay in cache;
/// the live flows' bytes and ports are kept packed in their own order. The
/// cost of an event is one sequential pass over the live flows' list
/// entries and one over the live flows (plus a heap of ports).
inline double fluid_time(const std::vector<FlowPorts>& ports, const std::vector<std::array<double, 3>>& weight,
                         std::vector<double> remaining, const std::vector<double>& cap, std::int64_t& events) {
  const std::size_t K = ports.size(), P = cap.size();
  if (K >= static_cast<std::size_t>(std::numeric_limits<std::int32_t>::max()))
    fail("simulate: {} flow classes in one stage are too many", K);
  // One entry per (flow, port): the flow, its other port (-1: none; -2: two
  // others, read from `ports`; kDead: the flow retired), the weight it has
  // there. A retired flow's entries are marked where they lie (`at`), and a
  // list is compacted once half of it is dead.
  struct Entry {
    std::int32_t other;
    std::uint32_t w;
  };
  constexpr std::int32_t kDead = std::numeric_limits<std::int32_t>::min();
  auto whole = [](double w) {
    if (!(w >= 0 && w <= 4294967295.0) || w != std::floor(w)) fail("simulate: flow weight {} (internal error)", w);
    return static_cast<std::uint32_t>(w);
  };
  std::vector<std::int64_t> off(P + 1, 0), end(P);
  for (const auto& pp : ports)
    for (auto p : pp)
      if (p >= 0) ++off[static_cast<std::size_t>(p) + 1];
  for (std::size_t p = 0; p < P; ++p) off[p + 1] += off[p];
  std::vector<Entry> list(static_cast<std::size_t>(off[P]));
  std::vector<std::int32_t> list_flow(list.size());  // the flow of each entry (read only to compact)
  for (std::size_t p = 0; p < P; ++p) end[p] = off[p];
  std::vector<std::array<std::int64_t, 3>> at(K, {-1, -1, -1});  // per flow and slot: its entry
  std::vector<std::int64_t> dead(P, 0);                          // dead entries per list
  std::vector<double> users(P, 0);  // live flows per port, weighted (whole numbers: exact)
  for (std::size_t k = 0; k < K; ++k) {
    int n = 0;
    for (auto p : ports[k]) n += p >= 0;
    for (int s = 0; s < 3; ++s) {
      const std::int32_t p = ports[k][static_cast<std::size_t>(s)];
      if (p < 0) continue;
      users[static_cast<std::size_t>(p)] += weight[k][static_cast<std::size_t>(s)];
      Entry e{-1, 0};
      if (n == 3) {
        e.other = -2;
      } else if (n == 2) {
        for (int o = 0; o < 3; ++o)
          if (o != s && ports[k][static_cast<std::size_t>(o)] >= 0) {
            e.other = ports[k][static_cast<std::size_t>(o)];
            e.w = whole(weight[k][static_cast<std::size_t>(o)]);
          }
      }
      at[k][static_cast<std::size_t>(s)] = end[static_cast<std::size_t>(p)];
      list_flow[static_cast<std::size_t>(end[static_cast<std::size_t>(p)])] = static_cast<std::int32_t>(k);
      list[static_cast<std::size_t>(end[static_cast<std::size_t>(p)]++)] = e;
    }
  }
  // The live flows, packed in flow order: id (-1: retired, not yet packed
  // away), bytes left, ports, and the port that froze it in the last event
  // (fz; P for a retired flow: a port of level 0).
  std::vector<std::int32_t> fl(K);
  std::vector<double> rem(std::move(remaining));
  std::vector<std::int32_t> fz(K, static_cast<std::int32_t>(P));
  std::vector<FlowPorts> pt(ports);
  for (std::size_t k = 0; k < K; ++k) fl[k] = static_cast<std::int32_t>(k);
  std::vector<std::pair<std::size_t, double>> near;  // flows near the window: (place, finish)
  // Per port, this event: room left, unfrozen flows (weighted), and when it
  // froze (event, place in the freezing order) at which level; the levels
  // of the event before are kept (`was`) to advance the flows by its step.
  std::vector<double> left(P), unfrozen(P), level(P + 1, 0), was(P + 1, 0);
  std::vector<std::uint32_t> froze(P, 0), order(P, 0);
  using Item = std::pair<double, std::int32_t>;  // (share, port)
  std::vector<Item> heap;
  const auto later = std::greater<Item>();
  double now = 0, last_step = 0;
  std::uint32_t epoch = 0;
  std::size_t live = K, dead_flows = 0;
  // One pass over the flows per event does two things: it advances each
  // flow by the last event's step at its rate then (bytes -= level x step,
  // as before), and finds this event's rate (the level of the first of its
  // ports to freeze, kept as the port's id in fz), the first finish and
  // the flows that may finish in the 1% window (the only ones divided).
  while (live > 0) {
    ++epoch;
    ++events;
    level.swap(was);
    left = cap;
    unfrozen = users;
    heap.clear();
    for (std::size_t p = 0; p < P; ++p)
      if (users[p] > 0) heap.push_back({left[p] / users[p], static_cast<std::int32_t>(p)});
    std::make_heap(heap.begin(), heap.end(), later);
    std::uint32_t seq = 0;
    while (!heap.empty()) {
      std::pop_heap(heap.begin(), heap.end(), later);
      const auto [share, p] = heap.back();
      heap.pop_back();
      const auto up = static_cast<std::size_t>(p);
      if (unfrozen[up] <= 0) continue;
      const double lvl = std::max(0.0, left[up]) / unfrozen[up];
      if (lvl > share * (1 + 1e-12) + 1e-300) {  // stale: its share grew
        heap.push_back({lvl, p});
        std::push_heap(heap.begin(), heap.end(), later);
        continue;
      }
      froze[up] = epoch;
      order[up] = seq++;
      level[up] = lvl;  // this event's levels (the last event's stay in `was`)
      unfrozen[up] = 0;
      const Entry* const b = list.data() + off[up];
      const Entry* const e_end = list.data() + end[up];
      for (const Entry* e = b; e < e_end; ++e) {
        const std::int32_t other = e->other;
        if (other >= 0) {
          const auto q = static_cast<std::size_t>(other);
          if (froze[q] == epoch) continue;  // frozen by its other port
          const double w = e->w;
          left[q] -= lvl * w;
          unfrozen[q] -= w;
        } else if (other == -2) {
          const auto k = static_cast<std::size_t>(list_flow[static_cast<std::size_t>(e - list.data())]);
          bool frozen = false;
          for (auto q : ports[k])
            if (q >= 0 && q != p && froze[static_cast<std::size_t>(q)] == epoch) frozen = true;
          if (frozen) continue;
          for (int s = 0; s < 3; ++s) {
            const std::int32_t q = ports[k][static_cast<std::size_t>(s)];
            if (q < 0 || q == p) continue;
            left[static_cast<std::size_t>(q)] -= lvl * weight[k][static_cast<std::size_t>(s)];
            unfrozen[static_cast<std::size_t>(q)] -= weight[k][static_cast<std::size_t>(s)];
          }
        }
      }
    }
    const std::size_t n_all = fl.size();
    const bool pack = 8 * dead_flows > n_all;  // pack retired flows away
    std::size_t n = 0;
    // The least finish so far, and its window (which only shrinks as the
    // least finish falls): a flow outside the window of its visit is
    // outside the final one; those inside are kept (`near`) and decided
    // below. Only they are divided, and every flow that could lower the
    // least finish is among them, so `first` is exact.
    double first = std::numeric_limits<double>::infinity(), wrun = first;
    near.clear();
    for (std::size_t i = 0; i < n_all; ++i) {
      if (fl[i] < 0) continue;
      const double r = rem[i] - was[static_cast<std::size_t>(fz[i])] * last_step;
      std::uint32_t best = std::numeric_limits<std::uint32_t>::max();
      std::int32_t f = -1;
      for (auto q : pt[i])
        if (q >= 0 && froze[static_cast<std::size_t>(q)] == epoch && order[static_cast<std::size_t>(q)] < best) {
          best = order[static_cast<std::size_t>(q)];
          f = q;
        }
      if (f < 0) fail("simulate: a flow got no bandwidth (internal error)");
      const std::size_t j = pack ? n++ : i;
      const double lv = level[static_cast<std::size_t>(f)];
      if (lv > 0 && r <= wrun * lv * (1 + 1e-9)) {  // (lv = 0: no rate, never done)
        const double t = r / lv;
        near.push_back({j, t});
        if (t < first) {
          first = t;
          wrun = first + 0.01 * (now + first);
        }
      }
      rem[j] = r;
      fz[j] = f;
      if (pack) {
        fl[j] = fl[i];
        pt[j] = pt[i];
      }
    }
    if (pack) {
      fl.resize(n);
      rem.resize(n);
      fz.resize(n);
      pt.resize(n);
      dead_flows = 0;
    }
    if (!std::isfinite(first)) fail("simulate: a flow got no bandwidth (internal error)");
    // Flows finishing within 1% of the stage's elapsed time retire together
    // (at the latest of their times): it bounds the rate recomputations to
    // a few hundred per stage. The retiring flows finish by the window
    // (times 1 + 1e-12), so all are in `near` (a looser test on bytes);
    // their own quotients decide, as each flow's did before.
    double step = first;
    const double window = first + 0.01 * (now + first);
    for (const auto& [i, t] : near)
      if (t <= window) step = std::max(step, t);
    for (const auto& [i, t] : near) {
      if (!(t <= step * (1 + 1e-12))) continue;
      const auto k = static_cast<std::size_t>(fl[i]);
      fl[i] = -1;
      fz[i] = static_cast<std::int32_t>(P);
      --live;
      ++dead_flows;
      for (int s = 0; s < 3; ++s) {
        const std::int32_t q = ports[k][static_cast<std::size_t>(s)];
        if (q < 0) continue;
        const auto uq = static_cast<std::size_t>(q);
        users[uq] -= weight[k][static_cast<std::size_t>(s)];
        list[static_cast<std::size_t>(at[k][static_cast<std::size_t>(s)])].other = kDead;
        if (2 * ++dead[uq] > end[uq] - off[uq]) {  // compact the list
          auto w = off[uq];
          for (auto j = off[uq]; j < end[uq]; ++j) {
            const Entry x = list[static_cast<std::size_t>(j)];
            if (x.other == kDead) continue;
            const std::int32_t xf = list_flow[static_cast<std::size_t>(j)];
            const auto xk = static_cast<std::size_t>(xf);
            for (int t2 = 0; t2 < 3; ++t2)
              if (ports[xk][static_cast<std::size_t>(t2)] == q) at[xk][static_cast<std::size_t>(t2)] = w;
            list_flow[static_cast<std::size_t>(w)] = xf;
            list[static_cast<std::size_t>(w++)] = x;
          }
          end[uq] = w;
          dead[uq] = 0;
        }
      }
    }
    last_step = step;
    now += step;
  }
  return now;
}

}  // namespace sim_detail

/// The host work of a stage around its transfer: first every sender
/// quantizes the FP8 bytes it sends (Topology::quantize_gbps; QuantRefit
/// quantizes before the executor runs), then the staging copies
/// (staging_copy_gbps and staging_run_ns): every source GPU packs its staged
/// bytes, then every destination GPU unpacks them; last the receivers
/// quantize what arrived in the source dtype. Each phase takes its slowest
/// GPU, and on a shared host the GPUs of a phase share host_cores.
/// `quantize`, when given, gets the two quantizing phases' part.
inline double staging_copy_seconds(const std::vector<PairTraffic>& pairs, const Topology& topo, double* quantize = nullptr) {
  auto phase = [&](const std::unordered_map<std::int64_t, double>& m) {
    double slowest = 0;
    for (const auto& [g, c] : m) slowest = std::max(slowest, c);
    const double share = topo.host_cores > 0 ? std::max(1.0, static_cast<double>(m.size()) / topo.host_cores) : 1.0;
    return slowest * share;
  };
  std::unordered_map<std::int64_t, double> quant, recv_quant, pack, unpack;  // GPU -> seconds
  if (topo.quantize_gbps > 0)
    for (const auto& p : pairs) {
      if (p.staging.quant_bytes > 0) quant[p.src_gpu] += p.staging.quant_bytes / topo.quantize_bytes_per_s();
      if (p.staging.recv_quant_bytes > 0) recv_quant[p.dst_gpu] += p.staging.recv_quant_bytes / topo.quantize_bytes_per_s();
    }
  const double q = phase(quant) + phase(recv_quant);
  if (quantize) *quantize = q;
  if (!(topo.staging_copy_gbps > 0) && !(topo.staging_run_ns > 0)) return q;
  auto cost = [&](double bytes, double runs) {
    return (topo.staging_copy_gbps > 0 ? bytes / topo.staging_copy_bytes_per_s() : 0.0) + runs * topo.staging_run_ns * 1e-9;
  };
  for (const auto& p : pairs) {
    if (p.src_gpu == p.dst_gpu) continue;  // local copies go box to box, unstaged
    if (p.staging.pack_runs > 0) pack[p.src_gpu] += cost(p.staging.pack_bytes, p.staging.pack_runs);
    if (p.staging.unpack_runs > 0) unpack[p.dst_gpu] += cost(p.staging.unpack_bytes, p.staging.unpack_runs);
  }
  return q + phase(pack) + phase(unpack);
}

/// Simulates every stage of the traffic on its topology (see the top).
inline SimResult simulate(const Traffic& tr) {
  const Topology& topo = tr.placement().topology();
  // Processes per core on a shared host stretch every message (topology.hpp, host_cores).
  const double oversubscribed =
      topo.host_cores > 0 ? std::max(1.0, static_cast<double>(tr.placement().gpus().size()) / topo.host_cores) : 1.0;
  SimResult res;
  // A staged refit splits each rank's staging budget among the stages in
  // which it exchanges bytes with another rank (staged_executor.hpp).
  std::unordered_map<std::int64_t, std::vector<std::int64_t>> stage_budget;  // GPU -> per stage
  if (tr.stages() > 1)
    for (const auto& [g, pairs] : tr.stage_pairs()) stage_budget[g] = stage_staging_budgets(topo.staging_budget, pairs, kDefaultPipeline);
  for (std::size_t s = 0; s < tr.stages(); ++s) {
    StageResult st;
    const auto pairs = tr.pairs(s);
    // Staged bytes and staged pairs per GPU (= rank: placements give each
    // rank its own GPU): each pair's share of the staging budget, as the
    // executor computes it (message_rule.hpp).
    std::unordered_map<std::int64_t, std::pair<std::int64_t, std::int64_t>> staging;  // GPU -> (bytes, pairs)
    for (const auto& p : pairs) {
      if (p.src_gpu == p.dst_gpu || p.forms.staged() <= 0) continue;
      const auto b = static_cast<std::int64_t>(std::llround(p.forms.staged()));
      for (auto g : {p.src_gpu, p.dst_gpu}) {
        auto& [bytes, n] = staging[g];
        bytes += b;
        ++n;
      }
    }
    auto limit = [&](std::int64_t g, std::int64_t staged) {
      const auto& [bytes, n] = staging[g];
      const auto it = stage_budget.find(g);
      const std::int64_t budget = it == stage_budget.end() ? topo.staging_budget : it->second[s];
      return staging_share(staging_capacity(bytes, n, budget, kDefaultPipeline), bytes, staged);
    };
    // Ports: dense ids per (GPU, port kind), only for the GPUs in use.
    std::unordered_map<std::int64_t, std::int32_t> gpu_id;
    std::vector<std::int64_t> gpus;
    auto id_of = [&](std::int64_t g) {
      auto [it, fresh] = gpu_id.emplace(g, static_cast<std::int32_t>(gpus.size()));
      if (fresh) gpus.push_back(g);
      return it->second;
    };
    constexpr std::int32_t kFabric = -2;  // remapped to the last port id below
    std::vector<sim_detail::FlowPorts> ports;
    std::vector<double> remaining;
    std::vector<double> msg_cost_out, msg_cost_in;
    for (const auto& p : pairs) {
      const LinkKind k = tr.kind(p);
      st.bytes[static_cast<int>(k)] += p.bytes;
      if (p.bytes <= 0) continue;
      const std::int32_t a = id_of(p.src_gpu), b = id_of(p.dst_gpu);
      sim_detail::FlowPorts pp{-1, -1, -1};
      switch (k) {
        case LinkKind::network:
          pp = {a * 5 + static_cast<int>(Port::nic_out), b * 5 + static_cast<int>(Port::nic_in), topo.fabric_gbps > 0 ? kFabric : -1};
          break;
        case LinkKind::nvlink: pp = {a * 5 + static_cast<int>(Port::nvlink_out), b * 5 + static_cast<int>(Port::nvlink_in), -1}; break;
        case LinkKind::local:
          if (topo.memcpy_gbps <= 0) continue;  // free
          pp = {a * 5 + static_cast<int>(Port::memcpy), -1, -1};
          break;
      }
      ports.push_back(pp);
      remaining.push_back(p.bytes);
      if (k != LinkKind::local) {
        const auto staged = static_cast<std::int64_t>(std::llround(p.forms.staged()));
        const std::int64_t share =
            staged > 0 ? std::max<std::int64_t>(16, std::min({limit(p.src_gpu, staged), limit(p.dst_gpu, staged), staged})) : 1;
        const auto msgs = std::max<std::int64_t>(1, static_cast<std::int64_t>(pair_messages(p.forms, share)));
        const double cost = static_cast<double>(msgs) * oversubscribed *
                            (k == LinkKind::network ? topo.latency_us : topo.nvlink_latency_us) * 1e-6 /
                            static_cast<double>(topo.messages_in_flight);
        st.messages += msgs;
        if (msg_cost_out.size() < gpus.size()) {
          msg_cost_out.resize(gpus.size(), 0);
          msg_cost_in.resize(gpus.size(), 0);
        }
        msg_cost_out[static_cast<std::size_t>(a)] += cost;
        msg_cost_in[static_cast<std::size_t>(b)] += cost;
      }
    }
    st.flows = static_cast<std::int64_t>(ports.size());
    const auto fabric = static_cast<std::int32_t>(gpus.size() * 5);
    for (auto& pp : ports)
      for (auto& p : pp)
        if (p == kFabric) p = fabric;
    std::vector<double> cap(gpus.size() * 5 + 1, 0), load(gpus.size() * 5 + 1, 0);
    cap[static_cast<std::size_t>(fabric)] = topo.fabric_gbps > 0 ? topo.fabric_bytes_per_s() : 1;
    for (std::size_t g = 0; g < gpus.size(); ++g) {
      cap[g * 5 + static_cast<int>(Port::nic_out)] = cap[g * 5 + static_cast<int>(Port::nic_in)] = topo.nic_bytes_per_s();
      cap[g * 5 + static_cast<int>(Port::nvlink_out)] = cap[g * 5 + static_cast<int>(Port::nvlink_in)] =
          topo.nvlink_bytes_per_s();
      cap[g * 5 + static_cast<int>(Port::memcpy)] = topo.memcpy_gbps > 0 ? topo.memcpy_bytes_per_s() : 1;
    }
    for (std::size_t f = 0; f < ports.size(); ++f)
      for (auto p : ports[f])
        if (p >= 0) load[static_cast<std::size_t>(p)] += remaining[f];
    for (std::size_t p = 0; p < load.size(); ++p) {
      const double t = load[p] / cap[p];
      if (t > st.bound_seconds) {
        st.bound_seconds = t;
        st.bound_gpu = p == static_cast<std::size_t>(fabric) ? -2 : gpus[p / 5];
        st.bound_port = p == static_cast<std::size_t>(fabric) ? Port::fabric : static_cast<Port>(p % 5);
        st.bound_bytes = load[p];
      }
    }
    // Fluid max-min fair transfer on the classes of alike flows and ports.
    std::vector<std::uint8_t> kind(cap.size());
    for (std::size_t p = 0; p < cap.size(); ++p)
      kind[p] = static_cast<std::uint8_t>(p == static_cast<std::size_t>(fabric) ? static_cast<int>(Port::fabric) : static_cast<int>(p % 5));
    const sim_detail::Classes cls = sim_detail::refine(ports, remaining, cap, kind);
    st.classes = cls.flows;
    st.port_classes = cls.ports;
    std::vector<sim_detail::FlowPorts> cports(static_cast<std::size_t>(cls.flows), sim_detail::FlowPorts{-1, -1, -1});
    std::vector<double> cbytes(static_cast<std::size_t>(cls.flows), 0), ccap(static_cast<std::size_t>(cls.ports), 0);
    std::vector<double> members(static_cast<std::size_t>(cls.flows), 0), port_members(static_cast<std::size_t>(cls.ports), 0);
    for (std::size_t f = 0; f < ports.size(); ++f) {
      const auto k = static_cast<std::size_t>(cls.of_flow[f]);
      members[k] += 1;
      cbytes[k] = remaining[f];
      for (int sl = 0; sl < 3; ++sl) {
        const std::int32_t p = ports[f][static_cast<std::size_t>(sl)];
        cports[k][static_cast<std::size_t>(sl)] = p < 0 ? -1 : cls.of_port[static_cast<std::size_t>(p)];
      }
    }
    for (std::size_t p = 0; p < cap.size(); ++p)
      if (cls.of_port[p] >= 0) {
        port_members[static_cast<std::size_t>(cls.of_port[p])] += 1;
        ccap[static_cast<std::size_t>(cls.of_port[p])] = cap[p];
      }
    // Each port of class j carries members(k) / members(j) flows of class k.
    std::vector<std::array<double, 3>> weight(static_cast<std::size_t>(cls.flows), {0, 0, 0});
    for (std::size_t k = 0; k < weight.size(); ++k)
      for (int sl = 0; sl < 3; ++sl) {
        const std::int32_t j = cports[k][static_cast<std::size_t>(sl)];
        if (j < 0) continue;
        const double w = members[k] / port_members[static_cast<std::size_t>(j)];
        if (w != std::floor(w)) fail("simulate: flow classes are not equitable (internal error)");
        weight[k][static_cast<std::size_t>(sl)] = w;
      }
    st.fluid_seconds = sim_detail::fluid_time(cports, weight, std::move(cbytes), ccap, st.events);
    double msg = 0;
    for (std::size_t g = 0; g < msg_cost_out.size(); ++g) msg = std::max({msg, msg_cost_out[g], msg_cost_in[g]});
    // The barrier is handshakes between processes too: stretched alike on a shared host.
    st.latency_seconds = msg + topo.stage_latency_us * 1e-6 * oversubscribed;
    st.copy_seconds = staging_copy_seconds(pairs, topo, &st.quantize_seconds);
    st.seconds = st.fluid_seconds + st.latency_seconds + st.copy_seconds;
    res.seconds += st.seconds;
    res.bound_seconds += st.bound_seconds;
    res.stages.push_back(st);
  }
  return res;
}

/// The lower bound of any refit between two layouts on a topology (see the top).
struct LowerBound {
  double seconds = 0;
  std::string what;                 ///< which term, in words
  double domain_seconds = 0, egress_seconds = 0, group_seconds = 0, gpu_seconds = 0;
  std::map<std::int64_t, double> unique_bytes;  ///< per destination domain without source GPUs
  std::int64_t skipped_domains = 0;             ///< destination domains that hold source GPUs
};

inline LowerBound refit_lower_bound(const Layout& src, const Layout& dst, const RankPlacement& place,
                                    const std::vector<double>* wire = nullptr) {
  const Topology& topo = place.topology();
  LowerBound lb;
  std::set<std::int64_t> src_domains, src_gpus;
  std::map<std::int64_t, std::set<std::int64_t>> domain_gpus;  // GPUs of the refit per domain
  for (auto r : src.mesh.global_ranks()) {
    src_domains.insert(place.domain(r));
    src_gpus.insert(place.gpu(r));
    domain_gpus[place.domain(r)].insert(place.gpu(r));
  }
  for (auto r : dst.mesh.global_ranks()) domain_gpus[place.domain(r)].insert(place.gpu(r));
  // Per destination position, once: its domain, and for a rank outside the
  // source mesh its GPU's index among such GPUs (in GPU order), else -1.
  const std::int64_t D = dst.mesh.size();
  std::vector<std::int64_t> pos_dom(static_cast<std::size_t>(D));
  std::vector<std::int32_t> pos_need(static_cast<std::size_t>(D), -1);
  std::map<std::int64_t, std::int32_t> need_id;  // destination-only GPU -> index
  for (std::int64_t pos = 0; pos < D; ++pos) {
    const std::int64_t rank = dst.mesh.global_rank(pos);
    pos_dom[static_cast<std::size_t>(pos)] = place.domain(rank);
    if (!src.mesh.position_of(rank)) need_id.emplace(place.gpu(rank), 0);
  }
  std::vector<std::int64_t> need_gpu;
  for (auto& [g, id] : need_id) {
    id = static_cast<std::int32_t>(need_gpu.size());
    need_gpu.push_back(g);
  }
  for (std::int64_t pos = 0; pos < D; ++pos) {
    const std::int64_t rank = dst.mesh.global_rank(pos);
    if (!src.mesh.position_of(rank)) pos_need[static_cast<std::size_t>(pos)] = need_id[place.gpu(rank)];
  }
  std::vector<double> gpu_need(need_gpu.size(), 0);  // destination-only GPUs
  // Source GPUs holding a tensor -> unique bytes of such tensors the domains need.
  std::map<std::vector<std::int64_t>, std::pair<double, std::int64_t>> group_bytes;  // (bytes, tensors)
  // Quantized (FP8) destinations count at their own dtype (1 byte per
  // element, plus the scale tensor's entries): what a sender-quantized copy
  // moves, and less than a receiver-quantized one (source dtype), so the
  // bound stays a bound whatever the planner decides. A scale tensor has no
  // source: its bytes leave the GPUs holding its weight.
  std::vector<int> src_of = match_tensors(src, dst, true);  // casts count at the destination's dtype, as they cross
  for (std::size_t t = 0; t < dst.tensors.size(); ++t)
    if (const int w = dst.tensors[t].scale_of; src_of[t] < 0 && w >= 0) src_of[t] = src_of[static_cast<std::size_t>(w)];
  // What a position holds of a tensor: (domain, part) and a linear interval
  // of the part's local array; sorted, as a map of (domain, part) to its
  // sorted intervals would list them.
  struct Held {
    std::int64_t dom;
    std::uint64_t lin;
    std::int64_t lo, hi;
    bool operator<(const Held& o) const { return std::tie(dom, lin, lo, hi) < std::tie(o.dom, o.lin, o.lo, o.hi); }
  };
  std::vector<Held> held;
  std::vector<std::int64_t> part_ix;
  for (std::size_t t = 0; t < dst.tensors.size(); ++t) {
    double tensor_unique = 0;
    const auto& ts = dst.tensors[t];
    const double scale = (wire ? (*wire)[t] : 1.0) * static_cast<double>(element_bytes(ts.dtype));
    const bool flat = ts.buffer >= 0 && dst.buffers[static_cast<std::size_t>(ts.buffer)].kind == BufferKind::flat;
    // Per part: the local extents and real prefixes (the same on every
    // position holding the part).
    std::unordered_map<std::uint64_t, std::pair<std::vector<std::int64_t>, std::vector<std::int64_t>>> shape;
    held.clear();
    part_ix.resize(static_cast<std::size_t>(ts.rank()));
    for (std::int64_t pos = 0; pos < D; ++pos) {
      if (!dst.holds(pos, static_cast<int>(t))) continue;
      std::uint64_t lin = 0;
      for (int d = 0; d < ts.rank(); ++d) {
        const auto ud = static_cast<std::size_t>(d);
        part_ix[ud] = ts.dims[ud].part_of(dst.mesh, pos);
        lin = lin * static_cast<std::uint64_t>(ts.cuts[ud].k) + static_cast<std::uint64_t>(part_ix[ud]);
      }
      auto [it, fresh] = shape.try_emplace(lin);
      auto& [e, m] = it->second;
      if (fresh) {
        e.resize(static_cast<std::size_t>(ts.rank()));
        m.resize(e.size());
        for (int d = 0; d < ts.rank(); ++d) {
          const auto ud = static_cast<std::size_t>(d);
          const DimPart part = ts.cuts[ud].part(part_ix[ud]);
          e[ud] = part.local_extent;
          m[ud] = hier_detail::real_prefix(part, ts.shape[ud]);
        }
      }
      std::int64_t lo = 0, hi = 1;
      for (auto x : e) hi *= x;
      if (flat) {
        const TensorStorage s = tensor_storage(dst, pos, static_cast<int>(t));
        if (s.empty()) continue;
        lo = s.lin_lo;
        hi = s.lin_hi;
      }
      const std::int64_t dom = pos_dom[static_cast<std::size_t>(pos)];
      held.push_back(Held{dom, lin, lo, hi});
      if (const std::int32_t g = pos_need[static_cast<std::size_t>(pos)]; g >= 0)
        gpu_need[static_cast<std::size_t>(g)] +=
            static_cast<double>(hier_detail::real_below(e, m, hi) - hier_detail::real_below(e, m, lo)) * scale;
    }
    std::sort(held.begin(), held.end());
    for (std::size_t g0 = 0; g0 < held.size();) {
      std::size_t g1 = g0;
      while (g1 < held.size() && held[g1].dom == held[g0].dom && held[g1].lin == held[g0].lin) ++g1;
      const std::int64_t dom = held[g0].dom;
      if (src_domains.count(dom)) {
        g0 = g1;
        continue;
      }
      const auto& [e, m] = shape.at(held[g0].lin);
      std::int64_t a = -1, b = -1, real = 0;
      for (std::size_t i = g0; i < g1; ++i) {
        const std::int64_t lo = held[i].lo, hi = held[i].hi;
        if (lo > b) {
          if (a >= 0) real += hier_detail::real_below(e, m, b) - hier_detail::real_below(e, m, a);
          a = lo;
          b = hi;
        } else {
          b = std::max(b, hi);
        }
      }
      if (a >= 0) real += hier_detail::real_below(e, m, b) - hier_detail::real_below(e, m, a);
      lb.unique_bytes[dom] += static_cast<double>(real) * scale;
      tensor_unique += static_cast<double>(real) * scale;
      g0 = g1;
    }
    if (tensor_unique > 0) {
      std::vector<std::int64_t> holders;
      const int st = src_of[t];
      for (std::int64_t p = 0; p < src.mesh.size(); ++p)
        if (src.holds(p, st)) holders.push_back(place.gpu(src.mesh.global_rank(p)));
      std::sort(holders.begin(), holders.end());
      auto& g = group_bytes[holders];
      g.first += tensor_unique;
      ++g.second;
    }
  }
  // Bytes only a group of source GPUs holds leave through that group's NICs.
  for (const auto& [gpus, bt] : group_bytes) {
    if (gpus.empty()) continue;
    const double t = bt.first / (static_cast<double>(gpus.size()) * topo.nic_bytes_per_s());
    lb.group_seconds = std::max(lb.group_seconds, t);
    if (t > lb.seconds) {
      lb.seconds = t;
      lb.what = fmt::format("source GPUs {}..{} ({} GPUs holding {} tensors, e.g. a pipeline stage): {:.3f} GB out over their NICs",
                            gpus.front(), gpus.back(), gpus.size(), bt.second, bt.first / 1e9);
    }
  }
  double total_unique = 0;
  for (const auto& [dom, u] : lb.unique_bytes) {
    total_unique += u;
    const double t = u / (static_cast<double>(domain_gpus[dom].size()) * topo.nic_bytes_per_s());
    if (t > lb.domain_seconds) {
      lb.domain_seconds = t;
      if (t > lb.seconds) {
        lb.seconds = t;
        lb.what = fmt::format("NVLink domain {}: {:.3f} GB of unique bytes in over its {} GPUs' NICs", dom, u / 1e9,
                              domain_gpus[dom].size());
      }
    }
  }
  std::set<std::int64_t> dst_domains;
  for (auto r : dst.mesh.global_ranks()) dst_domains.insert(place.domain(r));
  for (auto dom : dst_domains) lb.skipped_domains += src_domains.count(dom) ? 1 : 0;
  if (!src_gpus.empty()) {
    lb.egress_seconds = total_unique / (static_cast<double>(src_gpus.size()) * topo.nic_bytes_per_s());
    if (lb.egress_seconds > lb.seconds) {
      lb.seconds = lb.egress_seconds;
      lb.what = fmt::format("source NICs: {:.3f} GB out of {} source GPUs", total_unique / 1e9, src_gpus.size());
    }
  }
  for (std::size_t i = 0; i < gpu_need.size(); ++i) {
    const std::int64_t g = need_gpu[i];
    const double need = gpu_need[i];
    const double t = need / (topo.nic_bytes_per_s() + topo.nvlink_bytes_per_s());
    if (t > lb.gpu_seconds) lb.gpu_seconds = t;
    if (t > lb.seconds) {
      lb.seconds = t;
      lb.what = fmt::format("GPU {}: {:.3f} GB in over its NIC and NVLink together", g, need / 1e9);
    }
  }
  return lb;
}

// ---------------------------------------------------------------------------
// Delta refits (delta.hpp) predicted at a measured changed fraction F.
//
// Every network copy travels as its pair's delta payload: its bytes scaled
// by delta::expected_wire_fraction(element bytes, F) (the sender's own
// encoding choice), as packed messages (payloads go in blocks through
// staging). Local copies stay dense. Before the transfer each sender diffs
// what it sends against its shadow (reads weights and shadow, writes the
// payload); after it each receiver scatters (reads the payload, rewrites the
// memory lines holding a change: 1 - (1 - F)^(L / E) of them, L the line a
// write moves: a GPU's 32-byte sector, a CPU's 64-byte cache line on a
// shared host). Both run at `device_gbps` of memory bandwidth, the busiest
// GPU's each. The executor diffs, sends and scatters each pair's stream
// slice by slice (DeltaOptions::slice_bytes), so the three overlap but for
// one slice at each end: with S slices in the largest pair, the slowest of
// diff, transfer and scatter plus 1/S of the other two. On a shared host
// (topology host_cores > 0) every process's diff and scatter share those
// cores, and so does moving the payloads (the same cores run TCP and UCX:
// the wire bytes at fabric_gbps, the host's rate of moving bytes with all
// its cores, as the dense loopback fit measures it): at least the sum of
// the kernels over host_cores plus the wire bytes over the fabric, then the
// last slice's transfer and scatter (its diff is part of that sum). The
// density all-gather's latency is left out.

struct DeltaSimResult {
  double density = 0, device_gbps = 0;
  double dense_bytes = 0, wire_bytes = 0;  ///< network bytes, dense and as delta payloads
  double diff_seconds = 0, scatter_seconds = 0;
  SimResult transfer;
  std::int64_t slices = 1;   ///< in the largest pair
  double host_seconds = 0;   ///< shared host: every diff and scatter over host_cores, plus the payloads' moving (0 otherwise)
  double seconds = 0;        ///< the pipeline of slices (see above), at least host_seconds and the last slice's tail
};

inline DeltaSimResult simulate_delta(const Schedule& s, const RankPlacement& place, double density, double device_gbps,
                                     std::int64_t slice_bytes = DeltaOptions{}.slice_bytes) {
  if (!(density >= 0 && density <= 1)) fail("simulate_delta: the changed fraction {} is outside [0, 1]", density);
  if (!(device_gbps > 0)) fail("simulate_delta: the device memory bandwidth {} GB/s is not positive", device_gbps);
  if (slice_bytes < 1) fail("simulate_delta: slice_bytes {} is below 1", slice_bytes);
  DeltaSimResult r;
  r.density = density;
  r.device_gbps = device_gbps;
  const Topology& topo = place.topology();
  const double line = topo.host_cores > 0 ? 64 : 32;  // bytes a scattered write moves (see above)
  Traffic tr(place);
  std::unordered_map<std::int64_t, double> diff_bytes, scatter_bytes;  // per GPU
  std::map<std::pair<std::int64_t, std::int64_t>, double> pair_bytes;   // dense, per network pair
  for (const Copy& c : s.copies) {
    const std::int64_t a = place.gpu(c.src_rank), b = place.gpu(c.dst_rank);
    const auto dense = static_cast<double>(c.bytes());
    if (a == b) {
      tr.add(0, c.src_rank, c.dst_rank, dense, tr.shape_of(c));
      continue;
    }
    const double wire = dense * delta::expected_wire_fraction(c.element_bytes, density);
    tr.add(0, c.src_rank, c.dst_rank, wire, CopyForm::packed);
    r.dense_bytes += dense;
    r.wire_bytes += wire;
    pair_bytes[{c.src_rank, c.dst_rank}] += dense;
    diff_bytes[a] += 2 * dense + wire;
    const double touched = 1 - std::pow(1 - density, line / static_cast<double>(std::max<std::int64_t>(c.element_bytes, 1)));
    scatter_bytes[b] += wire + 2 * dense * touched;
  }
  const double bw = device_gbps * 1e9;
  double all = 0;  // every GPU's diff and scatter, seconds
  for (const auto& kv : diff_bytes) r.diff_seconds = std::max(r.diff_seconds, kv.second / bw), all += kv.second / bw;
  for (const auto& kv : scatter_bytes) r.scatter_seconds = std::max(r.scatter_seconds, kv.second / bw), all += kv.second / bw;
  for (const auto& kv : pair_bytes)
    r.slices = std::max(r.slices, static_cast<std::int64_t>(std::ceil(kv.second / static_cast<double>(slice_bytes))));
  r.transfer = simulate(tr);
  const double phases[3] = {r.diff_seconds, r.transfer.seconds, r.scatter_seconds};
  const double slowest = *std::max_element(phases, phases + 3), sum = phases[0] + phases[1] + phases[2];
  r.seconds = slowest + (sum - slowest) / static_cast<double>(r.slices);
  if (topo.host_cores > 0) {
    r.host_seconds = all / topo.host_cores + (topo.fabric_gbps > 0 ? r.wire_bytes / topo.fabric_bytes_per_s() : 0.0);
    r.seconds = std::max(r.seconds, r.host_seconds + (r.transfer.seconds + r.scatter_seconds) / static_cast<double>(r.slices));
  }
  return r;
}

}  // namespace reshard
