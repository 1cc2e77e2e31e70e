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

#include "reshard/plan/hierarchical.hpp"
#include "reshard/plan/plan.hpp"
#include "reshard/resharder.hpp"
#include "reshard/transport/local.hpp"
#include "reshard_support/measured_refit.hpp"

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

/// A fused buffer's name and its interleave (query groups per rank for
/// Megatron's per-group [q; k; v], 1 for a plain concatenation).
struct Fused {
  std::string name;
  std::int64_t interleave = 1;
};

/// Decoder layer i's tensors (HF names) on stage `st`, column-parallel
/// weights cut by `col` (k/v by `kvcut`), row-parallel ones on dim 1, and its
/// fused qkv and gate/up buffers: both frameworks' layers differ only there.
inline void add_layer(LayoutSpec& L, const ModelShape& m, int i, const DimSpec& col, const DimSpec& kvcut, const std::vector<StageCoord>& st,
                      const Fused& qkv, const Fused& gate_up) {
  const DimSpec none{};
  const DType dt = m.dtype;
  const std::int64_t q = m.heads * m.head_dim, kv = m.kv_heads * m.head_dim, H = m.hidden, I = m.intermediate;
  const auto qn = layer_name(i, "self_attn.q_proj.weight"), kn = layer_name(i, "self_attn.k_proj.weight"),
             vn = layer_name(i, "self_attn.v_proj.weight"), gn = layer_name(i, "mlp.gate_proj.weight"), un = layer_name(i, "mlp.up_proj.weight");
  L.tensors.push_back(tensor(qn, {q, H}, {col, none}, dt, st));
  L.tensors.push_back(tensor(kn, {kv, H}, {kvcut, none}, dt, st));
  L.tensors.push_back(tensor(vn, {kv, H}, {kvcut, none}, dt, st));
  L.tensors.push_back(tensor(layer_name(i, "self_attn.o_proj.weight"), {H, q}, {none, col}, dt, st));
  L.tensors.push_back(tensor(gn, {I, H}, {col, none}, dt, st));
  L.tensors.push_back(tensor(un, {I, H}, {col, none}, dt, st));
  L.tensors.push_back(tensor(layer_name(i, "mlp.down_proj.weight"), {H, I}, {none, col}, dt, st));
  L.tensors.push_back(tensor(layer_name(i, "input_layernorm.weight"), {H}, {}, dt, st));
  L.tensors.push_back(tensor(layer_name(i, "post_attention_layernorm.weight"), {H}, {}, dt, st));
  L.buffers.push_back(concat(qkv.name, {qn, kn, vn}, qkv.interleave));
  L.buffers.push_back(concat(gate_up.name, {gn, un}, gate_up.interleave));
}

/// The embedding on the first stage, the final norm and lm_head on the last.
inline void add_ends(LayoutSpec& L, const ModelShape& m, const DimSpec& vocab, int pp) {
  const DimSpec none{};
  L.tensors.push_back(tensor("model.embed_tokens.weight", {m.vocab, m.hidden}, {vocab, none}, m.dtype, {StageCoord{0, 0}}));
  L.tensors.push_back(tensor("model.norm.weight", {m.hidden}, {}, m.dtype, {StageCoord{0, pp - 1}}));
  L.tensors.push_back(tensor("lm_head.weight", {m.vocab, m.hidden}, {vocab, none}, m.dtype, {StageCoord{0, pp - 1}}));
}
}  // namespace detail

/// Megatron-Core training layout: mesh [pp, dp, tp] (tp fastest), layers
/// split evenly over pp, linear_qkv per query group [q_g; k_g; v_g] cut over
/// tp, linear_fc1 = [gate_t; up_t], row-parallel o/down, vocab padded to a
/// multiple of 128*tp, embedding on the first stage, norm + lm_head on the last.
inline Layout megatron_layout(const ModelShape& m, int pp, int dp, int tp, std::int64_t first_rank = 0) {
  using namespace detail;
  if (m.layers % pp != 0) fail("megatron layout: {} layers do not split evenly over pp={}", m.layers, pp);
  if (m.kv_heads % tp != 0) fail("megatron layout: tp={} must divide the {} query groups", tp, m.kv_heads);
  LayoutSpec L;
  L.origin = fmt::format("megatron pp={},dp={},tp={}", pp, dp, tp);
  L.mesh.axes = {{"pp", pp}, {"dp", dp}, {"tp", tp}};
  L.mesh.first_rank = first_rank;
  const DimSpec col = cut(2, tp);
  const std::int64_t groups_local = m.kv_heads / tp;
  for (int i = 0; i < m.layers; ++i)
    add_layer(L, m, i, col, col, {StageCoord{0, i / (m.layers / pp)}},
              {fmt::format("decoder.layers.{}.self_attention.linear_qkv.weight", i), groups_local},
              {fmt::format("decoder.layers.{}.mlp.linear_fc1.weight", i), 1});
  DimSpec vocab = col;
  vocab.pad_to = round_up(m.vocab, 128 * tp);
  add_ends(L, m, vocab, pp);
  return Layout(std::move(L));
}

/// vLLM inference layout: mesh [pp, tp], qkv_proj = [q_r; k_r; v_r] (kv heads
/// replicated when tp > kv_heads), gate_up_proj = [gate_r; up_r], row-parallel
/// o/down, vocab padded to a multiple of 64 and cut evenly, L // pp layers per
/// stage with the remainder on the stages before the last.
inline Layout vllm_layout(const ModelShape& m, int tp, int pp, std::int64_t first_rank) {
  using namespace detail;
  if (tp > m.kv_heads ? tp % m.kv_heads != 0 : m.kv_heads % tp != 0)
    fail("vllm layout: tp={} and {} kv heads do not divide each other", tp, m.kv_heads);
  LayoutSpec L;
  L.origin = fmt::format("vllm tp={},pp={}", tp, pp);
  L.mesh.axes = {{"pp", pp}, {"tp", tp}};
  L.mesh.first_rank = first_rank;
  const DimSpec col = cut(1, tp);
  DimSpec kvcut = col;
  if (tp > m.kv_heads) kvcut.axes = {AxisRef{1, tp / m.kv_heads, m.kv_heads}};  // shard = rank // replicas
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
  for (int i = 0; i < m.layers; ++i)
    add_layer(L, m, i, col, kvcut, {StageCoord{0, stage_of[static_cast<std::size_t>(i)]}},
              {layer_name(i, "self_attn.qkv_proj.weight"), 1}, {layer_name(i, "mlp.gate_up_proj.weight"), 1});
  DimSpec vocab = col;
  vocab.pad_to = round_up(m.vocab, 64);
  if (vocab.pad_to % tp != 0) vocab.pad_to = round_up(m.vocab, 64 * tp);
  add_ends(L, m, vocab, pp);
  return Layout(std::move(L));
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

using RunOptions = MeasuredRefitOptions;

struct RunResult {
  std::int64_t src_ranks = 0, dst_ranks = 0;
  std::int64_t plan_bytes = 0, plan_local_bytes = 0, minimal_bytes = 0;
  std::int64_t transport_bytes = 0;  ///< what the world itself copied, all refits
  double plan_seconds = 0;           ///< slowest rank's own plan
  MethodFigures reshard, baseline;
};

/// Refits src -> dst `iterations` times on a LocalWorld of both sides' ranks
/// (one thread each), alternating with the traditional refit, each iteration
/// with new source values and every destination element validated after
/// every iteration of each method (measured_refit.hpp).
inline RunResult run_refit(const Layout& src, const Layout& dst, const RunOptions& opt) {
  RunResult res;
  std::set<std::int64_t> world_set;
  for (auto r : src.mesh.global_ranks()) world_set.insert(r);
  for (auto r : dst.mesh.global_ranks()) world_set.insert(r);
  const std::vector<std::int64_t> ranks(world_set.begin(), world_set.end());
  res.src_ranks = src.mesh.size();
  res.dst_ranks = dst.mesh.size();
  res.minimal_bytes = minimal_bytes(src, dst);
  std::vector<RankFigures> per(ranks.size());
  LocalWorld world(ranks);
  world.run([&](LocalTransport& t) {
    per[static_cast<std::size_t>(std::find(ranks.begin(), ranks.end(), t.rank()) - ranks.begin())] =
        measure_refit_on_rank(src, dst, t, opt, [](const auto&) {});
  });
  res.transport_bytes = world.total_stats().bytes_sent;
  res.reshard = summarize_method(per, false, true);
  for (const auto& p : per) {
    res.plan_bytes += p.main.plan_bytes_sent;
    res.plan_local_bytes += p.main.plan_local_bytes;
    res.plan_seconds = std::max(res.plan_seconds, p.plan_seconds);
  }
  if (opt.baseline) res.baseline = summarize_method(per, true, true);
  return res;
}

}  // namespace refit_harness
