#pragma once
// Uploads arrays of kernel descriptors (trivially copyable structs) to the
// device on a stream: pinned host buffer -> device buffer, then the launch
// reads them. Stream-ordered: the only host waits are for the previous
// upload to have left the pinned buffer before it is rewritten, and, when
// the buffers grow, for work in flight that may still read the old ones.
// The device buffer is stream-ordered (cudaMallocAsync / cudaFreeAsync):
// no cudaMalloc / cudaFree, which synchronize the whole device.
// Not thread-safe; one per stream. (BoxCopier in copy_kernels.cuh uses it
// for BoxCopy descriptors; the delta and quantize kernels for theirs.)
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <span>
#include <type_traits>

#include "runtime.hpp"

namespace reshard::cuda {

template <class T>
class DescriptorUpload {
  static_assert(std::is_trivially_copyable_v<T>, "descriptors are uploaded as raw bytes");

 public:
  explicit DescriptorUpload(cudaStream_t stream = nullptr) : stream_(stream) {
    check_cuda(cudaEventCreateWithFlags(&uploaded_, cudaEventDisableTiming), "cudaEventCreate");
  }
  DescriptorUpload(const DescriptorUpload&) = delete;
  DescriptorUpload& operator=(const DescriptorUpload&) = delete;
  ~DescriptorUpload() {
    if (dev_ || host_) (void)cudaStreamSynchronize(stream_);
    if (dev_) (void)cudaFreeAsync(dev_, stream_);
    if (host_) (void)cudaFreeHost(host_);
    if (uploaded_) (void)cudaEventDestroy(uploaded_);
  }

  cudaStream_t stream() const { return stream_; }

  /// Enqueues the upload of `items` on the stream; returns their device copy,
  /// valid for work enqueued after it on this stream until the next upload.
  const T* upload(std::span<const T> items) {
    if (items.empty()) return nullptr;
    if (items.size() > capacity_) {
      check_cuda(cudaStreamSynchronize(stream_), "cudaStreamSynchronize before growing the descriptor buffers");
      if (dev_) check_cuda(cudaFreeAsync(dev_, stream_), "cudaFreeAsync of descriptors");
      if (host_) check_cuda(cudaFreeHost(host_), "cudaFreeHost");
      dev_ = nullptr;
      host_ = nullptr;
      const std::size_t cap = std::max<std::size_t>(items.size(), 2 * capacity_);
      capacity_ = 0;
      check_cuda(cudaMallocAsync(reinterpret_cast<void**>(&dev_), cap * sizeof(T), stream_), "cudaMallocAsync of descriptors");
      check_cuda(cudaMallocHost(reinterpret_cast<void**>(&host_), cap * sizeof(T)), "cudaMallocHost of descriptors");
      capacity_ = cap;
    } else {
      check_cuda(cudaEventSynchronize(uploaded_), "waiting for the previous descriptor upload");
    }
    std::memcpy(host_, items.data(), items.size() * sizeof(T));
    check_cuda(cudaMemcpyAsync(dev_, host_, items.size() * sizeof(T), cudaMemcpyHostToDevice, stream_), "uploading descriptors");
    check_cuda(cudaEventRecord(uploaded_, stream_), "cudaEventRecord");
    return dev_;
  }

 private:
  cudaStream_t stream_ = nullptr;
  T* dev_ = nullptr;
  T* host_ = nullptr;
  std::size_t capacity_ = 0;
  cudaEvent_t uploaded_ = nullptr;
};

}  // namespace reshard::cuda
