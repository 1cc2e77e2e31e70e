#pragma once
// reshard-refit --delta: N successive versions of the source weights, made
// as an RL step makes them, each refit twice on the same transport: as a
// delta refit (ResharderOptions::delta) and as a dense refit, into two
// destination sets. Run by every rank of the world (threads of a LocalWorld
// or processes under mpirun), over any Transport.
//
// The workload. Each source rank keeps, for every element it holds, an f32
// master weight and Adam's two moments (12 bytes per element). Version 1 is
// the initial weights: N(0, 0.02) for matrices (Llama's init std), 1.0 for
// norm weights. Version k+1 is one Adam step (beta1 0.9, beta2 0.999, eps
// 1e-8, bias-corrected, learning rate lr) with a fresh gradient: per element
// Gaussian, N(0, s_t^2), s_t a per-tensor scale drawn log-uniformly from
// [1e-4, 1e-2]. Why this is realistic for RL: policy-gradient updates are
// dominated by sampling noise, so consecutive gradients are close to
// independent and roughly Gaussian per element, with magnitudes that differ
// by orders between tensors; Adam divides that scale out, so each step moves
// a weight by about lr, and whether its BF16 value (round to nearest even
// of the master) changes depends on lr against the weight's ulp, as in real
// runs. Every replica of an element draws the same numbers (a counter-based
// hash of tensor, global index and step), so replicas stay identical.
//
// Checks: after every version, every destination element of the delta set
// is compared bit for bit with the dense set (the claim: a delta refit
// leaves exactly what a dense one does).
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "refit_harness.hpp"
#include "reshard/layout/storage.hpp"
#include "reshard/resharder.hpp"
#include "reshard_support/clocks.hpp"
#include "reshard_support/verify.hpp"

namespace delta_harness {

using namespace reshard;

struct Options {
  int versions = 5;
  double lr = 1e-6;
  /// Casts in flight (PlanOptions::cast) for both refits: with f32 source
  /// buffers (reshard-refit --master-f32) the master itself is the source,
  /// and the delta refit diffs its destination-dtype values.
  bool cast = false;
  ExecutorOptions executor;
  DeltaOptions delta;
};

/// Per version, over all ranks.
struct Version {
  std::string mode;  ///< the delta executor's mode (rank 0's set)
  /// Over all ranks' shadowed elements; < 0 when not measured (a dense
  /// refit that did not diff: "prime", "streak").
  double changed_fraction = -1;
  std::int64_t delta_bytes = 0, dense_bytes = 0;
  double delta_seconds = 0, dense_seconds = 0;
  std::int64_t wrong = 0;
  double diff_seconds = 0, scatter_seconds = 0;  ///< the slowest rank's
  /// CPU time of the ranks' processes during the refit (all threads, user
  /// and system), summed over processes (ranks that are threads of one
  /// process count once): on a host of C cores no schedule of this work can
  /// take less wall time than this / C.
  double delta_cpu_seconds = 0, dense_cpu_seconds = 0;
};

struct Result {
  std::vector<Version> versions;
  std::int64_t checked = 0, wrong = 0;
  std::string first_wrong;
  std::int64_t shadow_bytes = 0, delta_staging_bytes = 0;  ///< most on any rank
  double adam_seconds = 0;                                  ///< slowest rank, all steps
  bool validated() const { return wrong == 0 && checked > 0; }
  /// Medians over the versions after the first.
  double median_of(double Version::*f) const {
    std::vector<double> v;
    for (std::size_t k = 1; k < versions.size(); ++k)
      if (versions[k].*f >= 0) v.push_back(versions[k].*f);  // (unmeasured fractions are left out)
    return reshard::median(v);
  }
  double median_of(std::int64_t Version::*f) const {
    std::vector<double> v;
    for (std::size_t k = 1; k < versions.size(); ++k) v.push_back(static_cast<double>(versions[k].*f));
    return reshard::median(v);
  }
};

namespace detail {

inline std::uint64_t mix64(std::uint64_t x) {
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBull;
  x ^= x >> 31;
  return x;
}
/// A standard normal from (key, index, step): Box-Muller on two hashed uniforms.
inline float gauss(std::uint64_t key, std::int64_t index, std::uint64_t step) {
  const std::uint64_t h = mix64(key ^ mix64(static_cast<std::uint64_t>(index) + 0x9E3779B97F4A7C15ull * (step + 1)));
  const double u1 = (static_cast<double>(h >> 40) + 0.5) * 0x1.0p-24, u2 = static_cast<double>((h >> 16) & 0xFFFFFF) * 0x1.0p-24;
  return static_cast<float>(std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2));
}
/// BF16 of an f32, round to nearest even (NaN kept quiet).
inline std::uint16_t bf16(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<std::uint16_t>((u >> 16) | 0x40);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>(u >> 16);
}

/// One run of consecutive elements of one tensor in a local buffer.
struct Run {
  int buffer = 0;
  std::int64_t first = 0, count = 0;  ///< in the buffer
  std::uint64_t key = 0;
  std::int64_t global = 0;  ///< global row-major index of the first
  float scale = 0;          ///< the tensor's gradient scale
  bool norm = false;        ///< a 1-D tensor (norm weight): starts at 1.0
  std::int64_t state = 0;   ///< offset of the run in the master / moment arrays
};

using Side = TaggedSide;

/// The source rank's optimizer: master weights and Adam moments.
struct Adam {
  std::vector<Run> runs;
  std::vector<float> master, m, v;
  std::vector<std::size_t> E;  ///< element bytes per buffer
  int steps = 0;

  void init(Side& s) {
    if (!s.pos) return;
    const Layout& L = *s.L;
    const auto& lbs = L.local_buffers();
    E.resize(lbs.size());
    std::int64_t n = 0;
    for (std::size_t b = 0; b < lbs.size(); ++b) {
      if (!s.mem[b]) continue;
      E[b] = static_cast<std::size_t>(element_bytes(lbs[b].dtype));
      if (lbs[b].dtype != DType::bf16 && lbs[b].dtype != DType::f32)
        fail("reshard-refit --delta: source buffer '{}' is {}; the RL workload evolves bf16 or f32 weights", lbs[b].name, to_string(lbs[b].dtype));
      std::memset(s.mem[b].get(), static_cast<int>(kSourcePadding), static_cast<std::size_t>(s.bytes[b]));
      for_each_slot_run(L, *s.pos, static_cast<int>(b), [&](std::int64_t b0, std::int64_t count, int t, std::int64_t g0) {
        if (t < 0) return;
        const auto& ts = L.tensors[static_cast<std::size_t>(t)];
        Run r;
        r.buffer = static_cast<int>(b);
        r.first = b0;
        r.count = count;
        r.key = tensor_key(ts.name);
        r.global = g0;
        // log-uniform in [1e-4, 1e-2], per tensor
        r.scale = static_cast<float>(std::pow(10.0, -4.0 + 2.0 * static_cast<double>(mix64(r.key) >> 11) * 0x1.0p-53));
        r.norm = ts.rank() == 1;
        r.state = n;
        n += count;
        runs.push_back(r);
      });
    }
    master.resize(static_cast<std::size_t>(n));
    m.assign(static_cast<std::size_t>(n), 0.f);
    v.assign(static_cast<std::size_t>(n), 0.f);
    for (const Run& r : runs)
      for (std::int64_t i = 0; i < r.count; ++i)
        master[static_cast<std::size_t>(r.state + i)] = r.norm ? 1.0f : 0.02f * gauss(r.key ^ 0x1717, r.global + i, 0);
    write(s);
  }
  /// One Adam step with this step's gradients.
  void step(Side& s, double lr) {
    ++steps;
    const float b1 = 0.9f, b2 = 0.999f, eps = 1e-8f;
    const float c1 = 1.0f - std::pow(b1, static_cast<float>(steps)), c2 = 1.0f - std::pow(b2, static_cast<float>(steps));
    const auto flr = static_cast<float>(lr);
    for (const Run& r : runs)
      for (std::int64_t i = 0; i < r.count; ++i) {
        const auto k = static_cast<std::size_t>(r.state + i);
        const float g = r.scale * gauss(r.key, r.global + i, static_cast<std::uint64_t>(steps));
        m[k] = b1 * m[k] + (1 - b1) * g;
        v[k] = b2 * v[k] + (1 - b2) * g * g;
        master[k] -= flr * (m[k] / c1) / (std::sqrt(v[k] / c2) + eps);
      }
    write(s);
  }
  void write(Side& s) const {
    for (const Run& r : runs) {
      std::byte* p = s.mem[static_cast<std::size_t>(r.buffer)].get() + static_cast<std::size_t>(r.first) * E[static_cast<std::size_t>(r.buffer)];
      const float* x = master.data() + r.state;
      if (E[static_cast<std::size_t>(r.buffer)] == 2) {
        for (std::int64_t i = 0; i < r.count; ++i) {
          const std::uint16_t h = bf16(x[i]);
          std::memcpy(p + 2 * i, &h, 2);
        }
      } else {
        std::memcpy(p, x, static_cast<std::size_t>(r.count) * 4);
      }
    }
  }
};

}  // namespace detail

/// Every rank of `t`'s world calls this (collective); every rank returns the same result.
template <class T>
Result run(const Layout& src, const Layout& dst, T& t, const Options& o) {
  using namespace detail;
  const auto far = [&] { return Clock::now() + o.executor.timeout; };
  LocalBuffers dbufs, nbufs;
  Side s, d_delta, d_dense;
  s.allocate(src, t.rank(), dbufs.src);
  d_delta.allocate(dst, t.rank(), dbufs.dst);
  nbufs.src = dbufs.src;
  d_dense.allocate(dst, t.rank(), nbufs.dst);
  // Destinations start with their own padding byte and garbage elsewhere (0xEE): the first refit must write every element.
  for (Side* x : {&d_delta, &d_dense})
    for (std::size_t b = 0; b < x->mem.size(); ++b)
      if (x->mem[b]) {
        std::memset(x->mem[b].get(), 0xEE, static_cast<std::size_t>(x->bytes[b]));
        if (x->pos)
          for_each_slot_run(dst, *x->pos, static_cast<int>(b), [&](std::int64_t b0, std::int64_t n, int tt, std::int64_t) {
            if (tt < 0) std::memset(x->mem[b].get() + b0 * element_bytes(dst.local_buffers()[b].dtype), static_cast<int>(kDestinationPadding),
                                    static_cast<std::size_t>(n * element_bytes(dst.local_buffers()[b].dtype)));
          });
      }
  const auto a0 = Clock::now();
  Adam adam;
  adam.init(s);
  double adam_seconds = std::chrono::duration<double>(Clock::now() - a0).count();

  ResharderOptions ro;
  ro.executor = o.executor;
  ro.executor.channel = 0;
  ro.delta = o.delta;
  ro.delta.enabled = true;
  ro.plan.cast = o.cast;
  Resharder<Layout, T> delta(src, dst, dbufs, t, ro);
  ResharderOptions no;
  no.executor = o.executor;
  no.executor.channel = 16;
  no.plan.cast = o.cast;
  Resharder<Layout, T> dense(src, dst, nbufs, t, no);

  const auto ns = [](Clock::time_point p) { return std::chrono::duration_cast<std::chrono::nanoseconds>(p.time_since_epoch()).count(); };
  // Per version: delta (start, end, bytes sent, wrong), dense (start, end, bytes sent); mode and fraction.
  struct Mine {
    std::int64_t t0, t1, b0, b1, delta_bytes, dense_bytes, wrong, checked;
    double fraction, diff, scatter, delta_cpu, dense_cpu;
    std::int64_t pid;
    char mode[8];
  };
  std::vector<Mine> mine;
  std::string first_wrong;
  for (int k = 1; k <= o.versions; ++k) {
    if (k > 1) {
      const auto x0 = Clock::now();
      adam.step(s, o.lr);
      adam_seconds += std::chrono::duration<double>(Clock::now() - x0).count();
    }
    Mine m{};
    m.pid = static_cast<std::int64_t>(getpid());
    // Alternate the order so both methods see the same machine.
    for (int half = 0; half < 2; ++half) {
      const bool do_delta = (half == 0) == (k % 2 == 1);
      t.all_gather({}, far());
      const double c0 = reshard::clocks::cpu_seconds();
      const auto a = Clock::now();
      const RefitReport rep = do_delta ? delta.refit() : dense.refit();
      const auto b = Clock::now();
      (do_delta ? m.delta_cpu : m.dense_cpu) = reshard::clocks::cpu_seconds() - c0;
      (do_delta ? m.t0 : m.b0) = ns(a);
      (do_delta ? m.t1 : m.b1) = ns(b);
      (do_delta ? m.delta_bytes : m.dense_bytes) = rep.bytes_sent;
    }
    const auto& ds = delta.delta_executor(0).last_delta();
    m.fraction = ds.changed_fraction();
    m.diff = ds.diff_seconds;
    m.scatter = ds.scatter_seconds;
    std::snprintf(m.mode, sizeof m.mode, "%s", ds.mode.c_str());
    // Every element: the delta set against the dense set.
    for (std::size_t b = 0; b < d_delta.mem.size(); ++b) {
      if (!d_delta.mem[b]) continue;
      const auto E = static_cast<std::size_t>(element_bytes(dst.local_buffers()[b].dtype));
      const auto n = static_cast<std::int64_t>(static_cast<std::size_t>(d_delta.bytes[b]) / E);
      m.checked += n;
      if (std::memcmp(d_delta.mem[b].get(), d_dense.mem[b].get(), static_cast<std::size_t>(d_delta.bytes[b])) == 0) continue;
      for (std::int64_t i = 0; i < n; ++i)
        if (std::memcmp(d_delta.mem[b].get() + i * static_cast<std::int64_t>(E), d_dense.mem[b].get() + i * static_cast<std::int64_t>(E), E) != 0 &&
            m.wrong++ == 0 && first_wrong.empty())
          first_wrong = fmt::format("version {}: rank {} buffer '{}' element {} differs from the dense refit", k, t.rank(),
                                    dst.local_buffers()[b].name, i);
    }
    mine.push_back(m);
  }
  // Everyone's figures to everyone.
  BlobWriter w;
  w.put<std::uint32_t>(static_cast<std::uint32_t>(mine.size()));
  for (const Mine& m : mine) w.put(m);
  w.put(delta.delta_executor(0).shadow_bytes());
  w.put(delta.delta_executor(0).staging_bytes());
  w.put(adam_seconds);
  w.put_string(first_wrong);
  const auto blobs = t.all_gather(w.buf, far());
  Result res;
  res.versions.resize(static_cast<std::size_t>(o.versions));
  std::vector<std::map<std::int64_t, std::pair<double, double>>> cpu(mine.size());  // per version: pid -> delta, dense
  std::vector<std::int64_t> lo0(mine.size(), INT64_MAX), hi0(mine.size(), INT64_MIN), lo1(mine.size(), INT64_MAX), hi1(mine.size(), INT64_MIN);
  const auto world = t.world_ranks();
  for (std::size_t r = 0; r < blobs.size(); ++r) {
    BlobReader rd(blobs[r], world[r]);
    const auto n = rd.get<std::uint32_t>();
    for (std::uint32_t k = 0; k < n && k < mine.size(); ++k) {
      const Mine m = rd.get<Mine>();
      Version& v = res.versions[k];
      v.delta_bytes += m.delta_bytes;
      v.dense_bytes += m.dense_bytes;
      v.wrong += m.wrong;
      v.diff_seconds = std::max(v.diff_seconds, m.diff);
      v.scatter_seconds = std::max(v.scatter_seconds, m.scatter);
      auto& [delta_cpu, dense_cpu] = cpu[k][m.pid];  // threads of one process: the most any of them saw
      delta_cpu = std::max(delta_cpu, m.delta_cpu);
      dense_cpu = std::max(dense_cpu, m.dense_cpu);
      res.checked += m.checked;
      res.wrong += m.wrong;
      if (r == 0) {
        v.mode = m.mode;
        v.changed_fraction = std::string(m.mode) == "delta" || std::string(m.mode) == "dense" || std::string(m.mode) == "sampled" ? m.fraction : -1;
      }
      lo0[k] = std::min(lo0[k], m.t0);
      hi0[k] = std::max(hi0[k], m.t1);
      lo1[k] = std::min(lo1[k], m.b0);
      hi1[k] = std::max(hi1[k], m.b1);
    }
    res.shadow_bytes = std::max(res.shadow_bytes, rd.get<std::int64_t>());
    res.delta_staging_bytes = std::max(res.delta_staging_bytes, rd.get<std::int64_t>());
    res.adam_seconds = std::max(res.adam_seconds, rd.get<double>());
    const std::string fw = rd.get_string();
    if (res.first_wrong.empty()) res.first_wrong = fw;
  }
  // First start to last finish (one host: one clock).
  for (std::size_t k = 0; k < mine.size(); ++k) {
    res.versions[k].delta_seconds = static_cast<double>(hi0[k] - lo0[k]) * 1e-9;
    res.versions[k].dense_seconds = static_cast<double>(hi1[k] - lo1[k]) * 1e-9;
    for (const auto& [pid, c] : cpu[k]) {
      res.versions[k].delta_cpu_seconds += c.first;
      res.versions[k].dense_cpu_seconds += c.second;
    }
  }
  t.all_gather({}, far());
  return res;
}

}  // namespace delta_harness
