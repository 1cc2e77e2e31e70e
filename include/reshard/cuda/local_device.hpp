#pragma once
// The in-process transport (transport/local.hpp) for ranks as threads that
// share one GPU: the world moves bytes with cudaMemcpy (device_world_options()),
// so device buffers are plain cudaMalloc memory (managed memory works too).
// Everything else is LocalTransport's. For tests and the device check: real
// multi-GPU refits use the NCCL (or a CUDA-enabled UCX) transport.
//
//   LocalWorld world(ranks, reshard::cuda::device_world_options());
//   world.run([&](LocalTransport& lt) {
//     reshard::cuda::LocalDeviceTransport t(lt);
//     ... Resharder<Layout, LocalDeviceTransport> over device buffers ...
//   });
//
// Plain C++; link CUDA::cudart.
#include <cuda_runtime.h>

#include "../transport/local.hpp"
#include "runtime.hpp"

namespace reshard::cuda {

/// The world's byte mover for device memory, with unified addressing (either
/// side may be device, managed or host memory). Host-driven transport: a
/// completed request means the bytes are there for any stream, so the copy
/// is waited for (a cudaMemcpy between device buffers returns before it is
/// done, and the executor's non-blocking copy stream would not wait for it:
/// seen as wrong elements under compute-sanitizer's racecheck on an H200).
inline void copy_device_bytes(void* to, const void* from, std::size_t bytes) {
  check_cuda(cudaMemcpyAsync(to, from, bytes, cudaMemcpyDefault, cudaStreamPerThread), "cudaMemcpyAsync (local-device transport)");
  check_cuda(cudaStreamSynchronize(cudaStreamPerThread), "cudaStreamSynchronize (local-device transport)");
}

/// LocalWorldOptions for a world whose ranks hold device buffers.
inline LocalWorldOptions device_world_options(LocalWorldOptions o = {}) {
  o.copy = &copy_device_bytes;
  return o;
}

/// LocalTransport whose device regions must be CUDA memory; the rest forwards.
class LocalDeviceTransport : public ForwardingTransport<LocalTransport> {
 public:
  explicit LocalDeviceTransport(LocalTransport t) : ForwardingTransport(t) {
    if (inner().world().options().copy != &copy_device_bytes)
      fail("local-device transport: rank {}: the world copies with the CPU; build it with "
           "LocalWorld(ranks, reshard::cuda::device_world_options())", rank());
  }

  std::string_view name() const { return "local-device"; }

  RegionHandle register_memory(void* p, std::size_t bytes, MemoryKind kind) {
    if (kind == MemoryKind::device && p) {
      cudaPointerAttributes a{};
      const cudaError_t e = cudaPointerGetAttributes(&a, p);
      if (e != cudaSuccess) (void)cudaGetLastError();
      if (e != cudaSuccess || (a.type != cudaMemoryTypeDevice && a.type != cudaMemoryTypeManaged))
        fail("local-device transport: rank {} registers {} bytes at {} as device memory, but CUDA does not know it as device or "
             "managed memory", rank(), bytes, p);
    }
    return inner().register_memory(p, bytes, MemoryKind::host);
  }
};

static_assert(check_transport<LocalDeviceTransport>());

}  // namespace reshard::cuda
