#pragma once
// Bounded batches: at most `max_ops` transport ops per rank in one wave (one
// batch, one NCCL group), with both ends of every peer pair putting each
// message into the same wave.
//
// Why: NCCL splits a group larger than its limits into several kernel plans,
// each rank from its own op list, so a send and its receive can land in
// different plans and hang (Megatron-LM PR 7189 at ~24k ops per rank;
// PyTorch chunks such batches at 256 ops, PR 174942). The wave of a message
// must therefore come from what both ends of its pair know alike, never from
// a rank's own op count.
//
// What both ends know: the pair's messages in tag order with the waves the
// staging split gave them (plan_pair_messages runs on both ends on the same
// inputs), the world's size and the pair's positions in it, and (one
// all_gather in setup) every rank's number of peer pairs (its degree) and the
// largest degree D. From those, each pair's messages are moved to new waves:
//
//  * quota (D * per_pair_min <= max_ops): a pair between ranks of degrees a
//    and b takes at most q = max_ops / max(a, b) ops per wave (its checksum
//    control message included), so a rank's ops in any wave are at most
//    degree * q <= max_ops. The pair's messages keep their order and each new
//    wave holds part of one old wave only, so staging per wave only shrinks.
//  * lanes (a rank with more peers than fit): pair {i, j} (world positions)
//    meets in round (i + j) mod N, where every rank has one partner per round
//    (two pairs: one each way); rounds are cut into lanes of W = max_ops /
//    (2 * per_pair_min) rounds, L lanes in all; the pair sends one data
//    message per wave, its t-th in wave t * L + lane. A rank then has at most
//    2 * W pairs in a wave, each with at most per_pair_min ops.
//
// Both give every message a wave both ends compute alike, and waves run in
// order on every rank, so the lowest unfinished wave always has both ends of
// all its messages posted: no plan waits for one that cannot start.
#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include "../base/error.hpp"

namespace reshard {

/// One peer pair as the wave bound sees it (the same on both ends).
struct BatchPair {
  std::int64_t degree_src = 0, degree_dst = 0;  ///< peer pairs of the sending and the receiving rank
  std::int64_t world_pos_src = 0, world_pos_dst = 0;
};

/// The world-wide inputs of the bound (the same on every rank).
struct BatchCap {
  std::int64_t max_ops = 0;     ///< 0: unbounded
  std::int64_t world = 1;       ///< ranks in the world
  std::int64_t max_degree = 0;  ///< largest number of peer pairs of any rank
  bool checksum = false;        ///< one control message per pair and wave
  /// Ops a pair needs in a wave at least: one data message, and its control.
  std::int64_t per_pair_min() const { return checksum ? 2 : 1; }
  /// The smallest cap that holds in both modes.
  static constexpr std::int64_t kMinimum = 4;
  bool lanes() const { return max_ops > 0 && max_degree * per_pair_min() > max_ops; }
  std::int64_t rounds_per_lane() const { return std::max<std::int64_t>(1, max_ops / (2 * per_pair_min())); }
  std::int64_t lane_count() const { return (world + rounds_per_lane() - 1) / rounds_per_lane(); }
};

/// New waves for one pair's messages (`waves`: their waves from the staging
/// split, non-decreasing, in tag order). Unbounded: unchanged.
inline std::vector<int> bounded_waves(std::span<const int> waves, const BatchCap& cap, const BatchPair& pair) {
  std::vector<int> out(waves.begin(), waves.end());
  if (cap.max_ops == 0 || waves.empty()) return out;
  if (cap.max_ops < BatchCap::kMinimum) fail("a batch cap of {} ops is below the minimum of {}", cap.max_ops, BatchCap::kMinimum);
  for (std::size_t k = 1; k < waves.size(); ++k)
    if (waves[k] < waves[k - 1]) fail("internal: a pair's messages are not in wave order");
  const std::int64_t control = cap.checksum ? 1 : 0;
  std::int64_t per_wave = 1, lane = 0, lanes = 1;  // data messages of the pair per new wave; its lane
  if (cap.lanes()) {
    const std::int64_t round = (pair.world_pos_src + pair.world_pos_dst) % cap.world;
    lane = round / cap.rounds_per_lane();
    lanes = cap.lane_count();
  } else {
    const std::int64_t degree = std::max<std::int64_t>({pair.degree_src, pair.degree_dst, 1});
    per_wave = cap.max_ops / degree - control;  // >= 1: degree * per_pair_min <= max_ops
  }
  std::int64_t t = 0, in_wave = 0;  // the pair's new wave (before lanes), messages in it
  for (std::size_t k = 0; k < waves.size(); ++k) {
    if (k > 0 && (waves[k] != waves[k - 1] || in_wave == per_wave)) {
      ++t;
      in_wave = 0;
    }
    ++in_wave;
    const std::int64_t w = t * lanes + lane;
    if (w > INT32_MAX) fail("a pair's {} messages need more than 2^31 waves under a batch cap of {} ops", waves.size(), cap.max_ops);
    out[k] = static_cast<int>(w);
  }
  return out;
}

}  // namespace reshard
