// Versioned refits (resharder.hpp): versions counted or given by the caller,
// ranks that disagree on the version never commit, a failed refit leaves a
// single-buffered destination stale (with what is missing) until a refit
// over a fresh transport commits, and the double-buffered mode keeps serving
// the old version intact through a failed refit and publishes a new one only
// when complete.
#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <memory>
#include <string>

#include "error_of.hpp"
#include "refit_util.hpp"
#include "reshard/commit.hpp"
#include "reshard/json_io.hpp"

using namespace reshard;
using namespace std::chrono_literals;
using refit_test::SideMemory;

namespace {

using refit_test::message_kinds_dst;
using refit_test::message_kinds_src;

using FT = FaultInjectingTransport<LocalTransport>;
using R = Resharder<Layout, FT>;

/// Ranks whose Resharders (and memory) outlive the worlds they refit over,
/// so that a failed refit can be followed by setup() on a fresh transport.
/// Each run destroys the previous world and its transports first: the
/// Resharders' registrations on them must not be touched any more
/// (RegisteredRegion over a transport with lifetime()).
struct Job {
  std::vector<std::int64_t> ranks = refit_test::world_of(message_kinds_src(), message_kinds_dst());
  std::vector<SideMemory> src, dst, back;
  std::vector<std::unique_ptr<R>> rs;
  // One world at a time, destroyed before the next (transports before their world);
  // the Resharders (rs, declared first) outlive the last one.
  std::unique_ptr<LocalWorld> world;
  std::vector<LocalTransport> endpoints;
  std::vector<std::unique_ptr<FT>> transports;
  ResharderOptions opt;

  explicit Job(ResharderOptions o) : opt(std::move(o)) {
    for (auto r : ranks) {
      src.push_back(refit_test::make_side(message_kinds_src(), r, true, 0));
      dst.push_back(refit_test::make_side(message_kinds_dst(), r, false, 0));
      back.push_back(refit_test::make_side(message_kinds_dst(), r, false, 0));
    }
    rs.resize(ranks.size());
  }
  LocalBuffers buffers(std::size_t i) {
    LocalBuffers b;
    b.src = refit_test::views(message_kinds_src(), src[i]);
    b.dst = refit_test::views(message_kinds_dst(), dst[i]);
    if (opt.double_buffered) b.dst_back = refit_test::views(message_kinds_dst(), back[i]);
    return b;
  }
  /// A fresh world (with `plan`) on which every rank sets up (again) and runs f.
  void run(FaultPlan& plan, const std::function<void(std::size_t, R&)>& f) {
    transports.clear();
    endpoints.clear();
    world = std::make_unique<LocalWorld>(ranks);
    LocalWorld& w = *world;
    for (auto r : ranks) endpoints.push_back(w.endpoint(r));
    for (auto& e : endpoints) transports.push_back(std::make_unique<FT>(e, plan));
    w.run([&](LocalTransport& t) {
      const std::size_t i = refit_test::index_of(ranks, t.rank());
      FT& ft = *transports[i];
      if (!rs[i])
        rs[i] = std::make_unique<R>(message_kinds_src(), message_kinds_dst(), buffers(i), ft, opt);
      else
        rs[i]->setup(buffers(i), ft);
      f(i, *rs[i]);
    });
  }
};

using test_util::error_of;
bool has(const std::string& s, const std::string& what) { return s.find(what) != std::string::npos; }

ResharderOptions options(bool checksum, bool double_buffered = false) {
  ResharderOptions o;
  o.executor.checksum = checksum;
  o.executor.zero_copy_min = 1024;
  o.executor.timeout = 3000ms;  // refits here must commit, also under a sanitizer on a loaded machine
  o.double_buffered = double_buffered;
  return o;
}

/// Rank 1's zero-copy message of b to rank 3, the `replay`-th time it is
/// posted on `channel` (a double-buffered Resharder's back set uses 0x8000).
FaultRule corrupt_b_to_3(std::int64_t replay, std::uint64_t channel = 0) {
  return FaultRule::when(FaultKind::corrupt_arrived, [replay, channel](const MessageInfo& m) {
    return m.from == 1 && m.to == 3 && m.replay == replay && m.bytes == 8192 && !(m.tag & kChecksumTagBit) && (m.tag >> 48) == channel;
  });
}

}  // namespace

TEST_CASE("versions: counted by default, given by the caller, never going back") {
  for (bool checksum : {false, true}) {
    CAPTURE(checksum);
    Job job(options(checksum));
    FaultPlan none;
    std::mutex m;
    std::vector<std::string> refused(job.ranks.size());
    job.run(none, [&](std::size_t i, R& r) {
      CHECK(r.state() == RefitState::empty);
      CHECK(r.last_good_version() == 0);
      CHECK(r.refit().version == 1);
      CHECK(r.refit(10).version == 10);
      CHECK(r.refit().version == 11);
      CHECK(r.state() == RefitState::current);
      CHECK(r.last_good_version() == 11);
      CHECK(refit_test::count_wrong(message_kinds_dst(), job.dst[i], job.ranks[i], 0, nullptr) == 0);
      const auto e = error_of([&] { r.refit(11); });
      std::lock_guard lk(m);
      refused[i] = e;
    });
    for (const auto& e : refused) CHECK(has(e, "version 11 is not above version 11"));
  }
}

TEST_CASE("versions: ranks refitting different versions do not commit, and name the odd one") {
  for (bool checksum : {false, true}) {
    CAPTURE(checksum);
    Job job(options(checksum));
    FaultPlan none;
    std::mutex m;
    std::vector<std::string> errors(job.ranks.size());
    job.run(none, [&](std::size_t i, R& r) {
      r.refit();
      const auto e = error_of([&] { r.refit(job.ranks[i] == 3 ? 7 : 6); });
      std::lock_guard lk(m);
      errors[i] = e;
      CHECK(r.state() == RefitState::stale);
      CHECK(r.last_good_version() == 1);
    });
    for (std::size_t i = 0; i < errors.size(); ++i) {
      CAPTURE(errors[i]);
      CHECK(has(errors[i], "not committed: "));
      // Without checksums the verdicts show it; with them rank 3 sees
      // version 6 arrive in its version 7 refit and aborts everyone.
      if (checksum)
        CHECK(has(errors[i], "sent wave 0 of refit version 6 while this rank refits version 7: a stale or duplicated message"));
      else if (job.ranks[i] == 3)
        CHECK(has(errors[i], "refit version 6, this rank version 7"));
      else
        CHECK(has(errors[i], "rank 3 refit version 7, this rank version 6"));
    }
  }
}

TEST_CASE("stale: a failed refit leaves the destination stale with what is missing, until a refit commits") {
  Job job(options(true));
  FaultPlan plan;
  plan.add(corrupt_b_to_3(1));
  std::mutex m;
  job.run(plan, [&](std::size_t i, R& r) {
    const auto rank = job.ranks[i];
    r.refit();  // version 1, clean
    refit_test::write_side(message_kinds_src(), job.src[i], true, 2);
    const auto e = error_of([&] { r.refit(); });
    std::lock_guard lk(m);
    CAPTURE(rank);
    CAPTURE(e);
    CHECK(has(e, "refit version 2 not committed: "));
    CHECK(r.state() == RefitState::stale);
    CHECK(r.last_good_version() == 1);
    CHECK(r.last_attempted_version() == 2);
    REQUIRE(r.last_failure().has_value());
    CHECK(r.last_failure()->version == 2);
    CHECK(r.last_failure()->destination_touched);
    // What the failure says each destination buffer holds is what it holds.
    CHECK(refit_test::check_writes(message_kinds_dst(), job.dst[i], r.last_failure()->writes, 2, 0) == "");  // (version 1 sent salt 0)
    if (rank == 3) CHECK_FALSE(r.last_failure()->writes.partial.empty());  // the corrupted message's buffer
    if (rank == 3) {
      CHECK(has(e, "checksum mismatch in 1 message(s) from rank 1"));
      const auto stale = r.stale_tensors();
      CHECK(std::count(stale.begin(), stale.end(), std::string("b")) == 1);
      CHECK(refit_test::count_wrong(message_kinds_dst(), job.dst[i], rank, 2, nullptr) > 0);  // it really is not version 2
    }
    // Refused until set up again.
    CHECK(has(error_of([&] { r.refit(); }), "an earlier run failed (refit version 2 was not committed)"));
  });
  // A fresh transport, the same Resharders: setup() again, then version 3 commits.
  FaultPlan none;
  job.run(none, [&](std::size_t i, R& r) {
    CHECK(r.state() == RefitState::stale);  // setup alone does not make it current
    refit_test::write_side(message_kinds_src(), job.src[i], true, 3);
    const auto rep = r.refit();
    CHECK(rep.version == 3);
    CHECK(r.state() == RefitState::current);
    CHECK(r.last_good_version() == 3);
    CHECK_FALSE(r.last_failure().has_value());
    CHECK(r.stale_tensors().empty());
    CHECK(refit_test::count_wrong(message_kinds_dst(), job.dst[i], job.ranks[i], 3, nullptr) == 0);
  });
}

TEST_CASE("double-buffered: the served set stays intact and current through a failed refit; a new version is published whole") {
  for (bool checksum : {true, false}) {
    CAPTURE(checksum);
    Job job(options(checksum, /*double_buffered=*/true));
    FaultPlan plan;
    // Refit 3 (the back set's second) fails: with checksums a corrupted
    // message, without them a dropped one.
    if (checksum)
      plan.add(corrupt_b_to_3(1, 0x8000));
    else
      plan.add(FaultRule::when(FaultKind::drop, [](const MessageInfo& m) {
        return m.from == 1 && m.to == 3 && m.replay == 1 && (m.tag >> 48) == 0x8000;
      }));
    std::mutex m;
    job.run(plan, [&](std::size_t i, R& r) {
      const auto rank = job.ranks[i];
      const bool dst_rank = rank >= 2;
      auto wrong = [&](SideMemory& mem, std::uint64_t salt) { return refit_test::count_wrong(message_kinds_dst(), mem, rank, salt, nullptr); };
      // serving_buffers() points into `mem` (destination ranks have buffers).
      auto serving_is = [&](SideMemory& mem) {
        const auto& sv = r.serving_buffers();
        if (!dst_rank) return sv.empty();
        return !sv.empty() && std::all_of(sv.begin(), sv.end(), [&](const auto& kv) {
          return std::any_of(mem.data.begin(), mem.data.end(), [&](auto& d) { return kv.second.data == static_cast<void*>(d.data()); });
        });
      };
      const auto untouched = job.dst[i].data;  // set 0 before any refit
      CHECK(r.serving_set() == 0);
      refit_test::write_side(message_kinds_src(), job.src[i], true, 1);
      auto rep = r.refit();
      CHECK(rep.version == 1);
      CHECK(rep.serving_set == 1);
      CHECK(r.serving_set() == 1);
      CHECK(serving_is(job.back[i]));
      CHECK(wrong(job.back[i], 1) == 0);
      CHECK(job.dst[i].data == untouched);  // version 1 went to the back set only

      refit_test::write_side(message_kinds_src(), job.src[i], true, 2);
      rep = r.refit();
      CHECK(rep.serving_set == 0);
      CHECK(serving_is(job.dst[i]));
      CHECK(wrong(job.dst[i], 2) == 0);
      CHECK(wrong(job.back[i], 1) == 0);  // the previous set is left as it was
      const auto v2 = job.dst[i].data;

      refit_test::write_side(message_kinds_src(), job.src[i], true, 3);
      const auto e = error_of([&] { r.refit(); });
      std::lock_guard lk(m);
      CAPTURE(rank);
      CAPTURE(e);
      CHECK(has(e, "refit version 3 not committed; the served destination keeps version 2"));
      CHECK(r.state() == RefitState::current);
      CHECK(r.last_good_version() == 2);
      CHECK(r.serving_set() == 0);
      CHECK(job.dst[i].data == v2);  // byte for byte
      CHECK(wrong(job.dst[i], 2) == 0);
      REQUIRE(r.last_failure().has_value());
      CHECK(r.last_failure()->version == 3);
      CHECK_FALSE(r.last_failure()->destination_touched);
      CHECK(r.stale_tensors().empty());
    });
    FaultPlan none;
    job.run(none, [&](std::size_t i, R& r) {
      refit_test::write_side(message_kinds_src(), job.src[i], true, 4);
      const auto rep = r.refit();
      CHECK(rep.version == 4);
      CHECK(r.serving_set() == 1);
      CHECK(refit_test::count_wrong(message_kinds_dst(), job.back[i], job.ranks[i], 4, nullptr) == 0);
      CHECK(refit_test::count_wrong(message_kinds_dst(), job.dst[i], job.ranks[i], 2, nullptr) == 0);
    });
  }
}

TEST_CASE("double-buffered: the two sets share the staging budget; misuse is named") {
  // Checksums off: their control messages live in memory of their own
  // (not staging), which the transport's registrations would count too.
  ResharderOptions o = options(false, true);
  o.executor.staging_budget = 4096;
  o.executor.zero_copy_min = 1 << 30;  // everything staged
  Job job(o);
  FaultPlan none;
  std::mutex m;
  job.run(none, [&](std::size_t i, R& r) {
    r.refit();  // writes the back set
    r.refit();
    // Both sets' staging as the transport saw it registered, beyond the buffers.
    const std::int64_t staged = refit_test::registered_outside(job.endpoints[i], {&job.src[i], &job.dst[i], &job.back[i]});
    std::lock_guard lk(m);
    CHECK(staged > 0);
    CHECK(staged <= 4096);
    CHECK(refit_test::count_wrong(message_kinds_dst(), job.dst[i], job.ranks[i], 0, nullptr) == 0);
  });

  // dst_back without the mode, and the mode without dst_back.
  const auto ranks = refit_test::world_of(message_kinds_src(), message_kinds_dst());
  std::vector<std::string> errors(ranks.size()), errors2(ranks.size());
  LocalWorld w(ranks), w2(ranks);
  std::vector<SideMemory> s, d;
  for (auto r : ranks) {
    s.push_back(refit_test::make_side(message_kinds_src(), r, true, 0));
    d.push_back(refit_test::make_side(message_kinds_dst(), r, false, 0));
  }
  auto attempt = [&](LocalWorld& world, bool mode, bool give_back, std::vector<std::string>& out) {
    error_of([&] {
      world.run([&](LocalTransport& t) {
        const std::size_t i = refit_test::index_of(ranks, t.rank());
        LocalBuffers b;
        b.src = refit_test::views(message_kinds_src(), s[i]);
        b.dst = refit_test::views(message_kinds_dst(), d[i]);
        if (give_back) b.dst_back = b.dst;
        ResharderOptions ro = options(false, mode);
        const auto e = error_of([&] { Resharder<Layout, LocalTransport> r(message_kinds_src(), message_kinds_dst(), b, t, ro); });
        std::lock_guard lk(m);
        out[i] = e;
      });
    });
  };
  attempt(w, false, true, errors);
  attempt(w2, true, false, errors2);
  CHECK(has(errors[3], "back destination buffers (dst_back) were given but ResharderOptions::double_buffered is off"));
  CHECK(has(errors2[3], "back destination (dst_back) buffer"));
  CHECK(has(errors2[3], "is missing"));
}
