#pragma once
// Shared by reshard-refit and refit-bench: a Llama-like model built in C++
// (Megatron training layouts with fused, per-group interleaved buffers; vLLM
// inference layouts), and a measured refit on the in-process transport with
// the traditional gather + broadcast + slice refit beside it, both validated
// element by element.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "reshard/backends/local.hpp"
#include "reshard/hierarchical.hpp"
#include "reshard/plan.hpp"
#include "reshard/resharder.hpp"
#include "reshard_support/traditional.hpp"
#include "reshard_support/verify.hpp"

namespace refit_harness {

using namespace reshard;

struct ModelShape {
  std::string name = "llama-8x2048";
  int layers = 8;
  std::int64_t hidden = 2048, heads = 16, kv_heads = 4, head_dim = 128, intermediate = 2816;
  std::int64_t vocab = 32001;  ///< odd on purpose: both sides pad it, differently
  DType dtype = DType::bf16;

  std::int64_t parameters() const {
    const std::int64_t q = heads * head_dim, kv = kv_heads * head_dim;
    const std::int64_t layer = (q + 2 * kv) * hidden + hidden * q + 3 * intermediate * hidden + 2 * hidden;
    return layers * layer + 2 * vocab * hidden + hidden;
  }
  std::int64_t bytes() const { return parameters() * element_bytes(dtype); }
};

inline std::int64_t round_up(std::int64_t n, std::int64_t m) { return (n + m - 1) / m * m; }

namespace detail {
inline DimSpec cut(int axis, std::int64_t size) {
  DimSpec d;
  if (size > 1) d.axes = {AxisRef{axis, 1, size}};
  return d;
}
inline TensorSpec tensor(std::string name, std::vector<std::int64_t> shape, std::vector<DimSpec> dims, DType dt,
                         std::vector<StageCoord> stage) {
  TensorSpec t;
  t.name = std::move(name);
  t.shape = std::move(shape);
  t.dims = std::move(dims);
  t.dtype = dt;
  t.stage = std::move(stage);
  return t;
}
inline BufferSpec concat(std::string name, std::vector<std::string> parts, std::int64_t interleave) {
  BufferSpec b;
  b.name = std::move(name);
  b.parts = std::move(parts);
  b.interleave = interleave;
  return b;
}
inline std::string layer_name(int i, const char* what) { return fmt::format("model.layers.{}.{}", i, what); }
}  // namespace detail

/// Megatron-Core training layout: mesh [pp, dp, tp] (tp fastest), layers
/// split evenly over pp, linear_qkv per query group [q_g; k_g; v_g] cut over
/// tp, linear_fc1 = [gate_t; up_t], row-parallel o/down, vocab padded to a
/// multiple of 128*tp, embedding on the first stage, norm + lm_head on the last.
inline Layout megatron_layout(const ModelShape& m, int pp, int dp, int tp, std::int64_t first_rank = 0) {
  using namespace detail;
  if (m.layers % pp != 0) fail("megatron layout: {} layers do not split evenly over pp={}", m.layers, pp);
  if (m.kv_heads % tp != 0) fail("megatron layout: tp={} must divide the {} query groups", tp, m.kv_heads);
  Layout L;
  L.origin = fmt::format("megatron pp={},dp={},tp={}", pp, dp, tp);
  L.mesh.axes = {{"pp", pp}, {"dp", dp}, {"tp", tp}};
  L.mesh.first_rank = first_rank;
  const DimSpec col = cut(2, tp), none{};
  const DType dt = m.dtype;
  const std::int64_t q = m.heads * m.head_dim, kv = m.kv_heads * m.head_dim, H = m.hidden, I = m.intermediate;
  const std::int64_t groups_local = m.kv_heads / tp;
  for (int i = 0; i < m.layers; ++i) {
    const std::vector<StageCoord> st = {StageCoord{0, i / (m.layers / pp)}};
    const auto qn = layer_name(i, "self_attn.q_proj.weight"), kn = layer_name(i, "self_attn.k_proj.weight"),
               vn = layer_name(i, "self_attn.v_proj.weight"), gn = layer_name(i, "mlp.gate_proj.weight"),
               un = layer_name(i, "mlp.up_proj.weight");
    L.tensors.push_back(tensor(qn, {q, H}, {col, none}, dt, st));
    L.tensors.push_back(tensor(kn, {kv, H}, {col, none}, dt, st));
    L.tensors.push_back(tensor(vn, {kv, H}, {col, none}, dt, st));
    L.tensors.push_back(tensor(layer_name(i, "self_attn.o_proj.weight"), {H, q}, {none, col}, dt, st));
    L.tensors.push_back(tensor(gn, {I, H}, {col, none}, dt, st));
    L.tensors.push_back(tensor(un, {I, H}, {col, none}, dt, st));
    L.tensors.push_back(tensor(layer_name(i, "mlp.down_proj.weight"), {H, I}, {none, col}, dt, st));
    L.tensors.push_back(tensor(layer_name(i, "input_layernorm.weight"), {H}, {}, dt, st));
    L.tensors.push_back(tensor(layer_name(i, "post_attention_layernorm.weight"), {H}, {}, dt, st));
    L.buffers.push_back(concat(fmt::format("decoder.layers.{}.self_attention.linear_qkv.weight", i), {qn, kn, vn}, groups_local));
    L.buffers.push_back(concat(fmt::format("decoder.layers.{}.mlp.linear_fc1.weight", i), {gn, un}, 1));
  }
  DimSpec vocab = cut(2, tp);
  vocab.pad_to = round_up(m.vocab, 128 * tp);
  L.tensors.push_back(tensor("model.embed_tokens.weight", {m.vocab, H}, {vocab, none}, dt, {StageCoord{0, 0}}));
  L.tensors.push_back(tensor("model.norm.weight", {H}, {}, dt, {StageCoord{0, pp - 1}}));
  L.tensors.push_back(tensor("lm_head.weight", {m.vocab, H}, {vocab, none}, dt, {StageCoord{0, pp - 1}}));
  L.validate();
  return L;
}

/// vLLM inference layout: mesh [pp, tp], qkv_proj = [q_r; k_r; v_r] (kv heads
/// replicated when tp > kv_heads), gate_up_proj = [gate_r; up_r], row-parallel
/// o/down, vocab padded to a multiple of 64 and cut evenly, L // pp layers per
/// stage with the remainder on the stages before the last.
inline Layout vllm_layout(const ModelShape& m, int tp, int pp, std::int64_t first_rank) {
  using namespace detail;
  if (tp > m.kv_heads ? tp % m.kv_heads != 0 : m.kv_heads % tp != 0)
    fail("vllm layout: tp={} and {} kv heads do not divide each other", tp, m.kv_heads);
  Layout L;
  L.origin = fmt::format("vllm tp={},pp={}", tp, pp);
  L.mesh.axes = {{"pp", pp}, {"tp", tp}};
  L.mesh.first_rank = first_rank;
  const DimSpec col = cut(1, tp), none{};
  DimSpec kvcut = col;
  if (tp > m.kv_heads) kvcut.axes = {AxisRef{1, tp / m.kv_heads, m.kv_heads}};  // shard = rank // replicas
  const DType dt = m.dtype;
  const std::int64_t q = m.heads * m.head_dim, kv = m.kv_heads * m.head_dim, H = m.hidden, I = m.intermediate;
  std::vector<int> stage_of(static_cast<std::size_t>(m.layers));
  {
    const int base = m.layers / pp, extra = m.layers % pp;
    int layer = 0;
    for (int s = 0; s < pp; ++s) {
      const int n = base + ((s < extra && s != pp - 1) || (pp == 1 && extra) ? 1 : 0);
      for (int k = 0; k < n && layer < m.layers; ++k) stage_of[static_cast<std::size_t>(layer++)] = s;
    }
    while (layer < m.layers) stage_of[static_cast<std::size_t>(layer++)] = pp - 1;
  }
  for (int i = 0; i < m.layers; ++i) {
    const std::vector<StageCoord> st = {StageCoord{0, stage_of[static_cast<std::size_t>(i)]}};
    const auto qn = layer_name(i, "self_attn.q_proj.weight"), kn = layer_name(i, "self_attn.k_proj.weight"),
               vn = layer_name(i, "self_attn.v_proj.weight"), gn = layer_name(i, "mlp.gate_proj.weight"),
               un = layer_name(i, "mlp.up_proj.weight");
    L.tensors.push_back(tensor(qn, {q, H}, {col, none}, dt, st));
    L.tensors.push_back(tensor(kn, {kv, H}, {kvcut, none}, dt, st));
    L.tensors.push_back(tensor(vn, {kv, H}, {kvcut, none}, dt, st));
    L.tensors.push_back(tensor(layer_name(i, "self_attn.o_proj.weight"), {H, q}, {none, col}, dt, st));
    L.tensors.push_back(tensor(gn, {I, H}, {col, none}, dt, st));
    L.tensors.push_back(tensor(un, {I, H}, {col, none}, dt, st));
    L.tensors.push_back(tensor(layer_name(i, "mlp.down_proj.weight"), {H, I}, {none, col}, dt, st));
    L.tensors.push_back(tensor(layer_name(i, "input_layernorm.weight"), {H}, {}, dt, st));
    L.tensors.push_back(tensor(layer_name(i, "post_attention_layernorm.weight"), {H}, {}, dt, st));
    L.buffers.push_back(concat(layer_name(i, "self_attn.qkv_proj.weight"), {qn, kn, vn}, 1));
    L.buffers.push_back(concat(layer_name(i, "mlp.gate_up_proj.weight"), {gn, un}, 1));
  }
  DimSpec vocab = col;
  vocab.pad_to = round_up(m.vocab, 64);
  if (vocab.pad_to % tp != 0) vocab.pad_to = round_up(m.vocab, 64 * tp);
  L.tensors.push_back(tensor("model.embed_tokens.weight", {m.vocab, H}, {vocab, none}, dt, {StageCoord{0, 0}}));
  L.tensors.push_back(tensor("model.norm.weight", {H}, {}, dt, {StageCoord{0, pp - 1}}));
  L.tensors.push_back(tensor("lm_head.weight", {m.vocab, H}, {vocab, none}, dt, {StageCoord{0, pp - 1}}));
  L.validate();
  return L;
}

/// Bytes a destination rank must receive over the network at least: its real
/// elements minus those the same rank already holds in the source layout.
/// -1 when a source tensor sits in a flat buffer (held sets are not boxes).
inline std::int64_t minimal_bytes(const Layout& src, const Layout& dst) {
  std::int64_t total = 0;
  for (std::int64_t pd = 0; pd < dst.mesh.size(); ++pd) {
    const auto rank = dst.mesh.global_rank(pd);
    const auto ps = src.mesh.position_of(rank);
    for (int t = 0; t < static_cast<int>(dst.tensors.size()); ++t) {
      if (!dst.holds(pd, t)) continue;
      const auto& ts = dst.tensors[static_cast<std::size_t>(t)];
      const int st = src.find_tensor(ts.name);
      std::int64_t have = 1, common = 1;
      const bool colocated = ps && src.holds(*ps, st);
      if (colocated) {
        const int b = src.tensors[static_cast<std::size_t>(st)].buffer;
        if (b >= 0 && src.buffers[static_cast<std::size_t>(b)].kind == BufferKind::flat) return -1;
      }
      for (int d = 0; d < ts.rank(); ++d) {
        const DimPart dp = dst.dim_part(pd, t, d);
        std::int64_t h = 0, c = 0;
        for (std::int64_t i = 0; i < ts.shape[static_cast<std::size_t>(d)]; ++i) {
          if (!dp.holds(i)) continue;
          ++h;
          if (colocated && src.dim_part(*ps, st, d).holds(i)) ++c;
        }
        have *= h;
        common *= c;
      }
      total += (have - (colocated ? common : 0)) * element_bytes(ts.dtype);
    }
  }
  return total;
}

struct RunOptions {
  int iterations = 5;
  bool baseline = true;
  ExecutorOptions executor;
  LocalWorldOptions world;
  /// A staged (hierarchical) schedule of src -> dst: reshard's refit is a
  /// Resharder running it (ResharderOptions::staged) instead of its own plan.
  std::shared_ptr<const StagedSchedule> staged;
  /// Called once set up and after each iteration (both methods, checked),
  /// from one rank's thread: (iterations done, iterations), 0 = set up.
  std::function<void(int, int)> progress;
};

/// One method's figures (over all ranks).
struct MethodResult {
  std::int64_t bytes_moved = 0;  ///< network bytes per refit (sum over ranks, executor-counted)
  std::int64_t local_bytes = 0;
  std::int64_t messages = 0;
  int waves = 0;                         ///< most waves on any rank
  std::int64_t peak_staging_bytes = 0;   ///< most on any rank, measured
  std::int64_t staging_bytes = 0;        ///< most allocated on any rank
  std::vector<double> seconds;           ///< per iteration: first start to last finish
  double median = 0, best = 0;
  bool validated = false;
  std::int64_t checked = 0, wrong = 0;
  std::string first_wrong;
};

struct RunResult {
  std::int64_t src_ranks = 0, dst_ranks = 0;
  std::int64_t plan_bytes = 0, plan_local_bytes = 0, minimal_bytes = 0;
  std::int64_t transport_bytes = 0;  ///< what the world itself copied, all refits
  double plan_seconds = 0;           ///< slowest rank's own plan
  MethodResult reshard, baseline;
};

inline double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const auto n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

namespace detail {
/// A rank's tagged buffers under one layout (verify.hpp).
using Side = TaggedSide;
}  // namespace detail

/// Refits src -> dst `iterations` times on a LocalWorld of both sides' ranks
/// (one thread each), alternating with the traditional refit, each iteration
/// with new source values and every destination element validated after
/// every iteration of each method.
inline RunResult run_refit(const Layout& src, const Layout& dst, const RunOptions& opt) {
  RunResult res;
  std::set<std::int64_t> world_set;
  for (auto r : src.mesh.global_ranks()) world_set.insert(r);
  for (auto r : dst.mesh.global_ranks()) world_set.insert(r);
  const std::vector<std::int64_t> ranks(world_set.begin(), world_set.end());
  const std::size_t n = ranks.size();
  res.src_ranks = src.mesh.size();
  res.dst_ranks = dst.mesh.size();
  res.minimal_bytes = minimal_bytes(src, dst);
  const int iters = std::max(1, opt.iterations);
  const Layout gathered = opt.baseline ? gather_layout(src) : Layout{};
  const Layout broadcast = opt.baseline ? broadcast_layout(dst) : Layout{};

  struct PerRank {
    std::vector<Clock::time_point> t0, t1, b0, b1;
    RefitReport main;
    std::vector<RefitReport> base;
    TagCheck check, base_check;
    double plan_seconds = 0;
  };
  std::vector<PerRank> per(n);
  LocalWorld world(ranks, opt.world);
  world.run([&](LocalTransport& t) {
    std::size_t i = 0;
    while (ranks[i] != t.rank()) ++i;
    PerRank& me = per[i];
    const auto far = [&] { return Clock::now() + opt.executor.timeout; };
    LocalBuffers main_bufs;
    detail::Side s, d;
    s.allocate(src, t.rank(), main_bufs.src);
    d.allocate(dst, t.rank(), main_bufs.dst);
    s.other = &dst;  // quantized destinations (docs/fp8.md)
    d.other = &src;
    s.fill(TagFill::source, 0);
    d.fill(TagFill::poison, 0);

    ResharderOptions ro;
    ro.executor = opt.executor;
    ro.executor.channel = 0;
    // reshard's refit: a Resharder with its own plan, or running the staged
    // schedule stage by stage on channels 8.. (the baseline's are 1-3), both
    // under the versioned commit.
    ResharderOptions mo = ro;
    if (opt.staged) {
      mo.staged = opt.staged;
      mo.executor.channel = 8;
    }
    Resharder<Layout, LocalTransport> reshard_refit(src, dst, main_bufs, t, mo);
    me.plan_seconds = reshard_refit.schedule().stats.plan_seconds;
    // The traditional refit's intermediate buffers: whole tensors on the
    // gather roots and on every destination rank.
    detail::Side g_side, b_side;
    std::map<std::string, BufferView> gv, bv;
    std::unique_ptr<Resharder<Layout, LocalTransport>> gather, bcast, slice;
    if (opt.baseline) {
      g_side.allocate(gathered, t.rank(), gv);
      b_side.allocate(broadcast, t.rank(), bv);
      LocalBuffers g_bufs{main_bufs.src, gv}, b_bufs{gv, bv}, s_bufs{bv, main_bufs.dst};
      ResharderOptions r1 = ro, r2 = ro, r3 = ro;
      r1.executor.channel = 1;
      r2.executor.channel = 2;
      r3.executor.channel = 3;
      gather = std::make_unique<Resharder<Layout, LocalTransport>>(src, gathered, g_bufs, t, r1);
      bcast = std::make_unique<Resharder<Layout, LocalTransport>>(gathered, broadcast, b_bufs, t, r2);
      slice = std::make_unique<Resharder<Layout, LocalTransport>>(broadcast, dst, s_bufs, t, r3);
    }
    // Iterations alternate between the methods so both see the same machine
    // (other load drifts over time). Each iteration refits new source values
    // (salt k) into all-wrong destination memory and is checked element by
    // element (outside the timed window), so a refit that moved nothing, or
    // last iteration's values, fails.
    const bool reports = opt.progress && i == 0;
    if (opt.progress) t.all_gather({}, far());  // every rank set up
    if (reports) opt.progress(0, iters);
    for (int k = 0; k < iters; ++k) {
      const auto salt = static_cast<std::uint64_t>(k);
      if (k > 0) {
        s.fill(TagFill::source, salt);
        d.fill(TagFill::poison, salt);
      }
      t.all_gather({}, far());
      me.t0.push_back(Clock::now());
      me.main = reshard_refit.refit();
      me.t1.push_back(Clock::now());
      me.check.add(d.check(salt), fmt::format("iteration {}", k));
      if (opt.baseline) {
        d.fill(TagFill::poison, salt);
        t.all_gather({}, far());
        me.b0.push_back(Clock::now());
        me.base = {gather->refit(), bcast->refit(), slice->refit()};
        me.b1.push_back(Clock::now());
        me.base_check.add(d.check(salt), fmt::format("iteration {}", k));
      }
      if (opt.progress) t.all_gather({}, far());  // every rank checked this iteration
      if (reports) opt.progress(k + 1, iters);
    }
    t.all_gather({}, far());
  });
  res.transport_bytes = world.total_stats().bytes_sent;

  auto summarize = [&](MethodResult& m, auto reports_of, auto t0_of, auto t1_of, auto check_of) {
    for (std::size_t i = 0; i < n; ++i) {
      for (const RefitReport& r : reports_of(per[i])) {
        m.bytes_moved += r.bytes_sent;
        m.local_bytes += r.local_bytes;
        m.messages += r.messages_sent;
        m.waves = std::max(m.waves, r.waves);
        m.peak_staging_bytes = std::max(m.peak_staging_bytes, r.peak_staging_bytes);
        m.staging_bytes = std::max(m.staging_bytes, r.staging_bytes);
      }
      const TagCheck& c = check_of(per[i]);
      m.checked += c.checked;
      m.wrong += c.wrong;
      if (c.wrong && m.first_wrong.empty()) m.first_wrong = c.first_wrong;
    }
    for (int k = 0; k < iters; ++k) {
      Clock::time_point a = Clock::time_point::max(), b = Clock::time_point::min();
      for (std::size_t i = 0; i < n; ++i) {
        a = std::min(a, t0_of(per[i])[static_cast<std::size_t>(k)]);
        b = std::max(b, t1_of(per[i])[static_cast<std::size_t>(k)]);
      }
      m.seconds.push_back(std::chrono::duration<double>(b - a).count());
    }
    m.median = median(m.seconds);
    m.best = *std::min_element(m.seconds.begin(), m.seconds.end());
    m.validated = m.wrong == 0 && m.checked > 0;
  };
  summarize(
      res.reshard, [](const PerRank& p) { return std::vector<RefitReport>{p.main}; }, [](const PerRank& p) -> const auto& { return p.t0; },
      [](const PerRank& p) -> const auto& { return p.t1; }, [](const PerRank& p) -> const TagCheck& { return p.check; });
  for (const auto& p : per) {
    res.plan_bytes += p.main.plan_bytes_sent;
    res.plan_local_bytes += p.main.plan_local_bytes;
    res.plan_seconds = std::max(res.plan_seconds, p.plan_seconds);
  }
  if (opt.baseline)
    summarize(
        res.baseline, [](const PerRank& p) { return p.base; }, [](const PerRank& p) -> const auto& { return p.b0; },
        [](const PerRank& p) -> const auto& { return p.b1; }, [](const PerRank& p) -> const TagCheck& { return p.base_check; });
  return res;
}

}  // namespace refit_harness
