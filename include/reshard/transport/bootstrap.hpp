#pragma once
// Bootstrap: how the processes of a job exchange small blobs (worker
// addresses, remote keys, message tables) before and around a refit. A
// networked transport takes one; it never needs MPI itself.
//
//   // an engine with its own store or torch.distributed:
//   auto boot = reshard::make_bootstrap(my_rank, all_ranks,
//       [&](std::span<const std::byte> mine) { return my_all_gather(mine); });
//   // under mpirun: reshard::mpi_bootstrap() (mpi_bootstrap.hpp)
//
// all_gather is collective: every rank calls it the same number of times and
// gets every rank's blob, in `ranks` order. A function that takes a Deadline
// must give up (throw) when it passes; one that takes an Idle callback should
// call it now and then while it waits, so the transport can progress its own
// network (and notice a peer that gave up) meanwhile. Idle may throw; the
// all-gather must let that exception through.
//
// Optionally a bootstrap also has a notice board (a key-value store every
// rank reads and writes at any time, such as torch.distributed's TCPStore):
// a transport that cannot tell its peers by itself that it gave up (NCCL
// over NVLink: a peer's abort never shows in the others' waits) posts its
// reason there, and its peers, polling the board while they wait, fail
// within a poll interval naming it instead of waiting out their deadline.
#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "../base/error.hpp"
#include "transport.hpp"

namespace reshard {

using Blobs = std::vector<std::vector<std::byte>>;

/// An out-of-band notice board: `post(key, text)` stores text under key
/// unless the key already holds one (the first post wins: a TCPStore's
/// compare_set(key, "", text)); `read(key)` returns what the key holds, or
/// nothing. Both must return promptly (read is called every ~100 ms while a
/// rank waits) and may throw; a failed read counts as nothing posted.
struct NoticeBoard {
  std::function<void(const std::string& key, const std::string& text)> post;
  std::function<std::optional<std::string>(const std::string& key)> read;
  bool valid() const { return post && read; }
};

struct Bootstrap {
  using Idle = std::function<void()>;
  using AllGather = std::function<Blobs(std::span<const std::byte> mine, Deadline deadline, const Idle& idle)>;

  std::int64_t rank = -1;            ///< this process's global rank
  std::vector<std::int64_t> ranks;   ///< every global rank of the job, in blob order
  AllGather all_gather;
  std::string name = "caller";       ///< for messages ("mpi", "caller", ...)
  NoticeBoard board;                 ///< optional: out-of-band aborts (above)

  /// Throws unless the rank list is usable (rank in it, no duplicates, a function).
  void validate() const {
    if (!all_gather) fail("bootstrap '{}': no all-gather function", name);
    if (static_cast<bool>(board.post) != static_cast<bool>(board.read))
      fail("bootstrap '{}': the notice board needs both post and read (or neither)", name);
    if (ranks.empty()) fail("bootstrap '{}': the rank list is empty", name);
    std::vector<std::int64_t> s = ranks;
    std::sort(s.begin(), s.end());
    if (std::adjacent_find(s.begin(), s.end()) != s.end()) fail("bootstrap '{}': a rank appears twice in the rank list", name);
    if (s.front() < 0) fail("bootstrap '{}': rank {} is negative", name, s.front());
    if (std::find(ranks.begin(), ranks.end(), rank) == ranks.end())
      fail("bootstrap '{}': this process's rank {} is not in the rank list", name, rank);
  }
};

/// A bootstrap from a caller's all-gather, given as any of
///   Blobs f(std::span<const std::byte> mine)
///   Blobs f(std::span<const std::byte> mine, Deadline)
///   Blobs f(std::span<const std::byte> mine, Deadline, const Bootstrap::Idle&)
/// (std::vector<std::vector<std::byte>> for Blobs). The first form cannot
/// time out: a dead peer hangs it unless the caller's store notices.
template <class F>
Bootstrap make_bootstrap(std::int64_t rank, std::vector<std::int64_t> ranks, F all_gather, std::string name = "caller") {
  Bootstrap b;
  b.rank = rank;
  b.ranks = std::move(ranks);
  b.name = std::move(name);
  if constexpr (std::is_invocable_r_v<Blobs, F&, std::span<const std::byte>, Deadline, const Bootstrap::Idle&>) {
    b.all_gather = std::move(all_gather);
  } else if constexpr (std::is_invocable_r_v<Blobs, F&, std::span<const std::byte>, Deadline>) {
    b.all_gather = [f = std::move(all_gather)](std::span<const std::byte> mine, Deadline d, const Bootstrap::Idle&) mutable {
      return f(mine, d);
    };
  } else {
    static_assert(std::is_invocable_r_v<Blobs, F&, std::span<const std::byte>>,
                  "reshard::make_bootstrap: the all-gather must be callable as f(std::span<const std::byte>) [, Deadline "
                  "[, const Bootstrap::Idle&]] and return std::vector<std::vector<std::byte>> (every rank's blob, in rank-list "
                  "order)");
    b.all_gather = [f = std::move(all_gather)](std::span<const std::byte> mine, Deadline, const Bootstrap::Idle&) mutable {
      return f(mine);
    };
  }
  b.validate();
  return b;
}

}  // namespace reshard
