// The executor and the in-process transport: message bucketing, zero-copy
// and half-staged pieces, waves under a staging budget, peak staging, bytes
// equal to the plan, agreement checks between ranks, deadlines, and the
// Transport concept's diagnostics.
#include <doctest/doctest.h>

#include <sys/resource.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <mutex>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "error_of.hpp"
#include "refit_util.hpp"
#include "reshard/exec/executor.hpp"

using namespace reshard;

namespace {

using refit_test::cut;
using refit_test::one_axis;
using refit_test::tensor;

using test_util::error_of;

/// Runs the executor directly (no Resharder) over one shared full schedule;
/// `edit` may change the schedule a rank compiles. Returns per-rank stats.
struct DirectRun {
  std::vector<ExecutorStats> stats;
  std::vector<std::int64_t> registered_staging;  ///< per rank, what the transport saw registered beyond the buffers
  std::vector<std::int64_t> ranks;
  std::int64_t wrong = 0;
  std::string first_wrong;
  LocalTrafficStats traffic;
  Schedule schedule;
};
DirectRun run_direct(const Layout& src, const Layout& dst, ExecutorOptions opt,
                     const std::function<void(std::int64_t, Schedule&)>& edit = {}, int runs = 1,
                     const std::function<void(std::int64_t rank, int run)>& before_run = {}) {
  DirectRun out;
  out.schedule = plan(src, dst);
  refit_test::DenseWorld w(src, dst);
  out.ranks = w.ranks;
  out.stats.resize(w.ranks.size());
  out.registered_staging.resize(w.ranks.size());
  std::mutex m;
  w.run(src, dst, [&](LocalTransport& t, std::size_t i, auto sb, auto db) {
    Schedule s = out.schedule;
    if (edit) edit(t.rank(), s);
    Executor<LocalTransport> ex;
    ex.setup(s, sb, db, t, opt);
    out.registered_staging[i] = refit_test::registered_outside(t, {&w.src_mem[i], &w.dst_mem[i]});
    for (int k = 0; k < runs; ++k) {
      if (before_run) before_run(t.rank(), k);
      out.stats[i] = ex.run();
    }
    std::string first;
    const auto wrong = refit_test::count_wrong(dst, w.dst_mem[i], t.rank(), 0, &first);
    std::lock_guard lk(m);
    if (wrong && out.first_wrong.empty()) out.first_wrong = first;
    out.wrong += wrong;
  });
  out.traffic = w.traffic;
  return out;
}

/// CPU time of this process so far (user + system, every thread).
double cpu_seconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) + static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec) * 1e-6;
}

std::int64_t sum(const DirectRun& r, std::int64_t ExecutorStats::*f) {
  std::int64_t s = 0;
  for (const auto& x : r.stats) s += x.*f;
  return s;
}

/// Posts `op` over a fresh host region of `region_bytes` (op.region is set to
/// it) and waits for it until `timeout`.
void post_one(LocalTransport& t, std::size_t region_bytes, TransferOp op,
              std::chrono::milliseconds timeout = std::chrono::seconds(10)) {
  std::vector<char> m(region_bytes);
  op.region = t.register_memory(m.data(), region_bytes, MemoryKind::host);
  auto q = t.post(std::span(&op, 1));
  t.wait(q, Clock::now() + timeout);
}

}  // namespace

// --- the Transport concept ---------------------------------------------------

struct NotATransport {};
struct AlmostATransport {  // everything but wait_any and abort
  using request = int;
  std::int64_t rank() const { return 0; }
  std::span<const std::int64_t> world_ranks() const { return {}; }
  std::string_view name() const { return "almost"; }
  RegionHandle register_memory(void*, std::size_t, MemoryKind) { return {}; }
  void deregister_memory(RegionHandle) {}
  std::vector<std::vector<std::byte>> all_gather(std::span<const std::byte>, Deadline) { return {}; }
  void prepare(std::span<const TransferOp>, Deadline) {}
  request post(std::span<const TransferOp>) { return 0; }
  bool test(request&) { return true; }
  void wait(request&, Deadline) {}
};
static_assert(Transport<LocalTransport>);
static_assert(!Transport<NotATransport>);
static_assert(!Transport<AlmostATransport>);
static_assert(!Transport<int>);

TEST_CASE("many small tensors between one pair travel as one bucketed message") {
  std::vector<TensorSpec> ts;
  for (int i = 0; i < 20; ++i) ts.push_back(tensor(fmt::format("w{}", i), {8, 8}, {}));
  auto src = one_axis("tp", 1, 0, ts), dst = one_axis("tp", 1, 1, ts);
  auto r = run_direct(src, dst, {});
  INFO(r.first_wrong);
  CHECK(r.wrong == 0);
  CHECK(r.stats[0].messages_sent == 1);
  CHECK(r.stats[1].messages_received == 1);
  CHECK(r.traffic.messages_sent == 1);
  CHECK(r.stats[0].packed_bytes == 20 * 64 * 4);
  CHECK(r.stats[1].unpacked_bytes == 20 * 64 * 4);
  CHECK(r.stats[0].bytes_sent == r.schedule.stats.bytes);
}

TEST_CASE("max_direct_messages: the largest in-place pieces keep their message, the rest join the bucket") {
  // 120 contiguous tensors of 4..16 KiB and one of 256 KiB (zero-copy each
  // at zero_copy_min 1 KiB).
  std::vector<TensorSpec> ts;
  std::vector<std::int64_t> sizes;
  for (int i = 0; i < 120; ++i) {
    const std::int64_t rows = 16 + (i * 37) % 49;
    ts.push_back(tensor(fmt::format("w{}", i), {rows, 64}, {}));
    sizes.push_back(rows * 64 * 4);
  }
  ts.push_back(tensor("o", {256, 512}, {}, DType::bf16));
  const auto src = one_axis("tp", 1, 0, ts), dst = one_axis("tp", 1, 1, ts);
  ExecutorOptions opt;
  opt.zero_copy_min = 1024;
  const auto all = run_direct(src, dst, opt);
  CHECK(all.wrong == 0);
  CHECK(all.stats[0].messages_sent == 121);  // every piece its own message
  std::sort(sizes.rbegin(), sizes.rend());
  const std::int64_t o_bytes = 256 * 512 * 2;  // 256 KiB: the largest piece
  for (const std::int64_t budget : {std::int64_t{256} << 20, std::int64_t{64} << 10}) {
    CAPTURE(budget);
    opt.max_direct_messages = 8;
    opt.staging_budget = budget;
    const auto r = run_direct(src, dst, opt);
    INFO(r.first_wrong);
    CHECK(r.wrong == 0);
    // Kept in place: o and the 7 largest w's; everything else is packed.
    std::int64_t kept = 0;
    for (int k = 0; k < 7; ++k) kept += sizes[static_cast<std::size_t>(k)];
    CHECK(r.stats[0].zero_copy_bytes == kept + o_bytes);
    CHECK(r.stats[0].packed_bytes == r.schedule.stats.bytes - kept - o_bytes);
    // Per wave at most 8 direct messages plus the bucket.
    CHECK(r.stats[0].messages_sent <= 8 + r.stats[0].waves);
    CHECK(r.stats[1].messages_received == r.stats[0].messages_sent);
    if (budget < (1 << 20)) CHECK(r.stats[0].waves > 1);
  }
  opt.max_direct_messages = -1;
  CHECK(error_of([&] { run_direct(src, dst, opt); }).find("max_direct_messages is negative (-1)") != std::string::npos);
}

TEST_CASE("contiguous pieces go zero-copy, one-sided runs skip half the staging") {
  SUBCASE("contiguous on both sides: no staging at all") {
    auto src = one_axis("tp", 2, 0, {tensor("w", {1024, 64}, {cut(2), {}})});
    auto dst = one_axis("tp", 4, 2, {tensor("w", {1024, 64}, {cut(4), {}})});
    auto r = run_direct(src, dst, {});
    CHECK(r.wrong == 0);
    CHECK(sum(r, &ExecutorStats::zero_copy_bytes) == r.schedule.stats.bytes);
    CHECK(sum(r, &ExecutorStats::packed_bytes) == 0);
    CHECK(sum(r, &ExecutorStats::unpacked_bytes) == 0);
    CHECK(sum(r, &ExecutorStats::staging_bytes) == 0);
    CHECK(r.traffic.bytes_sent == r.schedule.stats.bytes);
  }
  SUBCASE("row-parallel: packed by the sender, received in place") {
    auto src = one_axis("tp", 2, 0, {tensor("o", {256, 512}, {{}, cut(2)}, DType::bf16)});
    auto dst = one_axis("tp", 4, 2, {tensor("o", {256, 512}, {{}, cut(4)}, DType::bf16)});
    auto r = run_direct(src, dst, {});
    CHECK(r.wrong == 0);
    CHECK(sum(r, &ExecutorStats::packed_bytes) == r.schedule.stats.bytes);
    CHECK(sum(r, &ExecutorStats::unpacked_bytes) == 0);
  }
  SUBCASE("the reverse: sent in place, unpacked by the receiver") {
    auto src = one_axis("tp", 4, 0, {tensor("o", {256, 512}, {{}, cut(4)}, DType::bf16)});
    auto dst = one_axis("tp", 2, 4, {tensor("o", {256, 512}, {{}, cut(2)}, DType::bf16)});
    auto r = run_direct(src, dst, {});
    CHECK(r.wrong == 0);
    CHECK(sum(r, &ExecutorStats::packed_bytes) == 0);
    CHECK(sum(r, &ExecutorStats::unpacked_bytes) == r.schedule.stats.bytes);
  }
}

TEST_CASE("waves keep staging under the budget, with and without pipelining") {
  // Cross-dim reshard: strided on both sides, so everything is staged twice.
  auto src = one_axis("tp", 2, 0, {tensor("w", {96, 80}, {cut(2), {}}, DType::bf16), tensor("b", {333}, {cut(1)}, DType::u8)});
  auto dst = one_axis("tp", 2, 2, {tensor("w", {96, 80}, {{}, cut(2)}, DType::bf16), tensor("b", {333}, {cut(1)}, DType::u8)});
  for (int pipeline : {1, 2}) {
    for (std::int64_t budget : {std::int64_t{128}, std::int64_t{1000}, std::int64_t{5000}, std::int64_t{1} << 20}) {
      ExecutorOptions opt;
      opt.staging_budget = budget;
      opt.pipeline = pipeline;
      auto r = run_direct(src, dst, opt, {}, 2);
      INFO("pipeline " << pipeline << ", budget " << budget << ": " << r.first_wrong);
      CHECK(r.wrong == 0);
      // Staging as the transport saw it registered (not the executor's own
      // figures): within the budget on every rank, and used at all.
      std::int64_t staged = 0;
      for (std::size_t i = 0; i < r.ranks.size(); ++i) {
        CAPTURE(r.ranks[i]);
        CHECK(r.registered_staging[i] <= budget);
        CHECK(r.stats[i].peak_staging_bytes <= r.registered_staging[i]);
        staged = std::max(staged, r.registered_staging[i]);
      }
      CHECK(staged > 0);
      CHECK(sum(r, &ExecutorStats::bytes_sent) == r.schedule.stats.bytes);
      if (budget < 5000) {
        for (const auto& s : r.stats) CHECK(s.waves > 1);
      }
      if (budget == (std::int64_t{1} << 20)) {
        for (const auto& s : r.stats) CHECK(s.waves == 1);
      }
    }
  }
}

TEST_CASE("ranks whose schedules disagree fail setup together instead of hanging") {
  auto src = one_axis("tp", 2, 0, {tensor("w", {64, 16}, {cut(2), {}})});
  auto dst = one_axis("tp", 4, 2, {tensor("w", {64, 16}, {cut(4), {}})});
  ExecutorOptions opt;
  opt.timeout = std::chrono::seconds(20);
  const auto t0 = std::chrono::steady_clock::now();
  auto e = error_of([&] {
    run_direct(src, dst, opt, [](std::int64_t rank, Schedule& s) {
      if (rank == 3) s.copies.erase(std::remove_if(s.copies.begin(), s.copies.end(), [](const Copy& c) { return c.dst_rank == 3; }), s.copies.end());
    });
  });
  // Rank 3 (which lost its copies) or a source feeding it says so, naming both.
  INFO(e);
  CHECK(std::regex_search(e, std::regex("rank 3: rank [01] plans [0-9]+ copies \\([0-9]+ bytes\\) from rank [01] to rank 3, but this "
                                        "rank's schedule has none|rank [01]: this rank's schedule sends to rank 3 \\([0-9]+ bytes\\) "
                                        "but rank 3 plans no such copies")));
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(10));
  e = error_of([&] {
    run_direct(src, dst, opt, [](std::int64_t rank, Schedule& s) {
      if (rank == 4)  // the same copies, but rank 4 expects fewer bytes
        for (auto& c : s.copies)
          if (c.dst_rank == 4) c.extent(0) -= 1;
    });
  });
  INFO(e);
  CHECK(std::regex_search(e, std::regex("rank [0-4]: this rank and rank [0-4] disagree about the copies from rank [01] to rank 4 "
                                        "\\([0-9]+ vs [0-9]+ copies, [0-9]+ vs [0-9]+ bytes\\)")));
}

TEST_CASE("executor misuse: unbound buffers, out-of-bounds copies, run before setup") {
  Executor<LocalTransport> ex;
  CHECK(error_of([&] { ex.run(); }).find("before a successful setup") != std::string::npos);
  auto src = one_axis("tp", 1, 0, {tensor("w", {8, 8}, {})});
  auto dst = one_axis("tp", 1, 1, {tensor("w", {8, 8}, {})});
  auto e = error_of([&] { run_direct(src, dst, {}, [](std::int64_t, Schedule& s) { s.copies[0].src_offset = 10; }); });
  CHECK(e.find("reads outside source buffer 'w'") != std::string::npos);
}

TEST_CASE("local transport: matching, deadlines, sizes, regions, bootstrap") {
  LocalWorld world({10, 20});
  SUBCASE("a message reaches the peer's posted receive, in order per tag") {
    std::vector<int> a(100), b(100, 0), c(100, 0);
    for (int i = 0; i < 100; ++i) a[static_cast<std::size_t>(i)] = i;
    world.run([&](LocalTransport& t) {
      const auto dl = Clock::now() + std::chrono::seconds(10);
      if (t.rank() == 10) {
        auto r = t.register_memory(a.data(), 400, MemoryKind::host);
        TransferOp s1{OpKind::send, 20, 7, r, 0, 200}, s2{OpKind::send, 20, 7, r, 200, 200};
        auto q1 = t.post(std::span(&s1, 1));
        auto q2 = t.post(std::span(&s2, 1));
        t.wait(q1, dl);
        t.wait(q2, dl);
      } else {
        auto rb = t.register_memory(b.data(), 400, MemoryKind::host);
        auto rc = t.register_memory(c.data(), 400, MemoryKind::host);
        TransferOp r1{OpKind::recv, 10, 7, rb, 0, 200}, r2{OpKind::recv, 10, 7, rc, 0, 200};
        auto q = t.post(std::span(&r1, 1));
        auto q2 = t.post(std::span(&r2, 1));
        LocalTransport::request* both[2] = {&q, &q2};
        const auto first = t.wait_any(both, dl);
        CHECK(first < 2);
        t.wait(q, dl);
        t.wait(q2, dl);
        CHECK(t.test(q));
      }
    });
    for (int i = 0; i < 50; ++i) {
      CHECK(b[static_cast<std::size_t>(i)] == i);
      CHECK(c[static_cast<std::size_t>(i)] == 50 + i);
    }
    CHECK(world.stats(10).bytes_sent == 400);
    CHECK(world.stats(20).bytes_received == 400);
  }
  SUBCASE("an unmatched receive times out naming the missing send") {
    auto e = error_of([&] {
      world.run([&](LocalTransport& t) {
        if (t.rank() != 20) {  // silent, but still there (a rank that left would fail the wait at once)
          std::this_thread::sleep_for(std::chrono::milliseconds(400));
          return;
        }
        post_one(t, 16, {OpKind::recv, 10, 3, {}, 0, 16}, std::chrono::milliseconds(100));
      });
    });
    CHECK(e.find("timed out waiting for receive of 16 bytes from rank 10 at rank 20") != std::string::npos);
  }
  SUBCASE("sizes that differ fail both sides") {
    auto e = error_of([&] {
      world.run([&](LocalTransport& t) {
        post_one(t, 64, t.rank() == 10 ? TransferOp{OpKind::send, 20, 1, {}, 0, 64} : TransferOp{OpKind::recv, 10, 1, {}, 0, 32});
      });
    });
    CHECK(e.find("size mismatch") != std::string::npos);
  }
  SUBCASE("an op outside its region is refused") {
    auto e = error_of([&] {
      world.run([&](LocalTransport& t) {
        if (t.rank() == 10) post_one(t, 64, {OpKind::send, 20, 1, {}, 60, 8});
      });
    });
    CHECK(e.find("covers bytes [60, 68) of a region of 64 bytes") != std::string::npos);
  }
  SUBCASE("all_gather returns every rank's blob in world order") {
    std::vector<std::vector<std::vector<std::byte>>> got(2);
    world.run([&](LocalTransport& t) {
      std::vector<std::byte> mine(static_cast<std::size_t>(t.rank() / 10), std::byte{static_cast<unsigned char>(t.rank())});
      for (int round = 0; round < 3; ++round) got[t.rank() == 10 ? 0 : 1] = t.all_gather(mine, Clock::now() + std::chrono::seconds(10));
    });
    for (const auto& g : got) {
      REQUIRE(g.size() == 2);
      CHECK(g[0] == std::vector<std::byte>(1, std::byte{10}));
      CHECK(g[1] == std::vector<std::byte>(2, std::byte{20}));
    }
  }
}

TEST_CASE("many rank threads on few cores: copies are shared, nobody spins") {
  // 16 + 16 ranks, everything point to point; the world limits concurrent
  // copiers to the hardware threads and the rest sleep.
  auto src = one_axis("tp", 16, 0, {tensor("w", {512, 256}, {cut(16), {}}, DType::bf16)});
  auto dst = one_axis("tp", 16, 16, {tensor("w", {512, 256}, {{}, cut(16)}, DType::bf16)});
  const double c0 = cpu_seconds();
  auto r = run_direct(src, dst, {}, {}, 5);
  const double busy = cpu_seconds() - c0;
  CHECK(r.wrong == 0);
  CHECK(r.traffic.bytes_sent == 5 * r.schedule.stats.bytes);
  // The same runs with rank 0 late: half a second in setup (the others wait
  // in the bootstrap) and a second before its third run (they wait for its
  // messages). Threads that sleep while they wait add next to no CPU time
  // (measured by getrusage, not wall time); spinning adds a core-second or more.
  const double c1 = cpu_seconds();
  auto late = run_direct(
      src, dst, {}, [](std::int64_t rank, Schedule&) {
        if (rank == 0) std::this_thread::sleep_for(std::chrono::milliseconds(500));
      },
      5, [](std::int64_t rank, int run) {
        if (rank == 0 && run == 2) std::this_thread::sleep_for(std::chrono::seconds(1));
      });
  const double waiting = cpu_seconds() - c1 - busy;
  CHECK(late.wrong == 0);
  MESSAGE("CPU seconds: the run " << busy << ", the extra with 1.5 s of waiting " << waiting);
  CHECK(waiting < 0.4);
}

TEST_CASE("local transport: targeted wake-ups lose no work (all-to-all, one copier, tiny tasks)") {
  // Each rank thread sleeps on its own condition variable and is woken only
  // for its own transfers or for copy work left behind; a lost wake-up would
  // stall a round until the deadline and fail it with "timed out".
  constexpr int kRanks = 8;
  std::vector<std::int64_t> ranks;
  for (int r = 0; r < kRanks; ++r) ranks.push_back(r);
  for (const int copy_threads : {1, 2})
    for (const std::size_t task_bytes : {std::size_t{64}, std::size_t{1000}}) {
      CAPTURE(copy_threads);
      CAPTURE(task_bytes);
      LocalWorld world(ranks, LocalWorldOptions{copy_threads, task_bytes});
      // Message from a to b: (a * 7 + b * 3) % 5 + 1 KiB of bytes a * 16 + b.
      auto bytes = [](int a, int b) { return static_cast<std::size_t>(((a * 7 + b * 3) % 5 + 1) * 1024); };
      std::atomic<int> wrong{0};
      world.run([&](LocalTransport& t) {
        const int me = static_cast<int>(t.rank());
        for (int round = 0; round < 10; ++round) {
          std::vector<std::vector<unsigned char>> out(kRanks), in(kRanks);
          std::vector<TransferOp> ops;
          for (int p = 0; p < kRanks; ++p) {
            if (p == me) continue;
            out[static_cast<std::size_t>(p)].assign(bytes(me, p), static_cast<unsigned char>(me * 16 + p + round));
            in[static_cast<std::size_t>(p)].assign(bytes(p, me), 0);
            auto rs = t.register_memory(out[static_cast<std::size_t>(p)].data(), bytes(me, p), MemoryKind::host);
            auto rr = t.register_memory(in[static_cast<std::size_t>(p)].data(), bytes(p, me), MemoryKind::host);
            ops.push_back(TransferOp{OpKind::send, p, static_cast<std::uint64_t>(round), rs, 0, bytes(me, p)});
            ops.push_back(TransferOp{OpKind::recv, p, static_cast<std::uint64_t>(round), rr, 0, bytes(p, me)});
          }
          // Half the ranks post everything at once, the others one op at a
          // time, waiting for each with wait_any over what is outstanding.
          const auto dl = Clock::now() + std::chrono::seconds(20);
          if (me % 2 == 0) {
            auto q = t.post(ops);
            t.wait(q, dl);
          } else {
            std::vector<LocalTransport::request> qs;
            for (const auto& op : ops) qs.push_back(t.post(std::span(&op, 1)));
            std::vector<LocalTransport::request*> left;
            for (auto& q : qs) left.push_back(&q);
            while (!left.empty()) {
              const auto i = t.wait_any(left, dl);
              left.erase(left.begin() + static_cast<std::ptrdiff_t>(i));
            }
          }
          for (int p = 0; p < kRanks; ++p)
            if (p != me)
              for (auto v : in[static_cast<std::size_t>(p)])
                if (v != static_cast<unsigned char>(p * 16 + me + round)) {
                  ++wrong;
                  break;
                }
        }
      });
      CHECK(wrong == 0);
      const auto tot = world.total_stats();
      CHECK(tot.messages_sent == 10 * kRanks * (kRanks - 1));
      CHECK(tot.bytes_sent == tot.bytes_received);
    }
}

TEST_CASE("local transport: an abort wakes a rank asleep on a long deadline") {
  LocalWorld world({0, 1});
  const auto t0 = std::chrono::steady_clock::now();
  auto e = error_of([&] {
    world.run([&](LocalTransport& t) {
      if (t.rank() == 1) {
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
        throw Error("rank 1 gives up");
      }
      std::vector<char> m(16);
      auto r = t.register_memory(m.data(), 16, MemoryKind::host);
      TransferOp op{OpKind::recv, 1, 3, r, 0, 16};
      auto q = t.post(std::span(&op, 1));
      t.wait(q, Clock::now() + std::chrono::seconds(120));
    });
  });
  CHECK(e.find("rank 1 gives up") != std::string::npos);
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(60));
}
