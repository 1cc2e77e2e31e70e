// The transport conformance suite (transport_conformance.hpp) on
// mpi_transport.hpp, a transport written from transport.hpp's contract alone
// over MPI_Isend / MPI_Irecv. Run under mpirun with at least 3 ranks; each
// case runs on the first `ranks` of them (a sub-communicator), the others
// sit it out. Prints one line per case on rank 0; exits non-zero if any
// rank found a violation.
#define DOCTEST_CONFIG_DISABLE  // the cases only, not their doctest registrations
#include <mpi.h>

#include <cstdio>
#include <type_traits>

#include "mpi_transport.hpp"
#include "transport_conformance.hpp"

using namespace std::chrono_literals;

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int me = 0, n = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &me);
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  bool ok = n >= 3;
  if (!ok && me == 0) std::fprintf(stderr, "mpi transport conformance: needs at least 3 ranks, got %d\n", n);
  auto run_case = [&](const auto& c) {
    using Case = std::decay_t<decltype(c)>;
    MPI_Comm sub = MPI_COMM_NULL;
    MPI_Comm_split(MPI_COMM_WORLD, me < Case::ranks ? 0 : MPI_UNDEFINED, me, &sub);
    std::string err;
    const auto t0 = reshard::Clock::now();
    if (sub != MPI_COMM_NULL) {
      {
        mpi_transport::MpiTransport t(sub);
        try {
          c(t);
        } catch (const std::exception& e) {
          err = e.what();
          t.abort(e.what());  // the others fail fast instead of at their deadlines
        }
        try {
          t.all_gather({}, reshard::Clock::now() + 10s);  // nobody tears down while a peer still talks to it
        } catch (const reshard::TransportError&) {
          // aborted (the abort case, or a violation): fails at once
        }
      }
      MPI_Comm_free(&sub);
    }
    int bad = err.empty() ? 0 : 1, any = 0;
    MPI_Allreduce(&bad, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    if (!err.empty()) std::fprintf(stderr, "rank %d: %s: %s\n", me, Case::name, err.c_str());
    if (me == 0) std::printf("%s %s (%.2f s)\n", any ? "FAIL" : "ok  ", Case::name, conformance::seconds_since(t0));
    std::fflush(stdout);
    ok &= !any;
  };
  if (ok) {
    run_case(conformance::Matching{});
    run_case(conformance::EqualKeysInOrder{});
    run_case(conformance::SizeMismatch{});
    run_case(conformance::Deadlines{});
    run_case(conformance::AbortReachesPeers{});
    run_case(conformance::Replays{});
    run_case(conformance::WaitAny{});
    run_case(conformance::Batches{});
    run_case(conformance::AllGatherOrder{});
    run_case(conformance::PairwiseExchange{});
    run_case(conformance::DeregisterEndsAccess{});
  }
  MPI_Finalize();
  return ok ? 0 : 1;
}
