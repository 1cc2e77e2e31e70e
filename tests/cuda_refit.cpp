// Refits with the weights in GPU memory: ranks as threads sharing one GPU
// (cuda::LocalDeviceTransport, whose world moves bytes with cudaMemcpy), the
// executor staging in device memory and packing / unpacking / copying
// locally with the CUDA kernels (cuda::CudaCopyEngine). Buffers are plain
// cudaMalloc memory (host code touching them would fault, not pass), filled
// and read back with explicit copies; every destination element is checked
// after every refit (tests/refit_util.hpp's tags). Suite "gpu": skipped
// without a GPU (tests/cuda_test_main.cpp).
//
// Host code, compiled by g++: only the engine comes from nvcc
// (test_cuda_refit.cu), the way an application keeps its refit code out of
// nvcc (whose front end crashes on some of this TU's host code).
#include <doctest/doctest.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <thread>
#include <mutex>
#include <string>
#include <vector>

#include "quant_cases.hpp"
#include "refit_util.hpp"
#include "reshard/cuda/device_engine.hpp"
#include "reshard/cuda/local_device.hpp"
#include "reshard/cuda/runtime.hpp"

using namespace reshard;
using namespace refit_test;

/// test_cuda_refit.cu (nvcc): a CudaCopyEngine with cudaMalloc staging.
std::shared_ptr<DeviceCopyEngine> make_copy_engine();
std::int64_t copy_engine_launches(const DeviceCopyEngine& e);

namespace {

using refit_test::cut;
using refit_test::one_axis;
using refit_test::tensor;

using refit_test::DeviceOutcome;

/// A host function on a stream: the trainer's step, late.
void CUDART_CB late_step(void*) { std::this_thread::sleep_for(std::chrono::milliseconds(20)); }

/// One rank's buffers of one side in cudaMalloc memory (host code touching
/// them would fault), bound as MemoryKind::device.
struct DeviceSide {
  std::vector<std::byte*> ptrs;
  std::map<std::string, BufferView> views;
  DeviceSide(const Layout& L, const SideMemory& mem) : ptrs(mem.data.size(), nullptr) {
    for (std::size_t b = 0; b < mem.data.size(); ++b) {
      if (!mem.present[b]) continue;
      cuda::check_cuda(cudaMalloc(reinterpret_cast<void**>(&ptrs[b]), std::max<std::size_t>(mem.data[b].size(), 1)), "cudaMalloc");
      BufferView bv = bytes_view(ptrs[b], mem.data[b].size(), static_cast<std::int64_t>(mem.element_bytes[b]));
      bv.memory = MemoryKind::device;
      views[L.local_buffers()[b].name] = bv;
    }
  }
  ~DeviceSide() {
    for (auto* p : ptrs) cudaFree(p);
  }
  DeviceSide(const DeviceSide&) = delete;
  DeviceSide& operator=(const DeviceSide&) = delete;
  void upload(const SideMemory& mem) const {
    for (std::size_t b = 0; b < ptrs.size(); ++b)
      if (ptrs[b]) cuda::check_cuda(cudaMemcpy(ptrs[b], mem.data[b].data(), mem.data[b].size(), cudaMemcpyHostToDevice), "cudaMemcpy up");
  }
  /// Copies back on `stream` (the inference side's), then waits for it.
  void download(SideMemory& mem, cudaStream_t stream) const {
    for (std::size_t b = 0; b < ptrs.size(); ++b)
      if (ptrs[b])
        cuda::check_cuda(cudaMemcpyAsync(mem.data[b].data(), ptrs[b], mem.data[b].size(), cudaMemcpyDeviceToHost, stream), "cudaMemcpyAsync down");
    cuda::check_cuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  }
};

/// The trainer's side of the stream contract: each version's sources are
/// written on a trainer stream after a 20 ms host function (from pinned
/// memory: a pageable copy would make the host wait for the stream); the
/// event after them is the refit's StreamOrder::sources_final.
class LateTrainer {
 public:
  LateTrainer() {
    cuda::check_cuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
    cuda::check_cuda(cudaEventCreateWithFlags(&step_done_, cudaEventDisableTiming), "cudaEventCreate");
  }
  ~LateTrainer() {
    cudaStreamSynchronize(stream_);
    free_pinned();
    cudaEventDestroy(step_done_);
    cudaStreamDestroy(stream_);
  }
  LateTrainer(const LateTrainer&) = delete;
  LateTrainer& operator=(const LateTrainer&) = delete;
  cudaEvent_t write(const SideMemory& sm, const DeviceSide& d) {
    cuda::check_cuda(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");  // the last version's pinned copies are done
    free_pinned();
    pinned_.assign(d.ptrs.size(), nullptr);
    cuda::check_cuda(cudaLaunchHostFunc(stream_, late_step, nullptr), "cudaLaunchHostFunc");
    for (std::size_t b = 0; b < d.ptrs.size(); ++b)
      if (d.ptrs[b]) {
        cuda::check_cuda(cudaMallocHost(reinterpret_cast<void**>(&pinned_[b]), sm.data[b].size()), "cudaMallocHost");
        std::memcpy(pinned_[b], sm.data[b].data(), sm.data[b].size());
        cuda::check_cuda(cudaMemcpyAsync(d.ptrs[b], pinned_[b], sm.data[b].size(), cudaMemcpyHostToDevice, stream_),
                         "cudaMemcpyAsync of the sources on the trainer stream");
      }
    cuda::check_cuda(cudaEventRecord(step_done_, stream_), "cudaEventRecord");
    return step_done_;
  }

 private:
  void free_pinned() {
    for (auto* p : pinned_) cudaFreeHost(p);
    pinned_.clear();
  }
  cudaStream_t stream_ = nullptr;
  cudaEvent_t step_done_ = nullptr;
  std::vector<std::byte*> pinned_;
};

/// A non-blocking stream, destroyed with the object.
struct OwnStream {
  cudaStream_t s = nullptr;
  OwnStream() { cuda::check_cuda(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate"); }
  ~OwnStream() { cudaStreamDestroy(s); }
  OwnStream(const OwnStream&) = delete;
  OwnStream& operator=(const OwnStream&) = delete;
};

/// run_refits (refit_util.hpp) with every buffer copied into device memory
/// and bound as MemoryKind::device. With `streams`, the caller's contract
/// (StreamOrder): each version's sources come from a LateTrainer, the refit
/// gets the trainer's event and returns without waiting for its copies,
/// and the destination is read back on an inference stream that waits for
/// RefitReport::done.
DeviceOutcome run_device_refits(const Layout& src, const Layout& dst, int refits, ResharderOptions opt = {}, bool streams = false) {
  DeviceOutcome out;
  const auto ranks = world_of(src, dst);
  std::mutex m;
  LocalWorld world(ranks, cuda::device_world_options());
  world.run([&](LocalTransport& lt) {
    cuda::LocalDeviceTransport t(lt);
    SideMemory sm = make_side(src, t.rank(), true, 0), dm = make_side(dst, t.rank(), false, 0);
    const DeviceSide sd(src, sm), dd(dst, dm);
    LocalBuffers bufs;
    bufs.src = sd.views;
    bufs.dst = dd.views;
    sd.upload(sm);
    dd.upload(dm);
    auto engine = make_copy_engine();
    ResharderOptions o = opt;
    o.executor.device = engine;
    OwnStream inference;
    LateTrainer trainer;
    {
      Resharder<Layout, cuda::LocalDeviceTransport> r(src, dst, bufs, t, o);
      for (int k = 0; k < refits; ++k) {
        StreamOrder order;
        if (k > 0) {
          write_side(src, sm, true, static_cast<std::uint64_t>(k));
          write_side(dst, dm, false, static_cast<std::uint64_t>(k));
          dd.upload(dm);
          if (!streams) {
            sd.upload(sm);
          } else {
            order.sources_final = trainer.write(sm, sd);
            order.wait = false;
          }
        }
        const RefitReport rep = r.refit(order);
        if (streams) {
          REQUIRE(rep.done != nullptr);
          cuda::check_cuda(cudaStreamWaitEvent(inference.s, static_cast<cudaEvent_t>(rep.done), 0), "cudaStreamWaitEvent");
        }
        dd.download(dm, inference.s);
        out.add(m, k, rep, dst, dm, t.rank());
      }
    }
    std::lock_guard lk(m);
    out.launches += copy_engine_launches(*engine);
  });
  return out;
}

/// quant_cases' refit on the GPU: every rank's buffers in device memory, the
/// sources written late by a LateTrainer, the refit returning without
/// waiting, the destination read back after `done` on an inference stream.
void gpu_quant_refit(const quant_cases::Case& k, const std::vector<std::int64_t>& ranks, std::vector<SideMemory>& smem,
                     std::vector<SideMemory>& dmem) {
  LocalWorld world(ranks, cuda::device_world_options());
  world.run([&](LocalTransport& lt) {
    cuda::LocalDeviceTransport t(lt);
    const std::size_t i = index_of(ranks, t.rank());
    SideMemory garbage = smem[i];
    for (auto& b : garbage.data) std::fill(b.begin(), b.end(), std::byte{0x5A});
    const DeviceSide sd(k.src, smem[i]), dd(k.dst, dmem[i]);
    sd.upload(garbage);  // until the trainer's late write
    dd.upload(dmem[i]);
    LocalBuffers bufs;
    bufs.src = sd.views;
    bufs.dst = dd.views;
    ResharderOptions o;
    o.executor.device = make_copy_engine();
    o.executor.zero_copy_min = 1;  // every contiguous run sent straight from the FP8 shadow
    OwnStream inference;
    LateTrainer trainer;
    Resharder<Layout, cuda::LocalDeviceTransport> r(k.src, k.dst, bufs, t, o);
    StreamOrder order;
    order.sources_final = trainer.write(smem[i], sd);
    order.wait = false;
    const RefitReport rep = r.refit(order);
    if (!rep.done) throw std::runtime_error("a refit with wait = false gave no `done` event");
    cuda::check_cuda(cudaStreamWaitEvent(inference.s, static_cast<cudaEvent_t>(rep.done), 0), "cudaStreamWaitEvent");
    dd.download(dmem[i], inference.s);
  });
}

std::vector<TensorSpec> model(bool split_second) {
  return {tensor("w", {64, 96}, {cut(2), {}}, DType::f32),
          tensor("b", {1000}, {cut(2)}, DType::bf16),
          tensor("e", {12, 10, 8}, {{}, {}, split_second ? cut(2) : DimSpec{}}, DType::bf16),
          tensor("big", {512, 256}, {cut(2), {}}, DType::f32),
          tensor("emb", {300, 24}, {{}, cut(2)}, DType::u8)};
}

}  // namespace

TEST_CASE("device refit tp=2 -> tp=4 (disaggregated): packed, zero-copy and half-staged pieces on the GPU" * doctest::test_suite("gpu")) {
  auto dst_t = model(true);
  for (auto& t : dst_t)
    for (auto& d : t.dims)
      if (!d.axes.empty()) d.axes[0].size = 4;
  // Destination cuts the other dim of w and big: every piece strided on one side.
  dst_t[0].dims = {{}, cut(4)};
  dst_t[3].dims = {cut(4), {}};
  const Layout src = one_axis("tp", 2, 0, model(true)), dst = one_axis("tp", 4, 2, dst_t);
  const auto o = run_device_refits(src, dst, 3);
  INFO(o.first_wrong);
  CHECK(o.wrong == 0);
  CHECK(o.packed > 0);
  CHECK(o.zero_copy > 0);  // big: contiguous row blocks of 128 KiB
  CHECK(o.launches > 0);
}

// (One line: tests/cuda.cmake finds the "gpu" cases by their TEST_CASE line.)
TEST_CASE("device refit, stream order: trainer's event, no wait, the inference stream waits for done" * doctest::test_suite("gpu")) {
  auto dst_t = model(true);
  for (auto& t : dst_t)
    for (auto& d : t.dims)
      if (!d.axes.empty()) d.axes[0].size = 4;
  const Layout src = one_axis("tp", 2, 0, model(true)), dst = one_axis("tp", 4, 0, dst_t);  // colocated: local copies too
  ResharderOptions opt;
  opt.executor.staging_budget = 8192;
  const auto o = run_device_refits(src, dst, 4, opt, true);
  INFO(o.first_wrong);
  CHECK(o.wrong == 0);
  CHECK(o.packed > 0);
  CHECK(o.local > 0);
}

TEST_CASE("device refit into FP8 (block and MXFP8): the CUDA quantizer on senders and receivers matches the reference bitwise" * doctest::test_suite("gpu")) {
  const auto o = quant_cases::check_random_cases(60, gpu_quant_refit);
  CHECK(o.sender > 0);
  CHECK(o.receiver > 0);
}

TEST_CASE("device refit, colocated: local copies run as one kernel batch" * doctest::test_suite("gpu")) {
  auto dst_t = model(false);
  dst_t[0].dims = {{}, cut(2)};
  const Layout src = one_axis("tp", 2, 0, model(true)), dst = one_axis("tp", 2, 0, dst_t);
  ResharderOptions opt;
  opt.executor.staging_budget = 4096;  // many waves through small device staging
  const auto o = run_device_refits(src, dst, 2, opt);
  INFO(o.first_wrong);
  CHECK(o.wrong == 0);
  CHECK(o.local > 0);
}
