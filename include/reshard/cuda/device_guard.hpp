#pragma once
// DeviceGuard: makes a CUDA device current for a scope and gives the calling
// thread its own device back at the end (as torch's c10::cuda::CUDAGuard), so
// a library call never leaves a trainer's or inference engine's thread on
// another GPU. Plain C++ (no nvcc needed); link CUDA::cudart.
#include <cuda_runtime.h>

namespace reshard::cuda {

class DeviceGuard {
 public:
  /// device < 0: leaves the current device as it is.
  explicit DeviceGuard(int device) noexcept {
    if (device < 0) return;
    if (cudaGetDevice(&previous_) != cudaSuccess) {
      (void)cudaGetLastError();
      previous_ = -1;
    }
    if (previous_ == device) return;
    if (cudaSetDevice(device) != cudaSuccess) {
      (void)cudaGetLastError();
      return;  // the call that needs the device reports the failure
    }
    switched_ = true;
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;
  ~DeviceGuard() {
    if (switched_ && previous_ >= 0) (void)cudaSetDevice(previous_);
  }

 private:
  int previous_ = -1;
  bool switched_ = false;
};

}  // namespace reshard::cuda
