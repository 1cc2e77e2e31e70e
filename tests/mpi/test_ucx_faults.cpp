// Injected faults over the UCX transport (FaultInjectingTransport<UcxTransport>,
// forked ranks as in test_ucx_fork, no mpirun): with checksums, a byte
// flipped on arrival (tag and put protocols) and a dropped message both end
// in RefitNotCommitted on every rank, naming the tensor and the peer; the
// refit before the fault is exact.
#include <chrono>
#include <string>

#include <doctest/doctest.h>

#include "fork_world.hpp"
#include "refit_util.hpp"
#include "reshard_support/fault_injection.hpp"
#include "reshard/json_io.hpp"
#include "reshard/transport/ucx.hpp"

using namespace reshard;
using namespace std::chrono_literals;

namespace {

// Sources 0-1, destinations 2-3: b replicated (one zero-copy message per
// pair), w rows -> columns (half-staged).
const char* kSrc = R"({"mesh": {"axes": [["tp", 2]]}, "tensors": [
    {"name": "b", "shape": [4096], "dtype": "f32", "dims": ["tp"]},
    {"name": "w", "shape": [64, 32], "dtype": "f32", "dims": ["tp", null]}]})";
const char* kDst = R"({"mesh": {"axes": [["tp", 2]], "first_rank": 2}, "tensors": [
    {"name": "b", "shape": [4096], "dtype": "f32", "dims": [null]},
    {"name": "w", "shape": [64, 32], "dtype": "f32", "dims": [null, "tp"]}]})";

/// Each rank reports "ok" per refit that committed, else "failed: <error>".
std::vector<fork_world::Outcome> faulty(FaultKind kind, UcxProtocol proto) {
  const Layout src = parse_layout(nlohmann::json::parse(kSrc), "src"), dst = parse_layout(nlohmann::json::parse(kDst), "dst");
  return fork_world::run(4, [&](int r, Bootstrap& boot, const auto& report) {
    UcxOptions uo;
    uo.protocol = proto;
    UcxTransport inner(std::move(boot), uo);
    FaultPlan plan;  // per process; only rank 1 (sender) or 3 (receiver) acts on it
    plan.add(FaultRule::when(kind, [](const MessageInfo& m) {
      return m.from == 1 && m.to == 3 && m.replay == 1 && m.bytes == 8192 && !(m.tag & kChecksumTagBit);
    }));
    FaultInjectingTransport<UcxTransport> t(inner, plan);
    auto sm = refit_test::make_side(src, r, true, 0);
    auto dm = refit_test::make_side(dst, r, false, 0);
    LocalBuffers bufs{refit_test::views(src, sm), refit_test::views(dst, dm)};
    ResharderOptions ro;
    ro.executor.checksum = true;
    ro.executor.zero_copy_min = 1024;
    ro.executor.timeout = 2s;
    Resharder<Layout, FaultInjectingTransport<UcxTransport>> rs(src, dst, bufs, t, ro);
    for (std::uint64_t k = 0; k < 2; ++k) {
      refit_test::write_side(src, sm, true, k);
      refit_test::write_side(dst, dm, false, k);
      try {
        rs.refit();
        report(refit_test::count_wrong(dst, dm, r, k, nullptr) == 0 ? "ok" : "wrong");
      } catch (const RefitNotCommitted& e) {
        report(fmt::format("failed: {} [state {}]", e.what(), to_string(rs.state())));
        break;
      }
    }
    return 0;
  });
}

void check(const std::vector<fork_world::Outcome>& outs, const char* what) {
  MESSAGE(fork_world::describe(outs));
  INFO(fork_world::describe(outs));
  REQUIRE(outs.size() == 4);
  for (const auto& o : outs) {
    CAPTURE(o.rank);
    CHECK_FALSE(o.hung);
    CHECK(o.exited);
    CHECK(o.code == 0);
    REQUIRE(o.report.rfind("ok\nfailed: ", 0) == 0);  // the first refit committed, the second on no rank
    CHECK(o.report.find("not committed: ") != std::string::npos);
    CHECK(o.report.find("rank 1") != std::string::npos);
    CHECK(o.report.find("tensors b") != std::string::npos);
    CHECK(o.report.find("[state stale]") != std::string::npos);
    if (o.rank == 3) CHECK(o.report.find(what) != std::string::npos);
    CHECK(o.seconds < 20);
  }
}

}  // namespace

TEST_CASE("ucx faults: a byte flipped on arrival is caught by the checksum on every protocol") {
  check(faulty(FaultKind::corrupt_arrived, UcxProtocol::tag), "checksum mismatch in 1 message(s) from rank 1");
  check(faulty(FaultKind::corrupt_arrived, UcxProtocol::put), "checksum mismatch in 1 message(s) from rank 1");
}

TEST_CASE("ucx faults: a dropped message fails the receiver at its deadline, naming the peer and tensor") {
  check(faulty(FaultKind::drop, UcxProtocol::tag), "rank 3 was still waiting for wave 0: messages from rank 1 (tensors b");
}
