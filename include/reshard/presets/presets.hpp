#pragma once
// Whole-model presets: a HuggingFace config.json and two parallel specs ->
// the training layout (Megatron-Core, megatron.hpp) and the inference layout
// (vLLM, vllm.hpp), both validated, ready for reshard::plan().
//
//   auto m = reshard::presets::model_layouts("deepseek-v3.json",
//                                            "tp=1,pp=4,dp=32,ep=16", "tp=8,dp=16", false);
//   auto schedule = reshard::plan(m.train, m.infer);
//
// The inference ranks start at the training world size (disaggregated), or
// at 0 when colocated (the two sides share ranks 0.. as far as both reach;
// the planner then copies locally what a rank already holds).
#include <cstdint>
#include <string>
#include <vector>

#include "../layout/storage.hpp"
#include "megatron.hpp"
#include "model.hpp"
#include "parallel_spec.hpp"
#include "vllm.hpp"

namespace reshard::presets {

struct PresetOptions {
  bool colocate = false;  ///< inference ranks start at 0 instead of the training world size
  /// Stack each MoE layer's routed experts into 3 global tensors (names
  /// "....experts.{0..E-1}.gate_proj.weight", members by checkpoint_names())
  /// instead of 3*E: the layouts hold the same bytes in the same places, and
  /// planning a 256-expert model gets ~256x fewer tensors to walk.
  bool group_experts = true;
  VllmOptions vllm;
};

struct ModelLayouts {
  Layout train, infer;
  Manifest manifest;                       ///< every checkpoint tensor
  ParallelSpec train_spec, infer_spec;
  std::int64_t train_world = 0, infer_world = 0;
  std::int64_t infer_first_rank = 0;
  std::vector<std::int64_t> train_stage_layers, infer_stage_layers;  ///< decoder layers per pipeline stage
  std::vector<std::string> train_only;     ///< manifest tensors the inference layout leaves out (MTP)
};

/// Builds both layouts from a parsed manifest and specs.
inline ModelLayouts model_layouts(Manifest manifest, const ParallelSpec& train, const ParallelSpec& infer,
                                  const PresetOptions& opt = {}) {
  ModelLayouts out;
  out.train_spec = train;
  out.infer_spec = infer;
  out.train_world = train.tp * train.cp * train.dp * train.pp;
  out.infer_world = infer.tp * infer.dp * infer.pp;
  out.infer_first_rank = opt.colocate ? 0 : out.train_world;
  out.train = megatron_layout(manifest, train, 0);
  out.infer = vllm_layout(manifest, infer, out.infer_first_rank, opt.vllm);
  const auto& c = manifest.config;
  out.train_stage_layers = megatron_stage_layers(c.layers, train.pp, train.pp_first, train.pp_last);
  out.infer_stage_layers = vllm_stage_layers(c.layers, infer.pp);
  for (const auto& t : manifest.tensors)
    if (out.infer.find_tensor(t.name) < 0) out.train_only.push_back(t.name);
  // Every inference tensor must come from the training side with the same
  // shape and dtype (the planner checks it too; say it here in model words).
  for (const auto& t : out.infer.tensors)
    if (t.scale_of < 0 && out.train.find_tensor(t.name) < 0)  // scale tensors: the quantizer writes them
      fail("{}: tensor '{}' is in the inference layout but not in the training layout", c.origin, t.name);
  out.manifest = std::move(manifest);
  return out;
}

/// Bytes of local buffers each mesh position holds (padding slots included:
/// they take memory), in position order.
inline std::vector<std::int64_t> bytes_held(const Layout& L) {
  std::vector<std::int64_t> out(static_cast<std::size_t>(L.mesh.size()), 0);
  const auto& lbs = L.local_buffers();
  for (std::int64_t pos = 0; pos < L.mesh.size(); ++pos)
    for (std::size_t b = 0; b < lbs.size(); ++b)
      out[static_cast<std::size_t>(pos)] +=
          buffer_elements(L, pos, static_cast<int>(b)) * element_bytes(lbs[b].dtype);
  return out;
}

/// Reads `config_path` and parses both specs (CONTRACT.md §3 `--model`).
inline ModelLayouts model_layouts(const std::string& config_path, const std::string& train_spec,
                                  const std::string& infer_spec, const PresetOptions& opt) {
  return model_layouts(model_manifest(config_path, opt.group_experts), parse_parallel_spec(train_spec, "train spec"),
                       parse_parallel_spec(infer_spec, "infer spec"), opt);
}

inline ModelLayouts model_layouts(const std::string& config_path, const std::string& train_spec,
                                  const std::string& infer_spec, bool colocate) {
  PresetOptions opt;
  opt.colocate = colocate;
  return model_layouts(config_path, train_spec, infer_spec, opt);
}

}  // namespace reshard::presets
