#pragma once
// reshard::cuda::CudaCopyEngine: the executor's DeviceCopyEngine on one GPU
// (device_engine.hpp). Staging from cudaMalloc (or cudaMallocManaged, for
// transports whose copies run on the CPU, such as the in-process one); the
// descriptors of every batch uploaded once at setup; box copies by the
// batched kernels on the engine's stream, ordered with events, with no host
// synchronization except synchronize() and host_wait(). Compile with nvcc.
#include <cuda_runtime.h>

#include <memory>
#include <vector>

#include "copy_kernels.cuh"
#include "device_engine.hpp"
#include "quantize_kernels.cuh"

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
  }
  ~CudaCopyEngine() override {
    (void)cudaSetDevice(opt_.device);
    (void)cudaStreamSynchronize(opt_.stream);
    for (auto& b : batches_)
      if (b.descriptors) (void)cudaFree(b.descriptors);
    for (cudaEvent_t e : events_)
      if (e) (void)cudaEventDestroy(e);
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

  std::size_t upload(BoxBatch& batch) override {
    check_cuda(cudaSetDevice(opt_.device), "cudaSetDevice");
    Uploaded u;
    u.launch = batch.finish();
    u.count = static_cast<std::int64_t>(batch.boxes().size());
    u.descriptors = copy_to_device(std::as_bytes(batch.boxes()), "box descriptors");
    return keep(u);
  }
  std::size_t upload(QuantScheme scheme, std::span<const QuantTile> tiles) override {
    check_quant_tiles(tiles);
    check_cuda(cudaSetDevice(opt_.device), "cudaSetDevice");
    Uploaded u;
    u.quant = true;
    u.scheme = scheme;
    u.count = static_cast<std::int64_t>(tiles.size());
    u.descriptors = copy_to_device(std::as_bytes(tiles), "quantize tile descriptors");
    return keep(u);
  }
  void release(std::size_t id) noexcept override {
    if (id >= batches_.size() || !batches_[id].live) return;
    if (batches_[id].descriptors) (void)cudaFree(batches_[id].descriptors);  // cudaFree waits for work that reads it
    batches_[id] = Uploaded{};
  }
  void enqueue(std::size_t id) override {
    if (id >= batches_.size() || !batches_[id].live) fail("CudaCopyEngine: enqueue of batch {}, which is not uploaded", id);
    const Uploaded& u = batches_[id];
    if (!u.descriptors) return;
    check_cuda(cudaSetDevice(opt_.device), "cudaSetDevice");
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
    if (static_cast<std::size_t>(slot) >= events_.size()) events_.resize(static_cast<std::size_t>(slot) + 1, nullptr);
    cudaEvent_t& e = events_[static_cast<std::size_t>(slot)];
    if (!e) check_cuda(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate");
    check_cuda(cudaEventRecord(e, stream ? static_cast<cudaStream_t>(stream) : opt_.stream), "cudaEventRecord");
    return e;
  }
  void stream_wait(DeviceEvent e, DeviceStream stream = nullptr) override {
    if (!e) return;
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
  /// Descriptors go to device memory once, at setup, by a synchronous copy
  /// (setup is not on the refit's path).
  static void* copy_to_device(std::span<const std::byte> bytes, const char* what) {
    if (bytes.empty()) return nullptr;
    void* d = nullptr;
    check_cuda(cudaMalloc(&d, bytes.size()), fmt::format("cudaMalloc of {}", what).c_str());
    const cudaError_t e = cudaMemcpy(d, bytes.data(), bytes.size(), cudaMemcpyHostToDevice);
    if (e != cudaSuccess) {
      (void)cudaFree(d);
      check_cuda(e, fmt::format("uploading {}", what).c_str());
    }
    return d;
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
