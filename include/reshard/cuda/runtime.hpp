#pragma once
// Small CUDA runtime helpers shared by the kernels and the NCCL transport:
// plain C++ (no nvcc needed); link CUDA::cudart.
#include <cuda_runtime.h>

#include "../base/error.hpp"

namespace reshard::cuda {

/// Throws reshard::Error naming the call and CUDA's reason.
inline void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) fail("CUDA: {} failed: {} ({})", what, cudaGetErrorName(e), cudaGetErrorString(e));
}

/// GPUs this process sees (0 when there is no driver or no device).
inline int visible_devices() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the "no driver" error
    return 0;
  }
  return n;
}

}  // namespace reshard::cuda
