// The CUDA half of test_cuda_refit (the tests are in cuda_refit.cpp, host
// code compiled by g++): the device copy engine, built by nvcc.
#include <memory>

#include "reshard/cuda/device_engine.cuh"

std::shared_ptr<reshard::DeviceCopyEngine> make_copy_engine() {
  return std::make_shared<reshard::cuda::CudaCopyEngine>(reshard::cuda::CudaCopyEngineOptions{});
}

std::int64_t copy_engine_launches(const reshard::DeviceCopyEngine& e) {
  return dynamic_cast<const reshard::cuda::CudaCopyEngine&>(e).launches();
}
