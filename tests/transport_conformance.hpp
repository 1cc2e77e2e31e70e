#pragma once
// The transport conformance suite: what reshard/transport/transport.hpp's contract
// says, checked on any Transport. A case is a callable with `ranks` (how many
// endpoints it needs) and `template <class T> void operator()(T& t) const`,
// run once per rank on that rank's endpoint; a violation throws
// conformance::Violation. A harness runs a case on its ranks (threads,
// forked processes, mpirun) and throws when any rank failed:
//
//   struct MyHarness { template <class Case> void run(const Case& c); };
//   TEST_CASE_TEMPLATE_INVOKE(conformance_matching, MyHarness);  // or:
//   RESHARD_TRANSPORT_CONFORMANCE(MyHarness, OtherHarness);      // every case
//
// Cases refer to ranks by their position in world_ranks() (a world need not
// be 0..n-1) and prepare() every op they post, so a backend that refuses
// unprepared ops (UCX) runs them too. No case relies on a rank being the
// lowest or on timing beyond its stated bounds (generous: 2 shared cores).
#include <algorithm>
#include <chrono>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <doctest/doctest.h>
#include <fmt/format.h>

#include "reshard/transport/peer_exchange.hpp"
#include "reshard/transport/transport.hpp"

namespace conformance {

using reshard::Clock;
using reshard::Deadline;
using reshard::MemoryKind;
using reshard::OpKind;
using reshard::RegionHandle;
using reshard::TransferOp;
using reshard::TransportError;
using namespace std::chrono_literals;

/// The transport broke the contract (or the case could not run).
struct Violation : std::runtime_error {
  using std::runtime_error::runtime_error;
};

#define RESHARD_CONFORM(cond, ...)                                                                                           \
  do {                                                                                                                       \
    if (!(cond))                                                                                                             \
      throw ::conformance::Violation(fmt::format("{}:{}: {} ({})", __FILE__, __LINE__, fmt::format(__VA_ARGS__), #cond)); \
  } while (0)

inline Deadline in(std::chrono::milliseconds d) { return Clock::now() + d; }
inline double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

/// This endpoint's position in world_ranks().
template <class T>
std::size_t me(const T& t) {
  const auto w = t.world_ranks();
  return static_cast<std::size_t>(std::find(w.begin(), w.end(), t.rank()) - w.begin());
}
template <class T>
std::int64_t rank_at(const T& t, std::size_t i) {
  return t.world_ranks()[i];
}

/// A byte pattern that differs by message, replay and position.
inline unsigned char pattern(std::uint64_t seed, std::size_t i) {
  return static_cast<unsigned char>((i * 131 + (i >> 9) + seed * 0x9e37) ^ (seed >> 8));
}
inline void fill(std::vector<unsigned char>& b, std::size_t at, std::size_t n, std::uint64_t seed) {
  for (std::size_t i = 0; i < n; ++i) b[at + i] = pattern(seed, i);
}
inline std::size_t wrong(const std::vector<unsigned char>& b, std::size_t at, std::size_t n, std::uint64_t seed) {
  std::size_t bad = 0;
  for (std::size_t i = 0; i < n; ++i) bad += b[at + i] != pattern(seed, i);
  return bad;
}

/// Does `f` throw TransportError? (Any other exception is a violation too.)
template <class F>
std::string transport_error_of(F&& f) {
  try {
    f();
  } catch (const TransportError& e) {
    return std::string("TransportError: ") + e.what();
  }
  return "";
}

// The executor's tag layout (executor.hpp): channel << 48 | (1 << 47 for
// checksum control messages) | index. A transport must keep all 64 bits apart.
inline constexpr std::uint64_t kControlBit = std::uint64_t{1} << 47;
inline constexpr std::uint64_t channel(std::uint64_t c) { return c << 48; }

/// Sends meet the receive of the same (sender, receiver, tag), whatever the
/// posting order, across post() calls, both directions using the same tags;
/// tags differing only in bits 32..63 are different tags.
struct Matching {
  static constexpr int ranks = 3;
  static constexpr const char* name = "sends match receives by (sender, receiver, tag), all 64 tag bits";
  template <class T>
  void operator()(T& t) const {
    const std::uint64_t tags[] = {5, 5 | kControlBit, 5 | channel(0xabcd), 5 | channel(0xabcd) | kControlBit, (std::uint64_t{1} << 32) | 5};
    constexpr std::size_t K = std::size(tags), N = 256;
    const std::size_t i = me(t);
    // Rank at 1 talks to 0 and 2 with every tag, both ways; 0 and 2 only to 1.
    std::vector<std::size_t> peers = i == 1 ? std::vector<std::size_t>{2, 0} : std::vector<std::size_t>{1};
    std::vector<unsigned char> src(peers.size() * K * N), dst(peers.size() * K * N, 0);
    const RegionHandle rs = t.register_memory(src.data(), src.size(), MemoryKind::host);
    const RegionHandle rd = t.register_memory(dst.data(), dst.size(), MemoryKind::host);
    auto seed = [&](std::size_t from, std::size_t to, std::size_t k) { return from * 100 + to * 10 + k; };
    std::vector<std::vector<TransferOp>> recv_posts, send_posts;
    for (std::size_t p = 0; p < peers.size(); ++p) {
      std::vector<TransferOp> r, s;
      for (std::size_t k = 0; k < K; ++k) {
        const std::size_t kr = (k * 3 + p) % K;  // receives in a scrambled tag order
        r.push_back({OpKind::recv, rank_at(t, peers[p]), tags[kr], rd, (p * K + kr) * N, N});
        s.push_back({OpKind::send, rank_at(t, peers[p]), tags[k], rs, (p * K + k) * N, N});
        fill(src, (p * K + k) * N, N, seed(i, peers[p], k));
      }
      recv_posts.push_back(r);
      send_posts.push_back(s);
    }
    std::vector<TransferOp> all;
    for (const auto& v : recv_posts) all.insert(all.end(), v.begin(), v.end());
    for (const auto& v : send_posts) all.insert(all.end(), v.begin(), v.end());
    t.prepare(all, in(20s));
    std::vector<typename T::request> rq;
    for (const auto& v : recv_posts) rq.push_back(t.post(v));
    for (const auto& v : send_posts) rq.push_back(t.post(v));
    for (auto& r : rq) t.wait(r, in(20s));
    for (std::size_t p = 0; p < peers.size(); ++p)
      for (std::size_t k = 0; k < K; ++k)
        RESHARD_CONFORM(wrong(dst, (p * K + k) * N, N, seed(peers[p], i, k)) == 0,
                        "rank {}: the receive from rank {} with tag {:#x} got another message's bytes", t.rank(), rank_at(t, peers[p]), tags[k]);
    t.deregister_memory(rs);
    t.deregister_memory(rd);
  }
};

/// Equal (sender, receiver, tag) keys match in posting order, across post()
/// calls, whether the receives are posted before or after the sends.
struct EqualKeysInOrder {
  static constexpr int ranks = 2;
  static constexpr const char* name = "equal (peer, tag) pairs match in posting order";
  template <class T>
  void operator()(T& t) const {
    constexpr std::size_t M = 4, N = 1000;
    constexpr std::uint64_t tag = 9 | channel(3);
    const std::size_t i = me(t);
    const std::int64_t peer = rank_at(t, 1 - i);
    std::vector<unsigned char> buf(M * N, 0);
    const RegionHandle r = t.register_memory(buf.data(), buf.size(), MemoryKind::host);
    const OpKind kind = i == 0 ? OpKind::send : OpKind::recv;
    std::vector<TransferOp> ops;
    for (std::size_t m = 0; m < M; ++m) ops.push_back({kind, peer, tag, r, m * N, N});
    t.prepare(ops, in(20s));
    // Sends as 2 + 2 messages, receives as 1 + 3: posting order, not post() calls, decides.
    const std::size_t split = i == 0 ? 2 : 1;
    for (int round = 0; round < 2; ++round) {  // round 0: sends first; round 1: receives first
      const bool post_now = (i == 0) == (round == 0);
      if (i == 0)
        for (std::size_t m = 0; m < M; ++m) fill(buf, m * N, N, 1000 * round + m);
      else
        std::fill(buf.begin(), buf.end(), 0);
      std::vector<typename T::request> rq;
      auto post = [&] {
        rq.push_back(t.post(std::span(ops).first(split)));
        rq.push_back(t.post(std::span(ops).subspan(split)));
      };
      if (post_now) post();
      t.all_gather({}, in(20s));  // the other side posts only now
      if (!post_now) post();
      for (auto& q : rq) t.wait(q, in(20s));
      if (i == 1)
        for (std::size_t m = 0; m < M; ++m)
          RESHARD_CONFORM(wrong(buf, m * N, N, 1000 * round + m) == 0, "rank {}: receive {} of tag {:#x} did not get send {} ({} posted first)",
                          t.rank(), m, tag, m, round == 0 ? "sends" : "receives");
      t.all_gather({}, in(20s));  // the sender rewrites its buffer next round
    }
    t.deregister_memory(r);
  }
};

/// A send and a receive of the same key but different sizes fail on both
/// sides with TransportError (at prepare, post or wait), never silently.
struct SizeMismatch {
  static constexpr int ranks = 2;
  static constexpr const char* name = "a size mismatch is a TransportError on both sides";
  template <class T>
  void operator()(T& t) const {
    const std::size_t i = me(t);
    std::vector<unsigned char> buf(300, 7);
    const RegionHandle r = t.register_memory(buf.data(), buf.size(), MemoryKind::host);
    const TransferOp op = i == 0 ? TransferOp{OpKind::send, rank_at(t, 1), 3, r, 0, 300} : TransferOp{OpKind::recv, rank_at(t, 0), 3, r, 0, 200};
    const auto t0 = Clock::now();
    const std::string err = transport_error_of([&] {
      t.prepare(std::span(&op, 1), in(10s));
      auto q = t.post(std::span(&op, 1));
      t.wait(q, in(10s));
    });
    RESHARD_CONFORM(!err.empty(), "rank {}: a {} of tag 0x3 with sizes 300 (send) and 200 (receive) completed without an error", t.rank(),
                    i == 0 ? "send" : "receive");
    RESHARD_CONFORM(seconds_since(t0) < 8, "rank {}: the size mismatch took {:.1f} s to surface (by its deadline, not by the match)", t.rank(),
                    seconds_since(t0));
    t.deregister_memory(r);
  }
};

/// A wait on a receive nobody sends throws TransportError at its deadline
/// (not much later, not at once), naming the pending op's peer and tag;
/// test() on it returns false without blocking; a completed request waits
/// fine again, even past its deadline.
struct Deadlines {
  static constexpr int ranks = 2;
  static constexpr const char* name = "waits throw at the deadline naming what is pending; test() never blocks";
  template <class T>
  void operator()(T& t) const {
    constexpr std::uint64_t lost = 0x2a | channel(0x1234);
    const std::size_t i = me(t);
    std::vector<unsigned char> buf(64, 1);
    const RegionHandle r = t.register_memory(buf.data(), buf.size(), MemoryKind::host);
    const std::int64_t peer = rank_at(t, 1 - i);
    // Rank at 0 prepares the send of `lost` but never posts it; both exchange tag 1 normally.
    const OpKind mine = i == 0 ? OpKind::send : OpKind::recv;
    const std::vector<TransferOp> ops = {{mine, peer, 1, r, 0, 32}, {mine, peer, lost, r, 32, 32}};
    t.prepare(ops, in(20s));
    auto ok = t.post(std::span(ops).first(1));
    t.wait(ok, in(20s));
    t.wait(ok, Clock::now() - 1s);  // completed: waits fine again, past its deadline
    RESHARD_CONFORM(t.test(ok), "rank {}: test() of a completed request is false", t.rank());
    if (i == 1) {
      auto q = t.post(std::span(ops).subspan(1));
      double slowest = 0;
      for (int k = 0; k < 20; ++k) {
        const auto t0 = Clock::now();
        RESHARD_CONFORM(!t.test(q), "rank {}: test() says a receive nobody sent completed", t.rank());
        slowest = std::max(slowest, seconds_since(t0));
        RESHARD_CONFORM(slowest < 0.5, "rank {}: test() blocked for {:.2f} s", t.rank(), slowest);
      }
      const std::string tag_text = fmt::format("{:#x}", lost), peer_text = fmt::format("rank {}", peer);
      for (int how = 0; how < 2; ++how) {
        const auto t0 = Clock::now();
        const std::string err = transport_error_of([&] {
          if (how == 0) {
            t.wait(q, in(300ms));
          } else {
            typename T::request* one[] = {&q};
            t.wait_any(one, in(300ms));
          }
        });
        const double s = seconds_since(t0);
        const char* call = how == 0 ? "wait" : "wait_any";
        RESHARD_CONFORM(!err.empty(), "rank {}: {} on a receive nobody sends returned", t.rank(), call);
        RESHARD_CONFORM(s >= 0.25, "rank {}: {} with a 0.3 s deadline gave up after {:.3f} s", t.rank(), call, s);
        RESHARD_CONFORM(s < 2.3, "rank {}: {} with a 0.3 s deadline threw only after {:.1f} s", t.rank(), call, s);
        RESHARD_CONFORM(err.find(tag_text) != std::string::npos && err.find(peer_text) != std::string::npos,
                        "rank {}: the timeout of {} does not name the pending receive ({} from {}): {}", t.rank(), call, tag_text, peer_text, err);
      }
    }
    t.all_gather({}, in(20s));
  }
};

/// abort() on one rank fails the others' waits and all_gathers promptly (not
/// at their deadline), and every later post()/all_gather() on the aborted
/// endpoint at once.
struct AbortReachesPeers {
  static constexpr int ranks = 3;
  static constexpr const char* name = "abort() fails the peers' waits and all_gathers promptly";
  static constexpr auto wait_for = 8s;  ///< the peers' deadline
  static constexpr double prompt = 4;   ///< seconds an abort may take to arrive
  template <class T>
  void operator()(T& t) const {
    const std::size_t i = me(t);
    std::vector<unsigned char> buf(64, 1);
    const RegionHandle r = t.register_memory(buf.data(), buf.size(), MemoryKind::host);
    std::vector<TransferOp> ops;
    if (i == 0)
      for (std::size_t p : {1, 2}) ops.push_back({OpKind::send, rank_at(t, p), 1, r, 0, 64});
    else
      ops.push_back({OpKind::recv, rank_at(t, 0), 1, r, 0, 64});
    t.prepare(ops, in(20s));
    if (i == 0) {
      t.all_gather({}, in(20s));
      std::this_thread::sleep_for(200ms);  // the peers are in their waits
      t.abort("conformance: rank at 0 gives up");
      const auto t0 = Clock::now();
      RESHARD_CONFORM(!transport_error_of([&] { t.post(ops); }).empty(), "rank {}: post() after abort() did not throw", t.rank());
      RESHARD_CONFORM(!transport_error_of([&] { t.all_gather({}, in(wait_for)); }).empty(), "rank {}: all_gather after abort() did not throw",
                      t.rank());
      RESHARD_CONFORM(seconds_since(t0) < 1, "rank {}: calls after abort() took {:.1f} s to fail", t.rank(), seconds_since(t0));
      t.abort("again");  // harmless
      return;
    }
    auto q = t.post(ops);
    t.all_gather({}, in(20s));
    const auto t0 = Clock::now();
    const std::string err = transport_error_of([&] {
      if (i == 1) {
        t.wait(q, in(wait_for));
      } else {
        typename T::request* one[] = {&q};
        t.wait_any(one, in(wait_for));
      }
    });
    const double s = seconds_since(t0);
    RESHARD_CONFORM(!err.empty(), "rank {}: the wait for an aborted peer returned", t.rank());
    RESHARD_CONFORM(s < prompt, "rank {}: the peer's abort failed this rank's wait only after {:.1f} s (deadline {} s)", t.rank(), s,
                    wait_for.count());
    const auto t1 = Clock::now();
    RESHARD_CONFORM(!transport_error_of([&] { t.all_gather({}, in(wait_for)); }).empty(), "rank {}: all_gather after a peer's abort returned",
                    t.rank());
    RESHARD_CONFORM(seconds_since(t1) < prompt, "rank {}: all_gather after a peer's abort failed only after {:.1f} s", t.rank(), seconds_since(t1));
  }
};

/// Prepared ops replayed many times move each replay's bytes: the source is
/// rewritten right after its send completed, the receive checked right after
/// it completed, no barrier between replays; post()'s span is scribbled over
/// right after the call (the transport must have copied it); 0-byte and
/// multi-chunk messages included.
struct Replays {
  static constexpr int ranks = 3;
  static constexpr const char* name = "replays of prepared ops move the right bytes every time";
  int replays = 200;
  template <class T>
  void operator()(T& t) const {
    const std::size_t sizes[] = {0, 7, 65536, 200003};
    constexpr std::size_t K = std::size(sizes);
    const std::size_t n = t.world_ranks().size(), i = me(t);
    const std::int64_t next = rank_at(t, (i + 1) % n), prev = rank_at(t, (i + n - 1) % n);
    std::size_t total = 0;
    for (auto s : sizes) total += s;
    std::vector<unsigned char> src(total), dst(total);
    const RegionHandle rs = t.register_memory(src.data(), total, MemoryKind::host);
    const RegionHandle rd = t.register_memory(dst.data(), total, MemoryKind::host);
    auto ops_of = [&](OpKind kind) {
      std::vector<TransferOp> ops;
      std::size_t at = 0;
      for (std::size_t k = 0; k < K; ++k) {
        ops.push_back({kind, kind == OpKind::send ? next : prev, k | channel(1), kind == OpKind::send ? rs : rd, at, sizes[k]});
        at += sizes[k];
      }
      return ops;
    };
    std::vector<TransferOp> all = ops_of(OpKind::recv), sends = ops_of(OpKind::send);
    all.insert(all.end(), sends.begin(), sends.end());
    t.prepare(all, in(20s));
    auto post = [&](OpKind kind) {
      std::vector<TransferOp> ops = ops_of(kind);
      auto q = t.post(ops);
      for (auto& op : ops) op = TransferOp{kind, -7, 0xdead, RegionHandle{}, 1u << 30, 1u << 30};  // the caller's memory again
      return q;
    };
    for (int it = 0; it < replays; ++it) {
      std::size_t at = 0;
      for (std::size_t k = 0; k < K; ++k) {
        fill(src, at, sizes[k], static_cast<std::uint64_t>(it) * 64 + i * 8 + k);
        at += sizes[k];
      }
      std::fill(dst.begin(), dst.end(), 0);
      auto rq = post(OpKind::recv);
      auto sq = post(OpKind::send);
      t.wait(rq, in(20s));
      at = 0;
      for (std::size_t k = 0; k < K; ++k) {
        const std::size_t bad = wrong(dst, at, sizes[k], static_cast<std::uint64_t>(it) * 64 + ((i + n - 1) % n) * 8 + k);
        RESHARD_CONFORM(bad == 0, "rank {}: replay {}: message {} ({} bytes) from rank {}: {} wrong bytes", t.rank(), it, k, sizes[k], prev, bad);
        at += sizes[k];
      }
      t.wait(sq, in(20s));
    }
    t.all_gather({}, in(20s));
    t.deregister_memory(rs);
    t.deregister_memory(rd);
  }
};

/// wait_any returns the index of a request that completed (the only one
/// that can have), and test() agrees. The request that can complete is
/// posted and flushed first, in a batch of its own, so a transport whose
/// batches run in order (NCCL) can complete it too.
struct WaitAny {
  static constexpr int ranks = 2;
  static constexpr const char* name = "wait_any returns the index of a completed request";
  template <class T>
  void operator()(T& t) const {
    constexpr std::size_t N = 4096;
    const std::size_t i = me(t);
    const std::int64_t peer = rank_at(t, 1 - i);
    std::vector<unsigned char> buf(3 * N, 0);
    const RegionHandle r = t.register_memory(buf.data(), buf.size(), MemoryKind::host);
    const OpKind kind = i == 0 ? OpKind::recv : OpKind::send;
    // In posting order: message 1 (tag 2, the middle of the buffer), then 0 and 2.
    const std::uint64_t order[] = {1, 0, 2};
    std::vector<TransferOp> ops;
    for (std::uint64_t k : order) ops.push_back({kind, peer, 1 + k, r, k * N, N});
    t.prepare(ops, in(20s));
    if (i == 1) {
      for (std::size_t k = 0; k < 3; ++k) fill(buf, k * N, N, 40 + k);
      auto s1 = t.post(std::span(ops).first(1));  // only the middle one, for now
      reshard::flush_batch(t, in(20s));
      t.wait(s1, in(20s));
      t.all_gather({}, in(20s));
      t.all_gather({}, in(20s));
      std::vector<typename T::request> rest;
      rest.push_back(t.post(std::span(ops).subspan(1, 1)));
      rest.push_back(t.post(std::span(ops).subspan(2)));
      reshard::flush_batch(t, in(20s));
      for (auto& q : rest) t.wait(q, in(20s));
      return;
    }
    std::vector<typename T::request> rq;  // in posting order: messages 1, 0, 2
    rq.push_back(t.post(std::span(ops).first(1)));
    reshard::flush_batch(t, in(20s));
    rq.push_back(t.post(std::span(ops).subspan(1, 1)));
    rq.push_back(t.post(std::span(ops).subspan(2)));
    reshard::flush_batch(t, in(20s));
    t.all_gather({}, in(20s));  // the middle send is posted (and done)
    std::vector<typename T::request*> ptrs = {&rq[1], &rq[0], &rq[2]};  // messages 0, 1, 2
    const std::size_t got = t.wait_any(ptrs, in(20s));
    RESHARD_CONFORM(got == 1, "rank {}: wait_any returned {}, but only request 1 can complete", t.rank(), got);
    RESHARD_CONFORM(t.test(rq[0]), "rank {}: test() of the request wait_any returned is false", t.rank());
    RESHARD_CONFORM(wrong(buf, N, N, 41) == 0, "rank {}: the request wait_any returned has the wrong bytes", t.rank());
    t.all_gather({}, in(20s));  // now the others come
    std::vector<typename T::request*> left = {&rq[1], &rq[2]};
    const std::size_t next = t.wait_any(left, in(20s));
    RESHARD_CONFORM(next < 2 && t.test(*left[next]), "rank {}: wait_any returned {}, which has not completed", t.rank(), next);
    t.wait(*left[1 - next], in(20s));
    RESHARD_CONFORM(wrong(buf, 0, N, 40) == 0 && wrong(buf, 2 * N, N, 42) == 0, "rank {}: wrong bytes after wait_any", t.rank());
  }
};

/// The executor's batches (transport.hpp, "How the executor posts"): per
/// wave, one post() of receives per peer, then one of every send, then
/// flush_batch(); two waves live at once, the third posted once the first
/// completed; ranks skewed (one packs for a while between its flush and its
/// first wait, one posts its second wave late). Every flushed batch
/// completes through waits alone: nothing is posted after the last flush.
/// A transport that makes each post() a batch of its own (so a batch of
/// receives blocks its stream before the sends are posted) deadlocks here.
struct Batches {
  static constexpr int ranks = 3;
  static constexpr const char* name = "the executor's flushed batches (receives before sends, two waves live) complete";
  std::chrono::milliseconds patience{20000};
  template <class T>
  void operator()(T& t) const {
    constexpr std::size_t W = 3, K = 2, N = 3000;  // waves, messages per peer and wave, bytes
    const std::size_t n = t.world_ranks().size(), i = me(t);
    std::vector<std::size_t> peers;
    for (std::size_t p = 0; p < n; ++p)
      if (p != i) peers.push_back(p);
    const std::size_t P = peers.size();
    auto at = [&](std::size_t w, std::size_t p, std::size_t k) { return ((w * P + p) * K + k) * N; };
    auto seed = [&](std::size_t w, std::size_t from, std::size_t to, std::size_t k) { return ((w * 8 + from) * 8 + to) * 8 + k + 1; };
    std::vector<unsigned char> src(W * P * K * N), dst(W * P * K * N, 0);
    const RegionHandle rs = t.register_memory(src.data(), src.size(), MemoryKind::host);
    const RegionHandle rd = t.register_memory(dst.data(), dst.size(), MemoryKind::host);
    // Per wave: the receives per peer, then all sends (the executor's order).
    std::vector<std::vector<std::vector<TransferOp>>> recvs(W, std::vector<std::vector<TransferOp>>(P));
    std::vector<std::vector<TransferOp>> sends(W);
    std::vector<TransferOp> all;
    for (std::size_t w = 0; w < W; ++w) {
      for (std::size_t p = 0; p < P; ++p)
        for (std::size_t k = 0; k < K; ++k) recvs[w][p].push_back({OpKind::recv, rank_at(t, peers[p]), channel(2) | (w * K + k), rd, at(w, p, k), N});
      for (std::size_t p = 0; p < P; ++p)
        for (std::size_t k = 0; k < K; ++k) {
          sends[w].push_back({OpKind::send, rank_at(t, peers[p]), channel(2) | (w * K + k), rs, at(w, p, k), N});
          fill(src, at(w, p, k), N, seed(w, i, peers[p], k));
        }
      for (const auto& v : recvs[w]) all.insert(all.end(), v.begin(), v.end());
      all.insert(all.end(), sends[w].begin(), sends[w].end());
    }
    t.prepare(all, in(patience));
    struct Live {
      std::vector<typename T::request> recvs, sends;
    };
    std::vector<Live> live(W);
    auto post_wave = [&](std::size_t w) {
      for (const auto& v : recvs[w]) live[w].recvs.push_back(t.post(v));
      live[w].sends.push_back(t.post(sends[w]));
      reshard::flush_batch(t, in(patience));
    };
    auto finish_wave = [&](std::size_t w) {
      auto& rq = live[w].recvs;
      while (!rq.empty()) {
        std::vector<typename T::request*> ptrs;
        for (auto& r : rq) ptrs.push_back(&r);
        const std::size_t got = t.wait_any(ptrs, in(patience));
        rq.erase(rq.begin() + static_cast<std::ptrdiff_t>(got));
      }
      for (auto& s : live[w].sends) t.wait(s, in(patience));
      for (std::size_t p = 0; p < P; ++p)
        for (std::size_t k = 0; k < K; ++k)
          RESHARD_CONFORM(wrong(dst, at(w, p, k), N, seed(w, peers[p], i, k)) == 0, "rank {}: wave {}: message {} from rank {} has wrong bytes",
                          t.rank(), w, k, rank_at(t, peers[p]));
    };
    post_wave(0);
    if (i == 2) std::this_thread::sleep_for(150ms);  // a late second wave
    post_wave(1);
    if (i == 0) std::this_thread::sleep_for(150ms);  // packing: no transport call between flush and wait
    finish_wave(0);
    post_wave(2);
    finish_wave(1);
    finish_wave(2);
    t.all_gather({}, in(patience));
    t.deregister_memory(rs);
    t.deregister_memory(rd);
  }
};

/// all_gather returns every rank's blob (empty ones too) in world_ranks()
/// order, call after call.
struct AllGatherOrder {
  static constexpr int ranks = 3;
  static constexpr const char* name = "all_gather returns the blobs in world order";
  template <class T>
  void operator()(T& t) const {
    const auto world = t.world_ranks();
    auto blob_of = [](std::int64_t rank, std::size_t pos, int round) {
      std::vector<std::byte> b;
      if (pos == 1 && round == 0) return b;  // an empty blob stays empty, in its place
      for (std::size_t k = 0; k < 8 + 3 * pos + static_cast<std::size_t>(round); ++k)
        b.push_back(static_cast<std::byte>(rank * 37 + static_cast<std::int64_t>(k) + round));
      return b;
    };
    for (int round = 0; round < 3; ++round) {
      const auto got = t.all_gather(blob_of(t.rank(), me(t), round), in(20s));
      RESHARD_CONFORM(got.size() == world.size(), "rank {}: all_gather returned {} blobs for {} ranks", t.rank(), got.size(), world.size());
      for (std::size_t j = 0; j < world.size(); ++j)
        RESHARD_CONFORM(got[j] == blob_of(world[j], j, round), "rank {}: blob {} of all_gather round {} is not rank {}'s", t.rank(), j, round,
                        world[j]);
    }
  }
};

/// The pairwise exchange (transport.hpp "pairwise exchange", through
/// exchange_with_peers: the transport's own where it has one, else its
/// all_gather): each rank gets exactly what each listed peer addressed to it,
/// call after call, with peer sets that change per call (a rank with none),
/// an empty blob and one large enough to need fragments.
struct PairwiseExchange {
  static constexpr int ranks = 3;
  static constexpr const char* name = "the pairwise exchange delivers each peer's blob for this rank, call after call";
  template <class T>
  void operator()(T& t) const {
    const std::size_t i = me(t);
    // Peer sets by position, symmetric: round 0 a chain 0-1-2, round 1 only
    // 0-2 (rank 1 has no peer), round 2 everyone.
    auto peers = [](int round, std::size_t pos) -> std::vector<std::size_t> {
      if (round == 0) return pos == 1 ? std::vector<std::size_t>{2, 0} : std::vector<std::size_t>{1};
      if (round == 1) return pos == 1 ? std::vector<std::size_t>{} : std::vector<std::size_t>{2 - pos};
      std::vector<std::size_t> all;
      for (std::size_t p = 0; p < 3; ++p)
        if (p != pos) all.push_back(p);
      return all;
    };
    auto blob = [](std::size_t from, std::size_t to, int round) {
      const std::size_t n = from == 2 && to == 0 ? 0 : from == 0 && to == 1 ? 300'000 : 17 + 5 * from + to + static_cast<std::size_t>(round);
      std::vector<std::byte> b(n);
      for (std::size_t k = 0; k < n; ++k) b[k] = static_cast<std::byte>(pattern(from * 16 + to * 4 + static_cast<std::size_t>(round), k));
      return b;
    };
    for (int round = 0; round < 4; ++round) {
      const int shape = round == 3 ? 0 : round;  // round 3: the chain again, through the all_gather fallback
      std::vector<reshard::PeerBlob> out;
      for (auto p : peers(shape, i)) out.push_back({rank_at(t, p), blob(i, p, shape)});
      const auto got = reshard::exchange_with_peers(t, out, round != 3, in(20s));
      RESHARD_CONFORM(got.size() == out.size(), "rank {}: round {}: {} blobs for {} peers", t.rank(), round, got.size(), out.size());
      for (const auto& g : got) {
        const auto w = t.world_ranks();
        const auto from = static_cast<std::size_t>(std::find(w.begin(), w.end(), g.peer) - w.begin());
        const auto listed = peers(shape, i);
        RESHARD_CONFORM(std::find(listed.begin(), listed.end(), from) != listed.end(), "rank {}: round {}: a blob from unlisted rank {}",
                        t.rank(), round, g.peer);
        RESHARD_CONFORM(g.bytes == blob(from, i, shape), "rank {}: round {}: the blob from rank {} ({} bytes) is not the one it sent", t.rank(),
                        round, g.peer, g.bytes.size());
      }
    }
    t.all_gather({}, in(20s));
  }
};

/// A receive dropped unwaited and its region deregistered (what a failed
/// executor does before freeing its staging) is never written afterwards:
/// the sender, which posts only once the receiver deregistered, may complete
/// or fail by its deadline, but the bytes painted over the region after the
/// deregistration survive. On UCX's put protocol this takes the revoke
/// exchange (a ready signal was already sent; docs/design.md).
struct DeregisterEndsAccess {
  static constexpr int ranks = 2;
  static constexpr const char* name = "a deregistered region is never written again, even by an op pending on it";
  static constexpr std::size_t N = 4096;
  static constexpr unsigned char kPaint = 0xA5;
  template <class T>
  void operator()(T& t) const {
    const std::size_t i = me(t);
    std::vector<unsigned char> buf(N, 0);
    if (i == 0) fill(buf, 0, N, 77);
    const RegionHandle r = t.register_memory(buf.data(), buf.size(), MemoryKind::host);
    const TransferOp op = i == 0 ? TransferOp{OpKind::send, rank_at(t, 1), 13, r, 0, N} : TransferOp{OpKind::recv, rank_at(t, 0), 13, r, 0, N};
    t.prepare(std::span(&op, 1), in(20s));
    if (i == 1) {
      {
        auto q = t.post(std::span(&op, 1));
        reshard::flush_batch(t, in(20s));
      }  // dropped unwaited
      t.deregister_memory(r);
      std::fill(buf.begin(), buf.end(), kPaint);
      t.all_gather({}, in(20s));  // the sender posts only now
      t.all_gather({}, in(20s));  // and is done
      const auto kept = static_cast<std::size_t>(std::count(buf.begin(), buf.end(), kPaint));
      RESHARD_CONFORM(kept == N, "rank {}: {} of {} bytes of a deregistered region were written afterwards", t.rank(), N - kept, N);
      return;
    }
    t.all_gather({}, in(20s));
    const auto t0 = Clock::now();
    (void)transport_error_of([&] {  // completing (an eager send) and failing (no receive) are both allowed
      auto q = t.post(std::span(&op, 1));
      reshard::flush_batch(t, in(2s));
      t.wait(q, in(2s));
    });
    RESHARD_CONFORM(seconds_since(t0) < 6, "rank {}: the send to a dropped receive took {:.1f} s to end (deadline 2 s)", t.rank(), seconds_since(t0));
    t.all_gather({}, in(20s));
    t.deregister_memory(r);
  }
};

/// Runs one case on harness H and turns a failure into a doctest failure.
template <class H, class Case>
void check(const Case& c, H h = {}) {
  try {
    h.run(c);
  } catch (const std::exception& e) {
    FAIL_CHECK((std::string(Case::name) + ": " + e.what()));
  }
}

}  // namespace conformance

// One doctest case per rule, instantiated per harness by the including test.
TEST_CASE_TEMPLATE_DEFINE("transport conformance: sends match receives by (sender, receiver, tag), all 64 tag bits", H, conformance_matching) {
  conformance::check<H>(conformance::Matching{});
}
TEST_CASE_TEMPLATE_DEFINE("transport conformance: equal (peer, tag) pairs match in posting order", H, conformance_equal_keys) {
  conformance::check<H>(conformance::EqualKeysInOrder{});
}
TEST_CASE_TEMPLATE_DEFINE("transport conformance: a size mismatch is a TransportError on both sides", H, conformance_size_mismatch) {
  conformance::check<H>(conformance::SizeMismatch{});
}
TEST_CASE_TEMPLATE_DEFINE("transport conformance: waits throw at the deadline naming what is pending; test() never blocks", H,
                          conformance_deadlines) {
  conformance::check<H>(conformance::Deadlines{});
}
TEST_CASE_TEMPLATE_DEFINE("transport conformance: abort() fails the peers' waits and all_gathers promptly", H, conformance_abort) {
  conformance::check<H>(conformance::AbortReachesPeers{});
}
TEST_CASE_TEMPLATE_DEFINE("transport conformance: replays of prepared ops move the right bytes every time", H, conformance_replays) {
  conformance::check<H>(conformance::Replays{});
}
TEST_CASE_TEMPLATE_DEFINE("transport conformance: wait_any returns the index of a completed request", H, conformance_wait_any) {
  conformance::check<H>(conformance::WaitAny{});
}
TEST_CASE_TEMPLATE_DEFINE("transport conformance: the executor's flushed batches (receives before sends, two waves live) complete", H,
                          conformance_batches) {
  conformance::check<H>(conformance::Batches{});
}
TEST_CASE_TEMPLATE_DEFINE("transport conformance: all_gather returns the blobs in world order", H, conformance_all_gather) {
  conformance::check<H>(conformance::AllGatherOrder{});
}
TEST_CASE_TEMPLATE_DEFINE("transport conformance: the pairwise exchange delivers each peer's blob for this rank, call after call", H,
                          conformance_pairwise_exchange) {
  conformance::check<H>(conformance::PairwiseExchange{});
}
TEST_CASE_TEMPLATE_DEFINE("transport conformance: a deregistered region is never written again, even by an op pending on it", H,
                          conformance_deregister) {
  conformance::check<H>(conformance::DeregisterEndsAccess{});
}

/// Every case on every harness named.
#define RESHARD_TRANSPORT_CONFORMANCE(...)                            \
  TEST_CASE_TEMPLATE_INVOKE(conformance_matching, __VA_ARGS__);      \
  TEST_CASE_TEMPLATE_INVOKE(conformance_equal_keys, __VA_ARGS__);    \
  TEST_CASE_TEMPLATE_INVOKE(conformance_size_mismatch, __VA_ARGS__); \
  TEST_CASE_TEMPLATE_INVOKE(conformance_deadlines, __VA_ARGS__);     \
  TEST_CASE_TEMPLATE_INVOKE(conformance_abort, __VA_ARGS__);         \
  TEST_CASE_TEMPLATE_INVOKE(conformance_replays, __VA_ARGS__);       \
  TEST_CASE_TEMPLATE_INVOKE(conformance_wait_any, __VA_ARGS__);      \
  TEST_CASE_TEMPLATE_INVOKE(conformance_batches, __VA_ARGS__);       \
  TEST_CASE_TEMPLATE_INVOKE(conformance_all_gather, __VA_ARGS__);      \
  TEST_CASE_TEMPLATE_INVOKE(conformance_pairwise_exchange, __VA_ARGS__); \
  TEST_CASE_TEMPLATE_INVOKE(conformance_deregister, __VA_ARGS__)
