#pragma once
// reshard::cuda::CudaCopyEngine: the executor's DeviceCopyEngine on one GPU
// (device_engine.hpp). Staging and descriptors are allocated in setup, never
// in a refit: from the caller's allocator where it gives one (torch's caching
// allocator from Python), else stream-ordered (cudaMallocAsync / cudaFreeAsync
// on the engine's stream: cudaMalloc / cudaFree synchronize the device and can
// deadlock against another communicator's NCCL kernels in flight), or
// cudaMallocManaged for transports whose copies run on the CPU (the
// in-process one). Staging is zeroed and descriptors uploaded on the engine's
// stream (cudaMemsetAsync / cudaMemcpyAsync), never on the legacy default
// stream. Box copies by the batched kernels on the engine's stream, ordered
// with events, with no host synchronization except synchronize() and
// host_wait(). Every call gives the calling thread its own device back
// (DeviceGuard). Compile with nvcc.
#include <cuda_runtime.h>

#include <functional>
#include <memory>
#include <vector>

#include "copy_kernels.cuh"
#include "device_guard.hpp"
#include "device_engine.hpp"
#include "quantize_kernels.cuh"

namespace reshard::cuda {

struct CudaCopyEngineOptions {
  int device = -1;                ///< -1: the current device of the constructing thread
  cudaStream_t stream = nullptr;  ///< nullptr: the engine creates a non-blocking stream
  bool managed_staging = false;   ///< cudaMallocManaged: staging the CPU can also touch
  /// Optional allocator for staging and descriptors (both or neither), called
  /// in setup with the engine's stream: e.g. torch's caching allocator
  /// (raw_alloc_with_stream / raw_delete). Without one: cudaMallocAsync /
  /// cudaFreeAsync on the engine's stream.
  std::function<void*(std::size_t bytes, cudaStream_t stream)> allocate;
  std::function<void(void* p, cudaStream_t stream)> deallocate;
};

class CudaCopyEngine final : public DeviceCopyEngine {
 public:
  explicit CudaCopyEngine(CudaCopyEngineOptions opt = {}) : opt_(std::move(opt)) {
    if (visible_devices() == 0) fail("CudaCopyEngine: no CUDA device is visible");
    if (static_cast<bool>(opt_.allocate) != static_cast<bool>(opt_.deallocate))
      fail("CudaCopyEngine: an allocator needs both allocate and deallocate (or neither)");
    if (opt_.managed_staging && opt_.allocate) fail("CudaCopyEngine: managed_staging and a caller's allocator exclude each other");
    if (opt_.device < 0) check_cuda(cudaGetDevice(&opt_.device), "cudaGetDevice");
    const DeviceGuard guard(opt_.device);
    check_current(opt_.device);
    if (!opt_.stream) {
      check_cuda(cudaStreamCreateWithFlags(&opt_.stream, cudaStreamNonBlocking), "cudaStreamCreate");
      own_stream_ = true;
    }
  }
  ~CudaCopyEngine() override {
    const DeviceGuard guard(opt_.device);
    for (auto& b : batches_)
      if (b.descriptors) free_device(b.descriptors);
    (void)cudaStreamSynchronize(opt_.stream);
    for (cudaEvent_t e : events_)
      if (e) (void)cudaEventDestroy(e);
    if (own_stream_) (void)cudaStreamDestroy(opt_.stream);
  }
  CudaCopyEngine(const CudaCopyEngine&) = delete;
  CudaCopyEngine& operator=(const CudaCopyEngine&) = delete;

  std::byte* allocate_staging(std::size_t bytes) override {
    const DeviceGuard guard(opt_.device);
    void* p = nullptr;
    if (opt_.managed_staging) {
      check_cuda(cudaMallocManaged(&p, bytes), "cudaMallocManaged of device staging");
    } else {
      p = allocate_device(bytes, "device staging");
    }
    // On the engine's stream, which every pack and unpack follows.
    check_cuda(cudaMemsetAsync(p, 0, bytes, opt_.stream), "cudaMemsetAsync of device staging");
    // Setup, not a refit: wait here, so that any stream (a transport's, the
    // CPU for managed staging) may use the staging next.
    check_cuda(cudaStreamSynchronize(opt_.stream), "zeroing device staging");
    return static_cast<std::byte*>(p);
  }
  void free_staging(std::byte* p) noexcept override {
    if (!p) return;
    const DeviceGuard guard(opt_.device);
    if (opt_.managed_staging) {
      (void)cudaStreamSynchronize(opt_.stream);
      (void)cudaFree(p);  // managed memory: host-driven transports only, never with NCCL in flight
      return;
    }
    free_device(p);  // stream-ordered: after every pack and unpack enqueued on it
  }

  std::size_t upload(BoxBatch& batch) override {
    const DeviceGuard guard(opt_.device);
    Uploaded u;
    u.launch = batch.finish();
    u.count = static_cast<std::int64_t>(batch.boxes().size());
    u.descriptors = copy_to_device(std::as_bytes(batch.boxes()), "box descriptors");
    return keep(u);
  }
  std::size_t upload(QuantScheme scheme, std::span<const QuantTile> tiles) override {
    check_quant_tiles(tiles);
    const DeviceGuard guard(opt_.device);
    Uploaded u;
    u.quant = true;
    u.scheme = scheme;
    u.count = static_cast<std::int64_t>(tiles.size());
    u.descriptors = copy_to_device(std::as_bytes(tiles), "quantize tile descriptors");
    return keep(u);
  }
  void release(std::size_t id) noexcept override {
    if (id >= batches_.size() || !batches_[id].live) return;
    const DeviceGuard guard(opt_.device);
    if (batches_[id].descriptors) free_device(batches_[id].descriptors);  // stream-ordered: after the kernels that read it
    batches_[id] = Uploaded{};
  }
  void enqueue(std::size_t id) override {
    if (id >= batches_.size() || !batches_[id].live) fail("CudaCopyEngine: enqueue of batch {}, which is not uploaded", id);
    const Uploaded& u = batches_[id];
    if (!u.descriptors) return;
    const DeviceGuard guard(opt_.device);
    if (u.quant) {
      launch_quantize_tiles(u.scheme, static_cast<const QuantTile*>(u.descriptors), u.count, opt_.stream);
    } else {
      launch_box_copies(static_cast<const BoxCopy*>(u.descriptors), u.launch, opt_.stream);
      bytes_ += u.launch.elements * u.launch.in_bytes;
    }
    ++launches_;
  }

  DeviceEvent record(int slot, DeviceStream stream = nullptr) override {
    if (slot < 0) fail("CudaCopyEngine: event slot {} is negative", slot);
    // On the engine's device: events are created there, and cudaStreamLegacy is that device's default stream.
    const DeviceGuard guard(opt_.device);
    if (static_cast<std::size_t>(slot) >= events_.size()) events_.resize(static_cast<std::size_t>(slot) + 1, nullptr);
    cudaEvent_t& e = events_[static_cast<std::size_t>(slot)];
    if (!e) check_cuda(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate");
    check_cuda(cudaEventRecord(e, stream ? static_cast<cudaStream_t>(stream) : opt_.stream), "cudaEventRecord");
    return e;
  }
  void stream_wait(DeviceEvent e, DeviceStream stream = nullptr) override {
    if (!e) return;
    const DeviceGuard guard(opt_.device);
    check_cuda(cudaStreamWaitEvent(stream ? static_cast<cudaStream_t>(stream) : opt_.stream, static_cast<cudaEvent_t>(e), 0),
               "cudaStreamWaitEvent");
  }
  void host_wait(DeviceEvent e) override {
    if (e) check_cuda(cudaEventSynchronize(static_cast<cudaEvent_t>(e)), "cudaEventSynchronize");
  }
  void synchronize() override { check_cuda(cudaStreamSynchronize(opt_.stream), "cudaStreamSynchronize of the copy stream"); }

  cudaStream_t stream() const { return opt_.stream; }
  int device() const { return opt_.device; }
  std::int64_t launches() const { return launches_; }
  std::int64_t bytes() const { return bytes_; }

 private:
  /// A batch's descriptors: box copies or, with `quant`, tiles to quantize.
  struct Uploaded {
    void* descriptors = nullptr;
    std::int64_t count = 0;
    BatchLaunch launch{};
    bool quant = false;
    QuantScheme scheme = QuantScheme::block;
    bool live = false;
  };
  /// Descriptors go to device memory once, at setup, on the engine's stream
  /// (a copy from pageable memory returns once the bytes are staged, so the
  /// host vector may go; the kernels that read them follow on the stream).
  void* copy_to_device(std::span<const std::byte> bytes, const char* what) {
    if (bytes.empty()) return nullptr;
    void* d = allocate_device(bytes.size(), what);
    const cudaError_t e = cudaMemcpyAsync(d, bytes.data(), bytes.size(), cudaMemcpyHostToDevice, opt_.stream);
    if (e != cudaSuccess) {
      free_device(d);
      check_cuda(e, fmt::format("uploading {}", what).c_str());
    }
    return d;
  }
  /// Setup only: the caller's allocator, else cudaMallocAsync on the engine's stream.
  void* allocate_device(std::size_t bytes, const char* what) {
    void* p = nullptr;
    if (opt_.allocate) {
      p = opt_.allocate(bytes, opt_.stream);
      if (!p) fail("CudaCopyEngine: the caller's allocator returned null for {} bytes of {}", bytes, what);
      return p;
    }
    check_cuda(cudaMallocAsync(&p, bytes, opt_.stream), fmt::format("cudaMallocAsync of {} bytes of {}", bytes, what).c_str());
    return p;
  }
  void free_device(void* p) noexcept {
    if (!p) return;
    if (opt_.deallocate) {
      try {
        opt_.deallocate(p, opt_.stream);
      } catch (...) {
      }
      return;
    }
    (void)cudaFreeAsync(p, opt_.stream);
  }
  static void check_current(int device) {
    int now = -1;
    check_cuda(cudaGetDevice(&now), "cudaGetDevice");
    if (now != device) fail("CudaCopyEngine: GPU {} could not be made current (it is GPU {})", device, now);
  }
  std::size_t keep(Uploaded u) {
    for (std::size_t id = 0; id < batches_.size(); ++id)
      if (!batches_[id].live) {
        batches_[id] = u;
        batches_[id].live = true;
        return id;
      }
    u.live = true;
    batches_.push_back(u);
    return batches_.size() - 1;
  }
  CudaCopyEngineOptions opt_;
  bool own_stream_ = false;
  std::vector<Uploaded> batches_;
  std::vector<cudaEvent_t> events_;
  std::int64_t launches_ = 0, bytes_ = 0;
};

}  // namespace reshard::cuda
