#pragma once
// Bootstrap through MPI (a job launched by mpirun): global rank = MPI rank of
// the communicator, blobs exchanged with nonblocking MPI_Iallgather(v) so a
// deadline is honoured (MPI has none) and the transport keeps progressing
// its own network while MPI waits. The only reshard header that includes
// mpi.h; link MPI::MPI_CXX (or MPI::MPI_C).
//
//   reshard::MpiSession mpi(argc, argv);            // MPI_Init / MPI_Finalize
//   reshard::UcxTransport t(reshard::mpi_bootstrap());
//
// Failures (a rank that never joins, an MPI error) throw TransportError; the
// communicator then has a collective outstanding, so the job should end.
//
// Its notice board (bootstrap.hpp) is point-to-point MPI on a communicator of
// its own: post() sends the text to every other rank at once (nonblocking),
// read() takes what has arrived (MPI_Iprobe), so a rank that gave up (an
// NCCL abort, a timeout) reaches its peers within their next board read.
// The first text a rank posted or received under a key stays; two ranks
// posting one key at once may each be first somewhere. Like the all-gather,
// call it from the thread that drives MPI (MPI_THREAD_FUNNELED).
// The C API only (Open MPI's / MPICH's C++ bindings are deprecated and warn).
#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1
#endif
#ifndef MPICH_SKIP_MPICXX
#define MPICH_SKIP_MPICXX 1
#endif
#include <mpi.h>
#include <time.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <numeric>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "../base/error.hpp"
#include "bootstrap.hpp"

namespace reshard {

namespace mpi_detail {

inline std::string error_text(int code) {
  char s[MPI_MAX_ERROR_STRING];
  int n = 0;
  if (MPI_Error_string(code, s, &n) != MPI_SUCCESS) return fmt::format("MPI error {}", code);
  return std::string(s, static_cast<std::size_t>(n));
}

/// The communicator the bootstrap owns (a duplicate, errors returned).
struct Comm {
  MPI_Comm comm = MPI_COMM_NULL;
  int rank = -1, size = 0;
  bool broken = false;  ///< a collective was abandoned at a deadline
  ~Comm() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized && !broken && comm != MPI_COMM_NULL) MPI_Comm_free(&comm);
  }
};

/// The notice board's state (see the top): texts by key, first seen wins,
/// and the sends still in flight with their bytes.
struct Board {
  static constexpr int kTag = 0x5242;
  static constexpr std::size_t kMaxText = 2000;  ///< small messages: MPI sends them eagerly
  MPI_Comm comm = MPI_COMM_NULL;
  int rank = -1, size = 0;
  std::map<std::string, std::string> seen;
  std::vector<std::unique_ptr<std::string>> bytes;  ///< one message per post, alive until its sends complete
  std::vector<MPI_Request> sends;
  ~Board() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized || comm == MPI_COMM_NULL) return;
    settle();
    if (sends.empty()) {
      MPI_Comm_free(&comm);
      return;
    }
    // A peer never took a post (it ended first): MPI may still read the
    // bytes, so they are left to the process's end, as the communicator is.
    for (auto& r : sends) MPI_Request_free(&r);
    static_cast<void>(new std::vector<std::unique_ptr<std::string>>(std::move(bytes)));
  }
  /// Drops the sends that completed.
  void settle() {
    std::size_t k = 0;
    for (auto& r : sends) {
      int done = 0;
      if (MPI_Test(&r, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS || !done) sends[k++] = r;
    }
    sends.resize(k);
    if (sends.empty()) bytes.clear();
  }
  /// Takes every board message that has arrived.
  void receive() {
    for (;;) {
      int flag = 0;
      MPI_Status st;
      if (MPI_Iprobe(MPI_ANY_SOURCE, kTag, comm, &flag, &st) != MPI_SUCCESS || !flag) return;
      int n = 0;
      MPI_Get_count(&st, MPI_BYTE, &n);
      std::string m(static_cast<std::size_t>(std::max(n, 0)), '\0');
      if (MPI_Recv(m.data(), n, MPI_BYTE, st.MPI_SOURCE, kTag, comm, MPI_STATUS_IGNORE) != MPI_SUCCESS) return;
      const auto z = m.find('\0');
      if (z != std::string::npos) seen.emplace(m.substr(0, z), m.substr(z + 1));
    }
  }
  void post(const std::string& key, const std::string& text) {
    receive();
    settle();
    if (!seen.emplace(key, text).second) return;  // this rank already knows a first text for the key
    auto m = std::make_unique<std::string>(key);
    m->push_back('\0');
    m->append(text.substr(0, kMaxText));
    for (int r = 0; r < size; ++r) {
      if (r == rank) continue;
      MPI_Request req;
      if (MPI_Isend(m->data(), static_cast<int>(m->size()), MPI_BYTE, r, kTag, comm, &req) == MPI_SUCCESS) sends.push_back(req);
    }
    bytes.push_back(std::move(m));
  }
  std::optional<std::string> read(const std::string& key) {
    receive();
    settle();
    auto it = seen.find(key);
    if (it == seen.end()) return std::nullopt;
    return it->second;
  }
};

/// Waits for an MPI request with a deadline, calling idle() meanwhile.
inline void wait(Comm& c, MPI_Request& req, Deadline deadline, const Bootstrap::Idle& idle, const char* what) {
  long sleep_ns = 1'000;
  while (true) {
    int done = 0;
    const int rc = MPI_Test(&req, &done, MPI_STATUS_IGNORE);
    if (rc != MPI_SUCCESS) {
      c.broken = true;
      throw TransportError(fmt::format("MPI bootstrap: rank {}: {} failed: {}", c.rank, what, error_text(rc)));
    }
    if (done) return;
    if (idle) {
      try {
        idle();
      } catch (...) {
        c.broken = true;  // the collective stays outstanding
        throw;
      }
    }
    if (Clock::now() >= deadline) {
      c.broken = true;
      throw TransportError(fmt::format("MPI bootstrap: rank {}: {} timed out: some rank of the {} did not join (dead, stuck, or not "
                                       "running the same program)",
                                       c.rank, what, c.size));
    }
    timespec ts{0, sleep_ns};
    nanosleep(&ts, nullptr);
    sleep_ns = std::min<long>(sleep_ns * 2, 200'000);
  }
}

}  // namespace mpi_detail

/// A bootstrap over `comm` (MPI must be initialized): rank = MPI rank,
/// ranks = 0 .. size-1.
inline Bootstrap mpi_bootstrap(MPI_Comm comm = MPI_COMM_WORLD) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) fail("MPI bootstrap: MPI is not initialized (call MPI_Init first, or use reshard::MpiSession)");
  auto c = std::make_shared<mpi_detail::Comm>();
  int rc = MPI_Comm_dup(comm, &c->comm);
  if (rc != MPI_SUCCESS) fail("MPI bootstrap: MPI_Comm_dup failed: {}", mpi_detail::error_text(rc));
  MPI_Comm_set_errhandler(c->comm, MPI_ERRORS_RETURN);
  MPI_Comm_rank(c->comm, &c->rank);
  MPI_Comm_size(c->comm, &c->size);
  auto board = std::make_shared<mpi_detail::Board>();
  rc = MPI_Comm_dup(comm, &board->comm);
  if (rc != MPI_SUCCESS) fail("MPI bootstrap: MPI_Comm_dup (notice board) failed: {}", mpi_detail::error_text(rc));
  MPI_Comm_set_errhandler(board->comm, MPI_ERRORS_RETURN);
  board->rank = c->rank;
  board->size = c->size;
  Bootstrap b;
  b.name = "mpi";
  b.rank = c->rank;
  b.board.post = [board](const std::string& key, const std::string& text) { board->post(key, text); };
  b.board.read = [board](const std::string& key) { return board->read(key); };
  b.ranks.resize(static_cast<std::size_t>(c->size));
  std::iota(b.ranks.begin(), b.ranks.end(), std::int64_t{0});
  b.all_gather = [c](std::span<const std::byte> mine, Deadline deadline, const Bootstrap::Idle& idle) -> Blobs {
    if (c->broken) throw TransportError(fmt::format("MPI bootstrap: rank {}: an earlier all-gather failed; the communicator is unusable", c->rank));
    if (mine.size() > static_cast<std::size_t>(INT32_MAX))
      throw TransportError(fmt::format("MPI bootstrap: rank {}: a blob of {} bytes is too large", c->rank, mine.size()));
    const auto n = static_cast<std::size_t>(c->size);
    std::vector<int> sizes(n, 0);
    int my = static_cast<int>(mine.size());
    MPI_Request req;
    int rc2 = MPI_Iallgather(&my, 1, MPI_INT, sizes.data(), 1, MPI_INT, c->comm, &req);
    if (rc2 != MPI_SUCCESS) throw TransportError(fmt::format("MPI bootstrap: MPI_Iallgather failed: {}", mpi_detail::error_text(rc2)));
    mpi_detail::wait(*c, req, deadline, idle, "an all-gather of blob sizes");
    std::vector<int> displs(n, 0);
    std::int64_t total = 0;
    for (std::size_t i = 0; i < n; ++i) {
      displs[i] = static_cast<int>(total);
      total += sizes[i];
      if (total > INT32_MAX) throw TransportError(fmt::format("MPI bootstrap: rank {}: the blobs of all ranks exceed 2 GiB", c->rank));
    }
    std::vector<std::byte> all(static_cast<std::size_t>(total));
    rc2 = MPI_Iallgatherv(mine.data(), my, MPI_BYTE, all.data(), sizes.data(), displs.data(), MPI_BYTE, c->comm, &req);
    if (rc2 != MPI_SUCCESS) throw TransportError(fmt::format("MPI bootstrap: MPI_Iallgatherv failed: {}", mpi_detail::error_text(rc2)));
    mpi_detail::wait(*c, req, deadline, idle, "an all-gather of blobs");
    Blobs out(n);
    for (std::size_t i = 0; i < n; ++i)
      out[i].assign(all.begin() + displs[i], all.begin() + displs[i] + sizes[i]);
    return out;
  };
  return b;
}

/// MPI_Init on construction (if MPI is not initialized yet), MPI_Finalize on
/// destruction (if this object initialized it).
class MpiSession {
 public:
  MpiSession(int& argc, char**& argv) {
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (!initialized) {
      int provided = 0;
      const int rc = MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
      if (rc != MPI_SUCCESS) fail("MPI_Init failed: {}", mpi_detail::error_text(rc));
      owner_ = true;
    }
    MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
    MPI_Comm_size(MPI_COMM_WORLD, &size_);
  }
  MpiSession(const MpiSession&) = delete;
  MpiSession& operator=(const MpiSession&) = delete;
  ~MpiSession() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (owner_ && !finalized) MPI_Finalize();
  }
  int rank() const { return rank_; }
  int size() const { return size_; }

 private:
  bool owner_ = false;
  int rank_ = 0, size_ = 1;
};

}  // namespace reshard
