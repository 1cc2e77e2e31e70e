#pragma once
// The UCX transport: one process of a real job talks to the others through
// UCP (one context and one worker per process, single-threaded). Models
// reshard::Transport.
//
//  * Bootstrap (bootstrap.hpp / mpi_bootstrap.hpp): worker addresses are
//    exchanged once at construction; prepare() exchanges each program's
//    message table (and, for one-sided puts, every receive's address and
//    packed remote key) through the same all-gather.
//  * Endpoints are opened only to the peers a prepared program talks to
//    (plus, when a rank gives up, to every rank, to tell it so), with peer
//    error handling: a dead peer's endpoint fails and every wait that depends
//    on it throws TransportError naming that rank.
//  * Memory: register_memory() maps each range once (ucp_mem_map); the
//    receive regions' remote keys are packed at prepare().
//  * Two protocols (UcxProtocol), chosen per job:
//      tag (default): ucp_tag_send_nbx / ucp_tag_recv_nbx, the tag being the
//           receive's id fixed at prepare(); UCX's rendezvous moves large
//           messages zero-copy where the lanes allow.
//      put: the receiver posts a receive by telling the sender it is ready
//           (a small active message); the sender writes straight into the
//           receiver's memory with ucp_put_nbx, flushes the endpoint (the
//           data has landed) and sends a completion signal (another active
//           message) that completes the receive. Replays need no tags: every
//           signal carries the op's id and the replay count, and a receive
//           buffer (staging reused across waves) is never written before the
//           receiver re-posted it.
//    Measured on loopback with Debian's UCX 1.13 (no RDMA), tag is about 2x
//    faster: host-memory puts have no native lane there and UCX emulates
//    them with messages. Also, with emulated puts a sender that dies in the
//    middle of a put makes UCX 1.13 abort the target process ("ucp_put_handler:
//    Fatal: unexpected error"), so the killed-peer guarantee holds for put
//    only on transports with native RMA (or for a peer that dies before it
//    puts). On RDMA networks put is the natural choice.
//  * Data endpoints: UCX 1.13 keeps shared-memory and CMA lanes off endpoints
//    with peer error handling, so on one host the data goes over TCP unless
//    UcxOptions::fast_data_endpoint (second endpoint without error handling,
//    CMA zero-copy, ~2-3x here; but a CMA copy to or from a dead peer aborts
//    this process in UCX 1.13). The control endpoint always handles errors.
//  * Waits progress the worker, then sleep on its event descriptor (or
//    briefly, when it has none), and never past their deadline: they throw
//    at the deadline, or when nothing they wait on moved for
//    UcxOptions::stall_timeout (20 s by default), naming every pending op and
//    its peer.
//  * abort(reason) sends the reason to every rank; their waits fail at once.
//
// One thread uses a UcxTransport at a time. It is neither copyable nor
// movable (UCX holds pointers to it). Destroy it after the ranks agree the
// last refit is over (e.g. after a bootstrap all_gather).
#include <poll.h>
#include <sched.h>
#include <time.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <ucp/api/ucp.h>

#include "../base/error.hpp"
#include "../cuda/ucx_memory.hpp"
#include "blob.hpp"
#include "bootstrap.hpp"
#include "peer_exchange.hpp"
#include "transport.hpp"

namespace reshard {

enum class UcxProtocol : std::uint8_t { put, tag };

inline std::string_view to_string(UcxProtocol p) { return p == UcxProtocol::put ? "put" : "tag"; }
inline UcxProtocol parse_ucx_protocol(std::string_view s) {
  if (s == "put") return UcxProtocol::put;
  if (s == "tag") return UcxProtocol::tag;
  fail("ucx transport: unknown protocol '{}' (expected 'put' or 'tag')", s);
}

struct UcxOptions {
  /// How data moves; every rank of the job must use the same.
  UcxProtocol protocol = UcxProtocol::tag;
  /// A wait fails when nothing it waits on moves for this long (a peer that
  /// stopped answering), even before its own deadline. A bootstrap
  /// all_gather waits 1.25x this + 1 s (26 s by default), so that ranks stuck
  /// on the same peer time out first and tell it why: with the defaults every
  /// rank fails within 30 s of a peer going silent (a dead peer is noticed
  /// at once through its endpoint's error handler).
  std::chrono::milliseconds stall_timeout{20'000};
  /// Puts larger than this are cut into pieces of this size.
  std::size_t put_chunk = std::size_t{64} << 20;
  /// Idle progress rounds before a wait sleeps on the worker's events.
  int spin = 32;
  /// Longest single sleep of a wait (it wakes earlier on any event).
  std::chrono::microseconds max_sleep{2'000};
  /// How long abort() keeps progressing to deliver its messages.
  std::chrono::milliseconds abort_linger{500};
  /// After an op fails, how long a wait listens for a peer's reason (abort)
  /// before it reports the failure alone.
  std::chrono::milliseconds failure_linger{200};
  /// Peer failure detection (UCP_ERR_HANDLING_MODE_PEER on the control
  /// endpoint, whose error handler names the dead peer).
  bool peer_error_handling = true;
  /// Move data on a second endpoint per peer that has no error handling.
  /// UCX (1.13) keeps shared-memory and CMA lanes off endpoints that handle
  /// peer failure, so on one host the default endpoint moves data over TCP;
  /// this one gets CMA zero-copy (about 3x the bandwidth here). But a CMA
  /// copy from or to a peer that has just died is fatal in UCX 1.13: this
  /// process aborts instead of reporting the dead peer. Off by default; the
  /// control endpoint (signals, abort, liveness) always keeps error handling.
  bool fast_data_endpoint = false;
  /// UCX settings applied over the environment's (names without "UCX_"),
  /// e.g. {{"TLS", "tcp,self"}}.
  std::vector<std::pair<std::string, std::string>> ucx_config;
};

/// Result of UcxTransport::measure_bandwidth (every rank gets it).
struct UcxBandwidth {
  std::int64_t from = -1, to = -1;
  UcxProtocol protocol = UcxProtocol::tag;
  std::uint64_t bytes = 0;
  int iterations = 0;
  double seconds = 0;        ///< all timed iterations together
  double gb_per_s = 0;       ///< bytes * iterations / seconds / 1e9
};

/// Traffic this endpoint moved since construction.
struct UcxTrafficStats {
  std::int64_t bytes_sent = 0, bytes_received = 0, messages_sent = 0, messages_received = 0;
  std::int64_t signals_sent = 0, signals_received = 0, puts = 0, flushes = 0;
  /// Setup traffic: what this rank put into and got out of all_gather and
  /// exchange (blob bytes; the bootstrap's own framing not counted).
  std::int64_t setup_bytes_sent = 0, setup_bytes_received = 0;
};

namespace ucx_detail {

constexpr std::uint32_t kMagic = 0x52534855;  // "RSHU"
constexpr unsigned kAmId = 0x5253;
// revoke: a receiver is deregistering memory it offered for puts (payload:
// the sender's op ids and epochs); revoked: the sender answers that nothing of
// it puts into that memory any more (the same payload echoed).
enum class AmType : std::uint16_t { ready = 1, done = 2, abort = 3, probe = 4, exchange = 5, revoke = 6, revoked = 7 };

struct AmHeader {
  std::uint32_t magic = kMagic;
  std::uint16_t type = 0;
  std::uint16_t reserved = 0;
  std::int64_t from = -1;  ///< sender's global rank
};

inline std::string status_text(ucs_status_t s) { return fmt::format("{} ({})", ucs_status_string(s), static_cast<int>(s)); }
/// Starts closing `ep` (by force: its requests end at once, cancelled, and
/// the peer is not waited for); the close request, or nullptr when none is
/// left to wait on.
inline void* close_endpoint(ucp_ep_h ep, bool force) {
  ucp_request_param_t prm{};
  prm.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  prm.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
  ucs_status_ptr_t s = ucp_ep_close_nbx(ep, &prm);
  return s && !UCS_PTR_IS_ERR(s) ? s : nullptr;
}

}  // namespace ucx_detail

class UcxTransport {
 public:
  /// The group of ops one post() started.
  struct Group;
  using request = std::shared_ptr<Group>;

  /// Creates the context and worker and exchanges worker addresses through
  /// the bootstrap (collective over bootstrap.ranks).
  explicit UcxTransport(Bootstrap bootstrap, UcxOptions opt = {});
  UcxTransport(const UcxTransport&) = delete;
  UcxTransport& operator=(const UcxTransport&) = delete;
  ~UcxTransport();

  // --- reshard::Transport ---
  std::int64_t rank() const { return me_; }
  std::span<const std::int64_t> world_ranks() const { return boot_.ranks; }
  std::string_view name() const { return "ucx"; }

  /// Whether the UCX loaded at run time moves CUDA device memory (Debian's
  /// does not; the libucx-cu13 wheel's does): asked of UCP, not of the build.
  bool moves_device_memory() const { return cuda::ucx_memory(ctx_).cuda; }
  RegionHandle register_memory(void* p, std::size_t bytes, MemoryKind kind);
  void deregister_memory(RegionHandle h);
  /// Expires when this transport is destroyed (which unmaps what it mapped).
  Lifetime lifetime() const { return Lifetime(token_); }
  Blobs all_gather(std::span<const std::byte> blob, Deadline deadline);
  /// Pairwise exchange (transport.hpp): active messages on the control
  /// endpoints, so only the listed peers are talked to.
  Blobs exchange(std::span<const PeerBlob> out, Deadline deadline);
  void prepare(std::span<const TransferOp> ops, Deadline deadline);
  request post(std::span<const TransferOp> ops);
  bool test(request& r);
  void wait(request& r, Deadline deadline);
  std::size_t wait_any(std::span<request* const> rs, Deadline deadline);
  void abort(std::string_view why) noexcept;

  // --- beyond the concept ---
  const UcxOptions& options() const { return opt_; }
  UcxProtocol protocol() const { return opt_.protocol; }
  bool aborted() const { return aborted_; }
  const UcxTrafficStats& stats() const { return traffic_; }
  /// Peers this endpoint has opened endpoints to (global ranks).
  std::vector<std::int64_t> connected_peers() const;
  /// Transports and devices of the endpoint to `peer` (after it connected).
  std::string describe_endpoint(std::int64_t peer);

  /// Collective raw bandwidth probe between two ranks of the job, on the
  /// same data endpoint a refit uses: with `put`, rank `from` puts `bytes`
  /// into rank `to`'s registered memory `iterations` times, each put followed
  /// by a flush (the data has landed); with `tag`, one tagged send of `bytes`
  /// per iteration into a posted receive. One untimed warm-up round first.
  /// Every rank returns the result (the other ranks only join the bootstrap).
  UcxBandwidth measure_bandwidth(std::int64_t from, std::int64_t to, std::size_t bytes, int iterations, Deadline deadline,
                                 UcxProtocol how = UcxProtocol::put);

 private:
  LifetimeToken token_;
  struct Region {
    std::byte* ptr = nullptr;
    std::size_t bytes = 0;
    ucp_mem_h memh = nullptr;
  };
  struct Peer {
    UcxTransport* t = nullptr;
    std::size_t index = 0;
    std::int64_t rank = -1;
    ucp_ep_h ep = nullptr;    ///< control: signals, abort; peer failure detection
    ucp_ep_h data = nullptr;  ///< data: puts, flushes, tagged sends (may equal ep)
    bool failed = false;
    std::string failure;
    std::map<std::uint32_t, ucp_rkey_h> rkeys;  ///< by the peer's region id
  };
  enum class Stage : std::uint8_t { idle, wait_ready, putting, flushing, signalling, in_flight };
  struct Op {
    TransferOp op;
    std::size_t peer = 0;          ///< index into peers_
    std::uint64_t uid = 0;         ///< this rank's id of the op
    std::uint64_t remote_uid = 0;  ///< the peer's id of the matching op
    std::uint64_t remote_addr = 0;
    ucp_rkey_h rkey = nullptr;
    std::uint64_t posts = 0;      ///< times posted
    std::uint64_t signals = 0;    ///< put send: ready signals seen; put recv: done signals seen
    std::uint64_t completed = 0;  ///< posts completed
    Stage stage = Stage::idle;
    std::uint32_t chunks_left = 0;
    std::string error;            ///< failure of the current post
    bool ack_owed = false;        ///< put send: the receiver revoked it; answered (and failed) once no put of it is in flight
    std::uint64_t ack_epoch = 0;
  };
  struct Item {
    std::uint32_t op = 0;
    std::uint64_t epoch = 0;
  };

 public:
  struct Group {
    std::int64_t rank = -1;
    std::vector<Item> items;
  };

 private:
  /// Context of one UCX operation in flight (user_data of its callback).
  struct Pending {
    enum Kind : std::uint8_t { put_chunk, flush, signal, abort_msg, tag_send, tag_recv, probe_put, probe_flush, exchange_send } kind;
    UcxTransport* t = nullptr;
    std::uint32_t op = 0;
    std::size_t peer = 0;
    std::vector<std::uint32_t> ops;  ///< flush / signal: the ops it covers
    ucx_detail::AmHeader header;
    std::vector<std::byte> payload;
    void* req = nullptr;
    bool launching = false, early = false;  ///< see launch()
    ucs_status_t early_status = UCS_OK;
    std::size_t early_length = 0;
  };
  struct KeyList {
    std::vector<std::uint32_t> ops;
    std::size_t cursor = 0;
  };
  using OpKey = std::tuple<std::uint8_t, std::int64_t, std::uint64_t, std::uint32_t, std::uint64_t, std::uint64_t>;

  // callbacks (static: UCX is C)
  static void on_send_done(void* req, ucs_status_t st, void* user);
  static void on_recv_done(void* req, ucs_status_t st, const ucp_tag_recv_info_t* info, void* user);
  static void on_ep_error(void* arg, ucp_ep_h ep, ucs_status_t st);
  static ucs_status_t on_am(void* arg, const void* header, std::size_t hlen, void* data, std::size_t len,
                            const ucp_am_recv_param_t* param);

  void finish(Pending* p, ucs_status_t st, std::size_t recv_length = 0);
  /// Called by a callback: the op is no longer in flight.
  void landed(Pending* p) {
    live_.erase(p);
    p->req = nullptr;
  }
  /// Starts queued protocol steps (puts, flushes, signals); no worker progress.
  void pump();
  void handle_am(const ucx_detail::AmHeader& h, const std::byte* data, std::size_t len);
  /// Sends p's header and payload as one eager active message on `ep`
  /// (delivered whole to on_am, whatever its size); p as for launch().
  void send_am(Pending* p, ucp_ep_h ep) {
    ucp_request_param_t prm{};
    prm.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
    prm.cb.send = &UcxTransport::on_send_done;
    prm.user_data = p;
    prm.flags = UCP_AM_SEND_FLAG_EAGER;
    launch(p, [&] { return ucp_am_send_nbx(ep, ucx_detail::kAmId, &p->header, sizeof(p->header), p->payload.data(), p->payload.size(), &prm); });
  }
  /// Starts an operation: p is owned by UCX until its callback, or finished here.
  template <class Start>
  void launch(Pending* p, Start&& start);

  std::size_t peer_index(std::int64_t rank) const {
    auto it = index_.find(rank);
    if (it == index_.end()) throw TransportError(fmt::format("ucx transport: rank {} is not in this job's world", rank));
    return it->second;
  }
  /// Opens the control and data endpoints to a peer; returns the control one.
  ucp_ep_h ensure_ep(std::size_t peer);
  ucp_ep_h data_ep(std::size_t peer) {
    ensure_ep(peer);
    return peers_[peer]->data;
  }
  void check_usable() const;
  std::string describe(const Op& o) const;
  std::string describe_pending(const Op& o) const;
  std::string pending_text(std::span<const Group* const> gs) const;
  /// Progresses the worker and the protocol once; true if anything moved.
  bool progress();
  void start_puts(std::uint32_t op);
  /// Flushes the data endpoint to a peer (its puts have landed); then `ops` move on to their completion signal.
  void flush_data(std::size_t peer, std::vector<std::uint32_t> ops);
  void send_signal(std::size_t peer, ucx_detail::AmType type, const std::vector<std::uint32_t>& ops,
                   const std::vector<std::uint64_t>& uid_epochs);
  void start_tag(std::uint32_t op);
  void fail_op(std::uint32_t op, const std::string& why);
  /// Ends every request to `peer` now: its endpoints are closed by force
  /// (UCX completes their requests as cancelled) and the peer counts as
  /// failed from then on, for `why`.
  void close_by_force(std::size_t peer, const std::string& why);
  /// Throws if an item of g failed; true when all its items completed.
  bool group_done(const Group& g) const;
  template <class Done, class Describe>
  void wait_until(Done&& done, Describe&& describe, Deadline deadline, const char* what);
  void sleep_a_little(Clock::time_point until);
  /// Teardown paths: progresses the worker until done() or `until` (no
  /// sleeping, no throwing, no new endpoints), still answering revokes: a
  /// peer's deregistration waits for that.
  template <class Done>
  void progress_until(Clock::time_point until, Done&& done) {
    while (!done() && Clock::now() < until) {
      const unsigned moved = ucp_worker_progress(worker_);
      answer_revokes(false);
      if (moved == 0) sched_yield();
    }
  }
  /// Flushes the data endpoints to `peers` and progresses until those
  /// flushes end or `until`: the puts started to them before have landed.
  void land_puts(const std::set<std::size_t>& peers, Clock::time_point until) {
    for (auto peer : peers) flush_data(peer, {});
    auto landing = [&](const Pending* p) { return p->kind == Pending::flush && p->ops.empty() && peers.count(p->peer); };
    progress_until(until, [&] { return std::none_of(live_.begin(), live_.end(), landing); });
  }
  /// Cancels the tagged receives in flight that `which` selects (their
  /// callbacks end them during progress); true when there was one.
  template <class Which>
  bool cancel_receives(Which&& which) {
    bool any = false;
    for (Pending* p : std::vector<Pending*>(live_.begin(), live_.end()))  // a cancel may complete at once
      if (p->kind == Pending::tag_recv && p->req && which(p)) {
        ucp_request_cancel(worker_, p->req);
        any = true;
      }
    return any;
  }
  /// Put protocol: tells the senders of the receives `recvs` that were posted
  /// and not completed (a ready signal may have let them put) that their
  /// memory is going away, and waits until each sender confirms it puts
  /// nothing more into it, died, or gave up (it flushes before it says so);
  /// past the stall timeout this transport aborts, naming the silent peer.
  void revoke_receives(std::span<const std::uint32_t> recvs, std::string_view memory);
  /// A revoke for the put send `uid` from `peer` arrived.
  void on_revoke(std::size_t peer, std::uint64_t uid, std::uint64_t epoch);
  /// Answers the revokes whose puts are no longer in flight.
  void settle_revokes();
  /// Sends the answers settle_revokes() queued (over endpoints already open unless `may_connect`).
  void answer_revokes(bool may_connect);
  bool puts_in_flight(std::uint32_t op) const;

  Bootstrap boot_;
  UcxOptions opt_;
  std::int64_t me_ = -1;
  std::size_t my_index_ = 0;
  std::unordered_map<std::int64_t, std::size_t> index_;
  ucp_context_h ctx_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  int efd_ = -1;
  std::vector<std::vector<std::byte>> addresses_;
  std::vector<std::unique_ptr<Peer>> peers_;
  std::unordered_map<std::uint32_t, Region> regions_;
  std::uint32_t next_region_ = 0;
  std::vector<Op> ops_;
  std::unordered_map<std::uint64_t, std::uint32_t> by_uid_;
  std::map<OpKey, KeyList> by_key_;
  std::uint64_t next_uid_ = 1;
  std::vector<std::uint32_t> ready_queue_;                          ///< put sends whose receiver is ready
  std::map<std::size_t, std::vector<std::uint32_t>> flush_queue_;   ///< put sends whose data was put, by peer
  std::map<std::size_t, std::vector<std::uint32_t>> signal_queue_;  ///< put sends whose data landed, by peer
  std::map<std::size_t, std::vector<std::uint64_t>> revoked_queue_;  ///< revokes answered, by peer: (uid, epoch) pairs
  std::vector<std::uint32_t> acks_owed_;                             ///< revoked put sends with puts still in flight
  std::set<std::pair<std::size_t, std::uint64_t>> revoking_;          ///< (peer, its send's uid): revokes not yet answered
  std::unordered_set<std::int64_t> gave_up_;                          ///< ranks whose abort arrived
  std::unordered_set<Pending*> live_;  ///< operations UCX still owns
  int probe_left_ = 0;
  ucs_status_t probe_status_ = UCS_OK;
  std::uint64_t events_ = 0;  ///< bumped by anything that moves
  bool aborted_ = false;
  std::string abort_reason_;
  std::optional<double> probe_seconds_;
  UcxTrafficStats traffic_;
  std::uint64_t exchange_calls_ = 0;                                             ///< exchange() calls so far
  std::map<std::pair<std::int64_t, std::uint64_t>, std::vector<std::byte>> inbox_;  ///< (from, call): pairwise blobs
  std::size_t exchange_sends_left_ = 0;
  std::string exchange_error_;
};

static_assert(check_transport<UcxTransport>());

// ---------------------------------------------------------------------------

inline UcxTransport::UcxTransport(Bootstrap bootstrap, UcxOptions opt) : boot_(std::move(bootstrap)), opt_(std::move(opt)) {
  boot_.validate();
  me_ = boot_.rank;
  for (std::size_t i = 0; i < boot_.ranks.size(); ++i) index_.emplace(boot_.ranks[i], i);
  my_index_ = index_.at(me_);
  if (opt_.stall_timeout.count() <= 0) fail("ucx transport: stall_timeout must be positive");
  if (opt_.put_chunk == 0) fail("ucx transport: put_chunk must be positive");
  for (std::size_t i = 0; i < boot_.ranks.size(); ++i) {
    auto p = std::make_unique<Peer>();
    p->t = this;
    p->index = i;
    p->rank = boot_.ranks[i];
    peers_.push_back(std::move(p));
  }
  std::string error;
  try {
    ucp_config_t* cfg = nullptr;
    ucs_status_t st = ucp_config_read(nullptr, nullptr, &cfg);
    if (st != UCS_OK) throw TransportError(fmt::format("ucx transport: rank {}: ucp_config_read failed: {}", me_, ucx_detail::status_text(st)));
    for (const auto& [k, v] : opt_.ucx_config) {
      st = ucp_config_modify(cfg, k.c_str(), v.c_str());
      if (st != UCS_OK) {
        ucp_config_release(cfg);
        throw TransportError(fmt::format("ucx transport: rank {}: UCX setting {}={} was refused: {}", me_, k, v, ucx_detail::status_text(st)));
      }
    }
    ucp_params_t params{};
    params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED | UCP_PARAM_FIELD_ESTIMATED_NUM_EPS | UCP_PARAM_FIELD_NAME;
    params.features = UCP_FEATURE_RMA | UCP_FEATURE_TAG | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
    params.mt_workers_shared = 0;
    params.estimated_num_eps = boot_.ranks.size();
    params.name = "reshard";
    st = ucp_init(&params, cfg, &ctx_);
    ucp_config_release(cfg);
    if (st != UCS_OK) throw TransportError(fmt::format("ucx transport: rank {}: ucp_init failed: {}", me_, ucx_detail::status_text(st)));
    ucp_worker_params_t wp{};
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wp.thread_mode = UCS_THREAD_MODE_SINGLE;
    st = ucp_worker_create(ctx_, &wp, &worker_);
    if (st != UCS_OK) throw TransportError(fmt::format("ucx transport: rank {}: ucp_worker_create failed: {}", me_, ucx_detail::status_text(st)));
    if (ucp_worker_get_efd(worker_, &efd_) != UCS_OK) efd_ = -1;
    ucp_am_handler_param_t hp{};
    hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_FLAGS | UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG;
    hp.id = ucx_detail::kAmId;
    hp.flags = UCP_AM_FLAG_WHOLE_MSG;
    hp.cb = &UcxTransport::on_am;
    hp.arg = this;
    st = ucp_worker_set_am_recv_handler(worker_, &hp);
    if (st != UCS_OK) throw TransportError(fmt::format("ucx transport: rank {}: setting the message handler failed: {}", me_, ucx_detail::status_text(st)));
  } catch (const std::exception& e) {
    error = e.what();
  }
  // Exchange worker addresses (and each rank's status, so that a rank whose
  // UCX failed to start makes every rank fail, not hang).
  BlobWriter w;
  w.put(ucx_detail::kMagic);
  w.put<std::uint8_t>(error.empty() ? 1 : 0);
  w.put_string(error);
  w.put<std::uint8_t>(static_cast<std::uint8_t>(opt_.protocol));
  ucp_address_t* addr = nullptr;
  std::size_t addr_len = 0;
  if (error.empty()) {
    const ucs_status_t st = ucp_worker_get_address(worker_, &addr, &addr_len);
    if (st != UCS_OK) error = fmt::format("ucx transport: rank {}: ucp_worker_get_address failed: {}", me_, ucx_detail::status_text(st));
  }
  w.put_bytes(addr, error.empty() ? addr_len : 0);
  if (addr) ucp_worker_release_address(worker_, addr);
  Blobs blobs;
  try {
    blobs = boot_.all_gather(w.buf, Clock::now() + opt_.stall_timeout, [] {});
    if (blobs.size() != boot_.ranks.size())
      throw TransportError(fmt::format("ucx transport: rank {}: the bootstrap returned {} blobs for {} ranks", me_, blobs.size(), boot_.ranks.size()));
    if (!error.empty()) throw TransportError(error);
    addresses_.resize(blobs.size());
    for (std::size_t i = 0; i < blobs.size(); ++i) {
      BlobReader rd(blobs[i], boot_.ranks[i], "worker address");
      if (rd.get<std::uint32_t>() != ucx_detail::kMagic)
        throw TransportError(fmt::format("ucx transport: rank {}: rank {} sent a bootstrap blob of another kind (is it running the same program?)", me_, boot_.ranks[i]));
      const bool ok = rd.get<std::uint8_t>() != 0;
      const std::string msg = rd.get_string();
      if (!ok) throw TransportError(fmt::format("ucx transport: rank {}: rank {} could not start UCX: {}", me_, boot_.ranks[i], msg));
      const auto proto = static_cast<UcxProtocol>(rd.get<std::uint8_t>());
      if (proto != opt_.protocol)
        throw TransportError(fmt::format("ucx transport: rank {} uses protocol '{}' but rank {} uses '{}': every rank must use the same", me_,
                                         to_string(opt_.protocol), boot_.ranks[i], to_string(proto)));
      auto a = rd.get_bytes();
      addresses_[i].assign(a.begin(), a.end());
    }
  } catch (...) {
    if (worker_) ucp_worker_destroy(worker_);
    if (ctx_) ucp_cleanup(ctx_);
    worker_ = nullptr;
    ctx_ = nullptr;
    throw;
  }
}

inline UcxTransport::~UcxTransport() {
  if (!worker_) return;
  // Receives still posted (a failed refit) are cancelled or revoked; sends get a moment.
  cancel_receives([](const Pending*) { return true; });
  std::vector<std::uint32_t> registered;
  for (const auto& [uid, op] : by_uid_) registered.push_back(op);
  revoke_receives(registered, "its memory");
  progress_until(Clock::now() + std::chrono::milliseconds(aborted_ ? 100 : 1000), [&] { return live_.empty(); });
  for (auto& p : peers_)
    for (auto& [id, rk] : p->rkeys) ucp_rkey_destroy(rk);
  std::vector<void*> closing;
  for (auto& p : peers_) {
    for (ucp_ep_h* e : {&p->data, &p->ep}) {
      if (!*e || (e == &p->data && p->data == p->ep)) continue;
      // A data endpoint has no error handling: never wait on it for a peer that may be gone.
      if (void* r = ucx_detail::close_endpoint(*e, p->failed || aborted_ || e == &p->data)) closing.push_back(r);
    }
    p->ep = p->data = nullptr;
  }
  auto all_closed = [&] {
    for (void* r : closing)
      if (ucp_request_check_status(r) == UCS_INPROGRESS) return false;
    return true;
  };
  progress_until(Clock::now() + std::chrono::milliseconds(1000), all_closed);
  // Every close request is released, complete or not: UCX frees an incomplete
  // one when it completes, and ucp_worker_destroy, which completes them now
  // (a peer busy elsewhere never answered the close), asserts that each was
  // released: destroying the worker with one held aborted the process.
  for (void* r : closing) ucp_request_free(r);
  for (auto& [id, r] : regions_)
    if (r.memh) ucp_mem_unmap(ctx_, r.memh);
  ucp_worker_destroy(worker_);
  ucp_cleanup(ctx_);
  for (Pending* p : live_) delete p;  // UCX is gone: nothing will complete them
}

// --- callbacks -------------------------------------------------------------

inline void UcxTransport::on_send_done(void* req, ucs_status_t st, void* user) {
  auto* p = static_cast<Pending*>(user);
  if (p->launching) {
    p->early = true;
    p->early_status = st;
    return;
  }
  UcxTransport* t = p->t;
  t->landed(p);
  t->finish(p, st);
  ucp_request_free(req);
}

inline void UcxTransport::on_recv_done(void* req, ucs_status_t st, const ucp_tag_recv_info_t* info, void* user) {
  auto* p = static_cast<Pending*>(user);
  if (p->launching) {
    p->early = true;
    p->early_status = st;
    p->early_length = info ? info->length : 0;
    return;
  }
  UcxTransport* t = p->t;
  t->landed(p);
  t->finish(p, st, info ? info->length : 0);
  ucp_request_free(req);
}

inline void UcxTransport::on_ep_error(void* arg, ucp_ep_h, ucs_status_t st) {
  auto* peer = static_cast<Peer*>(arg);
  if (!peer->failed) {
    peer->failed = true;
    peer->failure = ucs_status_string(st);
  }
  ++peer->t->events_;
}

inline ucs_status_t UcxTransport::on_am(void* arg, const void* header, std::size_t hlen, void* data, std::size_t len,
                                        const ucp_am_recv_param_t* param) {
  auto* t = static_cast<UcxTransport*>(arg);
  try {
    ucx_detail::AmHeader h;
    if (hlen != sizeof(h) || (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV)) return UCS_OK;  // not ours
    std::memcpy(&h, header, sizeof(h));
    if (h.magic != ucx_detail::kMagic) return UCS_OK;
    t->handle_am(h, static_cast<const std::byte*>(data), len);
  } catch (...) {
    // Never throw into UCX; a malformed message is dropped.
  }
  ++t->events_;
  return UCS_OK;
}

inline void UcxTransport::handle_am(const ucx_detail::AmHeader& h, const std::byte* data, std::size_t len) {
  using ucx_detail::AmType;
  const auto type = static_cast<AmType>(h.type);
  if (type == AmType::abort) {
    gave_up_.insert(h.from);
    if (!aborted_) {
      aborted_ = true;
      abort_reason_ = fmt::format("ucx transport: rank {}: rank {} gave up: {}", me_, h.from,
                                  std::string_view(reinterpret_cast<const char*>(data), len));
    }
    return;
  }
  if (type == AmType::exchange) {  // kept until this rank's matching exchange() takes it
    std::uint64_t call = 0;
    if (len < sizeof(call)) return;
    std::memcpy(&call, data, sizeof(call));
    inbox_[{h.from, call}].assign(data + sizeof(call), data + len);
    return;
  }
  if (type == AmType::probe) {
    double s = 0;
    if (len == sizeof(s)) std::memcpy(&s, data, sizeof(s));
    probe_seconds_ = s;
    return;
  }
  if (len % 16 != 0) return;
  const auto from = index_.find(h.from);
  if (from == index_.end()) return;
  for (std::size_t k = 0; k < len; k += 16) {
    std::uint64_t uid, epoch;
    std::memcpy(&uid, data + k, 8);
    std::memcpy(&epoch, data + k + 8, 8);
    if (type == AmType::revoke) {
      on_revoke(from->second, uid, epoch);
      continue;
    }
    if (type == AmType::revoked) {
      revoking_.erase({from->second, uid});
      continue;
    }
    auto it = by_uid_.find(uid);
    if (it == by_uid_.end()) continue;  // an op deregistered meanwhile
    Op& o = ops_[it->second];
    if (peers_[o.peer]->rank != h.from) continue;
    ++traffic_.signals_received;
    if (type == AmType::ready && o.op.kind == OpKind::send) {
      o.signals = std::max(o.signals, epoch);
      if (o.stage == Stage::wait_ready && o.signals >= o.posts) ready_queue_.push_back(it->second);
    } else if (type == AmType::done && o.op.kind == OpKind::recv) {
      o.signals = std::max(o.signals, epoch);
      if (o.signals >= o.posts && o.completed < o.posts) {
        o.completed = o.posts;
        o.stage = Stage::idle;
        traffic_.bytes_received += static_cast<std::int64_t>(o.op.bytes);
        ++traffic_.messages_received;
      }
    }
  }
}

template <class Start>
void UcxTransport::launch(Pending* p, Start&& start) {
  // UCX may run the callback before the call returns (a receive matching a
  // message that already arrived, with immediate completion denied): the
  // callback then only records the result and we finish it here.
  p->launching = true;
  const ucs_status_ptr_t s = start();
  p->launching = false;
  if (s == nullptr) {
    finish(p, UCS_OK);
  } else if (UCS_PTR_IS_ERR(s)) {
    finish(p, UCS_PTR_STATUS(s));
  } else if (p->early) {
    ucp_request_free(s);
    finish(p, p->early_status, p->early_length);
  } else {
    p->req = s;
    live_.insert(p);
  }
}

inline void UcxTransport::finish(Pending* p, ucs_status_t st, std::size_t recv_length) {
  std::unique_ptr<Pending> own(p);
  ++events_;
  const bool ok = st == UCS_OK;
  auto peer_text = [&](std::size_t peer) {
    const Peer& pr = *peers_[peer];
    return pr.failed ? fmt::format("peer rank {} failed ({})", pr.rank, pr.failure) : fmt::format("{}", ucx_detail::status_text(st));
  };
  switch (p->kind) {
    case Pending::put_chunk: {
      Op& o = ops_[p->op];
      if (!ok) {
        fail_op(p->op, fmt::format("a put to rank {} failed: {}", peers_[o.peer]->rank, peer_text(o.peer)));
        break;
      }
      if (o.chunks_left > 0 && --o.chunks_left == 0 && o.error.empty()) {
        o.stage = Stage::flushing;
        flush_queue_[o.peer].push_back(p->op);
      }
      break;
    }
    case Pending::flush: {
      for (auto op : p->ops) {
        Op& o = ops_[op];
        if (!ok) {
          fail_op(op, fmt::format("flushing the endpoint to rank {} failed: {}", peers_[o.peer]->rank, peer_text(o.peer)));
          continue;
        }
        if (!o.error.empty() || o.ack_owed) continue;  // a revoked one fails once settle_revokes() answers it
        o.stage = Stage::signalling;
        signal_queue_[o.peer].push_back(op);
      }
      break;
    }
    case Pending::signal: {
      if (p->header.type == static_cast<std::uint16_t>(ucx_detail::AmType::done)) {
        for (auto op : p->ops) {
          Op& o = ops_[op];
          if (!ok) {
            fail_op(op, fmt::format("the completion signal to rank {} failed: {}", peers_[o.peer]->rank, peer_text(o.peer)));
            continue;
          }
          if (!o.error.empty()) continue;
          o.completed = o.posts;
          o.stage = Stage::idle;
          traffic_.bytes_sent += static_cast<std::int64_t>(o.op.bytes);
          ++traffic_.messages_sent;
        }
      } else if (!ok) {  // ready signal
        for (auto op : p->ops) {
          Op& o = ops_[op];
          fail_op(op, fmt::format("telling rank {} that the receive is posted failed: {}", peers_[o.peer]->rank, peer_text(o.peer)));
        }
      }
      break;
    }
    case Pending::tag_send:
    case Pending::tag_recv: {
      Op& o = ops_[p->op];
      if (st == UCS_ERR_CANCELED) {
        fail_op(p->op, "cancelled");
        break;
      }
      if (!ok) {
        fail_op(p->op, fmt::format("the tagged {} failed: {}", o.op.kind == OpKind::send ? "send" : "receive", peer_text(o.peer)));
        break;
      }
      if (p->kind == Pending::tag_recv && recv_length != o.op.bytes) {
        fail_op(p->op, fmt::format("size mismatch: received {} bytes from rank {} for a receive of {} bytes", recv_length,
                                   peers_[o.peer]->rank, o.op.bytes));
        break;
      }
      o.completed = o.posts;
      o.stage = Stage::idle;
      if (o.op.kind == OpKind::send) {
        traffic_.bytes_sent += static_cast<std::int64_t>(o.op.bytes);
        ++traffic_.messages_sent;
      } else {
        traffic_.bytes_received += static_cast<std::int64_t>(o.op.bytes);
        ++traffic_.messages_received;
      }
      break;
    }
    case Pending::abort_msg:
      break;
    case Pending::exchange_send:
      --exchange_sends_left_;
      if (!ok && exchange_error_.empty())
        exchange_error_ = fmt::format("ucx transport: rank {}: sending its setup blob to rank {} failed: {}", me_, peers_[p->peer]->rank,
                                      peer_text(p->peer));
      break;
    case Pending::probe_put:
    case Pending::probe_flush:
      if (st != UCS_OK && probe_status_ == UCS_OK) probe_status_ = st;
      --probe_left_;
      break;
  }
  if (!acks_owed_.empty() && (p->kind == Pending::put_chunk || p->kind == Pending::flush)) settle_revokes();
}

// --- helpers ---------------------------------------------------------------

inline void UcxTransport::check_usable() const {
  if (!worker_) throw TransportError(fmt::format("ucx transport: rank {}: not started", me_));
  if (aborted_) throw TransportError(abort_reason_);
}

inline ucp_ep_h UcxTransport::ensure_ep(std::size_t peer) {
  Peer& p = *peers_[peer];
  if (p.ep) return p.ep;
  if (p.failed) throw TransportError(fmt::format("ucx transport: rank {}: peer rank {} failed earlier ({})", me_, p.rank, p.failure));
  auto open = [&](bool handle_errors, ucp_ep_h* out) {
    ucp_ep_params_t ep{};
    ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
    ep.address = reinterpret_cast<const ucp_address_t*>(addresses_[peer].data());
    ep.err_mode = handle_errors ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE;
    if (handle_errors) {
      ep.field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLER;
      ep.err_handler.cb = &UcxTransport::on_ep_error;
      ep.err_handler.arg = &p;
    }
    const ucs_status_t st = ucp_ep_create(worker_, &ep, out);
    if (st != UCS_OK) {
      *out = nullptr;
      throw TransportError(fmt::format(
          "ucx transport: rank {}: opening {} endpoint to rank {} failed: {} (check UCX_TLS / UCX_NET_DEVICES{})", me_,
          handle_errors ? "an error-handling" : "a data", p.rank, ucx_detail::status_text(st),
          handle_errors ? "; peer error handling needs a transport that supports it, e.g. tcp: on one host UCX_TLS=sm,self has none" : ""));
    }
  };
  // Both sides open the control endpoint first, so UCX pairs them alike.
  open(opt_.peer_error_handling, &p.ep);
  if (opt_.peer_error_handling && opt_.fast_data_endpoint && peer != my_index_) {
    try {
      open(false, &p.data);
    } catch (...) {
      if (void* r = ucx_detail::close_endpoint(p.ep, true)) ucp_request_free(r);  // UCX frees it when it completes
      p.ep = nullptr;
      throw;
    }
  } else {
    p.data = p.ep;
  }
  return p.ep;
}

inline std::vector<std::int64_t> UcxTransport::connected_peers() const {
  std::vector<std::int64_t> out;
  for (const auto& p : peers_)
    if (p->ep) out.push_back(p->rank);
  return out;
}

inline std::string UcxTransport::describe_endpoint(std::int64_t peer) {
  const std::size_t i = peer_index(peer);
  ensure_ep(i);
  char* buf = nullptr;
  std::size_t len = 0;
  FILE* f = open_memstream(&buf, &len);
  if (!f) return {};
  std::fprintf(f, "control endpoint to rank %lld:\n", static_cast<long long>(peer));
  ucp_ep_print_info(peers_[i]->ep, f);
  if (peers_[i]->data != peers_[i]->ep) {
    std::fprintf(f, "data endpoint to rank %lld:\n", static_cast<long long>(peer));
    ucp_ep_print_info(peers_[i]->data, f);
  }
  std::fclose(f);
  std::string s(buf, len);
  std::free(buf);
  return s;
}

inline std::string UcxTransport::describe(const Op& o) const {
  return o.op.kind == OpKind::send
             ? fmt::format("send of {} bytes from rank {} to rank {} (tag {:#x})", o.op.bytes, me_, o.op.peer, o.op.tag)
             : fmt::format("receive of {} bytes from rank {} at rank {} (tag {:#x})", o.op.bytes, o.op.peer, me_, o.op.tag);
}

inline std::string UcxTransport::describe_pending(const Op& o) const {
  const auto peer = o.op.peer;
  switch (o.stage) {
    case Stage::wait_ready: return fmt::format("{}: waiting for rank {} to post the receive", describe(o), peer);
    case Stage::putting: return fmt::format("{}: {} put(s) to rank {} outstanding", describe(o), o.chunks_left, peer);
    case Stage::flushing: return fmt::format("{}: waiting for rank {} to confirm the data landed", describe(o), peer);
    case Stage::signalling: return fmt::format("{}: signalling completion to rank {}", describe(o), peer);
    case Stage::in_flight:
      return o.op.kind == OpKind::recv ? fmt::format("{}: waiting for rank {}'s data", describe(o), peer)
                                       : fmt::format("{}: in flight to rank {}", describe(o), peer);
    case Stage::idle: break;
  }
  return describe(o);
}

inline std::string UcxTransport::pending_text(std::span<const Group* const> gs) const {
  std::string s;
  int shown = 0, total = 0;
  for (const Group* g : gs)
    for (const auto& it : g->items) {
      const Op& o = ops_[it.op];
      if (o.completed >= it.epoch) continue;
      ++total;
      if (shown < 4) {
        s += (shown ? "; " : "") + describe_pending(o);
        ++shown;
      }
    }
  if (total > shown) s += fmt::format("; and {} more", total - shown);
  return s.empty() ? "nothing" : s;
}

inline void UcxTransport::fail_op(std::uint32_t op, const std::string& why) {
  Op& o = ops_[op];
  if (o.error.empty()) o.error = why;
  o.stage = Stage::idle;
  ++events_;
}

inline void UcxTransport::close_by_force(std::size_t peer, const std::string& why) {
  Peer& p = *peers_[peer];
  if (!p.failed) {
    p.failed = true;
    p.failure = why;
  }
  for (auto& o : ops_)
    if (o.peer == peer) o.rkey = nullptr;
  for (auto& [id, rk] : p.rkeys) ucp_rkey_destroy(rk);
  p.rkeys.clear();
  for (ucp_ep_h* e : {&p.data, &p.ep}) {
    if (!*e || (e == &p.data && p.data == p.ep)) continue;
    if (void* r = ucx_detail::close_endpoint(*e, true)) ucp_request_free(r);  // UCX frees it when it completes
  }
  p.ep = p.data = nullptr;
  ++events_;
}

inline bool UcxTransport::puts_in_flight(std::uint32_t op) const {
  for (const Pending* p : live_)
    if ((p->kind == Pending::put_chunk && p->op == op) || (p->kind == Pending::flush && std::find(p->ops.begin(), p->ops.end(), op) != p->ops.end()))
      return true;
  const auto q = flush_queue_.find(ops_[op].peer);
  return q != flush_queue_.end() && std::find(q->second.begin(), q->second.end(), op) != q->second.end();
}

inline void UcxTransport::on_revoke(std::size_t peer, std::uint64_t uid, std::uint64_t epoch) {
  const auto it = by_uid_.find(uid);
  if (it == by_uid_.end() || ops_[it->second].peer != peer || ops_[it->second].op.kind != OpKind::send) {
    // Not a send of this rank's any more: its region went first, and that
    // deregistration waited for its puts to land.
    auto& q = revoked_queue_[peer];
    q.push_back(uid);
    q.push_back(epoch);
    return;
  }
  Op& o = ops_[it->second];
  o.ack_epoch = std::max(o.ack_epoch, epoch);
  if (!o.ack_owed) {
    o.ack_owed = true;
    acks_owed_.push_back(it->second);
  }
  settle_revokes();
}

inline void UcxTransport::settle_revokes() {
  std::erase_if(acks_owed_, [&](std::uint32_t op) {
    if (puts_in_flight(op)) return false;  // answered once they have landed (flushed) or failed
    Op& o = ops_[op];
    fail_op(op, fmt::format("rank {} deregistered the memory of the matching receive", peers_[o.peer]->rank));
    auto& q = revoked_queue_[o.peer];
    q.push_back(o.uid);
    q.push_back(o.ack_epoch);
    o.ack_owed = false;
    return true;
  });
}

inline void UcxTransport::revoke_receives(std::span<const std::uint32_t> recvs, std::string_view memory) {
  if (opt_.protocol != UcxProtocol::put || !worker_) return;
  std::map<std::size_t, std::vector<std::uint64_t>> msgs;  ///< by peer: (its send's uid, epoch) pairs
  std::vector<std::pair<std::size_t, std::uint64_t>> awaited;
  for (auto i : recvs) {
    const Op& o = ops_[i];
    if (o.op.kind != OpKind::recv || o.completed >= o.posts || peers_[o.peer]->failed) continue;
    auto& m = msgs[o.peer];
    m.push_back(o.remote_uid);
    m.push_back(o.posts);
    awaited.emplace_back(o.peer, o.remote_uid);
    revoking_.insert(awaited.back());
  }
  if (awaited.empty()) return;
  for (auto& [peer, m] : msgs) send_signal(peer, ucx_detail::AmType::revoke, {}, m);
  auto silent = [&](const std::pair<std::size_t, std::uint64_t>& a) {
    const Peer& p = *peers_[a.first];
    return revoking_.count(a) && !p.failed && !gave_up_.count(p.rank);
  };
  const auto until = Clock::now() + opt_.stall_timeout;
  while (std::any_of(awaited.begin(), awaited.end(), silent) && Clock::now() < until) {
    try {
      if (!progress()) sleep_a_little(until);  // progress() also answers the peers' revokes (both may be revoking)
    } catch (...) {
      // a peer failing shows in its Peer; keep listening until the bound
    }
  }
  const auto left = std::find_if(awaited.begin(), awaited.end(), silent);
  if (left != awaited.end())
    abort(fmt::format("rank {} released {} although rank {} had not confirmed within {} ms that it puts nothing more into it", me_, memory,
                      peers_[left->first]->rank, opt_.stall_timeout.count()));
  for (const auto& a : awaited) revoking_.erase(a);
}

inline bool UcxTransport::group_done(const Group& g) const {
  bool all = true;
  for (const auto& it : g.items) {
    const Op& o = ops_[it.op];
    if (o.completed >= it.epoch) continue;
    const Peer& p = *peers_[o.peer];
    if (!o.error.empty() || p.failed) {
      const std::string cause = p.failed ? fmt::format("peer rank {} failed ({})", p.rank, p.failure) : o.error;
      throw TransportError(fmt::format("ucx transport: rank {}: {} did not complete: {}", me_, describe(o), cause));
    }
    all = false;
  }
  return all;
}

// --- memory ------------------------------------------------------------------

inline RegionHandle UcxTransport::register_memory(void* p, std::size_t bytes, MemoryKind kind) {
  if (!worker_) throw TransportError(fmt::format("ucx transport: rank {}: not started", me_));
  if (kind != MemoryKind::host && !moves_device_memory())
    fail("ucx transport: rank {} registers device memory, but {}: use a CUDA-enabled UCX (e.g. the libucx-cu13 "
         "wheel) or the nccl transport",
         me_, cuda::ucx_memory(ctx_).summary());
  if (!p && bytes) fail("ucx transport: rank {} registers a null pointer for {} bytes", me_, bytes);
  Region r;
  r.ptr = static_cast<std::byte*>(p);
  r.bytes = bytes;
  if (bytes > 0) {
    ucp_mem_map_params_t mp{};
    mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH | UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE;
    mp.address = p;
    mp.length = bytes;
    mp.memory_type = kind == MemoryKind::host ? UCS_MEMORY_TYPE_HOST : UCS_MEMORY_TYPE_CUDA;
    const ucs_status_t st = ucp_mem_map(ctx_, &mp, &r.memh);
    if (st != UCS_OK)
      throw TransportError(fmt::format("ucx transport: rank {}: registering {} bytes at {} failed: {}", me_, bytes, p, ucx_detail::status_text(st)));
  }
  const std::uint32_t id = next_region_++;
  regions_.emplace(id, r);
  return RegionHandle{id};
}

inline void UcxTransport::deregister_memory(RegionHandle h) {
  auto it = regions_.find(h.id);
  if (it == regions_.end()) return;
  // Ops over the region die with it; one still in flight (a failed refit
  // drops its requests unwaited) fails, so no completion signal is sent for it.
  std::vector<std::uint32_t> dying;
  for (auto k = by_key_.begin(); k != by_key_.end();) {
    if (std::get<3>(k->first) == h.id) {
      for (auto op : k->second.ops) {
        by_uid_.erase(ops_[op].uid);
        dying.push_back(op);
        if (ops_[op].completed < ops_[op].posts)
          fail_op(op, fmt::format("rank {} deregistered region {} while it was in flight", me_, h.id));
      }
      k = by_key_.erase(k);
    } else {
      ++k;
    }
  }
  // Then nothing may touch the memory the caller frees next: tagged receives
  // into it are cancelled, the senders of put receives confirm they stopped
  // putting into it, and this rank's own puts out of it end.
  auto into_region = [&](const Pending* p) { return p->kind == Pending::tag_recv && p->req && ops_[p->op].op.region.id == h.id; };
  if (worker_ && cancel_receives(into_region))
    progress_until(Clock::now() + std::chrono::seconds(1), [&] { return std::none_of(live_.begin(), live_.end(), into_region); });
  revoke_receives(dying, fmt::format("region {}", h.id));
  // This rank's puts out of it end and land (a flush; 1 s bound): a receiver
  // that revokes after this is answered that nothing of them is put.
  std::set<std::size_t> putting_to;
  for (auto op : dying)
    if (ops_[op].op.kind == OpKind::send && !peers_[ops_[op].peer]->failed && puts_in_flight(op)) putting_to.insert(ops_[op].peer);
  if (worker_ && !putting_to.empty()) land_puts(putting_to, Clock::now() + std::chrono::seconds(1));
  // Whatever still reads it ends now. A tagged send out of it (a receiver
  // that gave up never takes a rendezvous send, and UCX sends the data
  // whenever the worker progresses next, even in the destructor), or a put
  // that did not land (a data endpoint without error handling to a dead
  // peer): their peers' endpoints are closed by force, after a moment.
  auto out_of_region = [&](const Pending* p) {
    return (p->kind == Pending::tag_send || p->kind == Pending::put_chunk) && p->req && ops_[p->op].op.region.id == h.id;
  };
  if (worker_ && std::any_of(live_.begin(), live_.end(), out_of_region)) {
    progress_until(Clock::now() + std::chrono::milliseconds(aborted_ ? 100 : 1000),
                   [&] { return std::none_of(live_.begin(), live_.end(), out_of_region); });
    std::set<std::size_t> stuck;
    for (const Pending* p : live_)
      if (out_of_region(p)) stuck.insert(ops_[p->op].peer);
    for (auto peer : stuck)
      close_by_force(peer, fmt::format("rank {} closed its endpoints to it: region {} was deregistered while sends out of it "
                                       "to that rank were in flight (an earlier refit failed)", me_, h.id));
    progress_until(Clock::now() + std::chrono::seconds(1), [&] { return std::none_of(live_.begin(), live_.end(), out_of_region); });
  }
  if (it->second.memh && worker_) ucp_mem_unmap(ctx_, it->second.memh);
  regions_.erase(it);
}

// --- bootstrap -------------------------------------------------------------

inline Blobs UcxTransport::all_gather(std::span<const std::byte> blob, Deadline deadline) {
  check_usable();
  // Longer than a wait's stall timeout: a peer that is stuck on a dead or
  // stalled rank times out first and tells this one why (abort), instead of
  // this rank giving up with only "the bootstrap timed out".
  const auto patience = opt_.stall_timeout + opt_.stall_timeout / 4 + std::chrono::seconds(1);
  const Deadline d = std::min(deadline, Clock::now() + patience);
  Blobs out = boot_.all_gather(blob, d, [this] {
    progress();
    if (aborted_) throw TransportError(abort_reason_);
  });
  if (out.size() != boot_.ranks.size())
    throw TransportError(fmt::format("ucx transport: rank {}: the bootstrap returned {} blobs for {} ranks", me_, out.size(), boot_.ranks.size()));
  traffic_.setup_bytes_sent += static_cast<std::int64_t>(blob.size());
  for (const auto& b : out) traffic_.setup_bytes_received += static_cast<std::int64_t>(b.size());
  return out;
}

inline Blobs UcxTransport::exchange(std::span<const PeerBlob> out, Deadline deadline) {
  check_usable();
  const std::uint64_t call = ++exchange_calls_;
  std::vector<std::size_t> peer(out.size());
  for (std::size_t i = 0; i < out.size(); ++i) {
    peer[i] = peer_index(out[i].peer);
    if (peer[i] == my_index_ || std::find(peer.begin(), peer.begin() + static_cast<std::ptrdiff_t>(i), peer[i]) != peer.begin() + static_cast<std::ptrdiff_t>(i))
      throw TransportError(fmt::format("ucx transport: rank {} lists rank {} {} in a pairwise exchange", me_, out[i].peer,
                                       peer[i] == my_index_ ? "(itself)" : "twice"));
  }
  exchange_error_.clear();
  for (std::size_t i = 0; i < out.size(); ++i) {
    auto* p = new Pending{};
    p->kind = Pending::exchange_send;
    p->t = this;
    p->peer = peer[i];
    p->header.type = static_cast<std::uint16_t>(ucx_detail::AmType::exchange);
    p->header.from = me_;
    p->payload.resize(sizeof(call) + out[i].bytes.size());
    std::memcpy(p->payload.data(), &call, sizeof(call));
    if (!out[i].bytes.empty()) std::memcpy(p->payload.data() + sizeof(call), out[i].bytes.data(), out[i].bytes.size());
    ucp_ep_h ep = nullptr;
    try {
      ep = ensure_ep(peer[i]);
    } catch (...) {
      delete p;
      throw;
    }
    ++exchange_sends_left_;
    send_am(p, ep);
  }
  auto unheard = [&] {
    std::vector<std::int64_t> m;
    for (const auto& o : out)
      if (!inbox_.count({o.peer, call})) m.push_back(o.peer);
    return m;
  };
  // Like all_gather's patience: longer than a wait's stall timeout.
  const Deadline d = std::min(deadline, Clock::now() + opt_.stall_timeout + opt_.stall_timeout / 4 + std::chrono::seconds(1));
  wait_until(
      [&] {
        if (!exchange_error_.empty()) throw TransportError(exchange_error_);
        for (std::size_t i = 0; i < out.size(); ++i)
          if (peers_[peer[i]]->failed && !inbox_.count({out[i].peer, call}))
            throw TransportError(fmt::format("ucx transport: rank {}: peer rank {} failed ({}) before it sent its setup blob", me_,
                                             out[i].peer, peers_[peer[i]]->failure));
        return exchange_sends_left_ == 0 && unheard().empty();
      },
      [&] {
        const auto m = unheard();
        return m.empty() ? fmt::format("{} setup blob sends", exchange_sends_left_)
                         : fmt::format("the setup blobs of rank{} {}", m.size() == 1 ? "" : "s", fmt::join(m, ", "));
      },
      d, "in a pairwise exchange");
  Blobs got(out.size());
  for (std::size_t i = 0; i < out.size(); ++i) {
    auto it = inbox_.find({out[i].peer, call});
    got[i] = std::move(it->second);
    inbox_.erase(it);
    traffic_.setup_bytes_sent += static_cast<std::int64_t>(out[i].bytes.size());
    traffic_.setup_bytes_received += static_cast<std::int64_t>(got[i].size());
  }
  return got;
}

inline void UcxTransport::prepare(std::span<const TransferOp> ops, Deadline deadline) {
  check_usable();
  const bool put = opt_.protocol == UcxProtocol::put;
  std::string error;
  const std::size_t first = ops_.size();
  std::vector<std::uint32_t> rkey_regions;  // receive regions whose keys we publish
  try {
    for (const auto& op : ops) {
      const std::size_t peer = peer_index(op.peer);
      auto rit = regions_.find(op.region.id);
      Op o;
      o.op = op;
      o.peer = peer;
      o.uid = next_uid_++;
      if (rit == regions_.end())
        throw TransportError(fmt::format("ucx transport: rank {}: {} uses region {} which is not registered", me_, describe(o), op.region.id));
      if (op.offset > rit->second.bytes || op.bytes > rit->second.bytes - op.offset)
        throw TransportError(fmt::format("ucx transport: rank {}: {} covers bytes [{}, {}) of a region of {} bytes", me_, describe(o), op.offset,
                                         op.offset + op.bytes, rit->second.bytes));
      if (put && op.kind == OpKind::recv && op.bytes > 0 &&
          std::find(rkey_regions.begin(), rkey_regions.end(), op.region.id) == rkey_regions.end())
        rkey_regions.push_back(op.region.id);
      ops_.push_back(std::move(o));
    }
  } catch (const std::exception& e) {
    error = e.what();
  }
  // Signals for the new ops may arrive as soon as a peer has finished
  // prepare(), possibly before this rank has: make them findable now.
  for (std::size_t i = first; i < ops_.size(); ++i) by_uid_.emplace(ops_[i].uid, static_cast<std::uint32_t>(i));
  auto drop_new = [&] {
    for (std::size_t i = first; i < ops_.size(); ++i) by_uid_.erase(ops_[i].uid);
    ops_.resize(first);
  };
  // 1. Status, and the balance of this rank's ops over the job (one uint64:
  //    zero when every send has its receive), through one fixed-size all_gather.
  PairBalance balance;
  for (std::size_t i = first; i < ops_.size(); ++i) {
    const TransferOp& op = ops_[i].op;
    const bool send = op.kind == OpKind::send;
    balance.add(send, send ? me_ : op.peer, send ? op.peer : me_, {op.tag, op.bytes});
  }
  bool balanced = false;
  try {
    balanced = gather_setup_status(*this, ucx_detail::kMagic, fmt::format("ucx transport: rank {}", me_), error, balance.sum, deadline);
  } catch (...) {
    drop_new();
    throw;
  }

  // 2. Each peer gets this rank's ops with it (and, for puts, the keys of
  //    the receive regions it writes): pairwise when the balance is zero,
  //    else through an all_gather that lets the mismatch be named.
  std::vector<PeerBlob> out;
  {
    std::map<std::size_t, std::vector<std::uint32_t>> keyed;  // peer -> receive regions it writes
    std::map<std::size_t, std::vector<std::size_t>> by_peer;   // peer -> this rank's new ops with it
    for (std::size_t i = first; i < ops_.size(); ++i) {
      const Op& o = ops_[i];
      by_peer[o.peer].push_back(i);
      if (put && o.op.kind == OpKind::recv && o.op.bytes > 0) {
        auto& k = keyed[o.peer];
        if (std::find(k.begin(), k.end(), o.op.region.id) == k.end()) k.push_back(o.op.region.id);
      }
    }
    std::map<std::uint32_t, std::vector<std::byte>> packed;  // region -> packed remote key
    for (const auto& [peer, list] : by_peer) {
      BlobWriter pw;
      const auto& regions = keyed[peer];
      pw.put<std::uint32_t>(static_cast<std::uint32_t>(regions.size()));
      for (auto id : regions) {
        auto pk = packed.find(id);
        if (pk == packed.end()) {
          void* buf = nullptr;
          std::size_t len = 0;
          const ucs_status_t st = ucp_rkey_pack(ctx_, regions_.at(id).memh, &buf, &len);
          if (st != UCS_OK) {
            if (error.empty())
              error = fmt::format("ucx transport: rank {}: packing the remote key of region {} failed: {}", me_, id, ucx_detail::status_text(st));
            buf = nullptr;
            len = 0;
          }
          pk = packed.emplace(id, std::vector<std::byte>(static_cast<std::byte*>(buf), static_cast<std::byte*>(buf) + len)).first;
          if (buf) ucp_rkey_buffer_release(buf);
        }
        pw.put<std::uint32_t>(id);
        pw.put_bytes(pk->second.data(), pk->second.size());
      }
      pw.put<std::uint64_t>(list.size());
      for (auto i : list) {
        const Op& o = ops_[i];
        pw.put<std::uint8_t>(o.op.kind == OpKind::send ? 0 : 1);
        pw.put<std::uint64_t>(o.op.tag);
        pw.put<std::uint64_t>(o.op.bytes);
        pw.put<std::uint64_t>(o.uid);
        const bool keyed_op = put && o.op.kind == OpKind::recv && o.op.bytes > 0;
        pw.put<std::uint64_t>(keyed_op ? reinterpret_cast<std::uint64_t>(regions_.at(o.op.region.id).ptr + o.op.offset) : 0);
        pw.put<std::uint32_t>(keyed_op ? o.op.region.id : UINT32_MAX);
      }
      out.push_back(PeerBlob{boot_.ranks[peer], std::move(pw.buf)});
    }
  }
  std::vector<PeerBlob> got;
  try {
    got = exchange_with_peers(*this, out, balanced, deadline);
  } catch (...) {
    drop_new();
    throw;
  }

  // 3. Match every new op with the peer's op of the other kind, same tag, same occurrence.
  struct Theirs {
    std::uint64_t bytes, uid, addr;
    std::uint32_t region;
  };
  try {
    if (!error.empty()) throw TransportError(error);
    std::map<std::size_t, std::map<std::pair<std::uint8_t, std::uint64_t>, std::vector<Theirs>>> theirs;  // peer -> (their kind, tag) -> ops
    std::map<std::size_t, std::map<std::uint32_t, std::span<const std::byte>>> keys;
    std::vector<char> talks(boot_.ranks.size(), 0);
    for (std::size_t i = first; i < ops_.size(); ++i) talks[ops_[i].peer] = 1;
    for (const auto& g : got) {
      const std::size_t r = peer_index(g.peer);
      BlobReader rd(g.bytes, g.peer, "prepare");
      const auto nk = rd.get<std::uint32_t>();
      for (std::uint32_t k = 0; k < nk; ++k) {
        const auto id = rd.get<std::uint32_t>();
        keys[r][id] = rd.get_bytes();
      }
      const auto m = rd.get<std::uint64_t>();
      for (std::uint64_t k = 0; k < m; ++k) {
        const auto kind = rd.get<std::uint8_t>();
        const auto tag = rd.get<std::uint64_t>();
        Theirs t{};
        t.bytes = rd.get<std::uint64_t>();
        t.uid = rd.get<std::uint64_t>();
        t.addr = rd.get<std::uint64_t>();
        t.region = rd.get<std::uint32_t>();
        if (!talks[r])
          throw TransportError(fmt::format("ucx transport: rank {}: rank {} prepared a {} of {} bytes with this rank (tag {:#x}) but this rank "
                                           "prepared nothing with rank {}",
                                           me_, g.peer, kind == 0 ? "send" : "receive", t.bytes, tag, g.peer));
        theirs[r][{kind, tag}].push_back(t);
      }
    }
    std::map<std::tuple<std::size_t, std::uint8_t, std::uint64_t>, std::size_t> used;
    for (std::size_t i = first; i < ops_.size(); ++i) {
      Op& o = ops_[i];
      const std::uint8_t want = o.op.kind == OpKind::send ? 1 : 0;  // the peer's kind
      auto& list = theirs[o.peer][{want, o.op.tag}];
      auto& k = used[{o.peer, want, o.op.tag}];
      if (k >= list.size())
        throw TransportError(fmt::format("ucx transport: rank {}: {} has no matching {} prepared on rank {}", me_, describe(o),
                                         want ? "receive" : "send", o.op.peer));
      const Theirs& t = list[k++];
      if (t.bytes != o.op.bytes)
        throw TransportError(fmt::format("ucx transport: size mismatch: {} but rank {} prepared a {} of {} bytes", describe(o), o.op.peer,
                                         want ? "receive" : "send", t.bytes));
      o.remote_uid = t.uid;
      if (put && o.op.kind == OpKind::send && o.op.bytes > 0) {
        o.remote_addr = t.addr;
        Peer& p = *peers_[o.peer];
        ensure_ep(o.peer);
        auto rk = p.rkeys.find(t.region);
        if (rk == p.rkeys.end()) {
          auto kit = keys[o.peer].find(t.region);
          if (kit == keys[o.peer].end())
            throw TransportError(fmt::format("ucx transport: rank {}: rank {} published no remote key for its region {}", me_, o.op.peer, t.region));
          ucp_rkey_h h = nullptr;
          const ucs_status_t st = ucp_ep_rkey_unpack(p.data, kit->second.data(), &h);
          if (st != UCS_OK)
            throw TransportError(fmt::format("ucx transport: rank {}: unpacking rank {}'s remote key failed: {}", me_, o.op.peer, ucx_detail::status_text(st)));
          rk = p.rkeys.emplace(t.region, h).first;
        }
        o.rkey = rk->second;
      }
    }
    for (auto& [r, lists] : theirs)
      for (auto& [key, list] : lists) {
        const std::size_t k = used[{r, key.first, key.second}];
        if (k < list.size())
          throw TransportError(fmt::format("ucx transport: rank {}: rank {} prepared a {} of {} bytes with this rank (tag {:#x}) that this rank "
                                           "has no {} for",
                                           me_, boot_.ranks[r], key.first == 0 ? "send" : "receive", list[k].bytes, key.second,
                                           key.first == 0 ? "receive" : "send"));
      }
    for (std::size_t i = first; i < ops_.size(); ++i) ensure_ep(ops_[i].peer);
  } catch (const std::exception& e) {
    if (error.empty()) error = e.what();
  }
  // 4. Everyone learns whether everyone succeeded.
  BlobWriter w2;
  w2.put<std::uint8_t>(error.empty() ? 1 : 0);
  w2.put_string(error);
  Blobs st;
  try {
    st = all_gather(w2.buf, deadline);
  } catch (...) {
    drop_new();
    throw;
  }
  if (!error.empty()) {
    drop_new();
    throw TransportError(error);
  }
  for (std::size_t r = 0; r < st.size(); ++r) {
    BlobReader rd(st[r], boot_.ranks[r], "prepare status");
    const bool ok = rd.get<std::uint8_t>() != 0;
    const std::string msg = rd.get_string();
    if (!ok) {
      drop_new();
      throw TransportError(fmt::format("ucx transport: rank {}: prepare failed on rank {}: {}", me_, boot_.ranks[r], msg));
    }
  }
  for (std::size_t i = first; i < ops_.size(); ++i) {
    Op& o = ops_[i];
    const OpKey key{static_cast<std::uint8_t>(o.op.kind), o.op.peer, o.op.tag, o.op.region.id, o.op.offset, o.op.bytes};
    by_key_[key].ops.push_back(static_cast<std::uint32_t>(i));
  }
}

// --- data movement -----------------------------------------------------------

inline UcxTransport::request UcxTransport::post(std::span<const TransferOp> ops) {
  check_usable();
  auto g = std::make_shared<Group>();
  g->rank = me_;
  std::vector<std::uint32_t> idx(ops.size());
  std::map<OpKey, std::size_t> taken;
  for (std::size_t i = 0; i < ops.size(); ++i) {
    const auto& op = ops[i];
    const OpKey key{static_cast<std::uint8_t>(op.kind), op.peer, op.tag, op.region.id, op.offset, op.bytes};
    auto it = by_key_.find(key);
    if (it == by_key_.end() || it->second.ops.empty()) {
      Op tmp;
      tmp.op = op;
      throw TransportError(fmt::format("ucx transport: rank {}: {} (region {}, offset {}) was not prepared: prepare() the program's ops first",
                                       me_, describe(tmp), op.region.id, op.offset));
    }
    auto& kl = it->second;
    const std::size_t k = (kl.cursor + taken[key]++) % kl.ops.size();
    const std::uint32_t o = kl.ops[k];
    const Op& ro = ops_[o];
    if (!ro.error.empty())
      throw TransportError(fmt::format("ucx transport: rank {}: {} failed earlier: {}", me_, describe(ro), ro.error));
    if (ro.completed < ro.posts)
      throw TransportError(fmt::format("ucx transport: rank {}: {} posted again before its previous post completed", me_, describe(ro)));
    const Peer& p = *peers_[ro.peer];
    if (p.failed) throw TransportError(fmt::format("ucx transport: rank {}: cannot post {}: peer rank {} failed ({})", me_, describe(ro), p.rank, p.failure));
    idx[i] = o;
  }
  for (auto& [key, cnt] : taken) {
    auto& kl = by_key_[key];
    kl.cursor = (kl.cursor + cnt) % kl.ops.size();
  }
  std::map<std::size_t, std::pair<std::vector<std::uint32_t>, std::vector<std::uint64_t>>> ready;
  for (auto o : idx) {
    Op& op = ops_[o];
    op.error.clear();
    const std::uint64_t epoch = ++op.posts;
    g->items.push_back(Item{o, epoch});
    if (opt_.protocol == UcxProtocol::tag) {
      start_tag(o);
    } else if (op.op.kind == OpKind::recv) {
      op.stage = Stage::in_flight;
      auto& r = ready[op.peer];
      r.first.push_back(o);
      r.second.push_back(op.remote_uid);
      r.second.push_back(epoch);
    } else if (op.signals >= epoch) {
      start_puts(o);
    } else {
      op.stage = Stage::wait_ready;
    }
  }
  for (auto& [peer, r] : ready) send_signal(peer, ucx_detail::AmType::ready, r.first, r.second);
  pump();
  return g;
}

inline void UcxTransport::start_tag(std::uint32_t o) {
  Op& op = ops_[o];
  const Region& reg = regions_.at(op.op.region.id);
  auto* p = new Pending{};
  p->kind = op.op.kind == OpKind::send ? Pending::tag_send : Pending::tag_recv;
  p->t = this;
  p->op = o;
  ucp_request_param_t prm{};
  prm.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  prm.user_data = p;
  if (reg.memh) {
    prm.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
    prm.memh = reg.memh;
  }
  op.stage = Stage::in_flight;
  void* buf = reg.ptr + op.op.offset;
  if (op.op.kind == OpKind::send) {
    prm.cb.send = &UcxTransport::on_send_done;
    ucp_ep_h ep = nullptr;
    try {
      ep = data_ep(op.peer);
    } catch (...) {
      delete p;
      throw;
    }
    launch(p, [&] { return ucp_tag_send_nbx(ep, buf, op.op.bytes, op.remote_uid, &prm); });
  } else {
    prm.cb.recv = &UcxTransport::on_recv_done;
    // UCX 1.13 leaves recv_info unfilled on immediate completion: always
    // complete through the callback, which reports the received length.
    prm.op_attr_mask |= UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
    launch(p, [&] { return ucp_tag_recv_nbx(worker_, buf, op.op.bytes, op.uid, ~ucp_tag_t{0}, &prm); });
  }
}

inline void UcxTransport::start_puts(std::uint32_t o) {
  Op& op = ops_[o];
  if (op.op.bytes == 0) {
    op.stage = Stage::signalling;
    signal_queue_[op.peer].push_back(o);
    return;
  }
  const Region& reg = regions_.at(op.op.region.id);
  ucp_ep_h ep = data_ep(op.peer);
  const std::uint64_t chunk = opt_.put_chunk;
  op.chunks_left = static_cast<std::uint32_t>((op.op.bytes + chunk - 1) / chunk);
  op.stage = Stage::putting;
  for (std::uint64_t off = 0; off < op.op.bytes; off += chunk) {
    const std::uint64_t len = std::min<std::uint64_t>(chunk, op.op.bytes - off);
    auto* p = new Pending{};
    p->kind = Pending::put_chunk;
    p->t = this;
    p->op = o;
    ucp_request_param_t prm{};
    prm.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_MEMH;
    prm.cb.send = &UcxTransport::on_send_done;
    prm.user_data = p;
    prm.memh = reg.memh;
    ++traffic_.puts;
    launch(p, [&] { return ucp_put_nbx(ep, reg.ptr + op.op.offset + off, len, op.remote_addr + off, op.rkey, &prm); });
    if (!op.error.empty()) return;
  }
}

inline void UcxTransport::flush_data(std::size_t peer, std::vector<std::uint32_t> ops) {
  auto* p = new Pending{};
  p->kind = Pending::flush;
  p->t = this;
  p->peer = peer;
  p->ops = std::move(ops);
  ucp_request_param_t prm{};
  prm.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  prm.cb.send = &UcxTransport::on_send_done;
  prm.user_data = p;
  ++traffic_.flushes;
  launch(p, [&] { return ucp_ep_flush_nbx(peers_[peer]->data, &prm); });
}

inline void UcxTransport::send_signal(std::size_t peer, ucx_detail::AmType type, const std::vector<std::uint32_t>& ops,
                                      const std::vector<std::uint64_t>& uid_epochs) {
  auto* p = new Pending{};
  p->kind = Pending::signal;
  p->t = this;
  p->peer = peer;
  p->ops = ops;
  p->header.type = static_cast<std::uint16_t>(type);
  p->header.from = me_;
  p->payload.resize(uid_epochs.size() * 8);
  std::memcpy(p->payload.data(), uid_epochs.data(), p->payload.size());
  ucp_ep_h ep = nullptr;
  try {
    ep = ensure_ep(peer);
  } catch (const std::exception& e) {
    for (auto o : ops) fail_op(o, e.what());
    delete p;
    return;
  }
  traffic_.signals_sent += static_cast<std::int64_t>(ops.size());
  send_am(p, ep);
}

inline bool UcxTransport::progress() {
  const std::uint64_t before = events_;
  unsigned n = 0;
  for (int k = 0; k < 64; ++k) {
    const unsigned m = ucp_worker_progress(worker_);
    n += m;
    if (m == 0) break;
  }
  pump();
  return n > 0 || events_ != before;
}

inline void UcxTransport::pump() {
  // Sends whose receivers got ready: put.
  while (!ready_queue_.empty()) {
    auto q = std::move(ready_queue_);
    ready_queue_.clear();
    for (auto o : q) {
      Op& op = ops_[o];
      if (op.stage != Stage::wait_ready || op.signals < op.posts || !op.error.empty()) continue;
      // Aborted (here or by a peer's message): no new puts, a failed peer may free the memory it offered.
      if (aborted_)
        fail_op(o, abort_reason_);
      else
        start_puts(o);
    }
  }
  // Data put: one flush per peer for all of it.
  while (!flush_queue_.empty()) {
    auto q = std::move(flush_queue_);
    flush_queue_.clear();
    for (auto& [peer, list] : q) flush_data(peer, std::move(list));
  }
  // Data landed: one completion signal per peer.
  while (!signal_queue_.empty()) {
    auto q = std::move(signal_queue_);
    signal_queue_.clear();
    for (auto& [peer, list] : q) {
      std::vector<std::uint64_t> ue;
      for (auto o : list) {
        ue.push_back(ops_[o].remote_uid);
        ue.push_back(ops_[o].posts);
      }
      send_signal(peer, ucx_detail::AmType::done, list, ue);
    }
  }
  answer_revokes(true);
}

inline void UcxTransport::answer_revokes(bool may_connect) {
  while (!revoked_queue_.empty()) {
    auto q = std::move(revoked_queue_);
    revoked_queue_.clear();
    for (auto& [peer, ue] : q)
      if (may_connect || peers_[peer]->ep) send_signal(peer, ucx_detail::AmType::revoked, {}, ue);
  }
}

inline void UcxTransport::sleep_a_little(Clock::time_point until) {
  const auto now = Clock::now();
  if (until <= now) return;
  auto span = std::min<Clock::duration>(until - now, opt_.max_sleep);
  if (efd_ >= 0) {
    const ucs_status_t st = ucp_worker_arm(worker_);
    if (st == UCS_ERR_BUSY) return;  // events are waiting: progress
    if (st == UCS_OK) {
      pollfd pfd{efd_, POLLIN, 0};
      const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(span).count();
      timespec ts{static_cast<time_t>(ns / 1'000'000'000), static_cast<long>(ns % 1'000'000'000)};
      ppoll(&pfd, 1, &ts, nullptr);
      return;
    }
  }
  const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(std::min<Clock::duration>(span, std::chrono::microseconds(100))).count();
  timespec ts{0, static_cast<long>(ns)};
  nanosleep(&ts, nullptr);
}

template <class Done, class Describe>
void UcxTransport::wait_until(Done&& done, Describe&& describe_pending_ops, Deadline deadline, const char* what) {
  std::uint64_t seen = events_;
  auto moved = Clock::now();
  int idle = 0;
  while (true) {
    const bool any = progress();
    try {
      if (done()) return;
    } catch (const TransportError& e) {
      // An op failed, usually with its peer. When that peer gave up because
      // of a third rank it told us so just before: listen a moment, and lead
      // with the cause rather than the consequence.
      const auto until = Clock::now() + opt_.failure_linger;
      while (!aborted_ && Clock::now() < until)
        if (!progress()) sleep_a_little(until);
      if (aborted_) throw TransportError(fmt::format("{} (then: {})", abort_reason_, e.what()));
      throw;
    }
    if (aborted_) throw TransportError(abort_reason_);
    const auto now = Clock::now();
    if (events_ != seen) {  // only our own events count as movement: UCX may report internal work forever
      seen = events_;
      moved = now;
    }
    if (now >= deadline)
      throw TransportError(fmt::format("ucx transport: rank {} timed out {}: {}", me_, what, describe_pending_ops()));
    if (now - moved >= opt_.stall_timeout)
      throw TransportError(fmt::format("ucx transport: rank {}: nothing moved for {} s {}: {}", me_,
                                       std::chrono::duration<double>(opt_.stall_timeout).count(), what, describe_pending_ops()));
    if (any) {
      idle = 0;
      continue;
    }
    if (++idle <= opt_.spin) {
      if (idle > opt_.spin / 2) sched_yield();
      continue;
    }
    sleep_a_little(std::min(deadline, moved + opt_.stall_timeout));
  }
}

inline bool UcxTransport::test(request& r) {
  if (!r) fail("ucx transport: test on an empty request (rank {})", me_);
  check_usable();
  progress();
  if (aborted_) throw TransportError(abort_reason_);
  return group_done(*r);
}

inline void UcxTransport::wait(request& r, Deadline deadline) {
  if (!r) fail("ucx transport: wait on an empty request (rank {})", me_);
  check_usable();
  const Group* g = r.get();
  wait_until([&] { return group_done(*g); },
             [&] {
               const Group* gs[1] = {g};
               return pending_text(gs);
             },
             deadline, "waiting for");
}

inline std::size_t UcxTransport::wait_any(std::span<request* const> rs, Deadline deadline) {
  if (rs.empty()) fail("ucx transport: wait_any on no requests (rank {})", me_);
  for (auto* r : rs)
    if (!r || !*r) fail("ucx transport: wait_any on an empty request (rank {})", me_);
  check_usable();
  std::size_t found = rs.size();
  wait_until(
      [&] {
        for (std::size_t i = 0; i < rs.size(); ++i)
          if (group_done(**rs[i])) {
            found = i;
            return true;
          }
        return false;
      },
      [&] {
        std::vector<const Group*> gs;
        for (auto* r : rs) gs.push_back(r->get());
        return pending_text(gs);
      },
      deadline, "waiting for");
  return found;
}

inline void UcxTransport::abort(std::string_view why) noexcept {
  if (aborted_ || !worker_) return;
  try {
    aborted_ = true;
    abort_reason_ = fmt::format("ucx transport: rank {} gave up: {}", me_, why);
    const std::string text(why);
    // Puts first land (bounded): a peer that hears this rank gave up stops
    // waiting for it to answer a revoke (revoke_receives()), and this rank
    // starts no puts from now on.
    if (opt_.protocol == UcxProtocol::put) {
      std::set<std::size_t> putting_to;
      for (std::size_t i = 0; i < peers_.size(); ++i)
        if (i != my_index_ && !peers_[i]->failed && peers_[i]->data) putting_to.insert(i);
      land_puts(putting_to, Clock::now() + opt_.abort_linger);
    }
    for (std::size_t i = 0; i < peers_.size(); ++i) {
      if (i == my_index_ || peers_[i]->failed) continue;
      ucp_ep_h ep = nullptr;
      try {
        ep = ensure_ep(i);
      } catch (...) {
        continue;
      }
      auto* p = new Pending{};
      p->kind = Pending::abort_msg;
      p->t = this;
      p->peer = i;
      p->header.type = static_cast<std::uint16_t>(ucx_detail::AmType::abort);
      p->header.from = me_;
      p->payload.assign(reinterpret_cast<const std::byte*>(text.data()), reinterpret_cast<const std::byte*>(text.data()) + text.size());
      send_am(p, ep);
    }
    // Give the messages a moment to leave (bounded; peers may be dead).
    const auto sent_by = Clock::now() + opt_.abort_linger;
    while (!live_.empty() && Clock::now() < sent_by)
      if (ucp_worker_progress(worker_) == 0) sleep_a_little(sent_by);
  } catch (...) {
    aborted_ = true;
  }
}

// --- raw bandwidth probe -----------------------------------------------------

inline UcxBandwidth UcxTransport::measure_bandwidth(std::int64_t from, std::int64_t to, std::size_t bytes, int iterations, Deadline deadline,
                                                    UcxProtocol how) {
  check_usable();
  if (from == to) fail("ucx transport: the bandwidth probe needs two different ranks (got {} twice)", from);
  const std::size_t fi = peer_index(from), ti = peer_index(to);
  if (bytes == 0 || iterations < 1) fail("ucx transport: the bandwidth probe needs bytes > 0 and iterations >= 1");
  UcxBandwidth out;
  out.from = from;
  out.to = to;
  out.bytes = bytes;
  out.iterations = iterations;
  out.protocol = how;
  const bool put = how == UcxProtocol::put;
  constexpr ucp_tag_t kProbeTag = 0xFFFF'0000'0000'0000ull;  // op tags are small ids: no clash
  std::vector<std::byte> buf;
  ucp_mem_h memh = nullptr;
  std::string error;
  try {
    if (me_ == from || me_ == to) {
      buf.assign(bytes, std::byte{static_cast<unsigned char>(me_ == from ? 0x11 : 0)});  // touch every page now
      ucp_mem_map_params_t mp{};
      mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
      mp.address = buf.data();
      mp.length = bytes;
      const ucs_status_t st = ucp_mem_map(ctx_, &mp, &memh);
      if (st != UCS_OK) throw TransportError(fmt::format("ucx transport: rank {}: registering the probe buffer failed: {}", me_, ucx_detail::status_text(st)));
      ensure_ep(me_ == from ? ti : fi);
    }
  } catch (const std::exception& e) {
    error = e.what();
  }
  BlobWriter w;
  w.put<std::uint8_t>(error.empty() ? 1 : 0);
  w.put_string(error);
  if (me_ == to && error.empty() && put) {
    void* kb = nullptr;
    std::size_t kl = 0;
    const ucs_status_t st = ucp_rkey_pack(ctx_, memh, &kb, &kl);
    w.put<std::uint64_t>(reinterpret_cast<std::uint64_t>(buf.data()));
    w.put_bytes(kb, st == UCS_OK ? kl : 0);
    if (st == UCS_OK) ucp_rkey_buffer_release(kb);
  }
  auto cleanup = [&] {
    if (memh) ucp_mem_unmap(ctx_, memh);
    memh = nullptr;
  };
  Blobs blobs;
  try {
    blobs = all_gather(w.buf, deadline);
    for (std::size_t r = 0; r < blobs.size(); ++r) {
      BlobReader rd(blobs[r], boot_.ranks[r], "probe");
      if (!rd.get<std::uint8_t>())
        throw TransportError(fmt::format("ucx transport: rank {}: the bandwidth probe failed on rank {}: {}", me_, boot_.ranks[r], rd.get_string()));
    }
  } catch (...) {
    cleanup();
    throw;
  }
  // One operation of the probe, waited for.
  auto run = [&](Pending::Kind kind, auto&& start, const char* what) {
    probe_left_ = 1;
    probe_status_ = UCS_OK;
    auto* p = new Pending{};
    p->kind = kind;
    p->t = this;
    ucp_request_param_t prm{};
    prm.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_MEMH;
    prm.user_data = p;
    prm.memh = memh;
    launch(p, [&] { return start(prm, p); });
    const std::size_t other = me_ == from ? ti : fi;
    wait_until([&] { return probe_left_ <= 0 || peers_[other]->failed; }, [&] { return fmt::format("{} (rank {})", what, peers_[other]->rank); },
               deadline, "in the bandwidth probe");
    if (peers_[other]->failed || probe_status_ != UCS_OK)
      throw TransportError(fmt::format("ucx transport: rank {}: {} failed: {}", me_, what,
                                       peers_[other]->failed ? fmt::format("peer rank {} failed ({})", peers_[other]->rank, peers_[other]->failure)
                                                             : ucx_detail::status_text(probe_status_)));
  };
  double seconds = 0;
  error.clear();
  try {
    if (me_ == from) {
      ucp_ep_h ep = data_ep(ti);
      ucp_rkey_h rkey = nullptr;
      std::uint64_t raddr = 0;
      if (put) {
        BlobReader rd(blobs[ti], to, "probe");
        rd.get<std::uint8_t>();
        rd.get_string();
        raddr = rd.get<std::uint64_t>();
        auto key = rd.get_bytes();
        const ucs_status_t st = ucp_ep_rkey_unpack(ep, key.data(), &rkey);
        if (st != UCS_OK) throw TransportError(fmt::format("ucx transport: rank {}: unpacking the probe key failed: {}", me_, ucx_detail::status_text(st)));
      }
      auto round = [&] {
        if (put) {
          run(Pending::probe_put, [&](ucp_request_param_t& prm, Pending*) {
                prm.cb.send = &UcxTransport::on_send_done;
                return ucp_put_nbx(ep, buf.data(), bytes, raddr, rkey, &prm);
              }, "the probe's put");
          run(Pending::probe_flush, [&](ucp_request_param_t& prm, Pending*) {
                prm.op_attr_mask &= ~UCP_OP_ATTR_FIELD_MEMH;
                prm.cb.send = &UcxTransport::on_send_done;
                return ucp_ep_flush_nbx(ep, &prm);
              }, "the probe's flush");
        } else {
          run(Pending::probe_put, [&](ucp_request_param_t& prm, Pending*) {
                prm.cb.send = &UcxTransport::on_send_done;
                return ucp_tag_send_nbx(ep, buf.data(), bytes, kProbeTag, &prm);
              }, "the probe's tagged send");
        }
      };
      try {
        round();  // warm-up: connection, registration caches
        const auto t0 = Clock::now();
        for (int i = 0; i < iterations; ++i) round();
        seconds = std::chrono::duration<double>(Clock::now() - t0).count();
      } catch (...) {
        if (rkey) ucp_rkey_destroy(rkey);
        throw;
      }
      if (rkey) ucp_rkey_destroy(rkey);
      if (put) {
        // Tell the target it may stop progressing (puts over TCP land only while it does).
        auto* p = new Pending{};
        p->kind = Pending::abort_msg;  // fire and forget
        p->t = this;
        p->header.type = static_cast<std::uint16_t>(ucx_detail::AmType::probe);
        p->header.from = me_;
        p->payload.resize(sizeof(double));
        std::memcpy(p->payload.data(), &seconds, sizeof(double));
        ucp_ep_h ctl = ensure_ep(ti);
        send_am(p, ctl);
      }
    } else if (me_ == to) {
      if (put) {
        wait_until([&] { return probe_seconds_.has_value() || peers_[fi]->failed; },
                   [&] { return fmt::format("the end of rank {}'s bandwidth probe", from); }, deadline, "in the bandwidth probe");
        if (!probe_seconds_)
          throw TransportError(fmt::format("ucx transport: rank {}: peer rank {} failed during the bandwidth probe ({})", me_, from, peers_[fi]->failure));
        probe_seconds_.reset();
      } else {
        for (int i = 0; i <= iterations; ++i)
          run(Pending::probe_put, [&](ucp_request_param_t& prm, Pending*) {
                prm.cb.recv = &UcxTransport::on_recv_done;
                return ucp_tag_recv_nbx(worker_, buf.data(), bytes, kProbeTag, ~ucp_tag_t{0}, &prm);
              }, "the probe's tagged receive");
      }
    }
  } catch (const std::exception& e) {
    error = e.what();
  }
  BlobWriter w2;
  w2.put<std::uint8_t>(error.empty() ? 1 : 0);
  w2.put_string(error);
  w2.put(seconds);
  try {
    blobs = all_gather(w2.buf, deadline);
  } catch (...) {
    cleanup();
    throw;
  }
  cleanup();
  for (std::size_t r = 0; r < blobs.size(); ++r) {
    BlobReader rd(blobs[r], boot_.ranks[r], "probe result");
    const bool ok = rd.get<std::uint8_t>() != 0;
    const std::string msg = rd.get_string();
    if (!ok) throw TransportError(fmt::format("ucx transport: rank {}: the bandwidth probe failed on rank {}: {}", me_, boot_.ranks[r], msg));
    const double s = rd.get<double>();
    if (r == fi) seconds = s;
  }
  out.seconds = seconds;
  out.gb_per_s = seconds > 0 ? static_cast<double>(bytes) * iterations / seconds / 1e9 : 0;
  return out;
}

}  // namespace reshard
