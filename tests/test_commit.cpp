// agree_refit (commit.hpp) and Resharder::refit() on the in-process transport:
// a refit counts only when every rank's succeeded.
#include <mutex>

#include <doctest/doctest.h>

#include "refit_util.hpp"
#include "reshard/commit.hpp"
#include "reshard/json_io.hpp"
#include "reshard/transport/local.hpp"

using namespace reshard;

TEST_CASE("commit: one rank's failure makes every rank's refit not committed, naming it") {
  LocalWorld world({0, 1, 2, 3});
  std::mutex m;
  std::vector<std::string> seen(4);
  world.run([&](LocalTransport& t) {
    try {
      agree_refit(t, t.rank() == 2 ? "rank 2 refit failed: disk on fire" : "", Clock::now() + std::chrono::seconds(10));
    } catch (const RefitNotCommitted& e) {
      std::lock_guard lk(m);
      seen[static_cast<std::size_t>(t.rank())] = e.what();
    }
  });
  for (const auto& s : seen) {
    CHECK(s.find("refit not committed: rank 2 failed: rank 2 refit failed: disk on fire") != std::string::npos);
  }
  // All succeed: nobody throws.
  LocalWorld ok({0, 1});
  CHECK_NOTHROW(ok.run([&](LocalTransport& t) { agree_refit(t, "", Clock::now() + std::chrono::seconds(10)); }));
}

TEST_CASE("commit: refit() returns the report of a refit every rank completed") {
  const auto src = parse_layout(nlohmann::json::parse(R"({"mesh": {"axes": [["tp", 2]]},
    "tensors": [{"name": "w", "shape": [64, 8], "dtype": "f32", "dims": ["tp", null]}]})"), "src");
  const auto dst = parse_layout(nlohmann::json::parse(R"({"mesh": {"axes": [["tp", 2]], "first_rank": 2},
    "tensors": [{"name": "w", "shape": [64, 8], "dtype": "f32", "dims": [null, "tp"]}]})"), "dst");
  LocalWorld world({0, 1, 2, 3});
  std::mutex m;
  std::int64_t wrong = 0, received = 0;
  world.run([&](LocalTransport& t) {
    auto sm = refit_test::make_side(src, t.rank(), true, 0);
    auto dm = refit_test::make_side(dst, t.rank(), false, 0);
    LocalBuffers bufs{refit_test::views(src, sm), refit_test::views(dst, dm)};
    Resharder<Layout, LocalTransport> r(src, dst, bufs, t);
    const RefitReport rep = r.refit();
    std::lock_guard lk(m);
    wrong += refit_test::count_wrong(dst, dm, t.rank(), 0, nullptr);
    received += rep.bytes_received;
  });
  CHECK(wrong == 0);
  CHECK(received == 64 * 8 * 4);
}
