#pragma once
// Inference layout preset: vLLM conventions (CONTRACT.md §3).
//
// Rules it follows, and where they come from in vLLM:
// - Ranks: parallel_state.initialize_model_parallel lays the world out as
//   ExternalDP x DP x PP x TP (tp fastest): mesh axes dp, pp, tp, world =
//   tp*dp*pp. The first rank is the training world size unless colocated
//   (presets.hpp). cp and etp are not vLLM dimensions here: rejected.
// - QKVParallelLinear: `qkv_proj` = [q_r ; k_r ; v_r] per tp rank (interleave
//   1). q is cut evenly over tp; with tp <= n_kv, k and v too; with tp > n_kv
//   each kv head is replicated on tp/n_kv ranks, kv shard = tp_rank //
//   (tp/n_kv): the sub-axis {tp, stride tp/n_kv, size n_kv}.
// - MergedColumnParallelLinear: `gate_up_proj` = [gate_r ; up_r]; RowParallel
//   o_proj / down_proj cut dim 1. Norms and the MoE router (ReplicatedLinear
//   `gate`, and e_score_correction_bias) are replicated; weights are
//   replicated over dp.
// - VocabParallelEmbedding / ParallelLMHead: vocabulary padded to a multiple
//   of 64 (DEFAULT_VOCAB_PADDING_SIZE), then cut evenly over tp (padding on
//   the last ranks, never sent).
// - FusedMoE: `w13_weight` [E_local, 2*I_r, H] (per expert [gate ; up]) and
//   `w2_weight` [E_local, H, I_r]. Per-expert manifests: concat buffers of the
//   per-expert HF tensors (same memory as the 3-D arrays; the buffer shape
//   reads [E_local*2*I_r, H] and [E_local*H, I_r]). Grouped manifests: w13 =
//   concat of the gate and up stacks along dim 1, w2 = the down stack.
//   FusedMoEParallelConfig.make: without expert parallelism the experts'
//   intermediate dim is cut over the flattened dp x tp ranks (tp_rank' =
//   dp_rank*tp + tp_rank: flatten_tp_across_dp), so with dp > 1 it is NOT only
//   tp; with expert parallelism (ep > 1 here) ep = dp*tp, ep_rank = dp_rank*tp
//   + tp_rank, experts are whole (no tp cut) and placed linearly
//   (determine_expert_map "linear": the first E % ep ranks get one more) or
//   round-robin (ExpertPlacement::round_robin). So ep must be 1 or dp*tp.
//   Shared experts (DeepseekV2MLP) use the tp group: gate_up_proj over tp.
// - Pipeline: get_pp_indices: L // pp layers per stage, the remainder one
//   each to the stages before the last (partitions[-2], [-3], ...): 61/4 ->
//   15,15,16,15. Embedding on the first stage, norm and lm_head on the last.
// - MLA (DeepseekV2MLAAttention): `fused_qkv_a_proj` = [q_a_proj ;
//   kv_a_proj_with_mqa], replicated (disable_tp); without q_lora, q_proj is
//   column-parallel and kv_a_proj_with_mqa replicated alone; q_b_proj and
//   kv_b_proj column-parallel by heads, o_proj row-parallel.
// - MTP layers are a separate speculative model in vLLM (DeepSeekMTP): the
//   main model skips their weights, so this layout has none of them.
// - Tied embeddings with pp > 1 would need the embedding on two stages:
//   rejected (a layout gives a tensor one stage).
// Buffer names follow vLLM 0.33's parameter names (CONTRACT.md §5:
// named_parameters() of the model vLLM builds, model.layers.{l}... with
// global layer numbers); the fused experts are
// mlp.experts.routed_experts.w13_weight / .w2_weight in 0.33 (earlier
// releases: mlp.experts.w13_weight). reshard.vllm traces a live model's
// layout instead of trusting this table.
#include <cstdint>
#include <string>
#include <vector>

#include "builder.hpp"
#include "fp8.hpp"

namespace reshard::presets {

enum class ExpertPlacement : std::uint8_t { linear, round_robin };

struct VllmOptions {
  ExpertPlacement placement = ExpertPlacement::linear;
};

/// Layers per pipeline stage (vLLM get_pp_indices without VLLM_PP_LAYER_PARTITION).
inline std::vector<std::int64_t> vllm_stage_layers(std::int64_t layers, std::int64_t pp) {
  if (pp < 1) fail("pipeline size {} must be positive", pp);
  if (layers < pp) fail("{} layers cannot fill {} pipeline stages", layers, pp);
  std::vector<std::int64_t> counts(static_cast<std::size_t>(pp), layers / pp);
  const std::int64_t rem = layers % pp;
  for (std::int64_t i = 2; i < rem + 2; ++i) counts[static_cast<std::size_t>(pp - i)] += 1;
  return counts;
}

/// vLLM's padded vocabulary (a multiple of 64).
inline std::int64_t vllm_padded_vocab(std::int64_t vocab, std::int64_t padding = 64) { return round_up(vocab, padding); }

/// The ep rank that holds expert e (vLLM determine_expert_map).
inline std::int64_t vllm_expert_owner(std::int64_t e, std::int64_t experts, std::int64_t ep,
                                      ExpertPlacement placement = ExpertPlacement::linear) {
  if (placement == ExpertPlacement::round_robin) return e % ep;
  const std::int64_t base = experts / ep, rem = experts % ep;
  if (e < rem * (base + 1)) return e / (base + 1);
  return rem + (e - rem * (base + 1)) / base;
}

/// The inference layout of a model under a vLLM parallel spec.
inline Layout vllm_layout(const Manifest& m, const ParallelSpec& s, std::int64_t first_rank = 0,
                          const VllmOptions& opt = {}) {
  const ModelConfig& c = m.config;
  const std::string where = detail::spec_where(c, "infer", s);
  const std::int64_t tp = s.tp, pp = s.pp, dp = s.dp;
  if (s.cp != 1) fail("{}: cp={}: context parallelism is a training dimension (vLLM world = tp*dp*pp)", where, s.cp);
  if (s.etp) fail("{}: etp is a training key (vLLM's experts are cut over dp*tp, or whole with ep)", where);
  if (s.pp_first || s.pp_last)
    fail("{}: pp_first/pp_last are training keys (vLLM splits layers by get_pp_indices)", where);
  std::int64_t world = 0;
  if (__builtin_mul_overflow(tp * dp, pp, &world) || world > (std::int64_t{1} << 31))
    fail("{}: world tp*dp*pp is too large", where);
  if (c.heads % tp != 0) fail("{}: tp={} does not divide num_attention_heads={}", where, tp, c.heads);
  const std::int64_t ng = c.kv_heads;
  if (!c.mla && ng % tp != 0 && tp % ng != 0)
    fail("{}: tp={} and num_key_value_heads={}: one must divide the other", where, tp, ng);
  bool dense = false;
  for (std::int64_t l = 0; l < c.layers; ++l) dense |= !c.is_moe_layer(l);
  if (dense && c.intermediate % tp != 0)
    fail("{}: tp={} does not divide intermediate_size={}", where, tp, c.intermediate);
  const bool use_ep = s.ep > 1;
  if (c.experts > 0) {
    if (use_ep && s.ep != dp * tp)
      fail("{}: ep={}: vLLM's expert parallelism spans the dp*tp = {} ranks of a stage (give ep={} or ep=1)", where,
           s.ep, dp * tp, dp * tp);
    if (!use_ep && c.moe_intermediate % (dp * tp) != 0)
      fail("{}: dp*tp = {} does not divide moe_intermediate_size={} (without ep, vLLM cuts each expert over dp*tp)",
           where, dp * tp, c.moe_intermediate);
    if (c.shared_experts > 0 && c.shared_intermediate() % tp != 0)
      fail("{}: tp={} does not divide the shared experts' intermediate size {}", where, tp, c.shared_intermediate());
  } else if (use_ep) {
    fail("{}: ep={} but the model has no experts", where, s.ep);
  }
  const std::int64_t vocab_pad = vllm_padded_vocab(c.vocab);
  if (vocab_pad % tp != 0)
    fail("{}: tp={} does not divide the padded vocabulary {} (vocab_size {} rounded up to 64)", where, tp, vocab_pad,
         c.vocab);
  const auto stage = detail::layer_stages(c, pp, where, [&] { return vllm_stage_layers(c.layers, pp); });

  detail::LayoutBuilder b(fmt::format("vllm layout ({})", to_string(s)), {{"dp", dp}, {"pp", pp}, {"tp", tp}},
                          first_rank);
  b.set_stage_axis("pp");
  using LB = detail::LayoutBuilder;
  const AxisRef TP = b.whole("tp");
  const std::vector<AxisRef> moe_ranks = {b.whole("dp"), TP};  // flattened dp x tp, dp major
  const AxisRef KV = tp > ng ? AxisRef{TP.axis, tp / ng, ng} : TP;
  auto expert_dim = [&](std::int64_t e, std::int64_t extent) {
    if (!use_ep) return LB::even(moe_ranks);
    std::vector<std::int64_t> sizes(static_cast<std::size_t>(s.ep), 0);
    sizes[static_cast<std::size_t>(vllm_expert_owner(e, c.experts, s.ep, opt.placement))] = extent;
    return LB::sizes(moe_ranks, std::move(sizes));
  };
  // A stack's expert dim over the ep ranks: linear = numpy array_split
  // ("balanced": the first E % ep ranks get one more), round-robin = cyclic 1.
  auto stack_dim = [&] {
    DimSpec d = LB::even(moe_ranks);
    if (opt.placement == ExpertPlacement::round_robin) {
      d.split = Split::cyclic;
      d.block = 1;
    } else {
      d.split = Split::balanced;
    }
    return d;
  };

  for (const auto& t : m.tensors) {
    if (t.layer >= c.layers) continue;  // MTP: not part of vLLM's main model
    const std::int64_t st = t.layer < 0 ? 0 : stage[static_cast<std::size_t>(t.layer)];
    if (b.add_alike(t, TP, vocab_pad, st, pp - 1)) continue;
    switch (t.role) {
      case Role::q: b.add(t, LB::column_parallel(TP), st); break;
      case Role::k:
      case Role::v: b.add(t, {LB::even({KV}), DimSpec{}}, st); break;
      case Role::expert_gate:
      case Role::expert_up:
        if (!t.stacked) b.add(t, {expert_dim(t.expert, t.shape[0]), DimSpec{}}, st);
        else if (use_ep) b.add(t, {stack_dim(), DimSpec{}, DimSpec{}}, st);
        else b.add(t, {DimSpec{}, LB::even(moe_ranks), DimSpec{}}, st);
        break;
      case Role::expert_down:
        if (!t.stacked) b.add(t, {DimSpec{}, expert_dim(t.expert, t.shape[1])}, st);
        else if (use_ep) b.add(t, {stack_dim(), DimSpec{}, DimSpec{}}, st);
        else b.add(t, {DimSpec{}, DimSpec{}, LB::even(moe_ranks)}, st);
        break;
      default: b.add(t, {}, st); break;  // norms, router, router bias, q_a_proj, kv_a_proj_with_mqa
    }
  }
  // Fused local buffers; routed experts: w13 = [gate ; up] of each expert,
  // w2 = the down projections (grouped: the stacks, w13's along dim 1).
  using F = detail::FusedBuffer;
  detail::add_fused_buffers(b, m, c.layers, [](std::int64_t l) { return fmt::format("model.layers.{}.", l); },
                            {{F::Layers::gqa_attention, "self_attn.qkv_proj.weight", {Role::q, Role::k, Role::v}},
                             {F::Layers::mla_q_lora, "self_attn.fused_qkv_a_proj.weight", {Role::q_a, Role::kv_a}},
                             {F::Layers::dense_mlp, "mlp.gate_up_proj.weight", {Role::gate, Role::up}},
                             {F::Layers::shared_experts, "mlp.shared_experts.gate_up_proj.weight", {Role::shared_gate, Role::shared_up}},
                             {F::Layers::routed_experts, "mlp.experts.routed_experts.w13_weight", {Role::expert_gate, Role::expert_up}},
                             {F::Layers::routed_experts, "mlp.experts.routed_experts.w2_weight", {Role::expert_down}}});
  Layout L = b.finish();
  // FP8 serving: the spec's quant=, else the config's quantization_config.
  const std::string quant = !s.quant.empty() ? s.quant : c.fp8_block.empty() ? "none" : "fp8";
  if (quant != "none") {
    try {
      if (quant == "mxfp8") L = quantize_linear_weights(L, m, QuantScheme::mx, {kMxTile}, "weight_scale");
      else L = quantize_linear_weights(L, m, QuantScheme::block, c.fp8_block.empty() ? std::vector<std::int64_t>{128, 128} : c.fp8_block,
                                       "weight_scale_inv");
    } catch (const LayoutError& e) {
      fail("{}: quant={}: {}", where, quant, e.what());
    }
  }
  return L;
}

}  // namespace reshard::presets
