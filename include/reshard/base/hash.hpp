#pragma once
// Hash mixing for digests the library compares (setup digests, pair
// balances): not cryptographic, only well spread.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string_view>

namespace reshard {

/// A 64-bit mixing step.
inline std::uint64_t hash_mix(std::uint64_t h, std::uint64_t v) {
  h ^= v + 0x9E3779B97F4A7C15ull + (h << 6) + (h >> 2);
  h *= 0xBF58476D1CE4E5B9ull;
  return h ^ (h >> 31);
}

/// A streaming digest of words and strings, for change detection over large
/// descriptions: one multiply a word (FNV-1a on 64-bit words), finished by
/// hash_mix so that the result is well spread.
class Digest {
 public:
  Digest& add(std::uint64_t word) {
    h_ = (h_ ^ word) * 0x100000001B3ull;
    return *this;
  }
  /// A string's length, then its bytes eight at a time.
  Digest& add(std::string_view s) {
    add(static_cast<std::uint64_t>(s.size()));
    for (std::size_t i = 0; i < s.size(); i += 8) {
      std::uint64_t word = 0;
      std::memcpy(&word, s.data() + i, std::min<std::size_t>(8, s.size() - i));
      add(word);
    }
    return *this;
  }
  std::uint64_t value() const { return hash_mix(h_, 0x5245534841524400ull); }

 private:
  std::uint64_t h_ = 0xCBF29CE484222325ull;
};

}  // namespace reshard
