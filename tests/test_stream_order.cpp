// Stream order of the device path, on the CPU (host_stream.hpp): copies run
// asynchronously on an emulated copy stream, each launch after a random
// delay, and the transport is either host-driven (the in-process one) or
// runs its batches on a device stream of its own (NCCL-like). Every
// destination element is checked against the oracle's tags, so a read of
// staging before its pack ran, an unpack not ordered after its transfer, a
// refit that reads sources before the trainer's event or overwrites a set
// the inference side still reads, shows up as wrong elements.
#include <doctest/doctest.h>

#include <mutex>

#include "error_of.hpp"
#include "host_stream.hpp"
#include "refit_util.hpp"
#include "reshard/resharder.hpp"

using namespace reshard;
using reshard::test::DeviceStreamLocalTransport;
using reshard::test::HostAsDevice;
using reshard::test::HostEvent;
using reshard::test::HostStream;
using reshard::test::HostStreamEngine;
using refit_test::cut;
using refit_test::one_axis;
using refit_test::tensor;

namespace {

std::vector<TensorSpec> model(std::int64_t tp, bool second) {
  return {tensor("w", {64, 96}, {second ? DimSpec{} : cut(tp), second ? cut(tp) : DimSpec{}}, DType::f32),
          tensor("b", {1000}, {cut(tp)}, DType::bf16), tensor("e", {12, 10, 8}, {{}, {}, cut(tp)}, DType::bf16),
          tensor("big", {512, 256}, {cut(tp), {}}, DType::f32), tensor("emb", {300, 24}, {{}, cut(tp)}, DType::u8)};
}

constexpr auto kDelay = std::chrono::microseconds(400);

struct Scenario {
  bool stream_transport = false;
  bool trainer_event = false;  // the sources are written on a "trainer stream" just before the refit
  bool wait = true;            // StreamOrder::wait
  bool double_buffered = false;
  int refits = 3;
  ResharderOptions opt{};
};

struct Result : refit_test::WrongElements {
  std::int64_t host_waits = 0, waves = 0, packed = 0, unpacked = 0, launches = 0;
  std::int64_t torn_reads = 0;  // double-buffered: elements a slow reader saw change under it
};

/// One rank's refits. `T` is the transport the Resharder drives.
template <class T>
void run_rank(T& t, const Layout& src, const Layout& dst, const Scenario& sc, Result& out, std::mutex& m) {
  using namespace refit_test;
  SideMemory sm = make_side(src, t.rank(), true, 0), dm = make_side(dst, t.rank(), false, 0), dm2 = make_side(dst, t.rank(), false, 0);
  LocalBuffers bufs;
  bufs.src = views(src, sm);
  bufs.dst = views(dst, dm);
  if (sc.double_buffered) bufs.dst_back = views(dst, dm2);
  for (auto* side : {&bufs.src, &bufs.dst, &bufs.dst_back})
    for (auto& [name, v] : *side) v.memory = MemoryKind::device;
  auto engine = std::make_shared<HostStreamEngine>(kDelay, static_cast<std::uint64_t>(t.rank()) + 11);
  ResharderOptions o = sc.opt;
  o.executor.device = engine;
  o.double_buffered = sc.double_buffered;
  HostStream trainer, inference;
  Resharder<Layout, T> r(src, dst, bufs, t, o);
  std::vector<std::byte> snapshot;  // double-buffered: what the slow reader copied
  std::int64_t torn = 0;
  for (int k = 1; k <= sc.refits; ++k) {
    StreamOrder order;
    order.wait = sc.wait;
    if (sc.trainer_event) {
      // The optimizer writes version k on the trainer stream, late; the refit
      // is called at once and must not read the sources before the event.
      trainer.enqueue([&, k] {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
        write_side(src, sm, true, static_cast<std::uint64_t>(k));
      });
      order.sources_final = engine->adopt(trainer.record());
    } else {
      write_side(src, sm, true, static_cast<std::uint64_t>(k));
    }
    std::shared_ptr<HostEvent> reader_done;
    if (sc.double_buffered && k >= 3) {
      // The inference stream still reads the set this refit overwrites (the
      // set served before the last swap), slowly: the refit must wait.
      SideMemory& target = r.serving_set() == 0 ? dm2 : dm;
      inference.enqueue([&target, &snapshot, &torn] {
        std::vector<std::byte> before;
        for (auto& b : target.data) before.insert(before.end(), b.begin(), b.end());
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
        std::vector<std::byte> after;
        for (auto& b : target.data) after.insert(after.end(), b.begin(), b.end());
        for (std::size_t i = 0; i < before.size(); ++i) torn += before[i] != after[i];
        snapshot = std::move(after);
      });
      order.destination_free = engine->adopt(inference.record());
    }
    const RefitReport rep = r.refit(order);
    if (!sc.wait) {
      REQUIRE(rep.done != nullptr);
      engine->host_wait(rep.done);  // the inference side's wait, here on the host
    }
    inference.drain();
    const SideMemory& served = r.serving_set() == 0 ? dm : dm2;
    out.count(m, k, dst, served, t.rank());
    std::lock_guard lk(m);
    out.host_waits += rep.host_waits;
    out.waves += rep.waves;
    out.packed += rep.packed_bytes;
    out.unpacked += rep.unpacked_bytes;
  }
  std::lock_guard lk(m);
  out.launches += engine->launches;
  out.torn_reads += torn;
}

Result run(const Layout& src, const Layout& dst, const Scenario& sc) {
  Result out;
  std::mutex m;
  LocalWorld world(refit_test::world_of(src, dst));
  world.run([&](LocalTransport& lt) {
    if (sc.stream_transport) {
      DeviceStreamLocalTransport t(lt, kDelay, static_cast<std::uint64_t>(lt.rank()) + 3);
      run_rank(t, src, dst, sc, out, m);
    } else {
      HostAsDevice t(lt);
      run_rank(t, src, dst, sc, out, m);
    }
  });
  return out;
}

const Layout& tp2() {
  static const Layout L = one_axis("tp", 2, 0, model(2, false));
  return L;
}
const Layout& tp4_apart() {
  static const Layout L = one_axis("tp", 4, 2, model(4, true));
  return L;
}
const Layout& tp2_colocated() {
  static const Layout L = one_axis("tp", 2, 0, model(2, true));
  return L;
}

/// Runs `body(transport, memory)` on both ranks of tp2 -> tp2_colocated in
/// host memory and collects the errors each returns.
template <class F>
std::vector<std::string> errors_on_each_rank(F body) {
  std::mutex m;
  std::vector<std::string> errors;
  LocalWorld world(refit_test::world_of(tp2(), tp2_colocated()));
  world.run([&](LocalTransport& t) {
    refit_test::RankMemory mem(tp2(), tp2_colocated(), t.rank(), false, 1);
    const std::vector<std::string> mine = body(t, mem);
    std::lock_guard lk(m);
    errors.insert(errors.end(), mine.begin(), mine.end());
  });
  return errors;
}

}  // namespace

static_assert(DeviceStreamTransport<DeviceStreamLocalTransport>);
static_assert(!DeviceStreamTransport<HostAsDevice>);
static_assert(DeviceStreamTransport<ForwardingTransport<DeviceStreamLocalTransport*>>);

// Host-driven: at most one host wait per wave (after its pack), never one
// per peer group. On a device stream: none inside a refit.
TEST_CASE("stream order: every element right over pipelines, staging budgets and layouts; host waits bounded") {
  for (bool stream : {false, true})
    for (int pipeline : {1, 2})
      for (std::int64_t budget : {std::int64_t{1} << 30, std::int64_t{4096}})
        for (const Layout* dst : {&tp4_apart(), &tp2_colocated()}) {
          CAPTURE(stream);
          CAPTURE(pipeline);
          CAPTURE(budget);
          Scenario sc;
          sc.stream_transport = stream;
          sc.opt.executor.pipeline = pipeline;
          sc.opt.executor.staging_budget = budget;
          const Result r = run(tp2(), *dst, sc);
          INFO(r.first_wrong);
          CHECK(r.wrong == 0);
          CHECK(r.packed > 0);
          CHECK(r.unpacked > 0);
          CHECK(r.launches > 0);
          CHECK(r.host_waits <= (stream ? 0 : r.waves));
        }
}

TEST_CASE("stream order: the refit waits for the trainer's event; with wait = false, `done` marks the copies' end") {
  struct Case {
    bool wait;
    const Layout* dst;
    std::int64_t budget;
  };
  for (const Case& c : {Case{true, &tp4_apart(), 4096}, Case{false, &tp2_colocated(), std::int64_t{1} << 30}})
    for (bool stream : {false, true}) {
      CAPTURE(c.wait);
      CAPTURE(stream);
      Scenario sc;
      sc.stream_transport = stream;
      sc.trainer_event = true;
      sc.wait = c.wait;
      sc.opt.executor.staging_budget = c.budget;
      const Result r = run(tp2(), *c.dst, sc);
      INFO(r.first_wrong);
      CHECK(r.wrong == 0);
    }
}

TEST_CASE("stream order, double-buffered: a refit never writes the set a reader enqueued before the swap still reads") {
  for (bool stream : {false, true}) {
    CAPTURE(stream);
    Scenario sc;
    sc.stream_transport = stream;
    sc.double_buffered = true;
    sc.wait = false;
    sc.refits = 4;
    const Result r = run(tp2(), tp4_apart(), sc);
    INFO(r.first_wrong);
    CHECK(r.wrong == 0);
    CHECK(r.torn_reads == 0);
  }
}

TEST_CASE("stream order: events with host buffers are a clear error, and the peers fail too") {
  const auto errors = errors_on_each_rank([](LocalTransport& t, refit_test::RankMemory& mem) {
    Resharder<Layout, LocalTransport> r(tp2(), tp2_colocated(), mem.bufs, t);
    HostEvent never;
    StreamOrder order;
    if (t.rank() == 0) order.sources_final = &never;  // one rank misuses it; the other must not hang
    return std::vector<std::string>{test_util::error_of([&] { (void)r.refit(order); })};
  });
  REQUIRE(errors.size() == 2);
  bool named = false;
  for (const auto& e : errors) {
    CHECK(e != "(no error)");  // the misusing rank and its peer both fail
    named = named || e.find("a StreamOrder with events orders device buffers, but this rank's buffers are host memory") != std::string::npos;
  }
  CHECK(named);
}

namespace {

/// One rank's refits through enqueue() / commit(): the trainer writes each
/// version late on its stream (after `trainer_delay`), the refit is
/// enqueued at once, the inference stream waits for the event enqueue()
/// returns and then reads the destination, and only then does the host
/// commit. On a transport with a device stream, enqueue() must not wait on
/// the host at all: `blocked` counts enqueues that waited for anything (an
/// engine host wait or synchronize, a transport test or wait) or returned
/// after the trainer's write ran.
template <class T>
void enqueue_commit_rank(T& t, const Layout& src, const Layout& dst, std::chrono::milliseconds trainer_delay, Result& out,
                         std::int64_t& blocked, std::mutex& m) {
  using namespace refit_test;
  RankMemory mem(src, dst, t.rank(), true);
  SideMemory &sm = mem.src, &dm = mem.dst;
  auto engine = std::make_shared<HostStreamEngine>(kDelay, static_cast<std::uint64_t>(t.rank()) + 17);
  ResharderOptions o;
  o.executor.device = engine;
  o.executor.staging_budget = 4096;  // several waves
  HostStream trainer, inference;
  Resharder<Layout, T> r(src, dst, mem.bufs, t, o);
  for (int k = 1; k <= 3; ++k) {
    auto written = std::make_shared<std::atomic<bool>>(false);
    trainer.enqueue([&, k, written] {
      std::this_thread::sleep_for(trainer_delay);
      write_side(src, sm, true, static_cast<std::uint64_t>(k));
      *written = true;
    });
    StreamOrder order;
    order.wait = false;
    order.sources_final = engine->adopt(trainer.record());
    std::int64_t checks_before = 0;
    if constexpr (requires { t.host_checks; }) checks_before = t.host_checks;
    const std::int64_t waits_before = engine->host_waits;
    const DeviceEvent done = r.enqueue(order);
    bool waited = engine->host_waits != waits_before || *written;
    if constexpr (requires { t.host_checks; }) waited = waited || t.host_checks != checks_before;
    REQUIRE(done != nullptr);
    // The consumer: its stream waits for `done` (no host wait), then reads.
    engine->stream_wait(done, &inference);
    auto read = inference.record();
    const RefitReport rep = r.commit();
    read->wait();
    out.count(m, k, dst, dm, t.rank());
    std::lock_guard lk(m);
    blocked += waited;
    CHECK(rep.version == static_cast<std::uint64_t>(k));
    CHECK(r.last_good_version() == static_cast<std::uint64_t>(k));
  }
  trainer.drain();
}

}  // namespace

TEST_CASE("enqueue / commit: on a device-stream transport enqueue never waits on the host; the consumer's stream orders after `done`") {
  for (const Layout* dst : {&tp4_apart(), &tp2_colocated()}) {
    Result out;
    std::int64_t blocked = 0;
    std::mutex m;
    LocalWorld world(refit_test::world_of(tp2(), *dst));
    world.run([&](LocalTransport& lt) {
      DeviceStreamLocalTransport t(lt, kDelay, static_cast<std::uint64_t>(lt.rank()) + 5);
      // 1 s: an enqueue that waited for the trainer's event cannot hide.
      enqueue_commit_rank(t, tp2(), *dst, std::chrono::milliseconds(1000), out, blocked, m);
    });
    INFO(out.first_wrong);
    CHECK(out.wrong == 0);
    CHECK(blocked == 0);
  }
}

TEST_CASE("enqueue / commit: a host-driven transport moves everything in enqueue, in order, and commits alike") {
  Result out;
  std::int64_t blocked = 0;
  std::mutex m;
  LocalWorld world(refit_test::world_of(tp2(), tp4_apart()));
  world.run([&](LocalTransport& lt) {
    HostAsDevice t(lt);
    enqueue_commit_rank(t, tp2(), tp4_apart(), std::chrono::milliseconds(20), out, blocked, m);
  });
  INFO(out.first_wrong);
  CHECK(out.wrong == 0);
  CHECK(blocked > 0);  // (the host waited for the trainer's event: the control)
}

TEST_CASE("enqueue / commit: misuse is a clear error on every rank, never a hang") {
  const Layout& src = tp2();
  const Layout& dst = tp2_colocated();
  const auto errors = errors_on_each_rank([&](LocalTransport& t, refit_test::RankMemory& mem) {
    const LocalBuffers& bufs = mem.bufs;
    std::vector<std::string> mine;
    {
      Resharder<Layout, LocalTransport> r(src, dst, bufs, t);
      mine.push_back(test_util::error_of([&] { (void)r.commit(); }));
      (void)r.enqueue(StreamOrder{});
      mine.push_back(test_util::error_of([&] { (void)r.enqueue(StreamOrder{}); }));
      mine.push_back(test_util::error_of([&] { (void)r.refit(); }));
      const RefitReport rep = r.commit();
      CHECK(rep.version == 1);
      CHECK(r.state() == RefitState::current);
    }
    ResharderOptions delta;
    delta.delta.enabled = true;
    Resharder<Layout, LocalTransport> d(src, dst, bufs, t, delta);
    mine.push_back(test_util::error_of([&] { (void)d.enqueue(StreamOrder{}); }));
    return mine;
  });
  REQUIRE(errors.size() == 8);
  for (std::size_t i = 0; i < errors.size(); i += 4) {
    CHECK(errors[i].find("Resharder::commit: no refit is enqueued") != std::string::npos);
    CHECK(errors[i + 1].find("version 1 is enqueued and not committed yet: commit() it first") != std::string::npos);
    CHECK(errors[i + 2].find("Resharder::refit of version 2: version 1 is enqueued and not committed yet") != std::string::npos);
    CHECK(errors[i + 3].find("delta refits run through refit()") != std::string::npos);
  }
}
