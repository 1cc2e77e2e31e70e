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
//   agree_refit(t, local_error, deadline)   the same verdict exchange on its own,
//                                           for callers that drive an Executor directly
//
// Works with any reshard::Transport (its all_gather is the bootstrap).
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "resharder.hpp"
#include "transport/transport.hpp"

namespace reshard {

/// After a refit (or its failure: `local_error` non-empty) on every rank:
/// returns only if all ranks succeeded; otherwise throws RefitNotCommitted
/// with the first failure (a rank that failed, a dead peer, an aborted
/// transport, a bootstrap that timed out).
template <class T>
void agree_refit(T& t, const std::string& local_error, Deadline deadline) {
  static_assert(check_transport<T>());
  // The Resharder's own verdict exchange, without a version to compare.
  const auto v = resharder_detail::exchange_verdicts(t, local_error, 0, deadline);
  if (!v.error.empty())
    throw RefitNotCommitted(fmt::format("rank {}: refit not committed: {}{}", t.rank(),
                                        local_error.empty() ? "" : local_error + "; then ", v.error));
  if (!v.failed.empty())
    throw RefitNotCommitted(fmt::format("rank {}: refit not committed: {}", t.rank(), v.first));
}

}  // namespace reshard
