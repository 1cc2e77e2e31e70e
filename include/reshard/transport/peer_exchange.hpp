#pragma once
// Pairwise setup exchange: each rank sends one blob to each of its peers and
// gets one back from each, so a setup moves O(peers) bytes per rank. An
// all_gather of the same tables hands every rank every rank's tables: O(ops
// in the job) per rank (the DeepSeek-V3 128+128 plan: hundreds of MB per
// rank in UCX's prepare).
//
// The optional Transport member `exchange` is specified in transport.hpp
// ("pairwise exchange", under Members).
//
// Callers make sure the lists are symmetric before they rely on it:
// PairBalance, summed over every rank through the all_gather a setup does
// anyway (one uint64 per rank), is zero exactly when the two ends of every
// pair agree (up to a 64-bit hash collision). Where it is not zero (or T has
// no exchange), exchange_with_peers() falls back to an all_gather of every
// rank's blobs, which cannot hang on an asymmetric list and lets the caller
// name the disagreement.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <span>
#include <vector>

#include <fmt/format.h>

#include "../base/hash.hpp"
#include "blob.hpp"
#include "transport.hpp"

namespace reshard {

/// What one rank holds of the pairs it is in, as a sum that cancels over the
/// job: the sending end adds the hash of (sender, receiver, what), the
/// receiving end subtracts the same hash. The sum over all ranks is zero when
/// every item one end lists the other end lists too (a multiset, so two
/// identical sends need two receives).
struct PairBalance {
  std::uint64_t sum = 0;
  void add(bool sending_end, std::int64_t sender, std::int64_t receiver, std::initializer_list<std::uint64_t> what) {
    std::uint64_t h = hash_mix(hash_mix(0x5041495242414cull, static_cast<std::uint64_t>(sender)), static_cast<std::uint64_t>(receiver));
    for (auto v : what) h = hash_mix(h, v);
    sum += sending_end ? h : 0 - h;
  }
  /// The job's balance from every rank's sum.
  static bool balanced(std::span<const std::uint64_t> sums) {
    std::uint64_t s = 0;
    for (auto v : sums) s += v;
    return s == 0;
  }
};

/// Step one of a pairwise setup (a transport's prepare): every rank's status
/// (ok, or its error) and its PairBalance sum through one fixed-size
/// all_gather. Every rank reads the same blobs, so all throw alike: this
/// rank's own `error` first, else the first rank that failed ("{who}: prepare
/// failed on rank R: ..."). Returns whether the job's pairs balance (then
/// exchange_with_peers may go pairwise).
template <class T>
bool gather_setup_status(T& t, std::uint32_t magic, const std::string& who, const std::string& error, std::uint64_t balance,
                         Deadline deadline) {
  BlobWriter w;
  w.put(magic);
  w.put<std::uint8_t>(error.empty() ? 1 : 0);
  w.put_string(error);
  w.put(balance);
  const auto blobs = t.all_gather(w.buf, deadline);
  const auto world = t.world_ranks();
  std::vector<std::uint64_t> sums(blobs.size(), 1);
  for (std::size_t r = 0; r < blobs.size() && r < world.size(); ++r) {
    BlobReader rd(blobs[r], world[r], "prepare");
    std::string why;
    try {
      if (rd.get<std::uint32_t>() != magic)
        why = fmt::format("{}: rank {} sent a prepare blob of another kind", who, world[r]);
      else if (rd.get<std::uint8_t>() == 0)
        why = fmt::format("{}: prepare failed on rank {}: {}", who, world[r], rd.get_string());
      else
        (void)rd.get_string(), sums[r] = rd.get<std::uint64_t>();
    } catch (const std::exception& e) {
      why = e.what();
    }
    if (!why.empty()) throw TransportError(error.empty() ? why : error);
  }
  return PairBalance::balanced(sums);
}

/// Sends each out[i] to its peer and returns what this rank received, by
/// sender. With `symmetric` (the caller checked a PairBalance) and a T that
/// exchanges natively, that is exactly one blob from each listed peer, in
/// out's order. Otherwise every rank's blobs travel through one all_gather
/// and the result holds, in world order, every blob any rank addressed to
/// this one: a listed peer that addressed none is absent and an unlisted
/// sender present, for the caller to report. Collective over the world.
template <class T>
std::vector<PeerBlob> exchange_with_peers(T& t, std::span<const PeerBlob> out, bool symmetric, Deadline deadline) {
  std::vector<PeerBlob> got;
  if constexpr (ExchangingTransport<T>) {
    if (symmetric) {
      auto blobs = t.exchange(out, deadline);
      if (blobs.size() != out.size())
        throw TransportError(fmt::format("{} transport: exchange returned {} blobs for {} peers", t.name(), blobs.size(), out.size()));
      got.reserve(out.size());
      for (std::size_t i = 0; i < out.size(); ++i) got.push_back(PeerBlob{out[i].peer, std::move(blobs[i])});
      return got;
    }
  }
  BlobWriter mine;
  mine.put<std::uint64_t>(out.size());
  for (const auto& o : out) {
    mine.put<std::int64_t>(o.peer);
    mine.put_bytes(o.bytes.data(), o.bytes.size());
  }
  const auto all = t.all_gather(mine.buf, deadline);
  const auto world = t.world_ranks();
  for (std::size_t r = 0; r < all.size() && r < world.size(); ++r) {
    BlobReader rd(all[r], world[r], "pairwise exchange");
    for (auto n = rd.get<std::uint64_t>(); n > 0; --n) {
      const auto to = rd.get<std::int64_t>();
      const auto bytes = rd.get_bytes();
      if (to == t.rank()) got.push_back(PeerBlob{world[r], std::vector<std::byte>(bytes.begin(), bytes.end())});
    }
  }
  return got;
}

}  // namespace reshard
