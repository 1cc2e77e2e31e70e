#pragma once
// The executor: compiles a Schedule into one rank's program once, then
// replays it on every refit over any reshard::Transport.
//
// Compile (collective over the transport's world):
//  * The rank's copies are grouped per peer pair (src rank, dst rank) in one
//    canonical order that both sides compute alike, so every message has the
//    same tag and size on both ends without negotiating.
//  * A copy that is one contiguous run on both sides and at least
//    zero_copy_min bytes is its own message, sent straight from the source
//    buffer into the destination buffer (zero-copy). A run contiguous on one
//    side only is read or written in place on that side and staged on the
//    other. Everything else is packed by the copy kernels, many tensors'
//    pieces bucketed into one message per peer pair and wave.
//  * Staging (packed sends and staged receives) is kept under the rank's
//    staging_budget: the budget is shared among the rank's peer pairs in
//    proportion to their staged bytes (both ends agree on each pair's share
//    through the bootstrap), a pair's stream is cut into waves of at most its
//    share, and a message larger than the share is split across waves.
//    With pipeline = 2, wave w+1 is packed and posted while wave w moves and
//    is unpacked, each in its own half of the budget.
//  * Copies within the rank (src rank == dst rank) run directly with the copy
//    kernels while the first wave is on the wire.
//  * Buffers may be strided views (a weight inside a larger allocation): the
//    rank translates its side of every copy into the view's strides, splitting
//    boxes only where the view breaks their regularity.
//
// Replay: post receives, post zero-copy sends, pack and post the rest, end
// the wave's batch (the transport's flush), copy locally, unpack each peer's receives as they complete, wait for the sends.
// Any failure aborts the transport (peers fail too) and is rethrown; a failed
// run never reports success, and the executor refuses further runs.
//
// Integrity (ExecutorOptions::checksum): every message's bytes get a CRC32C
// on the sender (of the packed staging, or of the source range for a
// zero-copy send), and per peer pair and wave one small control message
// carries the refit's version and those CRCs. The control message travels in
// the same receive group as the data, so when the group completes the
// receiver checks the version (a stale or duplicated message of another
// refit), the control message's own CRC, and each data message's CRC (of the
// staging before it is unpacked, or of the destination range it landed in)
// before unpacking. A mismatch is an IntegrityError naming the peer, the
// tensors the message carries and the version. Any transport error during a
// wait is rethrown with the peers and tensors still pending. After a failed
// run, missing() says which peers' messages (and so which tensors) did not
// arrive checked on this rank.
#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <numeric>
#include <optional>
#include <set>
#include <tuple>
#include <span>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "../base/error.hpp"
#include "../base/hash.hpp"
#include "../cuda/device_engine.hpp"
#include "../layout/layout.hpp"
#include "../schedule/message_rule.hpp"
#include "../schedule/schedule.hpp"
#include "../transport/blob.hpp"
#include "../transport/peer_exchange.hpp"
#include "../transport/transport.hpp"
#include "batch_cap.hpp"
#include "checksum.hpp"
#include "copy_kernels.hpp"

namespace reshard {

struct ExecutorOptions {
  /// Staging memory one rank may hold at once (packed sends + staged receives), bytes.
  std::int64_t staging_budget = kDefaultStagingBudget;
  /// Contiguous pieces at least this big go without packing.
  std::int64_t zero_copy_min = kDefaultZeroCopyMin;
  /// Per peer and direction, at most this many copies read or written in
  /// place (each its own message): the largest keep it, the rest are packed
  /// into the pair's bucket message of each wave, so a wave holds at most
  /// this many messages per peer plus its bucket (NCCL runs a wave as one
  /// group: tens of thousands of expert pieces would be that many sends).
  /// 0: no limit. Both ends of a pair must agree (it shapes the messages).
  std::int64_t max_direct_messages = 0;
  /// At most this many transport ops per rank in one wave (one batch: one
  /// NCCL group), both ends of every pair agreeing on each message's wave
  /// (batch_cap.hpp). -1: the transport's max_batch_ops() where it has one
  /// (NCCL: NcclOptions::max_group_ops, 256), else no bound; 0: no bound.
  /// All ranks must agree.
  std::int64_t max_batch_ops = -1;
  /// Waves in flight: 1 (no overlap across waves) or 2 (pack/unpack one wave while the other moves).
  int pipeline = kDefaultPipeline;
  /// A refit (and each collective step of setup) fails after this long.
  std::chrono::milliseconds timeout{300'000};
  /// Executors that share a transport and may overlap in time need distinct channels.
  std::uint16_t channel = 0;
  /// CRC32C of every message, checked on arrival with the refit's version
  /// (one control message per peer pair and wave). All ranks must agree.
  bool checksum = false;
  /// Required when the buffers are GPU memory (MemoryKind::device): allocates
  /// the staging and runs packs, unpacks and local copies, one batch per
  /// message group (reshard::cuda::CudaCopyEngine, cuda/device_engine.cuh).
  std::shared_ptr<DeviceCopyEngine> device;
};

/// Tag bit of the checksum control messages (data messages never set it).
inline constexpr std::uint64_t kChecksumTagBit = std::uint64_t{1} << 47;

/// A message arrived but failed its check: wrong checksum, wrong version
/// (stale or duplicated), or a damaged control message.
class IntegrityError : public TransportError {
 public:
  explicit IntegrityError(const std::string& what) : TransportError(what) {}
};

/// After a failed run: what one peer's messages to this rank left missing.
struct MissingPieces {
  std::int64_t peer = -1;  ///< the sender (this rank itself: its local copies)
  std::int64_t messages = 0, bytes = 0;
  std::vector<std::string> tensors;  ///< destination tensors with a piece among them
};

/// What a run did to one destination buffer of this rank, true of its
/// memory: nothing to write there (`none`), not a byte written yet
/// (`untouched`: it holds what it held before), some pieces possibly
/// written (`partial`: a mix of the old and the new version), or every piece
/// arrived and checked (`written`: the new version entirely). A receive
/// posted straight into the buffer (zero-copy) counts as a write from the
/// moment it is posted: the transport may land bytes there at any time.
enum class BufferWrite : std::uint8_t { none, untouched, partial, written };
/// By destination buffer id (the schedule's dst_buffer).
using BufferWrites = std::vector<BufferWrite>;

inline const char* to_string(BufferWrite w) {
  return w == BufferWrite::none ? "none" : w == BufferWrite::untouched ? "untouched" : w == BufferWrite::partial ? "partial" : "written";
}

/// Two runs (or parts of one) that write disjoint pieces of a buffer: written
/// only if each part that writes it wrote all of its pieces.
inline BufferWrite merge_disjoint(BufferWrite a, BufferWrite b) {
  if (a == BufferWrite::none) return b;
  if (b == BufferWrite::none || a == b) return a;
  return BufferWrite::partial;
}
/// Two passes that each write every piece of the buffer with the same
/// version (a delta's payloads, then the dense refit over them): written
/// when either wrote it all, untouched only when neither wrote a byte.
inline BufferWrite merge_overwrite(BufferWrite a, BufferWrite b) {
  if (a == BufferWrite::none) return b;
  if (b == BufferWrite::none) return a;
  if (a == BufferWrite::written || b == BufferWrite::written) return BufferWrite::written;
  if (a == BufferWrite::untouched && b == BufferWrite::untouched) return BufferWrite::untouched;
  return BufferWrite::partial;
}
/// `w` for a run that has not started: every buffer it writes is untouched.
inline BufferWrites not_started(BufferWrites w) {
  for (auto& x : w)
    if (x != BufferWrite::none) x = BufferWrite::untouched;
  return w;
}
inline void merge_into(BufferWrites& into, const BufferWrites& w, BufferWrite (*merge)(BufferWrite, BufferWrite)) {
  if (into.size() < w.size()) into.resize(w.size(), BufferWrite::none);
  for (std::size_t b = 0; b < w.size(); ++b) into[b] = merge(into[b], w[b]);
}

/// A local buffer bound to memory, as the executor sees it: `shape` is the
/// dense row-major shape the layout gives it (the schedule's offsets are in
/// that shape); `strides`, when not empty, say where each element really is
/// (an mdspan layout_stride view), in elements from `data`.
struct BoundBuffer {
  std::string name;
  std::byte* data = nullptr;
  std::int64_t element_bytes = 0;
  std::vector<std::int64_t> shape;
  std::vector<std::int64_t> strides;
  MemoryKind memory = MemoryKind::host;

  std::int64_t elements() const {
    std::int64_t n = 1;
    for (auto e : shape) n *= e;
    return shape.empty() ? 0 : n;
  }
  /// Elements from `data` to one past the last element the view reaches.
  std::int64_t span_elements() const {
    if (strides.empty()) return elements();
    if (elements() == 0) return 0;
    std::int64_t s = 1;
    for (std::size_t d = 0; d < shape.size(); ++d) s += (shape[d] - 1) * strides[d];
    return s;
  }
  bool dense() const {
    if (strides.empty()) return true;
    std::int64_t s = 1;
    for (std::size_t d = shape.size(); d-- > 0;) {
      if (shape[d] > 1 && strides[d] != s) return false;
      s *= shape[d];
    }
    return true;
  }
};

/// What one replay did on this rank.
struct ExecutorStats {
  std::int64_t bytes_sent = 0, bytes_received = 0;  ///< over the transport
  std::int64_t local_bytes = 0;                     ///< copied within the rank
  std::int64_t messages_sent = 0, messages_received = 0;
  std::int64_t zero_copy_bytes = 0;   ///< sent and received without staging on either side
  std::int64_t packed_bytes = 0, unpacked_bytes = 0;
  int waves = 0;
  std::uint64_t version = 0;                ///< the refit version this run carried
  std::int64_t checksummed_bytes = 0;       ///< bytes checksummed (sent + received)
  double checksum_seconds = 0;              ///< time spent computing checksums
  std::int64_t staging_bytes = 0;       ///< staging memory allocated
  std::int64_t peak_staging_bytes = 0;  ///< most staging in use at once (waves in flight), measured
  double seconds = 0;
  /// Device buffers: the copy stream's event after the refit's last copy
  /// (see StreamOrder::wait); valid until the engine's next refit. nullptr
  /// on host memory.
  DeviceEvent done = nullptr;
  /// Device buffers: times the host waited for the copy stream inside the
  /// run (a host-driven transport: once per wave with packed sends).
  std::int64_t host_waits = 0;

  /// Adds the counts of another run that is part of this one (a staged
  /// refit's stages); version, seconds, staging and `done` are the caller's.
  void add_counts(const ExecutorStats& o) {
    for (auto f : {&ExecutorStats::bytes_sent, &ExecutorStats::bytes_received, &ExecutorStats::local_bytes, &ExecutorStats::messages_sent,
                   &ExecutorStats::messages_received, &ExecutorStats::zero_copy_bytes, &ExecutorStats::packed_bytes,
                   &ExecutorStats::unpacked_bytes, &ExecutorStats::checksummed_bytes, &ExecutorStats::host_waits})
      this->*f += o.*f;
    waves += o.waves;
    checksum_seconds += o.checksum_seconds;
  }
};

namespace exec_detail {

constexpr std::int64_t kInf = INT64_MAX;

/// Dense row-major shape of a buffer and where its view puts each element.
struct ViewMap {
  int rank = 0;
  bool identity = true;
  std::array<std::int64_t, kMaxTensorRank> dims{}, dense{}, view{};

  static ViewMap of(const BoundBuffer& b) {
    ViewMap m;
    m.rank = static_cast<int>(b.shape.size());
    m.identity = b.dense();
    std::int64_t s = 1;
    for (int j = m.rank - 1; j >= 0; --j) {
      const auto u = static_cast<std::size_t>(j);
      m.dims[u] = b.shape[u];
      m.dense[u] = s;
      m.view[u] = b.strides.empty() ? s : b.strides[u];
      s *= b.shape[u];
    }
    return m;
  }
  void digits(std::int64_t o, std::int64_t* out) const {
    for (int j = 0; j < rank; ++j) {
      const auto u = static_cast<std::size_t>(j);
      out[j] = j == 0 ? o / dense[u] : (o / dense[u]) % dims[u];
    }
  }
  void stride_digits(std::int64_t s, std::int64_t* out) const {
    for (int j = 0; j < rank; ++j) {
      const auto u = static_cast<std::size_t>(j);
      out[j] = s / dense[u];
      s %= dense[u];
    }
  }
  std::int64_t map(const std::int64_t* dig) const {
    std::int64_t v = 0;
    for (int j = 0; j < rank; ++j) v += dig[j] * view[static_cast<std::size_t>(j)];
    return v;
  }
  /// Is the box (dense offset o, strides st) free of carries, so that it maps
  /// to one strided box of the view? Gives the view offset and strides.
  bool affine(std::int64_t o, int r, const std::int64_t* ext, const std::int64_t* st, std::int64_t& vo,
              std::int64_t* vst) const {
    if (identity) {
      vo = o;
      for (int k = 0; k < r; ++k) vst[k] = st[k];
      return true;
    }
    std::array<std::int64_t, kMaxTensorRank> dig{}, acc{}, sd{};
    digits(o, dig.data());
    acc = dig;
    for (int k = 0; k < r; ++k) {
      stride_digits(st[k], sd.data());
      vst[k] = map(sd.data());
      for (int j = 0; j < rank; ++j) acc[static_cast<std::size_t>(j)] += (ext[k] - 1) * sd[static_cast<std::size_t>(j)];
    }
    for (int j = 0; j < rank; ++j)
      if (acc[static_cast<std::size_t>(j)] >= dims[static_cast<std::size_t>(j)]) return false;
    vo = map(dig.data());
    return true;
  }
  /// Steps of stride s from dense offset x that stay carry-free (>= 1).
  std::int64_t steps(std::int64_t x, std::int64_t s) const {
    if (identity) return kInf;
    std::array<std::int64_t, kMaxTensorRank> dig{}, sd{};
    digits(x, dig.data());
    stride_digits(s, sd.data());
    std::int64_t m = kInf;
    for (int j = 0; j < rank; ++j) {
      const auto u = static_cast<std::size_t>(j);
      if (sd[u] > 0) m = std::min(m, (dims[u] - 1 - dig[u]) / sd[u] + 1);
    }
    return std::max<std::int64_t>(m, 1);
  }
};

/// A part of a copy: the same box in view coordinates, holding elements
/// [first, first + count) of the copy's row-major order. A one-sided part
/// (sides 1) leaves the destination side's offset and strides 0.
struct Part : StridedBox {
  std::int64_t first = 0, count = 0;
  int sides = 1;
};

/// Appends p, merging it into the previous part when the two form one box
/// (detail::merge_into, the schedule's merge) over consecutive elements.
inline void emit_part(std::vector<Part>& out, const Part& p) {
  if (!out.empty()) {
    Part& L = out.back();
    if (L.first + L.count == p.first && detail::merge_into(L, p, p.sides)) {
      L.count += p.count;
      return;
    }
  }
  out.push_back(p);
}

/// The box b (its first `sides` sides in dense buffer coordinates) as one
/// part in view coordinates, if every side maps to one strided box.
inline bool to_part(const StridedBox& b, int sides, const ViewMap* const* maps, std::int64_t first, Part& p) {
  p = Part{};
  p.first = first;
  p.sides = sides;
  p.assign(b.rank, b.extents(), b.strides(0), b.strides(1));
  p.count = b.elements();
  for (int s = 0; s < sides; ++s)
    if (!maps[s]->affine(b.offset(s), b.rank, b.extents(), b.strides(s), p.offset(s), p.strides_for(s, b.rank))) return false;
  return true;
}

/// Splits a box into parts that each map to one strided box on every side.
inline void split_box(const StridedBox& b, int sides, const ViewMap* const* maps, std::int64_t first, std::vector<Part>& out) {
  Part p;
  if (to_part(b, sides, maps, first, p)) {
    emit_part(out, p);
    return;
  }
  if (b.rank == 1) {
    const std::int64_t e = b.extent(0);
    std::int64_t i = 0;
    while (i < e) {
      std::int64_t m = e - i;
      for (int s = 0; s < sides; ++s) m = std::min(m, maps[s]->steps(b.offset(s) + i * b.stride(s, 0), b.stride(s, 0)));
      StridedBox sub = b;
      sub.extent(0) = m;
      for (int s = 0; s < sides; ++s) sub.offset(s) += i * b.stride(s, 0);
      if (!to_part(sub, sides, maps, first + i, p)) {  // cannot happen: carry-free by construction; go element-wise
        sub.extent(0) = m = 1;
        to_part(sub, sides, maps, first + i, p);
      }
      emit_part(out, p);
      i += m;
    }
    return;
  }
  std::int64_t inner = 1;
  for (int k = 1; k < b.rank; ++k) inner *= b.extent(k);
  StridedBox sub;
  sub.assign(b.rank - 1, b.extents() + 1, b.strides(0) + 1, b.strides(1) + 1);
  for (std::int64_t i = 0; i < b.extent(0); ++i) {
    for (int s = 0; s < sides; ++s) sub.offset(s) = b.offset(s) + i * b.stride(s, 0);
    split_box(sub, sides, maps, first + i * inner, out);
  }
}

/// Is one side of a box one unit-stride run (row-major dense over the extents)?
inline bool contiguous(int rank, const std::int64_t* ext, const std::int64_t* st) { return dense_run(rank, ext, st); }

/// Dense-coordinate bounds of one side of a copy.
inline bool in_bounds(std::int64_t off, int rank, const std::int64_t* ext, const std::int64_t* st, std::int64_t n) {
  std::int64_t lo = off, hi = off;
  for (int k = 0; k < rank; ++k) {
    if (ext[k] <= 0) return true;
    const std::int64_t span = (ext[k] - 1) * st[k];
    (span < 0 ? lo : hi) += span;
  }
  return lo >= 0 && hi < n;
}

using reshard::hash_mix;

inline std::uint64_t copy_digest(std::uint64_t h, const Copy& c) {
  h = hash_mix(h, static_cast<std::uint64_t>(c.src_buffer));
  h = hash_mix(h, static_cast<std::uint64_t>(c.dst_buffer));
  h = hash_mix(h, static_cast<std::uint64_t>(c.element_bytes));
  h = hash_mix(h, static_cast<std::uint64_t>(c.src_offset));
  h = hash_mix(h, static_cast<std::uint64_t>(c.dst_offset));
  h = hash_mix(h, static_cast<std::uint64_t>(c.rank));
  for (int k = 0; k < c.rank; ++k) {
    h = hash_mix(h, static_cast<std::uint64_t>(c.extent(k)));
    h = hash_mix(h, static_cast<std::uint64_t>(c.src_stride(k)));
    h = hash_mix(h, static_cast<std::uint64_t>(c.dst_stride(k)));
  }
  return h;
}

constexpr std::uint32_t kBlobMagic = 0x52534832;  // "RSH2"
constexpr std::uint32_t kControlMagic = 0x5253434B;  // "RSCK"
// The device engine's event slots an executor records (one run at a time per engine).
constexpr int kStartSlot = 0;     // the copy stream after the caller's events
constexpr int kPackSlot = 1;      // after a wave's pack
constexpr int kTransferSlot = 2;  // + wave % 2: the transport's stream after a wave's batch
constexpr int kDoneSlot = 4;      // after the run's last copy
constexpr int kQuantSourcesSlot = 5;  // after the senders' FP8 quantizing (quant_refit.hpp)
constexpr int kQuantDoneSlot = 6;     // after the receivers' FP8 quantizing
constexpr int kCallerSlot = 7;        // a binding's: the caller's stream when a refit starts (python/src)
/// Control message: magic, count, version (8), wave, count CRCs, own CRC.
inline std::uint64_t control_bytes(std::size_t count) { return 4 + 4 + 8 + 4 + 4 * static_cast<std::uint64_t>(count) + 4; }

}  // namespace exec_detail

template <class T>
class Executor {
  static_assert(check_transport<T>(), "reshard::Executor<T>: T must model reshard::Transport (see transport.hpp)");

 public:
  using request = typename T::request;

  Executor() = default;
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;
  ~Executor() { release(); }

  /// Compiles `schedule` (which must hold at least every copy this rank
  /// sends or receives) into this rank's program. Collective: every rank of
  /// the transport's world calls setup. `src` / `dst` are indexed like the
  /// schedule's buffer ids (nullptr where this rank has no such buffer).
  /// A non-empty `local_error` (e.g. a bad buffer found by the caller) is
  /// shared with all ranks so that every one fails setup, none hangs.
  void setup(const Schedule& schedule, std::vector<const BoundBuffer*> src, std::vector<const BoundBuffer*> dst,
             T& transport, ExecutorOptions opt = {}, std::string local_error = {});

  /// Runs the program once: moves every byte of the schedule. Throws (after
  /// aborting the transport) on any failure. `version` names this refit (all
  /// ranks pass the same; with checksums it travels with every pair's
  /// control message and is checked); run() uses runs() + 1.
  /// With device buffers, `order` says what the run waits for on the
  /// device and whether it returns before its copies end (StreamOrder).
  ExecutorStats run(std::uint64_t version, const StreamOrder& order = {}) {
    enqueue(version, order);
    return complete();
  }
  ExecutorStats run() { return run(static_cast<std::uint64_t>(runs_) + 1); }

  /// run() in two halves. enqueue(): with device buffers on a transport with
  /// a device stream (NCCL; DeviceStreamTransport), enqueues every pack,
  /// transfer and unpack of the run after `order`'s events and returns with
  /// no host wait at all; enqueued_done() is then the event after the last
  /// copy, which a consumer's stream may wait for at once. complete() waits
  /// on the host for the transport's requests (a failure names the wave and
  /// peers) and, with `order.wait`, for the copies. Otherwise (a host-driven
  /// transport, host buffers) enqueue() moves everything as run() does and
  /// complete() closes the run. One run at a time; either half throws after
  /// aborting the transport on any failure.
  void enqueue(std::uint64_t version, const StreamOrder& order = {});
  ExecutorStats complete();
  /// Between enqueue() and complete(): the event after the run's last copy (device buffers; else nullptr).
  DeviceEvent enqueued_done() const { return in_run_ ? run_.st.done : nullptr; }

  /// Names for error messages, by destination-layout tensor id (a Copy's
  /// `tensor`); without them tensors are "tensor #id". Set before setup.
  void set_tensor_names(std::vector<std::string> names) { tensor_names_ = std::move(names); }
  std::string tensor_name(std::int32_t id) const {
    return id >= 0 && static_cast<std::size_t>(id) < tensor_names_.size() ? tensor_names_[static_cast<std::size_t>(id)]
                                                                           : fmt::format("tensor #{}", id);
  }
  /// Destination tensors this rank writes (received or copied locally).
  std::vector<std::string> destination_tensors() const;
  /// After a failed run: per peer, the messages to this rank that did not
  /// arrive and pass their checks (empty after a successful run).
  std::vector<MissingPieces> missing() const { return broken_ ? pieces(true) : std::vector<MissingPieces>{}; }
  /// Per peer, everything a run brings to this rank (messages, and this
  /// rank's local copies under its own rank): what missing() names when
  /// nothing arrived (a staged run's stages after the failed one).
  std::vector<MissingPieces> incoming() const { return pieces(false); }
  /// What the last run (or the one in progress, or that failed) did to each
  /// destination buffer of this rank (BufferWrite), by buffer id.
  BufferWrites buffer_writes() const;
  bool broken() const { return broken_; }

  bool ready() const { return ready_; }
  /// Per replay, fixed at setup.
  std::int64_t planned_bytes_sent() const { return plan_sent_; }
  std::int64_t planned_bytes_received() const { return plan_recv_; }
  std::int64_t planned_local_bytes() const { return plan_local_; }
  int waves() const { return static_cast<int>(waves_.size()); }
  std::int64_t staging_bytes() const { return static_cast<std::int64_t>(staging_size_); }
  std::int64_t runs() const { return runs_; }
  std::int64_t compiles() const { return compiles_; }

 private:
  using Part = exec_detail::Part;

  /// Per peer, the messages to this rank (and local copies): all of them, or
  /// only those that did not arrive checked in the last run.
  std::vector<MissingPieces> pieces(bool only_missing) const;

  /// One remote copy as this rank sees it: its side only.
  struct SideCopy {
    std::size_t copy = 0;        ///< index into the schedule
    std::int32_t buffer = 0;     ///< this rank's buffer id (src or dst)
    std::int64_t element_bytes = 0, elements = 0;
    std::vector<Part> parts;
    bool dense_run = false;      ///< one unit-stride run in dense coordinates
    bool direct = false;         ///< one unit-stride run in memory
    std::int64_t run_offset = 0;  ///< element offset of that run from the buffer's data
  };
  struct Segment {
    std::uint32_t copy;  ///< index into Pair::copies
    std::int64_t first, count;
  };
  struct PairMessage {
    int wave = 0;
    int kind = 0;  ///< 0 direct both, 1 sender direct, 2 receiver direct, 3 bucket
    std::int64_t bytes = 0;
    std::uint64_t tag = 0;
    std::vector<Segment> segs;
  };
  struct Pair {
    std::int64_t peer = -1;
    bool send = true;  ///< this rank is the source
    std::vector<SideCopy> copies;
    std::vector<std::uint32_t> exceptions;  ///< dense runs that this rank's views break
    std::vector<std::uint32_t> peer_exceptions;
    std::int64_t bytes = 0, staged = 0, share = 0;
    std::uint64_t digest = 0;
    std::vector<PairMessage> messages;
  };
  /// A message as this rank executes it.
  struct Message {
    std::size_t pair = 0, msg = 0;
    bool staged = false;
    std::uint64_t staging_offset = 0;
  };
  struct Group {
    std::int64_t peer = -1;
    std::vector<TransferOp> ops;
    std::vector<std::size_t> staged;  ///< messages to pack before / unpack after
    std::vector<std::size_t> all{};   ///< every data message, in op order
    std::ptrdiff_t control = -1;      ///< receive: index into Wave::controls
    std::ptrdiff_t unpack_batch = -1;  ///< device, host-driven transport: the group's uploaded unpack batch
  };
  /// One checksum control message: a peer pair's data messages in one wave.
  struct Control {
    std::size_t pair = 0;
    std::vector<std::size_t> messages;  ///< indices into messages_
    std::uint64_t offset = 0, bytes = 0;  ///< in the integrity buffer
  };
  struct Wave {
    Group direct_sends;
    std::vector<Group> sends, recvs;
    Group control_sends;
    std::vector<Control> controls;
    std::int64_t staging = 0;
    /// Device buffers: the uploaded batch that packs every send group, and
    /// (a transport with a device stream) the one that unpacks every receive.
    std::ptrdiff_t pack_batch = -1, unpack_batch = -1;
    std::int64_t packed_bytes = 0, unpacked_bytes = 0;
  };
  struct LocalCopy {
    const BoundBuffer* src = nullptr;
    const BoundBuffer* dst = nullptr;
    std::int64_t element_bytes = 0;
    std::vector<Part> parts;
    std::int32_t tensor = 0;
  };

  [[noreturn]] void fail_here(const std::string& what) const { fail("rank {}: {}", me_, what); }
  void release();
  // The steps of setup(), in order (each collective from step 2 on).
  std::string bind_copies(const Schedule& schedule, std::string local_error);
  std::string agree_on_pairs(T& transport, const std::string& local_error, Deadline deadline);
  bool negotiate_staging(T& transport, std::string step_error, Deadline deadline);
  void compile_program(T& transport, bool reuse, Deadline deadline);
  /// Position of `rank` in the transport's world, -1 if absent.
  std::ptrdiff_t world_index(std::int64_t rank) const {
    auto it = world_pos_.find(rank);
    return it == world_pos_.end() ? -1 : it->second;
  }
  void build_side(const Copy& c, std::size_t index, bool src_side, SideCopy& out) const;
  std::vector<std::pair<bool, bool>> pair_modes(const Pair& p) const;
  void plan_pair_messages(Pair& p) const;
  void compile_waves(bool reuse, std::int64_t slot_capacity);
  void pack(const Message& m, std::byte* out) const;
  /// Device buffers: the copies that pack (or unpack) staged messages.
  cuda::BoxBatch device_batch(const std::vector<std::size_t>& staged, bool packing) const;
  /// Device buffers: builds and uploads every batch a run enqueues (setup).
  void upload_device_batches();
  /// A transport whose batches run on a device stream (transport.hpp).
  static constexpr bool kStreamTransport = DeviceStreamTransport<T>;
  DeviceStream transport_stream() {
    if constexpr (kStreamTransport) return t_->device_stream();
    return nullptr;
  }
  void unpack(const Message& m, const std::byte* in) const;
  /// Walks a message's pieces in message order: f(element bytes, part, box,
  /// first element within the part, element count, byte offset in the message).
  template <class F>
  void for_each_range(const Message& m, F&& f) const;
  void start_wave(std::size_t w, ExecutorStats& st, std::vector<request>& sends, std::vector<request>& recvs,
                  std::vector<std::size_t>& recv_groups);
  /// Device buffers: enqueues wave w's pack and orders the transport after it.
  void device_pack(std::size_t w, ExecutorStats& st);
  /// Byte range of a direct (zero-copy) message in its buffer.
  const std::byte* direct_range(const Message& m) const;
  /// Sender: CRCs of a wave's messages into its control messages.
  void write_controls(Wave& wv, ExecutorStats& st);
  /// Receiver: checks a completed group against its control message; the
  /// error ("" when all passed) and, in `bad`, the messages that failed.
  std::string check_group(std::size_t w, const Group& g, ExecutorStats& st, std::set<std::size_t>& bad) const;
  std::string tensors_of(const std::vector<std::size_t>& messages) const;
  /// The peers and tensors of a wave's receive groups (or, with `sends`, of
  /// its send requests by index) that are still pending.
  std::string pending_of(std::size_t w, const std::vector<std::size_t>& recv_groups, bool sends) const;
  void finish_wave(std::size_t w, ExecutorStats& st, std::vector<request>& sends, std::vector<request>& recvs,
                   std::vector<std::size_t>& recv_groups, Deadline deadline);
  const BoundBuffer& side_buffer(const Pair& p, const SideCopy& s) const {
    return p.send ? *src_[static_cast<std::size_t>(s.buffer)] : *dst_[static_cast<std::size_t>(s.buffer)];
  }
  RegionHandle side_region(const Pair& p, const SideCopy& s) const {
    return (p.send ? src_regions_[static_cast<std::size_t>(s.buffer)] : dst_regions_[static_cast<std::size_t>(s.buffer)]).handle();
  }

  T* t_ = nullptr;
  ExecutorOptions opt_;
  std::int64_t me_ = -1;
  std::vector<Copy> copies_;  ///< this rank's copies of the schedule
  std::vector<const BoundBuffer*> src_, dst_;
  std::vector<RegisteredRegion<T>> src_regions_, dst_regions_;
  std::vector<Pair> pairs_;
  std::map<std::pair<std::int64_t, bool>, std::size_t> pair_index_;  ///< (peer, this rank sends) -> pairs_ index
  std::map<std::int64_t, std::ptrdiff_t> world_pos_;                 ///< rank -> position in world_ranks()
  std::vector<LocalCopy> local_;
  std::vector<Message> messages_;
  std::vector<Wave> waves_;
  std::unique_ptr<std::byte[]> staging_;
  bool device_ = false;                  ///< buffers and staging in GPU memory (opt_.device moves them)
  std::byte* device_staging_ = nullptr;  ///< from opt_.device
  std::vector<std::size_t> uploads_;     ///< batches uploaded to opt_.device
  std::ptrdiff_t local_batch_ = -1;      ///< device: the uploaded local copies
  std::int64_t local_bytes_ = 0;
  bool copies_pending_ = false;          ///< device: copies enqueued since the host last waited
  /// One wave in flight: its send and receive requests.
  struct InFlight {
    std::size_t wave = 0;
    std::vector<request> sends, recvs;
    std::vector<std::size_t> recv_groups;
  };
  /// The run between enqueue() and complete().
  struct RunInFlight {
    ExecutorStats st;
    StreamOrder order;
    Clock::time_point t0{};
    Deadline deadline{};
    std::vector<InFlight> later;  ///< device stream: every wave's requests, waited for in complete()
  };
  RunInFlight run_;
  bool in_run_ = false;
  std::array<DeviceEvent, 2> transfer_{};  ///< device stream: the transport's stream after wave w (w % 2)
  std::size_t staging_size_ = 0;
  RegisteredRegion<T> staging_region_;
  std::int64_t plan_sent_ = 0, plan_recv_ = 0, plan_local_ = 0;
  bool ready_ = false, broken_ = false;
  std::int64_t runs_ = 0, compiles_ = 0;
  // Integrity and versions.
  std::vector<std::string> tensor_names_;
  std::unique_ptr<std::byte[]> integrity_;
  std::size_t integrity_size_ = 0;
  RegisteredRegion<T> integrity_region_;
  mutable std::vector<std::uint32_t> crc_;  ///< per message, this run (sender)
  std::vector<char> arrived_;               ///< per message, this run (receiver): arrived and checked
  std::vector<char> posted_;                ///< per message, this run (receiver): its receive was posted
  bool local_started_ = false, local_done_ = false;
  std::uint64_t version_ = 0;
};

// ---------------------------------------------------------------------------

template <class T>
void Executor<T>::release() {
  if (!t_) return;
  // Deregistered first: no peer may touch this memory once it is freed below.
  src_regions_.clear();
  dst_regions_.clear();
  staging_region_.reset();
  integrity_region_.reset();
  if (opt_.device && (device_staging_ || !uploads_.empty())) {
    try {
      opt_.device->synchronize();  // nothing enqueued may still read the descriptors or the staging
    } catch (const std::exception&) {
      // A failed device (sticky CUDA error): nothing runs on it any more.
    }
    for (std::size_t id : uploads_) opt_.device->release(id);
  }
  uploads_.clear();
  local_batch_ = -1;
  if (device_staging_ && opt_.device) opt_.device->free_staging(device_staging_);
  device_staging_ = nullptr;
  ready_ = false;
}

template <class T>
void Executor<T>::build_side(const Copy& c, std::size_t index, bool src_side, SideCopy& out) const {
  const BoundBuffer& b = src_side ? *src_[static_cast<std::size_t>(c.src_buffer)] : *dst_[static_cast<std::size_t>(c.dst_buffer)];
  out.copy = index;
  out.buffer = src_side ? c.src_buffer : c.dst_buffer;
  out.element_bytes = c.element_bytes;
  out.elements = c.elements();
  const int side = src_side ? 0 : 1;
  out.dense_run = exec_detail::contiguous(c.rank, c.extents(), c.strides(side));
  const exec_detail::ViewMap map = exec_detail::ViewMap::of(b);
  StridedBox box;
  box.assign_side(c, side);
  const exec_detail::ViewMap* maps[1] = {&map};
  exec_detail::split_box(box, 1, maps, 0, out.parts);
  out.direct = out.dense_run && out.parts.size() == 1 &&
               exec_detail::contiguous(out.parts[0].rank, out.parts[0].extents(), out.parts[0].strides(0));
  out.run_offset = out.direct ? out.parts[0].src_offset : 0;
}

template <class T>
void Executor<T>::setup(const Schedule& schedule, std::vector<const BoundBuffer*> src, std::vector<const BoundBuffer*> dst,
                        T& transport, ExecutorOptions opt, std::string local_error) {
  release();
  broken_ = false;
  t_ = &transport;
  opt_ = opt;
  me_ = transport.rank();
  src_ = std::move(src);
  dst_ = std::move(dst);
  pairs_.clear();
  local_.clear();
  messages_.clear();
  waves_.clear();
  copies_.clear();
  staging_.reset();
  staging_size_ = 0;
  integrity_.reset();
  integrity_size_ = 0;
  arrived_.clear();
  posted_.clear();
  crc_.clear();
  plan_sent_ = plan_recv_ = plan_local_ = 0;
  pair_index_.clear();
  world_pos_.clear();
  const auto world = transport.world_ranks();
  for (std::size_t i = 0; i < world.size(); ++i) world_pos_.emplace(world[i], static_cast<std::ptrdiff_t>(i));
  const Deadline deadline = Clock::now() + opt_.timeout;
  local_error = bind_copies(schedule, std::move(local_error));
  std::string step_error = agree_on_pairs(transport, local_error, deadline);
  const bool reuse = negotiate_staging(transport, std::move(step_error), deadline);
  compile_program(transport, reuse, deadline);
  ready_ = true;
  ++compiles_;
}

/// Step 1 of setup: local checks and this rank's side of every copy. Errors
/// are returned, not thrown, until every rank has heard of them.
template <class T>
std::string Executor<T>::bind_copies(const Schedule& schedule, std::string local_error) {
  try {
    if (!local_error.empty()) throw Error(local_error);
    if (opt_.pipeline < 1 || opt_.pipeline > 2) fail_here(fmt::format("executor pipeline must be 1 or 2, not {}", opt_.pipeline));
    if (opt_.staging_budget < 64) fail_here(fmt::format("staging budget of {} bytes is below the minimum of 64", opt_.staging_budget));
    if (opt_.zero_copy_min < 0) fail_here("zero_copy_min is negative");
    if (opt_.max_direct_messages < 0) fail_here(fmt::format("max_direct_messages is negative ({})", opt_.max_direct_messages));
    if (opt_.max_batch_ops < -1 || (opt_.max_batch_ops > 0 && opt_.max_batch_ops < BatchCap::kMinimum))
      fail_here(fmt::format("max_batch_ops is {}: it must be -1 (the transport's), 0 (no bound) or at least {}", opt_.max_batch_ops,
                            BatchCap::kMinimum));
    if (world_index(me_) < 0) fail_here("the transport's world does not list this rank");
    if (opt_.checksum)
      for (const auto* v : {&src_, &dst_})
        for (const BoundBuffer* b : *v)
          if (b && b->memory != MemoryKind::host)
            fail_here(fmt::format("checksums are computed on the host, but buffer '{}' is device memory", b->name));
    device_ = false;
    {
      const BoundBuffer *host = nullptr, *dev = nullptr;
      for (const auto* v : {&src_, &dst_})
        for (const BoundBuffer* b : *v)
          if (b) (b->memory == MemoryKind::device ? dev : host) = b;
      if (dev && !opt_.device)
        fail_here(fmt::format("buffer '{}' is device memory: ExecutorOptions::device must be a DeviceCopyEngine "
                              "(reshard::cuda::CudaCopyEngine) to pack it", dev->name));
      if (dev && host)
        fail_here(fmt::format("buffer '{}' is host memory and buffer '{}' device memory: a rank's buffers must all be one or the other",
                              host->name, dev->name));
      device_ = dev != nullptr;
    }
    if (schedule.only_rank >= 0 && schedule.only_rank != me_)
      fail_here(fmt::format("the schedule was planned for rank {} only", schedule.only_rank));
    for (const auto& c : schedule.copies)
      if (c.src_rank == me_ || c.dst_rank == me_) copies_.push_back(c);
    auto buffer_of = [&](bool src_side, const Copy& c) -> const BoundBuffer& {
      const auto& v = src_side ? src_ : dst_;
      const auto id = static_cast<std::size_t>(src_side ? c.src_buffer : c.dst_buffer);
      const auto& names = src_side ? schedule.src_buffers : schedule.dst_buffers;
      const std::string name = id < names.size() ? names[id] : fmt::format("#{}", id);
      if (id >= v.size() || !v[id])
        fail_here(fmt::format("the schedule {} {} buffer '{}', which is not bound on this rank", src_side ? "reads" : "writes",
                              src_side ? "source" : "destination", name));
      const BoundBuffer& b = *v[id];
      if (b.element_bytes != c.element_bytes)
        fail_here(fmt::format("{} buffer '{}' has {}-byte elements but the schedule moves {}-byte elements", src_side ? "source" : "destination",
                              name, b.element_bytes, c.element_bytes));
      const int side = src_side ? 0 : 1;
      if (!exec_detail::in_bounds(c.offset(side), c.rank, c.extents(), c.strides(side), b.elements()))
        fail_here(fmt::format("a copy of tensor #{} {} outside {} buffer '{}' ({} elements)", c.tensor, src_side ? "reads" : "writes",
                              src_side ? "source" : "destination", name, b.elements()));
      return b;
    };
    std::stable_sort(copies_.begin(), copies_.end(), [](const Copy& a, const Copy& b) {
      return std::tie(a.src_rank, a.dst_rank, a.dst_buffer, a.dst_offset, a.src_buffer, a.src_offset) <
             std::tie(b.src_rank, b.dst_rank, b.dst_buffer, b.dst_offset, b.src_buffer, b.src_offset);
    });
    for (std::size_t i = 0; i < copies_.size(); ++i) {
      const Copy& c = copies_[i];
      if (c.rank < 1 || c.rank > kMaxBoxRank) fail_here(fmt::format("a copy has box rank {}", c.rank));
      if (c.element_bytes < 1) fail_here("a copy has element size < 1");
      if (c.quant != CopyQuant::none)  // it needs a quantizer around the run: quant_refit.hpp
        fail_here("the schedule quantizes into FP8 tensors or casts between float dtypes; run it through QuantRefit (quant_refit.hpp), as Resharder does");
      if (c.is_local()) {
        const BoundBuffer& sb = buffer_of(true, c);
        const BoundBuffer& db = buffer_of(false, c);
        LocalCopy lc{&sb, &db, c.element_bytes, {}};
        lc.tensor = c.tensor;
        const auto ms = exec_detail::ViewMap::of(sb), md = exec_detail::ViewMap::of(db);
        const exec_detail::ViewMap* maps[2] = {&ms, &md};
        exec_detail::split_box(c, 2, maps, 0, lc.parts);
        plan_local_ += c.bytes();
        local_.push_back(std::move(lc));
        continue;
      }
      const bool i_send = c.src_rank == me_;
      const std::int64_t peer = i_send ? c.dst_rank : c.src_rank;
      if (world_index(peer) < 0)
        fail_here(fmt::format("the schedule {} rank {}, which is not in the transport's world", i_send ? "sends to" : "receives from", peer));
      buffer_of(i_send, c);
      auto [it, fresh] = pair_index_.emplace(std::make_pair(peer, i_send), pairs_.size());
      if (fresh) {
        pairs_.emplace_back();
        pairs_.back().peer = peer;
        pairs_.back().send = i_send;
      }
      Pair& p = pairs_[it->second];
      SideCopy s;
      build_side(c, i, i_send, s);
      if (s.dense_run && !s.direct) p.exceptions.push_back(static_cast<std::uint32_t>(p.copies.size()));
      p.bytes += c.bytes();
      p.digest = exec_detail::copy_digest(p.digest, c);
      (i_send ? plan_sent_ : plan_recv_) += c.bytes();
      p.copies.push_back(std::move(s));
    }
  } catch (const std::exception& e) {
    local_error = e.what();
  }
  return local_error;

}

/// Step 2 of setup: status and options (one fixed-size all_gather, with the
/// balance of this rank's pair summaries), then, pairwise, per pair what
/// this rank believes it moves, so a schedule mismatch is an error, not a
/// hang. Throws when a rank failed step 1; returns the first disagreement.
template <class T>
std::string Executor<T>::agree_on_pairs(T& transport, const std::string& local_error, Deadline deadline) {
  const auto world = transport.world_ranks();
  PairBalance balance;
  for (const auto& p : pairs_)
    balance.add(p.send, p.send ? me_ : p.peer, p.send ? p.peer : me_,
                {static_cast<std::uint64_t>(p.copies.size()), static_cast<std::uint64_t>(p.bytes), p.digest});
  BlobWriter w1;
  w1.put(exec_detail::kBlobMagic);
  w1.put<std::uint8_t>(local_error.empty() ? 1 : 0);
  w1.put_string(local_error);
  w1.put(opt_.zero_copy_min);
  w1.put(opt_.channel);
  w1.put<std::uint8_t>(opt_.checksum ? 1 : 0);
  w1.put(balance.sum);
  const auto blobs1 = transport.all_gather(w1.buf, deadline);
  if (!local_error.empty()) throw Error(local_error);
  // Checks against the peers' view; a failure here is shared in the next
  // all_gather (negotiate_staging) so that every rank fails setup together.
  std::string step_error;
  // Every blob is read whatever an earlier one held, so that every rank
  // derives the same sums (and the same choice below) from the same blobs.
  std::vector<std::uint64_t> sums(blobs1.size(), 1);
  std::int64_t failed_rank = -1;
  for (std::size_t r = 0; r < blobs1.size() && failed_rank < 0; ++r) {
    try {
      BlobReader rd(blobs1[r], world[r]);
      if (rd.get<std::uint32_t>() != exec_detail::kBlobMagic)
        fail_here(fmt::format("rank {} sent a setup blob of another format (a different executor?)", world[r]));
      const bool ok = rd.get<std::uint8_t>() != 0;
      const std::string msg = rd.get_string();
      if (!ok) {  // every rank reads the same: all leave below, none waits in the exchange
        failed_rank = world[r];
        step_error = msg;
        break;
      }
      const auto zcm = rd.get<std::int64_t>();
      const auto channel = rd.get<std::uint16_t>();
      const bool checksum = rd.get<std::uint8_t>() != 0;
      sums[r] = rd.get<std::uint64_t>();
      if (zcm != opt_.zero_copy_min || channel != opt_.channel)
        fail_here(fmt::format("rank {} uses other executor options (zero_copy_min {} vs {}, channel {} vs {})", world[r], zcm,
                              opt_.zero_copy_min, channel, opt_.channel));
      if (checksum != opt_.checksum)
        fail_here(fmt::format("rank {} {} checksums but this rank {}: every rank must set ExecutorOptions::checksum alike", world[r],
                              checksum ? "uses" : "does not use", opt_.checksum ? "does" : "does not"));
    } catch (const std::exception& e) {
      if (step_error.empty()) step_error = e.what();
    }
  }
  if (failed_rank >= 0) throw Error(fmt::format("rank {}: setup failed on rank {}: {}", me_, failed_rank, step_error));
  // Pairwise when every pair's two ends agree (the same decision on every
  // rank: it is read off the same blobs); otherwise every rank's summaries
  // reach every rank, so the disagreement can be named.
  std::vector<PeerBlob> out;
  {
    std::map<std::int64_t, std::size_t> slot;
    for (const auto& p : pairs_) {
      auto [it, fresh] = slot.emplace(p.peer, out.size());
      if (fresh) out.push_back(PeerBlob{p.peer, {}});
      BlobWriter w;
      w.put<std::uint8_t>(p.send ? 1 : 0);
      w.put<std::uint64_t>(p.copies.size());
      w.put(p.bytes);
      w.put(p.digest);
      w.put<std::uint32_t>(static_cast<std::uint32_t>(p.exceptions.size()));
      for (auto e : p.exceptions) w.put(e);
      auto& b = out[it->second].bytes;
      b.insert(b.end(), w.buf.begin(), w.buf.end());
    }
  }
  std::vector<PeerBlob> views;
  try {
    views = exchange_with_peers(transport, out, PairBalance::balanced(sums), deadline);
  } catch (const std::exception& e) {  // the peers must not wait for this rank in the next all_gather
    transport.abort(fmt::format("rank {} failed setup: {}", me_, e.what()));
    throw;
  }
  try {
    if (!step_error.empty()) throw Error(step_error);
    std::set<std::pair<std::int64_t, bool>> confirmed;
    for (const auto& v : views) {
      BlobReader rd(v.bytes, v.peer);
      while (!rd.done()) {
        const bool sends = rd.get<std::uint8_t>() != 0;
        const auto count = rd.get<std::uint64_t>();
        const auto bytes = rd.get<std::int64_t>();
        const auto digest = rd.get<std::uint64_t>();
        std::vector<std::uint32_t> exc(rd.get<std::uint32_t>());
        for (auto& e : exc) e = rd.get<std::uint32_t>();
        auto it = pair_index_.find({v.peer, !sends});
        const std::string dir = sends ? fmt::format("rank {} to rank {}", v.peer, me_) : fmt::format("rank {} to rank {}", me_, v.peer);
        if (it == pair_index_.end())
          fail_here(fmt::format("rank {} plans {} copies ({} bytes) from {}, but this rank's schedule has none: were both planned "
                                "from the same layouts?", v.peer, count, bytes, dir));
        Pair& p = pairs_[it->second];
        if (p.copies.size() != count || p.bytes != bytes || p.digest != digest)
          fail_here(fmt::format("this rank and rank {} disagree about the copies from {} ({} vs {} copies, {} vs {} bytes): were "
                                "both planned from the same layouts?", v.peer, dir, p.copies.size(), count, p.bytes, bytes));
        for (auto e : exc)
          if (e >= p.copies.size()) fail_here(fmt::format("rank {} names copy {} of a pair of {} copies", v.peer, e, p.copies.size()));
        p.peer_exceptions = std::move(exc);
        confirmed.insert({v.peer, !sends});
      }
    }
    for (const auto& p : pairs_)
      if (!confirmed.count({p.peer, p.send}))
        fail_here(fmt::format("this rank's schedule {} rank {} ({} bytes) but rank {} plans no such copies: were both planned from "
                              "the same layouts?", p.send ? "sends to" : "receives from", p.peer, p.bytes, p.peer));
  } catch (const std::exception& e) {
    step_error = e.what();
  }
  return step_error;
}

/// Step 3 of setup: each pair's staged bytes, this rank's capacity per wave,
/// and (one fixed-size all_gather, which also shares step 2's verdict) each
/// pair's share of both ends' staging budgets; plans the pairs' messages.
/// Returns whether waves reuse staging (the budget is exceeded).
template <class T>
bool Executor<T>::negotiate_staging(T& transport, std::string step_error, Deadline deadline) {
  const auto world = transport.world_ranks();
  std::int64_t total_staged = 0;
  bool reuse = false;
  std::int64_t capacity = -1;  // -1: this rank does not constrain its pairs
  try {
    if (!step_error.empty()) throw Error(step_error);
    for (auto& p : pairs_) {
      const auto modes = pair_modes(p);
      p.staged = 0;
      for (std::size_t i = 0; i < p.copies.size(); ++i)
        if (!(modes[i].first && modes[i].second)) p.staged += copies_[p.copies[i].copy].bytes();
      total_staged += p.staged;
    }
    // Within the budget, every wave gets its own staging (no reuse, no
    // constraint); over it, each of `pipeline` slots holds one wave.
    // (message_rule.hpp: the simulator counts messages by the same rule.)
    reuse = total_staged > opt_.staging_budget;
    if (reuse) {
      const auto staged_pairs =
          static_cast<std::int64_t>(std::count_if(pairs_.begin(), pairs_.end(), [](const Pair& p) { return p.staged > 0; }));
      capacity = staging_capacity(total_staged, staged_pairs, opt_.staging_budget, opt_.pipeline);
      if (capacity <= 0)
        fail_here(fmt::format("a staging budget of {} bytes is too small for {} peer pairs with staged data (needs more than {} bytes)",
                              opt_.staging_budget, staged_pairs, 16 * staged_pairs * opt_.pipeline));
    }
  } catch (const std::exception& e) {
    step_error = e.what();
  }
  // The batch cap and this rank's degree (its peer pairs) ride along: every
  // pair's waves depend on both ends' degrees (batch_cap.hpp).
  const std::int64_t max_batch_ops = opt_.max_batch_ops >= 0 ? opt_.max_batch_ops : max_batch_ops_of(transport);
  BlobWriter w2;
  w2.put<std::uint8_t>(step_error.empty() ? 1 : 0);
  w2.put_string(step_error);
  w2.put(total_staged);
  w2.put(capacity);
  w2.put(max_batch_ops);
  w2.put(static_cast<std::int64_t>(pairs_.size()));
  const auto blobs2 = transport.all_gather(w2.buf, deadline);
  if (!step_error.empty()) throw Error(step_error);
  std::vector<std::pair<std::int64_t, std::int64_t>> load(world.size());
  std::vector<std::int64_t> degree(world.size(), 0);
  BatchCap cap;
  cap.max_ops = max_batch_ops;
  cap.world = static_cast<std::int64_t>(world.size());
  cap.checksum = opt_.checksum;
  for (std::size_t r = 0; r < blobs2.size(); ++r) {
    BlobReader rd(blobs2[r], world[r]);
    const bool ok = rd.get<std::uint8_t>() != 0;
    const std::string msg = rd.get_string();
    if (!ok) throw Error(fmt::format("rank {}: setup failed on rank {}: {}", me_, world[r], msg));
    load[r].first = rd.get<std::int64_t>();
    load[r].second = rd.get<std::int64_t>();
    const auto theirs = rd.get<std::int64_t>();
    degree[r] = rd.get<std::int64_t>();
    if (theirs != max_batch_ops)
      throw Error(fmt::format("rank {}: this rank bounds a batch to {} ops but rank {} to {} (0: no bound): every rank must use the "
                              "same max_batch_ops, or the ends of a pair would put its messages in different waves",
                              me_, max_batch_ops, world[r], theirs));
    cap.max_degree = std::max(cap.max_degree, degree[r]);
  }
  auto limit = [&](std::int64_t rank, std::int64_t staged) -> std::int64_t {
    const auto& [tot, cap] = load[static_cast<std::size_t>(world_index(rank))];
    return staging_share(cap, tot, staged);
  };
  for (auto& p : pairs_) {
    if (p.staged == 0) continue;
    const std::int64_t s = p.send ? me_ : p.peer, d = p.send ? p.peer : me_;
    p.share = std::min({limit(s, p.staged), limit(d, p.staged), p.staged});
    plan_pair_messages(p);
  }
  for (auto& p : pairs_)
    if (p.staged == 0) plan_pair_messages(p);
  // Bounded batches: each pair's messages spread over waves both ends compute alike.
  if (cap.max_ops > 0)
    for (auto& p : pairs_) {
      BatchPair bp;
      const std::int64_t s = p.send ? me_ : p.peer, d = p.send ? p.peer : me_;
      bp.world_pos_src = world_index(s);
      bp.world_pos_dst = world_index(d);
      bp.degree_src = degree[static_cast<std::size_t>(bp.world_pos_src)];
      bp.degree_dst = degree[static_cast<std::size_t>(bp.world_pos_dst)];
      std::vector<int> waves;
      for (const auto& m : p.messages) waves.push_back(m.wave);
      const std::vector<int> bounded = bounded_waves(waves, cap, bp);
      for (std::size_t k = 0; k < p.messages.size(); ++k) p.messages[k].wave = bounded[k];
    }
  return reuse;
}

/// Step 4 of setup: registers the buffers, lays out staging per wave, builds
/// the op groups and prepares them with the transport (collective).
template <class T>
void Executor<T>::compile_program(T& transport, bool reuse, Deadline deadline) {
  try {
    auto register_buffers = [&](const std::vector<const BoundBuffer*>& bufs, std::vector<RegisteredRegion<T>>& regions) {
      regions.clear();
      regions.resize(bufs.size());
      for (std::size_t b = 0; b < bufs.size(); ++b)
        if (bufs[b] && bufs[b]->span_elements() > 0)
          regions[b] = RegisteredRegion<T>(transport, bufs[b]->data,
                                           static_cast<std::size_t>(bufs[b]->span_elements() * bufs[b]->element_bytes), bufs[b]->memory);
    };
    register_buffers(src_, src_regions_);
    register_buffers(dst_, dst_regions_);
    compile_waves(reuse, reuse ? opt_.staging_budget / opt_.pipeline : 0);
    std::vector<TransferOp> all;
    for (const auto& wv : waves_) {
      for (const auto& g : wv.recvs) all.insert(all.end(), g.ops.begin(), g.ops.end());
      all.insert(all.end(), wv.direct_sends.ops.begin(), wv.direct_sends.ops.end());
      for (const auto& g : wv.sends) all.insert(all.end(), g.ops.begin(), g.ops.end());
      all.insert(all.end(), wv.control_sends.ops.begin(), wv.control_sends.ops.end());
    }
    transport.prepare(all, deadline);
  } catch (const std::exception& e) {
    transport.abort(fmt::format("rank {} failed setup: {}", me_, e.what()));
    release();
    throw;
  }
}

template <class T>
std::vector<std::pair<bool, bool>> Executor<T>::pair_modes(const Pair& p) const {
  // (sender reads in place, receiver writes in place) per copy: big enough,
  // one run in dense coordinates, and not broken by either side's view.
  std::vector<char> mine(p.copies.size(), 0), theirs(p.copies.size(), 0);
  for (auto e : p.exceptions) mine[e] = 1;
  for (auto e : p.peer_exceptions) theirs[e] = 1;
  std::vector<std::pair<bool, bool>> out(p.copies.size());
  for (std::size_t i = 0; i < p.copies.size(); ++i) {
    const Copy& c = copies_[p.copies[i].copy];
    out[i].first = in_place(c.bytes(), dense_run(c.rank, c.extents(), c.strides(0)) && !(p.send ? mine[i] : theirs[i]),
                            opt_.zero_copy_min);
    out[i].second = in_place(c.bytes(), dense_run(c.rank, c.extents(), c.strides(1)) && !(p.send ? theirs[i] : mine[i]),
                             opt_.zero_copy_min);
  }
  // Bucketing: past max_direct_messages, the smaller in-place copies are
  // packed (the largest keep their own message; ties by canonical order, so
  // both ends choose alike).
  const auto cap = static_cast<std::size_t>(opt_.max_direct_messages);
  if (cap == 0) return out;
  std::vector<std::size_t> direct;
  for (std::size_t i = 0; i < out.size(); ++i)
    if (out[i].first || out[i].second) direct.push_back(i);
  if (direct.size() > cap) {
    std::stable_sort(direct.begin(), direct.end(),
                     [&](std::size_t a, std::size_t b) { return copies_[p.copies[a].copy].bytes() > copies_[p.copies[b].copy].bytes(); });
    for (std::size_t k = cap; k < direct.size(); ++k) out[direct[k]] = {false, false};
  }
  return out;
}

template <class T>
void Executor<T>::plan_pair_messages(Pair& p) const {
  // Both ends run this on the same inputs: the pair's copies in canonical
  // order, both sides' view exceptions, zero_copy_min and the share.
  p.messages.clear();
  const auto modes = pair_modes(p);
  std::vector<PairMessage> msgs;
  std::map<int, std::size_t> bucket_of_wave;
  int wave = 0;
  std::int64_t fill = 0;
  for (std::uint32_t i = 0; i < p.copies.size(); ++i) {
    const Copy& c = copies_[p.copies[i].copy];
    const auto [send_direct, recv_direct] = modes[i];
    const std::int64_t n = c.elements(), E = c.element_bytes;
    if (send_direct && recv_direct) {
      msgs.push_back(PairMessage{0, 0, c.bytes(), 0, {Segment{i, 0, n}}});
      continue;
    }
    const int kind = send_direct ? 1 : recv_direct ? 2 : 3;
    std::int64_t pos = 0;
    while (pos < n) {
      const std::int64_t room = (p.share - fill) / E;
      if (room <= 0) {
        ++wave;
        fill = 0;
        if (p.share < E) fail_here(fmt::format("staging share of {} bytes for rank {} is below one element", p.share, p.peer));
        continue;
      }
      const std::int64_t take = std::min(n - pos, room);
      if (kind == 3) {
        auto [it, fresh] = bucket_of_wave.emplace(wave, msgs.size());
        if (fresh) msgs.push_back(PairMessage{wave, 3, 0, 0, {}});
        msgs[it->second].segs.push_back(Segment{i, pos, take});
        msgs[it->second].bytes += take * E;
      } else {
        msgs.push_back(PairMessage{wave, kind, take * E, 0, {Segment{i, pos, take}}});
      }
      fill += take * E;
      pos += take;
    }
  }
  // Tag order: by wave; zero-copy first, then halves in stream order, then the bucket.
  std::stable_sort(msgs.begin(), msgs.end(), [](const PairMessage& a, const PairMessage& b) {
    auto rank_of = [](int k) { return k == 0 ? 0 : k == 3 ? 2 : 1; };
    return std::make_pair(a.wave, rank_of(a.kind)) < std::make_pair(b.wave, rank_of(b.kind));
  });
  for (std::size_t k = 0; k < msgs.size(); ++k)
    msgs[k].tag = (static_cast<std::uint64_t>(opt_.channel) << 48) | static_cast<std::uint64_t>(k);
  p.messages = std::move(msgs);
}

template <class T>
void Executor<T>::compile_waves(bool reuse, std::int64_t slot_capacity) {
  int nwaves = 0;
  for (const auto& p : pairs_)
    for (const auto& m : p.messages) nwaves = std::max(nwaves, m.wave + 1);
  waves_.assign(static_cast<std::size_t>(nwaves), Wave{});
  std::vector<std::int64_t> usage(static_cast<std::size_t>(nwaves), 0);
  // First pass: staging offsets within each wave.
  struct Pending {
    std::size_t message;
    int wave;
    std::int64_t offset_in_wave;
  };
  std::vector<Pending> staged;
  for (std::size_t pi = 0; pi < pairs_.size(); ++pi) {
    const Pair& p = pairs_[pi];
    for (std::size_t mi = 0; mi < p.messages.size(); ++mi) {
      const PairMessage& pm = p.messages[mi];
      const bool my_direct = p.send ? (pm.kind == 0 || pm.kind == 1) : (pm.kind == 0 || pm.kind == 2);
      Message m{pi, mi, !my_direct, 0};
      if (m.staged) {
        staged.push_back(Pending{messages_.size(), pm.wave, usage[static_cast<std::size_t>(pm.wave)]});
        usage[static_cast<std::size_t>(pm.wave)] += pm.bytes;
      }
      messages_.push_back(m);
    }
  }
  // Wave bases: two reused slots (pipelined), or every wave its own range.
  std::vector<std::int64_t> base(static_cast<std::size_t>(nwaves), 0);
  std::int64_t total = 0;
  if (reuse) {
    std::array<std::int64_t, 2> slot{0, 0};
    for (int w = 0; w < nwaves; ++w) {
      const auto s = static_cast<std::size_t>(w % opt_.pipeline);
      slot[s] = std::max(slot[s], usage[static_cast<std::size_t>(w)]);
      if (usage[static_cast<std::size_t>(w)] > slot_capacity)
        fail_here(fmt::format("internal: wave {} stages {} bytes, over its {} bytes", w, usage[static_cast<std::size_t>(w)], slot_capacity));
    }
    for (int w = 0; w < nwaves; ++w) base[static_cast<std::size_t>(w)] = (w % opt_.pipeline) == 0 ? 0 : slot[0];
    total = slot[0] + (opt_.pipeline > 1 ? slot[1] : 0);
  } else {
    for (int w = 0; w < nwaves; ++w) {
      base[static_cast<std::size_t>(w)] = total;
      total += usage[static_cast<std::size_t>(w)];
    }
  }
  for (const auto& s : staged) messages_[s.message].staging_offset = static_cast<std::uint64_t>(base[static_cast<std::size_t>(s.wave)] + s.offset_in_wave);
  for (int w = 0; w < nwaves; ++w) waves_[static_cast<std::size_t>(w)].staging = usage[static_cast<std::size_t>(w)];
  staging_size_ = static_cast<std::size_t>(total);
  if (staging_size_ > 0 && device_) {
    device_staging_ = opt_.device->allocate_staging(staging_size_);
    staging_region_ = RegisteredRegion<T>(*t_, device_staging_, staging_size_, MemoryKind::device);
  } else if (staging_size_ > 0) {
    staging_ = std::make_unique<std::byte[]>(staging_size_);  // value-initialized: pages touched now, not in a refit
    staging_region_ = RegisteredRegion<T>(*t_, staging_.get(), staging_size_, MemoryKind::host);
  }
  // Op groups: per wave, per peer, in tag order.
  for (std::size_t k = 0; k < messages_.size(); ++k) {
    const Message& m = messages_[k];
    const Pair& p = pairs_[m.pair];
    const PairMessage& pm = p.messages[m.msg];
    Wave& wv = waves_[static_cast<std::size_t>(pm.wave)];
    TransferOp op;
    op.kind = p.send ? OpKind::send : OpKind::recv;
    op.peer = p.peer;
    op.tag = pm.tag;
    op.bytes = static_cast<std::uint64_t>(pm.bytes);
    if (m.staged) {
      op.region = staging_region_.handle();
      op.offset = m.staging_offset;
    } else {
      const SideCopy& s = p.copies[pm.segs[0].copy];
      op.region = side_region(p, s);
      op.offset = static_cast<std::uint64_t>((s.run_offset + pm.segs[0].first) * s.element_bytes);
      if (!s.direct) fail_here("internal: a direct message over a piece that is not one run in memory");
    }
    Group* g = nullptr;
    if (!p.send) {
      if (wv.recvs.empty() || wv.recvs.back().peer != p.peer) wv.recvs.push_back(Group{p.peer, {}, {}});
      g = &wv.recvs.back();
    } else if (pm.kind == 0) {
      g = &wv.direct_sends;
    } else {
      if (wv.sends.empty() || wv.sends.back().peer != p.peer) wv.sends.push_back(Group{p.peer, {}, {}});
      g = &wv.sends.back();
    }
    g->ops.push_back(op);
    g->all.push_back(k);
    if (m.staged) g->staged.push_back(k);
  }
  crc_.assign(messages_.size(), 0);
  arrived_.assign(messages_.size(), 0);
  posted_.assign(messages_.size(), 0);
  if (device_) upload_device_batches();
  if (!opt_.checksum) return;
  // One control message per peer pair and wave, after the pair's data
  // messages in posting order on both sides (tag: the bit, then the wave).
  std::uint64_t at = 0;
  for (std::size_t w = 0; w < waves_.size(); ++w) {
    Wave& wv = waves_[w];
    std::map<std::size_t, std::size_t> control_of_pair;
    for (std::size_t k = 0; k < messages_.size(); ++k) {
      const Message& m = messages_[k];
      if (pairs_[m.pair].messages[m.msg].wave != static_cast<int>(w)) continue;
      auto [it, fresh] = control_of_pair.emplace(m.pair, wv.controls.size());
      if (fresh) wv.controls.push_back(Control{m.pair, {}, 0, 0});
      wv.controls[it->second].messages.push_back(k);
    }
    for (Control& c : wv.controls) {
      c.offset = at;
      c.bytes = exec_detail::control_bytes(c.messages.size());
      at += (c.bytes + 7) & ~std::uint64_t{7};
    }
  }
  integrity_size_ = static_cast<std::size_t>(at);
  if (integrity_size_ == 0) return;
  integrity_ = std::make_unique<std::byte[]>(integrity_size_);
  integrity_region_ = RegisteredRegion<T>(*t_, integrity_.get(), integrity_size_, MemoryKind::host);
  for (std::size_t w = 0; w < waves_.size(); ++w) {
    Wave& wv = waves_[w];
    for (std::size_t ci = 0; ci < wv.controls.size(); ++ci) {
      const Control& c = wv.controls[ci];
      const Pair& p = pairs_[c.pair];
      TransferOp op;
      op.kind = p.send ? OpKind::send : OpKind::recv;
      op.peer = p.peer;
      op.tag = (static_cast<std::uint64_t>(opt_.channel) << 48) | kChecksumTagBit | static_cast<std::uint64_t>(w);
      op.region = integrity_region_.handle();
      op.offset = c.offset;
      op.bytes = c.bytes;
      if (p.send) {
        wv.control_sends.ops.push_back(op);
        continue;
      }
      auto g = std::find_if(wv.recvs.begin(), wv.recvs.end(), [&](const Group& x) { return x.peer == p.peer; });
      if (g == wv.recvs.end()) fail_here("internal: a wave's control message has no receive group");
      g->ops.push_back(op);
      g->control = static_cast<std::ptrdiff_t>(ci);
    }
  }
}

template <class T>
template <class F>
void Executor<T>::for_each_range(const Message& m, F&& f) const {
  const Pair& p = pairs_[m.pair];
  std::int64_t at = 0;  // byte offset of the segment in the message
  for (const Segment& seg : p.messages[m.msg].segs) {
    const SideCopy& s = p.copies[seg.copy];
    std::byte* data = side_buffer(p, s).data;
    const auto E = static_cast<std::size_t>(s.element_bytes);
    const std::int64_t a = seg.first, b = seg.first + seg.count;
    for (const Part& part : s.parts) {
      const std::int64_t lo = std::max(a, part.first), hi = std::min(b, part.first + part.count);
      if (lo >= hi) continue;
      BoxSide box{data, part.src_offset, part.strides(0)};
      f(E, part, box, lo - part.first, hi - lo, at + (lo - a) * s.element_bytes);
    }
    at += seg.count * s.element_bytes;
  }
}

template <class T>
void Executor<T>::pack(const Message& m, std::byte* out) const {
  for_each_range(m, [&](std::size_t E, const Part& part, const BoxSide& box, std::int64_t first, std::int64_t count,
                        std::int64_t at) { pack_range(E, part.rank, part.extents(), box, first, count, out + at); });
}

template <class T>
void Executor<T>::unpack(const Message& m, const std::byte* in) const {
  for_each_range(m, [&](std::size_t E, const Part& part, const BoxSide& box, std::int64_t first, std::int64_t count,
                        std::int64_t at) { unpack_range(E, part.rank, part.extents(), box, first, count, in + at); });
}

template <class T>
cuda::BoxBatch Executor<T>::device_batch(const std::vector<std::size_t>& staged, bool packing) const {
  cuda::BoxBatch batch;
  for (std::size_t k : staged) {
    const Message& m = messages_[k];
    std::byte* stream = device_staging_ + m.staging_offset;
    for_each_range(m, [&](std::size_t E, const Part& part, const BoxSide& box, std::int64_t first, std::int64_t count, std::int64_t at) {
      const auto e = static_cast<std::int64_t>(E);
      batch.add(packing ? cuda::pack_copy(box.base, box.offset, part.rank, part.extents(), box.stride, first, count, stream + at, e, e)
                        : cuda::unpack_copy(box.base, box.offset, part.rank, part.extents(), box.stride, first, count, stream + at, e, e),
                e);
    });
  }
  return batch;
}

template <class T>
void Executor<T>::upload_device_batches() {
  DeviceCopyEngine& eng = *opt_.device;
  auto upload = [&](cuda::BoxBatch&& b) -> std::ptrdiff_t {
    if (b.empty()) return -1;
    uploads_.push_back(eng.upload(b));
    return static_cast<std::ptrdiff_t>(uploads_.back());
  };
  auto bytes_of = [&](const std::vector<std::size_t>& staged) {
    std::int64_t n = 0;
    for (std::size_t k : staged) n += pairs_[messages_[k].pair].messages[messages_[k].msg].bytes;
    return n;
  };
  for (Wave& wv : waves_) {
    // One pack batch per wave across all peers; unpacks per receive group
    // (a host-driven transport hands them over one by one) or, on a device
    // stream, one per wave.
    std::vector<std::size_t> packs, unpacks;
    for (const Group& g : wv.sends) packs.insert(packs.end(), g.staged.begin(), g.staged.end());
    wv.pack_batch = upload(device_batch(packs, true));
    wv.packed_bytes = bytes_of(packs);
    for (Group& g : wv.recvs) {
      unpacks.insert(unpacks.end(), g.staged.begin(), g.staged.end());
      if (!kStreamTransport) g.unpack_batch = upload(device_batch(g.staged, false));
    }
    if (kStreamTransport) wv.unpack_batch = upload(device_batch(unpacks, false));
    wv.unpacked_bytes = bytes_of(unpacks);
  }
  cuda::BoxBatch local;
  local_bytes_ = 0;
  for (const LocalCopy& lc : local_)
    for (const Part& part : lc.parts) {
      local.add(cuda::box_copy(lc.src->data, part.src_offset, part.strides(0), lc.dst->data, part.dst_offset, part.strides(1),
                               part.rank, part.extents(), lc.element_bytes, lc.element_bytes),
                lc.element_bytes);
      local_bytes_ += part.count * lc.element_bytes;
    }
  local_batch_ = upload(std::move(local));
}

template <class T>
void Executor<T>::device_pack(std::size_t w, ExecutorStats& st) {
  DeviceCopyEngine& eng = *opt_.device;
  const Wave& wv = waves_[w];
  if (wv.pack_batch >= 0) eng.enqueue(static_cast<std::size_t>(wv.pack_batch));
  st.packed_bytes += wv.packed_bytes;
  copies_pending_ = copies_pending_ || wv.pack_batch >= 0;
  if constexpr (kStreamTransport) {
    // The wave's batch runs on the transport's stream after the pack (and
    // after the unpacks of the wave whose staging it reuses), host untouched.
    eng.stream_wait(eng.record(exec_detail::kPackSlot), transport_stream());
  } else if (wv.pack_batch >= 0 || (copies_pending_ && wv.staging > 0)) {
    // A host-driven transport reads packed bytes in post(), and its receives
    // may reuse staging that earlier unpacks still read: one host wait.
    eng.synchronize();
    copies_pending_ = false;
    ++st.host_waits;
  }
}

template <class T>
void Executor<T>::start_wave(std::size_t w, ExecutorStats& st, std::vector<request>& sends, std::vector<request>& recvs,
                             std::vector<std::size_t>& recv_groups) {
  Wave& wv = waves_[w];
  if (device_) device_pack(w, st);
  for (std::size_t g = 0; g < wv.recvs.size(); ++g) {
    for (std::size_t k : wv.recvs[g].all) posted_[k] = 1;  // before the post: a direct receive may land at once
    recvs.push_back(t_->post(wv.recvs[g].ops));
    recv_groups.push_back(g);
  }
  if (!wv.direct_sends.ops.empty()) {
    // Checksums are taken before the bytes are handed to the transport, so a
    // change of the source while the send is in flight is caught too.
    if (opt_.checksum) {
      const auto c0 = Clock::now();
      for (std::size_t k : wv.direct_sends.all) {
        const auto n = pairs_[messages_[k].pair].messages[messages_[k].msg].bytes;
        crc_[k] = crc32c(direct_range(messages_[k]), static_cast<std::size_t>(n));
        st.checksummed_bytes += n;
      }
      st.checksum_seconds += std::chrono::duration<double>(Clock::now() - c0).count();
    }
    sends.push_back(t_->post(wv.direct_sends.ops));
    for (const auto& op : wv.direct_sends.ops) {
      st.bytes_sent += static_cast<std::int64_t>(op.bytes);
      st.zero_copy_bytes += static_cast<std::int64_t>(op.bytes);
    }
    st.messages_sent += static_cast<std::int64_t>(wv.direct_sends.ops.size());
  }
  for (const auto& g : wv.sends) {
    for (std::size_t k : g.staged) {
      if (device_) break;  // packed by device_pack()
      const Message& m = messages_[k];
      pack(m, staging_.get() + m.staging_offset);
      const std::int64_t n = pairs_[m.pair].messages[m.msg].bytes;
      st.packed_bytes += n;
      if (opt_.checksum) {  // while the packed bytes are still in cache
        const auto c0 = Clock::now();
        crc_[k] = crc32c(staging_.get() + m.staging_offset, static_cast<std::size_t>(n));
        st.checksum_seconds += std::chrono::duration<double>(Clock::now() - c0).count();
        st.checksummed_bytes += n;
      }
    }
    sends.push_back(t_->post(g.ops));
    for (const auto& op : g.ops) st.bytes_sent += static_cast<std::int64_t>(op.bytes);
    st.messages_sent += static_cast<std::int64_t>(g.ops.size());
  }
  if (opt_.checksum && !wv.control_sends.ops.empty()) {
    write_controls(wv, st);
    sends.push_back(t_->post(wv.control_sends.ops));
  }
}

template <class T>
const std::byte* Executor<T>::direct_range(const Message& m) const {
  const Pair& p = pairs_[m.pair];
  const PairMessage& pm = p.messages[m.msg];
  const SideCopy& s = p.copies[pm.segs[0].copy];
  return side_buffer(p, s).data + (s.run_offset + pm.segs[0].first) * s.element_bytes;
}

template <class T>
void Executor<T>::write_controls(Wave& wv, ExecutorStats& st) {
  const auto c0 = Clock::now();
  for (const Control& c : wv.controls) {
    if (!pairs_[c.pair].send) continue;
    std::byte* b = integrity_.get() + c.offset;
    const auto count = static_cast<std::uint32_t>(c.messages.size());
    const auto wave = static_cast<std::uint32_t>(pairs_[c.pair].messages[messages_[c.messages[0]].msg].wave);
    std::memcpy(b, &exec_detail::kControlMagic, 4);
    std::memcpy(b + 4, &count, 4);
    std::memcpy(b + 8, &version_, 8);
    std::memcpy(b + 16, &wave, 4);
    for (std::uint32_t i = 0; i < count; ++i) std::memcpy(b + 20 + 4 * i, &crc_[c.messages[i]], 4);
    const std::uint32_t self = crc32c(b, static_cast<std::size_t>(c.bytes - 4));
    std::memcpy(b + c.bytes - 4, &self, 4);
  }
  st.checksum_seconds += std::chrono::duration<double>(Clock::now() - c0).count();
}

template <class T>
std::string Executor<T>::tensors_of(const std::vector<std::size_t>& messages) const {
  std::set<std::int32_t> ids;
  for (std::size_t k : messages) {
    const Message& m = messages_[k];
    const Pair& p = pairs_[m.pair];
    for (const Segment& seg : p.messages[m.msg].segs) ids.insert(copies_[p.copies[seg.copy].copy].tensor);
  }
  std::vector<std::string> names;
  for (auto id : ids) names.push_back(tensor_name(id));
  constexpr std::size_t kShown = 8;
  std::string out = fmt::format("{}", fmt::join(names.begin(), names.begin() + static_cast<std::ptrdiff_t>(std::min(kShown, names.size())), ", "));
  if (names.size() > kShown) out += fmt::format(" and {} more", names.size() - kShown);
  return names.empty() ? std::string("no tensors") : "tensors " + out;
}

template <class T>
std::string Executor<T>::pending_of(std::size_t w, const std::vector<std::size_t>& recv_groups, bool sends) const {
  const Wave& wv = waves_[w];
  std::vector<std::string> parts;
  auto add = [&](const Group& g, const char* what) {
    std::map<std::int64_t, std::vector<std::size_t>> by_peer;
    for (std::size_t k : g.all) by_peer[pairs_[messages_[k].pair].peer].push_back(k);
    for (const auto& [peer, ks] : by_peer) {
      // By tag too, so the transport's message (which names the tag) points at its tensors.
      std::vector<std::string> tags;
      for (std::size_t j = 0; j < ks.size() && j < 8; ++j) {
        const Message& m = messages_[ks[j]];
        std::string t = tensors_of({ks[j]});
        if (t.rfind("tensors ", 0) == 0) t = t.substr(8);
        tags.push_back(fmt::format("{:#x} {}", pairs_[m.pair].messages[m.msg].tag, t));
      }
      if (ks.size() > 8) tags.push_back(fmt::format("and {} more", ks.size() - 8));
      parts.push_back(fmt::format("{} rank {} ({}; by tag: {})", what, peer, tensors_of(ks), fmt::join(tags, ", ")));
    }
  };
  if (!sends) {
    for (std::size_t gi : recv_groups) add(wv.recvs[gi], "messages from");
  } else {
    // Send requests in posting order: zero-copy group, packed groups, controls.
    std::vector<const Group*> order;
    if (!wv.direct_sends.ops.empty()) order.push_back(&wv.direct_sends);
    for (const auto& g : wv.sends) order.push_back(&g);
    for (std::size_t j : recv_groups) {
      if (j < order.size()) add(*order[j], "sends to");
      else parts.push_back("checksum control messages");
    }
  }
  return fmt::format("wave {}: {}", w, parts.empty() ? std::string("nothing") : fmt::format("{}", fmt::join(parts, "; ")));
}

template <class T>
std::string Executor<T>::check_group(std::size_t w, const Group& g, ExecutorStats& st, std::set<std::size_t>& bad_messages) const {
  if (g.control < 0) fail_here("internal: a receive group without its checksum control message");
  const Control& c = waves_[w].controls[static_cast<std::size_t>(g.control)];
  const std::int64_t peer = pairs_[c.pair].peer;
  const std::byte* b = integrity_.get() + c.offset;
  std::uint32_t magic = 0, count = 0, wave = 0, self = 0;
  std::uint64_t version = 0;
  std::memcpy(&magic, b, 4);
  std::memcpy(&count, b + 4, 4);
  std::memcpy(&version, b + 8, 8);
  std::memcpy(&wave, b + 16, 4);
  std::memcpy(&self, b + c.bytes - 4, 4);
  const auto c0 = Clock::now();
  const std::uint32_t self_now = crc32c(b, static_cast<std::size_t>(c.bytes - 4));
  bad_messages.insert(c.messages.begin(), c.messages.end());  // until checked
  if (magic != exec_detail::kControlMagic || self != self_now || count != c.messages.size() || wave != w)
    return (fmt::format("rank {}: refit version {}: the checksum control message from rank {} (wave {}) is damaged (its CRC32C "
                                     "{:#010x}, computed {:#010x}); the {} it covers are not verified",
                                     me_, version_, peer, w, self, self_now, tensors_of(c.messages)));
  if (version != version_)
    return (fmt::format("rank {}: rank {} sent wave {} of refit version {} while this rank refits version {}: a stale or "
                                     "duplicated message ({})",
                                     me_, peer, w, version, version_, tensors_of(c.messages)));
  std::vector<std::string> bad;
  for (std::uint32_t i = 0; i < count; ++i) {
    const std::size_t k = c.messages[i];
    const Message& m = messages_[k];
    const PairMessage& pm = pairs_[m.pair].messages[m.msg];
    const std::byte* data = m.staged ? staging_.get() + m.staging_offset : direct_range(m);
    const std::uint32_t got = crc32c(data, static_cast<std::size_t>(pm.bytes)), want = [&] {
      std::uint32_t v;
      std::memcpy(&v, b + 20 + 4 * i, 4);
      return v;
    }();
    st.checksummed_bytes += pm.bytes;
    if (got == want) bad_messages.erase(k);
    if (got != want)
      bad.push_back(fmt::format("message tag {:#x} ({} bytes, {}): CRC32C {:#010x}, the sender's {:#010x}", pm.tag, pm.bytes,
                                tensors_of({k}), got, want));
  }
  st.checksum_seconds += std::chrono::duration<double>(Clock::now() - c0).count();
  if (bad.empty()) return {};
  return fmt::format("rank {}: refit version {}: checksum mismatch in {} message(s) from rank {}: {}", me_, version_, bad.size(), peer,
                     fmt::join(bad, "; "));
}

template <class T>
std::vector<std::string> Executor<T>::destination_tensors() const {
  std::set<std::int32_t> ids;
  for (const auto& p : pairs_)
    if (!p.send)
      for (const auto& s : p.copies) ids.insert(copies_[s.copy].tensor);
  for (const auto& lc : local_) ids.insert(lc.tensor);
  std::vector<std::string> out;
  for (auto id : ids) out.push_back(tensor_name(id));
  return out;
}

template <class T>
std::vector<MissingPieces> Executor<T>::pieces(bool only_missing) const {
  std::vector<MissingPieces> out;
  std::map<std::int64_t, std::pair<MissingPieces, std::set<std::int32_t>>> by_peer;
  for (std::size_t k = 0; k < messages_.size(); ++k) {
    const Message& m = messages_[k];
    const Pair& p = pairs_[m.pair];
    if (p.send || (only_missing && arrived_[k])) continue;
    auto& [mp, ids] = by_peer[p.peer];
    mp.peer = p.peer;
    ++mp.messages;
    mp.bytes += p.messages[m.msg].bytes;
    for (const Segment& seg : p.messages[m.msg].segs) ids.insert(copies_[p.copies[seg.copy].copy].tensor);
  }
  if (!only_missing || !local_done_)
    for (const auto& lc : local_) {
      auto& [mp, ids] = by_peer[me_];
      mp.peer = me_;
      for (const Part& part : lc.parts) mp.bytes += part.count * lc.element_bytes;
      ids.insert(lc.tensor);
    }
  for (auto& [peer, e] : by_peer) {
    for (auto id : e.second) e.first.tensors.push_back(tensor_name(id));
    out.push_back(std::move(e.first));
  }
  return out;
}

template <class T>
BufferWrites Executor<T>::buffer_writes() const {
  // Per buffer: pieces this rank writes, those complete, and whether any
  // byte may have landed (a staged message lands only when unpacked, after
  // it arrived checked; a direct one from the moment it is posted).
  const std::size_t n = dst_.size();
  std::vector<std::int64_t> pieces(n, 0), complete(n, 0);
  std::vector<char> touched(n, 0);
  auto count = [&](std::size_t b, bool done, bool maybe) {
    if (b >= n) return;
    ++pieces[b];
    complete[b] += done ? 1 : 0;
    touched[b] = static_cast<char>(touched[b] || maybe);
  };
  for (std::size_t k = 0; k < messages_.size(); ++k) {
    const Message& m = messages_[k];
    const Pair& p = pairs_[m.pair];
    if (p.send) continue;
    const bool done = k < arrived_.size() && arrived_[k];
    const bool maybe = m.staged && !device_ ? done : (k < posted_.size() && posted_[k]);  // (device unpacks may be enqueued)
    std::set<std::int32_t> bufs;
    for (const Segment& seg : p.messages[m.msg].segs) bufs.insert(p.copies[seg.copy].buffer);
    for (auto b : bufs) count(static_cast<std::size_t>(b), done, maybe);
  }
  for (const LocalCopy& lc : local_) {
    const auto it = std::find(dst_.begin(), dst_.end(), lc.dst);
    count(static_cast<std::size_t>(it - dst_.begin()), local_done_, local_started_);
  }
  BufferWrites out(n, BufferWrite::none);
  for (std::size_t b = 0; b < n; ++b)
    if (pieces[b] > 0)
      out[b] = complete[b] == pieces[b] ? BufferWrite::written : touched[b] ? BufferWrite::partial : BufferWrite::untouched;
  return out;
}

template <class T>
void Executor<T>::finish_wave(std::size_t w, ExecutorStats& st, std::vector<request>& sends, std::vector<request>& recvs,
                              std::vector<std::size_t>& recv_groups, Deadline deadline) {
  Wave& wv = waves_[w];
  while (!recvs.empty()) {
    std::vector<request*> ptrs;
    for (auto& r : recvs) ptrs.push_back(&r);
    std::size_t i = 0;
    try {
      i = recvs.size() == 1 ? (t_->wait(recvs[0], deadline), 0) : t_->wait_any(ptrs, deadline);
    } catch (const IntegrityError&) {
      throw;
    } catch (const TransportError& e) {
      throw TransportError(fmt::format("{} [rank {} was still waiting for {}]", e.what(), me_, pending_of(w, recv_groups, false)));
    }
    const Group& g = wv.recvs[recv_groups[i]];
    // Checked messages land (and count as arrived) even when others of the
    // group failed: missing() then names only what is really missing.
    std::set<std::size_t> bad;
    const std::string integrity = opt_.checksum ? check_group(w, g, st, bad) : std::string();
    for (std::size_t k : g.all)
      if (!bad.count(k)) arrived_[k] = 1;
    if (device_ && !kStreamTransport) {  // (on a device stream the wave's unpack is already enqueued)
      if (g.unpack_batch >= 0) opt_.device->enqueue(static_cast<std::size_t>(g.unpack_batch));
      copies_pending_ = copies_pending_ || g.unpack_batch >= 0;
      for (std::size_t k : g.staged) st.unpacked_bytes += pairs_[messages_[k].pair].messages[messages_[k].msg].bytes;
    }
    for (std::size_t k : g.staged) {
      if (device_) break;
      if (bad.count(k)) continue;
      const Message& m = messages_[k];
      unpack(m, staging_.get() + m.staging_offset);
      st.unpacked_bytes += pairs_[m.pair].messages[m.msg].bytes;
    }
    if (!integrity.empty()) throw IntegrityError(integrity);
    for (const auto& op : g.ops) st.bytes_received += static_cast<std::int64_t>(op.bytes);
    st.messages_received += static_cast<std::int64_t>(g.ops.size());
    recvs.erase(recvs.begin() + static_cast<std::ptrdiff_t>(i));
    recv_groups.erase(recv_groups.begin() + static_cast<std::ptrdiff_t>(i));
  }
  for (std::size_t j = 0; j < sends.size(); ++j) {
    try {
      t_->wait(sends[j], deadline);
    } catch (const TransportError& e) {
      std::vector<std::size_t> left(sends.size() - j);
      std::iota(left.begin(), left.end(), j);
      throw TransportError(fmt::format("{} [rank {} was still sending {}]", e.what(), me_, pending_of(w, left, true)));
    }
  }
  sends.clear();
}

template <class T>
void Executor<T>::enqueue(std::uint64_t version, const StreamOrder& order) {
  if (!ready_) fail("executor: run() before a successful setup()");
  if (broken_) fail("rank {}: executor: an earlier run failed; the peers' state is unknown, set up again", me_);
  if (in_run_)
    fail("rank {}: executor: version {} is enqueued while version {} is not complete: complete() it first", me_, version, run_.st.version);
  run_ = RunInFlight{};
  ExecutorStats& st = run_.st;
  run_.order = order;
  version_ = st.version = version;
  std::fill(arrived_.begin(), arrived_.end(), char{0});
  std::fill(posted_.begin(), posted_.end(), char{0});
  local_started_ = local_done_ = false;
  st.waves = static_cast<int>(waves_.size());
  st.staging_bytes = static_cast<std::int64_t>(staging_size_);
  const auto t0 = run_.t0 = Clock::now();
  const Deadline deadline = run_.deadline = t0 + opt_.timeout;
  DeviceCopyEngine* eng = device_ ? opt_.device.get() : nullptr;
  if (!eng && (order.sources_final || order.destination_free))
    fail_here("run(): a StreamOrder with events orders device buffers, but this rank's buffers are host memory: nothing would wait for them");
  // A transport on a device stream: requests are waited for at the end.
  constexpr bool deferred = kStreamTransport;
  try {
    if (eng) {
      // Nothing touches the sources or the destination before the caller's
      // events: the copy stream waits on the device; the transport (which
      // reads and writes them directly, zero-copy) on its stream, or, driven
      // by the host, the host once.
      for (DeviceEvent e : {order.sources_final, order.destination_free}) eng->stream_wait(e);
      if (order.sources_final || order.destination_free) {
        if constexpr (deferred) {
          eng->stream_wait(eng->record(exec_detail::kStartSlot), transport_stream());
        } else {
          for (DeviceEvent e : {order.sources_final, order.destination_free}) eng->host_wait(e);
          ++st.host_waits;
        }
      }
    }
    std::array<InFlight, 2> fl;  // the waves in flight
    std::vector<InFlight>& later = run_.later;
    std::int64_t live = 0;
    auto start = [&](std::size_t w) {
      live += waves_[w].staging;
      st.peak_staging_bytes = std::max(st.peak_staging_bytes, live);
      auto& f = fl[w % 2];
      f.wave = w;
      start_wave(w, st, f.sends, f.recvs, f.recv_groups);
      // The wave is one batch: a batching transport (NCCL) launches it now,
      // so it moves while the next wave is packed (transport.hpp, "Batches").
      flush_batch(*t_, deadline);
      if constexpr (deferred)
        if (eng) transfer_[w % 2] = eng->record(exec_detail::kTransferSlot + static_cast<int>(w % 2), transport_stream());
    };
    auto finish = [&](std::size_t w) {
      auto& f = fl[w % 2];
      if (deferred && eng) {
        // The copy stream unpacks after the wave's batch; nobody waits here.
        eng->stream_wait(transfer_[w % 2]);
        const Wave& wv = waves_[w];
        if (wv.unpack_batch >= 0) eng->enqueue(static_cast<std::size_t>(wv.unpack_batch));
        st.unpacked_bytes += wv.unpacked_bytes;
        later.push_back(std::move(f));
        f = InFlight{};
        return;
      }
      finish_wave(w, st, f.sends, f.recvs, f.recv_groups, deadline);
    };
    auto local = [&] {
      local_started_ = true;
      if (eng) {
        if (local_batch_ >= 0) eng->enqueue(static_cast<std::size_t>(local_batch_));
        st.local_bytes += local_bytes_;
        copies_pending_ = copies_pending_ || local_batch_ >= 0;
        local_done_ = true;
        return;
      }
      for (const LocalCopy& lc : local_) {
        for (const Part& part : lc.parts) {
          BoxSide s{lc.src->data, part.src_offset, part.strides(0)};
          BoxSide d{lc.dst->data, part.dst_offset, part.strides(1)};
          copy_box(static_cast<std::size_t>(lc.element_bytes), part.rank, part.extents(), s, d);
          st.local_bytes += part.count * lc.element_bytes;
        }
      }
      local_done_ = true;
    };
    const std::size_t W = waves_.size();
    if (W == 0) local();
    if (W > 0) start(0);
    for (std::size_t w = 0; w < W; ++w) {
      if (opt_.pipeline > 1 && w + 1 < W) start(w + 1);
      if (w == 0) local();
      finish(w);
      live -= waves_[w].staging;
      if (opt_.pipeline == 1 && w + 1 < W) start(w + 1);
    }
    if (eng) {
      // Direct receives land by the transport's stream; the caller's `done`
      // covers them and every copy (on the device: no host wait).
      if constexpr (deferred) eng->stream_wait(eng->record(exec_detail::kTransferSlot, transport_stream()));
      st.done = eng->record(exec_detail::kDoneSlot);
    }
  } catch (const std::exception& e) {
    broken_ = true;
    t_->abort(fmt::format("rank {} refit failed: {}", me_, e.what()));
    throw;
  }
  in_run_ = true;
}

template <class T>
ExecutorStats Executor<T>::complete() {
  if (!in_run_) fail("rank {}: executor: complete() without an enqueued run", me_);
  in_run_ = false;
  ExecutorStats& st = run_.st;
  try {
    // Deferred: the one host wait for the transport, wave by wave (so a
    // failure names the wave and peers it was waiting for).
    for (auto& f : run_.later) finish_wave(f.wave, st, f.sends, f.recvs, f.recv_groups, run_.deadline);
    run_.later.clear();
    if (device_ && run_.order.wait) {
      opt_.device->synchronize();
      copies_pending_ = false;
    }
  } catch (const std::exception& e) {
    broken_ = true;
    t_->abort(fmt::format("rank {} refit failed: {}", me_, e.what()));
    throw;
  }
  st.seconds = std::chrono::duration<double>(Clock::now() - run_.t0).count();
  ++runs_;
  return st;
}

}  // namespace reshard
