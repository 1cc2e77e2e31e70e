#pragma once
// Layout: one side of a refit (the training job or the inference job): a mesh,
// the global tensors, how each is cut over the mesh, and which local buffers
// hold the pieces (CONTRACT.md §1). A LayoutSpec is what a caller writes; a
// Layout is one validated (everything the contract requires, cuts resolved)
// and read-only: the planner only ever sees validated layouts.
#include <array>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include "../base/dtype.hpp"
#include "../base/error.hpp"
#include "dim_spec.hpp"
#include "mesh.hpp"
#include "quantize.hpp"

namespace reshard {

struct StageCoord {
  int axis = 0;
  std::int64_t coord = 0;
};

/// A quantized destination tensor (CONTRACT.md §1 "Quantized destination
/// tensors"): its FP8 values are the tile-wise quantization of the source
/// tensor of that name, with one entry per tile in the scale tensor.
struct QuantSpec {
  QuantScheme scheme = QuantScheme::block;
  std::vector<std::int64_t> block;  ///< tile extents of the trailing dims (mx: {32})
  std::string scale;                ///< name of the scale tensor (same layout)

  // Resolved by validation (Layout's constructor).
  int scale_tensor = -1;
  /// Tile extent along dim d of a tensor of rank n (1 for the leading dims).
  std::int64_t tile(int d, int n) const {
    const int first = n - static_cast<int>(block.size());
    return d < first ? 1 : block[static_cast<std::size_t>(d - first)];
  }
};

struct TensorSpec {
  std::string name;
  std::vector<std::int64_t> shape;
  DType dtype = DType::f32;
  std::vector<DimSpec> dims;       ///< one per dim, or empty = none cut
  std::vector<StageCoord> stage;   ///< lives only where these coordinates match
  std::optional<QuantSpec> quant;  ///< destination only: FP8 with a scale tensor
  /// Rows [rows_start, rows_start + shape[0]) of checkpoint tensor `rows_of`
  /// (a fused checkpoint tensor, e.g. Phi-3's qkv_proj, whose row ranges land
  /// in different places): a name for planning, the same element values.
  std::string rows_of;
  std::int64_t rows_start = 0;

  // Resolved by validation (Layout's constructor).
  std::vector<DimCut> cuts;
  int scale_of = -1;  ///< >= 0: this is the scale tensor of that quantized tensor
  int buffer = -1;  ///< index into Layout::buffers, -1 = stored alone
  int rank() const { return static_cast<int>(shape.size()); }
  std::int64_t elements() const {
    std::int64_t n = 1;
    for (auto e : shape) n *= e;
    return n;
  }
};

enum class BufferKind : std::uint8_t { concat, flat };

/// A named buffer holding several tensors' local pieces (fused projections,
/// flat parameter buckets).
struct BufferSpec {
  std::string name;
  std::vector<std::string> parts;
  BufferKind kind = BufferKind::concat;
  int dim = 0;                  ///< concat dim
  std::int64_t interleave = 1;  ///< concat rounds G
  DimSpec flat;                 ///< flat: how the flattened sequence is cut

  // Resolved by validation (Layout's constructor).
  std::vector<int> part_ids;
};

/// A tensor as a layout file's "tensors" entry gives it, built in code.
inline TensorSpec tensor_spec(std::string name, std::vector<std::int64_t> shape, DType dtype, std::vector<DimSpec> dims = {},
                              std::vector<StageCoord> stage = {}) {
  TensorSpec t;
  t.name = std::move(name);
  t.shape = std::move(shape);
  t.dtype = dtype;
  t.dims = std::move(dims);
  t.stage = std::move(stage);
  return t;
}

/// One dimspec of tensor_spec()'s dims: a DimSpec, or {} (not cut). An axis
/// name or a null written as in a layout file stops the compiler with a
/// sentence saying where names are taken (LayoutBuilder).
struct DimSpecArg {
  DimSpec spec;
  DimSpecArg() = default;
  DimSpecArg(DimSpec s) : spec(std::move(s)) {}
  template <std::size_t N>
  DimSpecArg(const char (&)[N]) {
    static_assert(N == 0,
                  "reshard: tensor_spec() takes each dim as a DimSpec of axis indices (DimSpec{{AxisRef{axis}}}, or {} for a dim "
                  "not cut), not an axis name as a layout file writes it: to write \"tp\", {\"ep\", \"tp\"} or nullptr, build the "
                  "layout with reshard::LayoutBuilder (reshard/layout/layout_builder.hpp)");
  }
  template <class Null>
    requires std::same_as<Null, std::nullptr_t>
  DimSpecArg(Null) {
    static_assert(!std::same_as<Null, std::nullptr_t>,
                  "reshard: tensor_spec() takes a dim not cut as {} (an empty DimSpec), not nullptr; LayoutBuilder "
                  "(reshard/layout/layout_builder.hpp) takes dims as a layout file writes them, nullptr included");
  }
};

/// tensor_spec() with the dims braced in place: {cut, {}, ...}.
inline TensorSpec tensor_spec(std::string name, std::vector<std::int64_t> shape, DType dtype, std::initializer_list<DimSpecArg> dims,
                              std::vector<StageCoord> stage = {}) {
  std::vector<DimSpec> d;
  for (const auto& a : dims) d.push_back(a.spec);
  return tensor_spec(std::move(name), std::move(shape), dtype, std::move(d), std::move(stage));
}

/// A concat buffer: the parts' local arrays along `dim`, in `interleave` rounds.
inline BufferSpec concat_buffer(std::string name, std::vector<std::string> parts, int dim = 0, std::int64_t interleave = 1) {
  BufferSpec b;
  b.name = std::move(name);
  b.parts = std::move(parts);
  b.kind = BufferKind::concat;
  b.dim = dim;
  b.interleave = interleave;
  return b;
}

/// A buffer as it exists on ranks: a BufferSpec, or one tensor stored alone.
struct LocalBuffer {
  std::string name;
  int spec = -1;              ///< index into Layout::buffers, or -1
  std::vector<int> tensors;   ///< tensors in it, in order
  DType dtype = DType::f32;
};

/// What a caller writes to describe one side: the mesh, the tensors, the
/// buffers (CONTRACT.md §1). Writable and unchecked; Layout validates it.
struct LayoutSpec {
  Mesh mesh;
  std::vector<TensorSpec> tensors;
  std::vector<BufferSpec> buffers;
  std::string origin = "layout written in code";  ///< file name, for messages (name it: the default says only where it came from)
};

/// A validated LayoutSpec, read-only from then on: what validation resolved
/// (cuts, buffers, indexes) cannot go stale. Reads are field reads
/// (`L.tensors[t].shape`) through const references; writes do not compile.
/// To change a layout, copy spec(), edit it and validate the copy.
class Layout {
  struct State {
    LayoutSpec spec;
    bool validated = false;
    std::unordered_map<std::string, int> tensor_index, buffer_index;
    std::vector<LocalBuffer> local_buffers;
    std::vector<int> tensor_buffer;
    std::vector<int> tensor_slot;
  };
  State s_;  // declared before the views that refer into it

 public:
  const Mesh& mesh{s_.spec.mesh};
  const std::vector<TensorSpec>& tensors{s_.spec.tensors};
  const std::vector<BufferSpec>& buffers{s_.spec.buffers};
  const std::string& origin{s_.spec.origin};

  /// Empty and not validated (a slot to assign a layout to later).
  Layout() = default;
  /// Validates and resolves; throws LayoutError naming origin, tensor, field.
  explicit Layout(LayoutSpec spec) {
    s_.spec = std::move(spec);
    validate();
  }
  // The views keep referring to this object's own state.
  Layout(const Layout& o) : s_(o.s_) {}
  Layout(Layout&& o) noexcept : s_(std::move(o.s_)) { o.s_.validated = false; }
  Layout& operator=(const Layout& o) {
    if (this != &o) s_ = State(o.s_);  // copy, then move: a failed copy leaves this as it was
    return *this;
  }
  Layout& operator=(Layout&& o) noexcept {
    if (this != &o) {
      s_ = std::move(o.s_);
      o.s_.validated = false;
    }
    return *this;
  }

  /// The description it was validated from (with what validation resolved);
  /// `LayoutSpec s = layout;` copies it to change.
  const LayoutSpec& spec() const { return s_.spec; }
  operator const LayoutSpec&() const { return s_.spec; }  // NOLINT: implicit on purpose, a Layout is a description
  /// False only for a default-constructed or moved-from layout.
  bool validated() const { return s_.validated; }

  int find_tensor(std::string_view name) const {
    auto it = s_.tensor_index.find(std::string(name));
    return it == s_.tensor_index.end() ? -1 : it->second;
  }
  int find_buffer(std::string_view name) const {
    auto it = s_.buffer_index.find(std::string(name));
    return it == s_.buffer_index.end() ? -1 : it->second;
  }
  const std::vector<LocalBuffer>& local_buffers() const { return s_.local_buffers; }
  int buffer_of(int tensor) const { return s_.tensor_buffer[static_cast<std::size_t>(tensor)]; }
  /// Index of tensor t among the parts of its BufferSpec (-1 when stored alone).
  int slot_in_buffer(int tensor) const { return s_.tensor_slot[static_cast<std::size_t>(tensor)]; }

  bool in_stage(std::int64_t pos, int t) const {
    for (const auto& s : tensors[static_cast<std::size_t>(t)].stage)
      if (mesh.coord(pos, s.axis) != s.coord) return false;
    return true;
  }
  DimPart dim_part(std::int64_t pos, int t, int d) const {
    const auto& ts = tensors[static_cast<std::size_t>(t)];
    const auto& spec = ts.dims[static_cast<std::size_t>(d)];
    return ts.cuts[static_cast<std::size_t>(d)].part(spec.part_of(mesh, pos));
  }
  /// Extents of the local array of tensor t on a position (padding included);
  /// all zero when the position holds nothing of it.
  std::vector<std::int64_t> local_extents(std::int64_t pos, int t) const {
    const auto& ts = tensors[static_cast<std::size_t>(t)];
    std::vector<std::int64_t> e(ts.shape.size(), 0);
    if (!in_stage(pos, t)) return e;
    for (int d = 0; d < ts.rank(); ++d) e[static_cast<std::size_t>(d)] = dim_part(pos, t, d).local_extent;
    return e;
  }
  /// Does the position hold a (non-empty) local array of tensor t?
  bool holds(std::int64_t pos, int t) const {
    if (!in_stage(pos, t)) return false;
    const auto& ts = tensors[static_cast<std::size_t>(t)];
    for (int d = 0; d < ts.rank(); ++d)
      if (dim_part(pos, t, d).local_extent == 0) return false;
    return true;
  }

 private:
  inline void validate();
  inline void validate_tensor(std::size_t i, std::vector<std::vector<AxisRef>>& refs);
  inline void validate_buffer(std::size_t b);
  inline void validate_quant(std::size_t i);
  ErrorContext ctx(const std::string& tensor, const std::string& field) const {
    return ErrorContext{origin, tensor, field};
  }
};

namespace detail {
/// Do two axis references share a digit of the same axis?
inline bool refs_overlap(const AxisRef& a, const AxisRef& b) {
  return a.axis == b.axis && sub_axes_overlap(a.stride, a.size, b.stride, b.size);
}
inline bool checked_mul(std::int64_t a, std::int64_t b, std::int64_t& out) {
  return !__builtin_mul_overflow(a, b, &out);
}
}  // namespace detail

/// Checks one axis reference against the mesh; a size of 0 (none given)
/// becomes the rest of the axis, axis size / stride.
inline void validate_axis_ref(const Mesh& mesh, AxisRef& r, const ErrorContext& c) {
  if (r.axis < 0 || r.axis >= static_cast<int>(mesh.axes.size()))
    layout_fail(c, "axis index {} is not an axis of the mesh (it has {})", r.axis, mesh.axes.size());
  const auto& ax = mesh.axes[static_cast<std::size_t>(r.axis)];
  if (r.size == 0 && r.stride >= 1) {
    if (!sub_axis_divides(ax.size, r.stride, 0))
      layout_fail(c, "sub-axis of '{}' without a size: stride {} does not divide the axis size {}", ax.name, r.stride, ax.size);
    r.size = ax.size / r.stride;
  }
  if (r.stride < 1 || r.size < 1)
    layout_fail(c, "sub-axis of '{}' needs stride >= 1 and size >= 1 (got stride {}, size {})", ax.name,
                r.stride, r.size);
  if (!sub_axis_divides(ax.size, r.stride, r.size))
    layout_fail(c, "sub-axis of '{}': stride {} * size {} does not divide the axis size {}", ax.name,
                r.stride, r.size, ax.size);
}

inline void Layout::validate_tensor(std::size_t i, std::vector<std::vector<AxisRef>>& refs) {
  auto& t = s_.spec.tensors[i];
  if (t.name.empty()) layout_fail(ctx("", fmt::format("tensors[{}].name", i)), "tensor name is empty");
  if (!s_.tensor_index.emplace(t.name, static_cast<int>(i)).second)
    layout_fail(ctx(t.name, "name"), "tensor name appears twice");
  if (t.shape.empty() || t.shape.size() > kMaxTensorRank)
    layout_fail(ctx(t.name, "shape"), "shape has {} dims, it must have 1 to {}", t.shape.size(),
                kMaxTensorRank);
  std::int64_t n = 1, padded = 1;
  for (std::size_t d = 0; d < t.shape.size(); ++d) {
    if (t.shape[d] < 1)
      layout_fail(ctx(t.name, fmt::format("shape[{}]", d)), "extent {} must be positive", t.shape[d]);
    if (!detail::checked_mul(n, t.shape[d], n))
      layout_fail(ctx(t.name, "shape"), "the product of the extents overflows 64 bits");
  }
  if (t.dims.empty()) t.dims.resize(t.shape.size());
  if (t.dims.size() != t.shape.size())
    layout_fail(ctx(t.name, "dims"), "has {} dimspecs for a tensor of {} dims", t.dims.size(),
                t.shape.size());
  auto& used = refs[i];
  auto use = [&](AxisRef& r, const std::string& field) {
    validate_axis_ref(mesh, r, ctx(t.name, field));
    for (const auto& u : used)
      if (detail::refs_overlap(u, r))
        layout_fail(ctx(t.name, field), "axis '{}' is referenced more than once",
                    mesh.axes[static_cast<std::size_t>(r.axis)].name);
    used.push_back(r);
  };
  for (std::size_t s = 0; s < t.stage.size(); ++s) {
    const auto field = fmt::format("stage[{}]", s);
    const auto& st = t.stage[s];
    if (st.axis < 0 || st.axis >= static_cast<int>(mesh.axes.size()))
      layout_fail(ctx(t.name, field), "axis index {} is not an axis of the mesh", st.axis);
    const auto& ax = mesh.axes[static_cast<std::size_t>(st.axis)];
    if (st.coord < 0 || st.coord >= ax.size)
      layout_fail(ctx(t.name, field), "coordinate {} is outside axis '{}' of size {}", st.coord, ax.name,
                  ax.size);
    AxisRef whole{st.axis, 1, ax.size};
    use(whole, field);
  }
  t.cuts.clear();
  for (std::size_t d = 0; d < t.dims.size(); ++d) {
    const auto field = fmt::format("dims[{}]", d);
    for (std::size_t a = 0; a < t.dims[d].axes.size(); ++a)
      use(t.dims[d].axes[a], fmt::format("{}.axes[{}]", field, a));
    t.cuts.push_back(resolve_dim(t.dims[d], t.shape[d], ctx(t.name, field)));
    if (!detail::checked_mul(padded, t.cuts.back().padded, padded))
      layout_fail(ctx(t.name, field), "the product of the padded extents overflows 64 bits");
  }
  t.buffer = -1;
}

inline void Layout::validate_buffer(std::size_t b) {
  auto& buf = s_.spec.buffers[b];
  const std::string bname = buf.name;
  auto bctx = [&](const std::string& f) { return ErrorContext{origin, "", fmt::format("buffers[{}] '{}'.{}", b, bname, f)}; };
  if (buf.name.empty()) layout_fail(bctx("name"), "buffer name is empty");
  if (buf.parts.empty()) layout_fail(bctx("parts"), "a buffer needs at least one part");
  buf.part_ids.clear();
  for (std::size_t p = 0; p < buf.parts.size(); ++p) {
    const int t = find_tensor(buf.parts[p]);
    if (t < 0) layout_fail(bctx(fmt::format("parts[{}]", p)), "no tensor named '{}'", buf.parts[p]);
    auto& ts = s_.spec.tensors[static_cast<std::size_t>(t)];
    if (ts.buffer >= 0)
      layout_fail(ctx(ts.name, "buffer"), "tensor is part of two buffers ('{}' and '{}')",
                  buffers[static_cast<std::size_t>(ts.buffer)].name, bname);
    ts.buffer = static_cast<int>(b);
    s_.tensor_slot[static_cast<std::size_t>(t)] = static_cast<int>(buf.part_ids.size());
    buf.part_ids.push_back(t);
  }
  const auto& first = tensors[static_cast<std::size_t>(buf.part_ids[0])];
  for (std::size_t p = 1; p < buf.part_ids.size(); ++p) {
    const auto& ts = tensors[static_cast<std::size_t>(buf.part_ids[p])];
    if (ts.dtype != first.dtype)
      layout_fail(bctx(fmt::format("parts[{}]", p)), "part '{}' is {} but '{}' is {}: a buffer has one dtype",
                  ts.name, to_string(ts.dtype), first.name, to_string(first.dtype));
    // A concat buffer's parts may live on different stages: a rank's buffer is
    // made of the parts it holds, so one pipeline-local name (Megatron's
    // decoder.layers.0 on every stage, local expert i on every EP rank) can
    // hold another tensor on each stage. A flat buffer's sequence is cut over
    // its flat axes as one, so its parts share a stage.
    if (buf.kind == BufferKind::concat) continue;
    bool same_stage = ts.stage.size() == first.stage.size();
    for (std::size_t s = 0; same_stage && s < ts.stage.size(); ++s) {
      bool found = false;
      for (const auto& o : first.stage) found |= o.axis == ts.stage[s].axis && o.coord == ts.stage[s].coord;
      same_stage = found;
    }
    if (!same_stage)
      layout_fail(bctx(fmt::format("parts[{}]", p)), "part '{}' has another stage than '{}'", ts.name,
                  first.name);
  }
  if (buf.kind == BufferKind::concat) {
    if (buf.dim < 0 || buf.dim >= first.rank())
      layout_fail(bctx("dim"), "concat dim {} is outside the {} dims of '{}'", buf.dim, first.rank(), first.name);
    if (buf.interleave < 1) layout_fail(bctx("interleave"), "interleave {} must be >= 1", buf.interleave);
    for (std::size_t p = 1; p < buf.part_ids.size(); ++p) {
      const auto& ts = tensors[static_cast<std::size_t>(buf.part_ids[p])];
      if (ts.rank() != first.rank())
        layout_fail(bctx(fmt::format("parts[{}]", p)), "part '{}' has {} dims but '{}' has {}", ts.name,
                    ts.rank(), first.name, first.rank());
    }
    // Fixed arrays, no allocation: this runs for every position x part.
    const int n = first.rank();
    for (std::int64_t pos = 0; pos < mesh.size(); ++pos) {
      std::array<std::int64_t, kMaxTensorRank> ref{}, e{};
      int ref_t = -1;
      for (int t : buf.part_ids) {
        if (!holds(pos, t)) continue;
        const auto& ts = tensors[static_cast<std::size_t>(t)];
        for (int d = 0; d < n; ++d) e[static_cast<std::size_t>(d)] = dim_part(pos, t, d).local_extent;
        if (e[static_cast<std::size_t>(buf.dim)] % buf.interleave != 0)
          layout_fail(bctx("interleave"),
                      "interleave {} does not divide the local extent {} of '{}' along dim {} on rank {}",
                      buf.interleave, e[static_cast<std::size_t>(buf.dim)], ts.name, buf.dim,
                      mesh.global_rank(pos));
        e[static_cast<std::size_t>(buf.dim)] = 0;
        if (ref_t < 0) {
          ref = e;
          ref_t = t;
        } else if (e != ref) {
          layout_fail(bctx("parts"),
                      "on rank {} the local arrays of '{}' and '{}' differ outside concat dim {}",
                      mesh.global_rank(pos), tensors[static_cast<std::size_t>(ref_t)].name, ts.name, buf.dim);
        }
      }
    }
    return;
  }
  // flat
  for (std::size_t a = 0; a < buf.flat.axes.size(); ++a) {
    const auto field = fmt::format("flat.axes[{}]", a);
    validate_axis_ref(mesh, buf.flat.axes[a], bctx(field));
    for (std::size_t o = 0; o < a; ++o)
      if (detail::refs_overlap(buf.flat.axes[o], buf.flat.axes[a]))
        layout_fail(bctx(field), "axis '{}' is referenced more than once",
                    mesh.axes[static_cast<std::size_t>(buf.flat.axes[a].axis)].name);
    for (int t : buf.part_ids) {
      const auto& ts = tensors[static_cast<std::size_t>(t)];
      std::vector<AxisRef> used;
      for (const auto& d : ts.dims) used.insert(used.end(), d.axes.begin(), d.axes.end());
      for (const auto& s : ts.stage)
        used.push_back(AxisRef{s.axis, 1, mesh.axes[static_cast<std::size_t>(s.axis)].size});
      for (const auto& u : used)
        if (detail::refs_overlap(u, buf.flat.axes[a]))
          layout_fail(ctx(ts.name, "dims"), "flat axis '{}' of buffer '{}' also cuts this part",
                      mesh.axes[static_cast<std::size_t>(u.axis)].name, bname);
    }
  }
  if (buf.flat.split == Split::cyclic)
    layout_fail(bctx("flat.cyclic"), "a flat buffer is a contiguous range: cyclic is not allowed");
  for (std::int64_t pos = 0; pos < mesh.size(); ++pos) {
    std::int64_t L = 0;
    bool any = false;
    for (int t : buf.part_ids) {
      if (!holds(pos, t)) continue;
      any = true;
      std::int64_t sz = 1;
      const auto& ts = tensors[static_cast<std::size_t>(t)];
      for (int d = 0; d < ts.rank(); ++d) sz *= dim_part(pos, t, d).local_extent;
      L += sz;
    }
    if (!any) continue;
    auto c = bctx("flat");
    c.field = fmt::format("buffers[{}] '{}'.flat (rank {}, sequence length {})", b, bname,
                          mesh.global_rank(pos), L);
    resolve_dim(buf.flat, L, c);
  }
}

/// A quantized tensor's pieces are whole tiles, and its scale tensor holds
/// exactly the tiles of them (CONTRACT.md §1): checked on the cuts, per
/// position, without walking indices.
inline void Layout::validate_quant(std::size_t i) {
  auto& t = s_.spec.tensors[i];
  if (!t.quant) return;
  auto& q = *t.quant;
  const int n = t.rank();
  if (t.dtype != DType::fp8e4m3)
    layout_fail(ctx(t.name, "dtype"), "a tensor with quant must be fp8e4m3, not {}", to_string(t.dtype));
  if (q.scheme == QuantScheme::mx) {
    if (q.block.empty()) q.block = {kMxTile};
    if (q.block != std::vector<std::int64_t>{kMxTile})
      layout_fail(ctx(t.name, "quant.block"), "scheme mx tiles the last dim by 32; block must be [32] or absent");
  }
  if (q.block.empty() || static_cast<int>(q.block.size()) > n)
    layout_fail(ctx(t.name, "quant.block"), "block has {} extents for a tensor of {} dims; it needs 1 to {}",
                q.block.size(), n, n);
  for (std::size_t k = 0; k < q.block.size(); ++k)
    if (q.block[k] < 1)
      layout_fail(ctx(t.name, fmt::format("quant.block[{}]", k)), "block extent {} must be >= 1", q.block[k]);
  const int s = find_tensor(q.scale);
  if (s < 0) layout_fail(ctx(t.name, "quant.scale"), "no tensor named '{}' in this layout", q.scale);
  if (s == static_cast<int>(i)) layout_fail(ctx(t.name, "quant.scale"), "a tensor cannot be its own scale");
  auto& st = s_.spec.tensors[static_cast<std::size_t>(s)];
  if (st.quant) layout_fail(ctx(t.name, "quant.scale"), "scale tensor '{}' is itself quantized", st.name);
  if (st.scale_of >= 0)
    layout_fail(ctx(t.name, "quant.scale"), "scale tensor '{}' is also the scale of '{}'", st.name,
                tensors[static_cast<std::size_t>(st.scale_of)].name);
  st.scale_of = static_cast<int>(i);
  q.scale_tensor = s;
  const DType want = scale_dtype(q.scheme);
  if (st.dtype != want)
    layout_fail(ctx(st.name, "dtype"), "scale tensor of '{}' (scheme {}) must be {}, not {}", t.name,
                q.scheme == QuantScheme::block ? "block" : "mx", to_string(want), to_string(st.dtype));
  std::vector<std::int64_t> shape(t.shape);
  for (int d = 0; d < n; ++d) {
    const std::int64_t b = q.tile(d, n);
    shape[static_cast<std::size_t>(d)] = (t.shape[static_cast<std::size_t>(d)] + b - 1) / b;
    if (b > 1 && t.cuts[static_cast<std::size_t>(d)].padded != t.shape[static_cast<std::size_t>(d)])
      layout_fail(ctx(t.name, fmt::format("dims[{}].pad_to", d)), "a tiled dim of a quantized tensor cannot be padded");
  }
  if (st.shape != shape)
    layout_fail(ctx(st.name, "shape"), "scale tensor of '{}' must have shape [{}] (tiles of [{}]), not [{}]", t.name,
                fmt::join(shape, ", "), fmt::join(t.shape, ", "), fmt::join(st.shape, ", "));
  if (st.buffer >= 0)
    layout_fail(ctx(st.name, "buffer"), "the scale tensor of '{}' must be stored alone, not in buffer '{}'", t.name,
                buffers[static_cast<std::size_t>(st.buffer)].name);
  for (std::int64_t pos = 0; pos < mesh.size(); ++pos) {
    const bool held = holds(pos, static_cast<int>(i)), sheld = holds(pos, s);
    if (held != sheld)
      layout_fail(ctx(st.name, "dims"), "rank {} holds {} of '{}' but {} of its scale tensor", mesh.global_rank(pos),
                  held ? "a piece" : "nothing", t.name, sheld ? "a piece" : "nothing");
    if (!held) continue;
    for (int d = 0; d < n; ++d) {
      const DimPart w = dim_part(pos, static_cast<int>(i), d), c = dim_part(pos, s, d);
      const std::int64_t b = q.tile(d, n), ext = t.shape[static_cast<std::size_t>(d)];
      const auto field = fmt::format("dims[{}]", d);
      bool whole = true, alike = true;
      if (w.cyclic) {
        whole = w.B % b == 0;
        alike = c.cyclic && c.k == w.k && c.p == w.p && c.B == w.B / b;
      } else {
        whole = w.lo % b == 0 && (w.hi % b == 0 || w.hi == ext);
        alike = !c.cyclic && c.lo == w.lo / b && c.hi == (w.hi + b - 1) / b;
      }
      if (!whole)
        layout_fail(ctx(t.name, field),
                    "rank {} holds a piece that cuts tiles of {} along dim {} (a quantized tensor's pieces must be "
                    "whole tiles)",
                    mesh.global_rank(pos), b, d);
      if (!alike)
        layout_fail(ctx(st.name, field),
                    "rank {} holds other tiles of scale tensor '{}' along dim {} than its piece of '{}' has (the scale "
                    "must be cut like the weight, at tile granularity)",
                    mesh.global_rank(pos), st.name, d, t.name);
    }
  }
}

// Runs once, from the constructor, on a fresh State (the spec's own resolved
// fields may be a copied layout's: each step below resets what it resolves).
inline void Layout::validate() {
  s_.spec.mesh.validate(ErrorContext{origin, "", ""});
  std::vector<std::vector<AxisRef>> refs(tensors.size());
  for (std::size_t i = 0; i < tensors.size(); ++i) validate_tensor(i, refs);
  s_.tensor_slot.assign(tensors.size(), -1);
  for (std::size_t b = 0; b < buffers.size(); ++b) validate_buffer(b);
  for (auto& t : s_.spec.tensors) t.scale_of = -1;
  for (std::size_t i = 0; i < tensors.size(); ++i) validate_quant(i);
  s_.tensor_buffer.assign(tensors.size(), -1);
  auto add = [&](LocalBuffer lb, const ErrorContext& c) {
    if (!s_.buffer_index.emplace(lb.name, static_cast<int>(s_.local_buffers.size())).second)
      layout_fail(c, "buffer name '{}' is used twice", lb.name);
    for (int t : lb.tensors) s_.tensor_buffer[static_cast<std::size_t>(t)] = static_cast<int>(s_.local_buffers.size());
    s_.local_buffers.push_back(std::move(lb));
  };
  for (std::size_t b = 0; b < buffers.size(); ++b) {
    const auto& bs = buffers[b];
    add(LocalBuffer{bs.name, static_cast<int>(b), bs.part_ids,
                    tensors[static_cast<std::size_t>(bs.part_ids[0])].dtype},
        ErrorContext{origin, "", fmt::format("buffers[{}].name", b)});
  }
  for (std::size_t t = 0; t < tensors.size(); ++t)
    if (tensors[t].buffer < 0)
      add(LocalBuffer{tensors[t].name, -1, {static_cast<int>(t)}, tensors[t].dtype},
          ErrorContext{origin, tensors[t].name, "name"});
  s_.validated = true;
}

/// Anything that is, converts to, or lowers (`.lower()` / `.to_runtime()`)
/// to a runtime reshard::Layout, or a LayoutSpec to validate.
template <class L>
concept LayoutDescription = std::same_as<std::remove_cvref_t<L>, Layout> || std::same_as<std::remove_cvref_t<L>, LayoutSpec> ||
                            std::convertible_to<const L&, Layout> || requires(const L& l) {
                              { l.lower() } -> std::convertible_to<Layout>;
                            } || requires(const L& l) {
                              { l.to_runtime() } -> std::convertible_to<Layout>;
                            };

template <class L>
Layout lower_layout(const L& l) {
  static_assert(LayoutDescription<L>,
                "reshard: a layout argument must be reshard::Layout or LayoutSpec, convert to a Layout, or have "
                ".lower() / .to_runtime() returning one");
  Layout out;
  if constexpr (std::same_as<std::remove_cvref_t<L>, LayoutSpec>)
    out = Layout(l);
  else if constexpr (std::same_as<std::remove_cvref_t<L>, Layout> || std::convertible_to<const L&, Layout>)
    out = l;
  else if constexpr (requires { l.lower(); })
    out = l.lower();
  else
    out = l.to_runtime();
  if (!out.validated()) out = Layout(out.spec());  // an empty layout: the error names what is missing
  return out;
}

}  // namespace reshard
