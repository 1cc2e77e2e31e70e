// A peer that dies in the middle of a refit, on the in-process transports
// (LocalTransport, and FaultInjectingTransport over it), with the default
// refit timeout (300 s): every surviving rank's refit() fails well within
// 30 s, names the dead rank, and reports what each destination holds.
//
// A rank thread cannot be killed; it dies the way a thread can: it stops in
// the middle (right after posting its first send) and its function throws,
// and nothing it owns tells anybody (its transport's abort() is dead too, so
// the executor's and the Resharder's own abort calls reach no one). What
// tells the survivors is LocalWorld::run noticing the thread's end. Or the
// thread simply returns instead of joining the refit: the survivors' waits
// for it (and all_gathers it did not join) fail at once.
#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <mutex>
#include <string>
#include <vector>

#include "refit_util.hpp"
#include "reshard/resharder.hpp"
#include "reshard_support/fault_injection.hpp"

using namespace reshard;

namespace {

using refit_test::cut;
using refit_test::one_axis;
using refit_test::tensor;

/// The rank's death: thrown out of the dead rank's calls.
struct Died : TransportError {
  using TransportError::TransportError;
};

/// Once armed, the rank dies right after its first post() holding a send:
/// from then on every call throws and abort() reaches nobody.
template <class Inner>
class DiesAfterFirstSend : public ForwardingTransport<Inner*> {
  using Base = ForwardingTransport<Inner*>;

 public:
  using request = typename Base::request;
  explicit DiesAfterFirstSend(Inner& in) : Base(&in) {}
  void arm() { armed_ = true; }

  request post(std::span<const TransferOp> ops) {
    dead_check();
    request r = this->inner().post(ops);
    if (armed_ && std::any_of(ops.begin(), ops.end(), [](const TransferOp& op) { return op.kind == OpKind::send; })) {
      dead_ = true;
      dead_check();
    }
    return r;
  }
  std::vector<std::vector<std::byte>> all_gather(std::span<const std::byte> b, Deadline d) {
    dead_check();
    return Base::all_gather(b, d);
  }
  void flush(Deadline d) {
    dead_check();
    Base::flush(d);
  }
  bool test(request& r) {
    dead_check();
    return Base::test(r);
  }
  void wait(request& r, Deadline d) {
    dead_check();
    Base::wait(r, d);
  }
  std::size_t wait_any(std::span<request* const> rs, Deadline d) {
    dead_check();
    return Base::wait_any(rs, d);
  }
  void abort(std::string_view why) noexcept {
    if (!dead_) Base::abort(why);
  }

 private:
  void dead_check() const {
    if (dead_) throw Died(fmt::format("rank {} died in the middle of its refit", this->rank()));
  }
  bool armed_ = false, dead_ = false;
};

struct Survivor {
  std::int64_t rank = -1;
  double seconds = -1;
  std::string error;  ///< empty: its refit succeeded
};

/// Sources 0-1, destinations 2-3, every destination fed by both sources;
/// one good refit, then rank 1 dies in the second. `Wrap` makes the rank's
/// transport from its LocalTransport (the inner one of the decorator).
template <class Wrap>
std::vector<Survivor> refit_with_a_death(Wrap wrap, bool leaves = false) {
  const Layout src = one_axis("tp", 2, 0, {tensor("w", {64, 48}, {cut(2), {}}), tensor("b", {96}, {cut(2)})});
  const Layout dst = one_axis("tp", 2, 2, {tensor("w", {64, 48}, {{}, cut(2)}), tensor("b", {96}, {{}})});
  refit_test::DenseWorld w(src, dst);
  std::vector<Survivor> out;
  std::mutex m;
  LocalWorld world(w.ranks);
  std::string dead_error;
  try {
    world.run([&](LocalTransport& local) {
      const std::size_t i = refit_test::index_of(w.ranks, local.rank());
      wrap(local, [&](auto& t) {
        LocalBuffers bufs{refit_test::views(src, w.src_mem[i]), refit_test::views(dst, w.dst_mem[i])};
        Resharder<Layout, std::remove_reference_t<decltype(t)>> rs(src, dst, bufs, t);  // default options: 300 s timeout
        CHECK(ExecutorOptions{}.timeout == std::chrono::seconds(300));
        rs.refit();
        if (local.rank() == 1 && leaves) return;  // its thread just ends, refit 2 never comes
        if (local.rank() == 1) t.arm();
        const auto t0 = Clock::now();
        Survivor s{local.rank(), -1, ""};
        try {
          rs.refit();
        } catch (const RefitNotCommitted& e) {
          if (local.rank() == 1) throw;  // the dead rank's thread ends here
          s.error = e.what();
        }
        s.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
        std::lock_guard lk(m);
        out.push_back(s);
      });
    });
  } catch (const std::exception& e) {
    dead_error = e.what();
  }
  if (!leaves) CHECK(dead_error.find("rank 1 died") != std::string::npos);
  return out;
}

void check_survivors(const std::vector<Survivor>& out) {
  REQUIRE(out.size() == 3);
  for (const auto& s : out) {
    CAPTURE(s.rank);
    CAPTURE(s.error);
    MESSAGE("rank " << s.rank << " failed after " << s.seconds << " s");
    CHECK(s.rank != 1);
    CHECK(s.seconds < 30);
    CHECK(s.error.find("not committed") != std::string::npos);
    CHECK(s.error.find("rank 1 ") != std::string::npos);  // names the dead rank
  }
}

}  // namespace

TEST_CASE("killed peer, local transport: every survivor fails within 30 s, naming it") {
  check_survivors(refit_with_a_death([](LocalTransport& local, auto&& body) {
    DiesAfterFirstSend<LocalTransport> t(local);
    body(t);
  }));
}

TEST_CASE("killed peer, fault-injecting transport over local: every survivor fails within 30 s, naming it") {
  FaultPlan plan;  // a delay of the dead rank's peers' messages as well: nothing may hold the failure up
  FaultRule late = FaultRule::when(FaultKind::delay, [](const MessageInfo& m) { return m.from == 0 && m.replay == 1; });
  late.delay = std::chrono::milliseconds(200);
  plan.add(late);
  check_survivors(refit_with_a_death([&](LocalTransport& local, auto&& body) {
    FaultInjectingTransport<LocalTransport> f(local, plan);
    DiesAfterFirstSend<FaultInjectingTransport<LocalTransport>> t(f);
    body(t);
  }));
}

TEST_CASE("a rank thread that returns instead of refitting: every survivor fails within 30 s, naming it") {
  check_survivors(refit_with_a_death(
      [](LocalTransport& local, auto&& body) {
        DiesAfterFirstSend<LocalTransport> t(local);
        body(t);
      },
      true));
}
