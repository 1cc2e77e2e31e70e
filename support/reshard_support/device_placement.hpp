#pragma once
// The measured refit (measured_refit.hpp) with every buffer in GPU memory:
// each tagged side gets a cudaMalloc'd mirror of its buffers, bound to the
// Resharder as MemoryKind::device; the tagged values go up before a refit
// and come back after it with explicit copies, outside the timed window, so
// host code never touches what the transport and the kernels move. Plain C++
// (no nvcc); link CUDA::cudart.
#include <cstddef>
#include <map>
#include <string>
#include <vector>

#include "reshard/cuda/runtime.hpp"
#include "verify.hpp"

namespace reshard {

class DevicePlacement {
 public:
  DevicePlacement() = default;
  DevicePlacement(const DevicePlacement&) = delete;
  DevicePlacement& operator=(const DevicePlacement&) = delete;
  ~DevicePlacement() {
    for (const Mirror& m : mirrors_) cudaFree(m.device);
  }

  /// Allocates the side's buffers on the current device and points the
  /// views there.
  void place(const TaggedSide& side, std::map<std::string, BufferView>& views) {
    if (!side.L) return;
    const auto& lbs = side.L->local_buffers();
    for (std::size_t b = 0; b < side.mem.size(); ++b) {
      if (!side.mem[b]) continue;
      const auto bytes = static_cast<std::size_t>(side.bytes[b]);
      void* p = nullptr;
      cuda::check_cuda(cudaMalloc(&p, std::max<std::size_t>(bytes, 1)), "cudaMalloc (a refit buffer's device mirror)");
      mirrors_.push_back({&side, b, p, bytes});
      BufferView& v = views.at(lbs[b].name);
      v.data = p;
      v.memory = MemoryKind::device;
    }
  }
  void upload(const TaggedSide& side) {
    for (const Mirror& m : mirrors_)
      if (m.side == &side) cuda::check_cuda(cudaMemcpy(m.device, side.mem[m.buffer].get(), m.bytes, cudaMemcpyHostToDevice), "cudaMemcpy up");
  }
  void download(TaggedSide& side) {
    for (const Mirror& m : mirrors_)
      if (m.side == &side) cuda::check_cuda(cudaMemcpy(side.mem[m.buffer].get(), m.device, m.bytes, cudaMemcpyDeviceToHost), "cudaMemcpy down");
  }

 private:
  struct Mirror {
    const TaggedSide* side;
    std::size_t buffer;
    void* device;
    std::size_t bytes;
  };
  std::vector<Mirror> mirrors_;
};

}  // namespace reshard
