// Bounded batches (exec/batch_cap.hpp): at most max_batch_ops transport ops
// per rank in one wave, both ends of every pair agreeing on the wave of each
// message, so an NCCL group is never split into plans that disagree.
//  * The wave rule itself, on random pair graphs: counted per rank and wave
//    (the bound), and per pair (order kept, each new wave from one old one).
//  * Refits over QueueTransport in its NCCL mode (tests/queue_transport.hpp:
//    a batch past plan_cap ops is split into plans per rank from its own op
//    list, and ends that disagree wait until their deadline): with many more
//    messages per rank than the cap, bounded refits finish, every batch in
//    one plan, the data right; unbounded, the same refit hangs into the
//    deadline, which names the pair.
#include <doctest/doctest.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <thread>
#include <vector>

#include "queue_transport.hpp"
#include "refit_util.hpp"
#include "reshard/exec/batch_cap.hpp"
#include "reshard/exec/executor.hpp"

using namespace reshard;

namespace {

using refit_test::cut;
using refit_test::one_axis;
using refit_test::tensor;

struct PairRun {
  std::int64_t src = 0, dst = 0;
  std::vector<int> waves;  ///< per message, from the staging split
};

/// Checks bounded_waves on one world: every rank's ops in every wave (data
/// messages, plus one control per pair and wave with checksums) <= the cap.
void check_world(std::int64_t n, const std::vector<PairRun>& pairs, std::int64_t cap_ops, bool checksum) {
  std::vector<std::int64_t> degree(static_cast<std::size_t>(n), 0);
  for (const auto& p : pairs) ++degree[static_cast<std::size_t>(p.src)], ++degree[static_cast<std::size_t>(p.dst)];
  BatchCap cap;
  cap.max_ops = cap_ops;
  cap.world = n;
  cap.checksum = checksum;
  cap.max_degree = *std::max_element(degree.begin(), degree.end());
  std::map<std::pair<std::int64_t, int>, std::int64_t> ops;  // (rank, wave) -> ops
  for (const auto& p : pairs) {
    BatchPair bp{degree[static_cast<std::size_t>(p.src)], degree[static_cast<std::size_t>(p.dst)], p.src, p.dst};
    const std::vector<int> w = bounded_waves(p.waves, cap, bp);
    REQUIRE(w.size() == p.waves.size());
    std::map<int, std::set<int>> old_of_new;
    std::set<int> used;
    for (std::size_t k = 0; k < w.size(); ++k) {
      if (k) CHECK(w[k] >= w[k - 1]);  // order kept: tags stay in wave order
      old_of_new[w[k]].insert(p.waves[k]);
      used.insert(w[k]);
      ++ops[{p.src, w[k]}];
      ++ops[{p.dst, w[k]}];
    }
    for (const auto& [nw, olds] : old_of_new) CHECK(olds.size() == 1);  // staging per wave only shrinks
    if (checksum)
      for (int nw : used) ++ops[{p.src, nw}], ++ops[{p.dst, nw}];
  }
  std::int64_t most = 0;
  for (const auto& [key, count] : ops) most = std::max(most, count);
  CAPTURE(n);
  CAPTURE(cap.max_degree);
  CAPTURE(cap.lanes());
  CHECK(most <= cap_ops);
}

/// `tensors` tensors of 2 x 64 floats over `ranks` ranks that hold each
/// tensor's rows cut, then whole: every rank sends its rows to every other
/// rank and receives theirs, each row its own zero-copy message (both ways
/// between every two ranks, as a swap of an NCCL job has it).
std::pair<Layout, Layout> all_to_all(int ranks, int tensors) {
  std::vector<TensorSpec> src, dst;
  for (int k = 0; k < tensors; ++k) {
    src.push_back(tensor(fmt::format("w{}", k), {ranks, 64}, {cut(ranks), {}}));
    dst.push_back(tensor(fmt::format("w{}", k), {ranks, 64}, {{}, {}}));
  }
  return {one_axis("tp", ranks, 0, std::move(src)), one_axis("tp", ranks, 0, std::move(dst))};
}

struct Result {
  std::int64_t wrong = 0;
  std::string errors;
  std::size_t most_plans = 0;
  int waves = 0;
  double seconds = 0;
};

/// One refit over QueueTransport with NCCL-like plans of at most plan_cap ops.
Result refit(const Layout& src, const Layout& dst, std::size_t plan_cap, ExecutorOptions opt) {
  const auto ranks = refit_test::world_of(src, dst);
  std::vector<refit_test::SideMemory> sm(ranks.size()), dm(ranks.size());
  for (std::size_t i = 0; i < ranks.size(); ++i) {
    sm[i] = refit_test::make_side(src, ranks[i], true, 0);
    dm[i] = refit_test::make_side(dst, ranks[i], false, 0);
  }
  queue_transport::QueueWorld world(ranks, queue_transport::Flaw::none, true, plan_cap);
  const Schedule s = plan(src, dst);
  Result out;
  std::mutex m;
  const auto t0 = Clock::now();
  std::vector<std::thread> threads;
  for (std::size_t i = 0; i < ranks.size(); ++i)
    threads.emplace_back([&, i] {
      queue_transport::QueueTransport t(world, ranks[i]);
      try {
        const auto sb = bind_buffers(src, ranks[i], refit_test::views(src, sm[i]), "source");
        const auto db = bind_buffers(dst, ranks[i], refit_test::views(dst, dm[i]), "destination");
        Executor<queue_transport::QueueTransport> ex;
        ex.setup(s, refit_test::bound_pointers(sb), refit_test::bound_pointers(db), t, opt);
        ex.run();
        const auto wrong = refit_test::count_wrong(dst, dm[i], ranks[i], 0, nullptr);
        std::lock_guard lk(m);
        out.wrong += wrong;
        out.waves = std::max(out.waves, ex.waves());
      } catch (const std::exception& e) {
        std::lock_guard lk(m);
        out.errors += fmt::format("rank {}: {}\n", ranks[i], e.what());
      }
    });
  for (auto& th : threads) th.join();
  out.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  out.most_plans = world.most_plans();
  return out;
}

ExecutorOptions options(std::int64_t max_batch_ops, bool checksum, std::chrono::milliseconds timeout = std::chrono::seconds(20)) {
  ExecutorOptions opt;
  opt.zero_copy_min = 0;  // every row its own message
  opt.max_batch_ops = max_batch_ops;
  opt.checksum = checksum;
  opt.timeout = timeout;
  return opt;
}

}  // namespace

TEST_CASE("batch cap: on random pair graphs, no rank has more than the cap of ops in a wave") {
  std::mt19937_64 rng(41);
  for (int trial = 0; trial < 300; ++trial) {
    const std::int64_t n = 2 + static_cast<std::int64_t>(rng() % 40);
    const double density = 0.1 + 0.9 * static_cast<double>(rng() % 100) / 100.0;
    std::vector<PairRun> pairs;
    for (std::int64_t s = 0; s < n; ++s)
      for (std::int64_t d = 0; d < n; ++d) {
        if (s == d || static_cast<double>(rng() % 1000) / 1000.0 > density) continue;
        PairRun p{s, d, {}};
        int wave = 0;
        const int msgs = 1 + static_cast<int>(rng() % 60);
        for (int k = 0; k < msgs; ++k) {
          if (rng() % 8 == 0) wave += 1 + static_cast<int>(rng() % 2);
          p.waves.push_back(wave);
        }
        pairs.push_back(std::move(p));
      }
    if (pairs.empty()) continue;
    const std::int64_t caps[] = {4, 5, 16, 64, 256};
    const std::int64_t cap = caps[rng() % 5];
    check_world(n, pairs, cap, rng() % 2 == 0);
  }
}

TEST_CASE("batch cap: every rank has more peers than a wave can hold (lanes)") {
  // 40 ranks, all to all: 78 pairs a rank, over caps of 16 and 64 ops.
  std::vector<PairRun> pairs;
  for (std::int64_t s = 0; s < 40; ++s)
    for (std::int64_t d = 0; d < 40; ++d)
      if (s != d) pairs.push_back(PairRun{s, d, std::vector<int>(5, 0)});
  for (bool checksum : {false, true}) {
    check_world(40, pairs, 16, checksum);
    check_world(40, pairs, 64, checksum);
  }
}

TEST_CASE("batch cap: a cap below the minimum is refused by name") {
  const auto [src, dst] = all_to_all(2, 2);
  const Result r = refit(src, dst, 0, options(3, false));
  CHECK(r.errors.find("max_batch_ops is 3") != std::string::npos);
}

TEST_CASE("batch cap: refits with many times the cap of messages per rank finish, each batch one NCCL plan") {
  // 4 ranks, 60 tensors: each rank sends 180 and receives 180 row messages.
  const auto [src, dst] = all_to_all(4, 60);
  for (bool checksum : {false, true})
    for (std::int64_t cap : {64, 16, 4}) {  // 4: six pairs a rank do not fit a wave: lanes
      CAPTURE(checksum);
      CAPTURE(cap);
      const Result r = refit(src, dst, static_cast<std::size_t>(cap), options(cap, checksum));
      CHECK(r.errors == "");
      CHECK(r.wrong == 0);
      CHECK(r.most_plans == 1);  // no batch was split: every wave within the cap on every rank
      CHECK(r.waves >= 360 / cap);
    }
}

TEST_CASE("batch cap: packed messages over reused staging keep to the cap too") {
  // Rows cut on the source, columns on the destination: every piece is
  // packed by its sender, and a small budget cuts each pair's stream into
  // waves that reuse two staging slots (pipeline 2).
  std::vector<TensorSpec> s, d;
  for (int k = 0; k < 60; ++k) {
    s.push_back(tensor(fmt::format("w{}", k), {8, 64}, {cut(4), {}}));
    d.push_back(tensor(fmt::format("w{}", k), {8, 64}, {{}, cut(4)}));
  }
  const Layout src = one_axis("tp", 4, 0, std::move(s)), dst = one_axis("tp", 4, 0, std::move(d));
  for (bool checksum : {false, true})
    for (std::int64_t cap : {16, 4}) {
      CAPTURE(checksum);
      CAPTURE(cap);
      ExecutorOptions opt = options(cap, checksum);
      opt.staging_budget = 16 << 10;
      opt.pipeline = 2;
      const Result r = refit(src, dst, static_cast<std::size_t>(cap), opt);
      CHECK(r.errors == "");
      CHECK(r.wrong == 0);
      CHECK(r.most_plans == 1);
    }
}

TEST_CASE("batch cap: the transport's own bound is the default (max_batch_ops = -1)") {
  struct Capped : ForwardingTransport<queue_transport::QueueTransport*> {
    using ForwardingTransport::ForwardingTransport;
    std::int64_t max_batch_ops() const { return 32; }
  };
  static_assert(BoundedBatchTransport<Capped>);
  static_assert(!BoundedBatchTransport<queue_transport::QueueTransport>);
  const auto [src, dst] = all_to_all(3, 40);
  const auto ranks = refit_test::world_of(src, dst);
  queue_transport::QueueWorld world(ranks, queue_transport::Flaw::none, true, 32);
  const Schedule s = plan(src, dst);
  std::vector<refit_test::SideMemory> sm(ranks.size()), dm(ranks.size());
  std::mutex m;
  std::string errors;
  std::int64_t wrong = 0;
  std::vector<std::thread> threads;
  for (std::size_t i = 0; i < ranks.size(); ++i) {
    sm[i] = refit_test::make_side(src, ranks[i], true, 0);
    dm[i] = refit_test::make_side(dst, ranks[i], false, 0);
  }
  for (std::size_t i = 0; i < ranks.size(); ++i)
    threads.emplace_back([&, i] {
      queue_transport::QueueTransport inner(world, ranks[i]);
      Capped t(&inner);
      try {
        const auto sb = bind_buffers(src, ranks[i], refit_test::views(src, sm[i]), "source");
        const auto db = bind_buffers(dst, ranks[i], refit_test::views(dst, dm[i]), "destination");
        Executor<Capped> ex;
        ex.setup(s, refit_test::bound_pointers(sb), refit_test::bound_pointers(db), t, options(-1, false));
        ex.run();
        std::lock_guard lk(m);
        wrong += refit_test::count_wrong(dst, dm[i], ranks[i], 0, nullptr);
      } catch (const std::exception& e) {
        std::lock_guard lk(m);
        errors += e.what();
      }
    });
  for (auto& th : threads) th.join();
  CHECK(errors == "");
  CHECK(wrong == 0);
  CHECK(world.most_plans() == 1);
}

TEST_CASE("batch cap: unbounded, the NCCL-like plans disagree and the refit fails at its deadline, naming the pair") {
  // The control: the test transport does catch an oversized group. Each
  // rank's first plan holds only receives, so no send ever starts.
  const auto [src, dst] = all_to_all(2, 100);
  const Result r = refit(src, dst, 64, options(0, false, std::chrono::seconds(2)));
  CHECK(r.most_plans > 1);
  CHECK(r.seconds < 30);
  CHECK(r.errors.find("timed out") != std::string::npos);
  CHECK(r.errors.find("from rank 1") != std::string::npos);
  // Bounded, the same refit passes.
  const Result ok = refit(src, dst, 64, options(64, false));
  CHECK(ok.errors == "");
  CHECK(ok.wrong == 0);
}
