#pragma once
// The executor's hook for buffers in GPU memory: when a rank's buffers are
// MemoryKind::device, the executor stages in memory this engine allocates
// and packs, unpacks and copies locally through it, one batch (one kernel
// launch) per message group. Plain C++: the executor never needs nvcc; the
// CUDA implementation is reshard::cuda::CudaCopyEngine (device_engine.cuh),
// constructed in a TU that nvcc compiles.
//
//   ExecutorOptions opt;
//   opt.device = std::make_shared<reshard::cuda::CudaCopyEngine>();
#include <cstddef>

#include "box_batch.hpp"

namespace reshard {

class DeviceCopyEngine {
 public:
  virtual ~DeviceCopyEngine() = default;
  /// Staging memory the transport can move (registered as MemoryKind::device).
  virtual std::byte* allocate_staging(std::size_t bytes) = 0;
  virtual void free_staging(std::byte* p) noexcept = 0;
  /// Runs every copy of the batch (device addresses) and returns when they
  /// are done, so that a transport may read what was packed.
  virtual void copy(cuda::BoxBatch& batch) = 0;
};

}  // namespace reshard
