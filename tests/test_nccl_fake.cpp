// The NCCL transport (transport/nccl.hpp) on a CPU, over a fake NCCL and
// CUDA runtime (tests/fake_nccl/: groups cut into plans per rank past a cap,
// streams, aborts that do not reach the peers, as NCCL over NVLink). Ranks
// are threads; the bootstrap is an in-process all-gather with a notice board.
//  * Bounded groups: a batch past max_group_ops is cut into groups both ends
//    cut alike (and NCCL, splitting only past its own cap, never splits one);
//    unbounded, the fake's per-rank plans disagree and the batch hangs into
//    its deadline. Plus groups_by_round on random batches, against the
//    message identities on both ends.
//  * A borrowed communicator is split from and never aborted, whatever fails.
//  * An abort, or a rank that times out, reaches every survivor through the
//    notice board within a poll interval, naming the first rank that failed.
//  * Every call gives the caller's thread its own CUDA device back.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "fake_nccl/fake_nccl.hpp"
#include "reshard/transport/nccl.hpp"

using namespace reshard;

namespace {

/// An all-gather among threads (blob i = rank i's) with a deadline, and a notice board.
class InProcessBootstrap {
 public:
  explicit InProcessBootstrap(std::size_t n) : slots_(n) {
    for (std::size_t i = 0; i < n; ++i) ranks_.push_back(static_cast<std::int64_t>(i));
  }
  Bootstrap endpoint(std::int64_t rank, bool with_board = true) {
    Bootstrap b;
    b.rank = rank;
    b.ranks = ranks_;
    b.name = "threads";
    b.all_gather = [this, rank](std::span<const std::byte> mine, Deadline d, const Bootstrap::Idle& idle) {
      return gather(static_cast<std::size_t>(rank), mine, d, idle);
    };
    if (with_board) {
      b.board.post = [this](const std::string& key, const std::string& text) {
        std::lock_guard lk(m_);
        board_.emplace(key, text);  // the first post wins
      };
      b.board.read = [this](const std::string& key) -> std::optional<std::string> {
        std::lock_guard lk(m_);
        auto it = board_.find(key);
        if (it == board_.end()) return std::nullopt;
        return it->second;
      };
    }
    return b;
  }

 private:
  Blobs gather(std::size_t i, std::span<const std::byte> mine, Deadline d, const Bootstrap::Idle& idle) {
    std::unique_lock lk(m_);
    const std::uint64_t gen = gen_;
    slots_[i].assign(mine.begin(), mine.end());
    if (++arrived_ == slots_.size()) {
      result_ = slots_;
      arrived_ = 0;
      ++gen_;
      cv_.notify_all();
      return result_;
    }
    while (gen_ == gen) {
      cv_.wait_for(lk, std::chrono::milliseconds(20));
      if (gen_ != gen) break;
      lk.unlock();
      idle();
      lk.lock();
      if (Clock::now() >= d && gen_ == gen) throw TransportError(fmt::format("threads: rank {} timed out in all_gather", i));
    }
    return result_;
  }

  std::mutex m_;
  std::condition_variable cv_;
  std::vector<std::int64_t> ranks_;
  std::vector<std::vector<std::byte>> slots_;
  Blobs result_;
  std::size_t arrived_ = 0;
  std::uint64_t gen_ = 0;
  std::map<std::string, std::string> board_;
};

/// Runs fn(rank) on one thread per rank; returns each rank's exception text ("" if none).
template <class F>
std::vector<std::string> run_ranks(std::size_t n, F fn) {
  std::vector<std::string> errors(n);
  std::vector<std::thread> threads;
  for (std::size_t r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      try {
        fn(static_cast<std::int64_t>(r));
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  return errors;
}

/// Device memory of the fake, freed at the end of a scope.
struct DeviceBytes {
  std::byte* p = nullptr;
  std::size_t n = 0;
  explicit DeviceBytes(std::size_t bytes) : n(bytes) { REQUIRE(cudaMalloc(reinterpret_cast<void**>(&p), bytes) == cudaSuccess); }
  ~DeviceBytes() { (void)cudaFree(p); }
  DeviceBytes(const DeviceBytes&) = delete;
};

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

/// Every rank sends `per_pair` 8-byte messages to every other and receives
/// theirs, all in one batch (receives posted first), then waits for all.
/// The value of message k from s to d is s * 1'000'000 + d * 1'000 + k.
std::vector<std::string> all_to_all_batch(std::size_t n, int per_pair, NcclOptions opt, std::chrono::milliseconds timeout,
                                          std::int64_t* wrong) {
  InProcessBootstrap boot(n);
  std::atomic<std::int64_t> bad{0};
  auto errors = run_ranks(n, [&](std::int64_t me) {
    NcclTransport t(boot.endpoint(me), opt);
    const std::size_t peers = n - 1, count = peers * static_cast<std::size_t>(per_pair);
    DeviceBytes out(count * 8), in(count * 8);
    const RegionHandle ro = t.register_memory(out.p, out.n, MemoryKind::device);
    const RegionHandle ri = t.register_memory(in.p, in.n, MemoryKind::device);
    std::vector<TransferOp> recvs, sends;
    std::size_t slot = 0;
    for (std::int64_t p = 0; p < static_cast<std::int64_t>(n); ++p) {
      if (p == me) continue;
      for (int k = 0; k < per_pair; ++k, ++slot) {
        const std::int64_t v = me * 1'000'000 + p * 1'000 + k;
        std::memcpy(out.p + 8 * slot, &v, 8);
        recvs.push_back(TransferOp{OpKind::recv, p, static_cast<std::uint64_t>(k), ri, 8 * slot, 8});
        sends.push_back(TransferOp{OpKind::send, p, static_cast<std::uint64_t>(k), ro, 8 * slot, 8});
      }
    }
    auto r1 = t.post(recvs);
    auto r2 = t.post(sends);
    const Deadline d = Clock::now() + timeout;
    t.flush(d);
    t.wait(r1, d);
    t.wait(r2, d);
    slot = 0;
    for (std::int64_t p = 0; p < static_cast<std::int64_t>(n); ++p) {
      if (p == me) continue;
      for (int k = 0; k < per_pair; ++k, ++slot) {
        std::int64_t v = 0;
        std::memcpy(&v, in.p + 8 * slot, 8);
        if (v != p * 1'000'000 + me * 1'000 + k) ++bad;
      }
    }
  });
  *wrong = bad;
  return errors;
}

std::string joined(const std::vector<std::string>& v) {
  std::string s;
  for (std::size_t i = 0; i < v.size(); ++i)
    if (!v[i].empty()) s += fmt::format("[{}] {}\n", i, v[i]);
  return s;
}

}  // namespace

TEST_CASE("groups_by_round: both ends put every message into the same group, no group past the cap") {
  std::mt19937_64 rng(7);
  for (int trial = 0; trial < 200; ++trial) {
    const int n = 2 + static_cast<int>(rng() % 12);
    const std::size_t cap = 2 + rng() % 40;
    // counts[s][d]: messages s sends d in this batch.
    std::vector<std::vector<int>> counts(static_cast<std::size_t>(n), std::vector<int>(static_cast<std::size_t>(n), 0));
    for (int s = 0; s < n; ++s)
      for (int d = 0; d < n; ++d)
        if (s != d && rng() % 3) counts[s][d] = static_cast<int>(rng() % 30);
    // Per rank: its ops in a shuffled-by-peer posting order (receives first or not), and each op's message identity.
    std::map<std::tuple<int, int, int>, std::pair<std::size_t, std::size_t>> group_at;  // (src, dst, k) -> (group at src, at dst)
    for (int me = 0; me < n; ++me) {
      std::vector<std::pair<int, bool>> ops;
      std::vector<std::tuple<int, int, int>> ids;
      std::vector<int> peers;
      for (int p = 0; p < n; ++p)
        if (p != me) peers.push_back(p);
      std::shuffle(peers.begin(), peers.end(), rng);
      const bool recvs_first = rng() % 2;
      for (int pass = 0; pass < 2; ++pass) {
        const bool send = (pass == 0) != recvs_first;
        for (int p : peers)
          for (int k = 0; k < (send ? counts[me][p] : counts[p][me]); ++k) {
            ops.emplace_back(p, send);
            ids.emplace_back(send ? me : p, send ? p : me, k);
          }
      }
      const auto groups = nccl_detail::groups_by_round(me, n, ops, cap);
      std::size_t covered = 0;
      for (std::size_t g = 0; g < groups.size(); ++g) {
        CHECK(groups[g].ops.size() <= cap);
        if (g) CHECK(groups[g].index > groups[g - 1].index);
        std::map<std::pair<int, bool>, int> last;  // a pair's ops keep their order within a group
        for (std::size_t k : groups[g].ops) {
          ++covered;
          const auto& [s, d, idx] = ids[k];
          auto [it, fresh] = last.emplace(ops[k], idx);
          if (!fresh) CHECK(idx > it->second);
          it->second = idx;
          (ops[k].second ? group_at[ids[k]].first : group_at[ids[k]].second) = groups[g].index + 1;
        }
      }
      CHECK(covered == ops.size());
    }
    for (const auto& [id, at] : group_at) {
      CAPTURE(std::get<0>(id));
      CAPTURE(std::get<1>(id));
      CHECK(at.first == at.second);  // the sender's group of the message is the receiver's
    }
  }
}

TEST_CASE("nccl on the fake: a batch past max_group_ops is cut into groups both ends cut alike; unbounded it hangs into the deadline") {
  fake_nccl::fabric().reset();
  fake_nccl::fabric().plan_cap = 64;  // NCCL cuts a group past this into plans per rank
  NcclOptions opt;
  opt.max_group_ops = 64;
  std::int64_t wrong = -1;
  auto errors = all_to_all_batch(3, 100, opt, std::chrono::seconds(20), &wrong);  // 400 ops a rank in one batch
  CHECK(joined(errors) == "");
  CHECK(wrong == 0);
  CHECK(fake_nccl::fabric().most_plans == 1);  // no group reached NCCL's own cut
  // The control: unbounded, NCCL's per-rank plans disagree (each rank's first
  // plan holds only receives) and every rank waits out its deadline, naming the pair.
  fake_nccl::fabric().reset();
  fake_nccl::fabric().plan_cap = 64;
  opt.max_group_ops = 0;
  const auto t0 = Clock::now();
  errors = all_to_all_batch(2, 100, opt, std::chrono::milliseconds(800), &wrong);
  CHECK(seconds_since(t0) < 15);
  CHECK(fake_nccl::fabric().most_plans > 1);
  // Each rank times out on its own, or hears first that its peer did (the
  // notice board): either way the pair and the pending receive are named.
  for (std::size_t r = 0; r < 2; ++r) {
    CAPTURE(errors[r]);
    const bool own = errors[r].find(fmt::format("rank {} timed out waiting for receive of 8 bytes from rank {}", r, 1 - r)) != std::string::npos;
    const bool heard = errors[r].find(fmt::format("rank {} gave up: nccl transport: rank {} timed out waiting for receive of 8 bytes from rank {}",
                                                  1 - r, 1 - r, r)) != std::string::npos;
    CHECK((own || heard));
  }
  CHECK(NcclOptions{}.max_group_ops == 256);
}

TEST_CASE("nccl on the fake: a borrowed communicator is split from and never aborted") {
  fake_nccl::fabric().reset();
  InProcessBootstrap boot(2);
  ncclUniqueId id{};
  REQUIRE(ncclGetUniqueId(&id) == ncclSuccess);
  std::vector<ncclComm_t> caller(2, nullptr), own(2, nullptr);
  std::atomic<bool> timed_out{false};
  auto errors = run_ranks(2, [&](std::int64_t me) {
    REQUIRE(ncclCommInitRank(&caller[me], 2, id, static_cast<int>(me)) == ncclSuccess);
    NcclTransport t(boot.endpoint(me), caller[me]);
    own[me] = t.comm();
    CHECK(t.comm() != caller[me]);
    DeviceBytes buf(64);
    const RegionHandle h = t.register_memory(buf.p, buf.n, MemoryKind::device);
    // Rank 0 waits for a message rank 1 never sends: a timeout, then an abort.
    if (me == 0) {
      const TransferOp op{OpKind::recv, 1, 5, h, 0, 64};
      auto r = t.post(std::span(&op, 1));
      t.flush(Clock::now() + std::chrono::seconds(5));
      std::string what;
      try {
        t.wait(r, Clock::now() + std::chrono::milliseconds(300));
      } catch (const TransportError& e) {
        what = e.what();
      }
      CHECK(what.find("timed out") != std::string::npos);
      timed_out = true;
    }
    while (!timed_out) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    t.abort("the refit failed");
  });
  CHECK(joined(errors) == "");
  for (int r = 0; r < 2; ++r) {
    CAPTURE(r);
    CHECK(fake_nccl::fabric().was_aborted(own[r]));      // its own: yes
    CHECK_FALSE(fake_nccl::fabric().was_aborted(caller[r]));  // the caller's: never
  }
  // The caller's communicator still moves data.
  errors = run_ranks(2, [&](std::int64_t me) {
    cudaStream_t s = nullptr;
    REQUIRE(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess);
    DeviceBytes b(8);
    std::int64_t v = 40 + me;
    std::memcpy(b.p, &v, 8);
    REQUIRE(ncclGroupStart() == ncclSuccess);
    if (me == 0) REQUIRE(ncclSend(b.p, 8, ncclUint8, 1, caller[0], s) == ncclSuccess);
    else REQUIRE(ncclRecv(b.p, 8, ncclUint8, 0, caller[1], s) == ncclSuccess);
    REQUIRE(ncclGroupEnd() == ncclSuccess);
    REQUIRE(cudaStreamSynchronize(s) == cudaSuccess);
    std::memcpy(&v, b.p, 8);
    CHECK(v == 40);
    (void)cudaStreamDestroy(s);
  });
  CHECK(joined(errors) == "");
}

TEST_CASE("nccl on the fake: a borrowed communicator of the wrong size fails construction on every rank, and is not aborted") {
  fake_nccl::fabric().reset();
  InProcessBootstrap boot(2);
  ncclUniqueId id{};
  REQUIRE(ncclGetUniqueId(&id) == ncclSuccess);
  std::vector<ncclComm_t> caller(2, nullptr);
  const auto errors = run_ranks(2, [&](std::int64_t me) {
    REQUIRE(ncclCommInitRank(&caller[me], 3, id, static_cast<int>(me)) == ncclSuccess);  // 3 ranks: not this world
    NcclTransport t(boot.endpoint(me), caller[me]);
  });
  CHECK(errors[0].find("the given communicator has 3 ranks but the world (the bootstrap's rank list) has 2") != std::string::npos);
  CHECK(errors[1].find("has 3 ranks") != std::string::npos);
  CHECK(fake_nccl::fabric().abort_count() == 0);
}

TEST_CASE("nccl on the fake: an abort reaches every survivor through the notice board, naming the first failed rank") {
  // Ranks 1 and 2 wait (deadline 25 s) for messages from rank 0, which
  // gives up instead: by abort(), or by timing out on its own wait.
  for (bool by_timeout : {false, true}) {
    CAPTURE(by_timeout);
    fake_nccl::fabric().reset();
    InProcessBootstrap boot(3);
    std::vector<double> failed_after(3, 0);
    const auto t0 = Clock::now();
    const auto errors = run_ranks(3, [&](std::int64_t me) {
      NcclTransport t(boot.endpoint(me));
      DeviceBytes buf(16);
      const RegionHandle h = t.register_memory(buf.p, buf.n, MemoryKind::device);
      try {
        if (me == 0) {
          if (by_timeout) {
            const TransferOp op{OpKind::recv, 1, 9, h, 0, 16};  // rank 1 never sends it
            auto r = t.post(std::span(&op, 1));
            t.wait(r, Clock::now() + std::chrono::milliseconds(400));
          } else {
            std::this_thread::sleep_for(std::chrono::milliseconds(400));
            t.abort("its GPU fell off the bus");
            throw TransportError("rank 0 aborted");
          }
        } else {
          const TransferOp op{OpKind::recv, 0, 1, h, 0, 16};
          auto r = t.post(std::span(&op, 1));
          t.wait(r, Clock::now() + std::chrono::seconds(25));
        }
      } catch (...) {
        failed_after[static_cast<std::size_t>(me)] = seconds_since(t0);
        throw;
      }
    });
    for (std::size_t r = 1; r < 3; ++r) {
      CAPTURE(r);
      CAPTURE(errors[r]);
      CHECK(failed_after[r] > 0);
      CHECK(failed_after[r] < 5);  // not the 25 s deadline
      CHECK(errors[r].find("rank 0 gave up") != std::string::npos);
      CHECK(errors[r].find(by_timeout ? "timed out waiting for receive of 16 bytes from rank 1" : "its GPU fell off the bus") !=
            std::string::npos);
      CHECK(errors[r].find("notice board") != std::string::npos);
    }
  }
}

TEST_CASE("nccl on the fake: without a notice board the survivors learn only at their deadline (the control)") {
  fake_nccl::fabric().reset();
  InProcessBootstrap boot(2);
  const auto errors = run_ranks(2, [&](std::int64_t me) {
    NcclTransport t(boot.endpoint(me, false));
    DeviceBytes buf(16);
    const RegionHandle h = t.register_memory(buf.p, buf.n, MemoryKind::device);
    if (me == 0) {
      t.abort("gone");
      return;
    }
    const TransferOp op{OpKind::recv, 0, 1, h, 0, 16};
    auto r = t.post(std::span(&op, 1));
    t.wait(r, Clock::now() + std::chrono::milliseconds(600));
  });
  CHECK(errors[1].find("timed out") != std::string::npos);
  CHECK(errors[1].find("gave up") == std::string::npos);
}

TEST_CASE("nccl on the fake: every call gives the caller's thread its own device back") {
  fake_nccl::fabric().reset();
  fake_nccl::fabric().device_count = 2;
  InProcessBootstrap boot(2);
  NcclOptions opt;
  opt.device = 0;
  const auto errors = run_ranks(2, [&](std::int64_t me) {
    REQUIRE(cudaSetDevice(1) == cudaSuccess);  // the caller's thread works on GPU 1
    auto current = [] {
      int d = -1;
      (void)cudaGetDevice(&d);
      return d;
    };
    NcclTransport t(boot.endpoint(me), opt);
    CHECK(t.device() == 0);
    CHECK(current() == 1);
    REQUIRE(cudaSetDevice(0) == cudaSuccess);
    DeviceBytes buf(16);  // (the fake's memory is on "device 0" whatever is current)
    REQUIRE(cudaSetDevice(1) == cudaSuccess);
    const RegionHandle h = t.register_memory(buf.p, buf.n, MemoryKind::device);
    CHECK(current() == 1);
    const std::int64_t peer = 1 - me;
    const TransferOp ops[2] = {{OpKind::recv, peer, 0, h, 8, 8}, {OpKind::send, peer, 0, h, 0, 8}};
    auto r = t.post(ops);
    t.flush(Clock::now() + std::chrono::seconds(10));
    CHECK(current() == 1);
    t.wait(r, Clock::now() + std::chrono::seconds(10));
    const std::vector<PeerBlob> out{PeerBlob{peer, std::vector<std::byte>(3, std::byte{7})}};
    const auto got = t.exchange(out, Clock::now() + std::chrono::seconds(10));
    CHECK(got.size() == 1);
    CHECK(got[0] == out[0].bytes);
    CHECK(current() == 1);
  });
  CHECK(joined(errors) == "");
  fake_nccl::fabric().device_count = 1;
}
