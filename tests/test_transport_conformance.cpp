// The transport conformance suite (transport_conformance.hpp) on the
// in-process backends: LocalTransport, FaultInjectingTransport over it with
// an empty plan (the decorator must not change what the contract says), and
// QueueTransport, a backend written from transport.hpp's contract alone.
// Then each case once more on a QueueTransport with one planted flaw, where
// it must fail: a suite that cannot go red checks nothing.
#include <doctest/doctest.h>

#include <exception>
#include <mutex>
#include <thread>

#include "queue_transport.hpp"
#include "reshard_support/fault_injection.hpp"
#include "reshard/transport/local.hpp"
#include "transport_conformance.hpp"

using namespace reshard;
using queue_transport::Flaw;

namespace {

/// Ranks out of order and not 0..n-1: cases must go by world_ranks().
std::vector<std::int64_t> world_of(int n) {
  const std::int64_t pool[] = {5, 2, 9, 0};
  return std::vector<std::int64_t>(pool, pool + n);
}

struct LocalHarness {
  template <class Case>
  void run(const Case& c) {
    LocalWorld world(world_of(Case::ranks));
    world.run([&](LocalTransport& t) { c(t); });
  }
};

struct FaultInjectingHarness {
  template <class Case>
  void run(const Case& c) {
    LocalWorld world(world_of(Case::ranks));
    FaultPlan plan;  // empty: the decorator only passes through
    world.run([&](LocalTransport& inner) {
      FaultInjectingTransport<LocalTransport> t(inner, plan);
      c(t);
    });
    if (plan.injected_count() != 0) throw std::runtime_error("an empty fault plan injected faults");
  }
};

/// One thread per rank over a QueueWorld; a failing rank aborts the others.
struct QueueHarness {
  Flaw flaw = Flaw::none;
  bool batches = false;
  template <class Case>
  void run(const Case& c) {
    queue_transport::QueueWorld world(world_of(Case::ranks), flaw, batches);
    std::mutex m;
    std::string errors;
    std::vector<std::thread> threads;
    for (auto rank : world.ranks())
      threads.emplace_back([&, rank] {
        queue_transport::QueueTransport t(world, rank);
        try {
          c(t);
        } catch (const std::exception& e) {
          {
            std::lock_guard lk(m);
            errors += fmt::format("rank {}: {}\n", rank, e.what());
          }
          t.abort(e.what());
        }
      });
    for (auto& th : threads) th.join();
    if (!errors.empty()) throw std::runtime_error(errors);
  }
};

/// QueueTransport as a batching transport (NCCL-like: a batch blocks its
/// rank's stream until every op of it matched).
struct BatchQueueHarness : QueueHarness {
  BatchQueueHarness() { batches = true; }
};

}  // namespace

TYPE_TO_STRING(BatchQueueHarness);
TYPE_TO_STRING(LocalHarness);
TYPE_TO_STRING(FaultInjectingHarness);
TYPE_TO_STRING(QueueHarness);

RESHARD_TRANSPORT_CONFORMANCE(LocalHarness, FaultInjectingHarness, QueueHarness, BatchQueueHarness);

TEST_CASE("transport conformance: every case fails on a transport that breaks its rule") {
  auto red = [](Flaw f, const auto& c, const std::string& flaw, bool batches = false) {
    CAPTURE(flaw);
    QueueHarness h{f, batches};
    std::string why;
    try {
      h.run(c);
    } catch (const std::exception& e) {
      why = e.what();
    }
    CHECK_MESSAGE(!why.empty(), (std::string(c.name) + ": passed on a transport with the flaw " + flaw));
    MESSAGE((flaw + " -> " + why.substr(0, why.find('\n'))));
  };
  red(Flaw::tag_32_bits, conformance::Matching{}, "tag_32_bits");
  red(Flaw::lifo, conformance::EqualKeysInOrder{}, "lifo");
  red(Flaw::silent_size, conformance::SizeMismatch{}, "silent_size");
  red(Flaw::late_deadline, conformance::Deadlines{}, "late_deadline");
  red(Flaw::blocking_test, conformance::Deadlines{}, "blocking_test");
  red(Flaw::deaf_abort, conformance::AbortReachesPeers{}, "deaf_abort");
  red(Flaw::stale_replay, conformance::Replays{}, "stale_replay");
  red(Flaw::wrong_any, conformance::WaitAny{}, "wrong_any");
  red(Flaw::reversed_gather, conformance::AllGatherOrder{}, "reversed_gather");
  red(Flaw::deaf_deregister, conformance::DeregisterEndsAccess{}, "deaf_deregister");
  conformance::Batches impatient;
  impatient.patience = std::chrono::milliseconds(2000);  // it deadlocks: fail at this deadline
  red(Flaw::post_is_batch, impatient, "post_is_batch", true);
}
