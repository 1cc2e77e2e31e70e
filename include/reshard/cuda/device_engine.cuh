#pragma once
// reshard::cuda::CudaCopyEngine: the executor's DeviceCopyEngine on one GPU
// (device_engine.hpp). Staging from cudaMalloc (or cudaMallocManaged, for
// transports whose copies run on the CPU, such as the in-process one), box
// copies by the batched kernels on the engine's stream, synchronized before
// copy() returns. Compile with nvcc.
#include <cuda_runtime.h>

#include <memory>

#include "copy_kernels.cuh"
#include "device_engine.hpp"

namespace reshard::cuda {

struct CudaCopyEngineOptions {
  int device = -1;                ///< -1: the current device of the constructing thread
  cudaStream_t stream = nullptr;  ///< nullptr: the engine creates a non-blocking stream
  bool managed_staging = false;   ///< cudaMallocManaged: staging the CPU can also touch
};

class CudaCopyEngine final : public DeviceCopyEngine {
 public:
  explicit CudaCopyEngine(CudaCopyEngineOptions opt = {}) : opt_(opt) {
    if (visible_devices() == 0) fail("CudaCopyEngine: no CUDA device is visible");
    if (opt_.device < 0) check_cuda(cudaGetDevice(&opt_.device), "cudaGetDevice");
    check_cuda(cudaSetDevice(opt_.device), "cudaSetDevice");
    if (!opt_.stream) {
      check_cuda(cudaStreamCreateWithFlags(&opt_.stream, cudaStreamNonBlocking), "cudaStreamCreate");
      own_stream_ = true;
    }
    copier_ = std::make_unique<BoxCopier>(opt_.stream);
  }
  ~CudaCopyEngine() override {
    copier_.reset();
    if (own_stream_) (void)cudaStreamDestroy(opt_.stream);
  }
  CudaCopyEngine(const CudaCopyEngine&) = delete;
  CudaCopyEngine& operator=(const CudaCopyEngine&) = delete;

  std::byte* allocate_staging(std::size_t bytes) override {
    check_cuda(cudaSetDevice(opt_.device), "cudaSetDevice");
    void* p = nullptr;
    check_cuda(opt_.managed_staging ? cudaMallocManaged(&p, bytes) : cudaMalloc(&p, bytes), "allocating device staging");
    check_cuda(cudaMemset(p, 0, bytes), "cudaMemset of device staging");
    return static_cast<std::byte*>(p);
  }
  void free_staging(std::byte* p) noexcept override {
    if (!p) return;
    (void)cudaSetDevice(opt_.device);
    (void)cudaStreamSynchronize(opt_.stream);
    (void)cudaFree(p);
  }
  void copy(BoxBatch& batch) override {
    if (batch.empty()) return;
    check_cuda(cudaSetDevice(opt_.device), "cudaSetDevice");
    const BatchLaunch l = copier_->run(batch);
    copier_->synchronize();
    ++launches_;
    bytes_ += l.elements * l.in_bytes;
  }

  cudaStream_t stream() const { return opt_.stream; }
  int device() const { return opt_.device; }
  std::int64_t launches() const { return launches_; }
  std::int64_t bytes() const { return bytes_; }

 private:
  CudaCopyEngineOptions opt_;
  bool own_stream_ = false;
  std::unique_ptr<BoxCopier> copier_;
  std::int64_t launches_ = 0, bytes_ = 0;
};

}  // namespace reshard::cuda
