#pragma once
// Training layout preset: Megatron-Core conventions (CONTRACT.md §3).
//
// Rules it follows, and where they come from in Megatron-Core:
// - Ranks: RankGenerator order "tp-cp-ep-dp-pp": mesh axes pp, dp, cp, tp (tp
//   fastest), world = tp*cp*dp*pp, first rank 0 (or `first_rank`).
// - Column-parallel (ColumnParallelLinear: dim 0 cut over tp): linear_qkv,
//   linear_fc1, MLA linear_q_up_proj / linear_kv_up_proj (and linear_q_proj
//   without q_lora), the MTP eh_proj (built with gather_output=False), the
//   vocabulary-parallel embedding and output layer. Row-parallel
//   (RowParallelLinear: dim 1): linear_proj (o_proj), linear_fc2 (down_proj).
//   Norms, the MoE router (and its expert_bias) and the MLA down projections
//   (linear_q_down_proj / linear_kv_down_proj, TELinear "duplicated") are
//   replicated. Every weight is replicated over dp and cp.
// - linear_qkv: the fused weight [(nh + 2*ng)*hd, H] is, per query group g,
//   [q heads of g ; k_g ; v_g]; ColumnParallelLinear cuts it into tp equal
//   contiguous blocks. Global tensors stay HF's q_proj/k_proj/v_proj, so the
//   local buffer `linear_qkv` is a concat of their pieces:
//     ng % tp == 0: each rank holds ng/tp whole groups: q, k, v cut evenly,
//       interleave = ng/tp (one round per local group);
//     tp % ng == 0: a group is cut over s = tp/ng ranks; rank r holds rows
//       [j*R, (j+1)*R) (j = r % s, R = (nh/ng + 2)*hd / s) of group r/s's
//       block, i.e. some q rows, then maybe k rows, then maybe v rows: q, k, v
//       are cut with explicit split sizes (zero where a rank holds none) and
//       concatenated with interleave 1. (Megatron-Core's attention itself asserts
//       ng % tp == 0 via divide(num_query_groups, tp); this branch is the
//       contiguous-block rule of DESIGN.md §3 for forks that allow tp > ng.)
// - linear_fc1 = [gate_t ; up_t] on each tp rank (gate and up cut evenly,
//   concat interleave 1); shared experts likewise (SharedExpertMLP uses the
//   dense tp group).
// - Vocabulary: padded to a multiple of 128*tp (make_vocab_size_divisible_by
//   = 128, _vocab_size_with_padding), cut evenly; the padding rows sit on the
//   last ranks and are never sent (pad_to).
// - Experts: RankGenerator builds the expert ranks of a stage with order
//   "tp-ep-dp-pp" (etp fastest, then ep, then edp), ep*etp*edp = tp*cp*dp.
//   This preset keeps one mesh (pp, dp, cp, tp) and expresses the expert
//   digits as SUB-AXES of dp/cp/tp (digit_as_subaxes): e.g. tp=1,dp=32,ep=16:
//   ep = {dp, stride 1, size 16}, edp = dp / 16. Factorizations whose digits
//   do not line up with the dense axes (tp=2, dp=3, ep=3) are rejected.
//   EP rank e holds experts [e*E/ep, (e+1)*E/ep) (contiguous); etp cuts each
//   expert's gate/up on dim 0 and down on dim 1. Each expert stays its own
//   global tensor (HF name); residence is expressed by an explicit split over
//   the ep and etp digits that gives the expert's rows to the owning ep rank
//   and zero rows to the others. Megatron's default etp is tp.
//   Local buffers: TEGroupedMLP keeps one fc1/fc2 weight per local expert;
//   fc1 of expert e is the buffer `...mlp.experts.linear_fc1.weight{e}` (e is
//   the global expert id here) = [gate_e,t ; up_e,t].
//   With a grouped manifest (experts stacked per layer, model.hpp) the stacks
//   are cut on dim 0 over the ep sub-axes (contiguous expert ranges) and on the
//   intermediate dim over etp; fc1 = concat of the gate and up stacks along
//   dim 1 ([E_local, 2*I_t, H]: per local expert [gate_t ; up_t], the
//   weight{i} arrays back to back), fc2 = the down stack [E_local, H, I_t].
// - Pipeline: get_num_layers_to_build / get_transformer_layer_offset. With
//   pp_first and/or pp_last (decoder_first/last_pipeline_num_layers) the other
//   stages share the rest evenly (it must divide). Without them, L % pp == 0
//   gives L/pp each; otherwise (61 layers on 4 or 8 stages) this preset picks
//   the first/last counts itself, as a user would pass them to Megatron:
//   middle stages get m = ceil(L/pp) (or floor(L/pp) when ceil leaves fewer
//   than 2 layers for the two ends), and the first and last stages share
//   L - (pp-2)*m, first = floor(half), last = the rest: 61/4 -> 14,16,16,15;
//   61/8 -> 6,8,8,8,8,8,8,7. Embedding on the first stage; final norm and
//   output layer on the last; MTP layers on the last stage.
// - MTP (DeepSeek num_nextn_predict_layers): Megatron's MTP block reuses the
//   model's embedding and output layer, so the checkpoint's per-MTP copies
//   model.layers.{L+i}.embed_tokens / shared_head.head are not separate
//   Megatron parameters: they are left out of this layout (the manifest keeps
//   them; an inference layout without MTP does not need them).
// - Tied embeddings with pp > 1 would put one tensor on two stages, which a
//   layout cannot express: rejected.
// Names (CONTRACT.md §5): global tensors keep the HF checkpoint's names;
// every local buffer is named as Megatron-Core 0.19's GPTModel (local layer
// spec, unwrapped: no Float16Module "module." prefix) names that rank's
// parameter in named_parameters(): embedding.word_embeddings.weight,
// decoder.layers.{l}.{input_layernorm, self_attention.linear_qkv,
// self_attention.linear_proj, self_attention.{q,k}_layernorm,
// pre_mlp_layernorm, mlp.linear_fc1, mlp.linear_fc2, mlp.router,
// mlp.shared_experts.linear_fc{1,2}, mlp.experts.local_experts.{i}.linear_fc{1,2}}.weight,
// decoder.final_layernorm.weight, output_layer.weight, MLA's
// self_attention.linear_{q,kv}_{down,up}_proj / linear_q_proj and
// {q,kv}_layernorm, MTP's mtp.layers.{k}.{enorm, hnorm, eh_proj}. The layer
// number l is local to the pipeline stage (every stage has decoder.layers.0)
// and i is the expert's index on its EP rank, so one name is one buffer
// whose parts each rank holds only some of (a concat buffer's parts may
// live on different stages: docs/layout-format.md). With group_experts the
// stacks keep the names mlp.experts.linear_fc{1,2}.weight (TEGroupedMLP
// keeps one weight{i} per local expert instead). Norms are in the model's
// dtype here, as under Megatron's mixed-precision wrapper; an unwrapped
// GPTModel keeps them in f32.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "builder.hpp"

namespace reshard::presets {

/// Layers per pipeline stage under the rule above.
inline std::vector<std::int64_t> megatron_stage_layers(std::int64_t layers, std::int64_t pp,
                                                       std::optional<std::int64_t> first = std::nullopt,
                                                       std::optional<std::int64_t> last = std::nullopt) {
  if (pp < 1) fail("pipeline size {} must be positive", pp);
  if (pp == 1) {
    if ((first && *first != layers) || (last && *last != layers))
      fail("pp=1: pp_first/pp_last must equal the {} layers", layers);
    return {layers};
  }
  if (layers < pp) fail("{} layers cannot fill {} pipeline stages", layers, pp);
  std::vector<std::int64_t> counts(static_cast<std::size_t>(pp), 0);
  if (first || last) {
    std::int64_t rest = layers, left = pp;
    if (first) rest -= *first, --left;
    if (last) rest -= *last, --left;
    if (rest < 0)
      fail("pp_first/pp_last take {} layers but the model has {}", layers - rest, layers);
    if (left == 0 && rest != 0)
      fail("pp=2: pp_first + pp_last = {} but the model has {} layers", layers - rest, layers);
    if (left > 0 && rest % left != 0)
      fail("the {} layers left by pp_first/pp_last do not divide evenly over the other {} stages", rest, left);
    for (auto& c : counts) c = left > 0 ? rest / left : 0;
    if (first) counts.front() = *first;
    if (last) counts.back() = *last;
    return counts;
  }
  if (layers % pp == 0) {
    for (auto& c : counts) c = layers / pp;
    return counts;
  }
  std::int64_t m = (layers + pp - 1) / pp;
  if (layers - (pp - 2) * m < 2) m = layers / pp;
  const std::int64_t ends = layers - (pp - 2) * m;
  for (auto& c : counts) c = m;
  counts.front() = ends / 2;
  counts.back() = ends - ends / 2;
  return counts;
}

/// Megatron's padded vocabulary: a multiple of divisible_by * tp.
inline std::int64_t megatron_padded_vocab(std::int64_t vocab, std::int64_t tp, std::int64_t divisible_by = 128) {
  return round_up(vocab, divisible_by * tp);
}

/// GPTModel's name of a manifest tensor that Megatron-Core stores alone
/// (header comment), "" for the fused ones and those it does not hold (the
/// MTP copies of the embedding and output layer). `prefix(l)` is layer l's
/// stage-local "decoder.layers.{i}." or "mtp.layers.{k}.transformer_layer.".
template <class Prefix>
std::string megatron_parameter_name(const TensorInfo& t, const ModelConfig& c, Prefix&& prefix) {
  const std::string p = t.layer >= 0 ? prefix(t.layer) : std::string();
  const std::string mtp = t.layer >= c.layers ? fmt::format("mtp.layers.{}.", t.layer - c.layers) : std::string();
  switch (t.role) {
    case Role::embedding: return "embedding.word_embeddings.weight";
    case Role::final_norm: return "decoder.final_layernorm.weight";
    case Role::lm_head: return "output_layer.weight";
    case Role::input_norm: return p + "input_layernorm.weight";
    case Role::post_attn_norm: return p + "pre_mlp_layernorm.weight";
    case Role::o: return p + "self_attention.linear_proj.weight";
    case Role::q_norm: return p + "self_attention.q_layernorm.weight";
    case Role::k_norm: return p + "self_attention.k_layernorm.weight";
    case Role::q: return c.mla ? p + "self_attention.linear_q_proj.weight" : "";  // GQA: in linear_qkv
    case Role::q_a: return p + "self_attention.linear_q_down_proj.weight";
    case Role::q_a_norm: return p + "self_attention.q_layernorm.weight";
    case Role::q_b: return p + "self_attention.linear_q_up_proj.weight";
    case Role::kv_a: return p + "self_attention.linear_kv_down_proj.weight";
    case Role::kv_a_norm: return p + "self_attention.kv_layernorm.weight";
    case Role::kv_b: return p + "self_attention.linear_kv_up_proj.weight";
    case Role::down: return p + "mlp.linear_fc2.weight";
    case Role::router: return p + "mlp.router.weight";
    case Role::router_bias: return p + "mlp.router.expert_bias";
    case Role::shared_down: return p + "mlp.shared_experts.linear_fc2.weight";
    case Role::mtp_enorm: return mtp + "enorm.weight";
    case Role::mtp_hnorm: return mtp + "hnorm.weight";
    case Role::mtp_eh_proj: return mtp + "eh_proj.weight";
    case Role::mtp_head_norm: return mtp + "final_layernorm.weight";
    default: return "";  // fused (qkv, gate/up, experts) or not a Megatron parameter (MTP embedding/head)
  }
}

/// The expert factorization of one pipeline stage's ranks.
struct MegatronExpertMesh {
  std::int64_t ep = 1, etp = 1, edp = 1;
  std::vector<AxisRef> ep_axes, etp_axes;  ///< sub-axes of the (pp, dp, cp, tp) mesh, major to minor
};

/// Checks ep*etp*edp = tp*cp*dp and expresses ep and etp as sub-axes of the
/// mesh axes pp=0, dp=1, cp=2, tp=3.
inline MegatronExpertMesh megatron_expert_mesh(const ParallelSpec& s, const std::string& where) {
  MegatronExpertMesh x;
  x.ep = s.ep;
  const std::int64_t stage_ranks = s.tp * s.cp * s.dp;
  // Megatron defaults etp to tp; when ep*tp does not fit the stage (e.g.
  // tp=2,dp=1,ep=2) the only factorization is etp=1, the usual MoE setting.
  x.etp = s.etp.value_or(stage_ranks % (x.ep * s.tp) == 0 ? s.tp : 1);
  if (stage_ranks % (x.ep * x.etp) != 0)
    fail("{}: ep*etp = {}*{} does not divide the {} ranks of a stage (tp*cp*dp; Megatron needs "
         "ep*etp*edp = tp*cp*dp)",
         where, x.ep, x.etp, stage_ranks);
  x.edp = stage_ranks / (x.ep * x.etp);
  // Dense digits, minor to major: tp, cp, dp.
  const std::vector<std::pair<int, std::int64_t>> dense = {{3, s.tp}, {2, s.cp}, {1, s.dp}};
  auto etp = detail::digit_as_subaxes(dense, 1, x.etp);
  auto ep = detail::digit_as_subaxes(dense, x.etp, x.etp * x.ep);
  if (!etp || !ep)
    fail("{}: the expert ranks (etp={}, ep={}, edp={}, etp fastest) do not line up with tp={}, cp={}, dp={}: "
         "each expert digit must be a sub-axis of tp, cp or dp",
         where, x.etp, x.ep, x.edp, s.tp, s.cp, s.dp);
  x.etp_axes = *etp;
  x.ep_axes = *ep;
  return x;
}

/// The training layout of a model under a Megatron-Core parallel spec.
inline Layout megatron_layout(const Manifest& m, const ParallelSpec& s, std::int64_t first_rank = 0) {
  const ModelConfig& c = m.config;
  const std::string where = detail::spec_where(c, "train", s);
  const std::int64_t tp = s.tp, pp = s.pp;
  std::int64_t world = 0;
  if (__builtin_mul_overflow(tp * s.cp, s.dp * pp, &world) || world > (std::int64_t{1} << 31))
    fail("{}: world tp*cp*dp*pp is too large", where);
  if (s.has("quant")) fail("{}: quant is an inference key (training keeps the config's dtype)", where);
  if (c.heads % tp != 0) fail("{}: tp={} does not divide num_attention_heads={}", where, tp, c.heads);
  if (!c.mla) {
    const std::int64_t ng = c.kv_heads, group_rows = (c.heads / ng + 2) * c.head_dim;
    if (ng % tp != 0 && tp % ng != 0)
      fail("{}: tp={} and num_key_value_heads={}: one must divide the other", where, tp, ng);
    if (tp > ng && group_rows % (tp / ng) != 0)
      fail("{}: tp={}: a query group of {} rows does not cut into {} equal blocks", where, tp, group_rows, tp / ng);
  }
  bool dense = false;
  for (std::int64_t l = 0; l < c.layers; ++l) dense |= !c.is_moe_layer(l);
  if (dense && c.intermediate % tp != 0)
    fail("{}: tp={} does not divide intermediate_size={}", where, tp, c.intermediate);
  MegatronExpertMesh xm;
  if (c.experts > 0) {
    xm = megatron_expert_mesh(s, where);
    if (c.experts % xm.ep != 0) fail("{}: ep={} does not divide the {} experts", where, xm.ep, c.experts);
    if (c.moe_intermediate % xm.etp != 0)
      fail("{}: etp={} does not divide moe_intermediate_size={}", where, xm.etp, c.moe_intermediate);
    if (c.shared_experts > 0 && c.shared_intermediate() % tp != 0)
      fail("{}: tp={} does not divide the shared experts' intermediate size {}", where, tp, c.shared_intermediate());
  } else {
    if (s.ep != 1) fail("{}: ep={} but the model has no experts", where, s.ep);
    if (s.etp && *s.etp != 1 && *s.etp != tp) fail("{}: etp={} but the model has no experts", where, *s.etp);
  }
  if (c.mtp_layers > 0 && c.hidden % tp != 0)
    fail("{}: tp={} does not divide hidden_size={} (MTP eh_proj)", where, tp, c.hidden);
  const auto stage = detail::layer_stages(c, pp, where, [&] { return megatron_stage_layers(c.layers, pp, s.pp_first, s.pp_last); });

  detail::LayoutBuilder b(fmt::format("megatron layout ({})", to_string(s)),
                          {{"pp", pp}, {"dp", s.dp}, {"cp", s.cp}, {"tp", tp}}, first_rank);
  b.set_stage_axis("pp");
  using LB = detail::LayoutBuilder;
  const AxisRef TP = b.whole("tp");
  const std::int64_t vocab_pad = megatron_padded_vocab(c.vocab, tp);

  // linear_qkv pieces when tp % ng == 0 (see the header comment).
  std::vector<std::int64_t> q_sizes, k_sizes, v_sizes;
  std::int64_t qkv_interleave = 1;
  if (!c.mla) {
    const std::int64_t ng = c.kv_heads, hd = c.head_dim, Qg = c.heads / ng * hd;
    if (ng % tp == 0) {
      qkv_interleave = ng / tp;
    } else {
      const std::int64_t split = tp / ng, R = (Qg + 2 * hd) / split;
      auto overlap = [](std::int64_t a0, std::int64_t a1, std::int64_t b0, std::int64_t b1) {
        return std::max<std::int64_t>(0, std::min(a1, b1) - std::max(a0, b0));
      };
      for (std::int64_t r = 0; r < tp; ++r) {
        const std::int64_t j = r % split, lo = j * R, hi = lo + R;
        q_sizes.push_back(overlap(lo, hi, 0, Qg));
        k_sizes.push_back(overlap(lo, hi, Qg, Qg + hd));
        v_sizes.push_back(overlap(lo, hi, Qg + hd, Qg + 2 * hd));
      }
    }
  }
  std::vector<AxisRef> expert_refs = xm.ep_axes;
  expert_refs.insert(expert_refs.end(), xm.etp_axes.begin(), xm.etp_axes.end());
  const std::int64_t experts_per_rank = c.experts > 0 ? c.experts / xm.ep : 1;
  // Rows (or columns) of expert e on each (ep, etp) part: the owner's ep rank gets them.
  auto expert_dim = [&](std::int64_t e, std::int64_t extent) {
    if (expert_refs.empty()) return DimSpec{};
    std::vector<std::int64_t> sizes(static_cast<std::size_t>(xm.ep * xm.etp), 0);
    const std::int64_t owner = e / experts_per_rank;
    for (std::int64_t t = 0; t < xm.etp; ++t) sizes[static_cast<std::size_t>(owner * xm.etp + t)] = extent / xm.etp;
    return LB::sizes(expert_refs, std::move(sizes));
  };

  for (const auto& t : m.tensors) {
    const std::int64_t st = t.layer < 0 ? 0 : stage[static_cast<std::size_t>(t.layer)];
    if (b.add_alike(t, TP, vocab_pad, st, pp - 1)) continue;
    switch (t.role) {
      case Role::q:
        if (c.mla || q_sizes.empty()) b.add(t, LB::column_parallel(TP), st);
        else b.add(t, {LB::sizes({TP}, q_sizes), DimSpec{}}, st);
        break;
      case Role::k:
      case Role::v:
        if (q_sizes.empty()) b.add(t, LB::column_parallel(TP), st);
        else b.add(t, {LB::sizes({TP}, t.role == Role::k ? k_sizes : v_sizes), DimSpec{}}, st);
        break;
      case Role::expert_gate:
      case Role::expert_up:
        if (t.stacked) b.add(t, {LB::even(xm.ep_axes), LB::even(xm.etp_axes), DimSpec{}}, st);
        else b.add(t, {expert_dim(t.expert, t.shape[0]), DimSpec{}}, st);
        break;
      case Role::expert_down:
        if (t.stacked) b.add(t, {LB::even(xm.ep_axes), DimSpec{}, LB::even(xm.etp_axes)}, st);
        else b.add(t, {DimSpec{}, expert_dim(t.expert, t.shape[1])}, st);
        break;
      case Role::mtp_embedding:
      case Role::mtp_head: break;  // shared with the main embedding / output layer (see above)
      default: b.add(t, {}, st); break;  // norms, router, router bias, MLA down projections
    }
  }
  // Local buffers under GPTModel's names (header comment): the fused ones,
  // then one-part buffers that rename the tensors stored alone.
  const auto first_layer = [&] {
    std::vector<std::int64_t> first(static_cast<std::size_t>(pp), -1);
    for (std::int64_t l = 0; l < c.layers; ++l)
      if (first[static_cast<std::size_t>(stage[static_cast<std::size_t>(l)])] < 0)
        first[static_cast<std::size_t>(stage[static_cast<std::size_t>(l)])] = l;
    return first;
  }();
  auto prefix = [&](std::int64_t l) {
    if (l >= c.layers) return fmt::format("mtp.layers.{}.transformer_layer.", l - c.layers);
    return fmt::format("decoder.layers.{}.", l - first_layer[static_cast<std::size_t>(stage[static_cast<std::size_t>(l)])]);
  };
  using F = detail::FusedBuffer;
  detail::add_fused_buffers(
      b, m, c.total_layers(), prefix,
      {{F::Layers::gqa_attention, "self_attention.linear_qkv.weight", {Role::q, Role::k, Role::v}, qkv_interleave},
       {F::Layers::dense_mlp, "mlp.linear_fc1.weight", {Role::gate, Role::up}},
       {F::Layers::shared_experts, "mlp.shared_experts.linear_fc1.weight", {Role::shared_gate, Role::shared_up}},
       // SequentialMLP: fc1 = [gate_t ; up_t] and fc2 = down_t per local
       // expert. Stacks: fc1 [E_local, 2*I_t, H] = per local expert
       // [gate_t ; up_t] (TEGroupedMLP's weight{i} side by side), fc2
       // [E_local, H, I_t].
       {F::Layers::routed_experts, "mlp.experts.local_experts.{}.linear_fc1.weight", {Role::expert_gate, Role::expert_up}, 1,
        F::Experts::per_expert_unless_grouped, "mlp.experts.linear_fc1.weight"},
       {F::Layers::routed_experts, "mlp.experts.local_experts.{}.linear_fc2.weight", {Role::expert_down}, 1,
        F::Experts::per_expert_only},
       {F::Layers::grouped_experts, "mlp.experts.linear_fc2.weight", {Role::expert_down}}},
      experts_per_rank);
  for (const auto& t : m.tensors) {
    const std::string name = megatron_parameter_name(t, c, prefix);
    if (!name.empty()) b.concat(name, {t.name});
  }
  return b.finish();
}

}  // namespace reshard::presets
