// RegisteredRegion and transport lifetimes (transport.hpp): a registration
// is deregistered exactly once (reset, assignment over it, destruction; a
// move hands it over), and over a transport that has lifetime() it never
// calls a transport that is gone. Then the same through a Resharder that
// outlives the world and transports it was set up on: it sets up again on a
// fresh world, refits correctly, and is destroyed last, without one call
// into a destroyed transport.
#include <doctest/doctest.h>

#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "refit_util.hpp"
#include "reshard/resharder.hpp"
#include "reshard/transport/local.hpp"

using namespace reshard;

namespace {

/// What the fake transports below were asked, kept outside them so that it
/// outlives them.
struct Ledger {
  std::vector<std::uint32_t> deregistered;
  int calls_after_destruction = 0;
};

/// Only what RegisteredRegion calls. Destroyed in place inside a
/// std::optional, so that a wrong call after destruction is counted (the
/// storage stays) instead of crashing.
template <bool WithLifetime>
struct FakeTransport {
  Ledger* ledger;
  bool destroyed = false;
  std::uint32_t next = 0;
  LifetimeToken token;

  explicit FakeTransport(Ledger& l) : ledger(&l) {}
  ~FakeTransport() { destroyed = true; }
  RegionHandle register_memory(void*, std::size_t, MemoryKind) { return RegionHandle{next++}; }
  void deregister_memory(RegionHandle h) {
    if (destroyed) ++ledger->calls_after_destruction;
    ledger->deregistered.push_back(h.id);
  }
  Lifetime lifetime() const
    requires WithLifetime
  {
    return Lifetime(token);
  }
};
using Watched = FakeTransport<true>;
using Unwatched = FakeTransport<false>;
static_assert(LifetimeTransport<Watched> && !LifetimeTransport<Unwatched>);

/// A LocalTransport decorator that counts calls made into it after it was
/// destroyed (same trick: destroyed in place, the storage kept).
class CountingTransport : public ForwardingTransport<LocalTransport> {
 public:
  CountingTransport(LocalTransport t, Ledger& l) : ForwardingTransport(t), ledger_(&l) {}
  ~CountingTransport() { destroyed_ = true; }
  void deregister_memory(RegionHandle h) {
    if (destroyed_) ++ledger_->calls_after_destruction;
    ledger_->deregistered.push_back(h.id);
    if (!destroyed_) inner().deregister_memory(h);
  }

 private:
  Ledger* ledger_;
  bool destroyed_ = false;
};
static_assert(LifetimeTransport<CountingTransport>);

std::byte memory[64];

}  // namespace

TEST_CASE("a registered region is deregistered once: at reset, when assigned over, at destruction; a move hands it over") {
  Ledger ledger;
  Watched t(ledger);
  {
    RegisteredRegion<Watched> a(t, memory, sizeof memory, MemoryKind::host);  // id 0
    CHECK(a.valid());
    CHECK(a.handle().id == 0);
    RegisteredRegion<Watched> b(std::move(a));
    CHECK_FALSE(a.valid());  // NOLINT(bugprone-use-after-move): the moved-from state is part of the contract
    CHECK(b.handle().id == 0);
    CHECK(ledger.deregistered.empty());
    b = RegisteredRegion<Watched>(t, memory, 8, MemoryKind::host);  // id 1 replaces id 0
    CHECK(ledger.deregistered == std::vector<std::uint32_t>{0});
    b.reset();
    CHECK(ledger.deregistered == std::vector<std::uint32_t>{0, 1});
    CHECK_FALSE(b.valid());
    b.reset();  // empty: nothing more
    RegisteredRegion<Watched> c(t, memory, 8, MemoryKind::host);  // id 2, deregistered at scope end
    RegisteredRegion<Watched> empty;
  }
  CHECK(ledger.deregistered == std::vector<std::uint32_t>{0, 1, 2});
  CHECK(ledger.calls_after_destruction == 0);
}

TEST_CASE("a registered region that outlives a transport with lifetime() never calls it") {
  Ledger ledger;
  std::optional<Watched> t(std::in_place, ledger);
  RegisteredRegion<Watched> a(*t, memory, sizeof memory, MemoryKind::host);
  RegisteredRegion<Watched> b(*t, memory, 8, MemoryKind::host);
  CHECK_FALSE(a.transport_gone());
  b.reset();
  t.reset();
  CHECK(a.transport_gone());
  a.reset();
  CHECK(ledger.deregistered == std::vector<std::uint32_t>{1});
  CHECK(ledger.calls_after_destruction == 0);

  // Without lifetime() a region cannot tell: the transport must outlive it.
  Unwatched u(ledger);
  RegisteredRegion<Unwatched> c(u, memory, 8, MemoryKind::host);
  CHECK_FALSE(c.transport_gone());
}

TEST_CASE("a local endpoint's lifetime ends with the endpoint object or with its world; a copy is another object") {
  auto world = std::make_unique<LocalWorld>(std::vector<std::int64_t>{0});
  std::optional<LocalTransport> e(world->endpoint(0));
  std::optional<LocalTransport> copy(*e);
  RegisteredRegion<LocalTransport> on_e(*e, memory, 16, MemoryKind::host);
  RegisteredRegion<LocalTransport> on_copy(*copy, memory + 16, 16, MemoryKind::host);
  CHECK(e->registered().size() == 2);  // one world: both endpoint objects are rank 0's
  copy.reset();
  CHECK(on_copy.transport_gone());
  CHECK_FALSE(on_e.transport_gone());
  on_copy.reset();  // its endpoint object is gone: not deregistered through it
  CHECK(e->registered().size() == 2);
  on_e.reset();
  CHECK(e->registered().size() == 1);

  // An endpoint object assigned over stands for another endpoint now: what
  // was registered through it before is not deregistered through it.
  auto other_world = std::make_unique<LocalWorld>(std::vector<std::int64_t>{0});
  RegisteredRegion<LocalTransport> before(*e, memory, 8, MemoryKind::host);
  const std::size_t held = e->registered().size();
  *e = other_world->endpoint(0);
  CHECK(before.transport_gone());
  before.reset();
  CHECK(e->registered().empty());  // the other world's registrations: untouched
  *e = world->endpoint(0);
  CHECK(e->registered().size() == held);  // still held by the first world, released with it

  RegisteredRegion<LocalTransport> r(*e, memory, 8, MemoryKind::host);
  world.reset();  // the endpoint object lives on, its world does not
  CHECK(r.transport_gone());
  r.reset();

  // A decorator watches itself and what it decorates.
  Ledger ledger;
  auto w2 = std::make_unique<LocalWorld>(std::vector<std::int64_t>{0});
  std::optional<CountingTransport> d(std::in_place, w2->endpoint(0), ledger);
  RegisteredRegion<CountingTransport> via_d(*d, memory, 8, MemoryKind::host);
  w2.reset();
  CHECK(via_d.transport_gone());
  via_d.reset();
  d.reset();
  CHECK(ledger.deregistered.empty());
}

TEST_CASE("a Resharder outlives the worlds and transports it was set up on: set up again on a fresh one, it refits "
          "correctly, and it never calls a destroyed transport") {
  const Layout& src = refit_test::message_kinds_src();
  const Layout& dst = refit_test::message_kinds_dst();
  const auto ranks = refit_test::world_of(src, dst);
  const std::size_t n = ranks.size();
  using R = Resharder<Layout, CountingTransport>;
  std::vector<refit_test::SideMemory> smem, dmem;
  for (auto r : ranks) {
    smem.push_back(refit_test::make_side(src, r, true, 0));
    dmem.push_back(refit_test::make_side(dst, r, false, 0));
  }
  ResharderOptions opt;
  opt.executor.zero_copy_min = 1024;  // zero-copy, half-staged and packed messages: registrations of every kind
  std::vector<std::unique_ptr<R>> rs(n);
  Ledger ledger;
  // Transports are destroyed in place (the storage kept, see CountingTransport).
  std::deque<std::vector<std::optional<CountingTransport>>> transports;
  std::int64_t wrong = 0;
  std::vector<std::int64_t> staged_per_world;
  for (std::uint64_t world_no = 1; world_no <= 3; ++world_no) {
    auto world = std::make_unique<LocalWorld>(ranks);
    auto& ts = transports.emplace_back(n);
    for (std::size_t i = 0; i < n; ++i) ts[i].emplace(world->endpoint(ranks[i]), ledger);
    std::mutex m;
    std::int64_t outside = 0;
    world->run([&](LocalTransport& t) {
      const std::size_t i = refit_test::index_of(ranks, t.rank());
      refit_test::write_side(src, smem[i], true, world_no);
      LocalBuffers b;
      b.src = refit_test::views(src, smem[i]);
      b.dst = refit_test::views(dst, dmem[i]);
      if (!rs[i])
        rs[i] = std::make_unique<R>(src, dst, b, *ts[i]);
      else
        rs[i]->setup(b, *ts[i]);  // the previous world and its transports are gone by now
      rs[i]->refit();
      const std::int64_t w = refit_test::count_wrong(dst, dmem[i], t.rank(), world_no, nullptr);
      const std::int64_t o = refit_test::registered_outside(t, {&smem[i], &dmem[i]});
      std::lock_guard lk(m);
      wrong += w;
      outside += o;
    });
    staged_per_world.push_back(outside);
    // This world goes now, while the Resharders still hold registrations on it.
    for (auto& t : ts) t.reset();
    world.reset();
  }
  rs.clear();  // last of all: after every world and transport it used
  CHECK(wrong == 0);
  CHECK(staged_per_world[0] > 0);  // the executors registered staging, not only the weights
  CHECK(ledger.calls_after_destruction == 0);
}
