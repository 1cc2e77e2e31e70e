#pragma once
// FP8 inference layouts (docs/fp8.md): the linear weights vLLM serves in FP8
// become quantized tensors with a scale tensor beside them, named as FP8
// checkpoints name them (`<...>.weight` + `<...>.weight_scale_inv` for block
// FP8, `<...>.weight_scale` (E8M0) for MXFP8). vLLM's Fp8LinearMethod covers
// every LinearBase layer: attention projections (q/k/v/o, MLA's q_a/q_b/
// kv_a/kv_b), dense and shared-expert MLPs, and FusedMoE experts. The
// embedding, lm_head, norms and the router (ReplicatedLinear `gate`, its
// bias) stay BF16, as in the DeepSeek-V3 FP8 checkpoint.
#include <string>
#include <vector>

#include "../layout/layout.hpp"
#include "model.hpp"

namespace reshard::presets {

inline bool fp8_role(Role r) {
  switch (r) {
    case Role::q: case Role::k: case Role::v: case Role::o:
    case Role::q_a: case Role::q_b: case Role::kv_a: case Role::kv_b:
    case Role::gate: case Role::up: case Role::down:
    case Role::expert_gate: case Role::expert_up: case Role::expert_down:
    case Role::shared_gate: case Role::shared_up: case Role::shared_down:
      return true;
    default:
      return false;
  }
}

/// A validated layout built from `m` with its FP8 roles' tensors quantized
/// (scheme and tile `block`) and their scale tensors added (cut like the
/// weight at tile granularity, stored alone), validated.
inline Layout quantize_linear_weights(const Layout& served, const Manifest& m, QuantScheme scheme,
                                      const std::vector<std::int64_t>& block, const std::string& scale_suffix) {
  LayoutSpec L = served.spec();  // its cuts are resolved: they give the scales' part sizes
  std::vector<TensorSpec> scales;
  for (const auto& info : m.tensors) {
    if (!fp8_role(info.role)) continue;
    const int t = served.find_tensor(info.name);
    if (t < 0) continue;  // not served (MTP)
    auto& ts = L.tensors[static_cast<std::size_t>(t)];
    const std::string suffix = ".weight";
    if (ts.name.size() < suffix.size() || ts.name.compare(ts.name.size() - suffix.size(), suffix.size(), suffix) != 0)
      fail("tensor '{}': an FP8 weight's name must end in .weight", ts.name);
    QuantSpec q;
    q.scheme = scheme;
    q.block = block;
    q.scale = ts.name.substr(0, ts.name.size() - suffix.size()) + "." + scale_suffix;
    TensorSpec sc;
    sc.name = q.scale;
    sc.dtype = scale_dtype(scheme);
    sc.stage = ts.stage;
    sc.shape = ts.shape;
    sc.dims = ts.dims;
    const int n = ts.rank();
    for (int d = 0; d < n; ++d) {
      const std::int64_t b = q.tile(d, n);
      if (b == 1) continue;
      const auto ud = static_cast<std::size_t>(d);
      sc.shape[ud] = (ts.shape[ud] + b - 1) / b;
      DimSpec& ds = sc.dims[ud];
      ds.pad_to = 0;
      if (!ds.is_cut()) continue;
      if (ds.split == Split::cyclic) {
        ds.block = std::max<std::int64_t>(1, ds.block / b);
        continue;
      }
      // Contiguous parts: each part's tiles (whole tiles are checked on the weight).
      const DimCut& cut = ts.cuts[ud];
      ds.split = Split::sizes;
      ds.sizes.clear();
      for (std::int64_t p = 0; p < cut.k; ++p) {
        const std::int64_t lo = std::min(cut.cuts[static_cast<std::size_t>(p)], ts.shape[ud]);
        const std::int64_t hi = std::min(cut.cuts[static_cast<std::size_t>(p) + 1], ts.shape[ud]);
        ds.sizes.push_back((hi + b - 1) / b - (lo + b - 1) / b);
      }
    }
    ts.dtype = DType::fp8e4m3;
    ts.quant = std::move(q);
    scales.push_back(std::move(sc));
  }
  for (auto& s : scales) L.tensors.push_back(std::move(s));
  return Layout(std::move(L));
}

}  // namespace reshard::presets
