// The MPI bootstrap's notice board (mpi_bootstrap.hpp), under mpirun -np 3:
// a rank's post reaches every other rank's read within seconds (the NCCL
// transport's out-of-band abort in `reshard-refit --transport nccl` rides on
// it), the first text under a key stays, simultaneous posts of one key each
// land as one of the texts, an unposted key reads as nothing, and the job
// ends cleanly. Exits non-zero, naming the case, on any violation.
#include <chrono>
#include <cstdio>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "reshard/transport/mpi_bootstrap.hpp"

using namespace reshard;
using namespace std::chrono_literals;

namespace {

/// Reads `key` until it holds something or `limit` passes.
std::optional<std::string> await(Bootstrap& b, const std::string& key, std::chrono::milliseconds limit, double& seconds) {
  const auto t0 = Clock::now();
  for (;;) {
    if (auto v = b.board.read(key)) {
      seconds = std::chrono::duration<double>(Clock::now() - t0).count();
      return v;
    }
    if (Clock::now() - t0 > limit) return std::nullopt;
    std::this_thread::sleep_for(1ms);
  }
}

void barrier(Bootstrap& b) { (void)b.all_gather({}, Clock::now() + 60s, {}); }

}  // namespace

int main(int argc, char** argv) {
  MpiSession mpi(argc, argv);
  std::vector<std::string> bad;
  {
    Bootstrap b = mpi_bootstrap();
    const auto me = b.rank;
    if (b.ranks.size() != 3) bad.push_back(fmt::format("needs 3 ranks, got {}", b.ranks.size()));
    if (!b.board.valid()) bad.push_back("the MPI bootstrap has no notice board");
    if (bad.empty()) {
      double s = 0;
      // 1. One rank gives up; the others hear it.
      const std::string first = "rank 1 gave up: planted failure";
      if (me == 1) b.board.post("abort/1", first);
      const auto got = await(b, "abort/1", 10s, s);
      if (got != first) bad.push_back(fmt::format("rank {}: read '{}' for abort/1, not rank 1's post", me, got.value_or("(nothing after 10 s)")));
      else if (me != 1) std::printf("rank %lld heard rank 1 in %.3f s\n", static_cast<long long>(me), s);
      barrier(b);
      // 2. A later post under the same key changes nothing.
      if (me == 2) b.board.post("abort/1", "rank 2 gave up later");
      barrier(b);
      std::this_thread::sleep_for(200ms);
      if (b.board.read("abort/1") != first) bad.push_back(fmt::format("rank {}: a later post replaced the first text of abort/1", me));
      // 3. Two ranks post one key at once: each rank reads one of the two.
      barrier(b);
      if (me == 0 || me == 2) b.board.post("abort/2", fmt::format("rank {} gave up", me));
      const auto both = await(b, "abort/2", 10s, s);
      if (both != "rank 0 gave up" && both != "rank 2 gave up")
        bad.push_back(fmt::format("rank {}: read '{}' for abort/2", me, both.value_or("(nothing after 10 s)")));
      // 4. A key nobody posted.
      if (b.board.read("abort/never")) bad.push_back(fmt::format("rank {}: read a text for a key nobody posted", me));
      barrier(b);
    }
    // Every rank's findings, so each exits alike.
    std::string mine = bad.empty() ? "" : bad.front();
    const auto all = b.all_gather(std::as_bytes(std::span(mine.data(), mine.size())), Clock::now() + 60s, {});
    bad.clear();
    for (std::size_t i = 0; i < all.size(); ++i)
      if (!all[i].empty()) bad.emplace_back(reinterpret_cast<const char*>(all[i].data()), all[i].size());
    if (me == 0) {
      for (const auto& e : bad) std::fprintf(stderr, "mpi notice board: FAILED: %s\n", e.c_str());
      if (bad.empty()) std::printf("mpi notice board: 4 cases passed on 3 ranks\n");
    }
  }
  return bad.empty() ? 0 : 1;
}
