// Integrity checks under injected faults (reshard_support/fault_injection.hpp over
// the in-process transport): every corruption (sent or arrived; zero-copy,
// half-staged, bucketed and control messages), drop, delay past the timeout
// and duplicate ends in RefitNotCommitted on every rank, naming the tensor
// and the peer, with the destination reported stale; a delay within the
// timeout still succeeds, and without checksums a corruption goes through
// (which shows the injection really changes what arrives).
#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <regex>
#include <string>
#include <string_view>

#include "refit_util.hpp"
#include "reshard/json_io.hpp"

using namespace reshard;
using namespace std::chrono_literals;

namespace {

using refit_test::message_kinds_dst;
using refit_test::message_kinds_src;

// Deadlines: short so a drop costs under a second, long enough that on a
// loaded 2-core machine only the injected fault times out (400 ms was not).
// The deadline of a refit that should succeed, or whose drop should be
// caught: long enough for a sanitizer build on a loaded 2-core machine (an
// 800 ms one once expired there before any message had arrived).
ResharderOptions options(bool checksum, std::chrono::milliseconds timeout = 3000ms) {
  ResharderOptions o;
  o.executor.checksum = checksum;
  o.executor.zero_copy_min = 1024;
  o.executor.timeout = timeout;
  return o;
}

enum class Victim { zero_copy, half_staged, bucket, control };
const char* name_of(Victim v) {
  return v == Victim::zero_copy ? "zero-copy b" : v == Victim::half_staged ? "half-staged w" : v == Victim::bucket ? "bucket e" : "control";
}
/// The tensor named in the error (control: every tensor of the pair).
const char* tensor_of(Victim v) { return v == Victim::zero_copy ? "b" : v == Victim::half_staged ? "w" : "e"; }
bool is(Victim v, const MessageInfo& m) {
  if (v == Victim::control) return (m.tag & kChecksumTagBit) != 0;
  if (m.tag & kChecksumTagBit) return false;
  return v == Victim::zero_copy ? m.bytes == 8192 : v == Victim::half_staged ? m.bytes == 2048 : m.bytes == 48 * 3 * 4 / 2 * 2 / 2;
}

/// The message from rank 1 to rank 3 of `victim`'s kind in refit `replay`.
FaultRule rule(FaultKind k, Victim v, std::int64_t replay) {
  return FaultRule::when(k, [v, replay](const MessageInfo& m) { return m.from == 1 && m.to == 3 && m.replay == replay && is(v, m); });
}

/// Runs `refits` refits of the message-kinds pair with one fault rule and
/// requires that the fault was injected, once.
refit_test::FaultyOutcome run_with_fault(FaultRule r, ResharderOptions opt, int refits, bool same_values = false) {
  FaultPlan plan;
  plan.add(std::move(r));
  auto o = refit_test::run_with_faults(message_kinds_src(), message_kinds_dst(), plan, opt, refits, same_values);
  REQUIRE(o.injected.size() == 1);
  return o;
}

bool has(const std::string& s, const std::string& what) { return s.find(what) != std::string::npos; }

/// The error names `tensor` as an entry of a tensor list, as the executor
/// writes them ("tensors a, b", "... by tag: 0x5 a, 0x6 b)", "the tensors a,
/// b it covers"): the whole name, not a substring of another word (", but").
bool names_tensor(const std::string& s, const std::string& tensor) {
  std::string escaped;
  for (char c : tensor) {
    if (std::string_view("\\^$.|?*+()[]{}").find(c) != std::string_view::npos) escaped += '\\';
    escaped += c;
  }
  return std::regex_search(s, std::regex("(tensors |, |0x[0-9a-f]+ )" + escaped + "(, |; |\\)| and | it covers|$)"));
}

/// Refit `k` failed on every rank, each error naming the tensor and rank 1
/// (the sender) or rank 3, every rank stale at version k.
void check_failed_everywhere(const refit_test::FaultyOutcome& o, std::size_t k, const std::string& tensor, bool rank2_may_see_it = false) {
  CHECK(o.committed(k) == 0);
  for (const auto& r : o.ranks) {
    CAPTURE(r.rank);
    REQUIRE(r.errors.size() == k + 1);
    const std::string& e = r.errors[k];
    INFO(e);
    CHECK(has(e, "not committed"));
    CHECK(has(e, "rank 1"));
    CHECK((has(e, "rank 3") || (rank2_may_see_it && has(e, "rank 2"))));
    CHECK(names_tensor(e, tensor));
    CHECK(r.state == RefitState::stale);
    CHECK(r.last_good == k);
    REQUIRE(r.failure.has_value());
    CHECK(r.failure->version == k + 1);
  }
}

}  // namespace

TEST_CASE("integrity: refits with checksums are exact, checked, and versioned") {
  const auto& L = message_kinds_src();
  CHECK(L.tensors.size() == 3);
  FaultPlan none;
  const auto o = refit_test::run_with_faults(message_kinds_src(), message_kinds_dst(), none, options(true), 3);
  for (const auto& r : o.ranks) {
    CAPTURE(r.rank);
    REQUIRE(r.errors.size() == 3);
    for (std::size_t k = 0; k < 3; ++k) {
      CHECK(r.errors[k].empty());
      CHECK(r.wrong[k] == 0);
      CHECK(r.reports[k].version == k + 1);
      CHECK(r.reports[k].checksummed_bytes > 0);
    }
    CHECK(r.state == RefitState::current);
    CHECK(r.last_good == 3);
  }
  CHECK(o.injected.empty());
}

TEST_CASE("integrity: every corruption is detected and named; no rank reports success") {
  for (FaultKind kind : {FaultKind::corrupt_arrived, FaultKind::corrupt_sent})
    for (Victim v : {Victim::zero_copy, Victim::half_staged, Victim::bucket, Victim::control}) {
      const std::string kind_name = to_string(kind), victim_name = name_of(v);
      CAPTURE(kind_name);
      CAPTURE(victim_name);
      const auto o = run_with_fault(rule(kind, v, 1), options(true), 3);
      CHECK(o.committed(0) == 4);  // the first refit was clean
      // b is replicated: rank 1 sends the same source range to ranks 2 and
      // 3, so a byte flipped in it while in flight may reach rank 2 as well.
      const bool shared_source = kind == FaultKind::corrupt_sent && v == Victim::zero_copy;
      check_failed_everywhere(o, 1, tensor_of(v), shared_source);
      const auto own = [&](std::int64_t r) { return has(o.at(r).errors[1], fmt::format("not committed: rank {}: refit version 2: ", r)); };
      const std::int64_t detector = shared_source && own(2) ? 2 : 3;
      CHECK(own(detector));
      const auto& victim = o.at(detector);
      INFO(victim.errors[1]);
      if (v == Victim::control) {
        CHECK(has(victim.errors[1], "control message from rank 1 (wave 0) is damaged"));
      } else {
        CHECK(has(victim.errors[1], "checksum mismatch in 1 message(s) from rank 1"));
        // From rank 1 only the corrupted message is missing (the others of
        // its group passed and landed); rank 0's may not have been checked yet.
        CHECK(std::count(victim.stale.begin(), victim.stale.end(), tensor_of(v)) == 1);
        const auto& miss = victim.failure->missing;
        const auto from1 = std::find_if(miss.begin(), miss.end(), [](const MissingPieces& m) { return m.peer == 1; });
        REQUIRE(from1 != miss.end());
        CHECK(from1->messages == 1);
        CHECK(from1->tensors == std::vector<std::string>{tensor_of(v)});
      }
      CHECK(o.seconds < 10);
    }
}

TEST_CASE("integrity: without checksums the same corruption goes through (the injection changes data)") {
  const auto o = run_with_fault(rule(FaultKind::corrupt_arrived, Victim::zero_copy, 0), options(false), 1);
  CHECK(o.committed(0) == 4);
  CHECK(o.at(3).wrong[0] == 1);  // one element of b is wrong on rank 3, undetected
  CHECK(o.at(2).wrong[0] == 0);
}

TEST_CASE("integrity: a dropped message fails the receiver at its deadline, naming peer and tensors") {
  for (Victim v : {Victim::zero_copy, Victim::half_staged, Victim::bucket, Victim::control})
    for (bool checksum : {true, false}) {
      if (v == Victim::control && !checksum) continue;
      const std::string victim_name = name_of(v);
      CAPTURE(victim_name);
      CAPTURE(checksum);
      const auto o = run_with_fault(rule(FaultKind::drop, v, 0), options(checksum), 1);
      check_failed_everywhere(o, 0, tensor_of(v));
      const auto& e = o.at(3).errors[0];
      INFO(e);
      CHECK(has(e, "timed out"));
      // (On a slow machine other peers' messages may be late too: they are
      // named as well, but rank 1's must be.)
      CHECK(has(e, "rank 3 was still waiting for wave 0: "));
      CHECK(has(e, "messages from rank 1 (tensors"));
      const auto& missing = o.at(3).failure->missing;
      CHECK(std::any_of(missing.begin(), missing.end(), [](const MissingPieces& m) { return m.peer == 1; }));
      CHECK(o.seconds < 10);
    }
}

TEST_CASE("integrity: a delay past the timeout fails like a drop; a delay within it succeeds") {
  {
    auto r = rule(FaultKind::delay, Victim::half_staged, 0);
    r.delay = 2000ms;
    const auto o = run_with_fault(r, options(true, 800ms), 1);
    check_failed_everywhere(o, 0, "w");
    CHECK(has(o.at(3).errors[0], "timed out"));
    CHECK(o.seconds < 5);
  }
  {
    auto r = rule(FaultKind::delay, Victim::half_staged, 0);
    r.delay = 150ms;
    const auto o = run_with_fault(r, options(true, 3000ms), 2);
    CHECK(o.committed(0) == 4);
    CHECK(o.committed(1) == 4);
    for (const auto& rr : o.ranks) CHECK(rr.wrong == std::vector<std::int64_t>{0, 0});
  }
}

TEST_CASE("integrity: a duplicated message is caught in the next refit") {
  SUBCASE("data, new weights: the stale copy fails its checksum") {
    for (Victim v : {Victim::zero_copy, Victim::half_staged, Victim::bucket}) {
      const std::string victim_name = name_of(v);
      CAPTURE(victim_name);
      const auto o = run_with_fault(rule(FaultKind::duplicate, v, 0), options(true), 3);
      CHECK(o.committed(0) == 4);
      check_failed_everywhere(o, 1, tensor_of(v));
      CHECK(has(o.at(3).errors[1], "checksum mismatch"));
    }
  }
  SUBCASE("control: the previous refit's version is refused") {
    const auto o = run_with_fault(rule(FaultKind::duplicate, Victim::control, 0), options(true), 3);
    CHECK(o.committed(0) == 4);
    check_failed_everywhere(o, 1, "b");
    CHECK(has(o.at(3).errors[1], "rank 1 sent wave 0 of refit version 1 while this rank refits version 2: a stale or duplicated message"));
  }
  SUBCASE("data, unchanged weights: the displaced original is never received, so the refit is not committed") {
    const auto o = run_with_fault(rule(FaultKind::duplicate, Victim::zero_copy, 0), options(true), 3, /*same_values=*/true);
    CHECK(o.committed(0) == 4);
    check_failed_everywhere(o, 1, "b");
    const auto& e = o.at(1).errors[1];
    INFO(e);
    CHECK(has(e, "rank 1 was still sending wave 0: "));
    CHECK(has(e, "sends to rank 3 (tensors b"));
    CHECK(o.seconds < 10);
  }
}
