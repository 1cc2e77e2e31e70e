#pragma once
// End-to-end refit checks on the in-process transport, element by element.
//
// Memory is laid out and checked with the plan oracle's slots (tests/oracle.hpp:
// its own arithmetic from the contract, not the library's storage code):
// every source element holds a tag of (tensor name, global index, salt),
// every destination element starts as the complement of its tag, padding as a
// fixed byte (different on each side). After a refit every destination
// element must equal its tag and every padding slot must be untouched.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "oracle.hpp"
#include "reshard_support/fault_injection.hpp"
#include "reshard_support/verify.hpp"
#include "reshard/json_io.hpp"
#include "reshard/plan/plan.hpp"
#include "reshard/resharder.hpp"
#include "reshard/transport/local.hpp"

namespace refit_test {

using namespace reshard;

constexpr std::byte kSrcPad{0xA5}, kDstPad{0x5A};

/// A validated layout over one mesh axis of `size` ranks from `first`.
inline Layout one_axis(const std::string& axis, std::int64_t size, std::int64_t first, std::vector<TensorSpec> ts) {
  LayoutSpec L;
  L.mesh.axes = {{axis, size}};
  L.mesh.first_rank = first;
  L.tensors = std::move(ts);
  return Layout(std::move(L));
}
/// A dim cut evenly over the whole of mesh axis 0.
inline DimSpec cut(std::int64_t size) {
  DimSpec d;
  d.axes = {AxisRef{0, 1, size}};
  return d;
}
inline TensorSpec tensor(std::string name, std::vector<std::int64_t> shape, std::vector<DimSpec> dims,
                         DType dt = DType::f32) {
  return tensor_spec(std::move(name), std::move(shape), dt, std::move(dims));
}

// The element tags hash as verify.hpp's do (a tag is data to move, not a
// reference: where each element belongs comes from the oracle's slots).
inline std::uint64_t name_hash(const std::string& s) { return tensor_key(s); }
/// The tag of one element: its own hash (verify.hpp's element_tag hashes per
/// block of 256 elements).
inline std::uint64_t tag(std::uint64_t name, std::int64_t index, std::uint64_t salt) { return tag_block(name, index, salt); }

/// One rank's buffers under one layout, with their oracle slots.
struct SideMemory {
  std::vector<bool> present;
  std::vector<std::vector<oracle::Slot>> slots;
  std::vector<std::vector<std::byte>> data;
  std::vector<std::size_t> element_bytes;
};

/// Calls f(buffer, slot index, slot, bytes of the slot, element size) for
/// every slot of every buffer the side holds.
template <class M, class F>
void for_each_held_slot(M& m, F&& f) {
  for (std::size_t b = 0; b < m.slots.size(); ++b) {
    if (!m.present[b]) continue;
    const std::size_t E = m.element_bytes[b];
    for (std::size_t i = 0; i < m.slots[b].size(); ++i) f(b, i, m.slots[b][i], m.data[b].data() + i * E, E);
  }
}

inline void write_side(const Layout& L, SideMemory& m, bool source, std::uint64_t salt) {
  for_each_held_slot(m, [&](std::size_t, std::size_t, const oracle::Slot& s, std::byte* p, std::size_t E) {
    if (s.padding()) {
      std::memset(p, static_cast<int>(source ? kSrcPad : kDstPad), E);
      return;
    }
    std::uint64_t v = tag(name_hash(L.tensors[static_cast<std::size_t>(s.tensor)].name), s.index, salt);
    if (!source) v = ~v;
    std::memcpy(p, &v, E);
  });
}

inline SideMemory make_side(const Layout& L, std::int64_t rank, bool source, std::uint64_t salt) {
  SideMemory m;
  const auto pos = L.mesh.position_of(rank);
  const auto n = L.local_buffers().size();
  m.present.assign(n, false);
  m.slots.resize(n);
  m.data.resize(n);
  m.element_bytes.resize(n);
  if (!pos) return m;
  auto rs = oracle::local_slots(L, *pos);
  for (std::size_t b = 0; b < n; ++b) {
    m.present[b] = rs.present[b];
    m.slots[b] = std::move(rs.buffers[b]);
    m.element_bytes[b] = static_cast<std::size_t>(element_bytes(L.local_buffers()[b].dtype));
    m.data[b].assign(m.slots[b].size() * m.element_bytes[b], std::byte{0});
  }
  write_side(L, m, source, salt);
  return m;
}

/// Destination elements that are wrong (first one described in *first).
inline std::int64_t count_wrong(const Layout& L, const SideMemory& m, std::int64_t rank, std::uint64_t salt, std::string* first) {
  std::int64_t wrong = 0;
  for_each_held_slot(m, [&](std::size_t b, std::size_t i, const oracle::Slot& s, const std::byte* p, std::size_t E) {
    bool ok = true;
    if (s.padding()) {
      for (std::size_t k = 0; k < E; ++k) ok &= p[k] == kDstPad;
    } else {
      const std::uint64_t v = tag(name_hash(L.tensors[static_cast<std::size_t>(s.tensor)].name), s.index, salt);
      ok = std::memcmp(p, &v, E) == 0;
    }
    if (!ok && wrong++ == 0 && first)
      *first = fmt::format("rank {} buffer '{}' element {} ({}) is wrong", rank, L.local_buffers()[b].name, i,
                           s.padding() ? std::string("padding") : fmt::format("{}[{}]", L.tensors[static_cast<std::size_t>(s.tensor)].name, s.index));
  });
  return wrong;
}

/// Checks a failed refit's DestinationWrites against this rank's memory,
/// element by element: `written` buffers hold version `now` (the sources'
/// salt) entirely, `untouched` ones version `before`, `partial` ones
/// anything (one or the other, or bytes a corrupted message landed); every
/// held buffer is named once. Returns the problems ("" when none).
/// `value(name hash, index, version)`: an element's value at a version
/// (refit_test::tag with the version as salt unless given).
template <class Value>
std::string check_writes(const Layout& L, const SideMemory& m, const DestinationWrites& w, std::uint64_t now, std::uint64_t before,
                         Value&& value) {
  std::map<std::string, std::string> kind;
  std::string out;
  for (const auto* names : {&w.written, &w.partial, &w.untouched})
    for (const auto& n : *names)
      if (!kind.emplace(n, names == &w.written ? "written" : names == &w.partial ? "partial" : "untouched").second)
        out += fmt::format("'{}' is named twice; ", n);
  // Per buffer: elements only the new version has, only the old one, neither (an element both versions
  // agree on says nothing).
  std::vector<std::int64_t> fresh(m.slots.size(), 0), old(m.slots.size(), 0), other(m.slots.size(), 0);
  for_each_held_slot(m, [&](std::size_t b, std::size_t, const oracle::Slot& s, const std::byte* p, std::size_t E) {
    if (s.padding()) return;
    const auto h = name_hash(L.tensors[static_cast<std::size_t>(s.tensor)].name);
    const std::uint64_t a = value(h, s.index, now), z = value(h, s.index, before);
    const bool is_new = std::memcmp(p, &a, E) == 0, is_old = std::memcmp(p, &z, E) == 0;
    if (!is_new || !is_old) ++(is_new ? fresh[b] : is_old ? old[b] : other[b]);
  });
  for (std::size_t b = 0; b < m.slots.size(); ++b) {
    if (!m.present[b]) continue;
    const std::string& name = L.local_buffers()[b].name;
    const auto it = kind.find(name);
    if (it == kind.end()) {
      out += fmt::format("'{}' is not named; ", name);
      continue;
    }
    const bool ok = it->second == "partial" || (other[b] == 0 && (it->second == "written" ? old[b] == 0 : fresh[b] == 0));
    if (!ok)
      out += fmt::format("'{}' is named {} but holds {} elements of version {}, {} of version {}, {} of neither; ", name, it->second, fresh[b], now,
                         old[b], before, other[b]);
  }
  return out;
}

inline std::string check_writes(const Layout& L, const SideMemory& m, const DestinationWrites& w, std::uint64_t now, std::uint64_t before) {
  return check_writes(L, m, w, now, before, [](std::uint64_t h, std::int64_t i, std::uint64_t v) { return tag(h, i, v); });
}

/// Bytes endpoint `t` has registered outside the given sides' buffers: the
/// executors' staging, as the transport sees it (independent of the
/// executor's own staging figures).
inline std::int64_t registered_outside(const LocalTransport& t, std::initializer_list<const SideMemory*> sides) {
  std::int64_t out = 0;
  for (const auto& r : t.registered()) {
    bool inside = false;
    for (const SideMemory* m : sides)
      for (const auto& d : m->data)
        inside |= !d.empty() && r.data() >= d.data() && r.data() + r.size() <= d.data() + d.size();
    if (!inside) out += static_cast<std::int64_t>(r.size());
  }
  return out;
}

inline std::map<std::string, BufferView> views(const Layout& L, SideMemory& m) {
  std::map<std::string, BufferView> out;
  for (std::size_t b = 0; b < m.slots.size(); ++b)
    if (m.present[b])
      out[L.local_buffers()[b].name] = bytes_view(m.data[b].data(), m.data[b].size(), static_cast<std::int64_t>(m.element_bytes[b]));
  return out;
}

/// One rank's memory for a refit: its sources tagged (make_side with `salt`),
/// its destinations zero, and the views a Resharder takes; `device`: the
/// views say MemoryKind::device (host memory an emulated engine treats as a
/// GPU's). Not copyable: the views point into it.
struct RankMemory {
  SideMemory src, dst;
  LocalBuffers bufs;
  RankMemory(const Layout& s, const Layout& d, std::int64_t rank, bool device = false, std::uint64_t salt = 0)
      : src(make_side(s, rank, true, salt)), dst(make_side(d, rank, false, 0)) {
    bufs.src = views(s, src);
    bufs.dst = views(d, dst);
    if (device)
      for (auto* side : {&bufs.src, &bufs.dst})
        for (auto& [name, v] : *side) v.memory = MemoryKind::device;
  }
  RankMemory(const RankMemory&) = delete;
  RankMemory& operator=(const RankMemory&) = delete;
};

/// A side's buffers as strided views inside larger allocations: a buffer of
/// two or more dims gets 3 more elements of pitch on its outermost dim, a
/// 1-d buffer takes every other element. store() copies a SideMemory's dense
/// contents in, load() copies them back out; everything no element reaches
/// holds kGap, which gaps_intact() checks.
struct StridedSide {
  static constexpr std::byte kGap{0x6b};
  struct Buffer {
    bool present = false;
    std::size_t E = 0;
    std::vector<std::int64_t> shape, strides, at;  ///< at[i]: element offset of dense element i
    std::vector<std::byte> mem;
  };
  std::vector<Buffer> buffers;

  StridedSide(const Layout& L, std::int64_t rank, const SideMemory& m) {
    buffers.resize(m.slots.size());
    const auto pos = L.mesh.position_of(rank);
    for (std::size_t b = 0; pos && b < buffers.size(); ++b) {
      Buffer& x = buffers[b];
      if (!(x.present = m.present[b])) continue;
      x.E = m.element_bytes[b];
      x.shape = buffer_shape(L, *pos, static_cast<int>(b));
      const auto r = x.shape.size();
      x.strides.assign(r, 1);
      std::int64_t dense = 1;
      for (std::size_t d = r; d-- > 0;) {
        x.strides[d] = dense;
        dense *= x.shape[d];
      }
      x.strides[0] = r == 1 ? 2 : x.strides[0] + 3;
      std::int64_t span = 1;
      for (std::size_t d = 0; d < r; ++d) span += (x.shape[d] - 1) * x.strides[d];
      x.mem.assign(static_cast<std::size_t>(span) * x.E, kGap);
      x.at.resize(m.slots[b].size());
      for (std::size_t i = 0; i < x.at.size(); ++i) {
        std::int64_t rest = static_cast<std::int64_t>(i), o = 0;
        for (std::size_t d = r; d-- > 0;) {
          o += (rest % x.shape[d]) * x.strides[d];
          rest /= x.shape[d];
        }
        x.at[i] = o;
      }
    }
    store(m);
  }
  void store(const SideMemory& m) {
    for (std::size_t b = 0; b < buffers.size(); ++b)
      for (std::size_t i = 0; buffers[b].present && i < buffers[b].at.size(); ++i)
        std::memcpy(&buffers[b].mem[static_cast<std::size_t>(buffers[b].at[i]) * buffers[b].E], &m.data[b][i * buffers[b].E], buffers[b].E);
  }
  void load(SideMemory& m) const {
    for (std::size_t b = 0; b < buffers.size(); ++b)
      for (std::size_t i = 0; buffers[b].present && i < buffers[b].at.size(); ++i)
        std::memcpy(&m.data[b][i * buffers[b].E], &buffers[b].mem[static_cast<std::size_t>(buffers[b].at[i]) * buffers[b].E], buffers[b].E);
  }
  std::map<std::string, BufferView> views(const Layout& L) {
    std::map<std::string, BufferView> out;
    for (std::size_t b = 0; b < buffers.size(); ++b)
      if (buffers[b].present)
        out[L.local_buffers()[b].name] =
            BufferView{buffers[b].mem.data(), 0, static_cast<std::int64_t>(buffers[b].E), buffers[b].shape, buffers[b].strides, MemoryKind::host};
    return out;
  }
  bool gaps_intact() const {
    for (const Buffer& x : buffers) {
      std::vector<bool> reached(x.mem.size() / std::max<std::size_t>(x.E, 1), false);
      for (auto o : x.at) reached[static_cast<std::size_t>(o)] = true;
      for (std::size_t k = 0; k < reached.size(); ++k)
        for (std::size_t j = 0; !reached[k] && j < x.E; ++j)
          if (x.mem[k * x.E + j] != kGap) return false;
    }
    return true;
  }
};

/// A small pair with every kind of message. Sources 0-1, destinations 2-3;
/// every destination hears from both sources:
///   b  [4096]   split -> replicated: one 8 KiB zero-copy message per pair
///   w  [64, 32] rows -> columns: 2 KiB, contiguous on the receiver only (half-staged)
///   e  [48, 6]  columns -> rows: strided on both sides, packed into the bucket
inline const Layout& message_kinds_src() {
  static const Layout L = parse_layout(nlohmann::json::parse(R"({"mesh": {"axes": [["tp", 2]]}, "tensors": [
      {"name": "b", "shape": [4096], "dtype": "f32", "dims": ["tp"]},
      {"name": "w", "shape": [64, 32], "dtype": "f32", "dims": ["tp", null]},
      {"name": "e", "shape": [48, 6], "dtype": "f32", "dims": [null, "tp"]}]})"), "src");
  return L;
}
inline const Layout& message_kinds_dst() {
  static const Layout L = parse_layout(nlohmann::json::parse(R"({"mesh": {"axes": [["tp", 2]], "first_rank": 2}, "tensors": [
      {"name": "b", "shape": [4096], "dtype": "f32", "dims": [null]},
      {"name": "w", "shape": [64, 32], "dtype": "f32", "dims": [null, "tp"]},
      {"name": "e", "shape": [48, 6], "dtype": "f32", "dims": ["tp", null]}]})"), "dst");
  return L;
}

/// Where `rank` stands in a world's rank list (a rank thread's index into
/// per-rank memory).
inline std::size_t index_of(const std::vector<std::int64_t>& ranks, std::int64_t rank) {
  const auto it = std::find(ranks.begin(), ranks.end(), rank);
  if (it == ranks.end()) throw std::logic_error(fmt::format("rank {} is not in the world", rank));
  return static_cast<std::size_t>(it - ranks.begin());
}
inline std::vector<std::int64_t> world_of(const Layout& a, const Layout& b) {
  std::set<std::int64_t> s;
  for (auto r : a.mesh.global_ranks()) s.insert(r);
  for (auto r : b.mesh.global_ranks()) s.insert(r);
  return {s.begin(), s.end()};
}

/// Dense memory on both sides for every rank of a pair's world, for tests
/// that drive executors without a Resharder: run() calls fn(t, i, src, dst)
/// on rank ranks[i]'s thread with its buffers bound as a Resharder binds
/// them (binding.hpp).
struct DenseWorld {
  std::vector<std::int64_t> ranks;
  std::vector<SideMemory> src_mem, dst_mem;
  LocalTrafficStats traffic;  ///< what the transport moved in the last run()

  /// Sources hold the values of `salt` (count_wrong checks them).
  DenseWorld(const Layout& src, const Layout& dst, std::uint64_t salt = 0)
      : ranks(world_of(src, dst)), src_mem(ranks.size()), dst_mem(ranks.size()) {
    for (std::size_t i = 0; i < ranks.size(); ++i) {
      src_mem[i] = make_side(src, ranks[i], true, salt);
      dst_mem[i] = make_side(dst, ranks[i], false, salt);
    }
  }
  template <class F>
  void run(const Layout& src, const Layout& dst, F&& fn) {
    LocalWorld world(ranks);
    world.run([&](LocalTransport& t) {
      const std::size_t i = refit_test::index_of(ranks, t.rank());
      const auto sb = bind_buffers(src, t.rank(), views(src, src_mem[i]), "source");
      const auto db = bind_buffers(dst, t.rank(), views(dst, dst_mem[i]), "destination");
      fn(t, i, bound_pointers(sb), bound_pointers(db));
    });
    traffic = world.total_stats();
  }
};

/// Destination elements found wrong, over ranks and refits.
struct WrongElements {
  std::int64_t wrong = 0;
  std::string first_wrong;  ///< "refit k: " and the first wrong element seen
  /// Adds the elements of one rank's destination memory `dm` that are wrong
  /// after refit k (salt k); m guards the tally.
  void count(std::mutex& m, int k, const Layout& dst, const SideMemory& dm, std::int64_t rank) {
    std::string first;
    const auto w = count_wrong(dst, dm, rank, static_cast<std::uint64_t>(k), &first);
    std::lock_guard lk(m);
    if (w && first_wrong.empty()) first_wrong = fmt::format("refit {}: {}", k, first);
    wrong += w;
  }
};

/// What refits through a device copy engine added up to over the ranks.
struct DeviceOutcome : WrongElements {
  std::int64_t packed = 0, zero_copy = 0, local = 0, launches = 0;
  /// Adds one rank's refit k: its report and its wrong destination elements.
  void add(std::mutex& m, int k, const RefitReport& rep, const Layout& dst, const SideMemory& dm, std::int64_t rank) {
    count(m, k, dst, dm, rank);
    std::lock_guard lk(m);
    packed += rep.packed_bytes;
    zero_copy += rep.zero_copy_bytes;
    local += rep.local_bytes;
  }
};

struct Outcome : WrongElements {
  std::vector<std::int64_t> ranks;
  std::vector<RefitReport> last;  ///< per rank, the last refit's report
  std::vector<std::int64_t> compiles;
  LocalTrafficStats traffic;  ///< what the transport itself moved, all refits
  std::int64_t plan_bytes = 0, plan_local_bytes = 0;
  std::int64_t sum(std::int64_t RefitReport::*f) const {
    std::int64_t s = 0;
    for (const auto& r : last) s += r.*f;
    return s;
  }
  std::int64_t max(std::int64_t RefitReport::*f) const {
    std::int64_t s = 0;
    for (const auto& r : last) s = std::max(s, r.*f);
    return s;
  }
};

/// Refits `refits` times with new source values each time (salt = refit
/// number), checking every destination element after each refit.
inline Outcome run_refits(const Layout& src, const Layout& dst, ResharderOptions opt = {}, int refits = 1,
                          LocalWorldOptions wopt = {}) {
  Outcome out;
  out.ranks = world_of(src, dst);
  const std::size_t n = out.ranks.size();
  std::vector<SideMemory> smem(n), dmem(n);
  for (std::size_t i = 0; i < n; ++i) {
    smem[i] = make_side(src, out.ranks[i], true, 0);
    dmem[i] = make_side(dst, out.ranks[i], false, 0);
  }
  const Schedule full = plan(src, dst);
  out.plan_bytes = full.stats.bytes;
  out.plan_local_bytes = full.stats.local_bytes;
  out.last.resize(n);
  out.compiles.resize(n);
  std::mutex m;
  LocalWorld world(out.ranks, wopt);
  world.run([&](LocalTransport& t) {
    std::size_t i = 0;
    while (out.ranks[i] != t.rank()) ++i;
    LocalBuffers bufs;
    bufs.src = views(src, smem[i]);
    bufs.dst = views(dst, dmem[i]);
    Resharder<Layout, LocalTransport> r(src, dst, bufs, t, opt);
    for (int k = 0; k < refits; ++k) {
      if (k > 0) {
        write_side(src, smem[i], true, static_cast<std::uint64_t>(k));
        write_side(dst, dmem[i], false, static_cast<std::uint64_t>(k));
      }
      out.last[i] = r.refit();
      out.count(m, k, dst, dmem[i], t.rank());
    }
    out.compiles[i] = r.executor().compiles();
  });
  out.traffic = world.total_stats();
  return out;
}


/// One rank's history in a run with injected faults.
struct FaultyRank {
  std::int64_t rank = -1;
  std::vector<std::string> errors;   ///< per refit attempted: "" when it committed
  std::vector<std::int64_t> wrong;   ///< per committed refit: destination elements wrong after it
  std::vector<RefitReport> reports;  ///< per committed refit
  RefitState state = RefitState::empty;
  std::uint64_t last_good = 0;
  std::vector<std::string> stale;
  std::optional<StaleReport> failure;
};
struct FaultyOutcome {
  std::vector<FaultyRank> ranks;
  std::vector<InjectedFault> injected;
  double seconds = 0;
  /// Ranks whose refit k committed.
  int committed(std::size_t k) const {
    int n = 0;
    for (const auto& r : ranks) n += k < r.errors.size() && r.errors[k].empty();
    return n;
  }
  const FaultyRank& at(std::int64_t rank) const {
    for (const auto& r : ranks)
      if (r.rank == rank) return r;
    throw Error(fmt::format("no rank {} in the outcome", rank));
  }
};

/// Refits `refits` times over FaultInjectingTransport<LocalTransport>
/// following `plan` (new source values each time: salt = refit number,
/// unless `same_values`), each rank stopping at its first failure.
inline FaultyOutcome run_with_faults(const Layout& src, const Layout& dst, FaultPlan& plan, ResharderOptions opt, int refits,
                                     bool same_values = false) {
  FaultyOutcome out;
  const auto ranks = world_of(src, dst);
  const std::size_t n = ranks.size();
  std::vector<SideMemory> smem(n), dmem(n);
  for (std::size_t i = 0; i < n; ++i) {
    smem[i] = make_side(src, ranks[i], true, 0);
    dmem[i] = make_side(dst, ranks[i], false, 0);
  }
  out.ranks.resize(n);
  const auto t0 = Clock::now();
  LocalWorld world(ranks);
  world.run([&](LocalTransport& inner) {
    std::size_t i = 0;
    while (ranks[i] != inner.rank()) ++i;
    FaultyRank& me = out.ranks[i];
    me.rank = inner.rank();
    FaultInjectingTransport<LocalTransport> t(inner, plan);
    LocalBuffers bufs;
    bufs.src = views(src, smem[i]);
    bufs.dst = views(dst, dmem[i]);
    Resharder<Layout, FaultInjectingTransport<LocalTransport>> r(src, dst, bufs, t, opt);
    for (int k = 0; k < refits; ++k) {
      const auto salt = static_cast<std::uint64_t>(same_values ? 0 : k);
      write_side(src, smem[i], true, salt);
      write_side(dst, dmem[i], false, salt);
      try {
        me.reports.push_back(r.refit());
        me.errors.emplace_back();
        me.wrong.push_back(count_wrong(dst, dmem[i], me.rank, salt, nullptr));
      } catch (const RefitNotCommitted& e) {
        me.errors.emplace_back(e.what());
        break;
      }
    }
    me.state = r.state();
    me.last_good = r.last_good_version();
    me.stale = r.stale_tensors();
    me.failure = r.last_failure();
  });
  out.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  out.injected = plan.injected();
  return out;
}

}  // namespace refit_test
