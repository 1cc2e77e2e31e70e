// The CUDA delta kernels (cuda/delta_kernels.cuh) against the host kernels
// of delta.hpp: the device diff writes the same chunk table and bodies, byte
// for byte, as the host's encode (diff_compact_bytes, gap_escapes,
// best_mode, the body writers), brings the shadow to the current elements,
// and its bytes decode on the host to the current elements; the device
// scatter of a host encoding leaves the same buffer as the host's decode.
// Element sizes 1, 2, 4, 8 in one batch, full and partial chunks, densities
// 0, 0.1%, 0.3%, 1%, 50%, 100% and clustered changes (every chunk mode),
// an overflowing capacity, and malformed payloads. The cases that need a
// GPU are in the suite "gpu" (skipped without one, tests/cuda_test_main.cpp).
#include <doctest/doctest.h>

#include <cstring>
#include <random>
#include <vector>

#include "reshard/cuda/delta_kernels.cuh"

using namespace reshard;
using namespace reshard::cuda;
using delta::ChunkMode;

namespace {

struct DeviceBytes {
  std::byte* p = nullptr;
  std::size_t n = 0;
  explicit DeviceBytes(std::size_t bytes) : n(bytes) { check_cuda(cudaMalloc(reinterpret_cast<void**>(&p), std::max<std::size_t>(bytes, 1)), "cudaMalloc"); }
  DeviceBytes(const std::vector<std::byte>& v) : DeviceBytes(v.size()) { put(v); }
  ~DeviceBytes() { cudaFree(p); }
  DeviceBytes(const DeviceBytes&) = delete;
  DeviceBytes& operator=(const DeviceBytes&) = delete;
  void put(const std::vector<std::byte>& v) { check_cuda(cudaMemcpy(p, v.data(), v.size(), cudaMemcpyHostToDevice), "cudaMemcpy"); }
  std::vector<std::byte> get() const {
    std::vector<std::byte> v(n);
    check_cuda(cudaMemcpy(v.data(), p, n, cudaMemcpyDeviceToHost), "cudaMemcpy");
    return v;
  }
};

/// One chunk of the batch: E-byte elements [at, at + n) of the arenas (bytes at * 1).
struct Chunk {
  std::size_t at;  // byte offset in the arenas
  std::int64_t n, E;
};

/// cur and base arenas of several streams (element sizes), cut into chunks.
struct Batch {
  std::vector<std::byte> cur, base;
  std::vector<Chunk> chunks;
};

enum class Pattern { uniform, clustered, sparse_far };

/// Appends a stream of `elements` E-byte elements whose changed positions
/// (one random byte of the element flipped) follow `pattern` at `density`.
void add_stream(Batch& b, std::mt19937& g, std::int64_t E, std::int64_t elements, double density, Pattern pattern) {
  const std::size_t at = (b.cur.size() + 15) / 16 * 16;
  b.cur.resize(at + static_cast<std::size_t>(elements * E));
  for (std::size_t i = at; i < b.cur.size(); ++i) b.cur[i] = static_cast<std::byte>(g());
  b.base.resize(b.cur.size());
  std::memcpy(b.base.data() + at, b.cur.data() + at, static_cast<std::size_t>(elements * E));
  std::uniform_real_distribution<double> u(0, 1);
  auto change = [&](std::int64_t i) {
    const std::size_t byte = at + static_cast<std::size_t>(i * E + static_cast<std::int64_t>(g() % static_cast<unsigned>(E)));
    b.base[byte] ^= static_cast<std::byte>(1 + g() % 255);
  };
  if (pattern == Pattern::uniform) {
    for (std::int64_t i = 0; i < elements; ++i)
      if (density >= 1.0 || u(g) < density) change(i);
  } else if (pattern == Pattern::clustered) {
    // Runs of changes with long clean stretches between (escapes and short gaps both).
    for (std::int64_t i = 0; i < elements;) {
      const std::int64_t run = 1 + static_cast<std::int64_t>(g() % 40);
      for (std::int64_t r = 0; r < run && i < elements; ++r, ++i) change(i);
      i += static_cast<std::int64_t>(g() % 2000);
    }
  } else {
    // Gaps of 255 and 254 exactly (the escape's edge: 255 escapes), then
    // changes 255 and more apart.
    if (elements > 600) {
      change(0);
      change(256);  // gap 255 after 0: escaped
      change(511);  // gap 254 after 256: not escaped
    }
    for (std::int64_t i = 1200; i < elements; i += 255 + static_cast<std::int64_t>(g() % 700)) change(i);
  }
  for (std::int64_t c0 = 0; c0 < elements; c0 += delta::kChunk)
    b.chunks.push_back({at + static_cast<std::size_t>(c0 * E), std::min(delta::kChunk, elements - c0), E});
}

/// The host's encode (DeltaExecutor::encode's loop over a pair's chunks):
/// the table, the bodies (those that fit), the sum of all bodies' bytes.
struct Encoding {
  std::vector<std::byte> table, bodies;
  std::int64_t total = 0;
  int modes[delta::kChunkModes] = {};
};
Encoding host_encode(const Batch& b, std::vector<std::byte>& shadow, std::int64_t capacity) {
  using namespace delta;
  Encoding e;
  e.table.resize(4 * b.chunks.size());
  e.bodies.assign(static_cast<std::size_t>(capacity), std::byte{0xEE});
  std::vector<std::uint16_t> idx(static_cast<std::size_t>(kChunk));
  std::vector<std::byte> vals(static_cast<std::size_t>(8 * kChunk));
  std::int64_t body = 0;
  bool overflow = false;
  for (std::size_t c = 0; c < b.chunks.size(); ++c) {
    const Chunk& ch = b.chunks[c];
    const std::int64_t n = ch.n, E = ch.E;
    const std::byte* cur = b.cur.data() + ch.at;
    const std::int64_t k = diff_compact_bytes(static_cast<std::size_t>(E), cur, shadow.data() + ch.at, n, idx.data(), vals.data());
    const std::int64_t esc = gap_escapes(idx.data(), k);
    const ChunkMode m = best_mode(n, k, E, esc);
    ++e.modes[static_cast<int>(m)];
    const std::uint32_t entry = table_entry(m, k);
    std::memcpy(e.table.data() + 4 * c, &entry, 4);
    const std::int64_t need = body_bytes(m, n, k, E, esc);
    e.total += need;
    if (overflow || body + need > capacity) {
      overflow = true;
      continue;
    }
    write_chunk_body(m, n, k, E, esc, idx.data(), vals.data(), cur, e.bodies.data() + body);
    body += need;
  }
  return e;
}

/// The host's decode (DeltaExecutor::decode's loop) into `dst` (chunks at
/// their arena offsets, each one contiguous segment).
void host_decode(const Batch& b, const std::vector<std::byte>& table, const std::vector<std::byte>& bodies, std::int64_t bytes, std::vector<std::byte>& dst) {
  using namespace delta;
  std::vector<std::uint16_t> idx(static_cast<std::size_t>(kChunk));
  const std::byte* body = bodies.data();
  const std::byte* const end = bodies.data() + bytes;
  for (std::size_t c = 0; c < b.chunks.size(); ++c) {
    const Chunk& ch = b.chunks[c];
    const std::int64_t n = ch.n, E = ch.E;
    StreamSegment seg;
    seg.base = dst.data() + ch.at;
    const std::int64_t one = 1, none = 0;
    seg.assign(1, &n, &one, &none);
    seg.count = n;
    seg.contiguous = true;
    const std::vector<StreamSegment> segs{seg};
    std::size_t cursor = 0;
    std::uint32_t entry;
    std::memcpy(&entry, table.data() + 4 * c, 4);
    const auto m = static_cast<ChunkMode>(entry >> 24);
    const std::int64_t k = entry & 0xFFFFFF;
    REQUIRE((entry >> 24) < static_cast<std::uint32_t>(kChunkModes));
    REQUIRE(k <= n);
    std::int64_t esc = 0;
    if (m == ChunkMode::gap) {
      const std::int64_t gl = indices_from_gaps(body, k, n, end - body, idx.data());
      REQUIRE(gl >= 0);
      esc = (gl - k) / 2;
    }
    const std::int64_t need = body_bytes(m, n, k, E, esc);
    REQUIRE(body + need <= end);
    const auto sE = static_cast<std::size_t>(E);
    if (m == ChunkMode::index) {
      std::memcpy(idx.data(), body, static_cast<std::size_t>(2 * k));
      scatter_bytes(sE, segs, cursor, 0, idx.data(), k, body + 2 * k);
    } else if (m == ChunkMode::gap) {
      scatter_bytes(sE, segs, cursor, 0, idx.data(), k, body + k + 2 * esc);
    } else if (m == ChunkMode::mask) {
      REQUIRE(indices_from_mask(body, n, idx.data()) == k);
      scatter_bytes(sE, segs, cursor, 0, idx.data(), k, body + (n + 7) / 8);
    } else if (m == ChunkMode::dense) {
      stream_copy<false>(sE, segs, cursor, 0, n, const_cast<std::byte*>(body));
    }
    body += need;
  }
}

std::size_t first_difference(const std::vector<std::byte>& a, const std::vector<std::byte>& b, std::size_t n) {
  std::size_t i = 0;
  while (i < n && a[i] == b[i]) ++i;
  return i;
}

/// Runs the device diff of the batch (capacity: bodies' room) against the
/// host's encode, then the host decode and the device scatter of the host's
/// encoding; returns the host encoding's mode counts.
std::vector<int> check_batch(DeltaDiffer& differ, DeltaScatterer& scatterer, const Batch& b, double capacity_fraction = 2.0) {
  std::int64_t dense_bytes = 0;
  for (const Chunk& c : b.chunks) dense_bytes += c.n * c.E;
  const auto capacity = static_cast<std::int64_t>(static_cast<double>(dense_bytes) * capacity_fraction);
  std::vector<std::byte> shadow = b.base;
  const Encoding host = host_encode(b, shadow, capacity);
  REQUIRE(shadow == b.cur);  // the host's diff brings its shadow to the current elements

  // Device diff.
  DeviceBytes dcur(b.cur), dbase(b.base), dtable(host.table.size()), dbodies(static_cast<std::size_t>(capacity));
  check_cuda(cudaMemset(dtable.p, 0x77, dtable.n), "cudaMemset");
  check_cuda(cudaMemset(dbodies.p, 0xEE, dbodies.n), "cudaMemset");
  std::vector<DiffChunk> dc;
  for (const Chunk& c : b.chunks)
    dc.push_back({reinterpret_cast<std::uint64_t>(dcur.p + c.at), reinterpret_cast<std::uint64_t>(dbase.p + c.at), static_cast<std::int32_t>(c.n),
                  static_cast<std::int32_t>(c.E)});
  differ.run(dc, dtable.p, dbodies.p, capacity);
  std::int64_t total = -1;
  check_cuda(cudaMemcpyAsync(&total, differ.total_device(), 8, cudaMemcpyDeviceToHost, differ.stream()), "cudaMemcpyAsync");
  differ.synchronize();
  CHECK(total == host.total);
  const auto table = dtable.get(), bodies = dbodies.get(), base_after = dbase.get();
  {
    const std::size_t t = first_difference(table, host.table, table.size());
    INFO("table: first difference at chunk ", t / 4, " of ", b.chunks.size());
    CHECK(t == table.size());
  }
  {
    const std::size_t at = first_difference(bodies, host.bodies, bodies.size());
    INFO("bodies: first difference at byte ", at, " of ", bodies.size(), " (total ", host.total, ")");
    CHECK(at == bodies.size());
  }
  CHECK(base_after == b.cur);  // the device shadow too

  if (host.total > capacity) return {host.modes, host.modes + delta::kChunkModes};  // overflow: nothing to decode

  // The device's bytes decode on the host to the current elements.
  std::vector<std::byte> decoded = b.base;
  host_decode(b, table, bodies, total, decoded);
  CHECK(decoded == b.cur);

  // The device scatter of the host's encoding: the host decode's buffer.
  std::vector<std::byte> host_dst = b.base;
  host_decode(b, host.table, host.bodies, host.total, host_dst);
  DeviceBytes ddst(b.base), htable(host.table), hbodies(host.bodies);
  std::vector<ScatterChunk> sc;
  for (const Chunk& c : b.chunks) sc.push_back({reinterpret_cast<std::uint64_t>(ddst.p + c.at), static_cast<std::int32_t>(c.n), static_cast<std::int32_t>(c.E)});
  scatterer.run(sc, htable.p, hbodies.p, host.total);
  unsigned long long status = 1;
  check_cuda(cudaMemcpyAsync(&status, scatterer.status_device(), 8, cudaMemcpyDeviceToHost, scatterer.stream()), "cudaMemcpyAsync");
  scatterer.synchronize();
  INFO("scatter status: ", describe_delta_status(status));
  CHECK(status == 0);
  const auto out = ddst.get();
  const std::size_t at = first_difference(out, host_dst, out.size());
  INFO("scatter: first difference at byte ", at, " of ", out.size());
  CHECK(at == out.size());
  CHECK(out == b.cur);
  return {host.modes, host.modes + delta::kChunkModes};
}

}  // namespace

TEST_CASE("delta kernels refuse what they do not take: element sizes other than 1, 2, 4, 8; chunks of 0 or more than kChunk elements") {
  std::vector<DiffChunk> c{{0, 0, 16, 3}};
  CHECK_THROWS_WITH_AS(delta_detail::check_chunks<DiffChunk>(c), doctest::Contains("element size 3"), Error);
  c[0].E = 8;
  CHECK_NOTHROW(delta_detail::check_chunks<DiffChunk>(c));
  c[0].n = 0;
  CHECK_THROWS_AS(delta_detail::check_chunks<DiffChunk>(c), Error);
  c[0].n = static_cast<std::int32_t>(delta::kChunk) + 1;
  CHECK_THROWS_AS(delta_detail::check_chunks<DiffChunk>(c), Error);
  CHECK(describe_delta_status(0) == "good");
  CHECK(describe_delta_status(3ull << 32 | 5) == "chunk 4 has a body past the end");
}

TEST_CASE("device diff and scatter match the host at densities 0, ~1%, ~50%, 100%, element sizes 1, 2, 4, 8 in one batch" * doctest::test_suite("gpu")) {
  DeltaDiffer differ;
  DeltaScatterer scatterer;
  std::mt19937 g(21);
  int seen[delta::kChunkModes] = {};
  for (double density : {0.0, 0.01, 0.5, 1.0, 0.001, 0.003, 0.05}) {
    Batch b;
    for (std::int64_t E : {2, 1, 4, 8}) add_stream(b, g, E, 2 * delta::kChunk + 1 + static_cast<std::int64_t>(g() % 3000), density, Pattern::uniform);
    CAPTURE(density);
    const auto modes = check_batch(differ, scatterer, b);
    for (int m = 0; m < delta::kChunkModes; ++m) seen[m] += modes[static_cast<std::size_t>(m)];
  }
  // Every chunk encoding was exercised (the host chose each somewhere).
  for (int m = 0; m < delta::kChunkModes; ++m) {
    CAPTURE(m);
    CHECK(seen[m] > 0);
  }
}

TEST_CASE("device diff and scatter: clustered and far-apart changes (gap escapes), small and single-element chunks" * doctest::test_suite("gpu")) {
  DeltaDiffer differ;
  DeltaScatterer scatterer;
  std::mt19937 g(22);
  for (int trial = 0; trial < 4; ++trial) {
    Batch b;
    add_stream(b, g, 2, 3 * delta::kChunk, 0, Pattern::clustered);
    add_stream(b, g, 4, delta::kChunk + 700, 0, Pattern::sparse_far);
    add_stream(b, g, 1, 1, 1.0, Pattern::uniform);          // one element, changed
    add_stream(b, g, 8, 31, 0.5, Pattern::uniform);         // under one warp step
    add_stream(b, g, 2, 8 * 32 + 5, 0.2, Pattern::uniform);  // a few steps per warp
    CAPTURE(trial);
    check_batch(differ, scatterer, b);
  }
}

TEST_CASE("device diff: a capacity the bodies outgrow (bodies written up to it, the shadow still updated)" * doctest::test_suite("gpu")) {
  DeltaDiffer differ;
  DeltaScatterer scatterer;
  std::mt19937 g(23);
  Batch b;
  for (std::int64_t E : {2, 4}) add_stream(b, g, E, 3 * delta::kChunk, 0.3, Pattern::uniform);
  check_batch(differ, scatterer, b, 0.2);
}

TEST_CASE("device scatter reports malformed payloads and scatters nothing the walk found bad" * doctest::test_suite("gpu")) {
  std::mt19937 g(24);
  Batch b;
  add_stream(b, g, 2, 2 * delta::kChunk, 0.01, Pattern::uniform);   // gap chunks
  add_stream(b, g, 2, delta::kChunk, 0.5, Pattern::uniform);        // a mask chunk
  std::vector<std::byte> shadow = b.base;
  const Encoding e = host_encode(b, shadow, 1 << 24);
  DeltaScatterer scatterer;
  auto run = [&](const std::vector<std::byte>& table, const std::vector<std::byte>& bodies, std::int64_t bytes) {
    DeviceBytes ddst(b.base), dt(table), db(bodies);
    std::vector<ScatterChunk> sc;
    for (const Chunk& c : b.chunks) sc.push_back({reinterpret_cast<std::uint64_t>(ddst.p + c.at), static_cast<std::int32_t>(c.n), static_cast<std::int32_t>(c.E)});
    scatterer.run(sc, dt.p, db.p, bytes);
    unsigned long long status = 0;
    check_cuda(cudaMemcpyAsync(&status, scatterer.status_device(), 8, cudaMemcpyDeviceToHost, scatterer.stream()), "cudaMemcpyAsync");
    scatterer.synchronize();
    return std::make_pair(status, ddst.get());
  };
  {
    auto [status, out] = run(e.table, e.bodies, e.total);
    CHECK(status == 0);
    CHECK(out == b.cur);
  }
  {
    std::vector<std::byte> t = e.table;
    t[4 * 1 + 3] = std::byte{7};  // chunk 1: mode 7
    auto [status, out] = run(t, e.bodies, e.total);
    CHECK(describe_delta_status(status) == "chunk 1 has a bad chunk entry");
    CHECK(out == b.base);
  }
  {
    auto [status, out] = run(e.table, e.bodies, e.total - 1);  // the last body cut short
    CHECK(describe_delta_status(status) == "chunk 2 has a body past the end");
    CHECK(out == b.base);
  }
  {
    std::vector<std::byte> bodies = e.bodies;
    std::uint32_t entry;
    std::memcpy(&entry, e.table.data(), 4);
    REQUIRE(static_cast<ChunkMode>(entry >> 24) == ChunkMode::gap);
    bodies[0] = std::byte{255};  // the first gap escapes to position (bytes 1, 2) ...
    bodies[1] = std::byte{0xFF};
    bodies[2] = std::byte{0xFF};  // ... 65535, and the next gap cannot follow it
    auto [status, out] = run(e.table, bodies, e.total);
    CHECK(describe_delta_status(status) == "chunk 0 has a malformed gap list");
    CHECK(out == b.base);
  }
  {
    // The mask chunk (the last): one more bit than its count.
    std::uint32_t entry;
    std::memcpy(&entry, e.table.data() + 8, 4);
    REQUIRE(static_cast<ChunkMode>(entry >> 24) == ChunkMode::mask);
    std::memcpy(&entry, e.table.data() + 4, 4);
    REQUIRE(static_cast<ChunkMode>(entry >> 24) == ChunkMode::gap);  // chunks 0 and 1: gap lists (their lengths below)
    std::int64_t at = 0;
    for (int c = 0; c < 2; ++c) {
      std::uint32_t en;
      std::memcpy(&en, e.table.data() + 4 * c, 4);
      const std::int64_t k = en & 0xFFFFFF;
      std::vector<std::uint16_t> idx(static_cast<std::size_t>(delta::kChunk));
      const std::int64_t gl = delta::indices_from_gaps(e.bodies.data() + at, k, delta::kChunk, e.total - at, idx.data());
      REQUIRE(gl >= 0);
      at += delta::body_bytes(ChunkMode::gap, delta::kChunk, k, 2, (gl - k) / 2);
    }
    std::vector<std::byte> bodies = e.bodies;
    std::size_t flip = static_cast<std::size_t>(at);
    while (bodies[flip] == std::byte{0xFF}) ++flip;
    unsigned v = static_cast<unsigned>(bodies[flip]);
    bodies[flip] = static_cast<std::byte>(v | (~v & (v + 1)));  // set its lowest clear bit
    auto [status, out] = run(e.table, bodies, e.total);
    CHECK(describe_delta_status(status) == "chunk 2 has a bitmask whose count is not its entry's");
  }
}
