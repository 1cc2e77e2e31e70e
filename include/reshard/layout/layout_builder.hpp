#pragma once
// LayoutBuilder: a layout written in code the way a layout file reads
// (CONTRACT.md §1): axes by name, dims as "tp", {"ep", "tp"} or nullptr,
// stages as {"pp", 0}, dtypes as "bf16". It fills a LayoutSpec (axis names
// resolved to indices; a name the mesh lacks is a LayoutError naming the
// tensor, the dim and the mesh's axes) and build() validates it as any
// LayoutSpec. Sub-axes, uneven splits, padding and cyclic cuts: pass a
// DimSpec for that dim (AxisRef{axis, stride} without a size is the rest of
// the axis).
//
//   reshard::Layout train = reshard::LayoutBuilder({{"dp", 2}, {"tp", 2}}, 0, "train")
//       .tensor("w", {1024, 512}, "f32", {"tp", nullptr})
//       .tensor("b", {512}, "f32")                       // replicated
//       .build();
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "../base/dtype.hpp"
#include "../base/error.hpp"
#include "dim_spec.hpp"
#include "layout.hpp"
#include "mesh.hpp"

namespace reshard {

/// One dimspec as a layout file writes it: nullptr or {} (not cut), an axis
/// name ("tp"), axis names major to minor ({"ep", "tp"}), or a DimSpec.
class Dim {
 public:
  Dim() = default;
  Dim(std::nullptr_t) {}
  Dim(const char* axis) : names_{axis} {}
  Dim(std::string axis) : names_{std::move(axis)} {}
  Dim(std::initializer_list<const char*> axes) : names_(axes.begin(), axes.end()) {}
  Dim(DimSpec spec) : spec_(std::move(spec)), explicit_(true) {}

  /// The DimSpec over `mesh`; an unknown axis name is a LayoutError at `where`.
  DimSpec resolve(const Mesh& mesh, const ErrorContext& where) const {
    if (explicit_) return spec_;
    DimSpec d;
    for (const auto& n : names_) {
      const int a = mesh.axis_index(n);
      if (a < 0) {
        std::string axes;
        for (const auto& x : mesh.axes) axes += (axes.empty() ? "" : ", ") + x.name;
        layout_fail(where, "no axis named '{}' in the mesh (its axes: {})", n, axes.empty() ? "none" : axes);
      }
      d.axes.push_back(AxisRef{a, 1, mesh.axes[static_cast<std::size_t>(a)].size});
    }
    return d;
  }

 private:
  std::vector<std::string> names_;
  DimSpec spec_;
  bool explicit_ = false;
};

/// A tensor's stage as a layout file writes it: {"pp", 1}.
struct StageAt {
  std::string axis;
  std::int64_t coord = 0;
};

class LayoutBuilder {
 public:
  /// The mesh: axes major to minor, global rank first_rank + row-major position.
  explicit LayoutBuilder(std::vector<Axis> axes, std::int64_t first_rank = 0, std::string origin = "layout written in code") {
    spec_.mesh.axes = std::move(axes);
    spec_.mesh.first_rank = first_rank;
    spec_.origin = std::move(origin);
  }

  /// Explicit global ranks, one per mesh position (the file's "ranks").
  LayoutBuilder& ranks(std::vector<std::int64_t> global_ranks) {
    spec_.mesh.ranks = std::move(global_ranks);
    return *this;
  }

  /// A "tensors" entry: dims default to none cut; `dtype` is a contract name ("bf16").
  LayoutBuilder& tensor(std::string name, std::vector<std::int64_t> shape, std::string_view dtype, std::vector<Dim> dims = {},
                        std::vector<StageAt> stage = {}) {
    const auto dt = parse_dtype(dtype);
    const ErrorContext at{spec_.origin, name, "dtype"};
    if (!dt) layout_fail(at, "unknown dtype '{}' (expected one of {})", dtype, fmt::join(dtype_names, " "));
    return tensor(std::move(name), std::move(shape), *dt, std::move(dims), std::move(stage));
  }
  LayoutBuilder& tensor(std::string name, std::vector<std::int64_t> shape, DType dtype, std::vector<Dim> dims = {},
                        std::vector<StageAt> stage = {}) {
    TensorSpec t;
    t.name = std::move(name);
    t.shape = std::move(shape);
    t.dtype = dtype;
    for (std::size_t d = 0; d < dims.size(); ++d)
      t.dims.push_back(dims[d].resolve(spec_.mesh, ErrorContext{spec_.origin, t.name, fmt::format("dims[{}]", d)}));
    for (std::size_t s = 0; s < stage.size(); ++s) {
      const int a = Dim(stage[s].axis).resolve(spec_.mesh, ErrorContext{spec_.origin, t.name, fmt::format("stage[{}]", s)}).axes[0].axis;
      t.stage.push_back(StageCoord{a, stage[s].coord});
    }
    spec_.tensors.push_back(std::move(t));
    return *this;
  }

  /// A "buffers" entry of kind concat: the parts' local arrays along `dim`, in `interleave` rounds.
  LayoutBuilder& concat(std::string name, std::vector<std::string> parts, int dim = 0, std::int64_t interleave = 1) {
    spec_.buffers.push_back(concat_buffer(std::move(name), std::move(parts), dim, interleave));
    return *this;
  }

  /// A "buffers" entry of kind flat: the parts flattened in order, the sequence cut as `flat`.
  LayoutBuilder& flat(std::string name, std::vector<std::string> parts, Dim flat) {
    BufferSpec b;
    b.name = std::move(name);
    b.parts = std::move(parts);
    b.kind = BufferKind::flat;
    b.flat = flat.resolve(spec_.mesh, ErrorContext{spec_.origin, "", fmt::format("buffers '{}'.flat", b.name)});
    spec_.buffers.push_back(std::move(b));
    return *this;
  }

  /// What was written, unvalidated (to edit further).
  const LayoutSpec& spec() const { return spec_; }
  /// The validated layout; a LayoutError names the tensor and field at fault.
  Layout build() const { return Layout(spec_); }

 private:
  LayoutSpec spec_;
};

}  // namespace reshard
