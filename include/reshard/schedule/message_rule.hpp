#pragma once
// How the executor cuts a peer pair's copies into messages (executor.hpp,
// "Compile"), as the small functions both the executor and the simulator
// (sim/simulate.hpp) use, so that the simulator counts the messages the executor
// sends:
//  * a copy that is one contiguous run on both sides and at least
//    zero_copy_min bytes is its own message (zero-copy); with the
//    executor's max_direct_messages set, only the largest that many per
//    pair (the rest are packed): not modelled here, the simulator counts
//    the default (no bound);
//  * the other copies are staged: a rank's staged bytes within its
//    staging_budget all go in one wave; over it, each pair gets a share of
//    budget / pipeline in proportion to its staged bytes (the smaller of its
//    two ends' shares), and its staged stream is cut into waves of that share;
//  * per wave, a copy contiguous on one side only is a message per piece (it
//    is read or written in place on that side), and the packed rest of the
//    pair is one message.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace reshard {

/// The executor's defaults (ExecutorOptions), also the simulator's (Topology).
inline constexpr std::int64_t kDefaultStagingBudget = std::int64_t{256} << 20;
inline constexpr std::int64_t kDefaultZeroCopyMin = std::int64_t{64} << 10;
inline constexpr int kDefaultPipeline = 2;

/// Is one side of a box one unit-stride run (row-major dense over the extents)?
inline bool dense_run(int rank, const std::int64_t* ext, const std::int64_t* st) {
  std::int64_t expect = 1;
  for (int k = rank - 1; k >= 0; --k) {
    if (ext[k] == 1) continue;
    if (st[k] != expect) return false;
    expect *= ext[k];
  }
  return true;
}

/// How many unit-stride runs one side of a box is (1 for a dense_run): the
/// extents outside the innermost dims that are dense, multiplied.
inline std::int64_t contiguous_runs(int rank, const std::int64_t* ext, const std::int64_t* st) {
  std::int64_t expect = 1;
  int k = rank - 1;
  for (; k >= 0; --k) {
    if (ext[k] == 1) continue;
    if (st[k] != expect) break;
    expect *= ext[k];
  }
  std::int64_t runs = 1;
  for (int j = 0; j <= k; ++j) runs *= ext[j];
  return runs;
}

/// Is one side of a copy read or written in place (not staged)? Big enough
/// and one run (`run`: in dense coordinates and not broken by a view).
inline bool in_place(std::int64_t bytes, bool run, std::int64_t zero_copy_min) { return bytes >= zero_copy_min && run; }

/// A copy's form in the executor's messages.
enum class CopyForm : std::uint8_t {
  packed,     ///< staged on both sides, in the pair's bucket message of its wave
  half,       ///< in place on one side, staged on the other: a message per piece
  zero_copy,  ///< in place on both sides: its own message
};

inline CopyForm copy_form(bool src_in_place, bool dst_in_place) {
  return src_in_place && dst_in_place ? CopyForm::zero_copy : (src_in_place || dst_in_place) ? CopyForm::half : CopyForm::packed;
}

/// No staging limit: a pair's share when its rank's staging fits the budget.
inline constexpr std::int64_t kNoStagingLimit = std::numeric_limits<std::int64_t>::max();

/// A rank's staging capacity per wave: -1 when all its staged bytes fit the
/// budget (every wave its own staging); else one of `pipeline` slots less 16
/// bytes per staged pair (each pair's share is rounded down to 16 bytes and
/// given 16 more). <= 0: the budget is too small (the executor fails).
inline std::int64_t staging_capacity(std::int64_t total_staged, std::int64_t staged_pairs, std::int64_t budget, int pipeline) {
  if (total_staged <= budget) return -1;
  return budget / pipeline - 16 * staged_pairs;
}

/// A staged refit's staging budget of one rank, split among its stages (the
/// stages' executors hold their staging at once): `pairs[k]` is the rank's
/// peer pairs (peer, direction) in stage k. A stage with pairs gets what they
/// need at least (staging_capacity's 16 bytes per pair and slot, plus 64),
/// then an even part of the rest (an even split of the budget if it cannot
/// cover those floors: the executor then says it is too small); a stage
/// without pairs stages nothing and gets the executor's minimum of 64.
inline std::vector<std::int64_t> stage_staging_budgets(std::int64_t budget, const std::vector<std::int64_t>& pairs, int pipeline) {
  std::vector<std::int64_t> out(pairs.size(), 64);
  std::int64_t talking = 0, floors = 0;
  for (auto n : pairs)
    if (n > 0) {
      ++talking;
      floors += 16 * n * pipeline + 64;
    }
  if (talking == 0) return out;
  const std::int64_t rest = budget - floors;
  for (std::size_t k = 0; k < pairs.size(); ++k)
    if (pairs[k] > 0) out[k] = rest >= 0 ? 16 * pairs[k] * pipeline + 64 + rest / talking : budget / talking;
  return out;
}

/// One end's share for a pair with `staged` of the end's `total_staged`
/// bytes, at its capacity (staging_capacity); the pair's share is the smaller
/// of its two ends' shares and its own staged bytes.
inline std::int64_t staging_share(std::int64_t capacity, std::int64_t total_staged, std::int64_t staged) {
  if (capacity < 0 || total_staged <= 0) return kNoStagingLimit;
  const long double share = static_cast<long double>(capacity) * static_cast<long double>(staged) / static_cast<long double>(total_staged);
  return (static_cast<std::int64_t>(share) & ~std::int64_t{15}) + 16;
}

/// A pair's copies summed by form: what counting its messages needs (the
/// packed copies are the rest of the pair's).
struct PairForms {
  std::int64_t zero_copy = 0, half = 0;     ///< copies
  double half_bytes = 0, packed_bytes = 0;  ///< staged bytes by form
  double staged() const { return half_bytes + packed_bytes; }
};

/// The messages the executor forms for a pair at `share` bytes per wave.
/// Exact for one wave, and for several when the pair has no half copies;
/// with several waves and half copies it depends on the copies' order,
/// which the sums do not keep: the wave boundaries are taken to fall in half
/// copies in proportion to their bytes (each such boundary splits a piece in
/// two), and the packed bytes to reach every wave that half copies do not
/// fill on their own.
inline double pair_messages(const PairForms& f, std::int64_t share) {
  const double staged = f.staged();
  double n = static_cast<double>(f.zero_copy);
  if (staged <= 0) return n;
  const double waves = std::max(1.0, std::ceil(staged / static_cast<double>(share)));
  n += static_cast<double>(f.half) + std::round((waves - 1) * f.half_bytes / staged);
  if (f.packed_bytes > 0) n += std::clamp(waves - std::floor(f.half_bytes / static_cast<double>(share)), 1.0, waves);
  return n;
}

}  // namespace reshard
