// A rank SIGKILLed in the middle of an exchange over the MPI transport
// (mpi_transport.hpp), under mpirun -np 3: what the survivors see.
// Open MPI 4.1 has no fault tolerance (no ULFM): MPI calls with a dead peer
// may hang, so the transport cannot name it; mpirun notices the death and
// terminates the job. tests/mpi_conformance.cmake runs this and checks the
// job ends (non-zero) within 30 s of the kill and mpirun's report names the
// dead rank, though every survivor waits with a 300 s deadline.
#include <mpi.h>
#include <signal.h>

#include <chrono>
#include <cstdio>
#include <vector>

#include "mpi_transport.hpp"

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int me = 0, n = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &me);
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  {
    mpi_transport::MpiTransport t(MPI_COMM_WORLD);
    std::vector<unsigned char> buf(1 << 20, 1);
    const auto r = t.register_memory(buf.data(), buf.size(), reshard::MemoryKind::host);
    // A ring: every rank sends to the next and receives from the previous.
    const std::vector<reshard::TransferOp> ops = {{reshard::OpKind::recv, (me + n - 1) % n, 7, r, 0, buf.size() / 2},
                                                  {reshard::OpKind::send, (me + 1) % n, 7, r, buf.size() / 2, buf.size() / 2}};
    t.prepare(ops, reshard::Clock::now() + std::chrono::seconds(30));
    t.all_gather({}, reshard::Clock::now() + std::chrono::seconds(30));
    if (me == 1) {
      std::printf("rank 1: killing myself (SIGKILL)\n");
      std::fflush(stdout);
      raise(SIGKILL);
    }
    auto q = t.post(ops);
    try {
      t.wait(q, reshard::Clock::now() + std::chrono::seconds(300));
      std::printf("rank %d: the exchange completed without rank 1\n", me);
    } catch (const std::exception& e) {
      std::printf("rank %d: failed: %s\n", me, e.what());
    }
    std::fflush(stdout);
  }
  MPI_Finalize();
  return 0;
}
