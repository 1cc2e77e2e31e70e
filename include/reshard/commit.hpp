#pragma once
// Committing a refit: every rank learns whether every rank's refit succeeded.
//
// A refit is collective, but each rank's executor run returns as soon as its
// own sends and receives are done: a rank that exchanged nothing with a peer
// that died (or gave up) would report success while the refit as a whole did
// not happen. Resharder::refit() now closes that hole itself (one bootstrap
// all-gather of verdicts after every refit, see resharder.hpp), so success is
// decided in one place. This header keeps:
//
//   agree_refit(t, local_error, deadline)   the verdict exchange on its own, for
//                                           callers that drive an Executor directly
//   refit_and_agree(resharder, transport)   = resharder.refit() (kept for callers;
//                                           throws RefitNotCommitted)
//
// Works with any reshard::Transport (its all_gather is the bootstrap).
#include <chrono>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "resharder.hpp"
#include "transport.hpp"

namespace reshard {

/// After a refit (or its failure: `local_error` non-empty) on every rank:
/// returns only if all ranks succeeded; otherwise throws RefitNotCommitted
/// with the first failure (a rank that failed, a dead peer, an aborted
/// transport, a bootstrap that timed out).
template <class T>
void agree_refit(T& t, const std::string& local_error, Deadline deadline) {
  static_assert(check_transport<T>());
  // Blob: one byte ok, then the error text.
  std::vector<std::byte> mine(1 + local_error.size());
  mine[0] = std::byte{static_cast<unsigned char>(local_error.empty() ? 1 : 0)};
  std::memcpy(mine.data() + 1, local_error.data(), local_error.size());
  std::vector<std::vector<std::byte>> blobs;
  try {
    blobs = t.all_gather(mine, deadline);
  } catch (const std::exception& e) {
    throw RefitNotCommitted(fmt::format("rank {}: refit not committed, destination not updated: {}{}", t.rank(),
                                        local_error.empty() ? "" : local_error + "; then ", e.what()));
  }
  const auto world = t.world_ranks();
  for (std::size_t i = 0; i < blobs.size(); ++i) {
    const auto& b = blobs[i];
    if (b.empty())
      throw RefitNotCommitted(fmt::format("rank {}: refit not committed: rank {} sent an empty verdict", t.rank(), world[i]));
    if (b[0] != std::byte{1})
      throw RefitNotCommitted(fmt::format("rank {}: refit not committed, destination not updated: rank {} failed: {}", t.rank(), world[i],
                                          std::string(reinterpret_cast<const char*>(b.data() + 1), b.size() - 1)));
  }
}

/// Resharder::refit(), which agrees with every rank before it returns. The
/// timeout is not used: the agreement has the executor's timeout.
template <class L, class T>
RefitReport refit_and_agree(Resharder<L, T>& r, T& t, std::chrono::milliseconds timeout = std::chrono::seconds(30)) {
  static_cast<void>(t);
  static_cast<void>(timeout);
  return r.refit();
}

}  // namespace reshard
