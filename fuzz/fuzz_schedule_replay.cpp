// libFuzzer target: schedule replay. The bytes draw a valid layout pair
// (fuzz_layouts.hpp) and executor settings (staging budget, zero-copy
// threshold, pipeline depth, copy threads, plan options); every rank of both
// meshes runs a Resharder over the in-process transport (one thread per
// rank), and every destination element is checked after each refit:
//   refit 1: memory laid out and checked with the oracle's slots
//            (tests/refit_util.hpp, its own arithmetic);
//   refit 2: the same buffers refilled with the library's tags
//            (reshard_support/verify.hpp fill_tags / check_tags), padding included.
// Each rank's report must also move exactly the bytes its plan says.
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

#include "fuzz_common.hpp"
#include "fuzz_layouts.hpp"
#include "refit_util.hpp"
#include "reshard/resharder.hpp"
#include "reshard/transport/local.hpp"
#include "reshard_support/verify.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace reshard;
  fuzzgen::Bytes in(data, size);
  // Up to 8 positions a side: every rank is a thread, and executor bugs do
  // not need big worlds, only many different ones.
  const auto pair = fuzzgen::layout_pair(in, 8);
  if (!pair) return -1;
  const Layout& src = pair->src;
  const Layout& dst = pair->dst;
  ResharderOptions opt;
  opt.executor.staging_budget = in.pick(std::vector<std::int64_t>{std::int64_t{256} << 20, 4096, 1024, 256, 65536});
  opt.executor.zero_copy_min = in.pick(std::vector<std::int64_t>{std::int64_t{64} << 10, 1, 16, 256});
  opt.executor.pipeline = in.chance(96) ? 1 : 2;
  // A hang is a finding, not a stuck fuzzer. Long runs that may be paused
  // (SIGSTOP while the machine is measured) set a longer deadline, with
  // libFuzzer's -timeout above it (fuzz/README.md).
  static const long timeout_s = [] {
    const char* e = std::getenv("RESHARD_FUZZ_REFIT_TIMEOUT_S");
    return e && std::atol(e) > 0 ? std::atol(e) : 60L;
  }();
  opt.executor.timeout = std::chrono::seconds(timeout_s);
  opt.plan.split_bytes = in.pick(std::vector<std::int64_t>{64 * 1024, 1, 64, 512});
  opt.plan.coalesce = !in.chance(48);
  // Mostly one full plan shared by all ranks (as one process of threads
  // would); now and then each rank plans its own share (only_rank).
  const bool own_plans = in.chance(32);
  if (!own_plans) {
    try {
      opt.schedule = std::make_shared<const Schedule>(plan(src, dst, opt.plan));
    } catch (const std::exception& e) {
      fuzzgen::finding(fmt::format("plan threw on a valid pair: {}\n{}", e.what(), pair->describe()));
    }
  }
  LocalWorldOptions wopt;
  wopt.copy_threads = static_cast<int>(in.between(1, 2));
  wopt.task_bytes = static_cast<std::size_t>(in.pick(std::vector<std::int64_t>{std::int64_t{2} << 20, 64, 1000}));
  // Last, so that earlier inputs keep their meaning: bucketing of in-place pieces.
  opt.executor.max_direct_messages = in.pick(std::vector<std::int64_t>{0, 1, 3, 0});
  const std::string what = fmt::format(
      "staging_budget {} zero_copy_min {} max_direct_messages {} pipeline {} split_bytes {} coalesce {} per-rank plans {} copy_threads {} "
      "task_bytes {}\n{}",
      opt.executor.staging_budget, opt.executor.zero_copy_min, opt.executor.max_direct_messages, opt.executor.pipeline,
      opt.plan.split_bytes, opt.plan.coalesce, own_plans, wopt.copy_threads, wopt.task_bytes, pair->describe());

  const auto ranks = refit_test::world_of(src, dst);
  const std::size_t n = ranks.size();
  std::vector<refit_test::SideMemory> smem(n), dmem(n);
  for (std::size_t i = 0; i < n; ++i) {
    smem[i] = refit_test::make_side(src, ranks[i], true, 0);
    dmem[i] = refit_test::make_side(dst, ranks[i], false, 0);
  }
  std::mutex m;
  std::vector<std::string> faults;
  auto fault = [&](std::string s) {
    std::lock_guard lk(m);
    faults.push_back(std::move(s));
  };
  try {
    LocalWorld world(ranks, wopt);
    world.run([&](LocalTransport& t) {
      const std::size_t i = refit_test::index_of(ranks, t.rank());
      LocalBuffers bufs{refit_test::views(src, smem[i]), refit_test::views(dst, dmem[i])};
      Resharder<Layout, LocalTransport> r(src, dst, bufs, t, opt);
      auto check_report = [&](const RefitReport& rep, int k) {
        if (rep.bytes_sent != rep.plan_bytes_sent || rep.bytes_received != rep.plan_bytes_received)
          fault(fmt::format("refit {} rank {}: sent {} received {} bytes, its plan says {} and {}", k, t.rank(), rep.bytes_sent,
                            rep.bytes_received, rep.plan_bytes_sent, rep.plan_bytes_received));
      };
      check_report(r.refit(), 1);
      std::string first;
      if (refit_test::count_wrong(dst, dmem[i], t.rank(), 0, &first) > 0) fault("refit 1 (oracle slots): " + first);
      // Refit 2: new values written by the library's tagger, checked by it.
      const std::uint64_t salt = 0x5eed;
      const auto spos = src.mesh.position_of(t.rank()), dpos = dst.mesh.position_of(t.rank());
      for (std::size_t b = 0; b < smem[i].data.size(); ++b)
        if (smem[i].present[b]) fill_tags(src, *spos, static_cast<int>(b), smem[i].data[b].data(), TagFill::source, salt);
      for (std::size_t b = 0; b < dmem[i].data.size(); ++b)
        if (dmem[i].present[b]) fill_tags(dst, *dpos, static_cast<int>(b), dmem[i].data[b].data(), TagFill::poison, salt);
      check_report(r.refit(), 2);
      for (std::size_t b = 0; b < dmem[i].data.size(); ++b) {
        if (!dmem[i].present[b]) continue;
        const auto c = check_tags(dst, *dpos, static_cast<int>(b), dmem[i].data[b].data(), salt);
        if (c.wrong > 0) fault(fmt::format("refit 2 (verify.hpp tags): {} of {} slots wrong, first: {}", c.wrong, c.checked, c.first_wrong));
      }
    });
  } catch (const Error& e) {
    // The one refusal a valid pair may meet: a staging budget too small for
    // this rank's peer pairs (the executor says so at setup).
    if (std::string(e.what()).find("too small for") != std::string::npos) return 0;
    fuzzgen::finding(fmt::format("the refit failed: {}\n{}", e.what(), what));
  } catch (const std::exception& e) {
    fuzzgen::finding(fmt::format("the refit threw a non-reshard exception: {}\n{}", e.what(), what));
  }
  if (!faults.empty()) fuzzgen::finding(fmt::format("{} (and {} more)\n{}", faults.front(), faults.size() - 1, what));
  return 0;
}
