// LocalWorld's deregistration: once deregister_memory returns, no thread of
// the world touches the region again, whatever was pending on it. A rank
// whose refit failed drops its requests unwaited and frees its staging right
// after (Executor::release); a peer still copying into it would write freed
// memory (what ASan once caught in test_staged_executor).
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "reshard/transport/local.hpp"

using namespace reshard;

namespace {

constexpr std::size_t kBytes = 1u << 20;
constexpr std::size_t kTask = 4096;  // 256 copy tasks per message
constexpr unsigned char kCanary = 0xAB;

std::atomic<int> copies_started{0};

/// The world's copy: the first task sleeps, so the receiver deregisters while
/// a copy into its region is running and more tasks are queued behind it.
void slow_first_copy(void* to, const void* from, std::size_t bytes) {
  if (copies_started.fetch_add(1) == 0) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  std::memcpy(to, from, bytes);
}

void spin_until(const std::atomic<bool>& flag) {
  while (!flag.load()) std::this_thread::sleep_for(std::chrono::microseconds(100));
}

bool all_canary(const std::vector<unsigned char>& b) {
  for (unsigned char c : b)
    if (c != kCanary) return false;
  return true;
}

TransferOp op_of(OpKind kind, std::int64_t peer, RegionHandle region) {
  TransferOp op;
  op.kind = kind;
  op.peer = peer;
  op.tag = 7;
  op.region = region;
  op.offset = 0;
  op.bytes = kBytes;
  return op;
}

/// Rank 0 sends kBytes to rank 1. Rank 1 posts its receive, waits for
/// `ready_to_drop` (or not), drops the request and deregisters, then paints
/// its buffer with the canary. Returns rank 0's error ("" when its send
/// completed) and whether the canary survived rank 0's whole wait.
struct DropOutcome {
  std::string sender_error;
  bool canary_intact = false;
};
DropOutcome drop_receive(bool matched_first) {
  copies_started = 0;
  LocalWorldOptions opt;
  opt.copy_threads = 1;
  opt.task_bytes = kTask;
  opt.copy = slow_first_copy;
  LocalWorld world({0, 1}, opt);
  std::atomic<bool> receiver_posted{false}, receiver_dropped{false}, sender_done{false};
  DropOutcome out;
  world.run([&](LocalTransport& t) {
    if (t.rank() == 0) {
      std::vector<unsigned char> src(kBytes, 0x11);
      const RegionHandle r = t.register_memory(src.data(), src.size(), MemoryKind::host);
      spin_until(matched_first ? receiver_posted : receiver_dropped);
      const TransferOp op = op_of(OpKind::send, 1, r);
      auto req = t.post(std::span(&op, 1));
      try {
        t.wait(req, Clock::now() + std::chrono::milliseconds(matched_first ? 5000 : 300));
      } catch (const TransportError& e) {
        out.sender_error = e.what();
      }
      sender_done = true;
      t.deregister_memory(r);
    } else {
      std::vector<unsigned char> dst(kBytes, 0);
      const RegionHandle r = t.register_memory(dst.data(), dst.size(), MemoryKind::host);
      const TransferOp op = op_of(OpKind::recv, 0, r);
      auto req = t.post(std::span(&op, 1));
      receiver_posted = true;
      if (matched_first)
        while (copies_started.load() == 0) std::this_thread::sleep_for(std::chrono::microseconds(100));
      req.reset();  // dropped unwaited, as the executor does after a failure
      t.deregister_memory(r);
      std::memset(dst.data(), kCanary, dst.size());
      receiver_dropped = true;
      spin_until(sender_done);
      out.canary_intact = all_canary(dst);
    }
  });
  return out;
}

}  // namespace

TEST_CASE("local transport: deregistering a region under a running copy cancels the rest and fails the peer") {
  const DropOutcome o = drop_receive(true);
  CHECK(o.canary_intact);
  CHECK(o.sender_error.find("rank 1 deregistered region") != std::string::npos);
  CHECK(o.sender_error.find("receive of 1048576 bytes from rank 0 at rank 1") != std::string::npos);
  CHECK(copies_started.load() < static_cast<int>(kBytes / kTask));  // the queued tasks were dropped, not run
}

TEST_CASE("local transport: a receive dropped and deregistered before its send arrives never matches it") {
  const DropOutcome o = drop_receive(false);
  CHECK(o.canary_intact);
  CHECK(o.sender_error.find("timed out") != std::string::npos);  // the send waits for a receive that is gone
  CHECK(copies_started.load() == 0);
}
