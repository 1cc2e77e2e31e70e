#pragma once
// The Transport concept: what a backend provides so the executor can run a
// schedule. One Transport object is one rank's endpoint (a process of a real
// job, a thread of the in-process backend). The executor only ever talks to
// its own endpoint; data reaches another rank only through post().
//
// This comment is the whole contract: a third party can implement a backend
// from it alone, and tests/transport_conformance.hpp checks one (see "The
// conformance suite" at the end). "The executor" below is executor.hpp as it
// is today; a transport may do more than it relies on, never less.
//
// Members
// -------
//  * identity: `rank()` (this endpoint's global rank) and `world_ranks()`
//    (every global rank of the job, both sides of the refit, in the order the
//    bootstrap reports blobs); `name()` for messages.
//
//  * memory registration: `register_memory(ptr, bytes, MemoryKind)` returns a
//    RegionHandle for a local range (host memory today; a UCX backend pins it
//    with ucp_mem_map and can pack its rkey, an NCCL backend takes device
//    memory, possibly ncclCommRegister'ed). `deregister_memory(handle)` ends
//    it. Every byte the executor moves lies in a registered region: the
//    weights themselves (zero-copy pieces) or the executor's staging. The
//    executor registers in setup and deregisters when it is set up again or
//    destroyed, never while one of its runs is in flight. It holds each
//    registration as a RegisteredRegion (below: RAII, move-only). A failed
//    run drops its requests unwaited (see "Requests"), so a deregistration
//    may find ops still pending on the region, and the caller frees the
//    memory right after: once deregister_memory returns, the transport never
//    reads or writes the region again. It cancels what is pending there and
//    waits (bounded) for copies, receives or puts already running into it
//    (UCX: tagged receives cancelled; put senders revoked, each answering once
//    its puts landed; sends out of it given a moment, then the endpoints to
//    the peers they still go to closed by force, those peers failed from then
//    on; local: queued copy tasks dropped, running ones waited for); a peer's
//    op matched with one cancelled fails (local, UCX puts).
//
//  * lifetime (optional): `Lifetime lifetime() const` watches this endpoint
//    object and whatever holds its registrations (a world, an inner
//    transport); it expires once any of them is destroyed. Destroying an
//    endpoint releases every registration it still holds. With it, a
//    RegisteredRegion (so an executor or a Resharder) may outlive the
//    transport it was registered on: it no longer calls it. Without it, the
//    transport must outlive every registration made on it. Keep a
//    LifetimeToken member and return Lifetime(token) (a decorator adds its
//    inner's lifetime()).
//
//  * bootstrap: `all_gather(blob, deadline)` exchanges small blobs (message
//    tables, budgets, remote keys, commit verdicts) among all world ranks and
//    returns them in world_ranks() order (blob i is world_ranks()[i]'s; an
//    empty blob stays empty). Collective: every rank calls it the same number
//    of times. MPI_Allgather, a TCP store, or (in-process) a barrier.
//
//  * pairwise exchange (optional): `exchange(out, deadline)` sends each
//    PeerBlob out[i] to rank out[i].peer and returns, in out's order, the
//    blob out[i].peer addressed to this rank in its matching call, so that a
//    setup moves O(peers) bytes per rank (an all_gather of per-pair tables
//    moves O(job)); each peer at most once in `out`, never this rank. Every
//    world rank calls it the same number of times (an empty `out` when it
//    has no peers); the k-th calls of two ranks pair up.
//    The lists must be symmetric (A lists B exactly when B lists A; callers
//    check that first, peer_exchange.hpp's PairBalance): a rank waits for each
//    listed peer until the deadline and then throws TransportError naming
//    those it did not hear from; after abort() it throws at once, and a dead
//    or aborting peer fails it as it fails a wait. The blobs are copied before
//    it returns. Without it, exchange_with_peers() (peer_exchange.hpp) sends
//    the same through one all_gather.
//
//  * setup of a replayed program: `prepare(ops, deadline)`, collective (every
//    world rank calls it, with an empty span if it has no ops), once per
//    executor setup (a setup that fails earlier fails on every rank before
//    it), so several times over one transport's life (one call per executor:
//    double-buffered and staged refits set up several). `ops` is
//    every op this rank will post in each replay, in posting order. Ops are
//    persistent: each replay posts exactly these ops again (same kind, peer,
//    tag, region, offset, bytes), each op once per replay, and never posts a
//    prepared op again before its previous post completed. A one-sided
//    backend uses prepare to exchange each receive's (address, rkey) with its
//    sender over the bootstrap; a tag-mapping backend gives each op a wire id
//    here (UCX does both); a two-sided backend may ignore it. A backend may
//    refuse, in post(), an op that was not prepared (UCX does); it may also
//    accept it (the local one does; the fault injector's `duplicate` needs it).
//
//  * data movement: `post(ops)` hands the transport a group of sends and
//    receives of contiguous byte ranges and returns a `request` for the
//    whole group. `flush(deadline)` (optional, see "Batches") starts
//    everything posted since the last flush as one batch.
//
//  * completion: `test(request)`, `wait(request, deadline)`,
//    `wait_any(requests, deadline)`; and `abort(reason)`.
//
// How the executor posts (executor.hpp, Executor::start_wave)
// ------------------------------------------------------------
// A run is a sequence of waves. For each wave, on each rank, in this order:
//   1. one post() per peer with every receive from that peer in the wave
//      (data receives in tag order, then the wave's checksum control
//      receive when checksums are on);
//   2. one post() with all the wave's zero-copy sends (several peers);
//   3. per peer: the packed sends are packed (CPU or device copies, no
//      transport call in between), then one post() of that peer's packed
//      sends, in tag order;
//   4. with checksums, one post() of the wave's control sends (several peers);
//   5. one flush(deadline): the wave is one batch.
// So receives are posted before sends on one rank, but no single post()
// holds both a send and its matching receive, nothing orders the ranks
// against each other (a peer's send may be posted long before this rank's
// receive, or after it), and ops of several peers share a post(). A peer
// pair's ops of one wave are in the same wave (the same batch index) on both
// ranks. Then the executor waits: the receive requests with wait_any (wait
// when one is left), unpacking each group as it completes, then the send
// requests one by one with wait, in posting order. With
// ExecutorOptions::pipeline = 2 the next wave's posts and flush (1-5) come
// before this wave's waits, so two waves (two batches) are live at once and
// wave w+1 is packed while wave w moves; the first wave's local copies run
// between the posts and the first wait. The executor never calls test().
// Every op is posted to a peer other than rank(): copies within a rank never
// reach the transport. A wave holds, per peer and direction, the pair's
// bucket message and its in-place messages; ExecutorOptions::
// max_direct_messages bounds the latter (0, the default: no bound), for a
// transport whose batch cost grows with its op count.
//
// Batches and starting work
// -------------------------
// `void flush(Deadline)` is optional (the executor calls it through
// flush_batch(), a no-op for a transport without one; check_transport()
// reports a `flush` of another signature). A transport has it when it needs
// both sides' ops of a peer pair in one batch: NCCL p2p or torch's
// batch_isend_irecv, whose batch blocks a stream until the peer's batch
// arrives. Such a transport queues in post() and launches, at flush, all
// that is queued as one batch (NCCL: one ncclGroupStart/End); batches of one
// endpoint may run in order (a stream), and a batch's requests may complete
// only together. Launching each post() as its own batch deadlocks: rank A's
// batch of receives from B blocks A's stream before A's sends to B launch,
// and B's does the same. What flush() must guarantee: the batch completes
// with no further post() or flush() from this rank (only its waits), and the
// deadline bounds any blocking in flush itself (it must not wait for the
// peers' batches to complete, only, at most, for them to join).
//
// Without a flush, or for ops posted after the last flush (the conformance
// suite's cases and a decorator's late posts do that), a transport may still
// defer: it may make progress only inside its own calls (UCX is
// single-threaded and progresses in post/test/wait) and may defer starting
// what post() was given until its next call. But a wait must not depend on
// work this rank has not started: when it defers, its next
// test()/wait()/wait_any() must start EVERYTHING posted and not yet started,
// not only the request asked about (launching only the waited-on request
// deadlocks the same way: A and B each wait for receives whose sends neither
// started). post() itself must never block on a peer.
//
// Bounded batches
// ---------------
// `std::int64_t max_batch_ops() const` is optional too (concept
// BoundedBatchTransport): a batching transport whose batch misbehaves past
// some size says so (NCCL splits a group larger than its limits into kernel
// plans, each rank from its own op list, so a send and its receive can land
// in different plans and hang). The executor then puts at most that many ops
// of a rank into one wave, both ends of every pair agreeing on the wave of
// each message (exec/batch_cap.hpp; ExecutorOptions::max_batch_ops overrides
// it). A flush may still be handed more (a caller that does not bound its
// posts): the transport must then split the batch itself into sub-batches
// both ends of every pair cut alike (NcclTransport: by round, see nccl.hpp),
// never by its own op count.
//
// Device streams
// --------------
// `void* device_stream()` is optional too (concept DeviceStreamTransport).
// A transport has it when the work of a flushed batch runs on a device
// stream (NCCL: a cudaStream_t) rather than on the host. What it promises:
// a batch flushed after work was enqueued on that stream runs after that
// work, and its requests complete when the stream has executed it. With
// device buffers the executor then orders everything on the device: before
// a wave's flush it makes the stream wait for the wave's pack (an event of
// the copy stream), and the copy stream waits for the stream (an event
// recorded just after the flush) before unpacking; it waits for the
// requests on the host only once, at the end of a refit. A transport
// without it is host-driven: its post() may read the bytes at once, so the
// executor waits on the host for each wave's pack before posting it.
//
// Matching and ordering
// ---------------------
// A send to peer P with tag t matches the receive of tag t that P posted
// with this rank as its peer: the key is (sender, receiver, tag), so a send
// to P and a receive from P with the same tag are unrelated. Equal keys match
// in posting order, across post() calls: the k-th send of a key meets the
// k-th receive of it. That is what lets a replay reuse its tags without an
// epoch (a fast sender's replay r+1 must not meet a slow receiver's replay r
// receive out of turn). Within one run of one executor no key is posted
// twice; executors that share a transport and may overlap in time use
// distinct channels (ExecutorOptions::channel), hence distinct tags. Sizes must agree: a send of n bytes meets a receive of exactly n
// bytes, else BOTH sides fail with a TransportError (at prepare(), post() or
// the wait that observes it; never a truncation, never a silent success).
// 0-byte ops are legal and match like any other. Both ends post each peer
// pair's ops in the same relative order (per wave: data messages in increasing
// tag order, then the control message), so an ordered transport (NCCL) may
// match by order alone, checking sizes and tags at prepare().
//
// Tags: 64 bits, and the executor uses them all
// -------------------------------------------
// Data message: tag = channel << 48 | k, k the message's index in its peer
// pair's stream (0, 1, ...). Checksum control message: tag = channel << 48 |
// 1 << 47 (kChecksumTagBit) | wave. channel is ExecutorOptions::channel (16
// bits; executors sharing a transport and overlapping in time use distinct
// channels). So with channel 0 and no checksums, tags are small (below the
// number of messages of one peer pair); otherwise bits 47..63 are set. A
// transport whose native tag is narrower (32-bit tags; MPI guarantees only
// MPI_TAG_UB >= 32767; NCCL has none) must not truncate, or channels and
// control messages would collide. It can (a) match by order per peer pair as
// above, or (b) map each prepared (peer, tag) to a dense wire id at prepare()
// (UCX's wire tag is the receive's id, not the executor's tag); a transport
// that passes tags through unmapped supports only channel 0 without
// checksums (and < 2^32 messages per peer pair): a limitation it must state.
//
// Lifetimes: what the transport must copy
// ---------------------------------------
//  * The `ops` span of post() and prepare() and the `blob` of all_gather()
//    are valid only during the call: copy what you need before returning.
//    (The executor's prepare() list is a temporary; the fault injector posts
//    from a local vector.)
//  * The bytes the ops name are the caller's until the request completes: the
//    caller does not write a send's range or read a receive's range before
//    then, and keeps the region registered.
//  * Completion means: of a send, the transport no longer reads its range (the
//    executor repacks reused staging right after); of a receive, the bytes are
//    in place and visible to the caller.
//
// Requests
// --------
//  * `request` must be move-constructible and move-assignable: the executor
//    keeps requests in std::vector and erases from the middle. It never
//    copies one (the backends here are shared_ptr handles, so copyable too).
//  * The executor waits each request until it completes, once, then drops
//    it. A transport must still allow test()/wait() on a request that
//    already completed (true / return at once; a failed one throws again):
//    FaultInjectingTransport tests its inner requests over and over.
//  * On any failure the executor destroys its pending requests unwaited and
//    then calls abort(). Destroying a pending request must be safe (no
//    block, no crash, no effect on other requests).
//  * A request belongs to its endpoint; one thread uses an endpoint at a
//    time (abort() included, for the executor).
//
// Completion and deadlines
// ------------------------
//  * `test(request)` never blocks (it may progress the network); it returns
//    whether the group completed.
//  * `wait(request, deadline)` blocks until the group completed;
//    `wait_any(requests, deadline)` (never empty) until one of them did, and
//    returns its index (any one if several). Both sleep or progress (no
//    spinning forever) and throw TransportError at the deadline (soon after
//    it, never long after), naming what is still pending, with each op's
//    peer rank and its tag in hex ({:#x}), which the executor maps back to
//    tensors. A peer that is merely late is waited for until the deadline;
//    a wait may fail earlier only for a reason (a failed op or peer, an
//    abort, UCX's stall_timeout: nothing moved for that long). A request
//    that already completed waits successfully even past its deadline.
//  * The executor gives every wait of a run the same deadline (start of run +
//    ExecutorOptions::timeout), and setup's all_gather/prepare the setup's.
//  * A failed op (size mismatch, dead peer, abort) throws TransportError from
//    the test/wait/wait_any that observes its group; a failure never reads as
//    completion.
//
// Abort
// -----
// `abort(reason) noexcept` tells every rank that this one gave up. On this
// endpoint, from then on post() and all_gather() throw TransportError (with
// the reason) at once, and so does every test/wait/wait_any on a request
// that has not completed. On the other ranks, their
// pending and later waits and all_gathers throw TransportError promptly (UCX:
// within its abort message's flight; bounded, not at their deadline), naming
// the reason where the backend can carry it (NCCL cannot: its peers see a
// remote error or their deadline). In particular all_gather after an abort
// does not exchange anything: it throws, on the aborting rank at once and on
// the others once they heard; the Resharder's commit (every rank's verdict
// through all_gather) relies on that to report "not committed" instead of
// hanging. A backend that cannot reach the peers by itself (NCCL) may
// instead carry the abort through the bootstrap: its next all_gather joins
// the exchange with the reason in place of the blob (bounded by that
// all_gather's deadline) and then throws; the peers' all_gather throws on
// it, naming the rank. Aborting twice is harmless. An aborted transport stays
// unusable: make a new one.
//
// A peer that dies (a killed process, a rank thread that ends by an
// exception) without calling abort() must fail the others in bounded time
// as well, naming it: UCX through its endpoints' error handling (at once) or
// its stall timeout (20 s); the local world by noticing the thread's end;
// MPI (without fault tolerance) only through mpirun ending the job; NCCL
// only through its own remote-error reporting or the deadline.
//
// The conformance suite
// ---------------------
// tests/transport_conformance.hpp checks the above on any Transport given a
// harness that runs one body per rank (threads, forked processes, mpirun):
// matching by (peer, tag) with 64-bit tags, order of equal keys, size
// mismatch failing both sides, deadlines (bounded, naming the pending op),
// test() not blocking, abort reaching the peers promptly, many replays of
// prepared ops, wait_any, the executor's flushed batches (two waves live,
// ranks skewed, nothing posted after the last flush), and all_gather's
// order. tests/queue_transport.hpp (in-process queues; also in a batching
// mode that behaves like NCCL: a batch blocks its rank's stream until all
// of it matched) and tests/mpi/mpi_transport.hpp (MPI_Isend/Irecv, 32-bit
// wire tags mapped at prepare) are backends written from this comment
// alone.
//
// Use check_transport<T>() (or the executor, which calls it) to get one
// readable static_assert per missing piece instead of a concept backtrace.
#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "../base/error.hpp"

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

/// What one transport object is alive for: the token expires when the
/// object holding it is destroyed, or assigned over (it may then stand for
/// another endpoint). A copy or a move is another object and gets its own.
class LifetimeToken {
 public:
  LifetimeToken() = default;
  LifetimeToken(const LifetimeToken&) {}  // a fresh token: not the source's
  LifetimeToken& operator=(const LifetimeToken&) {
    alive_ = std::make_shared<const char>('\0');  // what was registered through the old identity is not ours to call
    return *this;
  }
  std::weak_ptr<const void> watch() const { return alive_; }

 private:
  std::shared_ptr<const char> alive_ = std::make_shared<const char>('\0');
};

/// The objects a registration needs alive to be deregistered: the endpoint
/// it calls and what holds the registrations behind it. Expired once any is
/// gone.
class Lifetime {
 public:
  Lifetime() = default;
  explicit Lifetime(const LifetimeToken& t) { add(t); }
  Lifetime& add(const LifetimeToken& t) {
    watched_.push_back(t.watch());
    return *this;
  }
  Lifetime& add(const Lifetime& other) {
    watched_.insert(watched_.end(), other.watched_.begin(), other.watched_.end());
    return *this;
  }
  bool expired() const {
    for (const auto& w : watched_)
      if (w.expired()) return true;
    return false;
  }

 private:
  std::vector<std::weak_ptr<const void>> watched_;
};

/// A transport that says when it is gone (see "lifetime" above).
template <class T>
concept LifetimeTransport = requires(const T& t) {
  { t.lifetime() } -> std::same_as<Lifetime>;
};

/// One registered range, owned: deregistered when reset, assigned over or
/// destroyed (RAII, move-only). Over a LifetimeTransport it cannot outlive
/// its transport: once the transport is gone (and with it every registration
/// it held) it never calls it again. Over any other, the transport must
/// outlive it.
template <class T>
class RegisteredRegion {
 public:
  RegisteredRegion() = default;
  /// Registers [p, p + bytes) on t (throws what register_memory throws).
  RegisteredRegion(T& t, void* p, std::size_t bytes, MemoryKind kind) {
    if constexpr (LifetimeTransport<T>) life_ = t.lifetime();
    h_ = t.register_memory(p, bytes, kind);
    t_ = &t;
  }
  RegisteredRegion(RegisteredRegion&& o) noexcept
      : t_(std::exchange(o.t_, nullptr)), h_(std::exchange(o.h_, RegionHandle{})), life_(std::move(o.life_)) {}
  RegisteredRegion& operator=(RegisteredRegion&& o) noexcept {
    if (this != &o) {
      reset();
      t_ = std::exchange(o.t_, nullptr);
      h_ = std::exchange(o.h_, RegionHandle{});
      life_ = std::move(o.life_);
    }
    return *this;
  }
  RegisteredRegion(const RegisteredRegion&) = delete;
  RegisteredRegion& operator=(const RegisteredRegion&) = delete;
  ~RegisteredRegion() { reset(); }

  /// The handle ops name (invalid when empty).
  RegionHandle handle() const { return h_; }
  bool valid() const { return h_.valid(); }
  /// Is the transport it was registered on gone (destroyed, or an endpoint
  /// object assigned over)? Never true over a transport without lifetime().
  bool transport_gone() const {
    if constexpr (LifetimeTransport<T>)
      return life_.expired();
    else
      return false;
  }
  /// Deregisters now (when the transport is still there) and empties.
  void reset() noexcept {
    if (t_ && h_.valid() && !transport_gone()) {
      try {
        t_->deregister_memory(h_);
      } catch (...) {
        // A transport that fails to deregister (an aborted one) leaves nothing to undo here.
      }
    }
    t_ = nullptr;
    h_ = RegionHandle{};
    life_ = Lifetime{};
  }

 private:
  T* t_ = nullptr;
  RegionHandle h_;
  Lifetime life_;
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

/// One blob addressed to (or received from) one peer: the pairwise exchange.
struct PeerBlob {
  std::int64_t peer = -1;
  std::vector<std::byte> bytes;
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
  requires std::is_move_constructible_v<typename T::request> && std::is_move_assignable_v<typename T::request>;
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

/// A transport with its own pairwise exchange (see "pairwise exchange" above).
template <class T>
concept ExchangingTransport = requires(T& t, std::span<const PeerBlob> out, Deadline d) {
  { t.exchange(out, d) } -> std::same_as<std::vector<std::vector<std::byte>>>;
};

/// A transport that launches batches explicitly: `void flush(Deadline)`
/// starts everything posted since its last flush as one batch.
template <class T>
concept FlushingTransport = requires(T& t, Deadline d) {
  { t.flush(d) } -> std::same_as<void>;
};

/// Ends one batch of posts (the executor calls it once per wave): T's
/// flush(deadline) where it has one, else nothing (such a transport starts
/// its work by its next call, see "Batches and starting work").
template <class T>
void flush_batch(T& t, Deadline deadline) {
  if constexpr (FlushingTransport<T>) t.flush(deadline);
}

/// A transport whose batches hold a bounded number of ops (see "Bounded
/// batches"): `std::int64_t max_batch_ops() const`, 0 for no bound.
template <class T>
concept BoundedBatchTransport = requires(const T& t) {
  { t.max_batch_ops() } -> std::convertible_to<std::int64_t>;
};

/// T's max_batch_ops() where it has one, else 0 (no bound).
template <class T>
std::int64_t max_batch_ops_of(const T& t) {
  if constexpr (BoundedBatchTransport<T>)
    return static_cast<std::int64_t>(t.max_batch_ops());
  else
    return 0;
}

/// A transport whose flushed batches run on a device stream (see "Device
/// streams"): `void* device_stream()` returns it (a cudaStream_t with CUDA).
template <class T>
concept DeviceStreamTransport = requires(T& t) {
  { t.device_stream() } -> std::same_as<void*>;
};

namespace detail {
template <class T>
concept has_request = requires { typename T::request; };
/// T has a member named `flush` (of any signature, not overloaded).
template <class T>
concept names_flush = requires { &T::flush; };
/// T has a member named `device_stream`.
template <class T>
concept names_device_stream = requires { &T::device_stream; };
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
    static_assert(std::is_move_constructible_v<typename T::request> && std::is_move_assignable_v<typename T::request>,
                  "reshard: a Transport's `request` must be movable (the executor keeps requests in a std::vector)");
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
  static_assert(ExchangingTransport<T> || !requires { &T::exchange; },
                "reshard: a Transport's `exchange` must be `std::vector<std::vector<std::byte>> exchange(std::span<const "
                "PeerBlob>, Deadline)`; with another signature setup would not call it");
  // flush is optional; without one the executor's batches start at the
  // transport's next call. One of another signature would be silently unused.
  static_assert(FlushingTransport<T> || !detail::names_flush<T>,
                "reshard: a Transport's `flush` must be `void flush(Deadline)` (start everything posted as one batch); "
                "with another signature the executor would not call it");
  static_assert(DeviceStreamTransport<T> || !detail::names_device_stream<T>,
                "reshard: a Transport's `device_stream` must be `void* device_stream()` (the stream its flushed batches run on); "
                "with another signature the executor would order it from the host");
  return Transport<T>;
}

/// A decorator's base: forwards every Transport call to an inner transport,
/// so a decorator (device-memory checks, fault injection, a test's kill
/// switch) redefines only the calls it changes; the executor, templated on
/// the decorator, calls the decorator's own where it has one. `Held` is the
/// inner transport (held by value: a cheap handle such as LocalTransport) or
/// a pointer to one that lives elsewhere.
template <class Held>
class ForwardingTransport {
  using Inner = std::remove_pointer_t<Held>;

 public:
  using request = typename Inner::request;
  explicit ForwardingTransport(Held inner) : held_(std::move(inner)) {}

  std::int64_t rank() const { return inner().rank(); }
  std::span<const std::int64_t> world_ranks() const { return inner().world_ranks(); }
  std::string_view name() const { return inner().name(); }
  RegionHandle register_memory(void* p, std::size_t bytes, MemoryKind kind) { return inner().register_memory(p, bytes, kind); }
  void deregister_memory(RegionHandle h) { inner().deregister_memory(h); }
  std::vector<std::vector<std::byte>> all_gather(std::span<const std::byte> blob, Deadline d) { return inner().all_gather(blob, d); }
  void prepare(std::span<const TransferOp> ops, Deadline d) { inner().prepare(ops, d); }
  /// Forwards the pairwise exchange where the inner transport has one.
  std::vector<std::vector<std::byte>> exchange(std::span<const PeerBlob> out, Deadline d)
    requires ExchangingTransport<Inner>
  {
    return inner().exchange(out, d);
  }
  request post(std::span<const TransferOp> ops) { return inner().post(ops); }
  bool test(request& r) { return inner().test(r); }
  void wait(request& r, Deadline d) { inner().wait(r, d); }
  std::size_t wait_any(std::span<request* const> rs, Deadline d) { return inner().wait_any(rs, d); }
  void abort(std::string_view why) noexcept { inner().abort(why); }
  /// Forwards the batch boundary (a no-op over a transport without flush).
  void flush(Deadline d) { flush_batch(inner(), d); }
  /// Forwards the batch bound where the inner transport has one.
  std::int64_t max_batch_ops() const
    requires BoundedBatchTransport<Inner>
  {
    return inner().max_batch_ops();
  }
  /// Forwards the device stream where the inner transport runs on one.
  void* device_stream()
    requires DeviceStreamTransport<Inner>
  {
    return inner().device_stream();
  }
  /// This decorator's lifetime, and its inner transport's where it has one.
  Lifetime lifetime() const {
    Lifetime l(token_);
    if constexpr (LifetimeTransport<Inner>) l.add(inner().lifetime());
    return l;
  }

 protected:
  Inner& inner() {
    if constexpr (std::is_pointer_v<Held>)
      return *held_;
    else
      return held_;
  }
  const Inner& inner() const {
    if constexpr (std::is_pointer_v<Held>)
      return *held_;
    else
      return held_;
  }

 private:
  Held held_;
  LifetimeToken token_;
};

}  // namespace reshard
