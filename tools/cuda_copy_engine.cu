// The CUDA half of reshard-refit-nccl (reshard_refit.cpp is host code,
// compiled by g++): the executor's device copy engine, built by nvcc.
#include <memory>

#include "reshard/cuda/device_engine.cuh"

std::shared_ptr<reshard::DeviceCopyEngine> make_cuda_copy_engine() {
  return std::make_shared<reshard::cuda::CudaCopyEngine>(reshard::cuda::CudaCopyEngineOptions{});
}
