#pragma once
// The planner's hash table: uint64 keys to uint32 values.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace reshard::detail {

/// uint64 key -> uint32 value by open addressing: the planner's caches hold
/// thousands of entries and are read millions of times, and a node per entry
/// (std::unordered_map) costs an allocation and a cache miss each.
class FlatIndex {
 public:
  static constexpr std::uint32_t kNone = UINT32_MAX;
  /// Forgets every key, keeping the slots.
  void clear() {
    if (used_ == 0) return;
    std::fill(keys_.begin(), keys_.end(), 0);
    used_ = 0;
  }
  /// The value slot of key (< UINT64_MAX), kNone when it was absent (the
  /// caller fills it). Valid until the next call.
  std::uint32_t& slot(std::uint64_t key) {
    if (2 * (used_ + 1) > keys_.size()) grow();
    const std::uint64_t stored = key + 1;  // 0 marks an empty slot
    const std::size_t mask = keys_.size() - 1;
    for (std::size_t i = hash(key, shift_);; i = (i + 1) & mask) {
      if (keys_[i] == stored) return values_[i];
      if (keys_[i] == 0) {
        keys_[i] = stored;
        ++used_;
        values_[i] = kNone;
        return values_[i];
      }
    }
  }

 private:
  // Fibonacci hashing: the product's top bits depend on all of the key's
  // (keys differ in both halves: tensor << 32 | part, position * tensors + tensor).
  static std::size_t hash(std::uint64_t k, int shift) {
    return static_cast<std::size_t>((k * 0x9E3779B97F4A7C15ull) >> shift);
  }
  void grow() {
    const int shift = keys_.empty() ? 58 : shift_ - 1;  // 64 slots, then doubling
    std::vector<std::uint64_t> keys(std::size_t{1} << (64 - shift), 0);
    std::vector<std::uint32_t> values(keys.size());
    const std::size_t mask = keys.size() - 1;
    for (std::size_t j = 0; j < keys_.size(); ++j) {
      if (keys_[j] == 0) continue;
      std::size_t i = hash(keys_[j] - 1, shift);
      while (keys[i] != 0) i = (i + 1) & mask;
      keys[i] = keys_[j];
      values[i] = values_[j];
    }
    keys_.swap(keys);
    values_.swap(values);
    shift_ = shift;
  }
  std::vector<std::uint64_t> keys_;
  std::vector<std::uint32_t> values_;
  std::size_t used_ = 0;
  int shift_ = 64;  // 64 - log2(slots)
};

}  // namespace reshard::detail
