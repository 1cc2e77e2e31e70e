// The NCCL transport (transport/nccl.hpp): the order check prepare() runs
// over every rank's op table (CPU), the clear error without a GPU (CPU), and
// on a GPU: one rank sending to itself, refusals of host memory and of a
// communicator of the wrong size, a size mismatch caught at prepare, and a
// deadline that aborts instead of hanging.
#include <doctest/doctest.h>

#include <chrono>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "error_of.hpp"
#include "reshard/cuda/runtime.hpp"
#include "reshard/transport/nccl.hpp"

using namespace reshard;
using nccl_detail::OpRow;

namespace {

using test_util::error_of;

/// A bootstrap for one process that plays every rank of `ranks` (blob i = mine).
Bootstrap solo(std::vector<std::int64_t> ranks = {0}) {
  const std::size_t n = ranks.size();
  const std::int64_t me = ranks.front();
  return make_bootstrap(me, std::move(ranks), [n](std::span<const std::byte> mine) {
    return Blobs(n, std::vector<std::byte>(mine.begin(), mine.end()));
  });
}

}  // namespace

TEST_CASE("prepare's order check: both sides must list the same messages in the same order") {
  const std::vector<std::int64_t> world{0, 1, 2};
  std::vector<std::vector<OpRow>> t(3);
  t[0] = {{0, 1, 1, 100}, {0, 1, 2, 50}, {1, 2, 7, 8}};
  t[1] = {{1, 0, 1, 100}, {1, 0, 2, 50}};
  t[2] = {{0, 0, 7, 8}};
  CHECK(nccl_detail::check_op_tables(world, 0, t).empty());
  CHECK(nccl_detail::check_op_tables(world, 1, t).empty());
  CHECK(nccl_detail::check_op_tables(world, 2, t).empty());
  auto bad = t;
  bad[1][1].bytes = 40;  // rank 1 expects 40 bytes where rank 0 sends 50
  const std::string e = nccl_detail::check_op_tables(world, 0, bad);
  CHECK(e.find("rank 0 posts 2 sends (150 bytes) to rank 1, but rank 1 posts 2 receives (140 bytes)") != std::string::npos);
  CHECK(e.find("message 1 differs") != std::string::npos);
  CHECK(nccl_detail::check_op_tables(world, 1, bad) == e);  // the receiver fails with the same words
  auto swapped = t;
  std::swap(swapped[1][0], swapped[1][1]);
  CHECK(nccl_detail::check_op_tables(world, 1, swapped).find("message 0 differs") != std::string::npos);
  auto missing = t;
  missing[2].clear();  // rank 2 never sends what rank 0 waits for; rank 2 lists nothing, yet must fail too
  const std::string m = "rank 2 posts 0 sends (0 bytes) to rank 0, but rank 0 posts 1 receives (8 bytes) from it";
  CHECK(nccl_detail::check_op_tables(world, 0, missing).find(m) != std::string::npos);
  CHECK(nccl_detail::check_op_tables(world, 2, missing).find(m) != std::string::npos);
  CHECK(nccl_detail::check_op_tables(world, 1, missing).empty());
  auto stranger = t;
  stranger[0].push_back({0, 9, 1, 1});
  CHECK(nccl_detail::check_op_tables(world, 0, stranger).find("rank 9, which is not in the world") != std::string::npos);
}

TEST_CASE("prepare's pairwise check: this rank's ops against the rows each peer sent it") {
  auto op = [](OpKind k, std::int64_t peer, std::uint64_t tag, std::uint64_t bytes) { return TransferOp{k, peer, tag, {}, 0, bytes}; };
  auto rows_from = [](std::int64_t peer, std::vector<TransferOp> ops) { return PeerBlob{peer, nccl_detail::encode_ops(ops)}; };
  // Rank 0 sends tags 1, 2 to rank 1 and receives tag 7 from rank 2.
  const std::vector<TransferOp> mine{op(OpKind::send, 1, 1, 100), op(OpKind::send, 1, 2, 50), op(OpKind::recv, 2, 7, 8)};
  const std::vector<PeerBlob> good{rows_from(1, {op(OpKind::recv, 0, 1, 100), op(OpKind::recv, 0, 2, 50)}),
                                   rows_from(2, {op(OpKind::send, 0, 7, 8)})};
  CHECK(nccl_detail::check_peer_tables(0, mine, good).empty());
  auto swapped = good;
  swapped[0] = rows_from(1, {op(OpKind::recv, 0, 2, 50), op(OpKind::recv, 0, 1, 100)});
  CHECK(nccl_detail::check_peer_tables(0, mine, swapped).find("message 0 differs") != std::string::npos);
  // Rank 2 addressed nothing to rank 0 (the all_gather fallback leaves it out).
  const std::vector<PeerBlob> silent{good[0]};
  CHECK(nccl_detail::check_peer_tables(0, mine, silent).find("rank 2 posts 0 sends (0 bytes) to rank 0, but rank 0 posts 1 receives") !=
        std::string::npos);
  // Rank 3, which rank 0 does not list, sends it rows: named too.
  auto stranger = good;
  stranger.push_back(rows_from(3, {op(OpKind::send, 0, 9, 4)}));
  CHECK(nccl_detail::check_peer_tables(0, mine, stranger).find("rank 3 posts 1 sends (4 bytes) to rank 0, but rank 0 posts 0 receives") !=
        std::string::npos);
  // A truncated table is named by its sender.
  auto cut_short = good;
  cut_short[1].bytes.resize(cut_short[1].bytes.size() - 3);
  CHECK(error_of([&] { (void)nccl_detail::check_peer_tables(0, mine, cut_short); }).find("rank 2") != std::string::npos);
  // Ops with itself: not sent to anyone, checked against the own table.
  auto self = mine;
  self.push_back(op(OpKind::send, 0, 5, 100));
  self.push_back(op(OpKind::recv, 0, 5, 100));
  const auto out = nccl_detail::peer_blobs(0, self);
  REQUIRE(out.size() == 2);
  CHECK((out[0].peer == 1 && out[1].peer == 2));
  CHECK(nccl_detail::check_peer_tables(0, self, good).empty());
  self.back().bytes = 50;
  CHECK(nccl_detail::check_peer_tables(0, self, good).find("rank 0 posts 1 sends (100 bytes) to rank 0, but rank 0 posts 1 receives (50 bytes)") !=
        std::string::npos);
}

TEST_CASE("the op table survives the bootstrap encoding") {
  std::vector<TransferOp> ops(2);
  ops[0] = TransferOp{OpKind::send, 3, 0x10001, RegionHandle{0}, 0, 96};
  ops[1] = TransferOp{OpKind::recv, 5, 7, RegionHandle{1}, 16, 32};
  const auto rows = nccl_detail::decode_ops(nccl_detail::encode_ops(ops), 0);
  REQUIRE(rows.size() == 2);
  CHECK(rows[0].kind == 0);
  CHECK(rows[0].peer == 3);
  CHECK(rows[0].tag == 0x10001);
  CHECK(rows[1].kind == 1);
  CHECK(rows[1].bytes == 32);
  CHECK(error_of([] { nccl_detail::decode_ops(std::vector<std::byte>(5), 4); }).find("rank 4 sent an op table of another kind") != std::string::npos);
  auto short_table = nccl_detail::encode_ops(ops);
  short_table.pop_back();
  CHECK(error_of([&] { nccl_detail::decode_ops(short_table, 4); }).find("op table blob from rank 4 is truncated") != std::string::npos);
  auto long_table = nccl_detail::encode_ops(ops);
  long_table.push_back(std::byte{0});
  CHECK(error_of([&] { nccl_detail::decode_ops(long_table, 4); }).find("rank 4 sent an op table with trailing bytes") != std::string::npos);
}

TEST_CASE("all_gather blobs: data comes back unframed; a rank that gave up is found with its reason") {
  const std::vector<std::int64_t> world{4, 7, 9};
  const std::string reason = "rank 7 refit failed: boom";
  auto data = [](int k) { return std::vector<std::byte>(static_cast<std::size_t>(k), std::byte{0x33}); };
  std::vector<std::vector<std::byte>> all;
  for (int k : {3, 0, 5}) all.push_back(nccl_detail::frame_blob(nccl_detail::kData, data(k)));
  std::string why;
  CHECK(nccl_detail::unframe_blobs(all, world, 4, why) == -1);
  CHECK(all == std::vector<std::vector<std::byte>>{data(3), data(0), data(5)});  // an empty blob stays empty, in its place
  all.clear();
  all.push_back(nccl_detail::frame_blob(nccl_detail::kData, data(3)));
  all.push_back(nccl_detail::frame_blob(nccl_detail::kGaveUp, std::as_bytes(std::span(reason))));
  all.push_back(nccl_detail::frame_blob(nccl_detail::kData, data(1)));
  CHECK(nccl_detail::unframe_blobs(all, world, 4, why) == 1);
  CHECK(why == reason);
  all[0].clear();  // no header at all: another program's blob
  CHECK(error_of([&] { nccl_detail::unframe_blobs(all, world, 9, why); }).find("rank 4 sent a bootstrap blob of another kind") != std::string::npos);
}

TEST_CASE("the transport constructs where a GPU is visible, and says so where none is") {
  const std::string e = error_of([] { NcclTransport t(solo()); });
  if (cuda::visible_devices() > 0) {
    CHECK(e == "(no error)");
  } else {
    CHECK(e.find("nccl transport: rank 0: no CUDA device is visible") != std::string::npos);
    MESSAGE("no GPU: " << e);
  }
}

TEST_CASE("one rank sends to itself through NCCL" * doctest::test_suite("gpu")) {
  NcclTransport t(solo());
  const std::size_t n = 3 << 20;
  std::byte *a = nullptr, *b = nullptr;
  cuda::check_cuda(cudaMalloc(reinterpret_cast<void**>(&a), n), "cudaMalloc");
  cuda::check_cuda(cudaMalloc(reinterpret_cast<void**>(&b), n), "cudaMalloc");
  std::vector<std::byte> host(n), back(n);
  const RegionHandle ra = t.register_memory(a, n, MemoryKind::device), rb = t.register_memory(b, n, MemoryKind::device);
  // Two messages each way within one group: a 1 MiB head and the rest.
  std::vector<TransferOp> ops{{OpKind::recv, 0, 1, rb, 0, 1 << 20}, {OpKind::recv, 0, 2, rb, 1 << 20, n - (1 << 20)},
                              {OpKind::send, 0, 1, ra, 0, 1 << 20}, {OpKind::send, 0, 2, ra, 1 << 20, n - (1 << 20)}};
  const Deadline d = Clock::now() + std::chrono::seconds(60);
  t.prepare(ops, d);
  for (int rep = 0; rep < 3; ++rep) {
    CAPTURE(rep);
    // A new source each repetition, and the destination cleared: each replay is checked on its own.
    for (std::size_t i = 0; i < n; ++i) host[i] = static_cast<std::byte>(i * 13 + 1 + 7 * static_cast<std::size_t>(rep));
    cuda::check_cuda(cudaMemcpy(a, host.data(), n, cudaMemcpyHostToDevice), "cudaMemcpy");
    cuda::check_cuda(cudaMemset(b, 0, n), "cudaMemset");
    auto recv = t.post(std::span(ops).subspan(0, 2));
    auto send = t.post(std::span(ops).subspan(2, 2));
    std::vector<NcclTransport::request*> rs{&recv, &send};
    const std::size_t first = t.wait_any(rs, d);
    CHECK(first < 2);
    t.wait(recv, d);
    t.wait(send, d);
    CHECK(t.test(recv));
    cuda::check_cuda(cudaMemcpy(back.data(), b, n, cudaMemcpyDeviceToHost), "cudaMemcpy");
    CHECK(std::memcmp(back.data(), host.data(), n) == 0);
  }
  CHECK(t.stats().groups == 3);
  // Bad input.
  std::vector<std::byte> plain(64);
  CHECK(error_of([&] { t.register_memory(plain.data(), 64, MemoryKind::device); }).find("CUDA says it is ordinary (unregistered) host memory") !=
        std::string::npos);
  CHECK(error_of([&] { t.register_memory(a, n, MemoryKind::host); }).find("NCCL moves device memory only") != std::string::npos);
  std::vector<TransferOp> over{{OpKind::send, 0, 9, ra, n - 8, 16}};
  CHECK(error_of([&] { t.post(over); }).find("covers bytes") != std::string::npos);
  std::vector<TransferOp> mismatch{{OpKind::send, 0, 5, ra, 0, 100}, {OpKind::recv, 0, 5, rb, 0, 50}};
  CHECK(error_of([&] { t.prepare(mismatch, d); }).find("rank 0 posts 1 sends (100 bytes) to rank 0, but rank 0 posts 1 receives (50 bytes)") !=
        std::string::npos);
  // A receive nobody sends fails, bounded, and aborts the communicator. To
  // itself, NCCL (2.28 on an H200) refuses the group at ncclGroupEnd ("invalid
  // usage"), which the error carries; from a silent peer it would be the
  // deadline ("timed out waiting for receive of 64 bytes"), which one GPU
  // cannot show.
  std::vector<TransferOp> lonely{{OpKind::recv, 0, 77, rb, 0, 64}};
  auto r = t.post(lonely);
  const auto t0 = Clock::now();
  const std::string lonely_error = error_of([&] { t.wait(r, Clock::now() + std::chrono::milliseconds(500)); });
  MESSAGE("a receive nobody sends: " << lonely_error);
  CHECK((lonely_error.find("timed out waiting for receive of 64 bytes") != std::string::npos ||
         lonely_error.find("ncclGroupEnd failed: invalid usage") != std::string::npos));
  CHECK(lonely_error.find("the communicator was aborted") != std::string::npos);
  CHECK(Clock::now() - t0 < std::chrono::seconds(30));
  CHECK(error_of([&] { t.post(ops); }).find("aborted") != std::string::npos);
  cudaFree(a);
  cudaFree(b);
}

TEST_CASE("a caller's communicator must match the world; the transport splits its own from it and never aborts it" *
          doctest::test_suite("gpu")) {
  ncclComm_t comm = nullptr;
  int dev = 0;
  REQUIRE(ncclCommInitAll(&comm, 1, &dev) == ncclSuccess);
  const std::string e = error_of([&] { NcclTransport t(solo({0, 1}), comm); });
  CHECK(e.find("the given communicator has 1 ranks but the world (the bootstrap's rank list) has 2") != std::string::npos);
  {
    NcclTransport ok(solo({0}), comm);
    CHECK(ok.comm() != comm);  // a private communicator split from the caller's
    ok.abort("a failed refit");  // aborts the private one only
  }
  int count = 0;
  ncclResult_t state = ncclSuccess;
  CHECK(ncclCommCount(comm, &count) == ncclSuccess);
  CHECK(count == 1);
  CHECK(ncclCommGetAsyncError(comm, &state) == ncclSuccess);
  CHECK(state == ncclSuccess);  // the caller's communicator is intact
  ncclCommDestroy(comm);
}
