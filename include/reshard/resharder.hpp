#pragma once
// Resharder<Layout, Transport>: the object a training engine holds on each
// rank. Built once from the two layouts (training and inference), this rank's
// local buffers and a transport endpoint; refit() moves the weights every RL
// step by replaying the schedule the executor compiled at setup.
//
//   reshard::LocalBuffers bufs;
//   bufs.src["qkv"] = reshard::view_of(qkv_ptr, qkv_elements);      // pointer + size
//   bufs.dst["qkv_proj"] = reshard::strided_view(p, {rows, cols}, {pitch, 1});
//   reshard::Resharder<reshard::Layout, reshard::LocalTransport> r(train, infer, bufs, transport);
//   auto report = r.refit();   // collective: every rank of the world calls it
//
// With two static layouts of one type (Layout = st::LayoutOf<Mesh>, see the
// class), memory bound through their typed handles is checked at compile time:
//   auto w = train.add<reshard::bf16_t>(st::Tensor<Col>("w", {4096, 4096}, DType::bf16));
//   reshard::bind_tensor(bufs.src, w, std::span<const reshard::bf16_t>(w_shard));  // a float span does not compile
//
// When peers touch this rank's memory: only inside refit() (and setup(),
// which registers it). Peers read the source buffers and write the
// destination buffers (or, double-buffered, the set not being served) while
// a refit runs, by messages or one-sided puts. When refit() returns, every
// transfer of that refit has ended and the buffers are the caller's until the
// next refit(). When it throws, the transport is aborted, but a peer that has
// not yet seen the failure may still put into a destination registered for
// one-sided puts (the put protocol) until that transport is destroyed:
// only into buffers the failure names as written in part (a put needs a
// receive posted before the failure), and the memory is lent until then. The caller must not write the sources during a refit.
//
// Misuse is a reshard::Error naming the rank and the buffer: a missing or
// unknown buffer, one too small for its layout, a wrong element size, a view
// whose shape is not the layout's, overlapping destination memory, refit()
// before setup(). A failed refit throws (and aborts the transport so the
// peers fail too); it never returns a report.
//
// Versioned refits. Every refit carries a version (refit() takes the next
// number, refit(v) a caller's; all ranks pass the same, increasing). refit()
// returns only when this rank's part of that version arrived (and, with
// ExecutorOptions::checksum, passed its checks) AND every rank of the world
// said so: after its run each rank joins one bootstrap all-gather of verdicts
// (rank, ok, version, error), so success is decided here, in one place, and a
// rank that exchanged nothing with a failed peer does not report success.
// Otherwise refit() throws RefitNotCommitted and records a StaleReport
// (last_failure(): the version, the first error, the ranks that failed, per
// peer which messages and tensors did not arrive checked on this rank, and
// DestinationWrites: which of this rank's destination buffers the failed
// refit wrote entirely, in part, or not at all, true of their memory; the
// error carries the same, and its message says so, buffer by buffer).
//   state() == RefitState::current  the destination holds last_good_version(), complete
//   state() == RefitState::stale    single-buffered: a refit wrote part of the
//                                   destination and failed; stale_tensors() says which
//                                   tensors lack pieces of it on this rank
// After a failure the Resharder refuses to refit until setup() runs again
// (with a fresh transport when the old one was aborted); versions and state
// survive setup().
//
// Double-buffered mode (ResharderOptions::double_buffered): the caller also
// binds LocalBuffers::dst_back, a second destination set of the same shapes.
// Inference reads serving_buffers() (set serving_set(): 0 = dst, 1 =
// dst_back) while refit() writes the other set; only when the new version is
// complete on every rank does refit() publish it (swap the sets) and return.
// A failed refit leaves the served set and its version untouched and current
// (state() stays current). The two sets have an executor each, compiled once
// (the back set's on channel | 0x8000); each gets half the staging budget, so
// the staging held stays within it.
//
// Streams (device buffers, ExecutorOptions::device). refit(order) takes a
// StreamOrder: `sources_final`, an event the trainer records after its
// optimizer step (the refit's copies and, on a device-stream transport such
// as NCCL, its sends wait for it on the device; a host-driven transport's
// host waits for it once before reading sources directly), and
// `destination_free`, an event after the last work that reads the set this
// refit writes. Double-buffered, that is the set served before the last
// swap: inference kernels enqueued before the swap may still read it, so
// record the event on the inference stream after them and pass it; the
// refit never writes that set before the event. With `order.wait = false`
// refit() returns once the version is committed (every rank's transport
// finished) while the last unpacks may still run: RefitReport::done is the
// copy stream's event after them, and the inference stream must wait for it
// (cudaStreamWaitEvent) before reading the new version, and the trainer
// before writing the sources again (the copies may still read them). The
// event is valid until the next refit. With the defaults refit() returns
// after every copy. enqueue(order) / commit() split refit() in two: on a
// transport with a device stream, enqueue() puts every copy and transfer on
// the streams and returns, with no host wait, the event after the last copy;
// commit() later waits for the transport and takes every rank's verdict.
//
// Staged schedules (ResharderOptions::staged, e.g. plan_hierarchical()): a
// StagedExecutor runs the stages in order (stage k on channel + k) instead of
// the plain Executor, under the same versioned commit; after a failure the
// stages after the failed one count as missing. Double-buffered, each set
// has its own StagedExecutor, and the fan-out copies (which read a
// destination buffer on the sending rank) read the set being written, which
// the same refit's earlier stages filled: the served set is never read or
// written. setup() checks the staged schedule against the layouts (buffer
// lists, every copy's buffers, tensor and ranks).
//
// Delta refits (ResharderOptions::delta, delta.hpp): each destination set
// gets a DeltaExecutor that, after a dense first refit, sends only the
// elements that changed since what that set holds, under the same commit.
// Any failure needs setup() again, which makes the next refit dense.
//
// Buffers are bound by bind_buffers() (binding.hpp), which also serves
// callers that drive an executor themselves.
#include <algorithm>
#include <array>
#include <concepts>
#include <cstdint>
#include <map>
#include <numeric>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <type_traits>
#include <variant>
#include <vector>

#include <fmt/format.h>

#include "base/error.hpp"
#include "exec/binding.hpp"
#include "exec/delta.hpp"
#include "exec/executor.hpp"
#include "exec/quant_refit.hpp"
#include "exec/staged_executor.hpp"
#include "layout/layout.hpp"
#include "layout/storage.hpp"
#include "plan/hierarchical.hpp"
#include "plan/plan.hpp"
#include "schedule/schedule.hpp"
#include "transport/transport.hpp"

namespace reshard {

/// This rank's buffers, by local buffer name under each layout (a fused
/// buffer's name, or a tensor's name when it is stored alone).
struct LocalBuffers {
  std::map<std::string, BufferView> src, dst;
  /// Double-buffered mode only: the second destination set (same names and shapes as dst).
  std::map<std::string, BufferView> dst_back{};
};

struct ResharderOptions {
  ExecutorOptions executor;
  PlanOptions plan;  ///< only_rank is set to the transport's rank unless a schedule is given
  /// A schedule planned elsewhere (e.g. once for every thread of a process);
  /// it must hold every copy this rank sends or receives.
  std::shared_ptr<const Schedule> schedule;
  /// Refits write LocalBuffers::dst_back / dst alternately and publish a set
  /// only when complete on every rank (see the header comment). All ranks alike.
  bool double_buffered = false;
  /// A staged (hierarchical) schedule of these layouts (plan_hierarchical(),
  /// the whole plan, the same on every rank): run stage by stage by a
  /// StagedExecutor (stage k on channel executor.channel + k) under the same
  /// versioned commit. Not together with `schedule`.
  std::shared_ptr<const StagedSchedule> staged;
  /// Delta refits (delta.hpp): after the first refit, send only the changed
  /// elements. Not together with `staged`. All ranks alike.
  DeltaOptions delta{};
};

/// A failed refit's writes into this rank's destination buffers, by name,
/// true of the memory when the failure is reported (BufferWrite): `written`
/// hold the failed version entirely, `partial` may hold it in part (a mix
/// with what they held before), `untouched` hold what they held before.
/// Double-buffered: of the set the refit was writing (the served set is
/// untouched). Empty on a rank without destination buffers.
struct DestinationWrites {
  std::vector<std::string> written, partial, untouched;
};

/// A refit that did not complete on every rank. Single-buffered: this
/// rank's destination holds what writes() says, buffer by buffer.
/// Double-buffered: the served set is untouched.
class RefitNotCommitted : public TransportError {
 public:
  explicit RefitNotCommitted(const std::string& what, DestinationWrites writes = {})
      : TransportError(what), writes_(std::move(writes)) {}
  const DestinationWrites& writes() const { return writes_; }

 private:
  DestinationWrites writes_;
};

enum class RefitState : std::uint8_t {
  empty,    ///< no refit committed yet (the destination holds what the caller put there)
  current,  ///< the served destination holds last_good_version(), complete on every rank
  stale,    ///< a refit failed after writing into the served destination
};

inline const char* to_string(RefitState s) {
  return s == RefitState::empty ? "empty" : s == RefitState::current ? "current" : "stale";
}

/// What a failed refit left behind on this rank.
struct StaleReport {
  std::uint64_t version = 0;            ///< the version that was not committed
  std::uint64_t last_good_version = 0;  ///< the last committed one (0: none)
  bool destination_touched = false;     ///< single-buffered: the served set was written into
  std::string error;                    ///< what failed first, here or on a peer
  std::vector<std::int64_t> failed_ranks;  ///< ranks whose verdict was a failure (when the verdicts could be exchanged)
  std::vector<MissingPieces> missing;      ///< per peer: what did not arrive checked on this rank
  std::vector<std::string> stale_tensors;  ///< destination tensors lacking pieces of `version` on this rank
  DestinationWrites writes;                ///< this rank's destination buffers: written, partial, untouched
};

namespace resharder_detail {
/// "a, b, c and 5 more": a message stays short on a rank with thousands of buffers.
inline std::string some_names(const std::vector<std::string>& names, std::size_t most = 8) {
  if (names.size() <= most) return fmt::format("{}", fmt::join(names, ", "));
  return fmt::format("{} and {} more", fmt::join(names.begin(), names.begin() + static_cast<std::ptrdiff_t>(most), ", "), names.size() - most);
}
/// What a failed refit's message says of this rank's destination.
inline std::string describe_writes(const DestinationWrites& w, std::uint64_t version, std::uint64_t before) {
  const std::size_t n = w.written.size() + w.partial.size() + w.untouched.size();
  if (n == 0) return "";
  const std::string old = before ? fmt::format("version {}", before) : std::string("what they held before");
  std::vector<std::string> parts;
  if (!w.written.empty()) parts.push_back(fmt::format("{} hold version {} entirely ({})", w.written.size(), version, some_names(w.written)));
  if (!w.partial.empty())
    parts.push_back(fmt::format("{} were written in part, a mix of version {} and {} ({})", w.partial.size(), version, old, some_names(w.partial)));
  if (!w.untouched.empty()) parts.push_back(fmt::format("{} are untouched, {} ({})", w.untouched.size(), old, some_names(w.untouched)));
  return fmt::format("{} destination buffer{} on this rank: {}", n, n == 1 ? "" : "s", fmt::join(parts, "; "));
}
}  // namespace resharder_detail

/// What one refit did on this rank.
struct RefitReport {
  std::int64_t bytes_sent = 0, bytes_received = 0, local_bytes = 0;
  std::int64_t messages_sent = 0, messages_received = 0;
  std::int64_t zero_copy_bytes = 0, packed_bytes = 0, unpacked_bytes = 0;
  int waves = 0;
  std::int64_t staging_bytes = 0, peak_staging_bytes = 0, staging_budget = 0;
  double seconds = 0;
  /// The plan's bytes for this rank (what bytes_sent/received must equal).
  std::int64_t plan_bytes_sent = 0, plan_bytes_received = 0, plan_local_bytes = 0;
  std::int64_t refit_index = 0;  ///< 0 for the first refit of this Resharder
  std::uint64_t version = 0;     ///< the version this refit committed
  int serving_set = 0;           ///< double-buffered: the set now served (0 = dst, 1 = dst_back)
  std::int64_t checksummed_bytes = 0;
  double checksum_seconds = 0;
  /// Device buffers: the event after this refit's last copy (StreamOrder);
  /// the inference stream waits for it before reading what was written.
  DeviceEvent done = nullptr;
  std::int64_t host_waits = 0;  ///< device buffers: host waits for the copy stream inside the refit
};

/// What an executor's run moved, as a report (the fields an executor knows:
/// stats and its planned bytes); the caller adds version and commit state.
/// `Ex`: an Executor or a StagedExecutor.
template <class Ex>
RefitReport refit_report(const ExecutorStats& st, const Ex& ex) {
  RefitReport r;
  r.checksummed_bytes = st.checksummed_bytes;
  r.checksum_seconds = st.checksum_seconds;
  r.done = st.done;
  r.host_waits = st.host_waits;
  r.bytes_sent = st.bytes_sent;
  r.bytes_received = st.bytes_received;
  r.local_bytes = st.local_bytes;
  r.messages_sent = st.messages_sent;
  r.messages_received = st.messages_received;
  r.zero_copy_bytes = st.zero_copy_bytes;
  r.packed_bytes = st.packed_bytes;
  r.unpacked_bytes = st.unpacked_bytes;
  r.waves = st.waves;
  r.staging_bytes = st.staging_bytes;
  r.peak_staging_bytes = st.peak_staging_bytes;
  r.seconds = st.seconds;
  r.version = st.version;
  r.plan_bytes_sent = ex.planned_bytes_sent();
  r.plan_bytes_received = ex.planned_bytes_received();
  r.plan_local_bytes = ex.planned_local_bytes();
  return r;
}

namespace resharder_detail {
/// Every rank's verdict after a refit, through the bootstrap.
struct Verdicts {
  std::string error;                 ///< the exchange itself failed
  std::vector<std::int64_t> failed;  ///< ranks that failed (or refit another version)
  std::string first;                 ///< the first failed rank's text
};
template <class T>
Verdicts exchange_verdicts(T& t, const std::string& local_error, std::uint64_t version, Deadline deadline) {
  BlobWriter w;
  w.put<std::uint8_t>(local_error.empty() ? 1 : 0);
  w.put(version);
  w.put_string(local_error);
  Verdicts v;
  std::vector<std::vector<std::byte>> blobs;
  try {
    blobs = t.all_gather(w.buf, deadline);
  } catch (const std::exception& e) {
    v.error = e.what();
    return v;
  }
  const auto world = t.world_ranks();
  for (std::size_t i = 0; i < blobs.size() && i < world.size(); ++i) {
    try {
      BlobReader rd(blobs[i], world[i]);
      const bool ok = rd.get<std::uint8_t>() != 0;
      const auto their = rd.get<std::uint64_t>();
      const std::string msg = rd.get_string();
      std::string why;
      if (!ok) why = fmt::format("rank {} failed: {}", world[i], msg);
      else if (their != version) why = fmt::format("rank {} refit version {}, this rank version {}", world[i], their, version);
      if (why.empty()) continue;
      v.failed.push_back(world[i]);
      if (v.first.empty()) v.first = why;
    } catch (const std::exception& e) {
      v.failed.push_back(world[i]);
      if (v.first.empty()) v.first = fmt::format("rank {} sent an unreadable verdict: {}", world[i], e.what());
    }
  }
  return v;
}
}  // namespace resharder_detail

/// The Layout parameter of Resharder<Layout, Transport> is the type of its
/// two layouts, which it keeps as given (source_layout(), destination_layout()):
///   Resharder<reshard::Layout, T>      runtime layouts; takes the two in any
///                                      forms that lower to a Layout (a LayoutSpec,
///                                      a static layout beside a runtime one ...)
///   Resharder<st::LayoutOf<Mesh>, T>   two static layouts of one mesh type (e.g.
///                                      pp, dp, tp axes sized at runtime), whose typed
///                                      tensor handles (add<E>) bind memory checked at
///                                      compile time (bind_tensor(), exec/binding.hpp)
/// Deduction picks the second when both layouts are of one such type.
template <class LayoutT, class TransportT>
class Resharder {
  static_assert(!std::is_same_v<LayoutT, LayoutSpec>,
                "reshard::Resharder<Layout, Transport>: Layout is the type of the validated layouts it keeps; give "
                "reshard::Layout, which takes LayoutSpecs (and validates them)");
  static_assert(LayoutDescription<LayoutT>,
                "reshard::Resharder<Layout, Transport>: Layout must be reshard::Layout, convert to it, or have .lower() / "
                ".to_runtime() returning one");
  static_assert(check_transport<TransportT>(), "reshard::Resharder<Layout, Transport>: Transport must model reshard::Transport");
  static constexpr bool runtime_layouts = std::is_same_v<LayoutT, Layout>;

 public:
  using layout_type = LayoutT;
  using transport_type = TransportT;

  /// Plans and sets up in one step (collective over the transport's world).
  Resharder(const LayoutT& src, const LayoutT& dst, const LocalBuffers& buffers, TransportT& transport, ResharderOptions opt = {})
      : Resharder(src, dst, std::move(opt)) {
    setup(buffers, transport);
  }
  /// Keeps the layouts; setup() binds buffers and compiles later.
  Resharder(const LayoutT& src, const LayoutT& dst, ResharderOptions opt = {})
      : given_(given_layouts(src, dst)), src_(lower_layout(src)), dst_(lower_layout(dst)), opt_(std::move(opt)) {
    src_of_dst_ = match_tensors(src_, dst_, opt_.plan.cast);  // same tensors on both sides, else a clear error now
  }
  /// Resharder<Layout, ...> only: the two layouts in any forms that lower to
  /// a Layout (a compile-time training layout and a runtime inference one, a
  /// LayoutSpec, which is validated here).
  template <class Src, class Dst>
    requires runtime_layouts && LayoutDescription<Src> && LayoutDescription<Dst>
  Resharder(const Src& src, const Dst& dst, const LocalBuffers& buffers, TransportT& transport, ResharderOptions opt = {})
      : Resharder(lower_layout(src), lower_layout(dst), buffers, transport, std::move(opt)) {}
  template <class Src, class Dst>
    requires runtime_layouts && LayoutDescription<Src> && LayoutDescription<Dst>
  Resharder(const Src& src, const Dst& dst, ResharderOptions opt = {})
      : Resharder(lower_layout(src), lower_layout(dst), std::move(opt)) {}

  /// Binds this rank's buffers, plans (this rank only, unless a schedule was
  /// given) and compiles the program. Collective. Errors on any rank make
  /// every rank's setup throw.
  void setup(const LocalBuffers& buffers, TransportT& transport) {
    ready_ = false;
    broken_ = false;
    t_ = &transport;
    me_ = transport.rank();
    std::string error;
    try {
      if (opt_.staged) {
        if (opt_.schedule) fail("rank {}: ResharderOptions::schedule and ResharderOptions::staged are both set (give one)", me_);
        check_staged(*opt_.staged);
        schedule_ = std::shared_ptr<const Schedule>(opt_.staged, &opt_.staged->schedule);
      } else if (opt_.schedule) {
        schedule_ = opt_.schedule;
      } else {
        PlanOptions po = opt_.plan;
        po.only_rank = me_;
        schedule_ = std::make_shared<const Schedule>(plan(src_, dst_, po));
      }
      bind(buffers);
    } catch (const std::exception& e) {
      error = e.what();
      if (!schedule_) schedule_ = std::make_shared<const Schedule>();
    }
    std::vector<const BoundBuffer*> s, d, d2;
    if (error.empty()) {
      s = bound_pointers(src_bound_);
      d = bound_pointers(dst_bound_);
      d2 = bound_pointers(dst_back_bound_);
    }
    // Quantized destinations and casts: the executor runs the expanded
    // schedule, with this rank's quantizer and cast shadows and staging bound
    // beside its buffers. A schedule that only casts changes the senders'
    // sources alone (the destination's dtype crosses the wire into the
    // destination itself), so it also runs double-buffered and as delta
    // refits: the DeltaExecutor diffs the cast shadow, in the destination's
    // dtype, against its own shadow of what the receiver holds.
    quant_.reset();
    const Schedule* run_schedule = schedule_.get();
    if (error.empty() && QuantRefit::needed(*schedule_)) {
      try {
        if (opt_.staged)
          fail("rank {}: quantized (FP8) destinations and casts in flight run unstaged only (not with ResharderOptions::staged)", me_);
        if (QuantRefit::quantizes(*schedule_) && (opt_.double_buffered || opt_.delta.enabled))
          fail("rank {}: quantized (FP8) destinations run single-buffered and dense only (not with ResharderOptions::{})", me_,
               opt_.double_buffered ? "double_buffered" : "delta");
        quant_ = std::make_unique<QuantRefit>(src_, dst_, *schedule_, me_, s, d, opt_.executor.device);
        s = quant_->src_buffers();
        d = quant_->dst_buffers();
        d2.resize(d.size(), nullptr);  // (a cast leaves the destination ids as they are)
        run_schedule = &quant_->expanded();
      } catch (const std::exception& e) {
        error = e.what();
      }
    }
    std::vector<std::string> names;
    for (const auto& t : dst_.tensors) names.push_back(t.name);
    ExecutorOptions eo = opt_.executor;
    if (opt_.double_buffered) eo.staging_budget = opt_.executor.staging_budget / 2;
    // A staged schedule: a StagedExecutor per destination set. With double
    // buffering the back set's fan-out copies read the back set, which the
    // same refit's earlier stages wrote, never the served set.
    for (int set = 0; set < (opt_.double_buffered ? 2 : 1); ++set) {
      if (set == 1) eo.channel = static_cast<std::uint16_t>(opt_.executor.channel | 0x8000u);
      const auto& dset = set == 0 ? d : d2;
      if (opt_.delta.enabled) {
        // One DeltaExecutor per destination set: each keeps the shadow of
        // what its own set holds (double-buffered: the version before last).
        if (opt_.staged && error.empty()) error = fmt::format("rank {}: delta refits do not run staged schedules (ResharderOptions::staged)", me_);
        auto& ex = delta_[static_cast<std::size_t>(set)];
        if (!ex) ex = std::make_unique<DeltaExecutor<TransportT>>();
        ex->set_tensor_names(names);
        ex->setup(*run_schedule, s, dset, transport, eo, opt_.delta, error);
        continue;
      }
      if (opt_.staged) {
        auto& ex = staged_[static_cast<std::size_t>(set)];
        if (!ex) ex = std::make_unique<StagedExecutor<TransportT>>();
        ex->set_tensor_names(names);
        ex->setup(*opt_.staged, s, dset, transport, eo, error);
        continue;
      }
      if (set == 1 && !back_executor_) back_executor_ = std::make_unique<Executor<TransportT>>();
      Executor<TransportT>& ex = set == 0 ? *executor_ : *back_executor_;
      ex.set_tensor_names(names);
      ex.setup(*run_schedule, s, dset, transport, eo, error);
    }
    serving_views_[0] = buffers.dst;
    serving_views_[1] = buffers.dst_back;
    ready_ = true;
  }

  /// Moves every weight this rank sends or receives, as the next version
  /// (the last one attempted + 1). Collective. Returns once the version is
  /// complete on every rank; else throws RefitNotCommitted (see last_failure()).
  RefitReport refit() { return refit(attempted_ + 1); }
  /// With device buffers, the same ordered with the caller's streams (see
  /// "Streams" above and StreamOrder).
  RefitReport refit(const StreamOrder& order) { return refit(attempted_ + 1, order); }
  /// The same with a caller's version (every rank the same; above every
  /// version attempted before).
  RefitReport refit(std::uint64_t version, const StreamOrder& order = {}) {
    const int target = start_refit(version, order, "refit");
    if (opt_.delta.enabled) return run_and_commit(*delta_[static_cast<std::size_t>(target)], version, target, order);
    if (opt_.staged) return run_and_commit(*staged_[static_cast<std::size_t>(target)], version, target, order);
    return run_and_commit(target == 0 ? *executor_ : *back_executor_, version, target, order);
  }

  /// refit(version, order) in two halves, so the host can go on while the
  /// device moves the weights and take the verdict later. enqueue(): with
  /// device buffers on a transport with a device stream (NCCL), every copy
  /// and transfer is enqueued after `order`'s events and it returns without
  /// waiting on the host; the event it returns follows the last copy (a
  /// consumer's stream may wait for it now; nullptr with host buffers). On a
  /// host-driven transport it returns once the transport moved everything.
  /// commit(): the host waits for the transport (and with `order.wait` for
  /// the copies), then every rank's verdict: it publishes the version and
  /// returns its report, or throws RefitNotCommitted, as refit() does (what
  /// a consumer read after the event is that version only once commit()
  /// returned). Every rank calls both, in that order, one refit at a time.
  /// Plain schedules only: delta, staged and FP8-quantized refits use refit().
  DeviceEvent enqueue(std::uint64_t version, const StreamOrder& order = {}) {
    if (opt_.delta.enabled || opt_.staged || quant_)
      fail("rank {}: Resharder::enqueue: {} refits run through refit() (enqueue / commit splits plain schedules only)", me_,
           opt_.delta.enabled ? "delta" : opt_.staged ? "staged" : "FP8-quantized");
    const int target = start_refit(version, order, "enqueue");
    if (!opt_.double_buffered) state_ = RefitState::stale;  // written into from here on
    pending_ = PendingRefit{version, target, order, verdict_deadline(), {}};
    Executor<TransportT>& ex = target == 0 ? *executor_ : *back_executor_;
    try {
      ex.enqueue(version, order);
    } catch (const std::exception& e) {
      pending_->local_error = e.what();  // reported by commit(), after every rank's verdict
      return nullptr;
    }
    return ex.enqueued_done();
  }
  DeviceEvent enqueue(const StreamOrder& order = {}) { return enqueue(attempted_ + 1, order); }
  RefitReport commit() {
    if (!pending_) fail("rank {}: Resharder::commit: no refit is enqueued (enqueue() first)", me_);
    PendingRefit p = std::move(*pending_);
    pending_.reset();
    Executor<TransportT>& ex = p.target == 0 ? *executor_ : *back_executor_;
    ExecutorStats st;
    if (p.local_error.empty()) {
      try {
        st = ex.complete();
      } catch (const std::exception& e) {
        p.local_error = e.what();
      }
    }
    return verdict(ex, p.version, p.target, st, p.local_error, p.verdict_deadline);
  }

  /// The served destination: current (complete at last_good_version()),
  /// stale (a failed refit wrote into it) or empty (no refit committed).
  RefitState state() const { return state_; }
  /// The last version committed (0: none yet). The served destination holds
  /// it, complete, while state() is current (single-buffered: not once stale).
  std::uint64_t last_good_version() const { return version_; }
  /// The last version refit() started (committed or not).
  std::uint64_t last_attempted_version() const { return attempted_; }
  /// The last refit's failure, until a refit commits.
  const std::optional<StaleReport>& last_failure() const { return last_failure_; }
  /// Single-buffered, after a failure: destination tensors of this rank that
  /// lack pieces of the failed version (empty when this rank's part arrived
  /// but another rank's did not: state() is stale all the same).
  std::vector<std::string> stale_tensors() const {
    if (state_ != RefitState::stale || !last_failure_) return {};
    return last_failure_->stale_tensors;
  }
  bool double_buffered() const { return opt_.double_buffered; }
  /// The destination set inference should read: 0 = LocalBuffers::dst, 1 = dst_back.
  int serving_set() const { return serving_; }
  const std::map<std::string, BufferView>& serving_buffers() const { return serving_views_[static_cast<std::size_t>(serving_)]; }

  bool ready() const { return ready_; }
  /// The layouts as given (for Resharder<Layout, ...>, the validated ones).
  const LayoutT& source_layout() const {
    if constexpr (runtime_layouts) return src_;
    else return given_.src;
  }
  const LayoutT& destination_layout() const {
    if constexpr (runtime_layouts) return dst_;
    else return given_.dst;
  }
  /// The layouts lowered to the runtime form the planner and binding read.
  const Layout& src_layout() const { return src_; }
  const Layout& dst_layout() const { return dst_; }
  const Schedule& schedule() const {
    if (!schedule_) fail("Resharder::schedule: setup() has not run");
    return *schedule_;
  }
  /// The plain executor (unused with a staged schedule: see staged_executor()).
  const Executor<TransportT>& executor() const { return *executor_; }
  bool staged() const { return opt_.staged != nullptr; }
  /// With ResharderOptions::staged: the executor of destination set `set`
  /// (0 = dst, 1 = dst_back).
  /// With ResharderOptions::delta: the delta executor of destination set `set`.
  const DeltaExecutor<TransportT>& delta_executor(int set = 0) const {
    if (!opt_.delta.enabled || set < 0 || set > 1 || !delta_[static_cast<std::size_t>(set)])
      fail("Resharder::delta_executor({}): {}", set, opt_.delta.enabled ? "no such destination set is set up" : "ResharderOptions::delta is off");
    return *delta_[static_cast<std::size_t>(set)];
  }
  /// With ResharderOptions::delta: the next refit of each destination set,
  /// on every rank, is dense (and the shadows are primed again). Call it on
  /// a rank whose destination something other than this Resharder wrote
  /// (e.g. inference processed its weights in place), between refits; the
  /// other ranks need not: the request travels with the next refit.
  void invalidate_delta_base() {
    if (!opt_.delta.enabled) fail("Resharder::invalidate_delta_base: ResharderOptions::delta is off");
    for (auto& d : delta_)
      if (d) d->invalidate_base();
  }
  const StagedExecutor<TransportT>& staged_executor(int set = 0) const {
    if (!opt_.staged || set < 0 || set > 1 || !staged_[static_cast<std::size_t>(set)])
      fail("Resharder::staged_executor({}): {}", set, opt_.staged ? "no such destination set is set up" : "ResharderOptions::staged is not set");
    return *staged_[static_cast<std::size_t>(set)];
  }

 private:
  /// refit() and enqueue()'s checks; returns the destination set to write.
  int start_refit(std::uint64_t version, const StreamOrder& order, const char* what) {
    if (!ready_) fail("Resharder::{} on rank {}: setup() has not completed (bind the buffers and set up first)", what, me_);
    if (pending_)
      fail("rank {}: Resharder::{} of version {}: version {} is enqueued and not committed yet: commit() it first", me_, what, version,
           pending_->version);
    if (broken_)
      fail("rank {}: Resharder::{}: an earlier run failed (refit version {} was not committed); the peers' state is unknown, set up "
           "again",
           me_, what, attempted_);
    if (version <= attempted_) {
      const std::string why =
          fmt::format("rank {}: Resharder::{}: version {} is not above version {}, attempted before", me_, what, version, attempted_);
      t_->abort(why);  // the peers would otherwise wait for this rank until their deadline
      fail("{}", why);
    }
    if ((order.sources_final || order.destination_free) && !opt_.executor.device) {
      const std::string why = fmt::format("rank {}: Resharder::{}: a StreamOrder with events orders device buffers, but this rank's "
                                          "buffers are host memory (ExecutorOptions::device is not set): nothing would wait for them",
                                          me_, what);
      t_->abort(why);
      fail("{}", why);
    }
    attempted_ = version;
    return opt_.double_buffered ? 1 - serving_ : 0;
  }

  /// The verdicts wait up to two timeouts from the start: a rank still in
  /// its run fails at one timeout and aborts, and the others then hear its
  /// reason (through the abort) instead of timing out beside it.
  Deadline verdict_deadline() const { return Clock::now() + 2 * opt_.executor.timeout; }

  /// An enqueued refit, until commit().
  struct PendingRefit {
    std::uint64_t version = 0;
    int target = 0;
    StreamOrder order;
    Deadline verdict_deadline{};
    std::string local_error;
  };

  /// One refit on `ex` (an Executor or a StagedExecutor writing set
  /// `target`) and the commit: every rank's verdict, then publish or record
  /// the failure.
  template <class Ex>
  RefitReport run_and_commit(Ex& ex, std::uint64_t version, int target, const StreamOrder& order) {
    if (!opt_.double_buffered) state_ = RefitState::stale;  // written into from here on
    ExecutorStats st;
    std::string local_error;
    const Deadline deadline = verdict_deadline();
    try {
      const StreamOrder run_order = quant_ ? quant_->before_run(order) : order;
      if constexpr (requires { ex.run(version, run_order); })
        st = ex.run(version, run_order);
      else
        st = ex.run(version);  // (delta refits: host memory only, nothing to order)
      if (quant_) quant_->after_run(st, order);
    } catch (const std::exception& e) {
      local_error = e.what();
    }
    return verdict(ex, version, target, st, local_error, deadline);
  }

  /// Every rank's verdict on a run of `ex`, then publish (the report) or
  /// record the failure (RefitNotCommitted).
  template <class Ex>
  RefitReport verdict(Ex& ex, std::uint64_t version, int target, const ExecutorStats& st, const std::string& local_error,
                      Deadline verdict_deadline) {
    const auto v = resharder_detail::exchange_verdicts(*t_, local_error, version, std::max(verdict_deadline, Clock::now() + opt_.executor.timeout / 4));
    if (!local_error.empty() || !v.error.empty() || !v.failed.empty()) {
      broken_ = true;
      StaleReport rep;
      rep.version = version;
      rep.last_good_version = version_;
      rep.destination_touched = !opt_.double_buffered;
      rep.error = !local_error.empty() ? local_error : !v.first.empty() ? v.first : v.error;
      rep.failed_ranks = v.failed;
      rep.missing = ex.missing();
      std::set<std::string> stale;
      for (const auto& m : rep.missing) stale.insert(m.tensors.begin(), m.tensors.end());
      rep.stale_tensors.assign(stale.begin(), stale.end());
      rep.writes = destination_writes(ex.buffer_writes());
      if (!opt_.double_buffered) state_ = RefitState::stale;
      std::string text = opt_.double_buffered
                             ? fmt::format("rank {}: refit version {} not committed; the served destination keeps version {}: {}", me_, version,
                                           version_, rep.error)
                             : fmt::format("rank {}: refit version {} not committed: {}", me_, version, rep.error);
      if (!local_error.empty() && !v.first.empty()) text += "; then " + v.first;
      // (The exchange failing with this rank's own abort adds nothing.)
      if (!v.error.empty() && (!local_error.empty() || !v.first.empty()) && v.error.find(rep.error) == std::string::npos)
        text += "; then " + v.error;
      std::vector<std::string> miss;
      for (const auto& m : rep.missing)
        miss.push_back(fmt::format("{} {} ({} messages, {} bytes: {})", m.peer == me_ ? "local copies on" : "from", m.peer == me_ ? "this rank" : fmt::format("rank {}", m.peer),
                                   m.messages, m.bytes, fmt::join(m.tensors, ", ")));
      if (!miss.empty()) text += fmt::format(". Missing here: {}", fmt::join(miss, "; "));
      const std::string held = resharder_detail::describe_writes(rep.writes, version, version_);
      if (!held.empty()) text += fmt::format(". {}{}", opt_.double_buffered ? "In the set being written, " : "", held);
      last_failure_ = std::move(rep);
      throw RefitNotCommitted(text, last_failure_->writes);
    }
    version_ = version;
    state_ = RefitState::current;
    if (opt_.double_buffered) serving_ = target;
    last_failure_.reset();
    ++committed_;
    RefitReport r = refit_report(st, ex);
    r.version = version;
    r.serving_set = serving_;
    r.staging_budget = opt_.executor.staging_budget;
    r.refit_index = committed_ - 1;
    return r;
  }


  /// This rank's destination buffers by what a run did to them (BufferWrite,
  /// by buffer id), as names.
  DestinationWrites destination_writes(const BufferWrites& w) const {
    DestinationWrites out;
    const auto& lbs = dst_.local_buffers();
    for (std::size_t b = 0; b < lbs.size() && b < dst_bound_.size(); ++b) {
      if (!dst_bound_[b].data) continue;  // not on this rank
      // Quantized: the run writes shadows and staging, converted into the
      // destination after it; their ids are not the destination's.
      const BufferWrite x = quant_ ? BufferWrite::partial : b < w.size() ? w[b] : BufferWrite::none;
      (x == BufferWrite::written ? out.written : x == BufferWrite::partial ? out.partial : out.untouched).push_back(lbs[b].name);
    }
    return out;
  }

  /// A staged schedule must be of these two layouts: the same buffer lists,
  /// and every copy's ids and ranks inside them (a schedule of other layouts
  /// would otherwise fail later, or write the wrong bytes).
  void check_staged(const StagedSchedule& h) const {
    const Schedule& sc = h.schedule;
    auto same_buffers = [&](const std::vector<std::string>& names, const Layout& L, const char* side) {
      const auto& lbs = L.local_buffers();
      for (std::size_t b = 0; b < std::max(names.size(), lbs.size()); ++b) {
        if (b < names.size() && b < lbs.size() && names[b] == lbs[b].name) continue;
        fail("rank {}: the staged schedule is not of these layouts: its {} buffer #{} is {} but {} has {} ({} buffers in the schedule, {} "
             "in the layout)",
             me_, side, b, b < names.size() ? fmt::format("'{}'", names[b]) : std::string("missing"), L.origin,
             b < lbs.size() ? fmt::format("'{}'", lbs[b].name) : std::string("none"), names.size(), lbs.size());
      }
    };
    same_buffers(sc.src_buffers, src_, "source");
    same_buffers(sc.dst_buffers, dst_, "destination");
    if (sc.only_rank >= 0 && sc.only_rank != me_)
      fail("rank {}: the staged schedule was planned for rank {} only (plan_hierarchical plans every rank)", me_, sc.only_rank);
    const std::size_t n = sc.copies.size();
    if ((!h.stage.empty() && h.stage.size() != n) || (!h.from_dst.empty() && h.from_dst.size() != n))
      fail("rank {}: the staged schedule has {} stage and {} src_layout entries for {} copies", me_, h.stage.size(), h.from_dst.size(), n);
    std::int64_t stages = std::max<std::int32_t>(h.stages, 1);
    const auto nsrc = static_cast<std::int32_t>(src_.local_buffers().size());
    const auto ndst = static_cast<std::int32_t>(dst_.local_buffers().size());
    for (std::size_t i = 0; i < n; ++i) {
      const Copy& c = sc.copies[i];
      const bool from_dst = h.reads_dst(i);
      const Layout& from = from_dst ? dst_ : src_;
      stages = std::max<std::int64_t>(stages, h.stage_of(i) + 1);
      std::string why;
      if (c.tensor < 0 || c.tensor >= static_cast<std::int32_t>(dst_.tensors.size()))
        why = fmt::format("tensor #{} (the destination layout has {})", c.tensor, dst_.tensors.size());
      else if (c.src_buffer < 0 || c.src_buffer >= (from_dst ? ndst : nsrc))
        why = fmt::format("reads {} buffer #{} ({} has {})", from_dst ? "destination" : "source", c.src_buffer, from.origin, from_dst ? ndst : nsrc);
      else if (c.dst_buffer < 0 || c.dst_buffer >= ndst)
        why = fmt::format("writes destination buffer #{} ({} has {})", c.dst_buffer, dst_.origin, ndst);
      else if (!from.mesh.position_of(c.src_rank))
        why = fmt::format("reads on rank {}, which {} does not hold", c.src_rank, from.origin);
      else if (!dst_.mesh.position_of(c.dst_rank))
        why = fmt::format("writes on rank {}, which {} does not hold", c.dst_rank, dst_.origin);
      if (!why.empty())
        fail("rank {}: the staged schedule is not of these layouts: copy {} (stage {}) {}", me_, i, h.stage_of(i), why);
    }
    // The back set's stages start at channel | 0x8000: the front set's must stay below.
    if (opt_.double_buffered && opt_.executor.channel + stages > 0x8000)
      fail("rank {}: double-buffered staged refits use channels {}..{} for the served set, which reach the back set's (| 0x8000)", me_,
           opt_.executor.channel, opt_.executor.channel + stages - 1);
  }

  /// Checks the caller's views against what each layout gives this rank.
  void bind(const LocalBuffers& buffers) {
    src_bound_.clear();
    dst_bound_.clear();
    dst_back_bound_.clear();
    const bool device = opt_.executor.device != nullptr;
    src_bound_ = bind_buffers(src_, me_, buffers.src, "source", device);
    dst_bound_ = bind_buffers(dst_, me_, buffers.dst, "destination", device);
    if (opt_.double_buffered) {
      if (opt_.executor.channel >= 0x8000)
        fail("rank {}: double-buffered refits use channel | 0x8000 for the back set; channel {} is too large", me_, opt_.executor.channel);
      dst_back_bound_ = bind_buffers(dst_, me_, buffers.dst_back, "back destination (dst_back)", device);
    } else if (!buffers.dst_back.empty()) {
      fail("rank {}: back destination buffers (dst_back) were given but ResharderOptions::double_buffered is off", me_);
    }
    check_no_overlap(me_, {&src_bound_}, {&dst_bound_, &dst_back_bound_});
  }

  /// The layouts as given, when they are not already the runtime ones.
  struct GivenLayouts {
    LayoutT src, dst;
  };
  using Given = std::conditional_t<runtime_layouts, std::monostate, GivenLayouts>;
  static Given given_layouts(const LayoutT& src, const LayoutT& dst) {
    if constexpr (runtime_layouts) return {};
    else return GivenLayouts{src, dst};
  }

  [[no_unique_address]] Given given_;
  Layout src_, dst_;
  ResharderOptions opt_;
  std::vector<int> src_of_dst_;
  TransportT* t_ = nullptr;
  std::int64_t me_ = -1;
  std::shared_ptr<const Schedule> schedule_;
  std::vector<BoundBuffer> src_bound_, dst_bound_, dst_back_bound_;
  std::unique_ptr<QuantRefit> quant_;  ///< quantized destinations: shadows, staging, expanded schedule
  /// Writes LocalBuffers::dst. Executors are held by pointer (they are not
  /// movable; the bound buffers they point into are heap elements that a
  /// move keeps in place), so a Resharder moves.
  std::unique_ptr<Executor<TransportT>> executor_ = std::make_unique<Executor<TransportT>>();
  std::unique_ptr<Executor<TransportT>> back_executor_;  ///< double-buffered: writes dst_back
  /// ResharderOptions::staged: per destination set (0 = dst, 1 = dst_back).
  std::array<std::unique_ptr<StagedExecutor<TransportT>>, 2> staged_;
  /// ResharderOptions::delta: per destination set.
  std::array<std::unique_ptr<DeltaExecutor<TransportT>>, 2> delta_;
  std::array<std::map<std::string, BufferView>, 2> serving_views_;
  bool ready_ = false, broken_ = false;
  // Versions: survive setup().
  std::uint64_t version_ = 0, attempted_ = 0;
  std::int64_t committed_ = 0;
  RefitState state_ = RefitState::empty;
  int serving_ = 0;
  std::optional<StaleReport> last_failure_;
  std::optional<PendingRefit> pending_;  ///< enqueue() until commit()
};

/// The Layout parameter for two layouts given as Src and Dst: their type
/// when both are of one type other than LayoutSpec, else reshard::Layout.
template <class Src, class Dst>
using common_layout_t = std::conditional_t<std::is_same_v<Src, Dst> && !std::is_same_v<Src, LayoutSpec>, Src, Layout>;

/// Deduction: `Resharder r(train, infer, buffers, transport);` is a
/// Resharder<L, T> with L = common_layout_t of the two layouts' types.
template <class Src, class Dst, class TransportT>
  requires LayoutDescription<Src> && LayoutDescription<Dst>
Resharder(const Src&, const Dst&, const LocalBuffers&, TransportT&, ResharderOptions = {})
    -> Resharder<common_layout_t<Src, Dst>, TransportT>;

/// Plans, binds and sets up (collective), as the constructor; for `auto r = ...`.
template <class Src, class Dst, class TransportT>
  requires LayoutDescription<Src> && LayoutDescription<Dst>
Resharder<common_layout_t<Src, Dst>, TransportT> make_resharder(const Src& src, const Dst& dst, const LocalBuffers& buffers,
                                                                TransportT& transport, ResharderOptions opt = {}) {
  return Resharder<common_layout_t<Src, Dst>, TransportT>(src, dst, buffers, transport, std::move(opt));
}

}  // namespace reshard
