// Setup moves O(peers) bytes per rank: Executor::setup sends each peer only
// its pairs' tables (transport.hpp "pairwise exchange"), after one
// fixed-size all_gather. Measured by counting the bytes each rank receives
// while a Resharder sets up, on the in-process world, with the transport's
// pairwise exchange and without it (the all_gather fallback), as the job
// grows with a fixed number of peers per rank.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "reshard/reshard.hpp"
#include "reshard/transport/peer_exchange.hpp"

namespace {

using reshard::Deadline;
using reshard::LocalTransport;

/// Counts the blob bytes a rank receives; `Native` keeps or hides the
/// local world's pairwise exchange (hidden: exchange_with_peers falls back
/// to an all_gather of every rank's tables).
template <bool Native>
class Counting : public reshard::ForwardingTransport<LocalTransport> {
  using Base = reshard::ForwardingTransport<LocalTransport>;

 public:
  Counting(LocalTransport t, std::int64_t& received, std::int64_t& exchanged) : Base(t), received_(&received), exchanged_(&exchanged) {}
  std::vector<std::vector<std::byte>> all_gather(std::span<const std::byte> blob, Deadline d) {
    auto got = Base::all_gather(blob, d);
    for (const auto& b : got) *received_ += static_cast<std::int64_t>(b.size());
    return got;
  }
  std::vector<std::vector<std::byte>> exchange(std::span<const reshard::PeerBlob> out, Deadline d)
    requires Native
  {
    auto got = Base::exchange(out, d);
    for (const auto& b : got) *received_ += static_cast<std::int64_t>(b.size()), *exchanged_ += static_cast<std::int64_t>(b.size());
    return got;
  }

 private:
  std::int64_t* received_;
  std::int64_t* exchanged_;  ///< of which through exchange()
};
static_assert(reshard::ExchangingTransport<Counting<true>>);
static_assert(!reshard::ExchangingTransport<Counting<false>>);

struct SetupBytes {
  std::int64_t max_received = 0;   ///< all blob bytes, the most any rank received
  double exchanged_per_peer = 0;   ///< pairwise-exchange bytes per peer, the most of any rank
  std::int64_t max_peers = 0;
};

/// Training dp=D x tp=2 (cut on dim 0) to inference dp=D x tp=2 (cut on dim
/// 1): 4*D ranks; sets up a Resharder on every rank and counts.
template <bool Native>
SetupBytes setup_bytes(int dp) {
  auto layout = [&](const char* dims, int first) {
    nlohmann::json j;
    j["mesh"]["axes"] = nlohmann::json::array({nlohmann::json::array({"dp", dp}), nlohmann::json::array({"tp", 2})});
    j["mesh"]["first_rank"] = first;
    for (int k = 0; k < 6; ++k)
      j["tensors"].push_back({{"name", fmt::format("w{}", k)}, {"shape", {256, 96}}, {"dtype", "f32"}, {"dims", nlohmann::json::parse(dims)}});
    return j;
  };
  const reshard::Layout train = reshard::parse_layout(layout(R"(["tp", null])", 0), "train");
  const reshard::Layout infer = reshard::parse_layout(layout(R"([null, "tp"])", 2 * dp), "infer");
  std::vector<std::int64_t> ranks(static_cast<std::size_t>(4 * dp));
  for (std::size_t i = 0; i < ranks.size(); ++i) ranks[i] = static_cast<std::int64_t>(i);
  reshard::LocalWorld world(ranks);
  std::vector<std::int64_t> received(ranks.size(), 0), exchanged(ranks.size(), 0), peers(ranks.size(), 0);
  world.run([&](LocalTransport& lt) {
    const auto r = static_cast<std::size_t>(lt.rank());
    Counting<Native> t(lt, received[r], exchanged[r]);
    std::vector<std::vector<float>> memory;
    reshard::LocalBuffers buffers;
    for (const auto& b : reshard::rank_buffers(train, lt.rank()))
      buffers.src[b.name] = reshard::view_of(memory.emplace_back(static_cast<std::size_t>(b.elements), 1.f).data(), b.elements);
    for (const auto& b : reshard::rank_buffers(infer, lt.rank()))
      buffers.dst[b.name] = reshard::view_of(memory.emplace_back(static_cast<std::size_t>(b.elements), 0.f).data(), b.elements);
    auto resharder = reshard::make_resharder(train, infer, buffers, t);
    const std::int64_t after_setup = received[r];
    std::vector<std::int64_t> talks;
    for (const auto& c : resharder.schedule().copies)
      if ((c.src_rank == lt.rank()) != (c.dst_rank == lt.rank())) talks.push_back(c.src_rank == lt.rank() ? c.dst_rank : c.src_rank);
    std::sort(talks.begin(), talks.end());
    peers[r] = std::unique(talks.begin(), talks.end()) - talks.begin();
    resharder.refit();  // the setup was a working one
    received[r] = after_setup;
  });
  SetupBytes out{*std::max_element(received.begin(), received.end()), 0, *std::max_element(peers.begin(), peers.end())};
  for (std::size_t r = 0; r < ranks.size(); ++r)
    if (peers[r] > 0) out.exchanged_per_peer = std::max(out.exchanged_per_peer, static_cast<double>(exchanged[r]) / static_cast<double>(peers[r]));
  return out;
}

}  // namespace

TEST_CASE("setup: the bytes a rank receives grow with its peers, not with the job") {
  const SetupBytes small = setup_bytes<true>(2), large = setup_bytes<true>(16);
  const SetupBytes small_all = setup_bytes<false>(2), large_all = setup_bytes<false>(16);
  MESSAGE(fmt::format("most bytes a rank received in setup: 8 ranks {} (all_gather fallback {}), 64 ranks {} (fallback {}); "
                      "peers per rank at most {} and {}; pairwise bytes per peer {:.1f} and {:.1f}",
                      small.max_received, small_all.max_received, large.max_received, large_all.max_received, small.max_peers,
                      large.max_peers, small.exchanged_per_peer, large.exchanged_per_peer));
  CHECK(small.exchanged_per_peer > 0);
  // The pairwise tables cost the same per peer whatever the job's size...
  CHECK(large.exchanged_per_peer <= 1.5 * small.exchanged_per_peer);
  // ...while the fallback hands every rank every rank's tables.
  CHECK(large_all.max_received > 5 * large.max_received);
  CHECK(large_all.max_received > 15 * small_all.max_received);
}
