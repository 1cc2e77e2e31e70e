#pragma once
// The two ways the tools take a layout pair: `--model CONFIG --train SPEC
// --infer SPEC [--colocate] [--group-experts]` (presets) or `--src FILE --dst
// FILE` (CONTRACT.md §1), read the same way by reshard-plan and reshard-refit.
#include <string>
#include <utility>

#include <fmt/format.h>

#include "reshard/json_io.hpp"
#include "reshard/layout/layout.hpp"
#include "reshard/presets/presets.hpp"

namespace tools {

struct LayoutArgs {
  std::string model_path, train_spec, infer_spec;  ///< presets
  std::string src_path, dst_path;                  ///< layout files
  bool colocate = false, group_experts = false;

  struct Loaded {
    reshard::Layout src, dst;
    std::string model;  ///< the model's name, or "SRC -> DST"
  };
  /// The pair from the model's presets when --model was given, else from the
  /// files; throws with what is wrong in either.
  Loaded load() const {
    Loaded l;
    if (!model_path.empty()) {
      reshard::presets::PresetOptions popt;
      popt.colocate = colocate;
      popt.group_experts = group_experts;
      auto m = reshard::presets::model_layouts(model_path, train_spec, infer_spec, popt);
      l.src = std::move(m.train);
      l.dst = std::move(m.infer);
      l.model = m.manifest.config.origin;
    } else {
      l.src = reshard::read_layout_file(src_path);
      l.dst = reshard::read_layout_file(dst_path);
      l.model = fmt::format("{} -> {}", src_path, dst_path);
    }
    return l;
  }
};

}  // namespace tools
