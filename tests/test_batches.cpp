// The executor's batches and pipelining, measured on the in-process
// transport by timestamps (transport.hpp, "How the executor posts"):
//  * every wave is one batch: one flush per wave, after the wave's posts;
//  * with pipeline = 2 the packing of wave w+1 happens while wave w is in
//    flight: a sender packs (and posts) wave w+1 before its receivers have
//    even posted their receives of wave w, so before wave w can complete;
//    with pipeline = 1 it never does (the control that shows the
//    measurement can tell the two apart).
// Packing needs no hook: the executor packs a peer's sends right before
// their post(), with no transport call in between, so a send post()'s entry
// time is the end of that pack and the previous call's return its start.
#include <doctest/doctest.h>

#include <chrono>
#include <mutex>
#include <thread>
#include <vector>

#include "refit_util.hpp"
#include "reshard/exec/executor.hpp"

using namespace reshard;

namespace {

using refit_test::cut;
using refit_test::one_axis;
using refit_test::tensor;

/// One transport call as the decorator saw it.
struct Call {
  bool flush = false;
  OpKind kind = OpKind::send;  ///< of a post's ops (the executor never mixes kinds in one post)
  std::vector<std::int64_t> peers;
  int batch = 0;  ///< flushes before it: the wave, as the executor posts
  Clock::time_point enter, exit;
};

/// Records every post() and flush() of one rank with its batch, and (on a
/// receiving rank) holds each batch's first receive post back by `hold`, so
/// every wave stays in flight at least that long.
class WaveClock : public ForwardingTransport<LocalTransport*> {
 public:
  WaveClock(LocalTransport& inner, std::chrono::milliseconds hold) : ForwardingTransport(&inner), hold_(hold) {}

  request post(std::span<const TransferOp> ops) {
    Call c;
    c.batch = batch_;
    c.kind = ops.empty() ? OpKind::send : ops[0].kind;
    for (const auto& op : ops) c.peers.push_back(op.peer);
    if (c.kind == OpKind::recv && held_ < batch_ + 1) {
      std::this_thread::sleep_for(hold_);
      held_ = batch_ + 1;
    }
    c.enter = Clock::now();
    request r = inner().post(ops);
    c.exit = Clock::now();
    calls.push_back(std::move(c));
    return r;
  }
  void flush(Deadline d) {
    Call c;
    c.flush = true;
    c.batch = batch_;
    c.enter = Clock::now();
    ForwardingTransport::flush(d);
    c.exit = Clock::now();
    calls.push_back(std::move(c));
    ++batch_;
  }

  std::vector<Call> calls;

 private:
  std::chrono::milliseconds hold_;
  int batch_ = 0, held_ = 0;
};

struct Recorded {
  std::vector<std::int64_t> ranks;
  std::vector<std::vector<Call>> calls;  ///< per rank
  std::vector<int> waves;
  std::int64_t wrong = 0;
};

/// A one-way refit (senders 0..1, receivers 2..3), every piece strided on
/// both sides, so every send is packed; receivers hold each wave back.
Recorded record(int pipeline, std::chrono::milliseconds hold) {
  auto src = one_axis("tp", 2, 0, {tensor("w", {96, 80}, {cut(2), {}}, DType::bf16)});
  auto dst = one_axis("tp", 2, 2, {tensor("w", {96, 80}, {{}, cut(2)}, DType::bf16)});
  ExecutorOptions opt;
  opt.staging_budget = 2048;
  opt.pipeline = pipeline;
  opt.timeout = std::chrono::seconds(60);
  refit_test::DenseWorld w(src, dst);
  Recorded out;
  out.ranks = w.ranks;
  out.calls.resize(w.ranks.size());
  out.waves.resize(w.ranks.size());
  std::mutex m;
  w.run(src, dst, [&](LocalTransport& inner, std::size_t i, auto sb, auto db) {
    WaveClock t(inner, inner.rank() >= 2 ? hold : std::chrono::milliseconds(0));
    Executor<WaveClock> ex;
    ex.setup(plan(src, dst), sb, db, t, opt);
    t.calls.clear();
    const ExecutorStats st = ex.run();
    const auto wrong = refit_test::count_wrong(dst, w.dst_mem[i], inner.rank(), 0, nullptr);
    std::lock_guard lk(m);
    out.calls[i] = t.calls;
    out.waves[i] = st.waves;
    out.wrong += wrong;
  });
  return out;
}

double ms(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double, std::milli>(b - a).count(); }

/// Per sender and wave w >= 1, and receiver r: how long before r posted
/// its receives of wave w-1 from the sender the sender had packed its sends
/// of wave w (negative: packed only after).
std::vector<double> pack_lead(const Recorded& rec) {
  std::vector<double> lead;
  for (std::size_t s = 0; s < 2; ++s) {
    const auto& calls = rec.calls[s];
    for (std::size_t c = 0; c < calls.size(); ++c) {
      const Call& send = calls[c];
      if (send.flush || send.kind != OpKind::send || send.batch == 0) continue;
      if (c > 0 && calls[c - 1].batch == send.batch && !calls[c - 1].flush && calls[c - 1].kind == OpKind::send) continue;  // not the batch's first
      for (std::size_t r = 2; r < 4; ++r)
        for (const Call& recv : rec.calls[r])
          if (!recv.flush && recv.kind == OpKind::recv && recv.batch == send.batch - 1 &&
              std::find(recv.peers.begin(), recv.peers.end(), rec.ranks[s]) != recv.peers.end())
            lead.push_back(ms(send.enter, recv.enter));
    }
  }
  return lead;
}

}  // namespace

TEST_CASE("batches: every wave is one flushed batch, after all of its posts") {
  const Recorded rec = record(2, std::chrono::milliseconds(0));
  CHECK(rec.wrong == 0);
  for (std::size_t i = 0; i < rec.ranks.size(); ++i) {
    CAPTURE(rec.ranks[i]);
    REQUIRE(rec.waves[i] >= 3);
    int flushes = 0;
    std::vector<int> posts(static_cast<std::size_t>(rec.waves[i]), 0);
    for (const Call& c : rec.calls[i]) {
      if (c.flush) {
        CHECK(c.batch == flushes);  // in order, one per wave
        ++flushes;
      } else {
        REQUIRE(c.batch < rec.waves[i]);  // no post after the last flush
        ++posts[static_cast<std::size_t>(c.batch)];
      }
    }
    CHECK(flushes == rec.waves[i]);
    for (int p : posts) CHECK(p > 0);
  }
}

TEST_CASE("pipeline = 2 packs wave w+1 while wave w is in flight (timestamps); pipeline = 1 does not") {
  const auto hold = std::chrono::milliseconds(150);
  const Recorded two = record(2, hold);
  const Recorded one = record(1, hold);
  CHECK(two.wrong == 0);
  CHECK(one.wrong == 0);
  const auto lead2 = pack_lead(two), lead1 = pack_lead(one);
  REQUIRE(lead2.size() >= 4);
  REQUIRE(lead1.size() >= 4);  // (fewer waves: each has the whole budget)
  const double min2 = *std::min_element(lead2.begin(), lead2.end()), max1 = *std::max_element(lead1.begin(), lead1.end());
  MESSAGE("pack of wave w+1 ahead of the receiver's posts of wave w: pipeline 2 at least " << min2 << " ms, pipeline 1 at most " << max1
                                                                                            << " ms, over " << lead2.size() << " and " << lead1.size() << " (sender, wave, receiver)");
  // Packed before wave w could even start to complete: it overlapped the transfer.
  CHECK(min2 > 0);
  // Pipeline 1 packs wave w+1 only after wave w completed, which needs the receives posted.
  CHECK(max1 < 0);
}
