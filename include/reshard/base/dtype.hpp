#pragma once
// Element types of the contract (CONTRACT.md §1 "dtype"). The planner only
// needs their sizes; executors move bytes.
#include <array>
#include <cstdint>
#include <optional>
#include <string_view>
#include <type_traits>

namespace reshard {

enum class DType : std::uint8_t { f64, f32, bf16, f16, fp8e4m3, fp8e5m2, i64, i32, u32, i8, u8 };

inline constexpr std::array<std::string_view, 11> dtype_names = {
    "f64", "f32", "bf16", "f16", "fp8e4m3", "fp8e5m2", "i64", "i32", "u32", "i8", "u8"};

constexpr std::string_view to_string(DType t) { return dtype_names[static_cast<int>(t)]; }

constexpr std::int64_t element_bytes(DType t) {
  constexpr std::array<std::int64_t, 11> bytes = {8, 4, 2, 2, 1, 1, 8, 4, 4, 1, 1};
  return bytes[static_cast<int>(t)];
}

constexpr std::optional<DType> parse_dtype(std::string_view s) {
  for (std::size_t i = 0; i < dtype_names.size(); ++i)
    if (dtype_names[i] == s) return static_cast<DType>(i);
  return std::nullopt;
}

/// One C++ element type per dtype, for bindings typed at compile time
/// (static layouts: st::LayoutOf::add<E>, bind_tensor()). The 2- and 1-byte
/// floating types are storage only (their bits), and distinct, so that a bf16
/// buffer cannot stand where an f16 one is expected.
struct bf16_t {
  std::uint16_t bits;
};
struct f16_t {
  std::uint16_t bits;
};
struct fp8e4m3_t {
  std::uint8_t bits;
};
struct fp8e5m2_t {
  std::uint8_t bits;
};

namespace detail {
template <class E>
inline constexpr std::optional<DType> dtype_of = std::nullopt;
template <> inline constexpr std::optional<DType> dtype_of<double> = DType::f64;
template <> inline constexpr std::optional<DType> dtype_of<float> = DType::f32;
template <> inline constexpr std::optional<DType> dtype_of<bf16_t> = DType::bf16;
template <> inline constexpr std::optional<DType> dtype_of<f16_t> = DType::f16;
template <> inline constexpr std::optional<DType> dtype_of<fp8e4m3_t> = DType::fp8e4m3;
template <> inline constexpr std::optional<DType> dtype_of<fp8e5m2_t> = DType::fp8e5m2;
template <> inline constexpr std::optional<DType> dtype_of<std::int64_t> = DType::i64;
template <> inline constexpr std::optional<DType> dtype_of<std::int32_t> = DType::i32;
template <> inline constexpr std::optional<DType> dtype_of<std::uint32_t> = DType::u32;
template <> inline constexpr std::optional<DType> dtype_of<std::int8_t> = DType::i8;
template <> inline constexpr std::optional<DType> dtype_of<std::uint8_t> = DType::u8;
}  // namespace detail

/// The C++ element types above and float, double, int64/32, uint32, int8, uint8.
template <class E>
concept ElementType = detail::dtype_of<std::remove_cv_t<E>>.has_value();

/// The dtype of an element type (ElementType<E>).
template <ElementType E>
inline constexpr DType dtype_of = *detail::dtype_of<std::remove_cv_t<E>>;

static_assert(sizeof(bf16_t) == 2 && sizeof(fp8e4m3_t) == 1 && element_bytes(dtype_of<bf16_t>) == sizeof(bf16_t));

}  // namespace reshard
