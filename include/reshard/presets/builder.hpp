#pragma once
// Small helpers the layout presets share: building a Layout tensor by tensor
// from a manifest, and the arithmetic both presets need (rounding, stages).
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "../layout/layout.hpp"
#include "model.hpp"
#include "parallel_spec.hpp"

namespace reshard::presets {

inline std::int64_t round_up(std::int64_t n, std::int64_t multiple) { return (n + multiple - 1) / multiple * multiple; }

namespace detail {

/// Builds one side's Layout: mesh axes, then tensors and fused buffers.
class LayoutBuilder {
 public:
  LayoutBuilder(std::string origin, std::vector<Axis> axes, std::int64_t first_rank) {
    L_.origin = std::move(origin);
    L_.mesh.axes = std::move(axes);
    L_.mesh.first_rank = first_rank;
  }
  int axis(std::string_view name) const { return L_.mesh.axis_index(name); }
  std::int64_t size(std::string_view name) const {
    return L_.mesh.axes[static_cast<std::size_t>(axis(name))].size;
  }
  /// The whole axis as a reference.
  AxisRef whole(std::string_view name) const { return AxisRef{axis(name), 1, size(name)}; }

  /// An even cut over `refs` (major to minor), optionally of a padded extent.
  static DimSpec even(std::vector<AxisRef> refs, std::int64_t pad_to = 0) {
    DimSpec d;
    d.axes = std::move(refs);
    d.pad_to = pad_to;
    return d;
  }
  static DimSpec sizes(std::vector<AxisRef> refs, std::vector<std::int64_t> parts) {
    DimSpec d;
    d.axes = std::move(refs);
    d.split = Split::sizes;
    d.sizes = std::move(parts);
    return d;
  }

  /// A linear weight [out, in] cut over `tp`: column parallel cuts the
  /// output dim, row parallel the input dim.
  static std::vector<DimSpec> column_parallel(AxisRef tp) { return {even({tp}), DimSpec{}}; }
  static std::vector<DimSpec> row_parallel(AxisRef tp) { return {DimSpec{}, even({tp})}; }

  /// Adds a tensor that Megatron and vLLM place alike: the embedding and the
  /// output layer cut by vocabulary rows over tp (padded to `vocab_pad`) on
  /// the first and the last stage, the final norm whole on the last, and the
  /// column- and row-parallel linear layers on their layer's `stage`. False,
  /// nothing added, for a role each framework places its own way.
  bool add_alike(const TensorInfo& t, AxisRef tp, std::int64_t vocab_pad, std::int64_t stage, std::int64_t last_stage) {
    switch (t.role) {
      case Role::embedding: add(t, {even({tp}, vocab_pad), DimSpec{}}, 0); return true;
      case Role::lm_head: add(t, {even({tp}, vocab_pad), DimSpec{}}, last_stage); return true;
      case Role::final_norm: add(t, {}, last_stage); return true;
      case Role::q_b:
      case Role::kv_b:
      case Role::gate:
      case Role::up:
      case Role::shared_gate:
      case Role::shared_up:
      case Role::mtp_eh_proj: add(t, column_parallel(tp), stage); return true;
      case Role::o:
      case Role::down:
      case Role::shared_down: add(t, row_parallel(tp), stage); return true;
      default: return false;
    }
  }

  /// Adds a manifest tensor with its dimspecs (empty = replicated) and the
  /// pipeline stage (coordinate on axis `stage_axis`) it lives on.
  void add(const TensorInfo& t, std::vector<DimSpec> dims, std::int64_t stage) {
    TensorSpec s;
    s.name = t.name;
    s.shape = t.shape;
    s.dtype = t.dtype;
    if (dims.empty()) dims.resize(t.shape.size());
    s.dims = std::move(dims);
    if (stage_axis_ >= 0) s.stage.push_back(StageCoord{stage_axis_, stage});
    L_.tensors.push_back(std::move(s));
  }
  void set_stage_axis(std::string_view name) { stage_axis_ = axis(name); }

  /// A concat buffer of tensors (by name) along `dim`. A name given again
  /// appends its parts to that buffer: a stage-local name (Megatron-Core's
  /// decoder.layers.0 on every stage, local_experts.0 on every EP rank) is
  /// one buffer whose parts each rank holds only some of.
  void concat(std::string name, std::vector<std::string> parts, std::int64_t interleave = 1, int dim = 0) {
    for (auto& b : L_.buffers) {
      if (b.name != name) continue;
      if (b.kind != BufferKind::concat || b.dim != dim || b.interleave != interleave)
        fail("preset: buffer '{}' is made twice with another concat dim or interleave", name);
      b.parts.insert(b.parts.end(), std::make_move_iterator(parts.begin()), std::make_move_iterator(parts.end()));
      return;
    }
    L_.buffers.push_back(concat_buffer(std::move(name), std::move(parts), dim, interleave));
  }

  Layout finish() { return Layout(std::move(L_)); }

 private:
  LayoutSpec L_;
  int stage_axis_ = -1;
};

/// One row of a framework's table of fused buffers: which layers have it,
/// its name after the layer's prefix, and the roles of its parts in order.
struct FusedBuffer {
  enum class Layers : std::uint8_t {
    gqa_attention,  ///< layers without MLA
    mla_q_lora,     ///< MLA layers with q compression
    dense_mlp,      ///< layers without routed experts
    shared_experts,
    routed_experts,  ///< MoE layers: the routed experts (see Experts)
    grouped_experts  ///< MoE layers of a grouped manifest only
  };
  /// How routed experts fuse: all of a layer's experts in one buffer (each
  /// expert's parts in role order, expert after expert; a grouped manifest's
  /// stacks side by side along dim 1 when there are several), or one buffer
  /// per expert (its name's "{}" replaced by the expert's index on its EP
  /// rank) unless grouped, or per expert and nothing when grouped.
  enum class Experts : std::uint8_t { one_buffer, per_expert_unless_grouped, per_expert_only };

  Layers layers;
  std::string_view name;
  std::vector<Role> roles;
  std::int64_t interleave = 1;
  Experts experts = Experts::one_buffer;
  std::string_view grouped_name = {};  ///< per_expert_unless_grouped: the stacks' buffer name
};

/// Adds every fused buffer of `table` for layers [0, layers) named
/// prefix(l) + row.name: one table per framework instead of one loop each.
/// Per-expert buffers number an expert e % experts_per_rank (its index on
/// its EP rank).
template <class Prefix>
void add_fused_buffers(LayoutBuilder& b, const Manifest& m, std::int64_t layers, Prefix&& prefix, const std::vector<FusedBuffer>& table,
                       std::int64_t experts_per_rank = 1) {
  const ModelConfig& c = m.config;
  auto name_of = [&](int id) { return m.tensors[static_cast<std::size_t>(id)].name; };
  using L = FusedBuffer::Layers;
  for (std::int64_t l = 0; l < layers; ++l) {
    const std::string p = prefix(l);
    const bool moe = c.is_moe_layer(l);
    for (const FusedBuffer& f : table) {
      const bool has = f.layers == L::gqa_attention    ? !c.mla
                       : f.layers == L::mla_q_lora      ? c.mla && c.q_lora_rank > 0
                       : f.layers == L::dense_mlp       ? !moe
                       : f.layers == L::shared_experts  ? moe && c.shared_experts > 0
                       : f.layers == L::routed_experts  ? moe
                                                        : moe && m.grouped;
      if (!has) continue;
      std::vector<std::string> parts;
      if (f.layers != L::routed_experts && f.layers != L::grouped_experts) {
        for (Role r : f.roles) parts.push_back(name_of(m.at(l, r)));
        b.concat(p + std::string(f.name), std::move(parts), f.interleave);
        continue;
      }
      const std::size_t experts = m.experts(l, f.roles.front()).size();
      const bool per_expert = f.experts != FusedBuffer::Experts::one_buffer;
      if (per_expert && m.grouped && f.experts == FusedBuffer::Experts::per_expert_only) continue;
      if (per_expert && !m.grouped) {
        for (std::size_t e = 0; e < experts; ++e) {
          std::vector<std::string> one;
          for (Role r : f.roles) one.push_back(name_of(m.experts(l, r)[e]));
          b.concat(p + fmt::format(fmt::runtime(f.name), static_cast<std::int64_t>(e) % experts_per_rank), std::move(one),
                   f.interleave);
        }
        continue;
      }
      for (std::size_t e = 0; e < experts; ++e)
        for (Role r : f.roles) parts.push_back(name_of(m.experts(l, r)[e]));
      b.concat(p + std::string(m.grouped && !f.grouped_name.empty() ? f.grouped_name : f.name), std::move(parts), f.interleave,
               m.grouped && f.roles.size() > 1 ? 1 : 0);
    }
  }
}

/// Expresses one digit of a factorization of the ranks of a pipeline stage
/// as sub-axes of the mesh axes. `axes` are the mesh's (axis, size) pairs
/// minor to major; the digit spans the mixed-radix positions [lo, hi) in
/// product scale (a digit of size z that starts after a stride s spans
/// [s, s*z)). Returns the references major to minor, or nullopt when the digit
/// does not line up with the axes (no sub-axes express it).
inline std::optional<std::vector<AxisRef>> digit_as_subaxes(const std::vector<std::pair<int, std::int64_t>>& axes,
                                                            std::int64_t lo, std::int64_t hi) {
  std::vector<AxisRef> refs;
  std::int64_t a_lo = 1;
  for (const auto& [axis, size] : axes) {
    const std::int64_t a_hi = a_lo * size;
    const std::int64_t o_lo = std::max(lo, a_lo), o_hi = std::min(hi, a_hi);
    if (o_lo < o_hi) {
      if (o_lo % a_lo != 0 || o_hi % o_lo != 0 || a_hi % o_hi != 0) return std::nullopt;
      refs.push_back(AxisRef{axis, o_lo / a_lo, o_hi / o_lo});
    }
    a_lo = a_hi;
  }
  std::int64_t covered = 1;
  for (const auto& r : refs) covered *= r.size;
  if (covered != hi / lo || hi % lo != 0) return std::nullopt;
  return std::vector<AxisRef>(refs.rbegin(), refs.rend());
}

/// Stage of each layer (decoder layers, then MTP layers on the last stage).
inline std::vector<std::int64_t> stage_of_layers(const std::vector<std::int64_t>& counts, std::int64_t total_layers) {
  std::vector<std::int64_t> stage;
  for (std::size_t s = 0; s < counts.size(); ++s)
    for (std::int64_t i = 0; i < counts[s]; ++i) stage.push_back(static_cast<std::int64_t>(s));
  while (static_cast<std::int64_t>(stage.size()) < total_layers)
    stage.push_back(static_cast<std::int64_t>(counts.size()) - 1);
  return stage;
}

/// The pipeline stage of each layer (MTP layers included) from the layers
/// per stage that `stage_layers()` gives, its errors told at `where`. A tied
/// embedding needs pp = 1: the embedding sits on the first stage and the
/// output layer on the last, and a layout gives a tensor one stage.
template <class StageLayers>
std::vector<std::int64_t> layer_stages(const ModelConfig& c, std::int64_t pp, const std::string& where,
                                       StageLayers&& stage_layers) {
  if (c.tied && pp > 1)
    fail("{}: tie_word_embeddings with pp={} would need the embedding on the first and the last stage; a layout "
         "gives a tensor one stage",
         where, pp);
  std::vector<std::int64_t> counts;
  try {
    counts = stage_layers();
  } catch (const Error& e) {
    fail("{}: {}", where, e.what());
  }
  return stage_of_layers(counts, c.total_layers());
}

/// "CONFIG: train spec 'tp=3': " prefix for preset errors.
inline std::string spec_where(const ModelConfig& c, std::string_view side, const ParallelSpec& s) {
  return fmt::format("{}: {} spec '{}'", c.origin, side, s.text.empty() ? to_string(s) : s.text);
}

}  // namespace detail
}  // namespace reshard::presets
