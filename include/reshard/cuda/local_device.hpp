#pragma once
// The in-process transport (backends/local.hpp) for ranks as threads that
// share one GPU: device buffers must be CUDA managed memory
// (cudaMallocManaged), because the in-process "network" copies with the CPU.
// Everything else is LocalTransport's. For tests and the device check: real
// multi-GPU refits use the NCCL (or a CUDA-enabled UCX) transport.
//
//   LocalWorld world(ranks);
//   world.run([&](LocalTransport& lt) {
//     reshard::cuda::LocalDeviceTransport t(lt);
//     ... Resharder<Layout, LocalDeviceTransport> over managed device buffers ...
//   });
//
// Plain C++; link CUDA::cudart.
#include <cuda_runtime.h>

#include "../backends/local.hpp"
#include "runtime.hpp"

namespace reshard::cuda {

class LocalDeviceTransport {
 public:
  using request = LocalTransport::request;

  explicit LocalDeviceTransport(LocalTransport t) : t_(t) {}

  std::int64_t rank() const { return t_.rank(); }
  std::span<const std::int64_t> world_ranks() const { return t_.world_ranks(); }
  std::string_view name() const { return "local-device"; }

  RegionHandle register_memory(void* p, std::size_t bytes, MemoryKind kind) {
    if (kind == MemoryKind::device && p) {
      cudaPointerAttributes a{};
      const cudaError_t e = cudaPointerGetAttributes(&a, p);
      if (e != cudaSuccess) (void)cudaGetLastError();
      if (e != cudaSuccess || a.type != cudaMemoryTypeManaged)
        fail("local-device transport: rank {} registers {} bytes at {} as device memory, but it is not CUDA managed memory: the in-process "
             "transport copies with the CPU, so device buffers must come from cudaMallocManaged", rank(), bytes, p);
    }
    return t_.register_memory(p, bytes, MemoryKind::host);
  }
  void deregister_memory(RegionHandle h) { t_.deregister_memory(h); }
  std::vector<std::vector<std::byte>> all_gather(std::span<const std::byte> blob, Deadline d) { return t_.all_gather(blob, d); }
  void prepare(std::span<const TransferOp> ops, Deadline d) { t_.prepare(ops, d); }
  request post(std::span<const TransferOp> ops) { return t_.post(ops); }
  bool test(request& r) { return t_.test(r); }
  void wait(request& r, Deadline d) { t_.wait(r, d); }
  std::size_t wait_any(std::span<request* const> rs, Deadline d) { return t_.wait_any(rs, d); }
  void abort(std::string_view why) noexcept { t_.abort(why); }

 private:
  LocalTransport t_;
};

static_assert(check_transport<LocalDeviceTransport>());

}  // namespace reshard::cuda
