#pragma once
// Element types of the contract (CONTRACT.md §1 "dtype"). The planner only
// needs their sizes; executors move bytes.
#include <array>
#include <cstdint>
#include <optional>
#include <string_view>

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

}  // namespace reshard
