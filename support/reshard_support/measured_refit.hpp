#pragma once
// One measured refit, whatever the transport: what a rank of reshard-refit,
// refit-bench or the UCX harness does (tools/refit_harness.hpp runs it on
// each thread of a LocalWorld, ucx_refit.hpp in each process under mpirun),
// and the summary of every rank's figures into one method's result.
//
// Per rank: tagged source weights and all-wrong destination memory
// (verify.hpp), reshard's Resharder and, with a baseline, the traditional
// gather + broadcast + slice (traditional.hpp) on the same transport; the
// two alternate iteration by iteration so both see the same machine, each
// iteration refits new source values (salt k) and is checked element by
// element outside the timed window, so a refit that moved nothing, or last
// iteration's values, fails.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "reshard/exec/executor.hpp"
#include "reshard/plan/hierarchical.hpp"
#include "reshard/resharder.hpp"
#include "traditional.hpp"
#include "verify.hpp"

namespace reshard {

inline double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const auto n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

struct MeasuredRefitOptions {
  int iterations = 5;
  bool baseline = true;
  ExecutorOptions executor;
  /// A staged (hierarchical) schedule of src -> dst: reshard's refit runs it
  /// stage by stage (ResharderOptions::staged) instead of its own plan.
  std::shared_ptr<const StagedSchedule> staged;
  /// Called on the world's first rank once every rank is set up and after
  /// each iteration (both methods, checked): (iterations done, iterations).
  std::function<void(int, int)> progress;
};

/// What one rank measured: steady-clock ns per iteration, the last refit's
/// reports and every iteration's check.
struct RankFigures {
  std::vector<std::int64_t> t0, t1, b0, b1;  ///< reshard's and the baseline's start / finish
  RefitReport main;
  std::vector<RefitReport> base;  ///< gather, broadcast, slice
  TagCheck check, base_check;
  double plan_seconds = 0;
  std::string host;                                          ///< where the rank ran (one clock or several)
  std::vector<std::pair<std::int64_t, std::int64_t>> sends;  ///< (dst rank, bytes) reshard's plan sends from here
  std::vector<std::int64_t> peers;                           ///< the transport's endpoints, where it says (UCX)
};

inline std::string host_name() {
  char h[256] = {};
  if (gethostname(h, sizeof(h) - 1) != 0) return "?";
  return h;
}

/// Where the refit's buffers live: the tagged sides' own host memory. A
/// placement binds each side's buffers (`place`: the views the Resharder
/// gets) and moves the tagged values there before a refit (`upload`) and
/// back after it (`download`), outside the timed window; device_placement.hpp
/// mirrors them in GPU memory.
struct HostPlacement {
  void place(const TaggedSide&, std::map<std::string, BufferView>&) {}
  void upload(const TaggedSide&) {}
  void download(TaggedSide&) {}
};

/// Fails unless every rank of both layouts is in the job's world (`who`
/// starts the message).
inline void require_world(const Layout& src, const Layout& dst, std::span<const std::int64_t> world, std::string_view who) {
  std::int64_t need = 0;
  for (const Layout* L : {&src, &dst})
    for (auto r : L->mesh.global_ranks()) need = std::max(need, r + 1);
  for (const Layout* L : {&src, &dst})
    for (auto r : L->mesh.global_ranks())
      if (std::find(world.begin(), world.end(), r) == world.end())
        fail("{}: {} uses rank {} but the job has {} processes (run under mpirun with -np {} or more)", who, L->origin, r, world.size(), need);
}

/// Runs the measured refit on this rank (collective over t's world). The
/// Resharder's channels: 0 (8 for a staged schedule), the baseline's 1-3.
/// `on_set_up` sees reshard's Resharder before the baseline sets up its own.
template <class T, class OnSetUp, class Placement = HostPlacement>
RankFigures measure_refit_on_rank(const Layout& src, const Layout& dst, T& t, const MeasuredRefitOptions& opt, OnSetUp&& on_set_up,
                                  Placement&& placement = {}) {
  RankFigures me;
  const int iters = std::max(1, opt.iterations);
  const auto far = [&] { return Clock::now() + opt.executor.timeout; };
  const auto ns = [] { return static_cast<std::int64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count()); };
  LocalBuffers main_bufs;
  TaggedSide s, d;
  s.allocate(src, t.rank(), main_bufs.src);
  d.allocate(dst, t.rank(), main_bufs.dst);
  s.other = &dst;  // quantized destinations (docs/fp8.md)
  d.other = &src;
  s.fill(TagFill::source, 0);
  d.fill(TagFill::poison, 0);
  placement.place(s, main_bufs.src);
  placement.place(d, main_bufs.dst);

  ResharderOptions ro;
  ro.executor = opt.executor;
  ro.executor.channel = 0;
  ResharderOptions mo = ro;
  if (opt.staged) {
    mo.staged = opt.staged;
    mo.executor.channel = 8;
  }
  Resharder<Layout, T> reshard_refit(src, dst, main_bufs, t, mo);
  me.plan_seconds = reshard_refit.schedule().stats.plan_seconds;
  me.host = host_name();
  {
    std::map<std::int64_t, std::int64_t> to;
    for (const auto& c : reshard_refit.schedule().copies)
      if (c.src_rank == t.rank() && c.dst_rank != t.rank()) to[c.dst_rank] += c.bytes();
    me.sends.assign(to.begin(), to.end());
  }
  on_set_up(reshard_refit);
  // The traditional refit's intermediate buffers: whole tensors on the
  // gather roots and on every destination rank.
  const Layout gathered = opt.baseline ? gather_layout(src) : Layout{};
  const Layout broadcast = opt.baseline ? broadcast_layout(dst) : Layout{};
  TaggedSide g_side, b_side;
  std::map<std::string, BufferView> gv, bv;
  std::unique_ptr<Resharder<Layout, T>> gather, bcast, slice;
  if (opt.baseline) {
    g_side.allocate(gathered, t.rank(), gv);
    b_side.allocate(broadcast, t.rank(), bv);
    placement.place(g_side, gv);
    placement.place(b_side, bv);
    LocalBuffers g_bufs{main_bufs.src, gv}, b_bufs{gv, bv}, s_bufs{bv, main_bufs.dst};
    ResharderOptions r1 = ro, r2 = ro, r3 = ro;
    r1.executor.channel = 1;
    r2.executor.channel = 2;
    r3.executor.channel = 3;
    gather = std::make_unique<Resharder<Layout, T>>(src, gathered, g_bufs, t, r1);
    bcast = std::make_unique<Resharder<Layout, T>>(gathered, broadcast, b_bufs, t, r2);
    slice = std::make_unique<Resharder<Layout, T>>(broadcast, dst, s_bufs, t, r3);
  }
  const bool reports = opt.progress && t.rank() == t.world_ranks().front();
  if (opt.progress) t.all_gather({}, far());  // every rank set up
  if (reports) opt.progress(0, iters);
  for (int k = 0; k < iters; ++k) {
    const auto salt = static_cast<std::uint64_t>(k);
    if (k > 0) {
      s.fill(TagFill::source, salt);
      d.fill(TagFill::poison, salt);
    }
    placement.upload(s);
    placement.upload(d);
    t.all_gather({}, far());
    me.t0.push_back(ns());
    me.main = reshard_refit.refit();
    me.t1.push_back(ns());
    placement.download(d);
    me.check.add(d.check(salt), fmt::format("iteration {}", k));
    if (opt.baseline) {
      d.fill(TagFill::poison, salt);
      placement.upload(d);
      t.all_gather({}, far());
      me.b0.push_back(ns());
      me.base = {gather->refit(), bcast->refit(), slice->refit()};
      me.b1.push_back(ns());
      placement.download(d);
      me.base_check.add(d.check(salt), fmt::format("iteration {}", k));
    }
    if (opt.progress) t.all_gather({}, far());  // every rank checked this iteration
    if (reports) opt.progress(k + 1, iters);
  }
  t.all_gather({}, far());
  return me;
}

namespace measured_detail {
using Reader = BlobReader;
using Writer = BlobWriter;
template <class V>
  requires std::is_trivially_copyable_v<V>
void put(Writer& w, const V& v) {
  w.put(v);
}
template <class V>
  requires std::is_trivially_copyable_v<V>
void get(Reader& rd, V& v) {
  v = rd.get<V>();
}
inline void put(Writer& w, const std::string& s) { w.put_string(s); }
inline void get(Reader& rd, std::string& s) { s = rd.get_string(); }
inline void put(Writer& w, const std::pair<std::int64_t, std::int64_t>& p) {
  w.put(p.first);
  w.put(p.second);
}
inline void get(Reader& rd, std::pair<std::int64_t, std::int64_t>& p) {
  p.first = rd.get<std::int64_t>();
  p.second = rd.get<std::int64_t>();
}
inline void put(Writer& w, const RefitReport& r) {
  for (std::int64_t v : {r.bytes_sent, r.bytes_received, r.local_bytes, r.messages_sent, r.messages_received, r.zero_copy_bytes, r.packed_bytes,
                         r.unpacked_bytes, std::int64_t{r.waves}, r.staging_bytes, r.peak_staging_bytes, r.plan_bytes_sent, r.plan_bytes_received,
                         r.plan_local_bytes})
    w.put(v);
  w.put(r.seconds);
}
inline void get(Reader& rd, RefitReport& r) {
  for (std::int64_t* v : {&r.bytes_sent, &r.bytes_received, &r.local_bytes, &r.messages_sent, &r.messages_received, &r.zero_copy_bytes,
                          &r.packed_bytes, &r.unpacked_bytes})
    *v = rd.get<std::int64_t>();
  r.waves = static_cast<int>(rd.get<std::int64_t>());
  for (std::int64_t* v : {&r.staging_bytes, &r.peak_staging_bytes, &r.plan_bytes_sent, &r.plan_bytes_received, &r.plan_local_bytes})
    *v = rd.get<std::int64_t>();
  r.seconds = rd.get<double>();
}
inline void put(Writer& w, const TagCheck& c) {
  w.put(c.checked);
  w.put(c.wrong);
  w.put_string(c.first_wrong);
}
inline void get(Reader& rd, TagCheck& c) {
  c.checked = rd.get<std::int64_t>();
  c.wrong = rd.get<std::int64_t>();
  c.first_wrong = rd.get_string();
}
template <class V>
void put(Writer& w, const std::vector<V>& v) {
  w.put<std::uint64_t>(v.size());
  for (const auto& x : v) put(w, x);
}
template <class V>
void get(Reader& rd, std::vector<V>& v) {
  v.resize(static_cast<std::size_t>(rd.get<std::uint64_t>()));
  for (auto& x : v) get(rd, x);
}
}  // namespace measured_detail

/// Every rank's figures, in world order, on every rank (collective).
template <class T>
std::vector<RankFigures> gather_figures(T& t, const RankFigures& me, Deadline deadline) {
  using namespace measured_detail;
  Writer w;
  put(w, me.t0), put(w, me.t1), put(w, me.b0), put(w, me.b1);
  put(w, me.main), put(w, me.base), put(w, me.check), put(w, me.base_check);
  put(w, me.plan_seconds), put(w, me.host), put(w, me.sends), put(w, me.peers);
  const auto blobs = t.all_gather(w.buf, deadline);
  std::vector<RankFigures> all(blobs.size());
  for (std::size_t i = 0; i < blobs.size(); ++i) {
    Reader rd(blobs[i], t.world_ranks()[i]);
    RankFigures& f = all[i];
    get(rd, f.t0), get(rd, f.t1), get(rd, f.b0), get(rd, f.b1);
    get(rd, f.main), get(rd, f.base), get(rd, f.check), get(rd, f.base_check);
    get(rd, f.plan_seconds), get(rd, f.host), get(rd, f.sends), get(rd, f.peers);
  }
  return all;
}

/// One method's figures over all ranks.
struct MethodFigures {
  std::int64_t bytes_moved = 0;  ///< network bytes per refit, sum over ranks (executor-counted)
  std::int64_t local_bytes = 0, messages = 0;
  int waves = 0;                        ///< most waves on any rank
  std::int64_t peak_staging_bytes = 0;  ///< most on any rank, measured
  std::int64_t staging_bytes = 0;       ///< most allocated on any rank
  std::int64_t max_rank_bytes = 0;      ///< most bytes one rank sent or received per refit
  std::vector<double> seconds;          ///< per iteration
  double median = 0, best = 0;
  bool validated = false;
  std::int64_t checked = 0, wrong = 0;
  std::string first_wrong;
};

/// Sums every rank's figures of one method (`baseline`: the traditional
/// refit's). One host has one clock: an iteration's time is first start to
/// last finish; over several hosts, the slowest rank's own time.
inline MethodFigures summarize_method(std::span<const RankFigures> all, bool baseline, bool one_clock) {
  MethodFigures m;
  for (const RankFigures& f : all) {
    std::int64_t sent = 0, recv = 0;
    const std::vector<RefitReport> reps = baseline ? f.base : std::vector<RefitReport>{f.main};
    for (const RefitReport& r : reps) {
      m.bytes_moved += r.bytes_sent;
      m.local_bytes += r.local_bytes;
      m.messages += r.messages_sent;
      m.waves = std::max(m.waves, r.waves);
      m.peak_staging_bytes = std::max(m.peak_staging_bytes, r.peak_staging_bytes);
      m.staging_bytes = std::max(m.staging_bytes, r.staging_bytes);
      sent += r.bytes_sent;
      recv += r.bytes_received;
    }
    m.max_rank_bytes = std::max({m.max_rank_bytes, sent, recv});
    const TagCheck& c = baseline ? f.base_check : f.check;
    m.checked += c.checked;
    m.wrong += c.wrong;
    if (c.wrong && m.first_wrong.empty()) m.first_wrong = c.first_wrong;
  }
  const std::size_t iters = all.empty() ? 0 : (baseline ? all.front().b0 : all.front().t0).size();
  for (std::size_t k = 0; k < iters; ++k) {
    std::int64_t a = INT64_MAX, b = INT64_MIN, longest = 0;
    for (const RankFigures& f : all) {
      const auto& s0 = baseline ? f.b0 : f.t0;
      const auto& s1 = baseline ? f.b1 : f.t1;
      a = std::min(a, s0[k]);
      b = std::max(b, s1[k]);
      longest = std::max(longest, s1[k] - s0[k]);
    }
    m.seconds.push_back(static_cast<double>(one_clock ? b - a : longest) * 1e-9);
  }
  m.median = median(m.seconds);
  m.best = m.seconds.empty() ? 0 : *std::min_element(m.seconds.begin(), m.seconds.end());
  m.validated = m.wrong == 0 && m.checked > 0;
  return m;
}

/// A method's figures as reshard-refit --json reports them (CONTRACT.md §3's
/// "baseline" object, and more).
inline nlohmann::json to_json(const MethodFigures& m) {
  return {{"bytes_moved", m.bytes_moved},
          {"seconds", m.median},
          {"best_seconds", m.best},
          {"validated", m.validated},
          {"local_bytes", m.local_bytes},
          {"messages", m.messages},
          {"waves", m.waves},
          {"peak_staging_bytes", m.peak_staging_bytes},
          {"max_rank_bytes", m.max_rank_bytes},
          {"iteration_seconds", m.seconds},
          {"checked_elements", m.checked},
          {"wrong_elements", m.wrong}};
}

}  // namespace reshard
