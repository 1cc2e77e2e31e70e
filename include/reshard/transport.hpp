#pragma once
// The Transport concept: what a backend provides so the executor can run a
// schedule. One Transport object is one rank's endpoint (a process of a real
// job, a thread of the in-process backend). The executor only ever talks to
// its own endpoint; data reaches another rank only through post().
//
// A backend provides:
//
//  * identity: `rank()` (this endpoint's global rank) and `world_ranks()`
//    (every global rank of the job, both sides of the refit, in the order the
//    bootstrap reports blobs); `name()` for messages.
//
//  * memory registration: `register_memory(ptr, bytes, MemoryKind)` returns a
//    RegionHandle for a local range (host memory today; a UCX backend pins it
//    with ucp_mem_map and can pack its rkey, an NCCL backend takes device
//    memory, possibly ncclCommRegister'ed). `deregister_memory(handle)` ends
//    it. Every byte the executor moves lies in a registered region: the
//    weights themselves (zero-copy pieces) or the executor's staging.
//
//  * bootstrap: `all_gather(blob, deadline)` exchanges small blobs (message
//    tables, budgets, remote keys) among all world ranks and returns them in
//    world_ranks() order. Collective: every rank calls it the same number of
//    times. MPI_Allgather, a TCP store, or (in-process) a barrier.
//
//  * setup of a replayed program: `prepare(ops, deadline)`, collective, once
//    per program: every op this rank will post in each replay, in posting
//    order. Ops are persistent: each replay posts exactly these ops again (same
//    peers, tags, regions, offsets, sizes). A one-sided backend uses prepare to
//    exchange each receive's (address, rkey) with its sender over the
//    bootstrap, so that in a replay a send is ucp_put_nbx straight into the
//    receiver's memory followed by a completion flag (a counter per replay),
//    and a receive is a wait on that flag. A two-sided backend may ignore it.
//
//  * data movement: `post(ops)` starts a group of sends and receives of
//    contiguous byte ranges and returns a `request` for the whole group (NCCL:
//    one ncclGroupStart/ncclGroupEnd on the stream plus an event; UCX: tagged
//    sends/receives or puts). A send (peer, tag) matches the receive of the
//    same tag that the peer posted for this rank; equal (peer, tag) pairs match
//    in posting order (so replays need no epoch in the tag). Sizes must agree,
//    else both sides fail. The executor posts the ops of one peer pair in
//    increasing tag order on both sides, so an ordered transport (NCCL) may
//    match by order alone.
//
//  * completion with a deadline: `test(request)` never blocks;
//    `wait(request, deadline)` and `wait_any(requests, deadline)` block (no
//    spinning forever: they sleep or progress, and throw TransportError at the
//    deadline naming what is still pending). A failed operation throws from
//    the wait that observes it; a failure never reads as completion.
//
//  * `abort(reason)`: tells every rank that this one gave up, so their waits
//    fail promptly instead of at the deadline.
//
// Use check_transport<T>() (or the executor, which calls it) to get one
// readable static_assert per missing piece instead of a concept backtrace.
#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "error.hpp"

namespace reshard {

using Clock = std::chrono::steady_clock;
using Deadline = Clock::time_point;

/// Where a registered range lives.
enum class MemoryKind : std::uint8_t { host, device };

/// A registered local range, as the backend numbers it.
struct RegionHandle {
  std::uint32_t id = UINT32_MAX;
  bool valid() const { return id != UINT32_MAX; }
  friend bool operator==(const RegionHandle&, const RegionHandle&) = default;
};

enum class OpKind : std::uint8_t { send, recv };

/// One contiguous byte range to send to, or receive from, a peer.
struct TransferOp {
  OpKind kind = OpKind::send;
  std::int64_t peer = -1;    ///< global rank of the other side
  std::uint64_t tag = 0;     ///< matches the peer's op of the other kind
  RegionHandle region;       ///< local registered memory
  std::uint64_t offset = 0;  ///< byte offset in the region
  std::uint64_t bytes = 0;
};

/// A transport operation failed: timeout, abort, size mismatch, bad region.
class TransportError : public Error {
 public:
  explicit TransportError(const std::string& what) : Error(what) {}
};

template <class T>
concept Transport = requires(T& t, const T& ct, void* p, std::size_t n, MemoryKind kind, RegionHandle region,
                             std::span<const TransferOp> ops, std::span<const std::byte> blob, Deadline deadline,
                             std::string_view why) {
  typename T::request;
  { ct.rank() } -> std::convertible_to<std::int64_t>;
  { ct.world_ranks() } -> std::convertible_to<std::span<const std::int64_t>>;
  { ct.name() } -> std::convertible_to<std::string_view>;
  { t.register_memory(p, n, kind) } -> std::same_as<RegionHandle>;
  { t.deregister_memory(region) } -> std::same_as<void>;
  { t.all_gather(blob, deadline) } -> std::same_as<std::vector<std::vector<std::byte>>>;
  { t.prepare(ops, deadline) } -> std::same_as<void>;
  { t.post(ops) } -> std::same_as<typename T::request>;
  requires requires(typename T::request& r, std::span<typename T::request* const> rs) {
    { t.test(r) } -> std::same_as<bool>;
    { t.wait(r, deadline) } -> std::same_as<void>;
    { t.wait_any(rs, deadline) } -> std::same_as<std::size_t>;
  };
  { t.abort(why) } noexcept;
};

namespace detail {
template <class T>
concept has_request = requires { typename T::request; };
}  // namespace detail

/// One static_assert per missing member, in words; true when T models
/// Transport. Call as `static_assert(check_transport<T>());`.
template <class T>
consteval bool check_transport() {
  static_assert(detail::has_request<T>,
                "reshard: a Transport needs a nested type `request`: the completion handle post() returns");
  static_assert(requires(const T& t) {
    { t.rank() } -> std::convertible_to<std::int64_t>;
  }, "reshard: a Transport needs `std::int64_t rank() const`: this endpoint's global rank");
  static_assert(requires(const T& t) {
    { t.world_ranks() } -> std::convertible_to<std::span<const std::int64_t>>;
  }, "reshard: a Transport needs `std::span<const std::int64_t> world_ranks() const`: every rank of the job");
  static_assert(requires(const T& t) {
    { t.name() } -> std::convertible_to<std::string_view>;
  }, "reshard: a Transport needs `std::string_view name() const` (e.g. \"local\", \"ucx\")");
  static_assert(requires(T& t, void* p, std::size_t n, MemoryKind k) {
    { t.register_memory(p, n, k) } -> std::same_as<RegionHandle>;
  }, "reshard: a Transport needs `RegionHandle register_memory(void*, std::size_t bytes, MemoryKind)`");
  static_assert(requires(T& t, RegionHandle r) {
    { t.deregister_memory(r) } -> std::same_as<void>;
  }, "reshard: a Transport needs `void deregister_memory(RegionHandle)`");
  static_assert(requires(T& t, std::span<const std::byte> b, Deadline d) {
    { t.all_gather(b, d) } -> std::same_as<std::vector<std::vector<std::byte>>>;
  }, "reshard: a Transport needs the bootstrap `std::vector<std::vector<std::byte>> all_gather(std::span<const "
     "std::byte>, Deadline)`");
  static_assert(requires(T& t, std::span<const TransferOp> ops, Deadline d) {
    { t.prepare(ops, d) } -> std::same_as<void>;
  }, "reshard: a Transport needs `void prepare(std::span<const TransferOp>, Deadline)` (may do nothing)");
  if constexpr (detail::has_request<T>) {
    static_assert(requires(T& t, std::span<const TransferOp> ops) {
      { t.post(ops) } -> std::same_as<typename T::request>;
    }, "reshard: a Transport needs `request post(std::span<const TransferOp>)`: start a group of sends/receives");
    static_assert(requires(T& t, typename T::request& r) {
      { t.test(r) } -> std::same_as<bool>;
    }, "reshard: a Transport needs `bool test(request&)`: has the group completed (never blocks)");
    static_assert(requires(T& t, typename T::request& r, Deadline d) {
      { t.wait(r, d) } -> std::same_as<void>;
    }, "reshard: a Transport needs `void wait(request&, Deadline)`: block until done, throw at the deadline");
    static_assert(requires(T& t, std::span<typename T::request* const> rs, Deadline d) {
      { t.wait_any(rs, d) } -> std::same_as<std::size_t>;
    }, "reshard: a Transport needs `std::size_t wait_any(std::span<request* const>, Deadline)`: index of a "
       "completed group");
  }
  static_assert(requires(T& t, std::string_view why) {
    { t.abort(why) } noexcept;
  }, "reshard: a Transport needs `void abort(std::string_view reason) noexcept`: fail every rank's waits");
  return Transport<T>;
}

}  // namespace reshard
