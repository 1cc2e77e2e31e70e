#pragma once
// CUDA copy kernels for strided boxes: one launch moves a whole batch of
// copies (pack into staging, unpack from it, or box to box), reading a
// device array of BoxCopy descriptors (cuda/box_batch.hpp holds the
// descriptor, the host reference and the kernel body).
//
//  * Templated on the element word (1, 2, 4, 8, 16 bytes, or a cast such as
//    F32ToBF16) and the box rank (1..4, or any rank read per copy). A batch
//    of mixed element sizes and ranks is lowered to one of each by
//    BoxBatch::finish().
//  * Each block moves 256 threads x 8 units; a unit is 16 bytes (one vector
//    load and store) where both sides are unit-stride and 16-byte aligned,
//    else one element. All of a thread's loads are issued before its stores.
//  * Everything runs on the caller's stream; nothing synchronizes.
//
//   reshard::cuda::BoxCopier copier(stream);
//   reshard::cuda::BoxBatch batch;
//   batch.add(reshard::cuda::pack_copy(dev_weights, offset, rank, extent, stride, 0, n, dev_staging, 2, 2), 2);
//   copier.run(batch);            // one descriptor upload + one kernel, on `stream`
//
// Compile with nvcc (-std=c++20); link CUDA::cudart.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <span>

#include "../base/error.hpp"
#include "box_batch.hpp"
#include "descriptor_upload.hpp"
#include "runtime.hpp"

namespace reshard::cuda {

template <int R, class Cast>
__global__ void __launch_bounds__(batch_detail::kThreads) box_copy_kernel(const BoxCopy* boxes, int n, std::int64_t block0) {
  batch_detail::run_block<R, Cast>(boxes, n, block0 + static_cast<std::int64_t>(blockIdx.x), static_cast<int>(threadIdx.x));
}

/// Launches a finished batch whose descriptors are in device memory.
template <class Cast>
void launch_box_copies(const BoxCopy* device_boxes, const BatchLaunch& l, cudaStream_t stream) {
  if (l.in_bytes != batch_detail::in_bytes<Cast> || l.out_bytes != batch_detail::out_bytes<Cast>)
    fail("box copy: a batch finished for {} -> {} byte elements launched as {} -> {}", l.in_bytes, l.out_bytes,
         batch_detail::in_bytes<Cast>, batch_detail::out_bytes<Cast>);
  if (l.copies == 0 || l.blocks == 0) return;
  constexpr std::int64_t kMaxGrid = 0x7fffffff;
  for (std::int64_t b0 = 0; b0 < l.blocks; b0 += kMaxGrid) {
    const dim3 grid(static_cast<unsigned>(std::min(kMaxGrid, l.blocks - b0)));
    const dim3 block(batch_detail::kThreads);
    switch (l.rank) {
      case 1: box_copy_kernel<1, Cast><<<grid, block, 0, stream>>>(device_boxes, l.copies, b0); break;
      case 2: box_copy_kernel<2, Cast><<<grid, block, 0, stream>>>(device_boxes, l.copies, b0); break;
      case 3: box_copy_kernel<3, Cast><<<grid, block, 0, stream>>>(device_boxes, l.copies, b0); break;
      case 4: box_copy_kernel<4, Cast><<<grid, block, 0, stream>>>(device_boxes, l.copies, b0); break;
      default: box_copy_kernel<0, Cast><<<grid, block, 0, stream>>>(device_boxes, l.copies, b0); break;
    }
  }
  check_cuda(cudaGetLastError(), "launching the box copy kernel");
}

/// Identity launch: the element word is the batch's (BoxBatch::finish()).
inline void launch_box_copies(const BoxCopy* device_boxes, const BatchLaunch& l, cudaStream_t stream) {
  if (!l.identity) fail("box copy: a batch finished with a cast must be launched with that cast");
  switch (l.in_bytes) {
    case 1: launch_box_copies<Identity<1>>(device_boxes, l, stream); return;
    case 2: launch_box_copies<Identity<2>>(device_boxes, l, stream); return;
    case 4: launch_box_copies<Identity<4>>(device_boxes, l, stream); return;
    case 8: launch_box_copies<Identity<8>>(device_boxes, l, stream); return;
    case 16: launch_box_copies<Identity<16>>(device_boxes, l, stream); return;
    default: fail("box copy: a finished batch has element size {}", l.in_bytes);
  }
}

/// Runs batches built on the host: uploads each one's descriptors
/// (DescriptorUpload) and launches it on one stream. For copies replayed
/// every refit the executor uploads once at setup instead (DeviceCopyEngine).
/// Not thread-safe; one per stream.
class BoxCopier {
 public:
  explicit BoxCopier(cudaStream_t stream = nullptr) : upload_(stream) {}

  cudaStream_t stream() const { return upload_.stream(); }

  /// Finishes `batch` (identity copies) and enqueues it. Returns the launch.
  BatchLaunch run(BoxBatch& batch) {
    const BatchLaunch l = batch.finish();
    if (l.blocks > 0) launch_box_copies(upload_.upload(batch.boxes()), l, stream());
    return l;
  }
  /// Finishes `batch` with a cast in flight and enqueues it.
  template <class Cast>
  BatchLaunch run_cast(BoxBatch& batch) {
    const BatchLaunch l = batch.template finish_cast<Cast>();
    if (l.blocks > 0) launch_box_copies<Cast>(upload_.upload(batch.boxes()), l, stream());
    return l;
  }
  void synchronize() { check_cuda(cudaStreamSynchronize(stream()), "cudaStreamSynchronize after box copies"); }

 private:
  DescriptorUpload<BoxCopy> upload_;
};

}  // namespace reshard::cuda
