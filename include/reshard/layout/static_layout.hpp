#pragma once
// Compile-time layouts: the structure of a layout (axis names, which dim each
// axis cuts, how, static sizes) as types, with the sizes that are only known
// at runtime (a config's dp, a tensor's hidden size) given as values. Static
// and dynamic sizes run through the same code, as CuTe's Int<4> and int do,
// and as std::mdspan's static and dynamic extents do. Everything lowers to the
// runtime descriptors of layout.hpp, exactly as the JSON reader builds them,
// and validating the Layout then checks what only runtime values can show.
//
// Misuse that types can show is one static_assert whose message is a
// sentence; the "In instantiation of ... diagnostic::<what>() [with ...]" line
// above it names the axis, dim or extent at fault.
//
//   namespace st = reshard::st;
//   using Mesh = st::MeshOf<st::Axis<"pp", 2>, st::Axis<"dp">, st::Axis<"tp", 4>>;
//   st::LayoutOf<Mesh> L{Mesh{dp}};                       // dp: runtime size
//   auto q = L.add(st::Tensor<st::ColumnParallel<"tp">>("q", {4096, 4096}, DType::bf16).stage<"pp">(0));
//   reshard::Layout layout = L.lower();                   // validated
#include <array>
#include <numeric>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "../base/dtype.hpp"
#include "../base/error.hpp"
#include "dim_spec.hpp"
#include "layout.hpp"
#include "mesh.hpp"

namespace reshard::st {

/// A size given at runtime (std::dynamic_extent's role).
inline constexpr std::int64_t dynamic = -1;

/// A size known at compile time; converts to std::int64_t wherever a runtime
/// size goes.
template <std::int64_t N>
using Int = std::integral_constant<std::int64_t, N>;

/// A mesh axis name as a template argument: Axis<"tp", 4>, .stage<"pp">(0).
/// Fixed capacity so that every name has one type and prints as axis_name{"tp"}.
struct axis_name {
  static constexpr std::size_t capacity = 48;
  char text[capacity]{};

  constexpr axis_name() = default;
  template <std::size_t N>
  constexpr axis_name(const char (&s)[N]) {  // NOLINT: implicit from a literal on purpose
    static_assert(N <= capacity, "a mesh axis name has at most 47 characters");
    for (std::size_t i = 0; i + 1 < N; ++i) text[i] = s[i];
  }
  constexpr std::size_t length() const {
    std::size_t n = 0;
    while (n < capacity && text[n] != '\0') ++n;
    return n;
  }
  constexpr std::string_view view() const { return {text, length()}; }
  constexpr bool empty() const { return text[0] == '\0'; }
  friend constexpr bool operator==(const axis_name&, const axis_name&) = default;
};

/// A reference to a mesh axis inside Shard<...>: a whole axis ("tp"), or the
/// sub-axis digit (c / stride) % size of it (sub_axis("tp", 2, 2)).
struct axis_ref {
  axis_name axis;
  std::int64_t stride = 1;
  std::int64_t size = dynamic;  ///< dynamic: axis size / stride

  constexpr axis_ref() = default;
  template <std::size_t N>
  constexpr axis_ref(const char (&s)[N]) : axis(s) {}  // NOLINT: implicit from a literal on purpose
  constexpr axis_ref(axis_name a, std::int64_t stride_, std::int64_t size_)
      : axis(a), stride(stride_), size(size_) {}
  friend constexpr bool operator==(const axis_ref&, const axis_ref&) = default;
};

/// Sub-axis of a mesh axis: the digit (c / stride) % size of the rank's
/// coordinate c on it; size defaults to axis size / stride.
consteval axis_ref sub_axis(axis_name axis, std::int64_t stride, std::int64_t size = dynamic) {
  return axis_ref{axis, stride, size};
}

namespace detail {
template <class... T>
struct type_list {};

// What kind of static-layout type a type is: each names its kind (`using static_layout_kind =
// kinds::cut;`), so that one test classifies them all; any other type is of no kind.
namespace kinds {
struct axis;
struct mesh;
struct cut;  // Replicate, Shard<...>
struct dim;  // Dim<...>
struct shard_spec;
struct shape;
struct tensor;
}  // namespace kinds
template <class T, class Kind>
struct is_kind : std::false_type {};
template <class T, class Kind>
  requires std::is_same_v<typename T::static_layout_kind, Kind>
struct is_kind<T, Kind> : std::true_type {};
template <class T> using is_axis = is_kind<T, kinds::axis>;
template <class T> using is_mesh = is_kind<T, kinds::mesh>;
template <class T> using is_cut = is_kind<T, kinds::cut>;
/// A spec of one dim: a cut alone, or Dim<cut, options...>.
template <class T>
struct is_dim_spec : std::bool_constant<is_cut<T>::value || is_kind<T, kinds::dim>::value> {};
template <class T> using is_shard_spec = is_kind<T, kinds::shard_spec>;
template <class T> using is_shape = is_kind<T, kinds::shape>;
template <class T> using is_tensor = is_kind<T, kinds::tensor>;
}  // namespace detail

// One function per misuse: its name and template arguments say where, the
// message says what. Only the branch that found the fault instantiates it.
namespace diagnostic {
// Dependent false: the assertion fires only when the function is instantiated.
template <auto...>
inline constexpr bool never = false;
template <class...>
inline constexpr bool never_type = false;
template <std::int64_t size> constexpr void mesh_axis_needs_a_name() { static_assert(never<size>, "a mesh axis needs a non-empty name"); }
template <axis_name axis, std::int64_t size> constexpr void mesh_axis_size_must_be_positive() { static_assert(never<axis, size>, "a mesh axis has size >= 1, or reshard::st::dynamic when its size is given at runtime"); }
template <class... T> constexpr void mesh_needs_an_axis() { static_assert(never_type<T...>, "a mesh needs at least one axis"); }
template <class... T> constexpr void mesh_takes_axes_only() { static_assert(never_type<T...>, "MeshOf<...> takes mesh axes only: Axis<\"name\", size> or Axis<\"name\", dynamic>"); }
template <axis_name axis> constexpr void mesh_axis_named_twice() { static_assert(never<axis>, "two axes of one mesh have the same name"); }
template <int dynamic_axes, int sizes_given> constexpr void mesh_needs_one_size_per_dynamic_axis() { static_assert(never<dynamic_axes, sizes_given>, "give the mesh one runtime size per dynamic axis, in mesh order"); }
template <axis_name axis> constexpr void mesh_has_no_axis_named() { static_assert(never<axis>, "the mesh has no axis of this name"); }
template <class... T> constexpr void shard_needs_an_axis() { static_assert(never_type<T...>, "Shard<...> needs at least one mesh axis; write Replicate for a dim that is not cut"); }
template <axis_ref ref> constexpr void axis_reference_needs_a_name() { static_assert(never<ref>, "a Shard<...> axis needs a non-empty name"); }
template <axis_ref ref> constexpr void sub_axis_needs_positive_stride_and_size() { static_assert(never<ref>, "a sub-axis needs stride >= 1 and size >= 1"); }
template <axis_name axis> constexpr void shard_names_an_axis_twice() { static_assert(never<axis>, "a Shard<...> names one mesh axis twice (or two overlapping sub-axes of it)"); }
template <class... T> constexpr void dim_takes_at_most_one_cut() { static_assert(never_type<T...>, "Dim<...> takes at most one cut: Replicate or Shard<axes...>"); }
template <class... T> constexpr void dim_takes_cut_split_rule_and_padding() { static_assert(never_type<T...>, "Dim<...> takes a cut (Replicate or Shard<axes...>), one split rule (Even, Chunk, Balanced, Sizes<...> or Cyclic<B>) and one padding (Padded<P>, RoundUp<M> or RoundUpPerPart<M>); this argument is none of them"); }
template <class... T> constexpr void dim_takes_one_split_rule() { static_assert(never_type<T...>, "a dim takes one split rule: Even, Chunk, Balanced, Sizes<...> or Cyclic<B>"); }
template <class... T> constexpr void dim_takes_one_padding() { static_assert(never_type<T...>, "a dim takes at most one padding: Padded<P>, RoundUp<M> or RoundUpPerPart<M>"); }
template <class... T> constexpr void split_rule_needs_a_shard() { static_assert(never_type<T...>, "a split rule only applies to a dim cut by Shard<axes...>; a Replicate dim is not split"); }
template <std::int64_t block> constexpr void cyclic_block_must_be_positive() { static_assert(never<block>, "Cyclic<B> needs a block size B >= 1"); }
template <std::int64_t extent> constexpr void padded_extent_must_be_positive() { static_assert(never<extent>, "Padded<P> needs P >= 1 and RoundUp<M> needs M >= 1"); }
template <class... T> constexpr void sizes_must_be_non_negative() { static_assert(never_type<T...>, "Sizes<...> lists at least one part size, all >= 0"); }
template <int dim> constexpr void shard_spec_takes_dim_specs() { static_assert(never<dim>, "ShardSpec<...> takes one dim spec per tensor dim: Replicate, Shard<axes...> or Dim<...>"); }
template <int rank> constexpr void tensor_has_1_to_8_dims() { static_assert(never<rank>, "a tensor has 1 to 8 dims"); }
template <class... T> constexpr void shard_dims_takes_on_entries() { static_assert(never_type<T...>, "ShardDims<...> takes On<dim, spec> entries whose spec is Replicate, Shard<axes...> or Dim<...>"); }
template <int dim> constexpr void dim_index_must_be_non_negative() { static_assert(never<dim>, "a dim index is >= 0"); }
template <int dim> constexpr void dim_cut_twice() { static_assert(never<dim>, "two On<dim, ...> entries name the same dim"); }
template <axis_name axis, int first_dim, int second_dim> constexpr void axis_cuts_two_dims() { static_assert(never<axis, first_dim, second_dim>, "this mesh axis cuts two dims of one tensor; each mesh axis may cut at most one dim"); }
template <class... T> constexpr void tensor_takes_a_shard_spec() { static_assert(never_type<T...>, "Tensor<Spec, ...> takes a shard spec: Replicated, ShardSpec<...>, ShardDims<...>, ShardOn<dim, ...>, ColumnParallel<axes...> or RowParallel<axes...>"); }
template <class... T> constexpr void tensor_takes_a_shape() { static_assert(never_type<T...>, "Tensor<Spec, Shape> takes Shape<extents...> or AnyShape"); }
template <int dim, std::int64_t extent> constexpr void shape_extent_must_be_positive() { static_assert(never<dim, extent>, "a static extent is >= 1, or reshard::st::dynamic"); }
template <int spec_dims, int shape_dims> constexpr void shard_spec_and_shape_differ_in_rank() { static_assert(never<spec_dims, shape_dims>, "the shard spec and the shape have different numbers of dims"); }
template <int dim, int rank> constexpr void shard_spec_cuts_a_dim_beyond_the_rank() { static_assert(never<dim, rank>, "the shard spec cuts a dim beyond the tensor's rank"); }
template <axis_name axis> constexpr void stage_axis_named_twice() { static_assert(never<axis>, "a tensor names one stage axis twice"); }
template <axis_name axis> constexpr void stage_axis_also_cuts_a_dim() { static_assert(never<axis>, "a tensor's stage axis may not also cut one of its dims"); }
template <axis_name axis> constexpr void unknown_axis() { static_assert(never<axis>, "the shard spec names an axis that is not in the mesh"); }
template <axis_name axis> constexpr void unknown_stage_axis() { static_assert(never<axis>, "the stage names an axis that is not in the mesh"); }
template <axis_ref ref, std::int64_t axis_size> constexpr void sub_axis_does_not_divide_its_axis() { static_assert(never<ref, axis_size>, "a sub-axis's stride * size must divide its axis size"); }
template <int dim, std::int64_t extent, std::int64_t parts> constexpr void even_split_does_not_divide() { static_assert(never<dim, extent, parts>, "an even split must divide the dim's extent; use Chunk or Balanced for uneven dims, or pad it"); }
template <int dim, std::int64_t padded, std::int64_t extent> constexpr void padded_extent_below_the_extent() { static_assert(never<dim, padded, extent>, "Padded<P> must be at least the dim's extent"); }
template <int dim, std::int64_t sizes, std::int64_t parts> constexpr void sizes_count_differs_from_parts() { static_assert(never<dim, sizes, parts>, "Sizes<...> lists one size per part (the product of the dim's axis sizes)"); }
template <int dim, std::int64_t sum, std::int64_t extent> constexpr void sizes_sum_differs_from_extent() { static_assert(never<dim, sum, extent>, "Sizes<...> must sum to the dim's extent (its padded extent when padded)"); }
template <class... T> constexpr void layout_takes_a_mesh() { static_assert(never_type<T...>, "LayoutOf<Mesh> takes a MeshOf<Axis<...>...> type"); }
template <class... T> constexpr void add_takes_a_tensor() { static_assert(never_type<T...>, "LayoutOf::add takes a Tensor<Spec, ...>"); }
template <class E> constexpr void add_takes_an_element_type() { static_assert(never_type<E>, "LayoutOf::add<E> takes the tensor's element type: float, double, std::int64_t, std::int32_t, std::uint32_t, std::int8_t, std::uint8_t, reshard::bf16_t, f16_t, fp8e4m3_t or fp8e5m2_t"); }
template <class... T> constexpr void buffer_parts_are_tensor_handles() { static_assert(never_type<T...>, "a buffer's parts are the handles LayoutOf::add returned, at least one"); }
template <int dim, int rank> constexpr void concat_dim_beyond_the_rank_of_a_part() { static_assert(never<dim, rank>, "the concat dim is beyond the rank of a part"); }
template <class... T> constexpr void buffer_parts_differ_in_stage_axes() { static_assert(never_type<T...>, "all parts of a buffer must live on the same stage axes"); }
template <class... T> constexpr void flat_takes_a_dim_spec() { static_assert(never_type<T...>, "flat<Cut> takes a dim spec: Shard<axes...> or Dim<Shard<axes...>, ...>"); }
template <class... T> constexpr void flat_buffer_cannot_be_cyclic() { static_assert(never_type<T...>, "a flat buffer holds a contiguous range: Cyclic is not allowed"); }
template <class... T> constexpr void flat_buffer_cannot_round_up() { static_assert(never_type<T...>, "a flat buffer's length differs between ranks: pad it with Padded<P>, not RoundUp<M> or RoundUpPerPart<M>"); }
template <axis_name axis> constexpr void flat_axis_also_cuts_a_part() { static_assert(never<axis>, "a flat buffer's axes may not cut or stage its parts"); }
}  // namespace diagnostic

// ---------------------------------------------------------------- mesh axes

/// A mesh axis: Axis<"tp", 4> (static size) or Axis<"dp"> / Axis<"dp", dynamic>
/// (size given to the mesh at runtime).
template <axis_name Name, std::int64_t Size = dynamic>
struct Axis {
  using static_layout_kind = detail::kinds::axis;
  static constexpr axis_name name = Name;
  static constexpr std::int64_t size = Size;
  static constexpr bool is_static = Size != dynamic;

 private:
  static constexpr bool check() {
    if constexpr (Name.empty()) {
      diagnostic::mesh_axis_needs_a_name<Size>();
      return false;
    } else if constexpr (Size != dynamic && Size < 1) {
      diagnostic::mesh_axis_size_must_be_positive<Name, Size>();
      return false;
    }
    return true;
  }

 public:
  static constexpr bool valid = check();
  static_assert(valid || !valid);  // runs check() with the class
};

namespace detail {
template <std::size_t N>
constexpr int find_name(const std::array<axis_name, N>& names, const axis_name& n) {
  for (std::size_t i = 0; i < N; ++i)
    if (names[i] == n) return static_cast<int>(i);
  return -1;
}
/// Index of the first element equal to an earlier one, -1 if none.
template <class T, std::size_t N>
constexpr int first_repeated(const std::array<T, N>& v) {
  for (std::size_t i = 0; i < N; ++i)
    for (std::size_t j = 0; j < i; ++j)
      if (v[i] == v[j]) return static_cast<int>(i);
  return -1;
}
}  // namespace detail

/// A device mesh whose axis names (and some sizes) are types:
/// MeshOf<Axis<"pp", 2>, Axis<"dp">, Axis<"tp", 4>>. Row-major like Mesh: the
/// first axis varies slowest. Runtime sizes are given in mesh order, one per
/// dynamic axis, as std::extents takes its dynamic extents.
template <class... A>
class MeshOf {
 public:
  using static_layout_kind = detail::kinds::mesh;

 private:
  static constexpr bool check() {
    if constexpr (sizeof...(A) == 0) {
      diagnostic::mesh_needs_an_axis<MeshOf>();
      return false;
    } else if constexpr (!(detail::is_axis<A>::value && ...)) {
      diagnostic::mesh_takes_axes_only<A...>();
      return false;
    } else if constexpr (!(A::valid && ...)) {
      return false;  // the axis said why
    } else if constexpr (constexpr int i =
                             detail::first_repeated(std::array<axis_name, sizeof...(A)>{A::name...});
                         i >= 0) {
      diagnostic::mesh_axis_named_twice<std::array<axis_name, sizeof...(A)>{
          A::name...}[static_cast<std::size_t>(i)]>();
      return false;
    }
    return true;
  }
  template <class X>
  static constexpr axis_name name_of() {
    if constexpr (detail::is_axis<X>::value)
      return X::name;
    else
      return axis_name{};
  }
  template <class X>
  static constexpr std::int64_t size_of() {
    if constexpr (detail::is_axis<X>::value)
      return X::size;
    else
      return 1;
  }

 public:
  static constexpr bool valid = check();
  static_assert(valid || !valid);

  static constexpr int axis_count = static_cast<int>(sizeof...(A));
  static constexpr std::array<axis_name, sizeof...(A)> names{name_of<A>()...};
  /// Static size of each axis, dynamic where given at runtime.
  static constexpr std::array<std::int64_t, sizeof...(A)> static_sizes{size_of<A>()...};
  static constexpr int dynamic_count = ((size_of<A>() == dynamic ? 1 : 0) + ... + 0);
  /// Index of the axis with this name, -1 if none.
  template <axis_name Name>
  static constexpr int index_of = detail::find_name(names, Name);
  template <axis_name Name>
  static constexpr bool has = index_of<Name> >= 0;

  std::int64_t first_rank = 0;
  std::vector<std::int64_t> ranks;  ///< explicit global ranks; empty = first_rank + position

  MeshOf() {
    if constexpr (dynamic_count != 0) diagnostic::mesh_needs_one_size_per_dynamic_axis<dynamic_count, 0>();
    fill({});
  }
  template <class... S>
  requires(sizeof...(S) >= 1 && (std::is_integral_v<S> && ...)) explicit MeshOf(S... dynamic_sizes) {
    if constexpr (sizeof...(S) != static_cast<std::size_t>(dynamic_count)) {
      diagnostic::mesh_needs_one_size_per_dynamic_axis<dynamic_count, static_cast<int>(sizeof...(S))>();
    } else {
      fill({static_cast<std::int64_t>(dynamic_sizes)...});
    }
  }

  /// Size of a named axis: Int<N> when static, std::int64_t when dynamic.
  template <axis_name Name>
  auto size() const {
    constexpr int i = index_of<Name>;
    if constexpr (i < 0) {
      diagnostic::mesh_has_no_axis_named<Name>();
      return std::int64_t{0};
    } else if constexpr (static_sizes[static_cast<std::size_t>(i)] != dynamic) {
      return Int<static_sizes[static_cast<std::size_t>(i)]>{};
    } else {
      return sizes_[static_cast<std::size_t>(i)];
    }
  }
  /// Size of axis i (runtime index).
  std::int64_t size(int i) const { return sizes_[static_cast<std::size_t>(i)]; }
  /// Number of positions: Int<N> when every axis is static.
  auto size() const {
    if constexpr (dynamic_count == 0) {
      constexpr std::int64_t n = [] {
        std::int64_t p = 1;
        for (auto s : static_sizes) p *= s;
        return p;
      }();
      return Int<n>{};
    } else {
      std::int64_t p = 1;
      for (auto s : sizes_) p *= s;
      return p;
    }
  }

  /// The runtime mesh (not yet validated: building the Layout does that).
  Mesh lower() const {
    Mesh m;
    for (std::size_t i = 0; i < sizeof...(A); ++i)
      m.axes.push_back(reshard::Axis{std::string(names[i].view()), sizes_[i]});
    m.first_rank = first_rank;
    m.ranks = ranks;
    return m;
  }

 private:
  void fill(std::array<std::int64_t, static_cast<std::size_t>(dynamic_count)> dyn) {
    std::size_t d = 0;
    for (std::size_t i = 0; i < sizeof...(A); ++i)
      sizes_[i] = static_sizes[i] != dynamic ? static_sizes[i] : dyn[d++];
  }
  std::array<std::int64_t, sizeof...(A)> sizes_{};
};

// ------------------------------------------------------------ one dim's cut

/// A dim that is not cut (every rank holds all of it).
struct Replicate;

/// A dim cut over mesh axes, major to minor: Shard<"tp">, Shard<"ep", "tp">,
/// Shard<sub_axis("tp", 2)>. Even split unless Dim<...> says otherwise.
template <axis_ref... A>
struct Shard;

// Split rules and paddings: the options of Dim<cut, options...>.
struct Even {};
/// torch.chunk: parts of ceil(n/k), the last ones possibly short or empty.
struct Chunk {};
/// numpy.array_split: the first n % k parts get one more.
struct Balanced {};
/// Block-cyclic: global index i belongs to part (i / B) % k.
template <std::int64_t B>
struct Cyclic {};
/// Explicit part sizes, one per part, summing to the (padded) extent.
template <std::int64_t... S>
struct Sizes {};
/// Cut from [0, P): indices >= the extent are padding.
template <std::int64_t P>
struct Padded {};
/// Pad the extent up to a multiple of M (vLLM's vocabulary: M = 64).
template <std::int64_t M>
struct RoundUp {};
/// Pad the extent up to a multiple of M * parts (Megatron's vocabulary: M = 128).
template <std::int64_t M>
struct RoundUpPerPart {};

/// A dim spec with options: Dim<Shard<"tp">, Chunk>, Dim<Shard<"tp">, Padded<152064>>,
/// Dim<Shard<"ep">, Cyclic<1>>. Arguments in any order; the cut defaults to Replicate.
template <class... Args>
struct Dim;

enum class PadKind : std::uint8_t { none, absolute, multiple, multiple_per_part };

namespace detail {
/// An option's amount (Cyclic's block, a padding's extent or multiple) is >= 1.
template <std::int64_t amount, Split of = Split::even>
constexpr bool check_amount() {
  if constexpr (amount < 1) {
    if constexpr (of == Split::cyclic)
      diagnostic::cyclic_block_must_be_positive<amount>();
    else
      diagnostic::padded_extent_must_be_positive<amount>();
    return false;
  }
  return true;
}

template <class T>
struct split_rule : std::false_type {};
template <>
struct split_rule<Even> : std::true_type {
  static constexpr Split split = Split::even;
  static constexpr std::int64_t block = 0;
  static constexpr std::array<std::int64_t, 0> sizes{};
  static constexpr bool valid = true;
};
template <>
struct split_rule<Chunk> : split_rule<Even> {
  static constexpr Split split = Split::chunk;
};
template <>
struct split_rule<Balanced> : split_rule<Even> {
  static constexpr Split split = Split::balanced;
};
template <std::int64_t B>
struct split_rule<Cyclic<B>> : std::true_type {
  static constexpr Split split = Split::cyclic;
  static constexpr std::int64_t block = B;
  static constexpr std::array<std::int64_t, 0> sizes{};
  static constexpr bool valid = check_amount<B, Split::cyclic>();
};
template <std::int64_t... S>
struct split_rule<Sizes<S...>> : std::true_type {
  static constexpr Split split = Split::sizes;
  static constexpr std::int64_t block = 0;
  static constexpr std::array<std::int64_t, sizeof...(S)> sizes{S...};
  static constexpr bool check() {
    if constexpr (sizeof...(S) == 0 || !((S >= 0) && ...)) {
      diagnostic::sizes_must_be_non_negative<Sizes<S...>>();
      return false;
    }
    return true;
  }
  static constexpr bool valid = check();
};

template <class T>
struct padding : std::false_type {};
template <>
struct padding<void> : std::false_type {  // no padding
  static constexpr PadKind kind = PadKind::none;
  static constexpr std::int64_t amount = 0;
  static constexpr bool valid = true;
};
template <PadKind K, std::int64_t V>
struct padding_of : std::true_type {
  static constexpr PadKind kind = K;
  static constexpr std::int64_t amount = V;
  static constexpr bool valid = check_amount<V>();
};
template <std::int64_t P>
struct padding<Padded<P>> : padding_of<PadKind::absolute, P> {};
template <std::int64_t M>
struct padding<RoundUp<M>> : padding_of<PadKind::multiple, M> {};
template <std::int64_t M>
struct padding<RoundUpPerPart<M>> : padding_of<PadKind::multiple_per_part, M> {};

/// Do two references share a digit of one axis? Unknown sizes count as the
/// rest of the axis.
constexpr bool refs_overlap(const axis_ref& a, const axis_ref& b) {
  return a.axis == b.axis && sub_axes_overlap(a.stride, a.size, b.stride, b.size);
}
template <std::size_t N>
constexpr int first_overlapping_ref(const std::array<axis_ref, N>& r) {
  for (std::size_t i = 0; i < N; ++i)
    for (std::size_t j = 0; j < i; ++j)
      if (refs_overlap(r[i], r[j])) return static_cast<int>(i);
  return -1;
}
template <std::size_t N>
constexpr int first_bad_ref(const std::array<axis_ref, N>& r) {
  for (std::size_t i = 0; i < N; ++i)
    if (r[i].axis.empty() || r[i].stride < 1 || (r[i].size != dynamic && r[i].size < 1))
      return static_cast<int>(i);
  return -1;
}

/// The first of T... for which Trait<T>::value holds, else Default.
template <template <class> class Trait, class Default, class... T>
struct first_of {
  using type = Default;
};
template <template <class> class Trait, class Default, class T0, class... T>
struct first_of<Trait, Default, T0, T...> {
  using type = std::conditional_t<Trait<T0>::value, T0, typename first_of<Trait, Default, T...>::type>;
};
}  // namespace detail

struct Replicate {
  using static_layout_kind = detail::kinds::cut;
  static constexpr std::array<axis_ref, 0> refs{};
  static constexpr Split split = Split::even;
  static constexpr std::int64_t block = 0;
  static constexpr std::array<std::int64_t, 0> sizes{};
  static constexpr PadKind pad = PadKind::none;
  static constexpr std::int64_t pad_value = 0;
  static constexpr bool valid = true;
};

template <axis_ref... A>
struct Shard {
  using static_layout_kind = detail::kinds::cut;
  static constexpr std::array<axis_ref, sizeof...(A)> refs{A...};
  static constexpr Split split = Split::even;
  static constexpr std::int64_t block = 0;
  static constexpr std::array<std::int64_t, 0> sizes{};
  static constexpr PadKind pad = PadKind::none;
  static constexpr std::int64_t pad_value = 0;

 private:
  static constexpr bool check() {
    if constexpr (sizeof...(A) == 0) {
      diagnostic::shard_needs_an_axis<Shard>();
      return false;
    } else if constexpr (constexpr int i = detail::first_bad_ref(refs); i >= 0) {
      if constexpr (refs[static_cast<std::size_t>(i)].axis.empty())
        diagnostic::axis_reference_needs_a_name<refs[static_cast<std::size_t>(i)]>();
      else
        diagnostic::sub_axis_needs_positive_stride_and_size<refs[static_cast<std::size_t>(i)]>();
      return false;
    } else if constexpr (constexpr int j = detail::first_overlapping_ref(refs); j >= 0) {
      diagnostic::shard_names_an_axis_twice<refs[static_cast<std::size_t>(j)].axis>();
      return false;
    }
    return true;
  }

 public:
  static constexpr bool valid = check();
  static_assert(valid || !valid);
};

template <class... Args>
struct Dim {
  using static_layout_kind = detail::kinds::dim;

 private:
  static constexpr int cuts = ((detail::is_cut<Args>::value ? 1 : 0) + ... + 0);
  static constexpr int rules = ((detail::split_rule<Args>::value ? 1 : 0) + ... + 0);
  static constexpr int pads = ((detail::padding<Args>::value ? 1 : 0) + ... + 0);
  template <class X>
  static constexpr bool known =
      detail::is_cut<X>::value || detail::split_rule<X>::value || detail::padding<X>::value;
  template <class X, class... Rest>
  static constexpr void report_unknown() {
    if constexpr (!known<X>)
      diagnostic::dim_takes_cut_split_rule_and_padding<X>();
    else if constexpr (sizeof...(Rest) > 0)
      report_unknown<Rest...>();
  }
  using cut_type = typename detail::first_of<detail::is_cut, Replicate, Args...>::type;
  using rule_type = typename detail::first_of<detail::split_rule, Even, Args...>::type;
  using pad_type = typename detail::first_of<detail::padding, void, Args...>::type;
  static constexpr bool check() {
    if constexpr (!(known<Args> && ...)) {
      report_unknown<Args...>();
      return false;
    } else if constexpr (cuts > 1) {
      diagnostic::dim_takes_at_most_one_cut<Dim>();
      return false;
    } else if constexpr (rules > 1) {
      diagnostic::dim_takes_one_split_rule<Dim>();
      return false;
    } else if constexpr (pads > 1) {
      diagnostic::dim_takes_one_padding<Dim>();
      return false;
    } else if constexpr (!cut_type::valid || !detail::split_rule<rule_type>::valid) {
      return false;  // the cut or the rule said why
    } else if constexpr (!detail::padding<pad_type>::valid) {
      return false;
    } else if constexpr (std::is_same_v<cut_type, Replicate> && !std::is_same_v<rule_type, Even>) {
      diagnostic::split_rule_needs_a_shard<Dim>();
      return false;
    }
    return true;
  }
  using cut = std::conditional_t<cuts <= 1, cut_type, Replicate>;
  using rule = detail::split_rule<std::conditional_t<rules <= 1, rule_type, Even>>;
  using pad_info = detail::padding<std::conditional_t<pads <= 1, pad_type, void>>;

 public:
  static constexpr bool valid = check();
  static_assert(valid || !valid);
  static constexpr auto refs = cut::refs;
  static constexpr Split split = rule::split;
  static constexpr std::int64_t block = rule::block;
  static constexpr auto sizes = rule::sizes;
  static constexpr PadKind pad = pad_info::kind;
  static constexpr std::int64_t pad_value = pad_info::amount;
};

// ------------------------------------------------------ a tensor's shard spec

/// Dim `D` of a tensor has spec `S` (for ShardDims<...>).
template <int D, class S>
struct On {};

/// Every dim of the tensor replicated, whatever its rank.
struct Replicated;
/// One dim spec per tensor dim: the rank is part of the type.
template <class... D>
struct ShardSpec;
/// Only the named dims are cut; the rank comes from the shape.
template <class... E>
struct ShardDims;
/// Dim `D` cut by `S`, every other dim replicated.
template <int D, class S>
using ShardOn = ShardDims<On<D, S>>;
/// Megatron's and vLLM's column-parallel linear (q/k/v, gate/up, embeddings,
/// lm_head): dim 0 of [out, in] cut evenly over the axes.
template <axis_ref... A>
using ColumnParallel = ShardOn<0, Shard<A...>>;
/// Row-parallel linear (o_proj, down_proj): dim 1 of [out, in] cut over the axes.
template <axis_ref... A>
using RowParallel = ShardOn<1, Shard<A...>>;

namespace detail {
template <class T>
struct is_on : std::false_type {};
template <int D, class S>
struct is_on<On<D, S>> : std::bool_constant<is_dim_spec<S>::value> {};

/// One referenced axis of a tensor and the dim it cuts.
struct dim_ref {
  axis_ref ref;
  int dim = 0;
};

template <int D, class S>
constexpr auto refs_of_entry() {
  std::array<dim_ref, S::refs.size()> out{};
  for (std::size_t i = 0; i < S::refs.size(); ++i) out[i] = dim_ref{S::refs[i], D};
  return out;
}
template <class... E>
struct entry_refs;
template <>
struct entry_refs<> {
  static constexpr std::array<dim_ref, 0> value{};
};
template <int D, class S, class... E>
struct entry_refs<On<D, S>, E...> {
  static constexpr auto value = [] {
    constexpr auto head = refs_of_entry<D, S>();
    constexpr auto tail = entry_refs<E...>::value;
    std::array<dim_ref, head.size() + tail.size()> out{};
    for (std::size_t i = 0; i < head.size(); ++i) out[i] = head[i];
    for (std::size_t i = 0; i < tail.size(); ++i) out[head.size() + i] = tail[i];
    return out;
  }();
};

/// Every axis a shard spec references, with the dim it cuts.
template <class Spec>
constexpr auto spec_refs() {
  return []<class... E>(type_list<E...>) { return entry_refs<E...>::value; }(typename Spec::entries{});
}

/// First ref (index i, the later one) that overlaps an earlier ref of another
/// dim, and that earlier one (j).
template <std::size_t N>
constexpr std::pair<int, int> first_cross_dim_overlap(const std::array<dim_ref, N>& r) {
  for (std::size_t i = 0; i < N; ++i)
    for (std::size_t j = 0; j < i; ++j)
      if (r[i].dim != r[j].dim && refs_overlap(r[i].ref, r[j].ref))
        return {static_cast<int>(i), static_cast<int>(j)};
  return {-1, -1};
}

template <class... E>
constexpr int max_dim() {
  int m = -1;
  ((m = std::max(m, E::dim)), ...);
  return m;
}

template <class T>
struct on_traits;
template <int D, class S>
struct on_traits<On<D, S>> {
  static constexpr int dim = D;
  using spec = S;
};

template <class Seq, class... D>
struct indexed_entries;
template <std::size_t... I, class... D>
struct indexed_entries<std::index_sequence<I...>, D...> {
  using type = type_list<On<static_cast<int>(I), D>...>;
};

/// Checks shared by ShardSpec and ShardDims once the entries are well formed:
/// entries are On<d, S> with valid S; no axis cuts two dims.
template <class... E>
constexpr bool check_entries() {
  if constexpr (!(on_traits<E>::spec::valid && ...)) {
    return false;  // the dim spec said why
  } else if constexpr (constexpr auto ov = first_cross_dim_overlap(entry_refs<E...>::value); ov.first >= 0) {
    constexpr auto r = entry_refs<E...>::value;
    diagnostic::axis_cuts_two_dims<r[static_cast<std::size_t>(ov.first)].ref.axis,
                                   r[static_cast<std::size_t>(ov.second)].dim,
                                   r[static_cast<std::size_t>(ov.first)].dim>();
    return false;
  }
  return true;
}

/// The dims of On<dim, spec> entries, in order.
template <class... E>
constexpr std::array<int, sizeof...(E)> dims_of() {
  return {on_traits<E>::dim...};
}
template <std::size_t N>
constexpr int first_negative_int(const std::array<int, N>& v) {
  for (std::size_t i = 0; i < N; ++i)
    if (v[i] < 0) return static_cast<int>(i);
  return -1;
}
template <class... D>
constexpr int first_non_dim_spec() {
  int i = 0, found = -1;
  ((found < 0 && !is_dim_spec<D>::value ? found = i : 0, ++i), ...);
  return found;
}
}  // namespace detail

struct Replicated {
  using static_layout_kind = detail::kinds::shard_spec;
  static constexpr int static_rank = -1;  ///< any rank
  static constexpr int min_rank = 1;
  using entries = detail::type_list<>;
  static constexpr bool valid = true;
};

template <class... D>
struct ShardSpec {
  using static_layout_kind = detail::kinds::shard_spec;

 private:
  static constexpr int rank = static_cast<int>(sizeof...(D));
  using raw_entries = typename detail::indexed_entries<std::index_sequence_for<D...>, D...>::type;
  template <class L>
  struct check_list;
  template <class... E>
  struct check_list<detail::type_list<E...>> {
    static constexpr bool run() { return detail::check_entries<E...>(); }
  };
  static constexpr bool check() {
    if constexpr (rank < 1 || rank > kMaxTensorRank) {
      diagnostic::tensor_has_1_to_8_dims<rank>();
      return false;
    } else if constexpr (constexpr int i = detail::first_non_dim_spec<D...>(); i >= 0) {
      diagnostic::shard_spec_takes_dim_specs<i>();
      return false;
    } else {
      return check_list<raw_entries>::run();
    }
  }

 public:
  static constexpr bool valid = check();
  static_assert(valid || !valid);
  static constexpr int static_rank = rank;
  static constexpr int min_rank = rank;
  using entries = std::conditional_t<valid, raw_entries, detail::type_list<>>;
};

template <class... E>
struct ShardDims {
  using static_layout_kind = detail::kinds::shard_spec;

 private:
  static constexpr bool check() {
    if constexpr (sizeof...(E) == 0 || !(detail::is_on<E>::value && ...)) {
      diagnostic::shard_dims_takes_on_entries<E...>();
      return false;
    } else if constexpr (constexpr int i = detail::first_negative_int(detail::dims_of<E...>()); i >= 0) {
      diagnostic::dim_index_must_be_non_negative<detail::dims_of<E...>()[static_cast<std::size_t>(i)]>();
      return false;
    } else if constexpr (constexpr int j = detail::first_repeated(detail::dims_of<E...>()); j >= 0) {
      diagnostic::dim_cut_twice<detail::dims_of<E...>()[static_cast<std::size_t>(j)]>();
      return false;
    } else if constexpr (detail::max_dim<detail::on_traits<E>...>() >= kMaxTensorRank) {
      diagnostic::shard_spec_cuts_a_dim_beyond_the_rank<detail::max_dim<detail::on_traits<E>...>(),
                                                        kMaxTensorRank>();
      return false;
    } else {
      return detail::check_entries<E...>();
    }
  }

 public:
  static constexpr bool valid = check();
  static_assert(valid || !valid);
  static constexpr int static_rank = -1;
  static constexpr int min_rank = [] {
    if constexpr (valid)
      return detail::max_dim<detail::on_traits<E>...>() + 1;
    else
      return 1;
  }();
  using entries = std::conditional_t<valid, detail::type_list<E...>, detail::type_list<>>;
};

// ------------------------------------------------------------------ shapes

/// A shape with static and dynamic extents: Shape<dynamic, 4096>.
template <std::int64_t... E>
struct Shape {
  using static_layout_kind = detail::kinds::shape;
  static constexpr int rank = static_cast<int>(sizeof...(E));
  static constexpr std::array<std::int64_t, sizeof...(E)> static_extents{E...};
  static constexpr int dynamic_count = ((E == dynamic ? 1 : 0) + ... + 0);
  /// What the tensor declaration takes at runtime: the dynamic extents, in order.
  using runtime_extents = std::array<std::int64_t, static_cast<std::size_t>(dynamic_count)>;
  static std::vector<std::int64_t> full(const runtime_extents& dyn) {
    std::vector<std::int64_t> s;
    std::size_t d = 0;
    for (auto e : static_extents) s.push_back(e == dynamic ? dyn[d++] : e);
    return s;
  }

 private:
  static constexpr int first_bad() {
    for (int i = 0; i < rank; ++i) {
      const auto e = static_extents[static_cast<std::size_t>(i)];
      if (e != dynamic && e < 1) return i;
    }
    return -1;
  }
  static constexpr bool check() {
    if constexpr (rank < 1 || rank > kMaxTensorRank) {
      diagnostic::tensor_has_1_to_8_dims<rank>();
      return false;
    } else if constexpr (constexpr int i = first_bad(); i >= 0) {
      diagnostic::shape_extent_must_be_positive<i, static_extents[static_cast<std::size_t>(i)]>();
      return false;
    }
    return true;
  }

 public:
  static constexpr bool valid = check();
  static_assert(valid || !valid);
};

/// A shape whose rank and extents are all given at runtime.
struct AnyShape {
  using static_layout_kind = detail::kinds::shape;
  static constexpr int rank = -1;
  static constexpr bool valid = true;
  using runtime_extents = std::vector<std::int64_t>;
  static std::vector<std::int64_t> full(const runtime_extents& s) { return s; }
};

namespace detail {
template <class Spec, axis_name... Stage>
constexpr int first_stage_axis_cutting_a_dim() {
  constexpr auto refs = spec_refs<Spec>();
  constexpr std::array<axis_name, sizeof...(Stage)> stage{Stage...};
  for (std::size_t s = 0; s < stage.size(); ++s)
    for (const auto& r : refs)
      if (r.ref.axis == stage[s]) return static_cast<int>(s);
  return -1;
}

template <class Spec, class Sh, axis_name... Stage>
constexpr bool check_tensor() {
  constexpr std::array<axis_name, sizeof...(Stage)> stage{Stage...};
  if constexpr (!is_shard_spec<Spec>::value) {
    diagnostic::tensor_takes_a_shard_spec<Spec>();
    return false;
  } else if constexpr (!is_shape<Sh>::value) {
    diagnostic::tensor_takes_a_shape<Sh>();
    return false;
  } else if constexpr (!Spec::valid || !Sh::valid) {
    return false;  // they said why
  } else if constexpr (Sh::rank >= 0 && Spec::static_rank >= 0 && Sh::rank != Spec::static_rank) {
    diagnostic::shard_spec_and_shape_differ_in_rank<Spec::static_rank, Sh::rank>();
    return false;
  } else if constexpr (Sh::rank >= 0 && Spec::min_rank > Sh::rank) {
    diagnostic::shard_spec_cuts_a_dim_beyond_the_rank<Spec::min_rank - 1, Sh::rank>();
    return false;
  } else if constexpr (constexpr int i = first_repeated(stage); i >= 0) {
    diagnostic::stage_axis_named_twice<stage[static_cast<std::size_t>(i)]>();
    return false;
  } else if constexpr (constexpr int j = first_stage_axis_cutting_a_dim<Spec, Stage...>(); j >= 0) {
    diagnostic::stage_axis_also_cuts_a_dim<stage[static_cast<std::size_t>(j)]>();
    return false;
  }
  return true;
}
}  // namespace detail

/// A tensor declaration: a runtime name, shape and dtype bound to a static
/// shard spec (and optionally a static shape, and stage axes whose
/// coordinates are runtime).
///   Tensor<ColumnParallel<"tp">>("q", {4096, 4096}, DType::bf16).stage<"pp">(0)
///   Tensor<ShardSpec<Shard<"tp">, Replicate>, Shape<dynamic, 4096>>("q", {hidden}, DType::bf16)
template <class Spec, class Sh = AnyShape, axis_name... Stage>
struct Tensor {
  using static_layout_kind = detail::kinds::tensor;
  static constexpr bool valid = detail::check_tensor<Spec, Sh, Stage...>();
  static_assert(valid || !valid);

  using spec = std::conditional_t<valid, Spec, Replicated>;
  using shape_type = std::conditional_t<valid, Sh, AnyShape>;
  using runtime_extents = typename shape_type::runtime_extents;
  static constexpr std::array<axis_name, sizeof...(Stage)> stage_axes{Stage...};
  /// Rank when the type knows it, else -1.
  static constexpr int static_rank = shape_type::rank >= 0 ? shape_type::rank : spec::static_rank;

  std::string name;
  std::vector<std::int64_t> shape;
  DType dtype = DType::f32;
  std::array<std::int64_t, sizeof...(Stage)> stage_coords{};  ///< one per stage axis

  Tensor(std::string name_, runtime_extents extents, DType dtype_)
      : name(std::move(name_)), shape(shape_type::full(extents)), dtype(dtype_) {}

  /// The same tensor living only where the coordinate on `Axis` is `coord`.
  template <axis_name Axis>
  Tensor<Spec, Sh, Stage..., Axis> stage(std::int64_t coord) const {
    Tensor<Spec, Sh, Stage..., Axis> t(name, shape, dtype, {});
    for (std::size_t i = 0; i < sizeof...(Stage); ++i) t.stage_coords[i] = stage_coords[i];
    t.stage_coords[sizeof...(Stage)] = coord;
    return t;
  }

 private:
  template <class, class, axis_name...>
  friend struct Tensor;
  struct full_shape {};
  Tensor(std::string name_, std::vector<std::int64_t> shape_, DType dtype_, full_shape)
      : name(std::move(name_)), shape(std::move(shape_)), dtype(dtype_) {}
};

/// What LayoutOf::add returns: names the tensor in buffers, keeps its type
/// for the static checks of concat and flat. From add<E>(), `E` is the
/// tensor's element type (reshard::ElementType), and bind_tensor() (exec/binding.hpp)
/// checks the memory bound to it at compile time; from add(), E is void.
template <class T, class E = void>
struct TensorHandle {
  using tensor_type = T;
  using element_type = E;
  int index = -1;
  const void* owner = nullptr;
  std::string name;  ///< the tensor's name: its local buffer's when stored alone
  /// The tensor's number of dims when its type knows it, else -1.
  static constexpr int static_rank() { return T::static_rank; }
};

/// Concat rounds (CONTRACT.md §1 buffers: interleave G).
struct Interleave {
  std::int64_t groups = 1;
};

// -------------------------------------------------- checks against a mesh

namespace detail {
/// Number of parts a dim is cut into when the types know it, else dynamic.
template <class M, class S>
constexpr std::int64_t static_parts() {
  std::int64_t k = 1;
  for (const auto& r : S::refs) {
    const int a = find_name(M::names, r.axis);
    if (a < 0) return dynamic;
    std::int64_t z = r.size;
    if (z == dynamic) {
      const auto n = M::static_sizes[static_cast<std::size_t>(a)];
      if (n == dynamic) return dynamic;
      z = n / r.stride;
    }
    k *= z;
  }
  return k;
}

template <class M, std::size_t N>
constexpr int first_unknown_ref(const std::array<axis_ref, N>& refs) {
  for (std::size_t i = 0; i < N; ++i)
    if (find_name(M::names, refs[i].axis) < 0) return static_cast<int>(i);
  return -1;
}
template <class M, std::size_t N>
constexpr int first_non_dividing_ref(const std::array<axis_ref, N>& refs) {
  for (std::size_t i = 0; i < N; ++i) {
    const auto n = M::static_sizes[static_cast<std::size_t>(find_name(M::names, refs[i].axis))];
    if (n != dynamic && !sub_axis_divides(n, refs[i].stride, refs[i].size)) return static_cast<int>(i);
  }
  return -1;
}

/// One dim of a tensor against a mesh (and its static extent, or dynamic).
template <class M, int D, class S, std::int64_t Extent>
constexpr bool check_dim_in_mesh() {
  constexpr std::int64_t k = static_parts<M, S>();
  constexpr std::int64_t padded = S::pad == PadKind::absolute ? S::pad_value
                                  : S::pad == PadKind::none   ? Extent
                                                              : dynamic;
  if constexpr (constexpr int i = first_unknown_ref<M>(S::refs); i >= 0) {
    diagnostic::unknown_axis<S::refs[static_cast<std::size_t>(i)].axis>();
    return false;
  } else if constexpr (constexpr int j = first_non_dividing_ref<M>(S::refs); j >= 0) {
    diagnostic::sub_axis_does_not_divide_its_axis<
        S::refs[static_cast<std::size_t>(j)], M::static_sizes[static_cast<std::size_t>(find_name(
                                                  M::names, S::refs[static_cast<std::size_t>(j)].axis))]>();
    return false;
  } else if constexpr (constexpr CutFault fault = cut_fault(S::split, Extent, padded, k, S::sizes); fault != CutFault::none) {
    // The validated Layout's cut rules (dim_spec.hpp), on what the types know.
    if constexpr (fault == CutFault::padded_below_extent)
      diagnostic::padded_extent_below_the_extent<D, S::pad_value, Extent>();
    else if constexpr (fault == CutFault::even_split_does_not_divide)
      diagnostic::even_split_does_not_divide<D, padded, k>();
    else if constexpr (fault == CutFault::sizes_count)
      diagnostic::sizes_count_differs_from_parts<D, static_cast<std::int64_t>(S::sizes.size()), k>();
    else  // Sizes<...> holds no negative size (Dim checked)
      diagnostic::sizes_sum_differs_from_extent<D, std::accumulate(S::sizes.begin(), S::sizes.end(), std::int64_t{0}), padded>();
    return false;
  }
  return true;
}

template <class Sh, int D>
constexpr std::int64_t static_extent() {
  if constexpr (Sh::rank < 0)
    return dynamic;
  else if constexpr (D >= Sh::rank)
    return dynamic;
  else
    return Sh::static_extents[static_cast<std::size_t>(D)];
}

template <class M, class Sh, class... E>
struct check_dims_in_mesh;
template <class M, class Sh>
struct check_dims_in_mesh<M, Sh> {
  static constexpr bool run() { return true; }
};
template <class M, class Sh, int D, class S, class... E>
struct check_dims_in_mesh<M, Sh, On<D, S>, E...> {
  static constexpr bool run() {
    if constexpr (!check_dim_in_mesh<M, D, S, static_extent<Sh, D>()>())
      return false;
    else
      return check_dims_in_mesh<M, Sh, E...>::run();
  }
};

template <class M, class T>
constexpr bool check_tensor_in_mesh() {
  if constexpr (!T::valid) {
    return false;
  } else if constexpr (constexpr int i =
                           [] {
                             for (std::size_t s = 0; s < T::stage_axes.size(); ++s)
                               if (find_name(M::names, T::stage_axes[s]) < 0) return static_cast<int>(s);
                             return -1;
                           }();
                       i >= 0) {
    diagnostic::unknown_stage_axis<T::stage_axes[static_cast<std::size_t>(i)]>();
    return false;
  } else {
    return []<class... E>(type_list<E...>) {
      return check_dims_in_mesh<M, typename T::shape_type, E...>::run();
    }(typename T::spec::entries{});
  }
}

template <class M, class S>
DimSpec lower_dim(const M& mesh, std::int64_t extent) {
  DimSpec d;
  for (const auto& r : S::refs) {
    const int a = find_name(M::names, r.axis);
    const std::int64_t n = mesh.size(a);
    d.axes.push_back(AxisRef{a, r.stride, r.size == dynamic ? n / r.stride : r.size});
  }
  d.split = S::split;
  d.block = S::block;
  d.sizes.assign(S::sizes.begin(), S::sizes.end());
  if constexpr (S::pad == PadKind::absolute) {
    d.pad_to = S::pad_value;
  } else if constexpr (S::pad != PadKind::none) {
    const std::int64_t m = S::pad == PadKind::multiple ? S::pad_value : S::pad_value * d.parts();
    d.pad_to = m > 0 ? (extent + m - 1) / m * m : extent;
  }
  return d;
}
}  // namespace detail

// Concepts for generic code over static layouts (the checks above give the
// sentences; these only classify).
template <class T>
concept MeshType = detail::is_mesh<T>::value;
template <class T>
concept DimSpecType = detail::is_dim_spec<T>::value;
template <class T>
concept ShardSpecType = detail::is_shard_spec<T>::value;
template <class T>
concept TensorType = detail::is_tensor<T>::value;

/// True when tensor declaration T fits mesh M; a misfit is a compile error
/// that says why.
template <class M, class T>
inline constexpr bool fits = detail::check_tensor_in_mesh<M, T>();

// ------------------------------------------------------------- the layout

/// A layout whose mesh and shard specs are types. add() checks each tensor
/// against the mesh at compile time and records its runtime descriptor;
/// lower() gives the validated reshard::Layout.
template <class M>
class LayoutOf {
  static constexpr bool check() {
    if constexpr (!detail::is_mesh<M>::value) {
      diagnostic::layout_takes_a_mesh<M>();
      return false;
    } else {
      return M::valid;
    }
  }

 public:
  static constexpr bool valid = check();
  static_assert(valid || !valid);
  using mesh_type = M;

  M mesh;
  std::string origin = "<static layout>";  ///< names the layout in messages

  explicit LayoutOf(M mesh_, std::string origin_ = "<static layout>")
      : mesh(std::move(mesh_)), origin(std::move(origin_)) {}

  /// Adds a tensor; its spec is checked against the mesh here, at compile
  /// time. add<E>(tensor) also fixes its element type E (its dtype must be
  /// dtype_of<E>, else a LayoutError naming the tensor): bind_tensor() then takes
  /// only memory of E (const or not) for it; add<const E> is add<E>.
  template <class E = void, class T>
  TensorHandle<T, std::remove_cv_t<E>> add(const T& tensor) {
    if constexpr (!detail::is_tensor<T>::value) {
      diagnostic::add_takes_a_tensor<T>();
      return {};
    } else if constexpr (!std::is_void_v<E> && !ElementType<E>) {
      diagnostic::add_takes_an_element_type<E>();
      return {};
    } else if constexpr (!valid || !detail::check_tensor_in_mesh<M, T>()) {
      return {};
    } else {
      if constexpr (!std::is_void_v<E>)
        if (tensor.dtype != dtype_of<E>)
          layout_fail(ErrorContext{origin, tensor.name, "dtype"}, "the tensor is {} but add<E> gives its element type as {}",
                      to_string(tensor.dtype), to_string(dtype_of<E>));
      TensorSpec ts;
      ts.name = tensor.name;
      ts.shape = tensor.shape;
      ts.dtype = tensor.dtype;
      const int rank = static_cast<int>(ts.shape.size());
      const int dims = T::spec::static_rank >= 0 ? T::spec::static_rank : rank;
      ts.dims.resize(static_cast<std::size_t>(std::max(dims, 0)));
      [&]<class... Entry>(detail::type_list<Entry...>) {
        (lower_entry<Entry>(ts, tensor.name), ...);
      }(typename T::spec::entries{});
      for (std::size_t s = 0; s < T::stage_axes.size(); ++s)
        ts.stage.push_back(StageCoord{detail::find_name(M::names, T::stage_axes[s]), tensor.stage_coords[s]});
      tensors_.push_back(std::move(ts));
      return TensorHandle<T, std::remove_cv_t<E>>{static_cast<int>(tensors_.size()) - 1, this, tensor.name};
    }
  }

  /// A concat buffer: the parts' local arrays side by side along `Dim`
  /// (vLLM's qkv_proj = [q_r; k_r; v_r]).
  template <int Dim = 0, class... T, class... E>
  void concat(std::string name, TensorHandle<T, E>... parts) {
    concat<Dim>(std::move(name), Interleave{1}, parts...);
  }
  /// Concat in G rounds (Megatron's per-query-group [q; k; v]).
  template <int Dim = 0, class... T, class... E>
  void concat(std::string name, Interleave rounds, TensorHandle<T, E>... parts) {
    if constexpr (check_parts<T...>() && check_concat_dim<Dim, T...>()) {
      BufferSpec b;
      b.name = std::move(name);
      b.kind = BufferKind::concat;
      b.dim = Dim;
      b.interleave = rounds.groups;
      (b.parts.push_back(part_name(parts)), ...);
      buffers_.push_back(std::move(b));
    }
  }

  /// A flat bucket: the parts' local arrays flattened, concatenated and cut
  /// by `Cut` (ZeRO / FSDP flat parameters): flat<Dim<Shard<"dp">, Chunk>>("bucket0", a, b).
  template <class Cut, class... T, class... E>
  void flat(std::string name, TensorHandle<T, E>... parts) {
    if constexpr (check_parts<T...>() && check_flat<Cut, T...>()) {
      BufferSpec b;
      b.name = std::move(name);
      b.kind = BufferKind::flat;
      b.flat = detail::lower_dim<M, Cut>(mesh, 0);
      (b.parts.push_back(part_name(parts)), ...);
      buffers_.push_back(std::move(b));
    }
  }

  /// The runtime descriptors recorded so far (not validated).
  const std::vector<TensorSpec>& tensors() const { return tensors_; }
  const std::vector<BufferSpec>& buffers() const { return buffers_; }

  /// The runtime layout, validated (throws LayoutError naming origin, tensor, field).
  Layout lower() const {
    LayoutSpec L;
    L.mesh = mesh.lower();
    L.tensors = tensors_;
    L.buffers = buffers_;
    L.origin = origin;
    return Layout(std::move(L));
  }

 private:
  template <class E>
  void lower_entry(TensorSpec& ts, const std::string& name) const {
    constexpr int d = detail::on_traits<E>::dim;
    using S = typename detail::on_traits<E>::spec;
    if (d >= static_cast<int>(ts.dims.size()))
      layout_fail(ErrorContext{origin, name, "dims"}, "the shard spec cuts dim {} but the tensor has {} dims",
                  d, ts.shape.size());
    const std::int64_t extent =
        d < static_cast<int>(ts.shape.size()) ? ts.shape[static_cast<std::size_t>(d)] : 0;
    ts.dims[static_cast<std::size_t>(d)] = detail::lower_dim<M, S>(mesh, extent);
  }
  template <class T, class E>
  std::string part_name(const TensorHandle<T, E>& h) const {
    if (h.owner != this || h.index < 0 || h.index >= static_cast<int>(tensors_.size()))
      fail("{}: a buffer part is a tensor handle from another layout", origin);
    return tensors_[static_cast<std::size_t>(h.index)].name;
  }
  template <class... T>
  static constexpr bool check_parts() {
    if constexpr (sizeof...(T) == 0 || !(detail::is_tensor<T>::value && ...)) {
      diagnostic::buffer_parts_are_tensor_handles<T...>();
      return false;
    } else if constexpr (!((T::valid && detail::check_tensor_in_mesh<M, T>()) && ...)) {
      return false;
    } else if constexpr (!same_stage_axes<T...>()) {
      diagnostic::buffer_parts_differ_in_stage_axes<T...>();
      return false;
    }
    return true;
  }
  template <class T0, class... T>
  static constexpr bool same_stage_axes() {
    [[maybe_unused]] auto contains = [](const auto& set, const axis_name& n) {
      for (const auto& s : set)
        if (s == n) return true;
      return false;
    };
    bool same = true;
    (
        [&] {
          same = same && T::stage_axes.size() == T0::stage_axes.size();
          for (const auto& n : T::stage_axes) same = same && contains(T0::stage_axes, n);
        }(),
        ...);
    return same;
  }
  template <int Dim, class... T>
  static constexpr bool check_concat_dim() {
    constexpr int rank = [] {
      int r = -1;
      ((r = (T::static_rank >= 0 && (r < 0 || T::static_rank < r)) ? T::static_rank : r), ...);
      return r;
    }();
    if constexpr (Dim < 0 || (rank >= 0 && Dim >= rank)) {
      diagnostic::concat_dim_beyond_the_rank_of_a_part<Dim, rank>();
      return false;
    }
    return true;
  }
  template <class Cut, class... T>
  static constexpr bool check_flat() {
    if constexpr (!detail::is_dim_spec<Cut>::value) {
      diagnostic::flat_takes_a_dim_spec<Cut>();
      return false;
    } else if constexpr (!Cut::valid) {
      return false;
    } else if constexpr (Cut::split == Split::cyclic) {
      diagnostic::flat_buffer_cannot_be_cyclic<Cut>();
      return false;
    } else if constexpr (Cut::pad == PadKind::multiple || Cut::pad == PadKind::multiple_per_part) {
      diagnostic::flat_buffer_cannot_round_up<Cut>();
      return false;
    } else if constexpr (!detail::check_dim_in_mesh<M, 0, Cut, dynamic>()) {
      return false;
    } else if constexpr (constexpr int i =
                             [] {
                               int found = -1;
                               (
                                   [&] {
                                     constexpr auto refs = detail::spec_refs<typename T::spec>();
                                     for (std::size_t c = 0; c < Cut::refs.size(); ++c) {
                                       for (const auto& r : refs)
                                         if (found < 0 && detail::refs_overlap(r.ref, Cut::refs[c]))
                                           found = static_cast<int>(c);
                                       for (const auto& s : T::stage_axes)
                                         if (found < 0 && s == Cut::refs[c].axis) found = static_cast<int>(c);
                                     }
                                   }(),
                                   ...);
                               return found;
                             }();
                         i >= 0) {
      diagnostic::flat_axis_also_cuts_a_part<Cut::refs[static_cast<std::size_t>(i)].axis>();
      return false;
    }
    return true;
  }

  std::vector<TensorSpec> tensors_;
  std::vector<BufferSpec> buffers_;
};

}  // namespace reshard::st
